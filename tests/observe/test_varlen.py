"""Packed calls of torch.nn.attention.varlen.varlen_attn: statistics document by document, and the call observed
in a watched model.

The CPU build of PyTorch has no kernel for varlen_attn's op (it raises NotImplementedError): this module
registers a reference CPU kernel for it (attention per document, in float32), so that the watch's handling of
the call runs here as it does on the GPU."""
import pytest
import torch
import torch.nn as nn

from instability_watch import Probe
from instability_watch.kernels.stats.varlen import VARLEN_OP, VarlenCall, documents, varlen_stats

from helpers import count_document_searches, seeded
from varlen_cpu import NAMES, visible as _visible  # registers the CPU kernel

if VARLEN_OP is None:
    pytest.skip("this PyTorch has no torch.nn.attention.varlen", allow_module_level=True)
from torch.nn.attention.varlen import varlen_attn  # noqa: E402

EPS = 1e-3


def _reference(q, k, cu_q, cu_k, causal, window, scale):
    """rows, multi-max rows, max score per head: document by document in float64; rows past the last document
    counted nowhere."""
    H, g = q.shape[1], q.shape[1] // k.shape[1]
    rows = torch.zeros(H, dtype=torch.int64)
    multi = torch.zeros(H, dtype=torch.int64)
    masked = torch.zeros(H, dtype=torch.int64)
    top = torch.full((H,), float("-inf"), dtype=torch.float64)
    for d in range(len(cu_q) - 1):
        qd = q[cu_q[d]:cu_q[d + 1]].double()
        kd = k[cu_k[d]:cu_k[d + 1]].double().repeat_interleave(g, 1)
        s = torch.einsum("nhd,mhd->hnm", qd, kd) * scale
        s = s.masked_fill(~_visible(s.shape[1], s.shape[2], causal, window), float("-inf"))
        top2 = s.topk(min(2, s.shape[-1]), dim=-1).values
        t1 = top2[..., 0]
        t2 = top2[..., 1] if s.shape[-1] > 1 else torch.full_like(t1, float("-inf"))
        live = ~torch.isneginf(t1)
        rows += live.sum(-1)
        masked += (~live).sum(-1)
        multi += (live & (t2 >= t1 - EPS)).sum(-1)
        top = torch.maximum(top, torch.where(live, t1, float("-inf")).amax(-1))
    return rows, multi, masked, top


@pytest.mark.parametrize("case", ["causal", "window", "cross_lengths", "tail"])
def test_varlen_statistics_equal_a_float64_reference_per_document(case):
    g = seeded("varlen", case)
    H, h_kv, D = 4, 2, 16
    cu_q = [0, 37, 50, 96]
    cu_k = [0, 40, 61, 96] if case == "cross_lengths" else cu_q
    t_q = cu_q[-1] + (7 if case == "tail" else 0)  # rows past the last document
    q = torch.randint(-2, 3, (t_q, H, D), generator=g).float()
    k = torch.randint(-2, 3, (cu_k[-1], h_kv, D), generator=g).float()
    v = torch.randn(cu_k[-1], h_kv, D, generator=g)
    causal = case != "window"
    window = (9, 3) if case == "window" else (-1, 0)
    call = VarlenCall(q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                      causal, 0.25, window, False)
    assert call.unobservable(H) is None
    probe = Probe(H)
    varlen_stats(call, None, probe.counts, probe.values, eps=EPS)
    rows, multi, masked, top = _reference(q, k, cu_q, cu_k, causal, window, 0.25)
    assert torch.equal(probe.rows, rows) and torch.equal(probe.masked_rows, masked)
    assert torch.equal(probe.multi_max_rows, multi)
    assert multi.min() > 0 and (multi < rows).all()
    torch.testing.assert_close(probe.max_score.double(), top)


def test_documents_are_found_on_the_device_without_a_host_loop():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    doc_q, pos_q, doc_k, pos_k = documents(cu, torch.tensor([0, 4, 5], dtype=torch.int32), 6, 5)
    assert doc_q.tolist() == [0, 0, 0, 1, 1, 2]  # row 5: past the last document
    assert pos_q[:5].tolist() == [1, 2, 3, -1, 0]  # bottom-right: document 0 has 4 keys for 3 rows
    assert doc_k.tolist() == [0, 0, 0, 0, 1] and pos_k.tolist() == [0, 1, 2, 3, 0]


def test_paged_calls_are_unobservable_by_name():
    q = torch.zeros(4, 2, 8)
    call = VarlenCall(q, q, q, torch.tensor([0, 4]), None, True, None, (-1, 0), True)
    assert "paged" in call.unobservable(2)


# ----------------------------------------------------------------------------- a watched packed model


