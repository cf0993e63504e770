"""The Triton kernels on a CUDA GPU: large sizes, PyTorch's flash kernel as yardstick (marker ``gpu``).

Run on the lent GPU machine: ``python -m pytest -q -m gpu tests/kernels/test_triton_gpu.py``.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from instability_watch import Probe, flash_attention
from instability_watch.mechanism import exact_attention, measure_bias, near_tie_inputs

from helpers import assert_probe_counts_equal, compiled_kernels, fused_and_split_backward, max_err, run_fwd_bwd, seeded

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _sdpa(q, k, v, causal, backend=SDPBackend.FLASH_ATTENTION):
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _inputs(key, B, H, h_kv, N, D):
    g = seeded(*key)
    q, do = (torch.randn(B, H, N, D, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, h_kv, N, D, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    return q, k, v, do


@pytest.mark.parametrize("stabilize", [False, True], ids=["standard", "stabilized"])
@pytest.mark.parametrize(
    "B, H, h_kv, N, D, causal",
    [
        (4, 12, 12, 1024, 64, True),
        (2, 12, 12, 1025, 64, False),
        (1, 8, 2, 2048, 128, True),
        (2, 8, 2, 777, 128, False),
        (2, 4, 4, 513, 96, True),
        (2, 4, 1, 300, 32, True),
        (3, 2, 2, 1, 64, False),
    ],
)
def test_error_at_most_twice_pytorch_flash(B, H, h_kv, N, D, causal, stabilize):
    q, k, v, do = _inputs(("gpu", B, H, h_kv, N, D, causal, stabilize), B, H, h_kv, N, D)
    f64 = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, causal, SDPBackend.MATH), q, k, v, do, torch.float64)
    pt = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, causal), q, k, v, do, torch.bfloat16)
    probe = Probe(H, DEV)
    probe.shadow = True
    ours = run_fwd_bwd(
        lambda a, b, c: flash_attention(a, b, c, causal=causal, stabilize=stabilize, probe=probe), q, k, v, do, torch.bfloat16
    )
    for name, o, p, x in zip(["o", "dq", "dk", "dv"], ours, pt, f64):
        assert torch.isfinite(o).all(), name
        assert max_err(o, x) <= 2 * max_err(p, x) + 1e-6, (name, max_err(o, x), max_err(p, x))
    # Counters agree with the reference path on the same inputs.
    ref_probe = Probe(H, DEV)
    flash_attention(q, k, v, causal=causal, stabilize=stabilize, probe=ref_probe, backend="reference")
    for name in ("rows", "nonfinite_rows"):
        assert getattr(probe, name).tolist() == getattr(ref_probe, name).tolist(), name
    # Unstabilized heads count ties on a sample of query tiles: compare frequencies.
    assert (probe.tie_rows > 0).all() and (probe.tie_rows <= probe.rows).all()
    if stabilize:
        assert probe.tie_rows.tolist() == probe.rows.tolist()
    freq = probe.multi_max_rows.double() / probe.tie_rows.double()
    ref_freq = ref_probe.multi_max_rows.double() / ref_probe.tie_rows.double()
    assert (freq - ref_freq).abs().max() <= 0.01, (freq, ref_freq)
    assert torch.allclose(probe.max_score, ref_probe.max_score, rtol=1e-5)
    err = (do.double() * ours[0].double()).sum(-1) - (do.double() * f64[0]).sum(-1)
    assert probe.shadow_rows.tolist() == [B * N] * H
    assert torch.allclose(probe.delta_err_sum.double(), err.sum(dim=(0, 2)), atol=1e-3, rtol=1e-2)


def test_near_tie_bias_matches_pytorch_flash_and_the_fix_removes_it():
    """Our standard kernel has FA2's precision model: it shows the same signed bias as PyTorch's flash."""
    biases = {"flash": [], "ours": [], "stab": []}
    for seed in range(4):
        inp = near_tie_inputs(batch=4, heads=8, seq=1024, device=DEV, generator=seeded("gpu-mech", seed))
        ref = exact_attention(inp.q, inp.k, inp.v)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(inp.q, inp.k, inp.v)
        biases["flash"].append((o.double() - ref)[..., inp.neg_dims].mean().item())
        biases["ours"].append(measure_bias(inp, stabilize=False)["o_bias"])
        biases["stab"].append(measure_bias(inp, stabilize=True)["o_bias"])
    mean = {k: sum(v) / len(v) for k, v in biases.items()}
    assert mean["flash"] < 0 and mean["ours"] < 0
    assert 0.5 <= mean["ours"] / mean["flash"] <= 2.0, mean
    assert abs(mean["stab"]) * 5 <= abs(mean["ours"]), mean


def test_extreme_scores_stay_finite():
    g = seeded("gpu-huge")
    B, H, N, D = 2, 4, 600, 64
    for sign in (1, -1):
        q = (torch.randint(100, 128, (B, H, N, D), generator=g).bfloat16() * sign).to(DEV)
        k = torch.randint(101, 127, (B, H, N, D), generator=g).bfloat16()
        k[:, :, [3, 200, 500]] = 127.0 if sign > 0 else 100.0
        k = k.to(DEV)
        v = torch.randn(B, H, N, D, generator=g).bfloat16().to(DEV)
        ref = exact_attention(q, k, v, scale=1.0)
        for stabilize in (False, True):
            o = flash_attention(q, k, v, scale=1.0, stabilize=stabilize)
            assert torch.isfinite(o).all()
            tol = 3 * 2 ** -9 * v.abs().max().item()
            assert max_err(o, ref) <= tol, (sign, stabilize, max_err(o, ref), tol)


def test_flipping_a_head_does_not_recompile():
    from instability_watch.kernels.attention import triton as ta

    q, k, v, do = _inputs(("recompile",), 2, 4, 4, 256, 64)
    mask = torch.zeros(4, dtype=torch.bool, device=DEV)
    probe = Probe(4, DEV)
    flash_attention(q, k, v, causal=True, stabilize=mask, probe=probe)
    before = compiled_kernels(ta.attn_fwd)
    assert before >= 1
    outs = []
    for h in range(4):
        mask[h] = True
        outs.append(flash_attention(q, k, v, causal=True, stabilize=mask, probe=probe))
    assert compiled_kernels(ta.attn_fwd) == before
    assert torch.equal(outs[-1], flash_attention(q, k, v, causal=True, stabilize=True))


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_fast_launch_matches_tritons_launch(offset, monkeypatch):
    from instability_watch.kernels import launch as _launch
    from instability_watch.kernels.attention import triton as ta

    if not _launch.fast_launch_enabled():
        pytest.skip(f"no fast launch path on Triton {_launch.triton.__version__}")
    B, H, h_kv, N, D = 2, 8, 2, 777, 128
    fields = []  # the dK/dV launch's constexpr names, in the order of its cache key's first entry
    dkdv = ta.launch_dkdv
    monkeypatch.setattr(ta, "launch_dkdv", lambda grid, t, a, meta: fields.append(list(meta)) or dkdv(grid, t, a, meta))

    def run(fast, seed, dropout_p=0.0):
        monkeypatch.setattr(_launch.Launcher, "enabled", fast)
        g = torch.Generator(device=DEV).manual_seed(seed)

        def proj(h):  # (B, N, h, D) memory seen as (B, h, N, D), `offset` elements into its buffer
            buf = torch.randn(B * N * h * D + offset, device=DEV, generator=g).to(torch.bfloat16)
            return buf[offset:].view(B, N, h, D).transpose(1, 2).requires_grad_(True)

        q, k, v = proj(H), proj(h_kv), proj(h_kv)
        do = torch.randn(B, H, N, D, device=DEV, generator=g).to(torch.bfloat16)
        probe = Probe(H, DEV)
        mask = torch.arange(H, device=DEV) % 2 == 0
        o = flash_attention(q, k, v, causal=True, stabilize=mask, probe=probe, dropout_p=dropout_p, generator=g)
        o.backward(do)
        return [o, q.grad, k.grad, v.grad, probe.counts, probe.max_score]

    for seed in range(2):
        triton_path = run(False, seed)
        for _ in range(2):  # the first call may take Triton's path; the second hits the cache
            fast = run(True, seed)
            for a, b in zip(triton_path, fast):
                assert torch.equal(a, b)
    # with dropout: the fused backward, whose dQ atomics add in a varying order
    for seed in range(2):
        triton_path = run(False, seed, 0.1)
        for _ in range(2):
            fast = run(True, seed, 0.1)
            for i, (a, b) in enumerate(zip(triton_path, fast)):
                if i == 1:
                    assert max_err(a, b) <= 2 ** -7 * b.abs().max()
                else:
                    assert torch.equal(a, b)
    launchers = {"launch_fwd": ta.launch_fwd, "launch_dq": ta.launch_dq, "launch_dkdv": dkdv,
                 "launch_delta": ta.launch_delta}
    hits = {name: len(launcher.cache) for name, launcher in launchers.items()}
    assert all(n >= 1 for n in hits.values()), hits
    fused = fields[0].index("FUSED_DQ")  # (every dK/dV launch passes its constexprs in one order)
    assert all(f == fields[0] for f in fields)
    assert {key[0][fused] for key in dkdv.cache} == {False, True}  # FUSED_DQ: both ways took the fast path


def test_launch_hooks_see_every_launch():
    import triton

    hooks = triton.knobs.runtime.launch_enter_hook
    if not hasattr(hooks, "add"):
        pytest.skip("this Triton has no launch hook chain")
    q, k, v, do = _inputs(("hooks",), 1, 2, 2, 128, 64)
    flash_attention(q, k, v, causal=True)  # compiled and cached before the hook
    names = []
    hook = lambda metadata: names.append(metadata.get()["name"])  # what a profiler does
    hooks.add(hook)
    try:
        for _ in range(3):
            flash_attention(q, k, v, causal=True)
    finally:
        hooks.remove(hook)
    torch.cuda.synchronize()
    assert names == ["attn_fwd"] * 3


def test_compiled_model_uses_the_triton_kernels():
    torch._dynamo.reset()

    def f(q, k, v, probe):
        return flash_attention(q, k, v, causal=True, probe=probe).float().square().sum()

    q, k, v, _ = _inputs(("gpu-compile",), 2, 4, 4, 200, 64)
    q.requires_grad_(True)
    probe = Probe(4, DEV)
    probe.shadow = True
    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(q, k, v, probe)
    loss.backward()
    g_c = q.grad.clone()
    q.grad = None
    f(q, k, v, Probe(4, DEV)).backward()
    torch.testing.assert_close(g_c, q.grad)
    assert probe.rows.tolist() == [400] * 4 and probe.shadow_rows.tolist() == [400] * 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 96, 128])
def test_other_dtypes_at_every_head_dim(dtype, D):
    # float16 against PyTorch's flash kernel, float32 against its math kernel in float32;
    # float32 tiles are twice the bytes (their own launch table: shared memory at D = 128).
    B, H, N = 2, 4, 300
    q, k, v, do = _inputs(("gpu-dtype", dtype, D), B, H, H, N, D)
    f64 = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, True, SDPBackend.MATH), q, k, v, do, torch.float64)
    peer = SDPBackend.FLASH_ATTENTION if dtype == torch.float16 else SDPBackend.MATH
    pt = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, True, peer), q, k, v, do, dtype)
    for stabilize in (False, True):
        probe = Probe(H, DEV)
        probe.shadow = True
        ours = run_fwd_bwd(
            lambda a, b, c: flash_attention(a, b, c, causal=True, stabilize=stabilize, probe=probe), q, k, v, do, dtype
        )
        for name, o, p, x in zip(["o", "dq", "dk", "dv"], ours, pt, f64):
            assert o.dtype == dtype and torch.isfinite(o).all(), name
            assert max_err(o, x) <= 2 * max_err(p, x) + 1e-6, (name, stabilize, max_err(o, x), max_err(p, x))
        assert probe.rows.tolist() == [B * N] * H and probe.shadow_rows.tolist() == [B * N] * H


@pytest.mark.parametrize("N, D, h_kv", [(1000, 64, 4), (517, 128, 2)])
def test_high_precision_delta_on_the_gpu(N, D, h_kv):
    """The control's backward on the GPU: a supplied delta (from O_hp) is read instead of the
    one the dQ kernel computes; both match the reference's gradients, and the plain
    backward's delta (computed inside the dQ kernel, read by dK/dV) gives the gradients of
    a separate rowsum(dO * O)."""
    from instability_watch.experimental import high_precision_delta
    from instability_watch.kernels.attention import triton as ta

    B, H = 2, 4
    q, k, v, do = _inputs(("hp_delta_gpu", N, D), B, H, h_kv, N, D)
    grads = {}
    for backend in ("triton", "reference"):
        dev = DEV if backend == "triton" else "cpu"
        for hp in (False, True):
            qq, kk, vv = (t.detach().to(dev).requires_grad_(True) for t in (q, k, v))
            with high_precision_delta(hp):
                o = flash_attention(qq, kk, vv, causal=True, backend=backend)
            o.backward(do.to(dev))
            grads[backend, hp] = [t.grad.to(DEV) for t in (qq, kk, vv)]
    for hp in (False, True):
        for ours, ref in zip(grads["triton", hp], grads["reference", hp]):
            assert max_err(ours, ref) <= 2 ** -6 * ref.abs().max()
    assert not torch.equal(grads["triton", False][0], grads["triton", True][0])
    # delta computed in the dQ kernel == delta passed in from a separate rowsum(dO * O)
    scale = D ** -0.5
    o, lse2 = ta.attention_forward_lse2(q, k, v, causal=True, scale=scale, stabilize=None, beta=2.0, eps=1e-3, counts=None, values=None)
    inside = ta.attention_backward_lse2(q, k, v, o, lse2, do, causal=True, scale=scale, counts=None, values=None, shadow=False)[:3]
    delta = (o.float() * do.float()).sum(-1)
    given = ta.attention_backward_lse2(q, k, v, o, lse2, do, causal=True, scale=scale, counts=None, values=None, shadow=False, delta=delta)[:3]
    for a, b in zip(inside, given):
        assert max_err(a, b) <= 2 ** -8 * b.abs().max()


def _exact_score_inputs(key, B, H, N, D, dtype=torch.bfloat16):
    """Integer-valued q, k (every score exact in any summation order, ties exact) and
    random v with a NaN at key 0 of (batch 1, head 3): every row there is NaN."""
    g = seeded(*key)
    q, k = (torch.randint(-1, 2, (B, H, N, D), generator=g).to(DEV, dtype) for _ in range(2))
    v = torch.randn(B, H, N, D, generator=g).to(DEV, dtype)
    v[1, 3, 0, 7] = float("nan")
    return q, k, v


def _assert_counters_equal(probe, ref):
    assert_probe_counts_equal(probe, ref)
    assert probe.multi_max_rows.min() > 0


@pytest.mark.parametrize("N, D, causal", [(1000, 64, True), (1024, 64, False), (777, 128, True), (2048, 128, False),
                                          (1000, 256, True)])
def test_probe_counters_match_the_reference_exactly(N, D, causal):
    """The probe epilogue on the GPU (warp-level counts and maximum, one atomic per warp)
    against the reference, row for row."""
    B, H = 2, 4
    q, k, v = _exact_score_inputs(("gpu-counters", N, D), B, H, N, D)
    q[0, 1, 3], q[1, 2, 5] = 2 * q[0, 1, 3], 0.5 * q[1, 2, 5]  # a row of larger, one of smaller scores
    q[0, 0, N - 2, 1] = float("inf")  # one row of infinite scores
    k[0, 0, :, 1] = 1.0
    every = torch.ones(H, dtype=torch.bool, device=DEV)  # every tile counts ties: exact counts
    probe, ref = Probe(H, DEV), Probe(H, DEV)
    for scale in (1.0, 0.5, 2.0):  # the maximum accumulates over calls: first, below it, above it
        qs = q * scale
        flash_attention(qs, k, v, causal=causal, stabilize=every, probe=probe)
        flash_attention(qs, k, v, causal=causal, stabilize=every, probe=ref, backend="reference")
    _assert_counters_equal(probe, ref)
    assert probe.nonfinite_rows[3].item() == 3 * N
    assert probe.max_score[0].item() == float("inf")


@pytest.mark.parametrize("config, dtype", [((64, 64, 8, 2), torch.bfloat16), (None, torch.float32)], ids=["rows-over-two-warps", "float32"])
def test_probe_counters_without_warp_level_statistics(config, dtype):
    """Launches whose rows span several warps (8 warps on 64 rows) or that do not use tensor
    cores (float32) take the per-row atomics instead of the warp-level statistics: exact too."""
    from instability_watch.kernels.attention import triton as ta

    B, H, N, D = 2, 4, 300, 64
    q, k, v = _exact_score_inputs(("gpu-counters-fallback", dtype), B, H, N, D, dtype)
    every = torch.ones(H, dtype=torch.bool, device=DEV)
    probe, ref = Probe(H, DEV), Probe(H, DEV)
    ta.attention_forward_lse2(q, k, v, causal=True, scale=D ** -0.5, stabilize=every, beta=2.0, eps=1e-3,
                         counts=probe.counts, values=probe.values, config=config)
    flash_attention(q, k, v, causal=True, stabilize=every, probe=ref, backend="reference")
    _assert_counters_equal(probe, ref)
    assert probe.nonfinite_rows.tolist() == [0, 0, 0, N]


@pytest.mark.parametrize(
    "B, H, h_kv, N, D, causal, p",
    [(16, 12, 12, 1024, 64, True, 0.1), (4, 8, 8, 2048, 256, True, 0.0), (2, 8, 2, 777, 128, False, 0.0),
     (2, 4, 4, 513, 96, True, 0.2)],
)
def test_fused_backward_matches_the_two_kernel_backward_at_size(B, H, h_kv, N, D, causal, p):
    """The default (fused, dQ by atomics) backward against the deterministic two-kernel one, and
    both within twice PyTorch flash's BF16 error against float64 where there is no dropout."""
    q, k, v, do = _inputs(("fused", B, H, h_kv, N, D, causal, p), B, H, h_kv, N, D)
    seed = torch.tensor([5, 6], dtype=torch.int64, device=DEV) if p else None
    fused = fused_and_split_backward(q, k, v, do, causal=causal, scale=D ** -0.5, tol=2 ** -7, dropout_p=p, seed=seed)
    if not p:
        f64 = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, causal, SDPBackend.MATH), q, k, v, do, torch.float64)
        pt = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, causal), q, k, v, do, torch.bfloat16)
        for name, a, pp, x in zip(("dq", "dk", "dv"), fused, pt[1:], f64[1:]):
            assert max_err(a, x) <= 2 * max_err(pp, x) + 1e-6, (name, max_err(a, x), max_err(pp, x))


