"""The observer's statistics and shadow passes against an independent float64 recomputation.

Integer-valued inputs with a power-of-two scale make every score exact in
float32, so the counts must agree exactly: ties, near-ties inside and beyond
``eps`` (scores differ by multiples of 2^-10 ~ 0.98e-3, and eps = 1e-3 is not
one of them), masked keys and fully masked rows included.
"""
import math

import pytest
import torch

from instability_watch.kernels import stats as st
from instability_watch.probe.bank import Probe

from helpers import seeded

EPS = 1e-3
SCALE = 2.0 ** -10


def float64_stats(q, k, mask, o, *, causal, scale, eps):
    """Per head: rows, multi_max_rows, masked_rows, nonfinite_rows, max_score (float64, written from the definition)."""
    B, H, N, D = q.shape
    g = H // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)
    s = scale * (q.double() @ kk.transpose(-1, -2))  # (B, H, N, N_kv)
    masked = torch.zeros_like(s, dtype=torch.bool)
    if causal:
        masked |= torch.ones(N, k.shape[2], dtype=torch.bool).triu(1)
    if mask is not None:
        m = mask.expand(B, H, N, k.shape[2]) if mask.dim() == 4 else mask.expand(B, H, N, k.shape[2])
        if m.dtype == torch.bool:
            masked |= ~m
        else:
            masked |= m.double() <= -1e30
            s = s + m.double()
    s = s.masked_fill(masked, -math.inf)
    out = {n: [0] * H for n in ("rows", "multi", "masked", "nonfinite")}
    out["max"] = [-math.inf] * H
    for b in range(B):
        for h in range(H):
            for i in range(N):
                row = [x for x in s[b, h, i].tolist() if x != -math.inf]
                if not row:
                    out["masked"][h] += 1
                    continue
                out["rows"][h] += 1
                if any(math.isnan(x) for x in row) or max(row) == math.inf or (
                        o is not None and not torch.isfinite(o[b, h, i]).all()):
                    out["nonfinite"][h] += 1
                finite = sorted((x for x in row if not math.isnan(x)), reverse=True)
                if len(finite) > 1 and math.isfinite(finite[0]) and finite[1] >= finite[0] - eps:
                    out["multi"][h] += 1
                if finite:
                    out["max"][h] = max(out["max"][h], finite[0])
    return out


def float64_shadow(q, k, v, o, do, mask, *, causal, scale):
    """Per head: sum over unmasked rows of rowsum(dO * O) - rowsum(dO * softmax(S) V), in float64."""
    B, H, N, D = q.shape
    g = H // k.shape[1]
    kk, vv = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    s = scale * (q.double() @ kk.transpose(-1, -2))
    masked = torch.zeros_like(s, dtype=torch.bool)
    if causal:
        masked |= torch.ones(N, k.shape[2], dtype=torch.bool).triu(1)
    if mask is not None:
        m = mask.expand(B, H, N, k.shape[2])
        masked |= ~m if m.dtype == torch.bool else (m.double() <= -1e30)
        if m.dtype != torch.bool:
            s = s + m.double()
    s = s.masked_fill(masked, -math.inf)
    live = ~masked.all(dim=-1)
    p = torch.softmax(torch.where(live[..., None], s, 0.0), dim=-1)
    o_hp = p @ vv
    err = (do.double() * o.double()).sum(-1) - (do.double() * o_hp).sum(-1)
    return torch.where(live, err, 0.0).sum(dim=(0, 2)), live.sum(dim=(0, 2))


def integer_inputs(B, H, H_kv, N, N_kv, D, key, dtype=torch.bfloat16):
    g = seeded("stats", key)
    q = torch.randint(-2, 3, (B, H, N, D), generator=g).to(dtype)
    k = torch.randint(-2, 3, (B, H_kv, N_kv, D), generator=g).to(dtype)
    if N_kv > 3:  # exact ties: a repeated key
        k[:, :, 3] = k[:, :, 1]
    return q, k, g


def make_mask(kind, B, H, N, N_kv, g):
    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(B, 1, N, N_kv, generator=g) > 0.3
        m[0, 0, min(2, N - 1)] = False  # a fully masked row
        return m
    if kind == "bool-2d":
        return torch.rand(N, N_kv, generator=g) > 0.5
    # additive, per head, multiples of 2^-10 (exact), -inf, finfo.min and a fully masked row
    m = torch.randint(-8, 9, (1, H, N, N_kv), generator=g).float() * SCALE
    m[..., 0] = -math.inf
    if N_kv > 1:
        m[..., N - 1 if N > 1 else 0, :] = torch.finfo(torch.float32).min
    return m.to(torch.bfloat16) if kind == "additive-bf16" else m


