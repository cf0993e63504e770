"""flash-attn 4 (``flash_attn.cute``) in a watched model on the GPU, the real package: training observed and
shadowed with FA4's own outputs unchanged; the statistics those of the same documents; a switched head on our
kernels. Runs where FA4 is importable (benchmarks/fa4_contact.sh installs it on a lent GPU); skipped elsewhere."""
import sys

import pytest
import torch
import torch.nn as nn

from instability_watch import InstabilityWatch, Probe, WatchConfig
from instability_watch.kernels.stats.varlen import VarlenCall, varlen_stats
from instability_watch.model.layer import AttentionLayer

from helpers import seeded

pytestmark = pytest.mark.gpu
cute = pytest.importorskip("flash_attn.cute")
DEV = "cuda"
H, H_KV, D, C = 8, 2, 128, 1024
DOCS = [0, 300, 500, 1024]
LONGEST = max(b - a for a, b in zip(DOCS, DOCS[1:]))


class FA4Attention(nn.Module):
    """Attention through FA4's functions, imported by name before the watch attaches: ``flash_attn_func`` on
    ``x (B, S, C)``, ``flash_attn_varlen_func`` on ``x (T, C)`` with ``cu``."""

    def __init__(self, **call):
        super().__init__()
        self.wq = nn.Linear(C, C, bias=False)
        self.wkv = nn.Linear(C, 2 * H_KV * D, bias=False)
        self.func, self.varlen_func, self.call = cute.flash_attn_func, cute.flash_attn_varlen_func, call

    def qk(self, x):
        lead = x.shape[:-1]
        return self.wq(x).view(*lead, H, D), self.wkv(x).view(*lead, 2, H_KV, D)[..., 0, :, :]

    def forward(self, x, cu=None):
        lead = x.shape[:-1]
        q = self.wq(x).view(*lead, H, D)
        k, v = self.wkv(x).view(*lead, 2, H_KV, D).unbind(-3)
        if cu is None:
            out = self.func(q, k, v, **self.call)
        else:
            out = self.varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=LONGEST, max_seqlen_k=LONGEST,
                                   **self.call)
        return (out[0] if isinstance(out, tuple) else out).reshape(*lead, -1)


def _model(**call):
    torch.manual_seed(0)
    model = FA4Attention(**call).to(DEV, torch.bfloat16)
    g = seeded("fa4_gpu_weights")
    with torch.no_grad():  # sparse small integers: exact scores, many rows tie at their top
        for p in model.parameters():
            w = torch.randint(-1, 2, p.shape, generator=g) * (torch.randint(0, 64, p.shape, generator=g) == 0)
            p.copy_(w.to(DEV, p.dtype))
    return model


def _watch(model, **config):
    layer = AttentionLayer(model, H, lambda: model.wq.weight.view(H, D, C), name="fa4")
    cfg = dict(probe_every=1, shadow_every=1, spectral_every=0, log_every=1, warmup_steps=100, strict=True)
    cfg.update(config)
    metrics = []
    watch = InstabilityWatch(model, WatchConfig(**cfg), layers=[layer], listeners=[lambda r: metrics.extend(r.metrics)])
    return watch, metrics


def _input(varlen):
    g = seeded("fa4_gpu_x", varlen)
    x = torch.randint(-1, 2, (1024, C) if varlen else (2, 512, C), generator=g).to(DEV, torch.bfloat16)
    return x, (torch.tensor(DOCS, dtype=torch.int32, device=DEV) if varlen else None)