def _gluon_layout(t, layout):
    """``t`` (B, H, N, D) with the same values in another memory layout (HF's, or a fused QKV's slice)."""
    B, H, N, D = t.shape
    if layout == "bnhd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "qkv_slice":
        x = torch.zeros(B, N, 3 * H * D, device=t.device, dtype=t.dtype)
        x[..., H * D:2 * H * D] = t.transpose(1, 2).reshape(B, N, H * D)
        return x[..., H * D:2 * H * D].view(B, N, H, D).transpose(1, 2)
    return t


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon dK/dV kernel is for sm_90")
@pytest.mark.parametrize("N, causal, layout, dtype",
                         [(2048, True, "bhnd", torch.bfloat16), (1024, False, "bnhd", torch.bfloat16),
                          (640, True, "qkv_slice", torch.float16), (576, True, "bhnd", torch.float16),
                          (128, True, "bhnd", torch.bfloat16), (64, True, "bhnd", torch.bfloat16)],
                         ids=["causal", "hf-layout", "fp16-qkv-slice", "fp16-n576", "one-query-block", "one-block"])
def test_gluon_dkdv_at_d256(N, causal, layout, dtype, monkeypatch):
    """At D = 256 on sm_90 the backward's dK/dV is one Gluon kernel, and dQ another where N is a
    multiple of 128: the same dQ, dK and dV as the Triton kernels within 2^-7 (relative to their
    largest), and within twice PyTorch's BF16 error against float64; calls they cannot serve raise
    with gluon=True and fall back without it."""
    from instability_watch.kernels.attention import triton as ta

    B, H, D = 2, 4, 256
    q, k, v, do = (_gluon_layout(t.to(dtype), layout) for t in _inputs(("gluon d256", N, causal), B, H, H, N, D))
    kw = dict(causal=causal, scale=D ** -0.5, counts=None, values=None, shadow=False)
    o, lse2 = ta.attention_forward_lse2(q, k, v, stabilize=None, beta=2.0, eps=1e-3, **{
        k_: v_ for k_, v_ in kw.items() if k_ != "shadow"})
    from instability_watch.kernels.attention import gluon as gluon_attention

    calls, dq_calls = [], []
    launch, launch_dq = gluon_attention.dkdv, gluon_attention.dq
    monkeypatch.setattr(gluon_attention, "dkdv", lambda *a, **k_: calls.append(1) or launch(*a, **k_))
    monkeypatch.setattr(gluon_attention, "dq", lambda *a, **k_: dq_calls.append(1) or launch_dq(*a, **k_))
    glu = ta.attention_backward_lse2(q, k, v, o, lse2, do, gluon=True, **kw)  # raises if it could not serve
    tri = ta.attention_backward_lse2(q, k, v, o, lse2, do, gluon=False, **kw)
    assert len(calls) == 1
    assert len(dq_calls) == (1 if N % 128 == 0 else 0)  # the Gluon dQ takes 128 queries a program
    auto = ta.attention_backward_lse2(q, k, v, o, lse2, do, **kw)
    assert len(calls) == 2  # the default took the Gluon kernels
    assert len(dq_calls) == (2 if N % 128 == 0 else 0)
    for name, a, b, c in zip(("dq", "dk", "dv"), glu, tri, auto):
        assert torch.isfinite(a).all() and a.abs().max() > 0, name
        assert a.stride() == b.stride(), name
        assert max_err(a, b) <= 2 ** -7 * b.abs().max().item(), (name, max_err(a, b))
        assert torch.equal(a, c), name
    f64 = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, causal, SDPBackend.MATH), q, k, v, do, torch.float64)
    pt = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, causal), q, k, v, do, dtype)
    for name, a, pp, x in zip(("dq", "dk", "dv"), glu, pt[1:], f64[1:]):
        assert max_err(a, x) <= 2 * max_err(pp, x) + 1e-6, (name, max_err(a, x), max_err(pp, x))
    # a caller's delta (the high-precision control's): read, not computed; the same as Triton's with it
    delta = (o.float() * do.float()).sum(-1) * 1.5
    glu_d = ta.attention_backward_lse2(q, k, v, o, lse2, do, gluon=True, delta=delta, **kw)
    tri_d = ta.attention_backward_lse2(q, k, v, o, lse2, do, gluon=False, delta=delta, **kw)
    assert len(dq_calls) == (3 if N % 128 == 0 else 0)
    for name, a, b in zip(("dq", "dk", "dv"), glu_d, tri_d):
        assert max_err(a, b) <= 2 ** -7 * b.abs().max().item(), (name, max_err(a, b))
    assert max_err(glu_d[0], glu[0]) > 2 ** -7 * glu[0].abs().max().item()  # the delta given was used
    # calls it cannot serve: named with gluon=True, the Triton kernels without it
    mask = torch.ones(N, N, dtype=torch.bool, device=DEV).tril()
    with pytest.raises(ValueError, match="mask or dropout"):
        ta.attention_backward_lse2(q, k, v, o, lse2, do, gluon=True, attn_mask=mask, **kw)
    k2, v2 = k[:, :2].contiguous(), v[:, :2].contiguous()
    o2, lse2b = ta.attention_forward_lse2(q, k2, v2, stabilize=None, beta=2.0, eps=1e-3, **{
        k_: v_ for k_, v_ in kw.items() if k_ != "shadow"})
    with pytest.raises(ValueError, match="GQA"):
        ta.attention_backward_lse2(q, k2, v2, o2, lse2b, do, gluon=True, **kw)
    gqa = ta.attention_backward_lse2(q, k2, v2, o2, lse2b, do, **kw)
    assert all(torch.isfinite(t).all() for t in gqa[:3])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon forward is for sm_90")