CASES = [
    # N, N_kv, D, H, H_kv, causal, mask
    (1, 1, 32, 4, 4, False, None),
    (17, 17, 64, 4, 2, True, None),
    (17, 17, 32, 4, 4, False, "bool"),
    (97, 97, 128, 4, 1, True, None),
    (97, 97, 64, 4, 2, False, "additive"),
    (97, 33, 32, 2, 2, False, "bool-2d"),
    (256, 256, 256, 2, 1, True, None),
    (256, 256, 32, 2, 2, False, "additive-bf16"),
    (17, 17, 256, 4, 2, False, "bool"),
]


@pytest.mark.parametrize("N,N_kv,D,H,H_kv,causal,mask_kind", CASES)
def test_statistics_pass_equals_float64(N, N_kv, D, H, H_kv, causal, mask_kind):
    B = 2
    q, k, g = integer_inputs(B, H, H_kv, N, N_kv, D, (N, N_kv, D, H, H_kv, causal, mask_kind))
    mask = make_mask(mask_kind, B, H, N, N_kv, g)
    probe = Probe(H)
    st.attention_stats(q, k, mask, None, probe.counts, probe.values, causal=causal, scale=SCALE, eps=EPS)
    ref = float64_stats(q, k, mask, None, causal=causal, scale=SCALE, eps=EPS)
    assert probe.rows.tolist() == ref["rows"] == probe.tie_rows.tolist()
    assert probe.multi_max_rows.tolist() == ref["multi"]
    assert probe.masked_rows.tolist() == ref["masked"]
    assert probe.nonfinite_rows.tolist() == ref["nonfinite"] == [0] * H
    torch.testing.assert_close(probe.max_score.double(), torch.tensor(ref["max"], dtype=torch.float64),
                               rtol=2 ** -23, atol=0)
    if N * N_kv > 100 and mask_kind is None:  # the cases hold both kinds of rows, so both outcomes are tested
        assert 0 < sum(ref["multi"]) < sum(ref["rows"])


