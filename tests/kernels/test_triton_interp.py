"""The Triton kernels on CPU, through Triton's interpreter (with the BF16 shim), against the reference.

Small sizes on purpose (the interpreter runs one program at a time in numpy);
block sizes are 16 here, so N=37 crosses three KV blocks with a ragged tail.
The same checks at large sizes, and against PyTorch's flash kernel, are in
test_triton_gpu.py.
"""
import math

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("the interpreter tests are for CPU-only machines", allow_module_level=True)

from instability_watch import Probe, flash_attention  # noqa: E402
from instability_watch.kernels.attention.masks import MaskArgs  # noqa: E402
from instability_watch.mechanism import exact_attention, measure_bias, near_tie_inputs  # noqa: E402

from helpers import assert_probe_counts_equal, fused_and_split_backward, max_err, run_fwd_bwd, sdpa_math, seeded  # noqa: E402


def _inputs(key, B, H, h_kv, N, D, dtype=torch.bfloat16, n_kv=None):
    g = seeded(*key)
    n_kv = N if n_kv is None else n_kv
    q, do = (torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, h_kv, n_kv, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v, do


def _with_probe(backend, causal, stabilize):
    def fn(q, k, v):
        probe = Probe(q.shape[1])
        probe.shadow = True
        fn.probe = probe
        return flash_attention(q, k, v, causal=causal, stabilize=stabilize, probe=probe, backend=backend)

    return fn


CASES = [
    # (N, D, causal, (H, H_kv), stabilize)
    *[(37, D, c, (4, 2), s) for D in (32, 64, 128) for c in (False, True) for s in (False, True)],
    (1, 64, False, (2, 2), False),
    (1, 64, True, (2, 1), True),
    (17, 64, True, (2, 2), False),
    (17, 32, False, (4, 4), True),
]


@pytest.mark.parametrize("N, D, causal, heads, stabilize", CASES)
def test_triton_matches_reference(N, D, causal, heads, stabilize):
    H, h_kv = heads
    q, k, v, do = _inputs(("interp", N, D, causal, heads, stabilize), 1, H, h_kv, N, D)
    f64 = run_fwd_bwd(lambda a, b, c: sdpa_math(a, b, c, causal=causal), q, k, v, do, torch.float64)
    pt = run_fwd_bwd(lambda a, b, c: sdpa_math(a, b, c, causal=causal), q, k, v, do, torch.bfloat16)
    tri_fn, ref_fn = _with_probe("triton", causal, stabilize), _with_probe("reference", causal, stabilize)
    tri = run_fwd_bwd(tri_fn, q, k, v, do, torch.bfloat16)
    ref = run_fwd_bwd(ref_fn, q, k, v, do, torch.bfloat16)
    for name, t, r, p, x in zip(["o", "dq", "dk", "dv"], tri, ref, pt, f64):
        assert t.dtype == torch.bfloat16 and t.shape == x.shape, name
        # The accuracy bar, and agreement with the reference to within its own rounding error.
        assert max_err(t, x) <= 2 * max_err(p, x) + 1e-6, (name, max_err(t, x), max_err(p, x))
        assert max_err(t, r) <= 2 * max_err(r, x) + 1e-6, (name, max_err(t, r), max_err(r, x))
    tp, rp = tri_fn.probe, ref_fn.probe
    assert_probe_counts_equal(tp, rp, ("rows", "multi_max_rows", "tie_rows", "nonfinite_rows", "shadow_rows"), rtol=1e-5)
    # The shadow drift from Triton's own O: delta_lp - delta_hp with O_hp in float64.
    err = (do.double() * tri[0].double()).sum(-1) - (do.double() * f64[0]).sum(-1)  # (B, H, N)
    assert torch.allclose(tp.delta_err_sum.double(), err.sum(dim=(0, 2)), atol=2e-4, rtol=1e-3)
    assert torch.allclose(tp.delta_err_abs.double(), err.abs().sum(dim=(0, 2)), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    q, k, v, do = _inputs(("dtypes", dtype), 1, 2, 2, 37, 64, dtype=dtype)
    f64 = run_fwd_bwd(lambda a, b, c: sdpa_math(a, b, c, causal=True), q, k, v, do, torch.float64)
    pt = run_fwd_bwd(lambda a, b, c: sdpa_math(a, b, c, causal=True), q, k, v, do, dtype)
    for stabilize in (False, True):
        tri = run_fwd_bwd(
            lambda a, b, c: flash_attention(a, b, c, causal=True, stabilize=stabilize, backend="triton"),
            q, k, v, do, dtype,
        )
        for t, p, x in zip(tri, pt, f64):
            assert t.dtype == dtype
            assert max_err(t, x) <= 2 * max_err(p, x) + 1e-6


def test_cross_attention_lengths():
    q, k, v, do = _inputs(("cross",), 1, 2, 1, 21, 32, n_kv=45)
    for causal in (False, True):
        fn = lambda a, b, c: sdpa_math(a, b, c, causal=causal, scale=0.4)  # noqa: E731
        f64 = run_fwd_bwd(fn, q, k, v, do, torch.float64)
        pt = run_fwd_bwd(fn, q, k, v, do, torch.bfloat16)
        tri = run_fwd_bwd(
            lambda a, b, c: flash_attention(a, b, c, causal=causal, scale=0.4, backend="triton"), q, k, v, do, torch.bfloat16
        )
        for t, p, x in zip(tri, pt, f64):
            assert max_err(t, x) <= 2 * max_err(p, x) + 1e-6


def test_near_tie_bias_and_fix_in_triton():
    std, stab = [], []
    for seed in range(3):
        inp = near_tie_inputs(batch=1, heads=2, seq=48, generator=seeded("tri-mech", seed))
        std.append(measure_bias(inp, stabilize=False, backend="triton"))
        stab.append(measure_bias(inp, stabilize=True, backend="triton"))
    assert all(r["multi_max_frac"] == 1.0 for r in std + stab)
    assert all(r["o_bias"] < 0 and r["delta_err_sum"] > 0 for r in std)
    mean = lambda rs: sum(r["o_bias"] for r in rs) / len(rs)  # noqa: E731
    assert abs(mean(stab)) * 5 <= abs(mean(std))


def test_extreme_scores_stay_finite_and_accurate():
    g = seeded("tri-huge")
    B, H, N, D = 1, 2, 40, 64
    for sign in (1, -1):
        q = torch.randint(100, 128, (B, H, N, D), generator=g).bfloat16() * sign
        k = torch.randint(101, 127, (B, H, N, D), generator=g).bfloat16()
        k[:, :, [3, 20, 35]] = 127.0 if sign > 0 else 100.0  # repeated maximum ~ +-1e6, three KV blocks
        v = torch.randn(B, H, N, D, generator=g).bfloat16()
        ref = exact_attention(q, k, v, scale=1.0)
        for stabilize in (False, True):
            probe = Probe(H)
            o = flash_attention(q, k, v, scale=1.0, stabilize=stabilize, probe=probe, backend="triton")
            assert torch.isfinite(o).all()
            assert probe.nonfinite_rows.sum() == 0 and probe.multi_max_rows.tolist() == [N, N]
            assert max_err(o, ref) <= 3 * 2 ** -9 * v.abs().max().item()


def test_nonfinite_rows_are_counted_and_max_score_skips_nan():
    # The probe epilogue's rare path: a NaN query row (tile 2 of 3) and an infinite one.
    g = seeded("tri-nan")
    B, H, N, D = 1, 2, 37, 32
    q = torch.randn(B, H, N, D, generator=g).bfloat16()
    k, v = (torch.randn(B, H, N, D, generator=g).bfloat16() for _ in range(2))
    q[0, 0, 20, 3] = float("nan")
    q[0, 1, 33, 0] = float("inf")
    for stabilize in (False, True):
        probe, ref = Probe(H), Probe(H)
        flash_attention(q, k, v, stabilize=stabilize, probe=probe, backend="triton")
        flash_attention(q, k, v, stabilize=stabilize, probe=ref, backend="reference")
        assert probe.nonfinite_rows.tolist() == ref.nonfinite_rows.tolist() == [1, 1]
        assert probe.rows.tolist() == [N, N]
        # head 0: the largest score of the finite rows (NaN is no maximum); head 1: +inf
        s = (q.float() @ k.float().transpose(-1, -2)) * D ** -0.5
        finite = torch.ones(N, dtype=torch.bool)
        finite[20] = False
        assert probe.max_score[0].item() == pytest.approx(s[0, 0, finite].max().item(), rel=1e-5)
        assert probe.max_score[1].item() == float("inf")


def test_multi_max_rows_counts_exactly():
    S = torch.linspace(-3, -1, 40).bfloat16().float().repeat(5, 1)
    S[0, [2, 9]] = 0.25  # tie inside a 16-key block -> counted
    S[1, [2, 30]] = 0.25  # tie across blocks -> counted
    S[2, 2], S[2, 39] = 0.25, 0.25 - 2 ** -10  # within eps across blocks -> counted
    S[3, 2], S[3, 20] = 0.25, 0.25 - 2 ** -8  # 3.9e-3 apart -> not counted
    S[4, 39] = 0.5  # single maximum -> not counted
    q = torch.eye(5, 16)[None, None].bfloat16()
    k = torch.zeros(40, 16)
    k[:, :5] = S.T
    k = k[None, None].bfloat16()
    v = torch.randn(1, 1, 40, 16, generator=seeded("tri-mm")).bfloat16()
    for stabilize in (False, True):
        probe = Probe(1)
        flash_attention(q, k, v, scale=1.0, stabilize=stabilize, probe=probe, backend="triton")
        assert probe.multi_max_rows.tolist() == [3]
        assert probe.rows.tolist() == [5] and probe.max_score.tolist() == [0.5]


def test_per_head_flags_and_accumulation():
    q, k, v, _ = _inputs(("flags",), 2, 4, 2, 20, 32)
    q = q[:, :, :1] + 0.1 * q
    k[:, :, 5] = k[:, :, 17] = 2 * q[:, 0::2, 0]  # every row's maximum repeats
    mask = torch.tensor([False, True, False, True])
    probe = Probe(4)
    one = flash_attention(q, k, v, stabilize=mask, probe=probe, backend="triton")
    flash_attention(q, k, v, stabilize=mask, probe=probe, backend="triton", causal=True)
    every = flash_attention(q, k, v, stabilize=True, backend="triton")
    none = flash_attention(q, k, v, backend="triton")
    assert torch.equal(one[:, 1], every[:, 1]) and torch.equal(one[:, 0], none[:, 0])
    assert not torch.equal(every, none)
    assert probe.rows.tolist() == [80] * 4
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(32)
    assert torch.allclose(probe.max_score.double(), s.amax(dim=(0, 2, 3)), rtol=1e-6)


def test_noncontiguous_inputs():
    q, k, v, _ = _inputs(("strides",), 1, 2, 2, 24, 32)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) storage
    a = flash_attention(qt, k, v, causal=True, backend="triton")
    b = flash_attention(q, k, v, causal=True, backend="triton")
    assert torch.equal(a, b)


def test_triton_backend_needs_cuda_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, _ = _inputs(("nocuda",), 1, 1, 1, 4, 32)
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors, got device cpu"):
        flash_attention(q, k, v, backend="triton")
    with pytest.raises(TypeError, match=r"backend='triton' supports dtypes"):
        flash_attention(q.double(), k.double(), v.double(), backend="triton")


def test_probe_samples_query_tiles_of_unstabilized_heads():
    """With many query tiles, unstabilized heads count ties on a rotating sample of them."""
    from instability_watch.kernels.attention import triton as ta

    B, H, N = 8, 2, 64  # 8 * 4 tiles of 16 rows per head -> stride min(16, 32 // 4) = 8
    q, k, v, _ = _inputs(("sampling",), B, H, H, N, 32)
    mask = torch.tensor([False, True])
    probe = Probe(H)
    o = flash_attention(q, k, v, causal=True, stabilize=mask, probe=probe, backend="triton")
    stride, tiles = 8, N // 16
    sampled = sum(1 for b in range(B) for t in range(tiles) if (t + b) % stride == 0)
    assert ta.TIE_SAMPLE_MAX >= stride
    assert probe.tie_rows.tolist() == [sampled * 16, B * N]  # head 1 is stabilized: every row
    assert probe.rows.tolist() == [B * N, B * N]
    # Tracking never changes an unstabilized head's output.
    assert torch.equal(o[:, 0], flash_attention(q, k, v, causal=True, backend="triton")[:, 0])


def test_high_precision_delta_matches_reference():
    """The control's backward (delta from O_hp) on the Triton path equals the reference's."""
    from instability_watch.experimental import high_precision_delta

    inp = near_tie_inputs(batch=1, heads=2, seq=37, head_dim=32, generator=seeded("hp_delta_tri"))
    grads = {}
    for backend in ("triton", "reference"):
        for hp in (False, True):
            q = inp.q.clone().requires_grad_(True)
            with high_precision_delta(hp):
                o = flash_attention(q, inp.k, inp.v, causal=True, backend=backend)
            o.backward(inp.do)
            grads[backend, hp] = q.grad
    assert not torch.equal(grads["triton", False], grads["triton", True])
    for hp in (False, True):
        assert max_err(grads["triton", hp], grads["reference", hp]) <= 2 ** -6 * grads["reference", hp].abs().max()


# ----------------------------------------------------------------------------- masks, dropout, head dims


def _sdpa_masked(mask):
    return lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
        a, b, c, attn_mask=None if mask is None else (mask if mask.dtype == torch.bool else mask.to(a.dtype)),
        enable_gqa=a.shape[1] != b.shape[1])


