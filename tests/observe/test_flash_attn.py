"""flash-attn 4's functions (``flash_attn.cute``) in a watched layer: observed through the CPU stand-in of
tests/fa4_cpu.py (FA4's argument names and order, float32 math). The real package runs in
test_flash_attn_gpu.py."""
import pytest
import torch
import torch.nn as nn

from instability_watch import InstabilityWatch, Probe, WatchConfig
from instability_watch.kernels.stats import attention_stats
from instability_watch.kernels.stats.varlen import VarlenCall, varlen_stats
from instability_watch.model.layer import AttentionLayer
from instability_watch.observe import flash_attn as fa_observe

import fa4_cpu
from helpers import seeded

EPS = 1e-3


@pytest.fixture
def cute(monkeypatch):
    return fa4_cpu.install(monkeypatch)


class FA4Attention(nn.Module):
    """Self-attention through FA4's functions, as a user's module calls them: imported by name before the watch
    attaches. ``x``: (B, S, C) for ``flash_attn_func``; (T, C) with ``cu`` for ``flash_attn_varlen_func``."""

    def __init__(self, cute, dim=64, heads=4, kv_heads=2, **call):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.func, self.varlen_func, self.call = cute.flash_attn_func, cute.flash_attn_varlen_func, call
        self.hooked = []  # per forward: whether FA4's autograd functions were hooked while it ran

    def forward(self, x, cu=None):
        self.hooked.append("apply" in fa4_cpu.FlashAttnFunc.__dict__)
        lead = x.shape[:-1]
        q = self.wq(x).view(*lead, self.heads, self.hd)
        k, v = self.wkv(x).view(*lead, 2, self.kv_heads, self.hd).unbind(-3)
        if cu is None:
            out, _ = self.func(q, k, v, **self.call)
        else:
            n = int((cu[1:] - cu[:-1]).max())
            out, _ = self.varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n,
                                      **self.call)
        return out.reshape(*lead, -1)

    def qk(self, x):
        lead = x.shape[:-1]
        return self.wq(x).view(*lead, self.heads, self.hd), self.wkv(x).view(*lead, 2, self.kv_heads, self.hd)[..., 0, :, :]


def _integer(model):
    """Sparse weights of -1, 0, 1: with inputs of -1, 0, 1 the scores are exact and many rows tie at their top."""
    g = seeded("fa4_weights")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-1, 2, p.shape, generator=g) * (torch.randint(0, 16, p.shape, generator=g) == 0))
    return model


def _watch(model, **config):
    layer = AttentionLayer(model, 4, lambda: model.wq.weight.view(4, 16, 64), name="fa4")
    cfg = dict(probe_every=1, shadow_every=0, spectral_every=0, log_every=1, warmup_steps=100, strict=True)
    cfg.update(config)
    metrics = []
    watch = InstabilityWatch(model, WatchConfig(**cfg), layers=[layer],
                             listeners=[lambda r: metrics.extend(r.metrics)])
    return watch, metrics


def test_a_batched_call_is_observed_with_sdpa_s_statistics(cute):
    """flash_attn_func, causal, GQA, in train mode under no_grad: observed, nothing unobserved; the statistics
    those of the same q, k through SDPA's statistics pass (causal, the batch's rows one by one)."""
    torch.manual_seed(0)
    model = _integer(FA4Attention(cute, causal=True))
    watch, metrics = _watch(model)
    x = torch.randint(-1, 2, (2, 40, 64), generator=seeded("fa4_batched")).float()
    with torch.no_grad():
        out = model(x)
    watch.step(out.float().pow(2).mean())
    (cov,) = watch.coverage()
    assert cov.unobserved_calls == {} and cov.observed_calls == 1
    q, k = model.qk(x)
    probe = Probe(4)
    attention_stats(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1), None, None, probe.counts,
                    probe.values, causal=True, scale=0.25, eps=EPS)
    assert metrics[0]["rows"].tolist() == [[80] * 4]
    assert metrics[0]["multi_max_rows"].tolist() == [probe.multi_max_rows.tolist()]
    assert 0 < probe.multi_max_rows.sum() and probe.multi_max_rows.max() < 80
    torch.testing.assert_close(torch.as_tensor(metrics[0]["max_score"][0]), probe.max_score.double())
    assert model.hooked == [True] and "apply" not in fa4_cpu.FlashAttnFunc.__dict__
    watch.detach()