class PackedAttention(nn.Module):
    """Self-attention over a packed batch (T, C), as torchtitan's varlen wrapper calls it."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)

    def forward(self, x, cu, max_len):
        T = x.shape[0]
        q = self.wq(x).view(T, self.heads, self.hd)
        k, v = self.wkv(x).view(T, 2, self.kv_heads, self.hd).unbind(1)
        if "window_size" in NAMES:
            o = varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), enable_gqa=True)
        else:  # pragma: no cover - PyTorch 2.10's signature
            o = varlen_attn(q, k, v, cu, cu, max_len, max_len, is_causal=True)
        return o.reshape(T, -1)


def test_a_watched_packed_model_shows_no_unobserved_call():
    from instability_watch import InstabilityWatch, WatchConfig
    from instability_watch.model.layer import AttentionLayer

    torch.manual_seed(0)
    model = PackedAttention()
    layer = AttentionLayer(model, 4, lambda: model.wq.weight.view(4, 16, 64), name="packed")
    metrics = []
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                warmup_steps=100, strict=True),
                             layers=[layer], listeners=[lambda r: metrics.extend(r.metrics)])
    cu = torch.tensor([0, 30, 52, 80], dtype=torch.int32)
    x = torch.randn(80, 64, generator=seeded("packed_model"))
    with torch.no_grad():
        out = model(x, cu, 30)
    watch.step(out.float().pow(2).mean())
    (cov,) = watch.coverage()
    assert cov.unobserved_calls == {} and cov.observed_calls == 1
    assert metrics[0]["rows"].tolist() == [[80] * 4]
    # the statistics are those of the documents: the same as varlen_stats on the call's own q, k
    probe = Probe(4)
    q = model.wq(x).view(80, 4, 16)
    k = model.wkv(x).view(80, 2, 2, 16)[:, 0]
    varlen_stats(VarlenCall(q, k, k, cu, cu, True, None, (-1, 0), False), None, probe.counts, probe.values, eps=1e-3)
    torch.testing.assert_close(torch.as_tensor(metrics[0]["max_score"][0]), probe.max_score.double())
    watch.detach()


def test_varlen_shadow_equals_a_float64_reference_per_document():
    from instability_watch.kernels.stats.varlen import varlen_shadow

    g = seeded("varlen_shadow")
    H, h_kv, D = 4, 2, 16
    cu = [0, 37, 50, 96]
    t_q = 103  # 7 rows past the last document: counted nowhere
    q, k, v = (torch.randn(t_q if i == 0 else 96, H if i == 0 else h_kv, D, generator=g).to(torch.bfloat16)
               for i in range(3))
    o = torch.randn(t_q, H, D, generator=g).to(torch.bfloat16)
    do = torch.randn(t_q, H, D, generator=g).to(torch.bfloat16)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    probe = Probe(H)
    varlen_shadow(VarlenCall(q, k, v, cu_t, cu_t, True, 0.3, (-1, 0), False), o, do, probe.counts, probe.values)
    err = []
    for d in range(3):
        sl = slice(cu[d], cu[d + 1])
        n = cu[d + 1] - cu[d]
        s = torch.einsum("nhd,mhd->hnm", q[sl].double(), k[sl].double().repeat_interleave(2, 1)) * 0.3
        p = torch.softmax(s.masked_fill(~_visible(n, n, True, (-1, 0)), float("-inf")), dim=-1)
        dp = torch.einsum("nhd,mhd->hnm", do[sl].double(), v[sl].double().repeat_interleave(2, 1))
        err.append((do[sl].double() * o[sl].double()).sum(-1).T - (p * dp).sum(-1))
    err = torch.cat(err, dim=1)  # (H, rows)
    assert probe.shadow_rows.tolist() == [96] * H
    assert probe.delta_err_pos.tolist() == (err > 0).sum(1).tolist()
    torch.testing.assert_close(probe.delta_err_abs.double(), err.abs().sum(1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(probe.delta_err_sum.double(), err.sum(1), rtol=1e-3, atol=1e-3)


def test_training_a_watched_packed_model_takes_the_shadow_pass():
    """A backward through varlen_attn (the tests' CPU kernels): probe and shadow steps observed, nothing skipped,
    and the model's gradients exactly those of the unwatched model."""
    from instability_watch import InstabilityWatch, WatchConfig
    from instability_watch.model.layer import AttentionLayer

    cu = torch.tensor([0, 30, 52, 80], dtype=torch.int32)
    x = torch.randn(80, 64, generator=seeded("packed_train"))
    grads = {}
    for watched in (False, True):
        torch.manual_seed(0)
        model = PackedAttention()
        if watched:
            layer = AttentionLayer(model, 4, lambda: model.wq.weight.view(4, 16, 64), name="packed")
            watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=1, spectral_every=1, log_every=2,
                                                        warmup_steps=100, strict=True), layers=[layer])
        loss = model(x, cu, 30).float().pow(2).mean()
        loss.backward()
        grads[watched] = [p.grad.clone() for p in model.parameters()]
        if watched:
            watch.step(loss)
            (cov,) = watch.coverage()
            assert cov.unobserved_calls == {} and cov.shadow_skipped == {}
            assert cov.observed_calls == 1 and cov.shadow_calls == 1
            watch.detach()
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


