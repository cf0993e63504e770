"""Triton kernels of the observer's passes: the statistics pass and the shadow pass.

The definitions are those of the ``stats`` package (its docstring; ``reference.py``'s
``stats_reference`` and ``shadow_reference`` are the test oracle). One kernel, two variants chosen by
the ``SHADOW`` constexpr; both share the program layout (a tile of ``BLOCK_M``
query rows of one head against the KV blocks it may see) and one score helper:

* ``S = scale * (q.k)`` in float32 from the inputs' dtype (float32 inputs: exact
  float32 dots), then the additive mask added, masked keys at ``-inf``, NaN kept.
  The product and the sum are rounded separately, as in the reference (the
  statistics kernel is compiled without FMA contraction).
* Statistics (``SHADOW=False``): no ``P V`` and no exponentials. Each row keeps
  its two largest scores *per lane* (column of the KV tile) across the KV blocks:
  three min/max per score, nothing across lanes; NaN drops out because Triton's
  ``minimum``/``maximum`` return the other operand (``minnum``/``maxnum``). A NaN
  among the visible scores makes the block's row sum NaN (one add per score):
  that is the row's NaN flag. The lanes are merged into ``t1``, ``t2`` once, at
  the end. Without an additive mask the tracking is on the raw ``q.k`` and the
  scale is applied to ``t1``, ``t2`` at the end (rounding a product by a positive
  scale is monotone, so this is the same two numbers).
* Shadow (``SHADOW=True``): an online softmax over the same scores, ``P`` in
  float32, ``dP = dO V^T`` on tensor cores with float32 accumulation, and the two
  row sums ``l = sum P`` and ``a = sum P dP``: ``delta_hp = a / l``. ``O_hp`` is
  never formed.

Per-row results are reduced inside the program; each program issues one relaxed
atomic per statistic of its head, skipped when it would add nothing.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from instability_watch.kernels.attention.masks import mask_row_ranges
from instability_watch.kernels.common import dropout_scale, dropout_threshold, mask4
from instability_watch.kernels.configs import head_dim_tile, launch_config
from instability_watch.kernels.launch import INTERPRET, Launcher, cdiv, dot_precision
from instability_watch.kernels.triton_common import (
    C_DPOS,
    C_MASKED,
    C_MULTI,
    C_NONFINITE,
    C_ROWS,
    C_SHADOW,
    C_TIE_ROWS,
    FLOOR,
    V_DABS,
    V_DSUM,
    V_MAXS,
    document_scores,
    dropout_keep,
    dropout_key,
)

# ---------------------------------------------------------------------------
# Helpers


@triton.jit
def _load_block(blk, start_n, stride_n, cols, offs_d, N_KV, D, MASK_KV: tl.constexpr, EVEN_D: tl.constexpr):
    """The (BLOCK_N, HEAD_DIM) block of keys or values ``cols = start_n + offs_n``, ``blk``
    pointing at the block of ``start_n = 0``: rows past ``N_KV`` (with ``MASK_KV``) and padded
    head dims (``offs_d >= D``) read as 0."""
    if MASK_KV:
        return tl.load(blk + start_n * stride_n, mask=(cols[:, None] < N_KV) & (offs_d[None, :] < D), other=0.0)
    elif EVEN_D:
        return tl.load(blk + start_n * stride_n)
    else:
        return tl.load(blk + start_n * stride_n, mask=offs_d[None, :] < D, other=0.0)


@triton.jit
def _scores(
    q, K_blk, M_blk, start_n, offs_m, offs_n, offs_d, row_ok, N_KV, D, scale,
    stride_kn, stride_mn, Docs, N_Q, win_l, win_r,
    MASK_CAUSAL: tl.constexpr, MASK_KV: tl.constexpr, MASK_KIND: tl.constexpr, SCALED: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Scores of the query tile ``q`` against keys ``start_n + offs_n``: (BLOCK_M, BLOCK_N) float32.

    ``scale * (q.k)`` (``SCALED``; else the raw ``q.k``), plus the additive mask;
    masked keys (causal, the call's mask, past ``N_KV``) at ``-inf``; NaN kept.
    ``K_blk`` and ``M_blk`` point at the tile of keys/mask entries of ``start_n = 0``.
    """
    cols = start_n + offs_n
    # -- the K block; keys past N_KV and padded head dims read as 0
    k = _load_block(K_blk, start_n, stride_kn, cols, offs_d, N_KV, D, MASK_KV, EVEN_D)
    # -- q.k in float32 (tensor cores for bf16/fp16, exact products for float32), then the scale
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SCALED:
        s = s * scale
    # -- documents (a packed call, MASK_KIND 3): a key is seen from its own document only, within the
    #    window (bottom-right aligned positions; win_l / win_r < 0: unbounded); Docs is the document vector
    if MASK_KIND == 3:
        s = document_scores(s, Docs, offs_m, cols, N_Q, N_KV, win_l, win_r, False)
    # -- the call's mask: a bool mask selects, an additive one is added (NaN in it is not
    #    "masked": it makes the score NaN, as in the reference)
    elif MASK_KIND != 0:
        m_ok = row_ok[:, None]
        if MASK_KV:
            m_ok = m_ok & (cols[None, :] < N_KV)
        if MASK_KIND == 1:
            keep = tl.load(M_blk + start_n * stride_mn, mask=m_ok, other=0)
            s = tl.where(keep != 0, s, float("-inf"))
        else:
            bias = tl.load(M_blk + start_n * stride_mn, mask=m_ok, other=0.0).to(tl.float32)
            s = tl.where(bias <= FLOOR, float("-inf"), s + bias)
    # -- causal (top-left: key j visible from row i iff j <= i) and the ragged last block
    if MASK_CAUSAL:
        s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
    if MASK_KV:
        s = tl.where(cols[None, :] < N_KV, s, float("-inf"))
    return s