def test_a_packed_call_is_observed_document_by_document_and_trained_unchanged(cute):
    """flash_attn_varlen_func over three documents with a sliding window: the statistics those of the packed
    call's documents; training takes the shadow pass and leaves every gradient as without the watch."""
    cu = torch.tensor([0, 30, 52, 80], dtype=torch.int32)
    x = torch.randint(-1, 2, (80, 64), generator=seeded("fa4_packed")).float()
    grads, got = {}, None
    for watched in (False, True):
        torch.manual_seed(0)
        model = _integer(FA4Attention(cute, causal=True, window_size=(9, None)))
        if watched:
            watch, metrics = _watch(model, shadow_every=1, log_every=2)
        loss = model(x, cu).float().pow(2).mean()
        loss.backward()
        grads[watched] = [p.grad.clone() for p in model.parameters()]
        if watched:
            watch.step(loss)
            (cov,) = watch.coverage()
            assert cov.unobserved_calls == {} and cov.shadow_skipped == {}
            assert cov.observed_calls == 1 and cov.shadow_calls == 1
            got = metrics[0]
            with torch.no_grad():
                q, k = model.qk(x)
            watch.detach()
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)
    probe = Probe(4)
    varlen_stats(VarlenCall(q, k, k, cu, cu, True, None, (9, 0), False), None, probe.counts, probe.values, eps=EPS)
    assert got["rows"].tolist() == [probe.rows.tolist()]
    assert got["multi_max_rows"].tolist() == [probe.multi_max_rows.tolist()]
    assert 0 < probe.multi_max_rows.sum() and probe.multi_max_rows.max() < 80
    torch.testing.assert_close(torch.as_tensor(got["max_score"][0]), probe.max_score.double())
    assert got["shadow_rows"].tolist() == [[80] * 4]


@pytest.mark.parametrize("call, named", [
    (dict(softcap=30.0), "softcap"),
    (dict(learnable_sink=torch.zeros(4)), "learnable_sink"),
    (dict(score_mod=lambda score, *index: score), "score_mod"),
])
def test_a_call_the_statistics_cannot_reproduce_is_unobserved_by_name(cute, call, named, caplog):
    """Counted unobserved with the argument's name, said once; the call itself runs as the user made it (with
    ``strict`` the watch raises: it sees nothing of this model's attention)."""
    torch.manual_seed(0)
    model = FA4Attention(cute, causal=True, **call)
    watch, _ = _watch(model, strict=False)
    x = torch.randn(2, 24, 64)
    with torch.no_grad():
        out = model(x)
    watch.step(out.float().pow(2).mean())
    (cov,) = watch.coverage()
    assert cov.observed_calls == 0
    ((reason, n),) = cov.unobserved_calls.items()
    assert reason.startswith("flash_attn_func: ") and named in reason and n == 1
    # the layer's note, then the watch's error (nothing of the model's attention observed: statistics off)
    assert sum(reason in r.getMessage() for r in caplog.records) == 2
    watch.detach()
    with torch.no_grad():
        assert torch.equal(out, model(x))


def test_between_probe_steps_fa4_is_untouched(cute):
    torch.manual_seed(0)
    model = FA4Attention(cute, causal=True)
    watch, _ = _watch(model, probe_every=3)
    x = torch.randn(2, 24, 64)
    for _ in range(4):
        with torch.no_grad():
            out = model(x)
        watch.step(out.float().pow(2).mean())
    assert model.hooked == [True, False, False, True]
    assert "apply" not in fa4_cpu.FlashAttnFunc.__dict__ and "apply" not in fa4_cpu.FlashAttnVarlenFunc.__dict__
    watch.detach()


@pytest.mark.parametrize("varlen", [False, True])
def test_a_switched_head_runs_fa4_calls_on_our_kernels(cute, varlen):
    """After watch.switch, the layer's FA4 calls run on our kernels over the same documents: counted as kernel
    calls, nothing "not applied"; out and lse as FA4's (shapes, values within BF16 rounding); gradients flow."""
    cu = torch.tensor([0, 30, 52, 80], dtype=torch.int32) if varlen else None
    x = torch.randn(*((80,) if varlen else (2, 40)), 64, generator=seeded("fa4_switch", varlen)).to(torch.bfloat16)
    torch.manual_seed(0)
    model = FA4Attention(cute, causal=True, return_lse=True).to(torch.bfloat16)
    lse = {}
    model.func = _keep_lse(model.func, lse, "reference")
    model.varlen_func = _keep_lse(model.varlen_func, lse, "reference")
    with torch.no_grad():
        reference = model(x, cu)
    watch, _ = _watch(model, shadow_every=1, spectral_every=1, log_every=2)
    watch.switch(0, 1)
    model.func = _keep_lse(cute.flash_attn_func, lse, "switched")
    model.varlen_func = _keep_lse(cute.flash_attn_varlen_func, lse, "switched")
    out = model(x, cu)
    out.float().pow(2).mean().backward()
    assert model.wq.weight.grad is not None and torch.isfinite(model.wq.weight.grad).all()
    assert (out - reference).abs().max() <= 2 ** -6 * reference.abs().max()
    assert lse["switched"].shape == lse["reference"].shape
    torch.testing.assert_close(lse["switched"].float(), lse["reference"].float(), rtol=1e-2, atol=1e-2)
    watch.step(out.float().pow(2).mean())
    (cov,) = watch.coverage()
    assert cov.kernel_calls == 1 and cov.not_applied == {} and cov.unobserved_calls == {}
    assert cov.observed_calls == 1 and cov.shadow_calls == 1
    watch.detach()