def test_a_step_finds_a_packed_batch_s_documents_once_for_every_layer(monkeypatch):
    """The layers of a step pass the same boundaries: the statistics and shadow passes (the Triton kernels, here on
    the interpreter) of every layer's call use one search for the batch's documents, the shadow pass in the
    backward too; the next step searches again (the watch forgets them)."""
    from instability_watch import InstabilityWatch, WatchConfig
    from instability_watch.kernels import stats as stats_kernels
    from instability_watch.kernels.attention import ops
    from instability_watch.model.layer import AttentionLayer

    made = count_document_searches(monkeypatch)
    monkeypatch.setattr(stats_kernels, "triton_serves", lambda *a: True)
    from instability_watch.kernels.stats import varlen as varlen_module

    found = varlen_module.documents  # the passes' own search, where they do not take the kept documents
    monkeypatch.setattr(varlen_module, "documents", lambda *a: made.append(1) or found(*a))
    torch.manual_seed(0)
    blocks = nn.ModuleList([PackedAttention(), PackedAttention()])
    layers = [AttentionLayer(b, 4, (lambda b=b: b.wq.weight.view(4, 16, 64)), name=f"packed{i}")
              for i, b in enumerate(blocks)]
    watch = InstabilityWatch(blocks, WatchConfig(probe_every=1, spectral_every=0, log_every=1, warmup_steps=100,
                                                 strict=True), layers=layers)
    cu = torch.tensor([0, 30, 52, 80], dtype=torch.int32)
    x = torch.randn(80, 64, generator=seeded("packed_documents_once"))
    for step in range(2):
        loss = blocks[1](blocks[0](x, cu, 30), cu, 30).float().pow(2).mean()
        loss.backward()
        assert len(made) == step + 1  # stats and shadow of both layers: one search a step
        watch.step(loss)
    for cov in watch.coverage():
        assert cov.unobserved_calls == {} and cov.observed_calls == 2 and cov.shadow_calls == 2
    assert not ops._DOCUMENTS
    watch.detach()


def test_the_cpu_kernels_of_the_tests_are_right():
    """The tests' CPU backward of the varlen op against autograd through the same attention, in float64."""
    from varlen_cpu import attend, cpu_varlen_backward

    g = seeded("varlen_cpu_bwd")
    q = torch.randn(40, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(40, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(40, 4, 8, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    got = cpu_varlen_backward(do, q, k, v, None, None, cu, cu, 25, 25, True, None, 0.3, [5, 0])
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    o, _ = attend(qq.double(), kk.double(), vv.double(), [0, 15, 40], [0, 15, 40], True, (5, 0), 0.3)
    want = torch.autograd.grad(o, (qq, kk, vv), do.float())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


def test_a_switched_head_runs_packed_calls_on_our_kernels():
    """After watch.switch, the layer's varlen calls run on our kernels over the same documents (stabilized for the
    switched head): counted as kernel calls, nothing "not applied", the output that of the op within BF16
    rounding, gradients through them; the statistics and shadow pass as before."""
    from instability_watch import InstabilityWatch, WatchConfig
    from instability_watch.model.layer import AttentionLayer

    cu = torch.tensor([0, 30, 52, 80], dtype=torch.int32)
    x = torch.randn(80, 64, generator=seeded("packed_switch")).to(torch.bfloat16)
    torch.manual_seed(0)
    model = PackedAttention().to(torch.bfloat16)
    with torch.no_grad():
        reference = model(x, cu, 30)  # PyTorch's op (the tests' CPU kernel)
    layer = AttentionLayer(model, 4, lambda: model.wq.weight.view(4, 16, 64), name="packed")
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=1, spectral_every=1, log_every=2,
                                                warmup_steps=100, strict=True), layers=[layer])
    watch.switch(0, 1)
    out = model(x, cu, 30)
    out.float().pow(2).mean().backward()
    assert model.wq.weight.grad is not None and torch.isfinite(model.wq.weight.grad).all()
    assert (out - reference).abs().max() <= 2 ** -6 * reference.abs().max()
    watch.step(out.float().pow(2).mean())
    (cov,) = watch.coverage()
    assert cov.kernel_calls == 1 and cov.not_applied == {} and cov.unobserved_calls == {}
    assert cov.observed_calls == 1 and cov.shadow_calls == 1
    watch.detach()
