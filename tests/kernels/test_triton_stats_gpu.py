"""The observer's Triton kernels (kernels/triton_stats.py) on CUDA at realistic sizes, against
stats.py's PyTorch path run on the same CUDA tensors. Skipped without a GPU.

As in test_triton_stats_interp.py, q and k are small integers so that every score is
exact whatever the summation order (tensor cores here, cuBLAS in the reference) and
``eps = 2.5 * scale`` keeps every gap away from the tie boundary: counts equal,
``max_score`` bitwise equal, delta sums to ~1e-4. One test on random normal inputs
(what a model passes) allows the rare row at the boundary.
"""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from instability_watch.kernels import stats  # noqa: E402
from instability_watch.probe.bank import Probe  # noqa: E402
from instability_watch.probe.fields import COUNT_FIELDS, VALUE_FIELDS

from helpers import seeded  # noqa: E402

V_MAXS, V_DSUM, V_DABS = (VALUE_FIELDS.index(n) for n in ("max_score", "delta_err_sum", "delta_err_abs"))
DEV = "cuda"


def _ts():
    from instability_watch.kernels.stats import triton as triton_stats

    return triton_stats


def _inputs(key, B, H, h_kv, N, n_kv, D, dv=None, dtype=torch.bfloat16, lim=3):
    g = seeded("gpu", *key)
    dv = D if dv is None else dv
    q = torch.randint(-lim, lim + 1, (B, H, N, D), generator=g).to(dtype)
    k = torch.randint(-lim, lim + 1, (B, h_kv, n_kv, D), generator=g).to(dtype)
    if n_kv >= 4:
        k[:, :, -1] = k[:, :, 0]  # exact ties, far apart
        k[:, :, n_kv // 2] = k[:, :, 1]
    v = torch.randn(B, h_kv, n_kv, dv, generator=g).to(dtype)
    do = torch.randn(B, H, N, dv, generator=g).to(dtype)
    o = torch.randn(B, H, N, dv, generator=g).to(dtype)
    return tuple(t.to(DEV) for t in (q, k, v, o, do))


def _run(q, k, v, o, do, mask, *, causal, scale, eps=None, exact=True):
    """Both passes of both implementations; returns (triton probe, reference probe)."""
    ts = _ts()
    eps = 2.5 * scale if eps is None else eps
    H = q.shape[1]
    tri, ref = Probe(H, DEV), Probe(H, DEV)
    ts.attention_stats(q, k, mask, o, tri.counts, tri.values, causal=causal, scale=scale, eps=eps)
    stats.stats_reference(q, k, mask, o, ref.counts, ref.values, causal=causal, scale=scale, eps=eps)
    ts.attention_shadow(q, k, v, o, do, mask, tri.counts, tri.values, causal=causal, scale=scale)
    stats.shadow_reference(q, k, v, o, do, mask, ref.counts, ref.values, causal=causal, scale=scale)
    if exact:
        for i, name in enumerate(COUNT_FIELDS):
            assert tri.counts[i].tolist() == ref.counts[i].tolist(), name
        assert torch.equal(tri.values[V_MAXS], ref.values[V_MAXS]), (tri.max_score, ref.max_score)
    mag = (do.float() * o.float()).abs().sum(dim=(0, 2, 3)).nan_to_num(0.0).max().item()
    for row in (V_DSUM, V_DABS):
        torch.testing.assert_close(tri.values[row], ref.values[row], rtol=1e-4, atol=1e-5 * mag + 1e-5, equal_nan=True,
                                   msg=lambda m: f"{VALUE_FIELDS[row]}: {m}")
    return tri, ref


CASES = [
    # (B, H, H_kv, N, N_kv, D, D_v, causal)
    (2, 12, 12, 1024, 1024, 64, 64, True),  # GPT-2
    (2, 12, 12, 1024, 1024, 64, 64, False),
    (1, 32, 4, 2048, 2048, 128, 128, True),  # Llama, GQA 8:1
    (1, 8, 4, 1024, 1024, 256, 256, True),  # Gemma's head dim
    (1, 8, 2, 777, 777, 256, 256, False),
    (2, 4, 2, 1000, 1000, 96, 96, True),  # ragged N, padded head dim
    (2, 4, 1, 515, 515, 80, 80, False),
    (1, 4, 2, 1, 1, 64, 64, True),
    (1, 4, 2, 333, 2048, 64, 64, False),  # cross-attention lengths
    (1, 4, 2, 2048, 333, 64, 64, True),  # causal, N > N_kv
    (1, 4, 4, 600, 600, 128, 64, True),  # D_v != D
]


@pytest.mark.parametrize("B, H, h_kv, N, n_kv, D, dv, causal", CASES)
def test_matches_reference(B, H, h_kv, N, n_kv, D, dv, causal):
    q, k, v, o, do = _inputs(("grid", B, H, N, n_kv, D, dv, causal), B, H, h_kv, N, n_kv, D, dv)
    tri, _ = _run(q, k, v, o, do, None, causal=causal, scale=D ** -0.5)
    assert tri.rows.sum().item() == B * H * N and tri.shadow_rows.sum().item() == B * H * N
    if N > 1:
        assert 0 < tri.multi_max_rows.sum().item() < B * H * N


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_other_dtypes(dtype, D):
    q, k, v, o, do = _inputs(("dtype", dtype, D), 2, 4, 2, 1024, 1024, D, dtype=dtype)
    _run(q, k, v, o, do, None, causal=True, scale=0.125)


def _padding_mask(B, N, n_kv, g):
    lengths = torch.randint(n_kv // 2, n_kv + 1, (B,), generator=g)
    return (torch.arange(n_kv)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, N_kv)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["padding", "window", "bool_heads", "hf_bf16", "f32_heads"])
def test_masks(kind, causal):
    B, H, h_kv, N, D = 2, 8, 2, 1024, 64
    q, k, v, o, do = _inputs(("mask", kind, causal), B, H, h_kv, N, N, D)
    g = seeded("gpu-mask", kind, causal)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    if kind == "padding":
        mask = _padding_mask(B, N, N, g)
    elif kind == "window":  # sliding window (Mistral/Gemma style), (B, 1, N, N); row 3: nothing
        mask = ((j <= i) & (j > i - 256)).expand(B, 1, N, N).clone()
        mask[:, :, 3] = False
    elif kind == "bool_heads":  # (1, H, N, N)
        mask = torch.rand(1, H, N, N, generator=g) < 0.6
        mask[0, :, 7] = False
    elif kind == "hf_bf16":  # HF's additive causal+padding mask under autocast: finfo.min, bf16, (B, 1, N, N)
        keep = (j <= i) & _padding_mask(B, N, N, g)  # (B, 1, N, N)
        mask = torch.zeros(B, 1, N, N).masked_fill(~keep, torch.finfo(torch.bfloat16).min).bfloat16()
    else:  # float32 (1, H, N, N): small exact biases, -inf, fully masked rows
        mask = (torch.randint(-8, 9, (1, H, N, N), generator=g) / 8.0)
        mask = mask.masked_fill(torch.rand(1, H, N, N, generator=g) < 0.3, float("-inf"))
        mask[0, :, 11] = float("-inf")
    tri, ref = _run(q, k, v, o, do, mask.to(DEV), causal=causal, scale=0.125)
    assert (tri.rows + tri.masked_rows).sum().item() == B * H * N


def test_nonfinite_rows_and_noncontiguous_inputs():
    B, H, h_kv, N, D = 2, 8, 4, 1024, 128
    q, k, v, o, do = _inputs(("nonfinite",), B, H, h_kv, N, N, D)
    q[0, 0, 100, 3] = float("nan")
    q[1, 2, 700, 0] = float("inf")
    k[0, 3, 500, 1] = float("nan")  # heads 6, 7 of batch 0: rows >= 500 (causal) see a NaN score
    o[1, 5, 12, 7] = float("inf")
    # (B, N, H, D) storage, as models pass it
    qt, kt, vt, ot, dot = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, o, do))
    for causal in (False, True):
        tri, _ = _run(qt, kt, vt, ot, dot, None, causal=causal, scale=D ** -0.5)
        assert tri.nonfinite_rows.sum().item() > 2


