"""The observer's Triton kernels (kernels/triton_stats.py) on CPU, through Triton's interpreter
(with the BF16 shim), against their PyTorch oracle (kernels/stats.py).

Counts must be equal and ``max_score`` bitwise equal, so the inputs make every score
exact: small-integer q and k (every q.k is an exact float32 sum in any order), and
``eps = 2.5 * scale`` so that scores of distinct keys are >= 1 * scale apart and no
gap sits within rounding of ``eps`` (gaps of 1 and 2 units are ties, 3 are not).
Exact ties come from copied key vectors. The delta sums of the shadow pass are
float32 sums in another order: compared to ~1e-4.

Small sizes on purpose: the interpreter runs one program at a time and the tiles are
16 x 16 here (``_INTERPRETER_CONFIG``), so N = 97 crosses seven KV blocks with a
ragged tail. The same checks at large sizes on CUDA are in test_triton_stats_gpu.py.
"""
import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("the interpreter tests are for CPU-only machines", allow_module_level=True)
# numpy's complaints about the NaN and Inf these tests plant on purpose
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:All-NaN slice encountered:RuntimeWarning"
)

from instability_watch.kernels import stats  # noqa: E402
from instability_watch.kernels.common import MASK_FLOOR  # noqa: E402
from instability_watch.kernels.stats import triton as triton_stats  # noqa: E402
from instability_watch.probe.bank import Probe  # noqa: E402
from instability_watch.probe.fields import COUNT_FIELDS, VALUE_FIELDS

from helpers import seeded  # noqa: E402

V_MAXS, V_DSUM, V_DABS = (VALUE_FIELDS.index(n) for n in ("max_score", "delta_err_sum", "delta_err_abs"))


# ----------------------------------------------------------------------------- harness


def _probes(H, key):
    """Two probes with the same non-zero starting contents: the passes add into them."""
    g = seeded("prefill", *key)
    a = Probe(H)
    a.counts.copy_(torch.randint(0, 5, a.counts.shape, generator=g))
    a.values.copy_(torch.randn(a.values.shape, generator=g))
    a.values[V_MAXS, ::2] = float("-inf")  # even heads: nothing seen yet; odd ones: a maximum to beat
    b = Probe(H)
    b.counts.copy_(a.counts)
    b.values.copy_(a.values)
    return a, b


def check_stats(q, k, mask, o, *, causal, scale, eps):
    """Both statistics passes on the same inputs; returns the reference's increments."""
    tri, ref = _probes(q.shape[1], ("stats", tuple(q.shape), causal))
    start = ref.counts.clone()
    triton_stats.attention_stats(q, k, mask, o, tri.counts, tri.values, causal=causal, scale=scale, eps=eps)
    stats.stats_reference(q, k, mask, o, ref.counts, ref.values, causal=causal, scale=scale, eps=eps)
    for i, name in enumerate(COUNT_FIELDS):  # the shadow counters untouched, as in the reference
        assert tri.counts[i].tolist() == ref.counts[i].tolist(), name
    # exact scores: the maxima are bitwise equal; the delta sums untouched
    assert torch.equal(tri.values, ref.values), (tri.values, ref.values)
    return {name: (ref.counts[i] - start[i]) for i, name in enumerate(COUNT_FIELDS)}


def check_shadow(q, k, v, o, do, mask, *, causal, scale, **dropout):
    tri, ref = _probes(q.shape[1], ("shadow", tuple(q.shape), causal))
    start = ref.values.clone()
    triton_stats.attention_shadow(q, k, v, o, do, mask, tri.counts, tri.values, causal=causal, scale=scale, **dropout)
    stats.shadow_reference(q, k, v, o, do, mask, ref.counts, ref.values, causal=causal, scale=scale, **dropout)
    for i, name in enumerate(COUNT_FIELDS):
        assert tri.counts[i].tolist() == ref.counts[i].tolist(), name
    assert torch.equal(tri.values[V_MAXS], ref.values[V_MAXS])
    # float32 sums in another order (and exp vs the reference's exp): relative 1e-4, plus an
    # absolute term for heads whose signed sum cancels, scaled by the magnitude of delta
    mag = (do.float() * o.float()).abs().sum(dim=(0, 2, 3)).nan_to_num(0.0)
    for row in (V_DSUM, V_DABS):
        torch.testing.assert_close(tri.values[row], ref.values[row], rtol=1e-4, atol=1e-5 * mag.max().item() + 1e-5,
                                   equal_nan=True, msg=lambda m: f"{VALUE_FIELDS[row]}: {m}")
    return ref.values - start