@pytest.mark.parametrize("N, causal, layout, dtype",
                         [(2048, True, "bhnd", torch.bfloat16), (1024, False, "bnhd", torch.bfloat16),
                          (640, True, "qkv_slice", torch.float16), (128, True, "bhnd", torch.bfloat16)],
                         ids=["causal", "hf-layout", "fp16-qkv-slice", "one-block"])
def test_gluon_forward_at_d256(N, causal, layout, dtype, monkeypatch):
    """At D = 256 on sm_90 a forward without probe, mask, dropout or GQA is the Gluon kernel, stabilized
    heads included: the Triton forward's O and LSE bit for bit (same online softmax and tie tracking),
    within twice PyTorch's error against float64; probe steps and the other calls stay on the Triton
    kernel, named with gluon=True."""
    from instability_watch.kernels.attention import gluon as gluon_attention
    from instability_watch.kernels.attention import triton as ta
    from instability_watch.probe.bank import Probe

    B, H, D = 2, 4, 256
    q, k, v, do = (_gluon_layout(t.to(dtype), layout) for t in _inputs(("gluon fwd d256", N, causal), B, H, H, N, D))
    kw = dict(causal=causal, scale=D ** -0.5, beta=2.0, eps=1e-3, counts=None, values=None)
    calls = []
    launch = gluon_attention.forward
    monkeypatch.setattr(gluon_attention, "forward", lambda *a, **k_: calls.append(1) or launch(*a, **k_))
    o, lse = ta.attention_forward_lse2(q, k, v, stabilize=None, gluon=True, **kw)
    o_t, lse_t = ta.attention_forward_lse2(q, k, v, stabilize=None, gluon=False, **kw)
    o_a, lse_a = ta.attention_forward_lse2(q, k, v, stabilize=None, **kw)
    assert len(calls) == 2  # gluon=True and the default
    assert o.stride() == o_t.stride() and torch.equal(o, o_a) and torch.equal(lse, lse_a)
    assert torch.equal(o, o_t) and torch.equal(lse, lse_t)  # the Triton forward's online softmax, bit for bit
    f64 = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, causal, SDPBackend.MATH), q, k, v, do, torch.float64)
    pt = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, causal), q, k, v, do, dtype)
    assert max_err(o, f64[0]) <= 2 * max_err(pt[0], f64[0]) + 1e-6, (max_err(o, f64[0]), max_err(pt[0], f64[0]))
    # a switched layer's call: stabilized heads (tie tracking, the shift above a repeated maximum) in the
    # Gluon kernel too, equal to the Triton kernel's; keys in equal pairs give most rows a tie
    kt = k.clone()
    kt[:, :, 1::2] = kt[:, :, 0::2]
    stab = torch.arange(H, device=DEV) % 2 == 0
    o_s, lse_s = ta.attention_forward_lse2(q, kt, v, stabilize=stab, gluon=True, **kw)
    o_st, lse_st = ta.attention_forward_lse2(q, kt, v, stabilize=stab, gluon=False, **kw)
    o_pl, lse_pl = ta.attention_forward_lse2(q, kt, v, stabilize=None, gluon=False, **kw)
    assert len(calls) == 3
    assert torch.equal(o_s, o_st) and torch.equal(lse_s, lse_st)
    assert not torch.equal(o_s[:, 0::2], o_pl[:, 0::2])  # the stabilized heads' shift moved (P rounds differently)
    assert torch.equal(o_s[:, 1::2], o_pl[:, 1::2])  # the others are the plain forward's
    # a probe keeps the Triton forward (its statistics)
    probe = Probe(H, device=DEV)
    kw_probe = {**kw, "counts": probe.counts, "values": probe.values}
    with pytest.raises(ValueError, match="a probe, mask or dropout"):
        ta.attention_forward_lse2(q, k, v, stabilize=stab, gluon=True, **kw_probe)
    o_p, _ = ta.attention_forward_lse2(q, k, v, stabilize=None, **kw_probe)
    assert len(calls) == 3
    assert torch.equal(o_p, o_t)
    mask = torch.ones(N, N, dtype=torch.bool, device=DEV).tril()
    with pytest.raises(ValueError, match="mask"):
        ta.attention_forward_lse2(q, k, v, stabilize=None, gluon=True, attn_mask=mask, **kw)
    if N % 128 == 0:
        with pytest.raises(ValueError, match="multiple of 128"):
            ta.attention_forward_lse2(q[:, :, :N - 64], k[:, :, :N - 64], v[:, :, :N - 64], stabilize=None,
                                      gluon=True, **kw)