@pytest.mark.parametrize("varlen, call", [
    (False, dict(causal=True)),
    (True, dict(causal=True)),
    (True, dict(causal=True, window_size=(128, 0))),
])
def test_training_through_fa4_is_observed_and_shadowed(varlen, call):
    """Three training steps, watched and not: FA4's forward outputs bitwise the same, its gradients as close as
    its own backward repeats; every call observed and shadowed; the statistics those of the packed call's
    documents (the PyTorch path of the statistics, on the same q and k)."""
    x, cu = _input(varlen)
    runs = {}
    for watched in (False, True):
        model = _model(**call)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if watched:
            watch, metrics = _watch(model)
        outs, grads = [], []
        for _ in range(3):
            out = model(x, cu)
            loss = out.float().pow(2).mean()
            loss.backward()
            outs.append(out.detach())
            grads.append(model.wq.weight.grad.detach().clone())
            if watched:
                watch.step(loss)
            opt.zero_grad(set_to_none=True)
        runs[watched] = outs, grads
        if watched:
            (cov,) = watch.coverage()
            assert cov.unobserved_calls == {} and cov.shadow_skipped == {}, (cov.unobserved_calls, cov.shadow_skipped)
            assert cov.observed_calls == 3 and cov.shadow_calls == 3
            watch.detach()
    assert torch.equal(runs[False][0][0], runs[True][0][0])
    for a, b in zip(runs[False][1], runs[True][1]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * a.float().abs().max().item())
    # the first step's statistics against the PyTorch path on the same q, k (the weights before the first update)
    model = _model(**call)
    with torch.no_grad():
        q, k = model.qk(x)
    if not varlen:
        q, k = q.reshape(-1, H, D), k.reshape(-1, H_KV, D)
        cu = torch.tensor([0, 512, 1024], dtype=torch.int32, device=DEV)
    window = call.get("window_size", (-1, 0))
    probe = Probe(H, device=DEV)
    varlen_stats(VarlenCall(q, k, k, cu, cu, True, None, window, False), None, probe.counts, probe.values, eps=1e-3,
                 triton=False)
    first = metrics[0]
    assert first["rows"].tolist()[0] == probe.rows.tolist()
    assert 0 < probe.multi_max_rows.sum()
    assert first["multi_max_rows"].tolist()[0] == probe.multi_max_rows.tolist()
    torch.testing.assert_close(torch.as_tensor(first["max_score"][0]), probe.max_score.double().cpu())
    assert first["shadow_rows"].tolist()[0] == probe.rows.tolist()


def test_a_softcapped_fa4_call_is_unobserved_by_name():
    model = _model(causal=True, softcap=30.0)
    watch, _ = _watch(model, strict=False)
    x, _ = _input(False)
    out = model(x)
    out.float().pow(2).mean().backward()
    watch.step(out.float().pow(2).mean())
    (cov,) = watch.coverage()
    assert list(cov.unobserved_calls) == ["flash_attn_func: softcap (the statistics cannot reproduce it)"]
    watch.detach()


@pytest.mark.parametrize("varlen", [False, True])
def test_a_switched_head_runs_fa4_calls_on_our_kernels_within_twice_fa4_s_error(varlen):
    """A switched layer's FA4 calls on our kernels (stabilized for the switched head): output and gradients
    against float64 within twice FA4's own BF16 error; counted as kernel calls, nothing "not applied"."""
    x, cu = _input(varlen)
    g = seeded("fa4_gpu_switch", varlen)
    x = (torch.randn(x.shape, generator=g) * 0.5).to(DEV, torch.bfloat16)
    errors = {}
    for arm in ("fa4", "switched", "float64"):
        torch.manual_seed(0)
        model = FA4Attention(causal=True).to(DEV, torch.bfloat16)  # float64: the same BF16 weights, widened
        if arm == "float64":
            model = model.double()
            out = _float64_attention(model, x.double(), cu)
        else:
            if arm == "switched":
                watch, _ = _watch(model)
                watch.switch(0, 1)
            out = model(x, cu)
        out.double().pow(2).mean().backward()
        errors[arm] = (out.detach().double(), model.wq.weight.grad.double())
        if arm == "switched":
            watch.step(out.float().pow(2).mean())
            (cov,) = watch.coverage()
            assert cov.kernel_calls == 1 and cov.not_applied == {} and cov.unobserved_calls == {}
            watch.detach()
    ref = errors["float64"]
    for i, name in enumerate(("output", "dW_Q")):
        fa4_err = (errors["fa4"][i] - ref[i]).abs().max().item()
        ours = (errors["switched"][i] - ref[i]).abs().max().item()
        assert ours <= 2 * fa4_err + 1e-6, (name, ours, fa4_err)