def _masks(N, n_kv, H):
    g = seeded("masks", N, n_kv)
    rows = torch.rand(2, 1, N, n_kv, generator=g) > 0.4
    rows[0, 0, 5] = False  # a row that sees no key
    rows[:, :, :, 20:36] = False  # whole key blocks masked for every row: skipped
    pad = (torch.arange(n_kv) < n_kv - 13).view(1, 1, 1, n_kv).expand(2, 1, N, n_kv)  # stride-0 rows
    window = torch.ones(N, n_kv, dtype=torch.bool).tril().triu(-7)  # causal sliding window of 8
    bias = torch.randn(1, H, N, n_kv, generator=g)
    bias[..., 3] = float("-inf")
    return {"bool": rows, "padding": pad, "window": window, "additive": bias}


@pytest.mark.parametrize("kind", ["bool", "padding", "window", "additive"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_masked_calls_match_the_reference_and_sdpa(kind, heads):
    H, h_kv = heads
    N = n_kv = 37 if kind == "window" else 37
    n_kv = N if kind == "window" else 45
    q, k, v, do = _inputs(("mask", kind, heads), 2, H, h_kv, N, 24, n_kv=n_kv)
    mask = _masks(N, n_kv, H)[kind]
    f64 = run_fwd_bwd(_sdpa_masked(mask), q, k, v, do, torch.float64)
    pt = run_fwd_bwd(_sdpa_masked(mask), q, k, v, do, torch.bfloat16)
    for stabilize in (False, True):
        outs = {}
        for backend in ("triton", "reference"):
            probe = Probe(H)
            probe.shadow = True
            outs[backend] = run_fwd_bwd(
                lambda a, b, c: flash_attention(a, b, c, attn_mask=mask, stabilize=stabilize, probe=probe,
                                                backend=backend), q, k, v, do, torch.bfloat16)
            outs[backend + " probe"] = probe
        for name, t, r, p, x in zip(["o", "dq", "dk", "dv"], outs["triton"], outs["reference"], pt, f64):
            assert torch.isfinite(t).all(), name
            assert max_err(t, x) <= 2 * max_err(p, x) + 1e-6, (name, max_err(t, x), max_err(p, x))
            assert max_err(t, r) <= 2 * max_err(r, x) + 1e-6, (name, max_err(t, r), max_err(r, x))
        tp, rp = outs["triton probe"], outs["reference probe"]
        for name in ("rows", "masked_rows", "nonfinite_rows", "shadow_rows"):
            assert getattr(tp, name).tolist() == getattr(rp, name).tolist(), name
    if kind == "bool":  # the row that sees no key: 0 and zero gradients, as SDPA
        assert (outs["triton"][0][0, :, 5] == 0).all() and (outs["triton"][1][0, :, 5] == 0).all()
        assert outs["triton probe"].masked_rows.tolist() == [1] * H


def _whole_tile_masks(N):
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    causal = j <= i
    doc = torch.repeat_interleave(torch.tensor([0, 1, 2]), torch.tensor([36, 17, N - 53]))
    holed = torch.ones(N, N, dtype=torch.bool)
    holed[:, 32:48] = False  # whole tiles, a masked key tile, whole tiles again (only the first run is read whole)
    return {
        "causal": causal,
        "sliding": causal & (i - j < 36),
        "documents": causal & (doc[:, None] == doc[None, :]),
        "holed": holed,
        "padding": (torch.arange(N) < N - 9).view(1, 1, 1, N).expand(2, 1, 1, N),  # one row for all
    }


@pytest.mark.parametrize("edge_loop", [False, True])
@pytest.mark.parametrize("kind, dropout", [("causal", 0.0), ("sliding", 0.0), ("documents", 0.2), ("holed", 0.0),
                                           ("padding", 0.2)])
def test_whole_tiles_of_a_boolean_mask_are_read_as_no_mask(kind, dropout, edge_loop, monkeypatch):
    """The tiles every row of a tile sees whole run the unmasked loop (no mask read); outputs, gradients and the
    probe's counts are those of the kernels reading the mask everywhere, and a causal mask's those of
    ``causal=True``, bit for bit where the tiles are taken in the same order: always with four loops (the edge loop
    off); with the edge loop in every kernel (the whole run first, then the other tiles), where no masked key tile
    comes before the whole run (else equal to float32's rounding). Dropout calls take the fused backward (its dK/dV kernel loops
    over query tiles)."""
    import instability_watch.kernels.attention.triton as ta

    monkeypatch.setattr(ta, "EDGE_LOOP", ("fwd", "dq", "dkdv") if edge_loop else ())
    H, h_kv, N = 2, 1, 70
    q, k, v, do = _inputs(("whole tiles", kind), 2, H, h_kv, N, 16, dtype=torch.float32)
    mask = _whole_tile_masks(N)[kind]
    stabilize = torch.tensor([False, True])

    def run(whole, **kw):
        monkeypatch.setattr(ta, "_whole_tiles", lambda kind_, causal: whole and kind_ in (ta.MASK_BOOL,) and not causal)
        probe = Probe(H)
        probe.shadow = not dropout  # (the shadow statistics take the two-kernel backward)
        g = torch.Generator().manual_seed(5)
        out = run_fwd_bwd(lambda a, b, c: flash_attention(a, b, c, stabilize=stabilize, probe=probe, dropout_p=dropout,
                                                          generator=g, backend="triton", **kw), q, k, v, do,
                          torch.float32)
        return out, probe

    read, read_probe = run(False, attn_mask=mask)
    seen = []  # (kernel, EDGE_LOOP) of each attention launch: the edge loop did run, where asked for
    for kernel in ("fwd", "dq", "dkdv"):
        launch = getattr(ta, f"launch_{kernel}")
        monkeypatch.setattr(ta, f"launch_{kernel}", lambda grid, t, a, meta, launch=launch, kernel=kernel: launch(
            grid, t, a, meta) or seen.append((kernel, meta["EDGE_LOOP"])))
    whole, whole_probe = run(True, attn_mask=mask)
    assert sorted(set(seen)) == sorted({(kernel, edge_loop) for kernel, _ in seen}), seen
    assert {kernel for kernel, _ in seen} == ({"fwd", "dkdv"} if dropout else {"fwd", "dq", "dkdv"})  # (fused: no dQ)
    reordered = edge_loop and kind in ("sliding", "documents")  # a masked key tile before a query tile's whole run
    for name, a, b in zip(["o", "dq", "dk", "dv"], read, whole):
        if reordered:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), name
    for name in ("rows", "masked_rows", "multi_max_rows", "shadow_rows"):
        assert getattr(read_probe, name).tolist() == getattr(whole_probe, name).tolist(), name
    if kind == "causal":
        native, _ = run(True, causal=True)
        for name, a, b in zip(["o", "dq", "dk", "dv"], native, whole):
            assert torch.equal(a, b), name
    # the mask does have whole tiles at the interpreter's tiles (16), in both directions
    margs = MaskArgs(mask, 2, H, N, N)
    for ranges, _ in (margs.rows(16, 16), margs.cols(16, 16)):
        assert (ranges[..., 3] > ranges[..., 2]).any()


@pytest.mark.parametrize("kind", ["sliding", "documents"])
def test_the_edge_loop_at_the_gpus_tiles_gives_the_four_loops_results(kind, monkeypatch):
    """At the launch table's tiles for D = 128, BF16 (the forward 128 x 64, dQ 64 x 64, dK/dV 64 x 128: not the
    interpreter's square 16 x 16), a ragged length (200) and a stabilized head: the edge loop in every kernel gives
    the four loops' output and gradients up to the order of float32 sums, and both agree with float64 attention."""
    from instability_watch.kernels import configs
    import instability_watch.kernels.attention.triton as ta

    monkeypatch.setattr(configs, "INTERPRET", False)  # launch_config reads the table, as on the GPU
    H, h_kv, N, D = 2, 1, 200, 128
    q, k, v, do = _inputs(("edge loop, GPU tiles", kind), 1, H, h_kv, N, D)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    doc = torch.repeat_interleave(torch.tensor([0, 1, 2]), torch.tensor([70, 81, N - 151]))
    mask = (j <= i) & ((i - j < 90) if kind == "sliding" else (doc[:, None] == doc[None, :]))
    stabilize = torch.tensor([False, True])

    def run(loops):
        monkeypatch.setattr(ta, "EDGE_LOOP", loops)
        return run_fwd_bwd(lambda a, b, c: flash_attention(a, b, c, attn_mask=mask, stabilize=stabilize,
                                                          backend="triton"), q, k, v, do, torch.bfloat16)

    tiles = {}
    for kernel in ("fwd", "dq", "dkdv"):
        launch = getattr(ta, f"launch_{kernel}")
        monkeypatch.setattr(ta, f"launch_{kernel}", lambda grid, t, a, meta, launch=launch, kernel=kernel: launch(
            grid, t, a, meta) or tiles.setdefault(kernel, (meta["BLOCK_M"], meta["BLOCK_N"])))
    four, two = run(()), run(("fwd", "dq", "dkdv"))
    assert tiles == {"fwd": (128, 64), "dq": (64, 64), "dkdv": (64, 128)}
    exact = run_fwd_bwd(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
        a, b.repeat_interleave(H // h_kv, 1), c.repeat_interleave(H // h_kv, 1), attn_mask=mask), q, k, v, do,
        torch.float64)
    for name, a, b, ref in zip(["o", "dq", "dk", "dv"], four, two, exact):
        torch.testing.assert_close(b.float(), a.float(), rtol=2 ** -6, atol=2 ** -7, msg=name)
        assert max_err(b.double(), ref) <= 2 ** -5 * ref.abs().max(), name


@pytest.mark.parametrize("N, D", [(64, 16), (64, 12), (70, 16)])
@pytest.mark.parametrize("kind, dropout", [("causal flag", 0.0), ("none", 0.0), ("sliding", 0.0), ("documents", 0.2)])
def test_loads_without_a_mask_where_every_block_is_whole_change_no_bit(kind, dropout, N, D, monkeypatch):
    """``EVEN_LOADS``: dK/dV loads its query rows without a mask where the query length is a multiple of its block
    and D fills the tile (``EVEN_MD``), dQ its key rows where the key length is (``EVEN_ND``, with ``EVEN_DQ``), and
    with one otherwise; either way the same bits (dQ up to the order of the fused backward's atomics, with
    dropout, whose backward takes no dQ kernel)."""
    import instability_watch.kernels.attention.triton as ta

    H, h_kv = 2, 1
    q, k, v, do = _inputs(("even loads", kind, N, D), 2, H, h_kv, N, D, dtype=torch.float32)
    mask = None if kind in ("causal flag", "none") else _whole_tile_masks(N)[kind]
    taken, taken_dq = [], []
    launch, launch_dq = ta.launch_dkdv, ta.launch_dq
    monkeypatch.setattr(ta, "launch_dkdv", lambda grid, t, a, meta: launch(grid, t, a, meta) or taken.append(
        (meta["EVEN_MD"], N % meta["BLOCK_M"] == 0)))
    monkeypatch.setattr(ta, "launch_dq", lambda grid, t, a, meta: launch_dq(grid, t, a, meta) or taken_dq.append(
        meta["EVEN_ND"]))

    def run(even):
        monkeypatch.setattr(ta, "EVEN_LOADS", even)
        torch.manual_seed(5)
        return run_fwd_bwd(lambda a, b, c: flash_attention(a, b, c, attn_mask=mask, causal=kind == "causal flag",
                                                          stabilize=torch.tensor([False, True]), dropout_p=dropout,
                                                          backend="triton"), q, k, v, do, torch.float32)

    masked, even = run(False), run(True)
    assert taken[0][0] is False and taken[1] == (taken[1][1] and D == 16, taken[1][1])
    assert taken[1][0] == (N == 64 and D == 16)  # (the interpreter's tiles divide 64, not 70)
    assert taken_dq == ([] if dropout else [False, N == 64 and D == 16])
    for name, a, b in zip(["o", "dq", "dk", "dv"], masked, even):
        if dropout and name == "dq":
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), name


def _causal_tile_case(tag, kind, H, N, n_kv):
    """``(q, k, v, do, mask, stabilize)`` of the causal-tile tests: two batch entries, ``H`` query heads over 2 KV
    heads, D 16, float32; the mask ``kind`` (one of the whole-tile masks, "causal per batch and head", "one key off",
    or with more keys than rows the causal mask top-left); every other head stabilized."""
    q, k, v, do = _inputs((tag, kind, n_kv), 2, H, 2, N, 16, dtype=torch.float32, n_kv=n_kv)
    causal = torch.arange(n_kv)[None, :] <= torch.arange(N)[:, None]
    if kind == "causal per batch and head":
        mask = causal.expand(2, H, N, n_kv).clone()
    elif kind == "one key off":
        mask = causal.clone()
        mask[40, 3] = False
    elif n_kv != N:
        mask = causal
    else:
        mask = _whole_tile_masks(N)[kind]
    return q, k, v, do, mask, torch.tensor([False, True] * (H // 2))


@pytest.mark.parametrize("kind, dropout, n_kv", [("causal", 0.0, None), ("sliding", 0.0, None),
                                                  ("documents", 0.2, None), ("holed", 0.0, None),
                                                  ("causal per batch and head", 0.0, None), ("one key off", 0.0, None),
                                                  ("causal", 0.0, 86)])
def test_causal_tiles_of_a_boolean_mask_are_computed_by_the_causal_compare(kind, dropout, n_kv, monkeypatch):
    """The tiles of a boolean mask that equal the causal mask, beside its run of whole tiles (the diagonal ones),
    run the causal loop (no mask read): outputs, gradients and the probe's counts bit for bit those of the kernels
    reading the mask there; a causal mask's those of ``causal=True``. A mask one entry off the causal one, per
    batch and head, more keys than rows (the causal mask top-left), and dropout (the fused backward); GQA. (Every
    kernel compares them here: by default the forward and dK/dV read them, ``READ_CAUSAL_TILES``.)"""
    import instability_watch.kernels.attention.masks as masks_mod
    import instability_watch.kernels.attention.triton as ta

    monkeypatch.setattr(ta, "READ_CAUSAL_TILES", ())

    H, N = 4, 70
    n_kv = n_kv or N
    q, k, v, do, mask, stabilize = _causal_tile_case("causal tiles", kind, H, N, n_kv)

    def run(on, **kw):
        monkeypatch.setattr(masks_mod, "CAUSAL_TILES", on)
        probe = Probe(H)
        probe.shadow = not dropout
        g = torch.Generator().manual_seed(5)
        out = run_fwd_bwd(lambda a, b, c: flash_attention(a, b, c, stabilize=stabilize, probe=probe, dropout_p=dropout,
                                                          generator=g, backend="triton", **kw), q, k, v, do,
                          torch.float32)
        return out, probe

    (read, read_probe), (tiles, tiles_probe) = run(False, attn_mask=mask), run(True, attn_mask=mask)
    for name, a, b in zip(["o", "dq", "dk", "dv"], read, tiles):
        assert torch.equal(a, b), name
    for name in ("rows", "masked_rows", "multi_max_rows", "shadow_rows"):
        assert getattr(read_probe, name).tolist() == getattr(tiles_probe, name).tolist(), name
    if kind.startswith("causal"):
        native, native_probe = run(True, causal=True)
        for name, a, b in zip(["o", "dq", "dk", "dv"], native, tiles):
            assert torch.equal(a, b), name
        for name in ("rows", "masked_rows", "multi_max_rows", "shadow_rows"):
            assert getattr(native_probe, name).tolist() == getattr(tiles_probe, name).tolist(), name
    if kind == "holed":  # (no diagonal: its causal tiles, if any, are masked ones above it)
        return
    # the call does have causal tiles at the interpreter's tiles (16): for query tiles and for key tiles
    monkeypatch.setattr(masks_mod, "CAUSAL_TILES", True)
    margs = MaskArgs(mask, 2, H, N, n_kv)
    rows, cols = margs.rows(16, 16)[0], margs.cols(16, 16)[0]
    assert (rows[..., 4] > torch.maximum(rows[..., 3], rows[..., 0])).any()
    assert (cols[..., 4] < torch.minimum(cols[..., 2], cols[..., 1])).any()


@pytest.mark.parametrize("kind, dropout, n_kv", [("sliding", 0.0, None), ("documents", 0.2, None),
                                                  ("causal per batch and head", 0.0, None), ("causal", 0.0, 86)])
def test_the_mask_is_read_once_a_call(kind, dropout, n_kv, monkeypatch):
    """``FLAGS_ONCE``: the forward reads the mask's base tile flags once and hands them to its backward (the op's
    third output), whose kernels make their tiles' flags from them: one read of the mask a call (forward and
    backward), where it was read once per tile shape (three: the forward's, dQ's and dK/dV's; with dropout, whose
    backward is fused, two). Outputs, gradients and the probe's counts bit for bit the same either way, and where
    the backward finds flags of another base (``FLAG_BASE`` changed between the two: it reads the mask itself).
    GQA; per batch entry and head; more keys than rows; dropout."""
    import instability_watch.kernels.attention.masks as masks_mod

    H, N = 4, 70
    n_kv = n_kv or N
    q, k, v, do, mask, stabilize = _causal_tile_case("read once", kind, H, N, n_kv)
    reads = []
    launch = masks_mod.launch_flags
    monkeypatch.setattr(masks_mod, "launch_flags", lambda *a: reads.append(a[3]["BLOCK_M"]) or launch(*a))

    def run(once, base_in_backward=16):
        monkeypatch.setattr(masks_mod, "FLAGS_ONCE", once)
        monkeypatch.setattr(masks_mod, "FLAG_BASE", 16)
        reads.clear()
        probe = Probe(H)
        probe.shadow = not dropout
        g = torch.Generator().manual_seed(5)

        def call(a, b, c):
            o = flash_attention(a, b, c, attn_mask=mask, stabilize=stabilize, probe=probe, dropout_p=dropout,
                                generator=g, backend="triton")
            monkeypatch.setattr(masks_mod, "FLAG_BASE", base_in_backward)  # (read when the backward runs)
            return o

        out = run_fwd_bwd(call, q, k, v, do, torch.float32)
        return out, probe, list(reads)

    (once, once_probe, once_reads), (per_tile, tile_probe, tile_reads) = run(True), run(False)
    other, other_probe, other_reads = run(True, 32)
    assert once_reads == [16], once_reads
    assert tile_reads == [16] * (2 if dropout else 3), tile_reads
    assert other_reads == [16] + [16] * (1 if dropout else 2), other_reads  # (the interpreter's tiles: 16)
    for got, got_probe in ((per_tile, tile_probe), (other, other_probe)):
        for name, a, b in zip(["o", "dq", "dk", "dv"], once, got):
            assert torch.equal(a, b), name
        for name in ("rows", "masked_rows", "multi_max_rows", "shadow_rows"):
            assert getattr(once_probe, name).tolist() == getattr(got_probe, name).tolist(), name


@pytest.mark.parametrize("kind, dropout, n_kv", [("sliding", 0.0, None), ("documents", 0.2, None),
                                                  ("causal", 0.0, 86)])
def test_causal_tiles_read_or_compared_give_the_same_bits(kind, dropout, n_kv, monkeypatch):
    """``READ_CAUSAL_TILES``: the kernels named there read a boolean mask's tiles equal to the causal mask as any
    other (the forward's and dK/dV's edge loops every tile outside the whole run; dQ the tiles after it, in one
    loop); the others take them by the causal compare (the edge loops: one select between the compare and the read
    on every tile; dQ: a loop of their own). Outputs, gradients and the probe's counts bit for bit the same every
    way (GQA; dropout, the fused backward; more keys than rows). Each launch had the asked-for way (the forward and
    dK/dV their edge loop; with dropout, no dQ kernel)."""
    import instability_watch.kernels.attention.triton as ta

    H, N = 4, 70
    n_kv = n_kv or N
    q, k, v, do, mask, stabilize = _causal_tile_case("edge tiles", kind, H, N, n_kv)
    seen = []
    for name in ("launch_fwd", "launch_dkdv", "launch_dq"):
        launch = getattr(ta, name)
        monkeypatch.setattr(ta, name, lambda grid, t, a, meta, launch=launch, name=name: launch(grid, t, a, meta) or
                            seen.append((name, meta["EDGE_LOOP"], meta["EDGE_HOW"])))

    def run(kernels):
        monkeypatch.setattr(ta, "READ_CAUSAL_TILES", kernels)
        seen.clear()
        probe = Probe(H)
        probe.shadow = not dropout
        g = torch.Generator().manual_seed(5)
        out = run_fwd_bwd(lambda a, b, c: flash_attention(a, b, c, attn_mask=mask, stabilize=stabilize, probe=probe,
                                                          dropout_p=dropout, generator=g, backend="triton"),
                          q, k, v, do, torch.float32)
        way = [int(k in kernels) for k in ("dkdv", "dq", "fwd")]  # (EDGE_HOW 1: read; 0: the causal compare too)
        dq = [] if dropout else [("launch_dq", False, way[1])]  # (dropout: the fused backward, no dQ kernel)
        assert sorted(set(seen)) == [("launch_dkdv", True, way[0])] + dq + [("launch_fwd", True, way[2])]
        return out, probe

    ref, ref_probe = run(())
    for how in (("fwd", "dq", "dkdv"), ("dq",)):
        out, probe = run(how)
        for name, a, b in zip(["o", "dq", "dk", "dv"], ref, out):
            assert torch.equal(a, b), (how, name)
        for name in ("rows", "masked_rows", "multi_max_rows", "shadow_rows"):
            assert getattr(ref_probe, name).tolist() == getattr(probe, name).tolist(), (how, name)


def test_read_causal_tiles_names_what_it_allows(monkeypatch):
    """A wrong kernel in ``READ_CAUSAL_TILES`` is refused by name, with what is allowed and what was given."""
    import instability_watch.kernels.attention.triton as ta

    monkeypatch.setattr(ta, "READ_CAUSAL_TILES", ("fwd", "bwd"))
    q = torch.randn(1, 1, 32, 16)
    mask = torch.ones(32, 32, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"READ_CAUSAL_TILES takes the kernels 'fwd', 'dq' and 'dkdv', got 'bwd'"):
        flash_attention(q, q, q, attn_mask=mask, backend="triton")


def test_a_ragged_key_tile_is_no_causal_tile(monkeypatch):
    """More rows than keys, a ragged last key tile and every score far below zero: the fused backward's dQ stays
    finite and equal to the mask read's (a key past the end in a tile read as causal had P = exp2(-lse) there, which
    overflows: found in review); the pre-pass flags no tile with keys past the end as causal."""
    import instability_watch.kernels.attention.masks as masks_mod
    import instability_watch.kernels.attention.triton as ta

    N, n_kv, D = 70, 40, 16
    g = seeded("ragged causal tile")
    u = torch.ones(D)
    k = (u + 0.01 * torch.randn(n_kv, D, generator=g)).view(1, 1, n_kv, D)
    q = (-60.0 * u + 0.1 * torch.randn(N, D, generator=g)).view(1, 1, N, D)  # every score about -240 nats
    v, do = torch.randn(1, 1, n_kv, D, generator=g), torch.randn(1, 1, N, D, generator=g)
    mask = torch.arange(n_kv)[None, :] <= torch.arange(N)[:, None]
    monkeypatch.setattr(ta, "FUSED_BACKWARD", True)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(masks_mod, "CAUSAL_TILES", on)
        outs[on] = run_fwd_bwd(lambda a, b, c: flash_attention(a, b, c, attn_mask=mask, backend="triton"), q, k, v,
                               do, torch.float32)
    for name, a, b in zip(["o", "dq", "dk", "dv"], outs[False], outs[True]):
        assert torch.isfinite(b).all(), name
        assert torch.equal(a, b), name
    cols, _ = MaskArgs(mask, 1, 1, N, n_kv).cols(16, 16)
    assert cols[0, 0, -1, 4].item() == cols[0, 0, -1, 2].item()  # the ragged key tile: an empty causal run


def _brute_ranges(vis, block, other, size_other, whole_ok, cols=False, causal_ok=None):
    """Per tile of ``block`` rows of ``vis`` (rows, keys): the span of the ``other``-wide key tiles some row sees,
    the first run of key tiles every real row sees whole (only where ``whole_ok``), and the run of key tiles equal
    to the causal mask beside it (only where ``causal_ok``, by default ``whole_ok``), as the kernels use them.
    ``cols``: ``vis`` is the transpose (rows are keys): a tile with keys past the end is never whole, a tile of
    the other axis (query rows) may be partial (rows past the end see everything: their P is 0 in the kernels),
    the run of whole tiles stands at ``hi`` where there is none, and the causal run ends where it starts."""
    causal_ok = whole_ok if causal_ok is None else causal_ok
    out = []
    for start in range(0, vis.shape[0], block):
        tile = vis[start:start + block]
        seen = [j for j in range(0, vis.shape[1], other) if tile[:, j:j + other].any()]
        lo, hi = (seen[0], min(seen[-1] + other, size_other)) if seen else (0, 0)
        last = vis.shape[1] if cols else vis.shape[1] - other + 1
        may = whole_ok and not (cols and start + block > vis.shape[0])
        whole = [j for j in range(0, last, other) if tile[:, j:j + other].all()] if may else []
        run = whole[:1]
        for j in whole[1:]:
            if j != run[-1] + other:
                break
            run.append(j)
        w0, w1 = (run[0], run[-1] + other) if run else ((hi, hi) if cols else (0, 0))

        def causal_tile(j):  # the tile of (real) rows and keys equals the causal mask, and has no key past the end
            part = tile[:, j:j + other]
            if (cols and tile.shape[0] < block) or (not cols and part.shape[1] < other):
                return False
            r = torch.arange(start, start + part.shape[0])[:, None]
            c = torch.arange(j, j + part.shape[1])[None, :]
            return bool((part == ((c >= r) if cols else (r >= c))).all())

        if cols:
            c = w0
            if causal_ok:
                c = -(-w0 // other) * other
                while c - other >= lo and causal_tile(c - other):
                    c -= other
                c = min(c, w0)
        else:
            c = w1
            if causal_ok:
                c = w1 if run else lo
                while c < hi and causal_tile(c):
                    c += other
                c = min(c, hi)
        out.append((lo, hi, w0, w1, c))
    return out


@pytest.mark.parametrize("base", [16, None])
@pytest.mark.parametrize("kind", ["causal", "sliding", "documents", "holed", "padding", "random", "additive"])
def test_the_mask_pre_pass_gives_each_tile_its_span_and_its_whole_tiles(kind, base, monkeypatch):
    """The pre-pass kernels (two launches) against a brute-force walk over the tiles: for query tiles, the keys their
    rows may see and the first run of key tiles they all see whole; for key tiles, the same over query rows (the
    transpose), at tile sizes that divide the lengths and ones that do not; per batch entry and head of the mask.
    Each tile's flags made from the mask's 16 x 16 tiles' (``FLAG_BASE``, one read of the mask for every tile
    shape; the lengths, 70, leave a ragged base tile and tiles of 32 and 64 past the last one), and read per tile
    shape (``FLAG_BASE`` None)."""
    import instability_watch.kernels.attention.masks as masks_mod

    monkeypatch.setattr(masks_mod, "FLAG_BASE", base)
    reads = []
    launch = masks_mod.launch_flags
    monkeypatch.setattr(masks_mod, "launch_flags", lambda *a: reads.append(a[3]["BLOCK_M"]) or launch(*a))
    N, n_kv = 70, 70
    masks = _whole_tile_masks(N)
    g = seeded("pre-pass", kind)
    if kind == "random":
        mask = torch.rand(2, 3, N, n_kv, generator=g) > 0.3
        mask[..., :20] = True
    elif kind == "additive":
        mask = torch.where(masks["sliding"], 0.0, float("-inf")).expand(2, 1, N, n_kv)
    else:
        mask = masks[kind].expand(2, 1, N, n_kv)
    margs = MaskArgs(mask, 2, 3, N, n_kv)
    whole_ok = mask.dtype == torch.bool
    causal_ok = whole_ok and kind != "padding"  # (a mask of one row for every row has no causal tiles)
    vis = mask if whole_ok else mask > float("-inf")
    n_whole = n_causal = 0
    for bm, bn in ((16, 16), (32, 16), (16, 32), (64, 64)):
        rows, _ = margs.rows(bm, bn)
        cols, _ = margs.cols(bn, bm)
        for b in range(2):
            for h in range(3):
                v = vis[b, h % vis.shape[1]]
                assert [tuple(r) for r in rows[b, h].tolist()] == _brute_ranges(v, bm, bn, n_kv, whole_ok,
                                                                                causal_ok=causal_ok)
                assert [tuple(r) for r in cols[b, h].tolist()] == _brute_ranges(v.T, bn, bm, N, whole_ok, cols=True,
                                                                                causal_ok=causal_ok)
                n_causal += int((rows[b, h, :, 4] > rows[b, h, :, 3].clamp(min=rows[b, h, :, 0])).sum())
                n_whole += int((rows[b, h, :, 3] > rows[b, h, :, 2]).sum())
    assert (n_whole > 0) == (kind != "additive")
    assert (n_causal > 0) == (kind in ("causal", "sliding", "documents", "holed"))
    rows_differ = kind != "padding"  # (a mask of one row: its key tiles' ranges come from PyTorch operations)
    assert reads == ([16] if base else [bm for bm in (16, 32, 16, 64) for _ in range(1 + rows_differ)]), reads


@pytest.mark.parametrize("kind", ["causal", "sliding", "documents", "random", "holed", "offset by a byte", "70 keys"])
def test_the_pre_pass_reads_an_aligned_boolean_mask_four_keys_at_a_time(kind, monkeypatch):
    """A boolean mask whose rows start on 4-byte boundaries is read as int32 words of four keys (``FLAG_WORDS``):
    each tile's ranges, whole runs and causal runs equal the byte-by-byte read's and the brute-force walk's, per batch
    entry and head, at several tile shapes; a mask that starts one byte into its storage, or whose rows hold 70 keys,
    is read byte by byte."""
    import instability_watch.kernels.attention.masks as masks_mod

    N = 72
    n_kv = 70 if kind == "70 keys" else N
    i, j = torch.arange(N)[:, None], torch.arange(n_kv)[None, :]
    g = seeded("pre-pass words", kind)
    doc = torch.repeat_interleave(torch.tensor([0, 1, 2]), torch.tensor([36, 17, N - 53]))
    if kind == "random":
        mask = torch.rand(2, 3, N, n_kv, generator=g) > 0.3
        mask[..., :20] = True
    elif kind == "holed":
        mask = torch.ones(N, n_kv, dtype=torch.bool)
        mask[:, 32:48] = False
    elif kind == "documents":
        mask = (j <= i) & (doc[:, None] == doc[None, :])
    elif kind == "sliding":
        mask = (j <= i) & (i - j < 36)
    elif kind == "offset by a byte":
        mask = torch.cat([torch.zeros(1, dtype=torch.bool), (j <= i).flatten()])[1:].view(N, n_kv)
    else:
        mask = j <= i
    mask = mask.expand(2, 3, N, n_kv) if mask.dim() == 2 else mask
    used = []
    launch = masks_mod.launch_flags
    monkeypatch.setattr(masks_mod, "launch_flags", lambda grid, args, sargs, kw: used.append(kw["WORDS"]) or launch(
        grid, args, sargs, kw))
    out = {}
    for words in (False, True):
        monkeypatch.setattr(masks_mod, "FLAG_WORDS", words)
        margs = MaskArgs(mask, 2, 3, N, n_kv)
        out[words] = [margs.rows(bm, bn)[0] for bm, bn in ((16, 16), (32, 16), (16, 32))] + [
            margs.cols(bn, bm)[0] for bm, bn in ((16, 16), (32, 16), (16, 32))]
    assert used[len(used) // 2:] == [kind not in ("offset by a byte", "70 keys")] * (len(used) // 2)
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a, b)
    rows = out[True][0]
    for b in range(2):
        for h in range(3):
            assert [tuple(r) for r in rows[b, h].tolist()] == _brute_ranges(mask[b, h], 16, 16, n_kv, True)


def test_the_mask_pre_pass_reads_rows_of_more_tiles_than_one_chunk():
    """More key tiles than the pre-pass reads in one chunk (256): a span and a run of whole tiles that cross
    chunks, a tile row that sees nothing, against the brute-force walk."""
    N, n_kv = 40, 16 * 270 + 5  # 270 key tiles of 16 and a ragged one
    keep = torch.zeros(1, 1, N, n_kv, dtype=torch.bool)
    keep[..., :32, 3000:4200] = True  # a run of whole tiles across tile 256 (key 4096)
    keep[..., :32, 4300:4310] = True  # then a partial tile; rows 32-39 see nothing
    rows, _ = MaskArgs(keep, 1, 1, N, n_kv).rows(32, 16)
    cols, _ = MaskArgs(keep, 1, 1, N, n_kv).cols(16, 32)
    assert [tuple(r) for r in rows[0, 0].tolist()] == _brute_ranges(keep[0, 0], 32, 16, n_kv, True)
    assert [tuple(r) for r in cols[0, 0].tolist()] == _brute_ranges(keep[0, 0].T, 16, 32, N, True, cols=True)
    assert rows[0, 0].tolist() == [[2992, 4320, 3008, 4192, 4192], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize("kind", ["causal", "mask", "dropout", "split"])
def test_gqa_expand_spreads_dkdv_over_query_heads_with_the_same_gradients(kind, monkeypatch):
    """``GQA_EXPAND`` (the dK/dV kernel run per query head, its shares summed per group afterwards): dQ bit for bit,
    dK and dV equal up to the float32 summation order (well under one BF16 rounding), for causal calls, a boolean
    mask with whole tiles, dropout (the fused backward) and the split dK/dV passes."""
    import instability_watch.kernels.attention.triton as ta

    H, h_kv, N = 4, 2, 70
    q, k, v, do = _inputs(("gqa expand", kind), 2, H, h_kv, N, 32)
    mask = _whole_tile_masks(N)["sliding"] if kind == "mask" else None
    outs, grids = {}, []
    launch = ta.launch_dkdv
    monkeypatch.setattr(ta, "launch_dkdv", lambda grid, *args: grids.append(  # (heads, tiles) in work order
        grid[::-1] if args[-1]["ORDERED"] else grid) or launch(grid, *args))
    for expand in (False, True):
        monkeypatch.setattr(ta, "GQA_EXPAND", expand)
        if kind == "split":
            monkeypatch.setattr(ta, "has_launch_config", lambda *a: True)
        g = torch.Generator().manual_seed(3)
        outs[expand] = run_fwd_bwd(lambda a, b, c: flash_attention(
            a, b, c, causal=mask is None, attn_mask=mask, dropout_p=0.2 if kind == "dropout" else 0.0, generator=g,
            backend="triton"), q, k, v, do, torch.bfloat16)
    (o0, dq0, dk0, dv0), (o1, dq1, dk1, dv1) = outs[False], outs[True]
    passes = len(grids) // 2  # the dK/dV programs: per K/V head, then per query head
    assert [g[1] for g in grids] == [2 * h_kv] * passes + [2 * H] * passes
    assert torch.equal(o0, o1)
    if kind != "dropout":  # (the fused backward's dQ atomics add in another order)
        assert torch.equal(dq0, dq1)
    for a, b in ((dk0, dk1), (dv0, dv1)):
        assert max_err(a, b) <= 2 ** -8 * b.abs().max()


def test_additive_mask_gets_its_gradient():
    H = 2
    q, k, v, do = _inputs(("bias grad",), 2, H, 1, 21, 16, dtype=torch.float32, n_kv=29)
    bias = _masks(21, 29, H)["additive"]
    grads = {}
    for name, fn in (("triton", lambda a, b, c, m: flash_attention(a, b, c, attn_mask=m, backend="triton")),
                     ("sdpa", lambda a, b, c, m: torch.nn.functional.scaled_dot_product_attention(
                         a, b, c, attn_mask=m, enable_gqa=True))):
        m = bias.clone().requires_grad_(True)
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        fn(qq, kk, vv, m).backward(do)
        grads[name] = (m.grad, qq.grad, kk.grad, vv.grad)
    for t, s in zip(grads["triton"], grads["sdpa"]):
        assert t.shape == s.shape and torch.allclose(t, s, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal, masked, heads", [(True, False, (4, 2)), (False, True, (2, 2)), (False, False, (2, 1))])
def test_dropout_is_the_references_bit_for_bit(causal, masked, heads):
    """The Triton kernels draw the reference's random numbers, whatever their block sizes."""
    H, h_kv = heads
    q, k, v, do = _inputs(("dropout", causal, masked, heads), 2, H, h_kv, 37, 32, dtype=torch.float32)
    mask = _masks(37, 37, H)["bool"] if masked else None
    outs = []
    for backend in ("triton", "reference"):
        g = torch.Generator().manual_seed(11)
        outs.append(run_fwd_bwd(lambda a, b, c: flash_attention(
            a, b, c, attn_mask=mask, causal=causal, dropout_p=0.3, generator=g, backend=backend),
            q, k, v, do, torch.float32))
    for t, r in zip(*outs):
        assert max_err(t, r) <= 2e-6
    # the same call without dropout differs: something was dropped
    plain = flash_attention(q, k, v, attn_mask=mask, causal=causal, backend="triton")
    assert max_err(outs[0][0], plain) > 1e-2


@pytest.mark.parametrize("D", [8, 80, 256])
def test_head_dims_up_to_256(D):
    q, k, v, do = _inputs(("head dims", D), 1, 2, 2, 21, D)
    f64 = run_fwd_bwd(lambda a, b, c: sdpa_math(a, b, c, causal=True), q, k, v, do, torch.float64)
    pt = run_fwd_bwd(lambda a, b, c: sdpa_math(a, b, c, causal=True), q, k, v, do, torch.bfloat16)
    tri = run_fwd_bwd(lambda a, b, c: flash_attention(a, b, c, causal=True, backend="triton"), q, k, v, do,
                      torch.bfloat16)
    for t, p, x in zip(tri, pt, f64):
        assert max_err(t, x) <= 2 * max_err(p, x) + 1e-6


def test_rows_below_the_floor_are_as_each_devices_sdpa():
    """A row of entries at -3e38 (HF's "masked" in float32): on the reference (CPU) path uniform, as
    CPU SDPA's forward, with the softmax's own gradients (PyTorch's CPU SDPA backward takes P = 1 there,
    from its LSE); on the Triton (CUDA) path a masked row, 0, as CUDA SDPA's cuDNN and efficient kernels."""
    H = 2
    q, k, v, do = _inputs(("floor",), 2, H, 1, 21, 16, n_kv=29)
    bias = torch.randn(1, H, 21, 29, generator=seeded("floor bias"))
    bias[0, 1, 2] = -3e38
    bias[..., 3] = float("-inf")

    def dense(a, b, c):
        b, c = (t.repeat_interleave(H, 1) for t in (b, c))
        s = (a.float() @ b.float().transpose(-1, -2)) / 4 + bias.to(a.dtype).float()
        return (torch.softmax(s, -1).to(a.dtype).float() @ c.float()).to(a.dtype)

    x = run_fwd_bwd(dense, q, k, v, do, torch.float64)
    p = run_fwd_bwd(dense, q, k, v, do, torch.bfloat16)
    t = run_fwd_bwd(lambda a, b, c: flash_attention(a, b, c, attn_mask=bias, backend="reference"), q, k, v, do,
                    torch.bfloat16)
    for name, tt, pp, xx in zip(["o", "dq", "dk", "dv"], t, p, x):
        assert max_err(tt, xx) <= 2 * max_err(pp, xx) + 1e-6, (name, max_err(tt, xx), max_err(pp, xx))
    assert torch.allclose(t[0][0, 1, 2].float(), v[0, 0, [j for j in range(29) if j != 3]].float().mean(0), atol=1e-2)
    tri = run_fwd_bwd(lambda a, b, c: flash_attention(a, b, c, attn_mask=bias, backend="triton"), q, k, v, do,
                      torch.bfloat16)
    assert (tri[0][:, 1, 2] == 0).all() and (tri[1][:, 1, 2] == 0).all()  # the bias is the same for both batches
    others = torch.ones(2, H, 21, dtype=torch.bool)
    others[:, 1, 2] = False
    assert max_err(tri[0][others], x[0][others]) <= 2 * max_err(p[0][others], x[0][others]) + 1e-6
    assert all(torch.isfinite(g).all() for g in tri)


FUSED_CASES = [
    # (N, n_kv, D, causal, (H, H_kv), mask kind or None, dropout_p)
    (37, 37, 32, True, (4, 2), None, 0.0),
    (37, 45, 64, False, (2, 2), None, 0.0),
    (37, 45, 24, False, (4, 2), "bool", 0.0),
    (37, 45, 24, False, (2, 1), "additive", 0.0),
    (37, 37, 24, False, (2, 2), "window", 0.2),
    (37, 37, 80, True, (4, 1), None, 0.3),
    (21, 21, 256, True, (2, 2), None, 0.0),
    (1, 1, 64, True, (2, 1), None, 0.0),
]


@pytest.mark.parametrize("N, n_kv, D, causal, heads, kind, p", FUSED_CASES)
def test_fused_backward_matches_the_two_kernel_backward(N, n_kv, D, causal, heads, kind, p):
    """The fused backward (dQ by atomics) against the two kernels (dQ, then dK/dV) on the same
    forward: the same gradients up to float32 summation order, in both dtypes. (The default
    path, fused, is also what the reference comparisons above run, dropout's bit for bit.)"""
    H, h_kv = heads
    mask = _masks(N, n_kv, H)[kind] if kind else None
    # float32 everywhere (the tight check); BF16, the production rounding of dS, on causal GQA and dropout
    dtypes = [(torch.float32, 1e-5)] + ([(torch.bfloat16, 2 ** -7)] if (causal and h_kv < H) or p else [])
    for dtype, tol in dtypes:
        q, k, v, do = _inputs(("fused", N, n_kv, D, kind, p), 2, H, h_kv, N, D, dtype=dtype, n_kv=n_kv)
        seed = torch.tensor([123, 456], dtype=torch.int64) if p else None
        fused = fused_and_split_backward(q, k, v, do, causal=causal, scale=D ** -0.5, tol=tol, attn_mask=mask,
                                         dropout_p=p, seed=seed)
        assert fused[0].abs().max() > 0 and fused[1].abs().max() > 0


def test_fused_backward_serves_dropout_calls_is_refused_where_it_cannot_and_skipped_when_deterministic(monkeypatch):
    from instability_watch.kernels.attention import triton as ta

    q, k, v, do = _inputs(("fused refuse",), 1, 2, 2, 19, 16)
    o, lse2 = ta.attention_forward_lse2(q, k, v, causal=True, scale=0.25, stabilize=None, beta=2.0, eps=1e-3,
                                   counts=None, values=None)
    probe = Probe(2)
    with pytest.raises(ValueError, match="fused=True"):
        ta.attention_backward_lse2(q, k, v, o, lse2, do, causal=True, scale=0.25, counts=probe.counts,
                              values=probe.values, shadow=True, fused=True)
    calls = []
    launch = ta.launch_dkdv
    monkeypatch.setattr(ta, "launch_dkdv", lambda grid, t, s, meta: launch(grid, t, s, meta) or (
        calls.append(1) if meta["FUSED_DQ"] else None))
    ta.attention_backward_lse2(q, k, v, o, lse2, do, causal=True, scale=0.25, counts=None, values=None, shadow=False)
    assert calls == []  # without dropout the two kernels are the faster way: the default
    seed = torch.tensor([3, 4], dtype=torch.int64)
    o, lse2 = ta.attention_forward_lse2(q, k, v, causal=True, scale=0.25, stabilize=None, beta=2.0, eps=1e-3,
                                   counts=None, values=None, dropout_p=0.25, seed=seed)
    kw = dict(causal=True, scale=0.25, counts=None, values=None, shadow=False, dropout_p=0.25, seed=seed)
    default = ta.attention_backward_lse2(q, k, v, o, lse2, do, **kw)
    assert len(calls) == 1
    torch.use_deterministic_algorithms(True)
    try:
        det = ta.attention_backward_lse2(q, k, v, o, lse2, do, **kw)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(calls) == 1  # deterministic: the two kernels
    for a, b in zip(default[:3], det[:3]):
        assert max_err(a, b) <= 2 ** -7 * b.abs().max()


SPLIT_CASES = [
    # (N, n_kv, D, causal, (H, H_kv), mask kind or None, dropout_p)
    (21, 21, 256, True, (2, 2), None, 0.0),
    (37, 45, 24, False, (4, 2), "bool", 0.0),
    (37, 45, 24, False, (2, 1), "additive", 0.0),
    (37, 37, 80, True, (4, 1), None, 0.3),
    (37, 37, 24, False, (2, 2), "window", 0.2),
]


@pytest.mark.parametrize("N, n_kv, D, causal, heads, kind, p", SPLIT_CASES)
def test_split_dkdv_passes_are_the_one_pass_kernel_bit_for_bit(N, n_kv, D, causal, heads, kind, p, monkeypatch):
    """dK and dV from two passes (PART 1, then 2: one accumulator each, the D = 256 default) equal
    the one-pass kernel's bit for bit: each pass does the same arithmetic on the same tiles."""
    from instability_watch.kernels.attention import triton as ta

    H, h_kv = heads
    mask = _masks(N, n_kv, H)[kind] if kind else None
    parts = []
    launch = ta.launch_dkdv
    monkeypatch.setattr(ta, "launch_dkdv", lambda grid, t, s, meta: launch(grid, t, s, meta) or parts.append(
        meta["PART"]))
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, do = _inputs(("split", N, n_kv, D, kind, p), 2, H, h_kv, N, D, dtype=dtype, n_kv=n_kv)
        seed = torch.tensor([123, 456], dtype=torch.int64) if p else None
        o, lse2 = ta.attention_forward_lse2(q, k, v, causal=causal, scale=D ** -0.5, stabilize=None, beta=2.0,
                                            eps=1e-3, counts=None, values=None, attn_mask=mask, dropout_p=p, seed=seed)
        kw = dict(causal=causal, scale=D ** -0.5, counts=None, values=None, shadow=False, attn_mask=mask,
                  dropout_p=p, seed=seed, fused=False, mask_grad=kind == "additive")
        parts.clear()
        one = ta.attention_backward_lse2(q, k, v, o, lse2, do, split=False, **kw)
        assert parts == [0]
        parts.clear()
        two = ta.attention_backward_lse2(q, k, v, o, lse2, do, split=True, **kw)
        assert parts == [1, 2]
        for name, a, b in zip(("dq", "dk", "dv", "dmask"), one, two):
            if a is None:
                assert b is None and name == "dmask"
                continue
            assert torch.isfinite(a).all() and a.abs().max() > 0, name
            assert torch.equal(a, b), (name, dtype, max_err(a, b))
        # the default: split exactly where the launch table has the two passes (D = 256 on tensor cores)
        parts.clear()
        ta.attention_backward_lse2(q, k, v, o, lse2, do, **{**kw, "fused": None, "dropout_p": 0.0, "seed": None})
        assert parts == ([1, 2] if D == 256 and dtype != torch.float32 else [0]), (D, dtype, parts)


@pytest.mark.parametrize("D, dtype", [(24, torch.bfloat16), (256, torch.float32)])
def test_split_forced_where_the_table_has_no_passes_takes_the_one_pass_tiles(D, dtype, monkeypatch):
    """``split=True`` where the launch table has no "dk"/"dv" entry (D <= 128, or float32) runs both
    passes at the one-pass kernel's tiles: the table's own tiles here, not the interpreter's."""
    from instability_watch.kernels import configs
    from instability_watch.kernels.attention import triton as ta

    monkeypatch.setattr(configs, "INTERPRET", False)  # launch_config reads the table, as on the GPU
    q, k, v, do = _inputs(("split forced", D), 1, 2, 1, 19, D, dtype=dtype)
    kw = dict(causal=True, scale=D ** -0.5, counts=None, values=None, shadow=False)
    o, lse2 = ta.attention_forward_lse2(q, k, v, stabilize=None, beta=2.0, eps=1e-3, **{
        k_: kw[k_] for k_ in ("causal", "scale", "counts", "values")})
    blocks = []
    launch = ta.launch_dkdv
    monkeypatch.setattr(ta, "launch_dkdv", lambda grid, t, s, meta: launch(grid, t, s, meta) or blocks.append(
        (meta["PART"], meta["BLOCK_M"], meta["BLOCK_N"])))
    one = ta.attention_backward_lse2(q, k, v, o, lse2, do, split=False, **kw)
    two = ta.attention_backward_lse2(q, k, v, o, lse2, do, split=True, **kw)
    cfg = configs.launch_config("dkdv", configs.head_dim_tile(D), dtype)
    assert blocks == [(0, cfg.block_m, cfg.block_n), (1, cfg.block_m, cfg.block_n), (2, cfg.block_m, cfg.block_n)]
    for a, b in zip(one[:3], two[:3]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="kernel must be one of"):
        configs.has_launch_config("dkv", 256, dtype)


@pytest.mark.parametrize("case", ["causal_gqa", "bool_mask", "dropout"])
def test_high_precision_delta_prepass_equals_float32_o(case):
    """The control's delta from the dQ kernel's pre-pass (rowsum(P * dP), P unrounded) gives the
    gradients of delta = rowsum(dO * O_hp) with O_hp recomputed by PyTorch in float32, and
    differs from the ordinary backward's."""
    from instability_watch.kernels.attention import triton as ta
    from instability_watch.kernels.attention.ops import delta_from_float32_o
    from instability_watch.kernels import dropout_seed

    B, H, h_kv, N, D = 2, 4, (2 if case == "causal_gqa" else 4), 37, 32
    q, k, v, do = _inputs(("hp_prepass", case), B, H, h_kv, N, D)
    causal = case != "bool_mask"
    mask = None
    if case == "bool_mask":
        mask = torch.rand(B, 1, N, N, generator=seeded("hp_prepass_mask")) > 0.3
        mask[..., 0] = True
    p = 0.25 if case == "dropout" else 0.0
    seed = dropout_seed(torch.Generator().manual_seed(3), "cpu") if p else None
    scale = D ** -0.5
    o, lse2 = ta.attention_forward_lse2(q, k, v, causal=causal, scale=scale, stabilize=None, beta=2.0, eps=1e-3,
                                        counts=None, values=None, attn_mask=mask, dropout_p=p, seed=seed)
    common = dict(causal=causal, scale=scale, counts=None, values=None, shadow=False, attn_mask=mask,
                  dropout_p=p, seed=seed)
    prepass = ta.attention_backward_lse2(q, k, v, o, lse2, do, delta_hp=True, **common)[:3]
    delta = delta_from_float32_o(q, k, v, do, mask, seed, causal, scale, p)
    given = ta.attention_backward_lse2(q, k, v, o, lse2, do, delta=delta, **common)[:3]
    ordinary = ta.attention_backward_lse2(q, k, v, o, lse2, do, **common)[:3]
    for a, b in zip(prepass, given):
        assert max_err(a, b) <= 2 ** -7 * b.abs().max()
    # the check can fail: the ordinary delta moves dQ by more than that tolerance here
    assert max_err(ordinary[0], given[0]) > 0
    with pytest.raises(ValueError, match="delta_hp"):
        ta.attention_backward_lse2(q, k, v, o, lse2, do, delta=delta, delta_hp=True, **common)