def _keep_lse(func, into, key):
    def call(*args, **kwargs):
        out, lse = func(*args, **kwargs)
        into[key] = lse.detach()
        return out, lse
    return call


def test_without_fa4_imported_nothing_is_hooked(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, fa_observe.INTERFACE, raising=False)
    assert fa_observe.hook(object()) is None


@pytest.mark.parametrize("strict", [False, True])
def test_a_failure_reading_an_fa4_call_never_breaks_the_user_s_call(cute, monkeypatch, caplog, strict):
    """A failure of the watch's own handling of an FA4 call: the user's output as without the watch, the failure
    reported once and the statistics turned off (``strict``: raised)."""
    def broken(*args, **kwargs):
        raise RuntimeError("reading the call failed")

    monkeypatch.setattr(fa_observe.FlashAttnCall, "parse", broken)
    torch.manual_seed(0)
    model = FA4Attention(cute, causal=True)
    x = torch.randn(2, 24, 64)
    with torch.no_grad():
        want = model(x)
    watch, _ = _watch(model, strict=strict)
    with torch.no_grad():
        if strict:
            with pytest.raises(RuntimeError, match="reading the call failed"):
                model(x)
            assert "apply" not in fa4_cpu.FlashAttnFunc.__dict__  # put back all the same
        else:
            assert torch.equal(model(x), want)
            assert sum("reading the call failed" in r.getMessage() for r in caplog.records) == 1
    watch.detach()


# ----------------------------------------------------------------------------- Hugging Face's flash_attention_4


def _hf_llama(impl):
    """A 2-layer HF Llama; ``flash_attention_4`` set after building (HF checks for FA4 and CUDA when building; at
    run time it imports ``flash_attn.cute``, here the stand-in)."""
    t = pytest.importorskip("transformers")
    cfg = t.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                        intermediate_size=128, vocab_size=64, max_position_embeddings=256, bos_token_id=0,
                        eos_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = t.LlamaForCausalLM(cfg)
    for m in model.modules():
        if hasattr(getattr(m, "config", None), "_attn_implementation"):
            m.config._attn_implementation = impl
    return model


def _hf_probe_step(model, batch):
    metrics = []
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                warmup_steps=100, strict=True),
                             listeners=[lambda r: metrics.extend(r.metrics)])
    model.train()
    with torch.no_grad():
        loss = model(**batch).logits.float().pow(2).mean()
    watch.step(loss)
    coverage = watch.coverage()
    watch.detach()
    return metrics, coverage