def _float64_attention(model, x, cu):
    lead = x.shape[:-1]
    q = model.wq(x).view(*lead, H, D)
    k, v = model.wkv(x).view(*lead, 2, H_KV, D).unbind(-3)
    if cu is None:
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        cu = torch.tensor([0, 512, 1024], device=DEV)
    outs = []
    for d in range(len(cu) - 1):
        sl = slice(int(cu[d]), int(cu[d + 1]))
        s = torch.einsum("nhd,mhd->hnm", q[sl], k[sl].repeat_interleave(H // H_KV, 1)) / D ** 0.5
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=DEV).triu(1), float("-inf"))
        outs.append(torch.einsum("hnm,mhd->nhd", s.softmax(-1), v[sl].repeat_interleave(H // H_KV, 1)))
    return torch.cat(outs).reshape(*lead, -1)


def test_fa4_is_hooked_only_inside_a_watched_forward():
    """During a watched forward FA4's classes hold the watch's handler; after it, and between probe steps, they are
    as they were (the real package's classes)."""
    interface = sys.modules["flash_attn.cute.interface"]
    model = _model(causal=True)
    seen = []
    call = model.func
    model.func = lambda *a, **k: (seen.append("apply" in interface.FlashAttnFunc.__dict__), call(*a, **k))[1]
    watch, _ = _watch(model, probe_every=2, shadow_every=2)
    x, _ = _input(False)
    for _ in range(3):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        watch.step(loss)
        assert "apply" not in interface.FlashAttnFunc.__dict__
        assert "apply" not in interface.FlashAttnVarlenFunc.__dict__
    assert seen == [True, False, True]
    watch.detach()


def test_hf_llama_on_flash_attention_4_trains_watched():
    """Hugging Face's own FA4 integration (``attn_implementation="flash_attention_4"``, which calls flash_attn.cute)
    on a packed batch as DataCollatorWithFlattening packs it: three training steps, every call observed and
    shadowed; the first step's statistics those of the same weights on sdpa (rows equal, multi-max rows and max
    logits within the statistics passes' float32 summation order)."""
    t = pytest.importorskip("transformers")
    available = getattr(t.utils, "is_flash_attn_4_available", None)
    if available is None or not available():
        pytest.skip(f"transformers {t.__version__} has no flash_attention_4, or does not find flash-attn 4")
    lengths = (300, 200, 524)
    g = seeded("hf_fa4_gpu")
    ids = torch.randint(1, 256, (1, sum(lengths)), generator=g).to(DEV)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(DEV)
    cu = torch.tensor([0, 300, 500, 1024], dtype=torch.int32, device=DEV)
    batch = dict(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=524,
                 max_length_k=524, use_cache=False)
    firsts = {}
    for impl in ("sdpa", "flash_attention_4"):
        cfg = t.LlamaConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, hidden_size=1024,
                            intermediate_size=2048, vocab_size=256, max_position_embeddings=2048, bos_token_id=0,
                            eos_token_id=0)
        torch.manual_seed(0)
        model = t.LlamaForCausalLM._from_config(cfg, attn_implementation=impl, dtype=torch.bfloat16).to(DEV)
        metrics = []
        watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=1, spectral_every=0, log_every=1,
                                                    warmup_steps=100, strict=True),
                                 listeners=[lambda r: metrics.extend(r.metrics)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model.train()
        for _ in range(3):
            loss = model(**batch, labels=ids).loss
            loss.backward()
            watch.step(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        coverage = watch.coverage()
        assert [c.unobserved_calls for c in coverage] == [{}, {}], impl
        assert [(c.observed_calls, c.shadow_calls) for c in coverage] == [(3, 3), (3, 3)], impl
        assert torch.isfinite(loss)
        watch.detach()
        firsts[impl] = metrics[0]
    sdpa, fa4 = firsts["sdpa"], firsts["flash_attention_4"]
    assert fa4["rows"].tolist() == sdpa["rows"].tolist()
    assert abs(fa4["multi_max_rows"] - sdpa["multi_max_rows"]).max() <= 0.02 * sdpa["rows"].max()
    torch.testing.assert_close(torch.as_tensor(fa4["max_score"]), torch.as_tensor(sdpa["max_score"]), rtol=2e-2,
                               atol=2e-2)