# ---------------------------------------------------------------------------
# Inner loops


@triton.jit
def _stats_inner(
    top1, top2, poison,
    q, K_blk, M_blk, offs_m, offs_n, offs_d, row_ok, N_KV, D, scale, stride_kn, stride_mn,
    lo, hi, Docs, N_Q, win_l, win_r,
    MASK_CAUSAL: tl.constexpr, MASK_KV: tl.constexpr, MASK_KIND: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # State: per (row, lane) the largest and second largest score seen in that lane
    # (repeats counted), -inf until seen; per row a NaN flag.
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        s = _scores(q, K_blk, M_blk, start_n, offs_m, offs_n, offs_d, row_ok, N_KV, D, scale, stride_kn, stride_mn,
                    Docs, N_Q, win_l, win_r, MASK_CAUSAL, MASK_KV, MASK_KIND, SCALED, EVEN_D, DOT_PRECISION)
        # -- NaN flag: a visible NaN makes the row's sum NaN. So does +inf beside a -inf
        #    (masked) entry, harmlessly: such a row's t1 is +inf, non-finite anyway, and
        #    not masked either way.
        blk = tl.sum(s, 1)
        poison = poison | (blk != blk)
        # -- insert s into each lane's top two: second = median(top2, top1, s). With
        #    minnum/maxnum semantics a NaN s leaves both unchanged (the reference reads
        #    NaN as -inf for the top two).
        top2 = tl.minimum(top1, tl.maximum(top2, s))
        top1 = tl.maximum(top1, s)
    return top1, top2, poison


@triton.jit
def _shadow_inner(
    m_i, l_i, a_i,
    q, do, K_blk, V_blk, M_blk, offs_m, offs_n, offs_d, offs_dv, row_ok, N_KV, D, DV, scale,
    stride_kn, stride_vn, stride_mn,
    lo, hi, k0, k1, drop_thr, off_bh, Docs, N_Q, win_l, win_r,
    MASK_CAUSAL: tl.constexpr, MASK_KV: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # State per row: m the running maximum score (-inf until one is seen), l = sum P and
    # a = sum P dP (with dropout: over the kept entries), both relative to m (rescaled
    # when m moves).
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        s = _scores(q, K_blk, M_blk, start_n, offs_m, offs_n, offs_d, row_ok, N_KV, D, scale, stride_kn, stride_mn,
                    Docs, N_Q, win_l, win_r, MASK_CAUSAL, MASK_KV, MASK_KIND, True, EVEN_D, DOT_PRECISION)
        # -- the V block
        cols = start_n + offs_n
        v = _load_block(V_blk, start_n, stride_vn, cols, offs_dv, N_KV, DV, MASK_KV, EVEN_DV)
        # -- online softmax in float32. The shift is 0 while a row has seen nothing but
        #    -inf (masked keys give P = 0, not NaN); a NaN score gives P = NaN, so l and a
        #    turn NaN (as the reference's row); a +inf score gives exp(inf - inf) = NaN too.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m_i - shift)  # 0 while m_i is -inf
        p = tl.exp(s - shift[:, None])
        # -- dP = dO V^T, float32 accumulation; l and a
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:  # the call's keep mask, regenerated as its kernels do; 1/(1-p) applied at the end
            pdp = tl.where(dropout_keep(k0, k1, drop_thr, off_bh, offs_m, start_n, BLOCK_M, BLOCK_N), p * dp, 0.0)
        else:
            pdp = p * dp
        a_i = a_i * alpha + tl.sum(pdp, 1)
        m_i = m_new
    return m_i, l_i, a_i


# ---------------------------------------------------------------------------
# Kernel


@triton.jit
def _attn_stats(
    Q, K, V, O, DO, Mask, Ranges, Counts, Values, Seed,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_dob, stride_doh, stride_don,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_rb, stride_rh, stride_rm,
    H, GROUP, N_Q, N_KV, D, DV,
    scale, eps, drop_thr, drop_scale, n_docs, win_l, win_r,
    SHADOW: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, SCALED: tl.constexpr,
    HAS_RANGES: tl.constexpr, HAS_O: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One tile of BLOCK_M query rows of one head: its statistics (or shadow sums) added to the head's counters."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(SCALED or not (SHADOW or MASK_KIND == 2), "P and an additive mask need the scaled score")
    tl.static_assert(HAS_O or not SHADOW, "the shadow pass reads O")
    if CAUSAL:
        # the longest rows first: the last tiles of the grid are the short ones
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)  # 64-bit base offsets: a (B, H, N, N_kv) mask can pass 2^31 entries
    off_h = off_bh % H  # the column of the probe buffers
    off_h64 = off_h.to(tl.int64)
    off_hk = (off_h // GROUP).to(tl.int64)  # grouped-query attention: the KV head this query head reads

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DV)
    row_ok = offs_m < N_Q
    if MASK_KIND == 3:
        # Mask: int64 [doc_q (N_Q), pos_q (N_Q), doc_k (N_KV), pos_k (N_KV), cu_k (n_docs + 1)]; rows past
        # the last document (doc n_docs) count nowhere; the tile's keys: the span its rows may see (their
        # documents, cut by the window: a row's own key position is its document's start + pos_q)
        doc_r = tl.load(Mask + offs_m, mask=row_ok, other=n_docs)
        row_ok = row_ok & (doc_r < n_docs)
        Cu = Mask + 2 * N_Q + 2 * N_KV
        d_r = tl.minimum(doc_r, n_docs - 1)
        start_r = tl.load(Cu + d_r, mask=row_ok, other=0)
        end_r = tl.load(Cu + d_r + 1, mask=row_ok, other=0)
        at_r = start_r + tl.load(Mask + N_Q + offs_m, mask=row_ok, other=0)
        lo_r = tl.where(win_l >= 0, tl.maximum(start_r, at_r - win_l), start_r)
        hi_r = tl.where(win_r >= 0, tl.minimum(end_r, at_r + win_r + 1), end_r)
        kv_lo = tl.min(tl.where(row_ok, lo_r, N_KV), 0)
        kv_hi = tl.max(tl.where(row_ok, hi_r, 0), 0)
        kv_hi = tl.maximum(kv_hi, kv_lo)
        kv_lo = kv_lo // BLOCK_N * BLOCK_N
    else:
        kv_lo = 0
        kv_hi = 0
    Docs = Mask
    q_mask = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(Q + off_b * stride_qb + off_h64 * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :], mask=q_mask, other=0.0)
    K_blk = K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    if MASK_KIND == 1 or MASK_KIND == 2:
        M_blk = Mask + off_b * stride_mb + off_h64 * stride_mh + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    else:
        M_blk = Mask  # unused
    dv_ok = row_ok[:, None] & (offs_dv[None, :] < DV)

    # -- KV range: causal rows see keys <= row, so blocks above the diagonal are skipped;
    #    blocks wholly below it (and, without causal, all but a ragged last block) need no
    #    causal or bounds mask.
    if MASK_KIND == 3:  # one masked loop over the tile's documents' keys
        hi = kv_hi
        n_full = kv_lo
    elif CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_KV)
        n_full = tl.minimum(start_m * BLOCK_M, N_KV) // BLOCK_N * BLOCK_N
    else:
        hi = N_KV
        n_full = N_KV // BLOCK_N * BLOCK_N
    if HAS_RANGES:
        # a mask's pre-pass: the keys outside [lo, hi) are masked for every row of the tile (skipped)
        r = Ranges + off_b * stride_rb + off_h64 * stride_rh + start_m * stride_rm
        kv_lo = tl.load(r)
        hi = tl.minimum(hi, tl.load(r + 1))
        n_full = tl.maximum(tl.minimum(n_full, hi // BLOCK_N * BLOCK_N), kv_lo)

    if SHADOW:
        # ----------------------------------------------------------------- shadow pass
        do = tl.load(DO + off_b * stride_dob + off_h64 * stride_doh + offs_m[:, None] * stride_don + offs_dv[None, :], mask=dv_ok, other=0.0)
        V_blk = V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :]
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        a_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        k0, k1, thr = dropout_key(Seed, drop_thr, DROPOUT)
        m_i, l_i, a_i = _shadow_inner(
            m_i, l_i, a_i, q, do, K_blk, V_blk, M_blk, offs_m, offs_n, offs_d, offs_dv, row_ok, N_KV, D, DV, scale,
            stride_kn, stride_vn, stride_mn, kv_lo, n_full, k0, k1, thr, off_bh, Docs, N_Q, win_l, win_r,
            MASK_CAUSAL=False, MASK_KV=False, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, EVEN_DV=EVEN_DV, DOT_PRECISION=DOT_PRECISION,
        )
        m_i, l_i, a_i = _shadow_inner(
            m_i, l_i, a_i, q, do, K_blk, V_blk, M_blk, offs_m, offs_n, offs_d, offs_dv, row_ok, N_KV, D, DV, scale,
            stride_kn, stride_vn, stride_mn, n_full, hi, k0, k1, thr, off_bh, Docs, N_Q, win_l, win_r,
            MASK_CAUSAL=CAUSAL, MASK_KV=True, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, EVEN_DV=EVEN_DV, DOT_PRECISION=DOT_PRECISION,
        )
        # -- delta_lp = rowsum(dO * O) from the call's O; delta_hp = a / l. A row is masked
        #    when it saw no score above -inf and no NaN (a NaN row stays in, NaN).
        o = tl.load(O + off_b * stride_ob + off_h64 * stride_oh + offs_m[:, None] * stride_on + offs_dv[None, :], mask=dv_ok, other=0.0)
        delta_lp = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        live = row_ok & ((m_i > float("-inf")) | (l_i != l_i))
        if DROPOUT:
            a_i = a_i * drop_scale
        err = tl.where(live, delta_lp - a_i / l_i, 0.0)
        # -- the tile's sums, one atomic per statistic
        n_live = tl.sum(live.to(tl.int32), 0).to(tl.int64)
        n_pos = tl.sum((err > 0).to(tl.int32), 0).to(tl.int64)
        any_live = n_live > 0
        tl.atomic_add(Counts + C_SHADOW * H + off_h, n_live, mask=any_live, sem="relaxed")
        tl.atomic_add(Counts + C_DPOS * H + off_h, n_pos, mask=n_pos > 0, sem="relaxed")
        tl.atomic_add(Values + V_DSUM * H + off_h, tl.sum(err, 0), mask=any_live, sem="relaxed")
        tl.atomic_add(Values + V_DABS * H + off_h, tl.sum(tl.abs(err), 0), mask=any_live, sem="relaxed")
    else:
        # ----------------------------------------------------------------- statistics pass
        top1 = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
        top2 = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
        poison = offs_m < 0  # all False
        top1, top2, poison = _stats_inner(
            top1, top2, poison, q, K_blk, M_blk, offs_m, offs_n, offs_d, row_ok, N_KV, D, scale, stride_kn, stride_mn,
            kv_lo, n_full, Docs, N_Q, win_l, win_r,
            MASK_CAUSAL=False, MASK_KV=False, MASK_KIND=MASK_KIND, SCALED=SCALED,
            BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION,
        )
        top1, top2, poison = _stats_inner(
            top1, top2, poison, q, K_blk, M_blk, offs_m, offs_n, offs_d, row_ok, N_KV, D, scale, stride_kn, stride_mn,
            n_full, hi, Docs, N_Q, win_l, win_r,
            MASK_CAUSAL=CAUSAL, MASK_KV=True, MASK_KIND=MASK_KIND, SCALED=SCALED,
            BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION,
        )
        # -- merge the lanes: t1 the largest lane maximum; t2 the largest of the lanes'
        #    seconds and of the other lanes' maxima (t1 itself if two lanes hold it)
        t1 = tl.max(top1, 1)
        n_top = tl.sum((top1 == t1[:, None]).to(tl.int32), 1)
        runner_up = tl.max(tl.where(top1 < t1[:, None], top1, float("-inf")), 1)
        t2 = tl.maximum(tl.max(top2, 1), tl.where(n_top > 1, t1, runner_up))
        if not SCALED:
            # tracked on raw q.k: x -> round(x * scale) is monotone for scale > 0
            t1 = t1 * scale
            t2 = t2 * scale
        # -- classify the rows (stats.py): masked = no score above -inf and no NaN;
        #    non-finite = a NaN or +inf score, or a NaN/Inf in the row of O
        live = row_ok & ((t1 > float("-inf")) | poison)
        masked = row_ok & ~live
        bad = live & (poison | (t1 == float("inf")))
        if HAS_O:
            o = tl.load(O + off_b * stride_ob + off_h64 * stride_oh + offs_m[:, None] * stride_on + offs_dv[None, :], mask=dv_ok, other=0.0)
            o_bad = tl.sum((~(tl.abs(o.to(tl.float32)) < float("inf"))).to(tl.int32), 1) > 0  # NaN fails < too
            bad = bad | (live & o_bad)
        multi = live & (tl.abs(t1) < float("inf")) & (t2 >= t1 - eps)
        # -- the tile's counts and maximum, one atomic per statistic (skipped when zero)
        n_live = tl.sum(live.to(tl.int32), 0).to(tl.int64)
        n_multi = tl.sum(multi.to(tl.int32), 0).to(tl.int64)
        n_masked = tl.sum(masked.to(tl.int32), 0).to(tl.int64)
        n_bad = tl.sum(bad.to(tl.int32), 0).to(tl.int64)
        top = tl.max(tl.where(live, t1, float("-inf")), 0)
        tl.atomic_add(Counts + C_ROWS * H + off_h, n_live, mask=n_live > 0, sem="relaxed")
        tl.atomic_add(Counts + C_TIE_ROWS * H + off_h, n_live, mask=n_live > 0, sem="relaxed")
        tl.atomic_add(Counts + C_MULTI * H + off_h, n_multi, mask=n_multi > 0, sem="relaxed")
        tl.atomic_add(Counts + C_MASKED * H + off_h, n_masked, mask=n_masked > 0, sem="relaxed")
        tl.atomic_add(Counts + C_NONFINITE * H + off_h, n_bad, mask=n_bad > 0, sem="relaxed")
        tl.atomic_max(Values + V_MAXS * H + off_h, top, mask=top > float("-inf"), sem="relaxed")


# ---------------------------------------------------------------------------
# Launchers

_launch_stats = Launcher(_attn_stats)


def _strides(t: Optional[torch.Tensor]):
    return (0, 0, 0) if t is None else t.stride()[:3]


def _launch(q, k, v, o, do, attn_mask, counts, values, *, shadow: bool, causal: bool, scale: float, eps: float,
            dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None, documents=None):
    B, H, N, D = q.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    q, k, v, o, do = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, o, do))
    dv = o.shape[-1] if o is not None else D
    # the call's mask as a (B, H, N, N_kv) view (stride 0 on broadcast dims); bool read as bytes
    mask = mask4(attn_mask, B, H, N, n_kv)
    ranges, range_strides = None, (0, 0, 0)
    n_docs, win_l, win_r = 0, -1, -1
    if documents is not None:  # a packed call: (the document vector, its number of documents, the window)
        mask, n_docs, (win_l, win_r) = documents
        kind, mask_strides = 3, (0, 0, 0, 0)
    elif mask is None:
        kind, mask_strides = 0, (0, 0, 0, 0)
    else:
        kind, mask_strides = (1 if mask.dtype == torch.bool else 2), mask.stride()
        if kind == 1:
            mask = mask.view(torch.uint8)
    # without P or an additive mask, the statistics track raw q.k and scale t1, t2 at the end
    scaled = shadow or kind == 2 or not (0.0 < scale < math.inf)
    head_dim, head_dv = head_dim_tile(D), head_dim_tile(dv)
    if shadow:
        cfg = launch_config("shadow", max(head_dim, head_dv), q.dtype)
    else:  # O is read once, after the loop
        cfg = launch_config("stats", head_dim, q.dtype)
    # the statistics compare scores exactly: scale * q.k and + mask rounded separately (no FMA)
    options = {} if (INTERPRET or shadow) else dict(enable_fp_fusion=False)
    if kind in (1, 2):  # each query tile's span of keys some row sees (the mask pre-pass, two launches)
        ranges, range_strides = mask_row_ranges(attn_mask, B, H, N, n_kv, cfg.block_m, cfg.block_n)
    _launch_stats(
        (cdiv(N, cfg.block_m), B * H),
        (q, k, v, o, do, mask, ranges, counts, values, seed if dropout_p else None),
        (*q.stride()[:3], *k.stride()[:3], *_strides(v), *_strides(o), *_strides(do), *mask_strides, *range_strides,
         H, H // h_kv, N, n_kv, D, dv, scale, eps,
         dropout_threshold(dropout_p) if dropout_p else 0, dropout_scale(dropout_p) if dropout_p else 1.0,
         n_docs, win_l, win_r),
        dict(
            SHADOW=shadow, CAUSAL=causal, MASK_KIND=kind, DROPOUT=bool(dropout_p), SCALED=scaled,
            HAS_RANGES=ranges is not None, HAS_O=o is not None,
            HEAD_DIM=head_dim, HEAD_DV=head_dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            EVEN_D=D == head_dim, EVEN_DV=dv == head_dv, DOT_PRECISION=dot_precision(q.dtype),
            **cfg.options(), **options,
        ),
    )