def test_model_like_inputs():
    """Random normal q, k, v and SDPA's own O: counts may differ only where a gap sits within
    rounding of eps (different summation orders); everything else as on exact inputs."""
    B, H, h_kv, N, D = 4, 12, 12, 1024, 64
    g = seeded("gpu-normal")
    q, k, v, do = (torch.randn(B, h, N, D, generator=g).bfloat16().to(DEV) for h in (H, h_kv, h_kv, H))
    q = q * 2  # larger logits: some rows with a dominant key
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    scale = D ** -0.5
    tri, ref = _run(q, k, v, o, do, None, causal=True, scale=scale, eps=1e-3, exact=False)
    for name in ("rows", "tie_rows", "masked_rows", "nonfinite_rows", "shadow_rows"):
        assert getattr(tri, name).tolist() == getattr(ref, name).tolist(), name
    rows = B * N
    assert (tri.multi_max_rows - ref.multi_max_rows).abs().max().item() <= 5 + rows // 5000
    assert (tri.delta_err_pos - ref.delta_err_pos).abs().max().item() <= 5 + rows // 500
    torch.testing.assert_close(tri.max_score, ref.max_score, rtol=2e-6, atol=0)


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
def test_dispatch_runs_triton_without_host_sync(monkeypatch):
    """stats.py sends CUDA tensors to the kernels, and neither pass synchronises with the host."""
    B, H, h_kv, N, D = 2, 4, 2, 512, 64
    q, k, v, o, do = _inputs(("sync",), B, H, h_kv, N, N, D)
    mask = _padding_mask(B, N, N, seeded("sync-mask")).to(DEV)
    probe = Probe(H, DEV)

    def both():
        stats.attention_stats(q, k, mask, o, probe.counts, probe.values, causal=True, scale=0.125, eps=0.3)
        stats.attention_shadow(q, k, v, o, do, mask, probe.counts, probe.values, causal=True, scale=0.125)

    both()  # compiles
    torch.cuda.synchronize()

    def no_reference(*args, **kwargs):
        raise AssertionError("the PyTorch path ran for CUDA tensors")

    monkeypatch.setattr(stats, "stats_reference", no_reference)
    monkeypatch.setattr(stats, "shadow_reference", no_reference)
    torch.cuda.set_sync_debug_mode("error")
    try:
        both()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert probe.rows.sum().item() == 2 * B * H * N and probe.shadow_rows.sum().item() == 2 * B * H * N