def _ints(g, shape, dtype, lim=3):
    return torch.randint(-lim, lim + 1, shape, generator=g).to(dtype)


def _inputs(key, B, H, h_kv, N, n_kv, D, dv=None, dtype=torch.bfloat16):
    """Integer q, k (with exact ties planted by copying keys); random v, dO and an O to test."""
    g = seeded(*key)
    dv = D if dv is None else dv
    q = _ints(g, (B, H, N, D), dtype)
    k = _ints(g, (B, h_kv, n_kv, D), dtype)
    if n_kv >= 4:
        k[:, :, -1] = k[:, :, 0]  # different KV blocks (and, with 16-wide tiles, lanes)
        k[:, :, n_kv // 2] = k[:, :, 1]
    v = torch.randn(B, h_kv, n_kv, dv, generator=g).to(dtype)
    do = torch.randn(B, H, N, dv, generator=g).to(dtype)
    o = torch.randn(B, H, N, dv, generator=g).to(dtype)
    return q, k, v, o, do


def _mask(key, shape, kind, dtype=torch.float32):
    """A bool (True = attend) or additive mask of ``shape``, with a fully masked row."""
    g = seeded("mask", *key)
    keep = torch.rand(shape, generator=g) < 0.7
    keep[..., 2, :] = False  # a row with every key masked
    if kind == "bool":
        return keep
    # additive: masked entries written as -inf, finfo.min or MASK_FLOOR itself; visible ones
    # small multiples of 1/8 (exact: the scale is a power of two where these are used)
    fill = torch.tensor([float("-inf"), torch.finfo(dtype).min, MASK_FLOOR])
    masked_val = fill[torch.randint(0, 3, shape, generator=g)]
    visible = torch.randint(-8, 9, shape, generator=g) / 8.0
    return torch.where(keep, visible, masked_val).to(dtype)


def _run_both(q, k, v, o, do, mask, *, causal, scale):
    inc = check_stats(q, k, mask, o, causal=causal, scale=scale, eps=2.5 * scale)
    check_shadow(q, k, v, o, do, mask, causal=causal, scale=scale)
    return inc


# ----------------------------------------------------------------------------- grid

CASES = [
    # (N, N_kv, D, D_v, causal, (H, H_kv), B)
    (1, 1, 64, 64, False, (2, 2), 1),
    (1, 1, 64, 64, True, (4, 1), 2),
    (17, 17, 32, 32, True, (4, 2), 2),
    (17, 17, 32, 32, False, (4, 1), 1),
    (97, 97, 64, 64, True, (4, 2), 1),
    (97, 97, 64, 64, False, (2, 1), 1),
    (37, 37, 128, 128, True, (4, 1), 1),
    (17, 17, 256, 256, False, (2, 1), 1),
    (17, 17, 256, 256, True, (2, 2), 1),
    (37, 37, 40, 40, True, (2, 1), 1),  # odd head dim: a padded 64 tile
    (37, 37, 64, 32, True, (2, 2), 1),  # D_v != D
    (21, 45, 40, 80, False, (4, 2), 1),  # cross-attention lengths, odd dims
    (45, 21, 32, 32, True, (2, 1), 1),  # causal, N > N_kv: the last rows see every key
    (21, 45, 32, 32, True, (2, 1), 1),  # causal, N < N_kv
]


@pytest.mark.parametrize("N, n_kv, D, dv, causal, heads, B", CASES)
def test_matches_reference(N, n_kv, D, dv, causal, heads, B):
    H, h_kv = heads
    q, k, v, o, do = _inputs(("grid", N, n_kv, D, dv, causal, heads), B, H, h_kv, N, n_kv, D, dv)
    inc = _run_both(q, k, v, o, do, None, causal=causal, scale=D ** -0.5)
    assert inc["rows"].sum() == B * H * N and inc["masked_rows"].sum() == 0
    if N * n_kv >= 17 * 17:  # the tie test sees both kinds of rows
        assert 0 < inc["multi_max_rows"].sum() < B * H * N


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_other_dtypes(dtype, causal):
    q, k, v, o, do = _inputs(("dtype", dtype, causal), 1, 4, 2, 37, 37, 64, dtype=dtype)
    _run_both(q, k, v, o, do, None, causal=causal, scale=0.125)


MASKS = [
    # (mask shape as a function of (B, H, N, N_kv), kind, mask dtype)
    (lambda B, H, N, M: (N, M), "bool", None),
    (lambda B, H, N, M: (B, 1, N, M), "bool", None),
    (lambda B, H, N, M: (1, H, N, M), "bool", None),
    (lambda B, H, N, M: (B, 1, 1, M), "bool", None),  # a padding mask: no fully masked row
    (lambda B, H, N, M: (N, M), "add", torch.float32),
    (lambda B, H, N, M: (B, H, N, M), "add", torch.float32),
    (lambda B, H, N, M: (1, 1, N, M), "add", torch.bfloat16),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape, kind, mdtype", MASKS)
def test_masks(shape, kind, mdtype, causal):
    B, H, h_kv, N, n_kv, D = 2, 4, 2, 33, 33, 32
    q, k, v, o, do = _inputs(("mask", kind, mdtype, causal), B, H, h_kv, N, n_kv, D)
    sh = shape(B, H, N, n_kv)
    if sh[-2] == 1:
        mask = torch.rand(sh, generator=seeded("pad", causal)) < 0.8
    else:
        mask = _mask((kind, mdtype, sh, causal), sh, kind, mdtype)
    inc = _run_both(q, k, v, o, do, mask, causal=causal, scale=0.125)
    if sh[-2] != 1:
        assert inc["masked_rows"].sum() >= B * H  # row 2 of every head
    assert (inc["rows"] + inc["masked_rows"]).sum() == B * H * N


def _blocky(B, H, N, n_kv, kind):
    """Masks with structure in tiles, different per batch entry and head: documents (block-diagonal, boundaries
    off the 16-wide tiles), a sliding window, a band of keys nobody sees, rows that see nothing."""
    i, j = torch.arange(N)[:, None], torch.arange(n_kv)[None, :]
    keep = torch.zeros(B, H, N, n_kv, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            if (b + h) % 3 == 0:  # documents
                cut_q, cut_k = torch.tensor([0, 23 + 5 * h, 51, N]), torch.tensor([0, 30 + 3 * b, 64, n_kv])
                keep[b, h] = torch.bucketize(i, cut_q[1:], right=True) == torch.bucketize(j, cut_k[1:], right=True)
            elif (b + h) % 3 == 1:  # a sliding window of 9 + h
                keep[b, h] = (j <= i + 10) & (j > i + 10 - (9 + h))
            else:  # all but a band of keys, and rows 40-47 see nothing
                keep[b, h] = (j < 20) | (j >= 52)
                keep[b, h, 40:48] = False
    if kind == "bool":
        return keep
    return torch.where(keep, (i - j).remainder(5).float() / 8.0, float("-inf"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["bool", "add"])
def test_masks_whose_tiles_see_nothing_are_skipped_exactly(kind, causal, monkeypatch):
    """A mask's pre-pass gives each query tile the span of keys its rows may see; the passes loop over that span
    only (whole tiles nobody sees skipped), with the reference's numbers."""
    B, H, h_kv, N, n_kv, D = 2, 4, 2, 70, 90, 32
    q, k, v, o, do = _inputs(("blocky", kind, causal), B, H, h_kv, N, n_kv, D)
    mask = _blocky(B, H, N, n_kv, kind)
    seen = []
    real = triton_stats.mask_row_ranges

    def spy(*args):
        out = real(*args)
        seen.append(out[0])
        return out

    monkeypatch.setattr(triton_stats, "mask_row_ranges", spy)
    inc = _run_both(q, k, v, o, do, mask, causal=causal, scale=0.125)
    assert inc["masked_rows"].sum() >= 8 and (inc["rows"] + inc["masked_rows"]).sum() == B * H * N
    assert len(seen) == 2  # the statistics pass and the shadow pass
    lo, hi = seen[0][..., 0], seen[0][..., 1]
    assert (lo > 0).any() and (hi < n_kv).any()  # spans shorter than the keys: tiles were skipped


def test_additive_mask_with_fully_masked_rows_and_floor_values():
    """-inf, finfo.min, MASK_FLOOR itself (masked) and just above it (a visible, huge negative score)."""
    B, H, N, D = 1, 2, 20, 32
    q, k, v, o, do = _inputs(("floor",), B, H, H, N, N, D)
    mask = torch.zeros(N, N)
    mask[3] = float("-inf")
    mask[4] = torch.finfo(torch.float32).min
    mask[5, ::2], mask[5, 1::2] = float("-inf"), MASK_FLOOR
    mask[6, 1:], mask[6, 0] = float("-inf"), -1e29  # one visible key: t1 = -1e29
    mask[7, 5:], mask[7, :5] = float("-inf"), -0.25  # a few visible keys, lowered
    for causal in (False, True):
        inc = _run_both(q, k, v, o, do, mask, causal=causal, scale=0.125)
        assert inc["masked_rows"].tolist() == [3, 3]
        assert inc["rows"].tolist() == [N - 3, N - 3]


def test_nonfinite_rows():
    """NaN and +inf in q (whole rows NaN), NaN in one key (every row has a NaN score beside
    finite ones: not a tie), NaN/Inf in the call's O."""
    B, H, h_kv, N, D = 1, 4, 2, 33, 32
    q, k, v, o, do = _inputs(("nonfinite",), B, H, h_kv, N, N, D)
    q[0, 0, 5, 3] = float("nan")
    q[0, 1, 20, 0] = float("inf")
    k[0, 1, 7, 2] = float("nan")  # heads 2, 3: every row sees one NaN score
    o[0, 0, 30, 1] = float("inf")
    o[0, 3, 9, 0] = float("nan")
    for causal in (False, True):
        inc = check_stats(q, k, None, o, causal=causal, scale=0.125, eps=2.5 * 0.125)
        nan_rows = N - 7 if causal else N  # causal: rows before key 7 never see it
        assert inc["nonfinite_rows"].tolist() == [2, 1, nan_rows, nan_rows]  # head 3: O's NaN row sees key 7 too
        assert inc["rows"].tolist() == [N] * H
        assert inc["multi_max_rows"][2:].min() > 0  # the finite scores of those rows still count
        check_stats(q, k, None, None, causal=causal, scale=0.125, eps=2.5 * 0.125)  # without O
        check_shadow(q, k, v, o, do, None, causal=causal, scale=0.125)  # NaN rows make the sums NaN


def test_noncontiguous_inputs():
    """(B, N, H, D) storage seen as (B, H, N, D), as models pass it; and a strided last dim."""
    B, H, h_kv, N, D = 2, 4, 2, 29, 32
    q, k, v, o, do = _inputs(("strides",), B, H, h_kv, N, N, D)
    qt, kt, vt, ot, dot = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, o, do))
    assert not qt.is_contiguous()
    wide = torch.zeros(B, H, N, 2 * D, dtype=q.dtype)
    wide[..., ::2] = q
    qs = wide[..., ::2]  # last-dim stride 2
    mask = _mask(("strides",), (N, N), "bool").t().contiguous().t()  # column-major mask
    for causal in (False, True):
        for qq in (qt, qs):
            _run_both(qq, kt, vt, ot, dot, mask, causal=causal, scale=D ** -0.5)


def test_ties_near_ties_and_special_scores_count_exactly():
    """Hand-built score rows: S[i, j] = k[j, i] (one-hot queries), 40 keys = three 16-key
    blocks; ties in one block, across blocks in the same lane and in other lanes; near
    ties at eps/4 and 4*eps; NaN and +inf scores (through an additive mask)."""
    n_rows, n_kv, eps = 16, 40, 2.0 ** -6
    S = (torch.arange(n_kv) / 16.0 - 3.0).repeat(n_rows, 1)  # -3 .. -0.5625, exact in bf16
    multi = {  # row: (planted scores, repeated maximum?)
        0: ({2: 1.0, 9: 1.0}, True),  # tie in one block
        1: ({2: 1.0, 18: 1.0}, True),  # across blocks, same lane
        2: ({2: 1.0, 37: 1.0}, True),  # across blocks and lanes
        3: ({5: 1.0, 30: 1.0 - eps / 4}, True),  # near tie
        4: ({5: 1.0, 30: 1.0 - 4 * eps}, False),  # too far
        5: ({39: 1.0}, False),  # single maximum, in the ragged block
        6: ({1: 1.0, 17: 1.0, 33: 1.0}, True),  # three times, one lane
        7: ({4: 1.0, 20: 1.0 - eps / 4}, True),  # near tie, same lane, later block lower
        8: ({20: 1.0, 4: 1.0 - eps / 4}, True),  # ... later block higher
        9: ({4: 1.0, 20: 1.0 - 4 * eps, 21: 1.0 - eps / 4}, True),  # runner-up in another lane
        10: ({3: 1.0, 19: 1.0 - 4 * eps, 35: 1.0 - 4 * eps}, False),  # a tie below the maximum
        12: ({7: 1.0, 23: 1.0}, False),  # key 7 is NaN: no tie (NaN before the maximum, same lane)
        13: ({7: 1.0, 23: 1.0}, False),  # key 23 is NaN: no tie (NaN after the maximum, same lane)
        14: ({10: 1.0, 11: 1.0}, False),  # key 10 is +inf (head 1 only; head 0: a tie)
        15: ({}, False),
    }
    for i, (planted, _) in multi.items():
        for j, val in planted.items():
            S[i, j] = val
    q = torch.eye(n_rows, 16)[None, None].repeat(1, 2, 1, 1).bfloat16()  # (1, 2, 16, 16)
    k = S.t().contiguous()[None, None].bfloat16()  # (1, 1, 40, 16): one KV head for both
    assert torch.equal(k[0, 0].float().t(), S)
    mask = torch.zeros(1, 2, n_rows, n_kv)
    mask[0, :, 11] = float("-inf")  # row 11 fully masked
    mask[0, :, 12, 7] = mask[0, :, 13, 23] = float("nan")
    mask[0, 1, 14, 10] = float("inf")
    mask[0, :, 15, 1:] = torch.finfo(torch.float32).min  # one visible key
    inc = check_stats(q, k, mask, None, causal=False, scale=1.0, eps=eps)
    expect = sum(m for _, m in multi.values())
    assert inc["multi_max_rows"].tolist() == [expect + 1, expect]  # head 0 row 14: tie
    assert inc["masked_rows"].tolist() == [1, 1]
    assert inc["nonfinite_rows"].tolist() == [2, 3]
    assert inc["rows"].tolist() == [15, 15]
    # the raw-score path (no additive mask: t1, t2 tracked on q.k, scaled at the end)
    for scale in (1.0, 0.5):
        inc = check_stats(q, k, None, None, causal=False, scale=scale, eps=eps * scale)
        assert inc["multi_max_rows"].tolist() == [expect + 3] * 2  # rows 12, 13, 14 tie without NaN
        bool_mask = torch.ones(n_rows, n_kv, dtype=torch.bool)
        bool_mask[11] = False
        inc = check_stats(q, k, bool_mask, None, causal=True, scale=scale, eps=eps * scale)
        assert inc["masked_rows"].tolist() == [1, 1]


def test_accumulates_across_calls():
    """A second call adds to the first (counts) and keeps the running maximum."""
    q, k, v, o, do = _inputs(("twice",), 1, 2, 1, 17, 17, 32)
    tri, ref = Probe(2), Probe(2)
    for scale, causal in ((0.125, False), (0.25, True)):
        kw = dict(causal=causal, scale=scale)
        triton_stats.attention_stats(q, k, None, o, tri.counts, tri.values, eps=2.5 * scale, **kw)
        stats.stats_reference(q, k, None, o, ref.counts, ref.values, eps=2.5 * scale, **kw)
        triton_stats.attention_shadow(q, k, v, o, do, None, tri.counts, tri.values, **kw)
        stats.shadow_reference(q, k, v, o, do, None, ref.counts, ref.values, **kw)
    assert torch.equal(tri.counts, ref.counts)
    assert tri.rows.tolist() == [34, 34] and tri.shadow_rows.tolist() == [34, 34]
    torch.testing.assert_close(tri.values, ref.values, rtol=1e-4, atol=1e-4)


def test_shadow_with_accurate_output():
    """O = the exact attention output rounded to bf16: delta_lp - delta_hp is the rounding's drift,
    small against delta itself; the sums still agree to ~1e-4 of it."""
    B, H, h_kv, N, D = 1, 4, 2, 41, 64
    q, k, v, _, do = _inputs(("accurate",), B, H, h_kv, N, N, D)
    q = q.float().mul(0.5).bfloat16()  # softer scores: many keys weigh in
    for causal in (False, True):
        s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * D ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        o = (s.softmax(-1) @ v.double().repeat_interleave(2, 1)).bfloat16()
        inc = check_shadow(q, k, v, o, do, None, causal=causal, scale=D ** -0.5)
        assert (inc[V_DABS] > 0).all()


@pytest.mark.parametrize("causal, mask_kind, heads", [(True, None, (4, 2)), (False, "bool", (2, 1)), (False, "additive", (2, 2))])
def test_shadow_with_dropout_regenerates_the_calls_keep_mask(causal, mask_kind, heads):
    """A call with dropout (on our kernels): the shadow's delta_hp uses the call's keep mask, from its seed.

    The Triton pass equals the reference, and the sums differ from a shadow without the mask (or
    with another seed's), so the mask is really applied."""
    from instability_watch.kernels import dropout_seed

    H, h_kv = heads
    B, N, D, p = 2, 45, 32, 0.3
    q, k, v, o, do = _inputs(("dropout", causal, mask_kind, heads), B, H, h_kv, N, N, D)
    mask = None if mask_kind is None else _mask(("dropout", mask_kind), (B, 1, N, N), mask_kind)
    seed = dropout_seed(torch.Generator().manual_seed(5), "cpu")
    inc = check_shadow(q, k, v, o, do, mask, causal=causal, scale=D ** -0.5, dropout_p=p, seed=seed)
    other = check_shadow(q, k, v, o, do, mask, causal=causal, scale=D ** -0.5, dropout_p=p, seed=seed + 1)
    plain = check_shadow(q, k, v, o, do, mask, causal=causal, scale=D ** -0.5)
    assert not torch.allclose(inc[V_DSUM], other[V_DSUM], rtol=1e-3) and not torch.allclose(inc[V_DSUM], plain[V_DSUM], rtol=1e-3)


# ----------------------------------------------------------------------------- packed calls (documents)


@pytest.mark.parametrize("case", ["causal", "window", "cross_lengths", "tail", "gqa_bf16"])
def test_document_statistics_match_the_reference(case):
    """The statistics kernel with a document mask (a varlen call) against the PyTorch path, which is checked
    against float64 documents one by one in tests/observe/test_varlen.py: counts equal, max_score bitwise."""
    from instability_watch.kernels.stats.varlen import VarlenCall, varlen_stats

    g = seeded("docs_interp", case)
    H, h_kv, D = 4, (2 if case == "gqa_bf16" else 4), 16
    cu_q = [0, 37, 50, 61, 97]
    cu_k = [0, 40, 61, 70, 97] if case == "cross_lengths" else cu_q
    t_q = cu_q[-1] + (9 if case == "tail" else 0)
    dtype = torch.bfloat16 if case == "gqa_bf16" else torch.float32
    q = torch.randint(-2, 3, (t_q, H, D), generator=g).to(dtype)
    k = torch.randint(-2, 3, (cu_k[-1], h_kv, D), generator=g).to(dtype)
    o = torch.randn(t_q, H, D, generator=g)
    o[40, 1, 3] = float("nan")
    causal = case != "window"
    window = (11, 4) if case == "window" else (-1, 0)
    call = VarlenCall(q, k, k, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                      causal, 0.25, window, False)
    tri, ref = _probes(H, ("docs", case))
    varlen_stats(call, o, tri.counts, tri.values, eps=0.6, triton=True)
    varlen_stats(call, o, ref.counts, ref.values, eps=0.6, triton=False)
    for i, name in enumerate(COUNT_FIELDS):
        assert tri.counts[i].tolist() == ref.counts[i].tolist(), name
    assert torch.equal(tri.values[V_MAXS], ref.values[V_MAXS])
    assert (ref.counts[COUNT_FIELDS.index("multi_max_rows")] > 0).all()


@pytest.mark.parametrize("case", ["causal", "window", "tail"])
def test_document_shadow_matches_the_reference(case):
    from instability_watch.kernels.stats.varlen import VarlenCall, varlen_shadow

    g = seeded("docs_shadow_interp", case)
    H, h_kv, D = 4, 2, 16
    cu = torch.tensor([0, 37, 50, 97], dtype=torch.int32)
    t_q = 97 + (9 if case == "tail" else 0)
    q = torch.randn(t_q, H, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(97, h_kv, D, generator=g).to(torch.bfloat16) for _ in range(2))
    o, do = (torch.randn(t_q, H, D, generator=g).to(torch.bfloat16) for _ in range(2))
    window = (11, 4) if case == "window" else (-1, 0)
    call = VarlenCall(q, k, v, cu, cu, case != "window", 0.25, window, False)
    tri, ref = _probes(H, ("docs_shadow", case))
    varlen_shadow(call, o, do, tri.counts, tri.values, triton=True)
    varlen_shadow(call, o, do, ref.counts, ref.values, triton=False)
    for i, name in enumerate(COUNT_FIELDS):
        assert tri.counts[i].tolist() == ref.counts[i].tolist(), name
    torch.testing.assert_close(tri.values[V_DSUM], ref.values[V_DSUM], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tri.values[V_DABS], ref.values[V_DABS], rtol=1e-4, atol=1e-4)