def attention_stats(
    q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor], o: Optional[torch.Tensor],
    counts: torch.Tensor, values: torch.Tensor, *, causal: bool, scale: float, eps: float,
) -> None:
    """The statistics pass (``stats.py``) on the GPU; adds into ``counts`` and ``values``, no host sync.

    Args:
        q: (B, H, N, D), k: (B, H_kv, N_kv, D), bfloat16/float16/float32, D <= 256,
            ``H % H_kv == 0``; any strides (last dim copied if not unit-stride).
        attn_mask: None, or bool (True = attend) or float (additive), broadcastable to
            (B, H, N, N_kv).
        o: None, or the call's output (B, H, N, D_v): rows holding NaN/Inf count as non-finite.
        counts: int64 (len(COUNT_FIELDS), H); values: float32 (len(VALUE_FIELDS), H), contiguous.
    """
    _launch(q, k, None, o, None, attn_mask, counts, values, shadow=False, causal=causal, scale=scale, eps=eps)


def attention_stats_documents(
    q: torch.Tensor, k: torch.Tensor, o: Optional[torch.Tensor], documents: torch.Tensor, n_docs: int,
    window, counts: torch.Tensor, values: torch.Tensor, *, scale: float, eps: float,
) -> None:
    """The statistics pass over a packed call (``varlen_attn``'s layout) on the GPU; no host sync.

    Args:
        q: (T_q, H, D), k: (T_k, H_kv, D), o: None or (T_q, H, D_v), as the call holds them.
        documents: int64 ``[doc_q (T_q), pos_q (T_q), doc_k (T_k), pos_k (T_k), cu_seq_k (n_docs + 1)]``
            (:func:`~instability_watch.kernels.stats.varlen.documents` and the call's ``cu_seq_k``).
        window: ``(left, right)`` in aligned key positions, ``-1`` unbounded (causal: right = 0).
    """
    as4 = (lambda t: None if t is None else t.permute(1, 0, 2).unsqueeze(0))  # (1, H, T, D) views
    _launch(as4(q), as4(k), None, as4(o), None, None, counts, values, shadow=False, causal=False, scale=scale,
            eps=eps, documents=(documents.contiguous(), int(n_docs), (int(window[0]), int(window[1]))))