@pytest.mark.parametrize("h_kv, N, causal, mask_kind, p, dtype",
                         [(8, 2048, True, None, 0.0, torch.bfloat16), (2, 1500, False, "window", 0.1, torch.bfloat16),
                          (4, 1000, False, "additive", 0.0, torch.float16)],
                         ids=["causal", "gqa-window-dropout", "fp16-gqa-additive-grad"])
def test_split_dkdv_at_d256(h_kv, N, causal, mask_kind, p, dtype):
    """D = 256 runs dK/dV in two passes (the default there): with the one-pass kernel's tiles forced
    on both passes the gradients are the one-pass kernel's bit for bit; at the default tiles within
    2^-7 of them, and without dropout or mask within twice PyTorch's BF16 error against float64."""
    from instability_watch.kernels.attention import triton as ta

    B, H, D = 2, 8, 256
    q, k, v, do = (t.to(dtype) for t in _inputs(("split d256", h_kv, N, causal, mask_kind, p), B, H, h_kv, N, D))
    mask = None
    i = torch.arange(N, device=DEV)
    if mask_kind == "window":
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 700)
    elif mask_kind == "additive":  # ALiBi-like, its gradient too
        mask = -0.05 * (i[:, None] - i[None, :]).abs().to(dtype) * torch.arange(1, H + 1, device=DEV).view(H, 1, 1)
    seed = torch.tensor([7, 8], dtype=torch.int64, device=DEV) if p else None
    kw = dict(causal=causal, scale=D ** -0.5, counts=None, values=None, shadow=False, attn_mask=mask, dropout_p=p,
              seed=seed, fused=False, mask_grad=mask_kind == "additive")
    o, lse2 = ta.attention_forward_lse2(q, k, v, causal=causal, scale=D ** -0.5, stabilize=None, beta=2.0, eps=1e-3,
                                        counts=None, values=None, attn_mask=mask, dropout_p=p, seed=seed)
    cfg = (64, 64, 8, 2)
    one = ta.attention_backward_lse2(q, k, v, o, lse2, do, split=False, config_dkdv=cfg, **kw)
    same = ta.attention_backward_lse2(q, k, v, o, lse2, do, split=True, config_dk=cfg, config_dv=cfg, **kw)
    default = ta.attention_backward_lse2(q, k, v, o, lse2, do, **kw)
    names = ("dq", "dk", "dv", "dmask") if mask_kind == "additive" else ("dq", "dk", "dv")
    for name, a, b, c in zip(names, one, same, default):
        assert torch.isfinite(a).all() and a.abs().max() > 0, name
        assert torch.equal(a, b), (name, max_err(a, b))
        assert max_err(c, a) <= 2 ** -7 * a.abs().max().item(), (name, max_err(c, a))
    if not p and mask is None:
        f64 = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, causal, SDPBackend.MATH), q, k, v, do, torch.float64)
        pt = run_fwd_bwd(lambda a, b, c: _sdpa(a, b, c, causal), q, k, v, do, torch.bfloat16)
        for name, a, pp, x in zip(("dq", "dk", "dv"), default, pt[1:], f64[1:]):
            assert max_err(a, x) <= 2 * max_err(pp, x) + 1e-6, (name, max_err(a, x), max_err(pp, x))


