"""The reference path: FA2-precision emulation, the stabilized variant, the probe statistics."""
import math

import pytest
import torch

from instability_watch import Probe, flash_attention
from instability_watch.kernels.attention.reference import (
    attention_backward_lse,
    attention_forward_lse,
    stabilized_shift,
)
from instability_watch.kernels.common import LOG2E, max_shift_for
from instability_watch.mechanism import exact_attention, measure_bias, near_tie_inputs

from helpers import max_err, run_fwd_bwd, sdpa_math, seeded

# ---------------------------------------------------------------------------
# Accuracy against float64: at most 2x PyTorch's own BF16 SDPA error


@pytest.mark.parametrize("stabilize", [False, True], ids=["standard", "stabilized"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [32, 64, 96, 128])
@pytest.mark.parametrize("N", [1, 17, 97, 256])
def test_error_at_most_twice_pytorch(N, D, causal, heads, stabilize):
    H, h_kv = heads
    g = seeded("accuracy", N, D, causal, heads, stabilize)
    B = 2
    q, do = (torch.randn(B, H, N, D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, h_kv, N, D, generator=g).bfloat16() for _ in range(2))

    ref = run_fwd_bwd(lambda a, b, c: sdpa_math(a, b, c, causal=causal), q, k, v, do, torch.float64)
    pt = run_fwd_bwd(lambda a, b, c: sdpa_math(a, b, c, causal=causal), q, k, v, do, torch.bfloat16)
    ours = run_fwd_bwd(
        lambda a, b, c: flash_attention(a, b, c, causal=causal, stabilize=stabilize),
        q, k, v, do, torch.bfloat16,
    )
    for name, r, p, o in zip(["o", "dq", "dk", "dv"], ref, pt, ours):
        assert o.dtype == torch.bfloat16 and o.shape == r.shape, name
        assert torch.isfinite(o).all(), name
        assert max_err(o, r) <= 2 * max_err(p, r) + 1e-6, (name, max_err(o, r), max_err(p, r))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    g = seeded("dtypes", dtype)
    q, k, v, do = (torch.randn(2, 4, 97, 64, generator=g).to(dtype) for _ in range(4))
    ref = run_fwd_bwd(lambda a, b, c: sdpa_math(a, b, c, causal=True), q, k, v, do, torch.float64)
    pt = run_fwd_bwd(lambda a, b, c: sdpa_math(a, b, c, causal=True), q, k, v, do, dtype)
    for stabilize in (False, True):
        ours = run_fwd_bwd(
            lambda a, b, c: flash_attention(a, b, c, causal=True, stabilize=stabilize), q, k, v, do, dtype
        )
        for r, p, o in zip(ref, pt, ours):
            assert o.dtype == dtype
            assert max_err(o, r) <= 2 * max_err(p, r) + 1e-6


def test_cross_attention_lengths_and_scale():
    """N != N_kv, a custom scale, causal top-left aligned like PyTorch's is_causal."""
    g = seeded("cross")
    q = torch.randn(2, 4, 33, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 4, 150, 64, generator=g).bfloat16() for _ in range(2))
    do = torch.randn(2, 4, 33, 64, generator=g).bfloat16()
    for causal in (False, True):
        fn = lambda a, b, c: sdpa_math(a, b, c, causal=causal, scale=0.3)  # noqa: E731
        ref = run_fwd_bwd(fn, q, k, v, do, torch.float64)
        pt = run_fwd_bwd(fn, q, k, v, do, torch.bfloat16)
        ours = run_fwd_bwd(lambda a, b, c: flash_attention(a, b, c, causal=causal, scale=0.3), q, k, v, do, torch.bfloat16)
        for r, p, o in zip(ref, pt, ours):
            assert max_err(o, r) <= 2 * max_err(p, r) + 1e-6