@pytest.mark.parametrize("B, H, h_kv, N, D, causal, mask", [
    (2, 12, 12, 1024, 64, True, None),  # GPT-2 with attention dropout
    (1, 8, 4, 777, 256, False, "bool"),
    (1, 4, 2, 600, 128, False, "additive"),
])
def test_shadow_with_dropout_matches_reference(B, H, h_kv, N, D, causal, mask):
    """The shadow of a call with dropout: the Triton pass regenerates the call's keep mask as the reference does."""
    from instability_watch.kernels import dropout_seed

    ts = _ts()
    q, k, v, o, do = _inputs(("dropout", N, D, mask), B, H, h_kv, N, N, D)
    g = seeded("gpu-dropout-mask", N, D)
    m = None
    if mask == "bool":
        m = (torch.rand(B, 1, N, N, generator=g) > 0.3).to(DEV)
    elif mask == "additive":
        m = torch.where(torch.rand(1, H, N, N, generator=g) > 0.3, 0.25, float("-inf")).to(DEV)
    seed = dropout_seed(torch.Generator(DEV).manual_seed(9), DEV)
    tri, ref, plain = Probe(H, DEV), Probe(H, DEV), Probe(H, DEV)
    kw = dict(causal=causal, scale=D ** -0.5, dropout_p=0.1, seed=seed)
    ts.attention_shadow(q, k, v, o, do, m, tri.counts, tri.values, **kw)
    stats.shadow_reference(q, k, v, o, do, m, ref.counts, ref.values, **kw)
    ts.attention_shadow(q, k, v, o, do, m, plain.counts, plain.values, causal=causal, scale=D ** -0.5)
    assert torch.equal(tri.counts, ref.counts)
    mag = (do.float() * o.float()).abs().sum(dim=(0, 2, 3)).max().item()
    for row in (V_DSUM, V_DABS):
        torch.testing.assert_close(tri.values[row], ref.values[row], rtol=1e-4, atol=1e-5 * mag + 1e-5)
    assert not torch.allclose(tri.values[V_DSUM], plain.values[V_DSUM], rtol=1e-3)