def attention_shadow_documents(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor, documents: torch.Tensor,
    n_docs: int, window, counts: torch.Tensor, values: torch.Tensor, *, scale: float,
) -> None:
    """The shadow pass over a packed call (``varlen_attn``'s layout) on the GPU; no host sync. Shapes as
    :func:`attention_stats_documents`, with v (T_k, H_kv, D_v), o and do (T_q, H, D_v)."""
    as4 = (lambda t: t.permute(1, 0, 2).unsqueeze(0))  # (1, H, T, D) views
    _launch(as4(q), as4(k), as4(v), as4(o), as4(do), None, counts, values, shadow=True, causal=False, scale=scale,
            eps=0.0, documents=(documents.contiguous(), int(n_docs), (int(window[0]), int(window[1]))))


def attention_shadow(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
    attn_mask: Optional[torch.Tensor], counts: torch.Tensor, values: torch.Tensor, *, causal: bool, scale: float,
    dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
) -> None:
    """The shadow pass (``stats.py``) on the GPU; adds into ``counts`` and ``values``, no host sync.

    Shapes as :func:`attention_stats`, with v (B, H_kv, N_kv, D_v), o and do (B, H, N, D_v),
    D_v <= 256. Adds ``shadow_rows``, ``delta_err_pos``, ``delta_err_sum`` and ``delta_err_abs``.
    With ``dropout_p > 0``, ``seed`` (int64 (2,) on the device) is the call's: its keep mask is regenerated.
    """
    _launch(q, k, v, o, do, attn_mask, counts, values, shadow=True, causal=causal, scale=scale, eps=0.0,
            dropout_p=dropout_p, seed=seed)