def test_lse_is_float32_logsumexp():
    g = seeded("lse")
    q, k, v = (torch.randn(2, 3, 50, 32, generator=g).bfloat16() for _ in range(3))
    for stabilize in (None, torch.ones(3, dtype=torch.bool)):
        _, lse = attention_forward_lse(q, k, v, causal=True, stabilize=stabilize)
        s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(32)
        s = s.masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), float("-inf"))
        assert lse.dtype == torch.float32
        assert torch.allclose(lse.double(), torch.logsumexp(s, dim=-1), atol=1e-5, rtol=0)


def test_block_size_does_not_change_the_result():
    """The running-maximum tie test makes tiles irrelevant beyond rounding."""
    inp = near_tie_inputs(batch=2, heads=2, seq=300, generator=seeded("blocks"))
    outs, counts = [], []
    for block_n in (16, 64, 128, 1024):
        probe = Probe(2)
        o, _ = attention_forward_lse(inp.q, inp.k, inp.v, stabilize=torch.ones(2, dtype=torch.bool), block_n=block_n, probe=probe)
        outs.append(o)
        counts.append(probe.multi_max_rows.tolist())
    ref = exact_attention(inp.q, inp.k, inp.v)
    for o in outs:
        assert max_err(o, ref) <= 2 * max_err(ref.bfloat16(), ref) + 2 ** -9
    assert all(c == counts[0] for c in counts)
    assert counts[0] == [2 * 300, 2 * 300]


# ---------------------------------------------------------------------------
# The stabilized variant is exact in exact arithmetic


@pytest.mark.parametrize("causal", [False, True])
def test_stabilized_equals_standard_in_float64(causal):
    inp = near_tie_inputs(batch=2, heads=4, seq=200, dtype=torch.float64, generator=seeded("f64", causal))
    stab = torch.tensor([True, False, True, True])
    probe = Probe(4)
    o_std, lse_std = attention_forward_lse(inp.q, inp.k, inp.v, causal=causal)
    o_stab, lse_stab = attention_forward_lse(inp.q, inp.k, inp.v, causal=causal, stabilize=stab, probe=probe)
    assert probe.multi_max_rows.sum() > 0  # the fix did engage
    assert (o_std - o_stab).abs().max().item() <= 1e-12
    assert (lse_std - lse_stab).abs().max().item() <= 1e-12
    # Large shifts (the cap) are exact too: every score moved by +-125 (float64 keeps
    # the tie offsets exactly), so the repeated maxima sit near +129 and near -121.
    for offset in (1000.0, -1000.0):
        k = inp.k.clone()
        k[..., 0] += offset
        o_std, _ = attention_forward_lse(inp.q, k, inp.v, causal=causal)
        o_stab, _ = attention_forward_lse(inp.q, k, inp.v, causal=causal, stabilize=stab)
        assert (o_std - o_stab).abs().max().item() <= 1e-12


# ---------------------------------------------------------------------------
# The mechanism: near-ties bias the standard path; the stabilized path removes it


def _biases(n_ties, stabilize, seeds=range(8)):
    out = []
    for seed in seeds:
        inp = near_tie_inputs(batch=2, heads=4, seq=256, n_ties=n_ties, generator=seeded("mech", n_ties, seed))
        out.append(measure_bias(inp, stabilize=stabilize))
    return out


def test_near_ties_bias_o_and_the_fix_removes_it():
    no_tie = _biases(1, False)
    std = _biases(4, False)
    stab = _biases(4, True)
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    level = abs(mean(no_tie, "o_bias"))
    # Every row of the tie inputs holds repeated maxima, none of the control's.
    assert mean(std, "multi_max_frac") == 1.0 and mean(no_tie, "multi_max_frac") == 0.0
    # The standard path is biased negative (towards V's sign), several times the no-tie level...
    assert all(r["o_bias"] < 0 for r in std)
    assert abs(mean(std, "o_bias")) >= 5 * level
    # ...and the stabilized path cuts it at least 5x.
    assert abs(mean(stab, "o_bias")) * 5 <= abs(mean(std, "o_bias"))