def test_counts_planted_ties_and_near_ties_exactly():
    """One row each: an exact tie, a near tie inside eps, one beyond eps, a single maximum, masked keys."""
    H, N_kv, D = 1, 8, 32
    q = torch.zeros(1, H, 5, D, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    k = torch.zeros(1, H, N_kv, D, dtype=torch.bfloat16)
    k[0, 0, :, 0] = torch.tensor([8.0, 8.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0])  # keys 0 and 1 tie at 8 * scale
    bias = torch.zeros(1, 1, 5, N_kv)
    bias[0, 0, 1, 1] = -EPS / 4    # inside eps: still a repeated maximum
    bias[0, 0, 2, 1] = -4 * EPS    # beyond eps: a single maximum
    bias[0, 0, 3, 0] = -math.inf   # key 0 masked: key 1 alone at the top
    bias[0, 0, 4, :] = -math.inf   # fully masked
    probe = Probe(H)
    st.attention_stats(q, k, bias, None, probe.counts, probe.values, causal=False, scale=1.0, eps=EPS)
    assert probe.rows.tolist() == [4] and probe.masked_rows.tolist() == [1]
    assert probe.multi_max_rows.tolist() == [2]  # rows 0 (exact tie) and 1 (inside eps)
    assert probe.max_score.tolist() == [8.0]


def test_nonfinite_rows_and_running_maximum():
    q, k, _ = integer_inputs(1, 2, 2, 9, 9, 32, "nonfinite")
    q[0, 0, 4, 0] = float("nan")  # row 4 of head 0: NaN scores
    o = torch.zeros(1, 2, 9, 32)
    o[0, 1, 7, 3] = float("inf")  # row 7 of head 1: a broken output
    probe = Probe(2)
    probe.values[0].fill_(1e4)  # the running maximum only grows
    st.attention_stats(q, k, None, o, probe.counts, probe.values, causal=True, scale=SCALE, eps=EPS)
    assert probe.nonfinite_rows.tolist() == [1, 1]
    assert probe.max_score.tolist() == [1e4, 1e4]
    ref = float64_stats(q, k, None, o, causal=True, scale=SCALE, eps=EPS)
    assert probe.nonfinite_rows.tolist() == ref["nonfinite"]
    assert probe.multi_max_rows.tolist() == ref["multi"]  # a NaN row never counts as a tie


@pytest.mark.parametrize("causal,mask_kind,H_kv", [(True, None, 2), (False, "bool", 4), (False, "additive", 1)])
def test_shadow_pass_equals_float64(causal, mask_kind, H_kv):
    B, H, N, D = 2, 4, 33, 64
    g = seeded("shadow", causal, mask_kind)
    q, k, v = (torch.randn(B, h, N, D, generator=g).to(torch.bfloat16) for h in (H, H_kv, H_kv))
    mask = make_mask(mask_kind, B, H, N, N, g)
    o = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    do = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    probe = Probe(H)
    st.attention_shadow(q, k, v, o, do, mask, probe.counts, probe.values, causal=causal, scale=0.125)
    err, live = float64_shadow(q, k, v, o, do, mask, causal=causal, scale=0.125)
    assert probe.shadow_rows.tolist() == live.tolist()
    torch.testing.assert_close(probe.delta_err_sum.double(), err, rtol=1e-5, atol=1e-3)
    assert (probe.delta_err_abs >= probe.delta_err_sum.abs()).all()


@pytest.mark.parametrize("causal,mask_kind,H_kv", [(True, None, 2), (False, "bool", 4)])
def test_shadow_pass_with_dropout_equals_float64(causal, mask_kind, H_kv):
    """delta_hp of a call with dropout: rowsum(dO * O_hp), O_hp = (keep * softmax(S) / (1 - p)) V in float64."""
    from instability_watch.kernels import dropout_mask, dropout_seed
    from instability_watch.kernels.common import dropout_scale

    B, H, N, D, p = 2, 4, 33, 32, 0.25
    g = seeded("shadow-dropout", causal, mask_kind)
    q, k, v = (torch.randn(B, h, N, D, generator=g).to(torch.bfloat16) for h in (H, H_kv, H_kv))
    mask = make_mask(mask_kind, B, H, N, N, g)
    o, do = (torch.randn(B, H, N, D, generator=g).to(torch.bfloat16) for _ in range(2))
    seed = dropout_seed(torch.Generator().manual_seed(3), "cpu")
    keep = dropout_mask(seed, B, H, N, N, p)
    # the float64 oracle with the same keep mask folded into v's weights: O_hp = (keep * P / (1 - p)) V
    s = 0.125 * (q.double() @ k.double().repeat_interleave(H // H_kv, 1).transpose(-1, -2))
    masked = torch.zeros_like(s, dtype=torch.bool)
    if causal:
        masked |= torch.ones(N, N, dtype=torch.bool).triu(1)
    if mask is not None:
        masked |= ~mask.expand(B, H, N, N)
    live = ~masked.all(-1)
    prob = torch.softmax(torch.where(live[..., None], s.masked_fill(masked, -math.inf), 0.0), -1)
    o_hp = (prob * keep * dropout_scale(p)) @ v.double().repeat_interleave(H // H_kv, 1)
    err = torch.where(live, (do.double() * o.double()).sum(-1) - (do.double() * o_hp).sum(-1), 0.0).sum(dim=(0, 2))
    probe = Probe(H)
    st.attention_shadow(q, k, v, o, do, mask, probe.counts, probe.values, causal=causal, scale=0.125,
                        dropout_p=p, seed=seed)
    assert probe.shadow_rows.tolist() == live.sum(dim=(0, 2)).tolist()
    torch.testing.assert_close(probe.delta_err_sum.double(), err, rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="seed"):
        st.attention_shadow(q, k, v, o, do, mask, probe.counts, probe.values, causal=causal, scale=0.125, dropout_p=p)


def test_shadow_of_the_true_output_is_its_rounding_only():
    """With O = softmax(S) V in float64 (no P rounded), delta_lp - delta_hp is the output's float32 rounding."""
    B, H, N, D = 1, 2, 40, 32
    g = seeded("true-output")
    q, k, v, do = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
    o = torch.softmax(0.2 * q.double() @ k.double().transpose(-1, -2), dim=-1) @ v.double()
    probe = Probe(H)
    st.attention_shadow(q, k, v, o.float(), do, None, probe.counts, probe.values, causal=False, scale=0.2)
    assert (probe.delta_err_abs < 1e-4 * N).all()


def test_chunked_path_gives_the_same_counts(monkeypatch):
    q, k, g = integer_inputs(2, 4, 2, 97, 97, 64, "chunks")
    full, chunked = Probe(4), Probe(4)
    st.attention_stats(q, k, None, None, full.counts, full.values, causal=True, scale=SCALE, eps=EPS)
    monkeypatch.setattr(st.reference, "CHUNK_ELEMENTS", 2 * 4 * 97 * 5)  # 5 query rows at a time
    st.attention_stats(q, k, None, None, chunked.counts, chunked.values, causal=True, scale=SCALE, eps=EPS)
    assert torch.equal(full.counts, chunked.counts) and torch.equal(full.values, chunked.values)


def test_statistics_are_computed_outside_the_callers_autocast():
    """Inside a bf16 autocast region the pass still computes S in float32 (no rounding of S to BF16)."""
    g = seeded("autocast")
    q = torch.randn(1, 2, 64, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 2, 64, 64, generator=g).to(torch.bfloat16)
    plain, inside = Probe(2), Probe(2)
    st.attention_stats(q, k, None, None, plain.counts, plain.values, causal=True, scale=0.125, eps=EPS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        st.attention_stats(q, k, None, None, inside.counts, inside.values, causal=True, scale=0.125, eps=EPS)
    assert torch.equal(plain.counts, inside.counts) and torch.equal(plain.values, inside.values)