@pytest.mark.parametrize("batch_kind", ["rows", "padded", "packed"])
def test_hf_llama_on_flash_attention_4_is_watched_like_sdpa(cute, batch_kind):
    """The same weights through sdpa and through HF's flash_attention_4 (HF's own FA4 integration calling
    flash_attn.cute): 0 calls unobserved, the same per-head statistics. Rows: flash_attn_func; padded: HF
    unpads the rows into flash_attn_varlen_func; packed: three documents in one row as DataCollatorWithFlattening
    packs them (flash_attn_varlen_func over the documents)."""
    g = seeded("hf_fa4", batch_kind)
    ids = torch.randint(1, 64, (2, 96), generator=g)
    if batch_kind == "rows":
        batch = dict(input_ids=ids)
    elif batch_kind == "padded":
        mask = torch.ones(2, 96, dtype=torch.long)
        mask[1, 70:] = 0  # right padding, as a causal LM's collator pads
        batch = dict(input_ids=ids, attention_mask=mask)
    else:
        cu = torch.tensor([0, 40, 70, 96], dtype=torch.int32)
        pos = torch.cat([torch.arange(n) for n in (40, 30, 26)]).unsqueeze(0)
        batch = dict(input_ids=ids[:1], position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=40,
                     max_length_k=40, use_cache=False)
    metrics, coverage = _hf_probe_step(_hf_llama("flash_attention_4"), batch)
    assert [c.unobserved_calls for c in coverage] == [{}, {}]
    assert all(c.observed_calls == 1 for c in coverage)
    fa4 = metrics[0]
    if batch_kind == "padded":
        # HF's FA4 path drops the padded rows (sdpa would count them, with HF's mask giving them keys): the
        # statistics of the two rows' real tokens run one by one on sdpa
        rows = [_hf_probe_step(_hf_llama("sdpa"), dict(input_ids=ids[i:i + 1, :n]))[0][0] for i, n in ((0, 96), (1, 70))]
        sdpa = {name: sum(torch.as_tensor(m[name]) for m in rows) for name in ("rows", "multi_max_rows", "masked_rows")}
        sdpa["max_score"] = torch.stack([torch.as_tensor(m["max_score"]) for m in rows]).amax(dim=0)
        assert sdpa["rows"].tolist() == [[166] * 4] * 2
    else:
        metrics, coverage = _hf_probe_step(_hf_llama("sdpa"), batch)
        assert [c.unobserved_calls for c in coverage] == [{}, {}]
        sdpa = metrics[0]
    for name in ("rows", "multi_max_rows", "masked_rows"):
        assert torch.equal(torch.as_tensor(fa4[name]), torch.as_tensor(sdpa[name])), name
    assert torch.as_tensor(fa4["multi_max_rows"]).sum() > 0
    torch.testing.assert_close(torch.as_tensor(fa4["max_score"]), torch.as_tensor(sdpa["max_score"]),
                               rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- FA4's semantics kept


@pytest.mark.parametrize("causal, window, named", [
    (True, (-1, 0), True),  # FA2's way of saying "causal": FA4 takes the -1 as a bound (every key masked)
    (False, (-1, 0), True),
    (True, (-1, 64), True),
    (False, (-1, -1), False),  # both negative: unbounded, as FA4 reads it
    (True, (None, None), False),
    (False, (16, None), False),
])
def test_fa4_s_window_is_read_as_fa4_reads_it(cute, causal, window, named):
    """A window with one negative side is a bound to FA4, not "unbounded": such a call is counted unobserved by
    name; the others are read as FA4 reads them, with FA4's statistics (the stand-in's mask is FA4's)."""
    torch.manual_seed(0)
    model = _integer(FA4Attention(cute, causal=causal, window_size=window))
    watch, metrics = _watch(model, strict=False)
    x = torch.randint(-1, 2, (2, 40, 64), generator=seeded("fa4_window")).float()
    with torch.no_grad():
        out = model(x)
    watch.step(out.float().pow(2).mean())
    (cov,) = watch.coverage()
    if named:
        ((reason, _),) = cov.unobserved_calls.items()
        assert "window_size" in reason and "one side negative" in reason
    else:
        assert cov.unobserved_calls == {} and cov.observed_calls == 1
        q, k = model.qk(x)
        left = -1 if window[0] is None or window[0] < 0 else window[0]
        right = 0 if causal else (-1 if window[1] is None or window[1] < 0 else window[1])
        probe = Probe(4)
        cu = torch.tensor([0, 40, 80], dtype=torch.int32)
        varlen_stats(VarlenCall(q.reshape(80, 4, 16), k.reshape(80, 2, 16), k.reshape(80, 2, 16), cu, cu,
                                causal, None, (left, right), False), None, probe.counts, probe.values, eps=EPS)
        assert metrics[0]["rows"].tolist() == [probe.rows.tolist()]
        assert metrics[0]["multi_max_rows"].tolist() == [probe.multi_max_rows.tolist()]
    watch.detach()


class CrossFA4(nn.Module):
    """Packed cross-attention through flash_attn_varlen_func: documents of 10 queries over 4 keys, causal, so the
    first 6 queries of each document see no key (bottom-right alignment)."""

    def __init__(self, cute):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(64, 64, bias=False) for _ in range(3))
        self.func = cute.flash_attn_varlen_func
        self.lse = None

    def forward(self, x, y):
        q, k, v = self.wq(x).view(-1, 4, 16), self.wk(y).view(-1, 4, 16), self.wv(y).view(-1, 4, 16)
        cu_q = torch.tensor([0, 10, 20], dtype=torch.int32)
        cu_k = torch.tensor([0, 4, 8], dtype=torch.int32)
        out, self.lse = self.func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, return_lse=True)
        return out.reshape(-1, 64)