def test_masked_calls_of_one_shape_again_and_again_with_other_masks(monkeypatch):
    """The mask pre-pass's grid has a third axis (the mask's batch entries and heads): every launch after the first
    of a shape goes through the fast launch path, which must pass that axis too. Calls of one shape, each with other
    per-batch masks (windows and padding), against PyTorch's math attention; the statistics against their
    reference."""
    from instability_watch.kernels import launch as _launch
    from instability_watch.kernels import stats

    monkeypatch.setattr(_launch.Launcher, "enabled", _launch.fast_launch_enabled())
    B, H, N, D = 3, 4, 300, 64
    for call in range(3):
        g = seeded("pre-pass planes", call)  # small integers: every score exact, the tie counts comparable
        q, k = (torch.randint(-3, 4, (B, H, N, D), generator=g).to(DEV, torch.bfloat16) for _ in range(2))
        v = torch.randn(B, H, N, D, generator=g).to(DEV, torch.bfloat16)
        i, j = torch.arange(N, device=DEV)[:, None], torch.arange(N, device=DEV)[None, :]
        keep = torch.stack([(j <= i) & (j > i - 40 - 60 * b - 20 * call) & (j < N - 30 * b) for b in range(B)])
        keep[:, :, 0] = True  # every row sees a key
        mask = keep[:, None]  # (B, 1, N, N)
        o = flash_attention(q, k, v, attn_mask=mask, scale=0.125)
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125)
        assert max_err(o, ref) < 2e-2, (call, max_err(o, ref))
        ours, want = Probe(H, DEV), Probe(H, DEV)
        stats.attention_stats(q, k, mask, o, ours.counts, ours.values, causal=False, scale=0.125, eps=0.3125)
        stats.stats_reference(q, k, mask, o, want.counts, want.values, causal=False, scale=0.125, eps=0.3125)
        assert_probe_counts_equal(ours, want)