def test_delta_drift_keeps_one_sign_only_in_the_standard_path():
    draws = range(24)
    std = [r["delta_err_sum"] for r in _biases(4, False, draws)]
    stab = [r["delta_err_sum"] for r in _biases(4, True, draws)]
    # Standard: delta_lp > delta_hp in every draw (the paper's Fig. 5a sign).
    assert all(s > 0 for s in std)
    # Stabilized: both signs occur, and the drift is much smaller on average.
    assert any(s > 0 for s in stab) and any(s < 0 for s in stab)
    assert abs(sum(stab)) * 5 <= abs(sum(std))


def test_shadow_rows_are_recorded_only_on_shadow_calls():
    inp = near_tie_inputs(batch=1, heads=2, seq=64, generator=seeded("shadow"))
    probe = Probe(2)
    q = inp.q.clone().requires_grad_(True)
    flash_attention(q, inp.k, inp.v, probe=probe).backward(inp.do)
    assert probe.shadow_rows.tolist() == [0, 0] and probe.delta_err_abs.tolist() == [0.0, 0.0]
    probe.shadow = True
    flash_attention(q, inp.k, inp.v, probe=probe).backward(inp.do)
    assert probe.shadow_rows.tolist() == [64, 64]
    assert (probe.delta_err_abs > 0).all()
    assert probe.rows.tolist() == [128, 128]