def test_a_switched_call_gives_fa4_s_lse_for_rows_without_keys(cute):
    torch.manual_seed(0)
    model = CrossFA4(cute)
    g = seeded("fa4_cross")
    x, y = torch.randn(20, 64, generator=g), torch.randn(8, 64, generator=g)
    with torch.no_grad():
        want = model(x, y)
    want_lse = model.lse
    layer = AttentionLayer(model, 4, lambda: model.wq.weight.view(4, 16, 64), name="cross")
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                warmup_steps=100, strict=True), layers=[layer])
    watch.switch(0, 1)
    with torch.no_grad():
        got = model(x, y)
    assert torch.isneginf(want_lse).sum() == 4 * 12  # 6 rows a document, 4 heads
    assert torch.equal(torch.isneginf(model.lse), torch.isneginf(want_lse))
    live = torch.isfinite(want_lse)
    torch.testing.assert_close(model.lse[live], want_lse[live], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    watch.step(got.pow(2).mean())
    (cov,) = watch.coverage()
    assert cov.kernel_calls == 1 and cov.not_applied == {} and cov.unobserved_calls == {}
    watch.detach()


def test_fa4_returns_an_lse_when_fa4_would(cute):
    """Switched or not, the lse is there when asked for or when an input requires grad, else None (as FA4)."""
    torch.manual_seed(0)
    model = FA4Attention(cute, causal=True)
    seen = []
    model.func = _keep_lse_or_none(cute.flash_attn_func, seen)
    x = torch.randn(2, 24, 64)
    watch, _ = _watch(model)
    for switched in (False, True):
        if switched:
            watch.switch(0, 1)
        with torch.no_grad():
            model(x)
        model(x)
    assert seen == [False, True, False, True]
    watch.detach()


def _keep_lse_or_none(func, seen):
    def call(*args, **kwargs):
        out, lse = func(*args, **kwargs)
        seen.append(lse is not None)
        return out, lse
    return call


def test_hooks_of_nested_forwards_and_of_threads_end_with_fa4_as_it_was(cute):
    """Two observers in one context (a watched module inside another) and two threads hooking and unhooking out
    of order: each call goes to the observer of its own context, none after its forward ended, and FA4's classes
    are as they were once the last forward ends."""
    import threading

    calls = []

    class Observer:
        def __init__(self, name):
            self.name = name

    def record(observer, apply, function, signature, *args, **kwargs):
        calls.append(observer.name)
        return apply(*args, **kwargs)

    q = torch.randn(1, 8, 4, 16)
    original = fa_observe.observed_call
    fa_observe.observed_call = record
    try:
        outer = fa_observe.hook(Observer("outer"))
        inner = fa_observe.hook(Observer("inner"))
        cute.flash_attn_func(q, q, q)
        fa_observe.unhook(inner)
        cute.flash_attn_func(q, q, q)
        a_hooked, b_hooked, a_done = threading.Event(), threading.Event(), threading.Event()

        def thread_a():
            token = fa_observe.hook(Observer("a"))
            a_hooked.set()
            b_hooked.wait()
            fa_observe.unhook(token)  # before b's unhook
            cute.flash_attn_func(q, q, q)  # after its forward: not observed
            a_done.set()

        def thread_b():
            a_hooked.wait()
            token = fa_observe.hook(Observer("b"))
            b_hooked.set()
            a_done.wait()
            cute.flash_attn_func(q, q, q)
            fa_observe.unhook(token)

        threads = [threading.Thread(target=f) for f in (thread_a, thread_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert "apply" in fa4_cpu.FlashAttnFunc.__dict__  # the outer forward still runs
        fa_observe.unhook(outer)
    finally:
        fa_observe.observed_call = original
    assert calls == ["inner", "outer", "b"]
    assert "apply" not in fa4_cpu.FlashAttnFunc.__dict__ and "apply" not in fa4_cpu.FlashAttnVarlenFunc.__dict__


def test_fa4_in_a_compiled_forward_is_said_once_not_silently_missed(cute):
    """A watched layer compiled whole (torch.compile on the model): Dynamo traces FA4's call, not the handler, so
    it is not observed; the watch says so at the first probe step (strict: raises), instead of waiting forever."""
    from instability_watch.errors import NothingObservedError

    for strict in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = FA4Attention(cute, causal=True)
        watch, _ = _watch(model, strict=strict)
        compiled = torch.compile(model, backend="eager")
        out = compiled(torch.randn(2, 24, 64))
        if strict:
            with pytest.raises(NothingObservedError, match="ran compiled .*flash-attn 4's functions are seen in eager"):
                watch.step(out.float().pow(2).mean())
        else:
            watch.step(out.float().pow(2).mean())
            assert "statistics" in watch.faults
        watch.detach()