def test_shadow_delta_hp_is_rowsum_do_times_high_precision_o():
    """delta_hp = rowsum(P * dP) equals rowsum(dO * O_hp), O_hp = softmax(S) V in float32."""
    g = seeded("delta_hp")
    q, k, v, do = (torch.randn(1, 2, 40, 32, generator=g).bfloat16() for _ in range(4))
    probe = Probe(2)
    probe.shadow = True
    o, lse = attention_forward_lse(q, k, v, causal=True)
    attention_backward_lse(q, k, v, o, lse, do, causal=True, shadow_probe=probe)
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(32)
    s = s.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    o_hp = torch.softmax(s, dim=-1) @ v.float()
    err = (do.float() * o.float()).sum(-1) - (do.float() * o_hp).sum(-1)  # (1, 2, 40)
    assert torch.allclose(probe.delta_err_sum, err.sum(dim=(0, 2)), atol=1e-4, rtol=1e-3)
    assert torch.allclose(probe.delta_err_abs, err.abs().sum(dim=(0, 2)), atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------
# Extreme inputs: no NaN/Inf, and the stabilized output still matches float64


def _int_inputs(g, B, H, N, D, lo, hi):
    # Small integers are exact in bfloat16 and their dot products exact in float32,
    # so the float32 scores equal the float64 ones and only P and O get rounded.
    return torch.randint(lo, hi, (B, H, N, D), generator=g).bfloat16()


def _check_extreme(q, k, v, scale=1.0, causal=False):
    ref = exact_attention(q, k, v, scale=scale, causal=causal)
    tol = 3 * 2 ** -9 * v.double().abs().max().item()  # P rounding + O rounding
    for stabilize in (False, True):
        probe = Probe(q.shape[1])
        o = flash_attention(q, k, v, scale=scale, causal=causal, stabilize=stabilize, probe=probe)
        assert torch.isfinite(o).all(), stabilize
        assert probe.nonfinite_rows.sum() == 0
        assert max_err(o, ref) <= tol, (stabilize, max_err(o, ref), tol)


@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negative"])
def test_scores_up_to_1e6_with_repeated_maxima(sign):
    g = seeded("huge", sign)
    B, H, N, D = 2, 2, 80, 64
    q = _int_inputs(g, B, H, N, D, 100, 128) * sign  # |S| ~ 64 * 128 * 128 ~ 1e6
    k = _int_inputs(g, B, H, N, D, 101, 127)
    # Keys 3, 40 and 70 (three KV blocks) give every row the same, repeated maximum.
    k[:, :, [3, 40, 70]] = 127.0 if sign > 0 else 100.0
    v = torch.randn(B, H, N, D, generator=g).bfloat16()
    s = q.double() @ k.double().transpose(-1, -2)
    assert s.abs().max() > 8e5
    _check_extreme(q, k, v)
    _check_extreme(q, k, v, causal=True)


def test_all_equal_rows():
    g = seeded("equal")
    v = torch.randn(1, 3, 70, 32, generator=g).bfloat16()
    k = torch.ones(1, 3, 70, 32).bfloat16()
    for c in (0.0, 5.0, -5.0, 3e4, -3e4):  # S = c * 32 everywhere in the row
        q = torch.full((1, 3, 70, 32), c).bfloat16()
        _check_extreme(q, k, v)
        _check_extreme(q, k, v, causal=True)


def test_n_equals_one():
    g = seeded("n1")
    q, k, v = (torch.randn(2, 4, 1, 64, generator=g).bfloat16() * 1000 for _ in range(3))
    for stabilize in (False, True):
        o = flash_attention(q, k, v, stabilize=stabilize)
        assert torch.equal(o, v)  # softmax over one key is exactly 1


def test_stabilized_shift_is_the_papers_and_capped():
    r = torch.tensor([3.0, -3.0, 0.0, 20.0, 40.0, 1e6, -1e6, -40.5], dtype=torch.float64)
    d = stabilized_shift(r, beta=2.0, max_shift=46.0)
    # beta * r for r > 0 (d = (beta - 1) r), m = 0 for r < 0 (d = -r), nothing at 0; below the cap
    assert torch.allclose(d[:4], torch.tensor([3.0, 3.0, 0.0, 20.0], dtype=torch.float64), rtol=1e-12, atol=0)
    # from 46 bits on: 45 + frac(d in bits), so the shift keeps varying with r
    bits = r[4:].abs() * LOG2E
    assert torch.allclose(d[4:] * LOG2E, 45.0 + torch.frac(bits), rtol=1e-12, atol=0)
    assert (d[4:] * LOG2E < 46.0).all() and (d[4:] * LOG2E >= 45.0).all()
    # beta > 2 scales the positive side only
    assert math.isclose(stabilized_shift(torch.tensor([3.0], dtype=torch.float64), 4.0, 46.0).item(), 9.0, rel_tol=1e-12)
    assert max_shift_for(torch.bfloat16) == 46.0 and max_shift_for(torch.float16) < 8


# ---------------------------------------------------------------------------
# Probe counters on a handmade case


def _scores_as_qk(S: torch.Tensor, D: int = 16):
    """q, k with q k^T == S exactly (scale 1): q one-hot rows, k = S^T padded to D."""
    N, N_kv = S.shape
    q = torch.eye(N, D)[None, None]
    k = torch.zeros(N_kv, D)
    k[:, :N] = S.T
    return q.bfloat16(), k[None, None].bfloat16()


def test_multi_max_rows_counts_exactly():
    n_kv = 140  # three KV blocks of 64
    S = torch.linspace(-3, -1, n_kv).bfloat16().float().repeat(6, 1)
    # bfloat16 steps are 2^-10 in [0.125, 0.25): near-ties below 0.25 are exact numbers.
    S[0, [5, 9]] = 0.25  # exact tie inside one block -> counted
    S[1, [5, 100]] = 0.25  # exact tie across blocks -> counted
    S[2, 5], S[2, 130] = 0.25, 0.25 - 2 ** -10  # 9.8e-4 apart (< eps) across blocks -> counted
    S[3, 5], S[3, 70] = 0.25, 0.25 - 2 ** -8  # 3.9e-3 apart: a single maximum -> not counted
    S[4, [5, 6]] = 0.125  # tie in block 0, beaten by a single maximum later -> not counted
    S[4, 120] = 0.25
    S[5, 139] = 0.5  # single maximum -> not counted
    q, k = _scores_as_qk(S)
    v = torch.randn(1, 1, n_kv, 16, generator=seeded("mm")).bfloat16()
    assert torch.equal((q.float() @ k.float().transpose(-1, -2))[0, 0], S)
    for stabilize in (False, True):
        probe = Probe(1)
        o = flash_attention(q, k, v, scale=1.0, stabilize=stabilize, probe=probe)
        assert probe.multi_max_rows.tolist() == [3]
        assert probe.rows.tolist() == [6]
        assert probe.max_score.tolist() == [0.5]
        assert probe.nonfinite_rows.tolist() == [0]
        assert max_err(o, exact_attention(q, k, v, scale=1.0)) < 2 ** -7


def test_probe_accumulates_per_head_and_resets():
    g = seeded("probe")
    q = torch.randn(2, 3, 20, 32, generator=g).bfloat16()
    k, v = (torch.randn(2, 1, 20, 32, generator=g).bfloat16() for _ in range(2))
    probe = Probe(3)
    flash_attention(q, k, v, probe=probe)
    flash_attention(q, k, v, probe=probe, causal=True)
    assert probe.rows.tolist() == [80, 80, 80]
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(32)
    assert torch.allclose(probe.max_score.double(), s.amax(dim=(0, 2, 3)), rtol=1e-6)
    probe.zero_()
    assert probe.rows.tolist() == [0, 0, 0]
    assert probe.max_score.tolist() == [float("-inf")] * 3


def test_nonfinite_rows_are_counted():
    g = seeded("nan")
    q, k, v = (torch.randn(1, 2, 10, 32, generator=g).bfloat16() for _ in range(3))
    q[0, 1, 4, 0] = float("nan")
    probe = Probe(2)
    flash_attention(q, k, v, probe=probe)
    assert probe.nonfinite_rows.tolist() == [0, 1]


def test_probe_rejects_bad_construction():
    with pytest.raises(ValueError, match="num_heads"):
        Probe(0)
    with pytest.raises(ValueError, match="num_heads"):
        Probe(True)


def test_probe_views_and_copies():
    import copy

    probe = Probe(2)
    probe.rows.add_(3)
    assert probe.counts[0].tolist() == [3, 3]  # the attribute is a view into the buffer
    clone = copy.deepcopy(probe)
    assert clone.rows.tolist() == [3, 3] and clone.counts.data_ptr() != probe.counts.data_ptr()
    with pytest.raises(AttributeError):
        probe.no_such_statistic


# ---------------------------------------------------------------------------
# The paper's control: delta from a high-precision O


def _tie_grads(hp: bool, backend: str = "reference"):
    from instability_watch.experimental import high_precision_delta

    inp = near_tie_inputs(batch=1, heads=2, seq=64, generator=seeded("hp_delta"))
    probe = Probe(2)
    probe.shadow = True
    q = inp.q.clone().requires_grad_(True)
    with high_precision_delta(hp):
        o = flash_attention(q, inp.k, inp.v, probe=probe, backend=backend)
    o.backward(inp.do)
    return inp, o.detach(), q.grad, probe


def test_high_precision_delta_removes_the_delta_bias_and_leaves_the_forward():
    from instability_watch.kernels.attention.ops import HIGH_PRECISION_DELTA

    inp, o_std, dq_std, p_std = _tie_grads(False)
    _, o_hp, dq_hp, p_hp = _tie_grads(True)
    assert HIGH_PRECISION_DELTA.get() is False  # the context is undone
    assert torch.equal(o_std, o_hp)  # the forward is the standard kernel's
    # Standard: delta_lp - delta_hp one-signed and large; the control's delta is delta_hp.
    assert (p_std.delta_err_sum > 0).all()
    assert (p_hp.delta_err_abs * 50 <= p_std.delta_err_abs).all()
    # dQ moves towards the float64 gradient.
    q = inp.q.double().requires_grad_(True)
    o = torch.nn.functional.scaled_dot_product_attention(q, inp.k.double(), inp.v.double())
    o.backward(inp.do.double())
    err = lambda dq: (dq.double() - q.grad).abs().mean().item()  # noqa: E731
    assert not torch.equal(dq_std, dq_hp)
    assert err(dq_hp) < 0.7 * err(dq_std), (err(dq_hp), err(dq_std))


def test_high_precision_delta_rejects_non_bool():
    from instability_watch.experimental import high_precision_delta

    with pytest.raises(TypeError, match="enabled must be a bool"):
        with high_precision_delta("yes"):
            pass
