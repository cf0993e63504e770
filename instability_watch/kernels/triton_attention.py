"""Triton flash attention with FA2's precision model, per-head stabilization and in-kernel diagnostics.

Reads top to bottom: helpers, the forward (inner loop, kernel), the backward
(dQ kernel, which also computes delta and the shadow delta_hp, then dK/dV), then
the host functions that launch them. Elsewhere: the inline-PTX helpers (``_ptx.py``),
the launch table (``configs.py``), the launch path and its Triton version pins
(``_launch.py``). The numerics are those of ``reference.py`` (the test oracle):

* ``S = q.k`` in float32 from the low-precision ``Q, K``; the softmax scale is
  applied in the exponent, in log2 units (``qk_scale = scale * log2(e)``);
* ``P = exp2(q.k * qk_scale - m)`` in float32 (one FMA and one exp2 per score, as
  FA2), with the shift ``m = r * qk_scale`` for ``r`` the running maximum of the
  raw scores (stabilized rows: ``max(m_old, r * qk_scale + d)``, ``d`` the
  stabilized shift in bits, > 0 on a repeated maximum);
  ``l`` summed from the float32 ``P``; ``P`` rounded to the
  input dtype for ``P V`` with a float32 accumulator; ``O = acc / l`` rounded once;
* the log-sum-exp is stored in log2 units (``LSE2``) for the backward, which
  recomputes ``P = exp2(q.k * qk_scale - LSE2)`` (FA2's backward, unchanged by
  stabilization).

Stabilized heads (a per-head flag read from a tensor, so flipping one never
recompiles) move the softmax shift above the row maximum where that maximum is
repeated within ``eps``, tested against the running maximum of all blocks so far
(see reference.py for why, and for the cap on the shift). The same tie test
feeds the probe's ``multi_max_rows``.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from instability_watch.kernels._launch import INTERPRET, Launcher, cdiv, dot_precision
from instability_watch.kernels._ptx import add_rn, add_rows, at_least, max_rows
from instability_watch.kernels.configs import LaunchConfig, has_launch_config, head_dim_tile, launch_config
from instability_watch.kernels.layout import empty_like_layout
from instability_watch.kernels.reference import (
    LOG2E,
    MASK_FLOOR,
    PHILOX_M0,
    PHILOX_M1,
    PHILOX_ROUNDS,
    PHILOX_W0,
    PHILOX_W1,
    dropout_scale,
    dropout_threshold,
    mask4,
    max_shift_for,
    reduce_to,
)
from instability_watch.probe.fields import COUNT_FIELDS, VALUE_FIELDS

# Rows of the probe buffers, as constexprs for the kernels.
C_ROWS = tl.constexpr(COUNT_FIELDS.index("rows"))
C_MULTI = tl.constexpr(COUNT_FIELDS.index("multi_max_rows"))
C_TIE_ROWS = tl.constexpr(COUNT_FIELDS.index("tie_rows"))
C_NONFINITE = tl.constexpr(COUNT_FIELDS.index("nonfinite_rows"))
C_SHADOW = tl.constexpr(COUNT_FIELDS.index("shadow_rows"))
C_DPOS = tl.constexpr(COUNT_FIELDS.index("delta_err_pos"))
V_MAXS = tl.constexpr(VALUE_FIELDS.index("max_score"))
V_DSUM = tl.constexpr(VALUE_FIELDS.index("delta_err_sum"))
V_DABS = tl.constexpr(VALUE_FIELDS.index("delta_err_abs"))
C_MASKED = tl.constexpr(COUNT_FIELDS.index("masked_rows"))

# The call's attn_mask, as the kernels read it.
MASK_NONE = 0
MASK_BOOL = 1  # uint8 view of a bool mask: nonzero = attend
MASK_ADD = 2  # additive float mask, added to the scaled scores
FLOOR = tl.constexpr(MASK_FLOOR)
P_M0, P_M1 = tl.constexpr(PHILOX_M0), tl.constexpr(PHILOX_M1)
P_W0, P_W1 = tl.constexpr(PHILOX_W0), tl.constexpr(PHILOX_W1)
P_ROUNDS = tl.constexpr(PHILOX_ROUNDS)


# ---------------------------------------------------------------------------
# Helpers


@triton.jit
def _stabilized_shift2(m_std, r, beta, max_shift2):
    """Extra shift (log2 units) above the shift m_std = r * qk_scale of a row maximum r; see reference.stabilized_shift."""
    d = tl.where(r > 0, beta - 1.0, -1.0) * m_std  # beta > 1: d >= 0
    return tl.minimum(d, (max_shift2 - 1.0) + (d - tl.floor(d)))


@triton.jit
def _masked_scores(qk, M_blk, start_n, cols, row_ok, N_KV, stride_mk, sm_scale,
                   MASK_KIND: tl.constexpr, MASK_KV: tl.constexpr):
    """The scores as the loops use them under the call's mask: (rows, BLOCK_N) float32.

    Boolean mask: the raw ``q.k``, ``-inf`` where the mask is False (the scale stays in
    the exponent). Additive: ``(scale * q.k + bias) * log2(e)``, the scores in log2 units
    (the loops then take ``qk_scale = 1``), rounded once before the row maximum is taken;
    entries at or below FLOOR are masked (``-inf``), so a row of them (HF's
    ``finfo.min``) is a masked row, 0, as CUDA SDPA's cuDNN and efficient kernels give
    it. Keys past ``N_KV`` read as masked.
    """
    ok = row_ok[:, None]
    if MASK_KV:
        ok = ok & (cols[None, :] < N_KV)
    if MASK_KIND == 1:
        keep = tl.load(M_blk + start_n * stride_mk, mask=ok, other=0)
        return tl.where(keep != 0, qk, float("-inf"))
    else:
        bias = tl.load(M_blk + start_n * stride_mk, mask=ok, other=float("-inf")).to(tl.float32)
        bias = tl.where(bias <= FLOOR, float("-inf"), bias)
        return (qk * sm_scale + bias) * 1.4426950408889634


@triton.jit
def _philox(k0, k1, c0, c1, c2, c3):
    """Philox4x32 (reference.philox) on uint32 counters (tensors) and key (scalars)."""
    for r in tl.static_range(P_ROUNDS):
        if r > 0:
            k0 = k0 + P_W0
            k1 = k1 + P_W1
        hi0 = tl.umulhi(c0, P_M0)
        lo0 = c0 * P_M0
        hi1 = tl.umulhi(c2, P_M1)
        lo1 = c2 * P_M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def _dropout_key(Seed, drop_thr, DROPOUT: tl.constexpr):
    """Philox's key ``(k0, k1)`` (uint32 scalars) from the call's seed (int64 (2,)), and the keep
    threshold ``drop_thr`` as uint32; without ``DROPOUT``, zeros (unused)."""
    if DROPOUT:
        k0 = tl.load(Seed).to(tl.uint32)
        k1 = tl.load(Seed + 1).to(tl.uint32)
        thr = drop_thr.to(tl.uint32)
    else:
        k0 = 0
        k1 = 0
        thr = 0
    return k0, k1, thr


@triton.jit
def _halves(x):
    """A word's two 16-bit halves on a new last axis: ``(.., 2)``, low first."""
    return tl.join(x & 0xFFFF, x >> 16)


@triton.jit
def _dropout_keep(k0, k1, thr, bh, offs_m, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Which entries dropout keeps in rows ``offs_m``, keys ``start_n + [0, BLOCK_N)``: (BLOCK_M, BLOCK_N) bool.

    reference.dropout_bits: entry (i, j) takes 16 bits of Philox at counter
    ``(4 (j // 32) + t, i, bh, 0)``, ``t = (j % 8) // 2``, word ``w = (j % 32) // 8``, low
    half for even j. The calls are computed on a (BLOCK_M, groups of 32, t) grid and
    the words and halves are joined on as new axes, then ordered to column
    ``32 g + 8 w + 2 t + h``. An MMA accumulator tile holds, per thread, the column pair
    ``2 t, 2 t + 1`` of every 8 columns, so (w, h) are in-thread axes there: the
    compiler can compute each call in the thread that applies its bits (no exchange of
    the numbers between threads, which the column-contiguous layout before this needed).
    ``start_n`` is a multiple of BLOCK_N, which is 16 or a multiple of 32.
    """
    T = tl.arange(0, 4)
    if BLOCK_N == 16:  # half a group: words (0, 1) or (2, 3) of its calls
        shape: tl.constexpr = (BLOCK_M, 1, 4)
        c0 = tl.broadcast_to((4 * (start_n // 32) + T).to(tl.uint32)[None, None, :], shape)
        c1 = tl.broadcast_to(offs_m.to(tl.uint32)[:, None, None], shape)
        c2 = tl.zeros(shape, dtype=tl.uint32) + bh.to(tl.uint32)
        c3 = tl.zeros(shape, dtype=tl.uint32)
        x0, x1, x2, x3 = _philox(k0, k1, c0, c1, c2, c3)
        second = (start_n // 16) % 2 == 1
        ws = tl.join(_halves(tl.where(second, x2, x0)), _halves(tl.where(second, x3, x1)))  # (M, 1, t, h, w)
        bits = tl.reshape(tl.permute(ws, (0, 1, 4, 2, 3)), (BLOCK_M, BLOCK_N))
    else:
        G: tl.constexpr = BLOCK_N // 32
        shape: tl.constexpr = (BLOCK_M, G, 4)
        g = start_n // 32 + tl.arange(0, G)
        c0 = tl.broadcast_to((4 * g[None, :, None] + T[None, None, :]).to(tl.uint32), shape)
        c1 = tl.broadcast_to(offs_m.to(tl.uint32)[:, None, None], shape)
        c2 = tl.zeros(shape, dtype=tl.uint32) + bh.to(tl.uint32)
        c3 = tl.zeros(shape, dtype=tl.uint32)
        x0, x1, x2, x3 = _philox(k0, k1, c0, c1, c2, c3)
        # (M, g, t, h, a, b) with word w = 2 a + b, then (M, g, a, b, t, h): column 32 g + 8 w + 2 t + h
        ws = tl.join(tl.join(_halves(x0), _halves(x2)), tl.join(_halves(x1), _halves(x3)))
        bits = tl.reshape(tl.permute(ws, (0, 1, 4, 5, 2, 3)), (BLOCK_M, BLOCK_N))
    return bits >= thr


# ---------------------------------------------------------------------------
# Forward


@triton.jit
def _fwd_inner(
    acc, l_i, r_i, m_i, c_i,
    q, K_ptrs, V_ptrs, M_ptrs, stride_kn, stride_vn, stride_mk,
    offs_m, offs_n, offs_d, row_ok, D, N_KV,
    qk_scale, sm_scale, eps_raw, beta, max_shift2, stab_h, track,
    k0, k1, drop_thr, off_bh,
    lo, hi,
    MASK_CAUSAL: tl.constexpr, MASK_KV: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    TRACK_TIES: tl.constexpr, HAS_STAB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ASM: tl.constexpr,
):
    # State per row: r the running maximum of the raw scores q.k (exact comparisons at any
    # magnitude), m the softmax shift in log2 units, c the near-maximum count. A standard
    # row's shift is r * qk_scale, replaced only when r moves, so the rescale
    # alpha = exp2(m_old - m_new) is exactly 1 while r holds. A stabilized row takes
    # m_new = max(m_old, r * qk_scale + d) (the authors' running maximum, as reference.py),
    # d > 0 only where the maximum repeats.
    # P = exp2(q.k * qk_scale - m) is one FMA and one exp2 per score (FA2's form; the product
    # inside the FMA is exact, so scores near the maximum keep their exact distance to it up to
    # the rounding of m, common to the row).
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        # -- load the KV block (keys past N_KV and padded head dims read as 0)
        if MASK_KV:
            kv_mask = (cols[:, None] < N_KV) & (offs_d[None, :] < D)
        else:
            kv_mask = offs_d[None, :] < D
        if MASK_KV or not EVEN_D:
            k = tl.load(K_ptrs + start_n * stride_kn, mask=kv_mask, other=0.0)
        else:
            k = tl.load(K_ptrs + start_n * stride_kn)
        # -- raw scores q.k in float32; the scale (> 0) is applied in the exponent below
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK_CAUSAL:
            qk = tl.where(offs_m[:, None] >= cols[None, :], qk, float("-inf"))
        if MASK_KIND != 0:  # the call's mask (an additive one turns qk into scaled scores, in nats)
            qk = _masked_scores(qk, M_ptrs, start_n, cols, row_ok, N_KV, stride_mk, sm_scale, MASK_KIND, MASK_KV)
        if MASK_KV:
            qk = tl.where(cols[None, :] < N_KV, qk, float("-inf"))
        r_new = tl.maximum(r_i, tl.max(qk, 1))
        # -- the standard shift; kept as m_i while r holds. The select matters on the GPU: a
        #    bare r * qk_scale would be contracted into alpha's subtraction (an FMA with the
        #    exact product), so alpha would differ from 1 by m's rounding while P uses the
        #    rounded m, and the weights of earlier blocks would drift (test_extreme_scores_*).
        m_std = tl.where(r_new > float("-inf"), r_new, 0.0) * qk_scale
        m_new = tl.where(r_new == r_i, m_i, m_std)
        if TRACK_TIES:
            if track:  # uniform per program: untracked programs skip all of the tie work
                # -- how many scores lie within eps of the running maximum (earlier blocks
                #    too); a float count: one set-and-add per score
                thr = r_new - eps_raw
                c_new = tl.where(r_i >= thr, c_i, 0)
                c_new += tl.sum(at_least(qk, tl.broadcast_to(thr[:, None], qk.shape), ASM), 1).to(tl.int32)
                if HAS_STAB:
                    # -- stabilized heads shift above a repeated maximum (paper Alg. 3)
                    # (no "any tie in this tile?" shortcut: that cross-warp reduction costs a
                    #  shared-memory round trip and a barrier per block, more than it saves)
                    tie = (c_new > 1) & (r_new > float("-inf")) & stab_h
                    d = _stabilized_shift2(m_std, r_new, beta, max_shift2)
                    # rounded once (no FMA with m_std's product): the Gluon forward's shift, bit for bit
                    m_new = tl.maximum(m_new, add_rn(m_std, tl.where(tie, d, 0.0), ASM))
                    # the shift never moves down (the authors' running maximum). Only tracked
                    # programs can have shifted: for a standard row m_new >= m_i already
                    # (r only grows and qk_scale > 0), so untracked programs skip this.
                    m_new = tl.where(r_i > float("-inf"), tl.maximum(m_i, m_new), m_new)
                c_i = c_new
        # -- online softmax update: P in float32, l from float32 P
        alpha = tl.math.exp2(tl.where(r_i > float("-inf"), m_i - m_new, float("-inf")))  # 0 until a row sees a score
        p = tl.math.exp2(tl.fma(qk, qk_scale, -m_new[:, None]))
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:  # after the softmax: l is the softmax's own normaliser; 1/(1-p) at the end
            p = tl.where(_dropout_keep(k0, k1, drop_thr, off_bh, offs_m, start_n, BLOCK_M, BLOCK_N), p, 0.0)
        # -- P rounded to the input dtype for P V, float32 accumulator
        if MASK_KV or not EVEN_D:
            v = tl.load(V_ptrs + start_n * stride_vn, mask=kv_mask, other=0.0)
        else:
            v = tl.load(V_ptrs + start_n * stride_vn)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        r_i = r_new
        m_i = m_new
    return acc, l_i, r_i, m_i, c_i


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE2, Stab, Counts, Values, Mask, RangeLo, RangeHi, Seed,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_mb, stride_mh, stride_mn, stride_mk,
    stride_rb, stride_rh, stride_rm,
    H, GROUP, N_Q, N_KV, D, lse_plane,
    qk_scale, sm_scale, stat_scale, eps_raw, beta, max_shift2, tie_stride, drop_thr, drop_scale,
    CAUSAL: tl.constexpr, HAS_STAB: tl.constexpr, HAS_PROBE: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ASM: tl.constexpr, WARP_STATS: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    off_hk = off_h // GROUP  # grouped-query attention: the KV head this query head reads

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    row_ok = offs_m < N_Q
    q_mask = row_ok[:, None] & (offs_d[None, :] < D)
    if EVEN_M and EVEN_D:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)

    # -- running state per row: raw maximum r of q.k, shift m, near-maximum count c, l, acc
    r_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # finite while r is -inf: P = exp2(-inf - m) = 0
    c_i = tl.zeros([BLOCK_M], dtype=tl.int32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # -- which programs track ties (a per-program decision, read at run time): every
    #    stabilized head (the fix needs it), and with a probe a rotating 1-in-tie_stride
    #    sample of the other heads' query tiles (the multi-max statistic). Tracking costs
    #    a compare-and-add per score; the rest run the plain loop.
    if HAS_STAB:
        stab_h = tl.load(Stab + off_h) != 0
    else:
        stab_h = False
    if HAS_PROBE:
        sampled = (start_m + off_b) % tie_stride == 0
        seen_max = tl.load(Values + V_MAXS * H + off_h)  # the head's maximum score so far
    else:
        sampled = False
    track = stab_h | sampled

    if MASK_KIND != 0:
        m_ptrs = Mask + off_b * stride_mb + off_h * stride_mh + offs_m[:, None] * stride_mn + offs_n[None, :] * stride_mk
    else:
        m_ptrs = Mask
    k0, k1, thr = _dropout_key(Seed, drop_thr, DROPOUT)

    # -- KV range: causal (top-left) rows see keys <= row; split the blocks that
    #    need no causal mask from the ones on the diagonal. With a mask: the blocks
    #    between the first and the last key any row of this tile may see (a pre-pass).
    if MASK_KIND != 0:
        r_off = off_b * stride_rb + off_h * stride_rh + start_m * stride_rm
        n_full = tl.load(RangeLo + r_off) // BLOCK_N * BLOCK_N
        hi = tl.load(RangeHi + r_off)
    elif CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_KV)
        n_full = tl.minimum(start_m * BLOCK_M, N_KV) // BLOCK_N * BLOCK_N
    elif EVEN_N:
        hi = N_KV
        n_full = N_KV
    else:
        hi = N_KV
        n_full = N_KV // BLOCK_N * BLOCK_N
    # One loop body for both (a branch around two loops would give each its own
    # software pipeline and double the shared memory).
    TRACK_TIES: tl.constexpr = HAS_STAB or HAS_PROBE
    if MASK_KIND == 0:
        acc, l_i, r_i, m_i, c_i = _fwd_inner(
            acc, l_i, r_i, m_i, c_i, q, k_ptrs, v_ptrs, m_ptrs, stride_kn, stride_vn, stride_mk,
            offs_m, offs_n, offs_d, row_ok, D, N_KV, qk_scale, sm_scale, eps_raw, beta, max_shift2, stab_h, track,
            k0, k1, thr, off_bh,
            0, n_full,
            MASK_CAUSAL=False, MASK_KV=False, MASK_KIND=0, DROPOUT=DROPOUT, TRACK_TIES=TRACK_TIES, HAS_STAB=HAS_STAB,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION, ASM=ASM,
        )
    # with a mask: one loop over the tile's range (n_full is where it starts)
    acc, l_i, r_i, m_i, c_i = _fwd_inner(
        acc, l_i, r_i, m_i, c_i, q, k_ptrs, v_ptrs, m_ptrs, stride_kn, stride_vn, stride_mk,
        offs_m, offs_n, offs_d, row_ok, D, N_KV, qk_scale, sm_scale, eps_raw, beta, max_shift2, stab_h, track,
        k0, k1, thr, off_bh,
        n_full, hi,
        MASK_CAUSAL=CAUSAL, MASK_KV=(MASK_KIND == 0) or not EVEN_N, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT,
        TRACK_TIES=TRACK_TIES, HAS_STAB=HAS_STAB,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION, ASM=ASM,
    )

    # -- epilogue: O rounded once, LSE in log2 units. With a mask a row may see no key at
    #    all: O = 0 and LSE = +inf (its backward is 0), as SDPA.
    if MASK_KIND != 0:
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse2 = tl.where(seen, m_i + tl.math.log2(l_i), float("inf"))
    else:
        o = acc / l_i[:, None]
        lse2 = m_i + tl.math.log2(l_i)
    if DROPOUT:
        o = o * drop_scale
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    if EVEN_M and EVEN_D:
        tl.store(o_ptrs, o.to(O.dtype.element_ty))
    else:
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=q_mask)
    if MASK_KIND == 2:
        # additive mask: the shift and log2(l) apart, so the backward's P = exp2(s - m - log2(l))
        # stays exact where m is huge (a row of FLOOR entries)
        tl.store(LSE2 + off_bh * N_Q + offs_m, m_i, mask=row_ok)
        tl.store(LSE2 + lse_plane + off_bh * N_Q + offs_m, tl.where(seen, tl.math.log2(l_i), float("inf")), mask=row_ok)
    else:
        tl.store(LSE2 + off_bh * N_Q + offs_m, lse2, mask=row_ok)

    if HAS_PROBE:
        # -- per-head statistics of this tile, relaxed atomics (no fences: the counters are
        #    only read after the step, behind a host sync), without tile-wide reductions:
        #    with WARP_STATS each warp reduces its own rows (add_rows, max_rows), else
        #    masked per-row atomics.
        n_rows = tl.minimum(N_Q - start_m * BLOCK_M, BLOCK_M).to(tl.int64)
        live = row_ok
        if MASK_KIND != 0:  # rows that see no key count as masked rows, and in nothing else
            masked = row_ok & (r_i == float("-inf"))
            n_masked = tl.sum(masked.to(tl.int64), 0)
            tl.atomic_add(Counts + C_MASKED * H + off_h, n_masked, sem="relaxed")
            n_rows -= n_masked
            live = row_ok & ~masked
        tl.atomic_add(Counts + C_ROWS * H + off_h, n_rows, sem="relaxed")
        # a row sum is NaN/Inf iff some entry is (short of an overflow of the sum itself)
        row_sum = tl.sum(o, 1) + lse2
        row_finite = (row_sum == row_sum) & (tl.abs(row_sum) < float("inf"))
        add_rows(Counts + C_NONFINITE * H + off_h, live & ~row_finite, offs_m, WARP_STATS)
        # the maximum score, skipped where it cannot beat the head's maximum as read at the
        # start of this program (the buffer only grows)
        score = tl.where(live, r_i * stat_scale, float("-inf"))
        max_rows(Values + V_MAXS * H + off_h, score, seen_max, WARP_STATS)
        if track:  # only tracked programs counted near-maximum ties
            tl.atomic_add(Counts + C_TIE_ROWS * H + off_h, n_rows, sem="relaxed")
            add_rows(Counts + C_MULTI * H + off_h, live & (c_i > 1), offs_m, WARP_STATS)


# ---------------------------------------------------------------------------
# Backward


@triton.jit
def _program_ids(H, BLOCK: tl.constexpr):
    """This backward program's place (grid: blocks of ``BLOCK`` along dim 0, batch x ``H`` heads
    along dim 1): ``(start, off_bh, off_b, off_h)``, its block's first index and its (batch, head)."""
    start = tl.program_id(0) * BLOCK
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    return start, off_bh, off_b, off_h


@triton.jit
def _tile_offsets(start, BLOCK: tl.constexpr, BLOCK_OTHER: tl.constexpr, HEAD_DIM: tl.constexpr):
    """int32 offsets of a tile: ``start + [0, BLOCK)``, the other axis' ``[0, BLOCK_OTHER)``, the head dim's."""
    return start + tl.arange(0, BLOCK), tl.arange(0, BLOCK_OTHER), tl.arange(0, HEAD_DIM)


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE2, Delta, DK, DV, DQacc, Mask, RangeLo, RangeHi, Seed,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_mb, stride_mh, stride_mn, stride_mk, stride_rb, stride_rh, stride_rm,
    H, H_KV, N_Q, N_KV, D, lse_plane,
    qk_scale, scale, drop_thr, drop_scale,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, FUSED_DQ: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PART: tl.constexpr,
):
    """One KV block of one KV head: dK, dV summed over the query heads that read it (GQA).

    ``PART`` 0 computes both; 1 only dK, 2 only dV (the split backward: two launches, each
    with one float32 accumulator, where two would not fit the registers; D = 256).

    With ``FUSED_DQ`` (the fused backward, FA2's), also each query block's share of dQ,
    added into ``DQacc`` (B, H, N, D) float32 with atomics: five products per tile where the
    two-kernel backward takes seven, and dropout's bits generated once, not twice. The order
    of those float32 additions varies from run to run: dQ is not bitwise deterministic."""
    tl.static_assert(PART == 0 or not FUSED_DQ, "the fused backward computes dK and dV in one pass")
    start_n, off_bhk, off_b, off_hk = _program_ids(H_KV, BLOCK_N)
    group = H // H_KV
    offs_n, offs_m0, offs_d = _tile_offsets(start_n, BLOCK_N, BLOCK_M, HEAD_DIM)
    d_ok = offs_d[None, :] < D
    kv_mask = (offs_n[:, None] < N_KV) & d_ok
    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    k0, k1, thr = _dropout_key(Seed, drop_thr, DROPOUT)
    # Causal (top-left): only rows >= start_n see this block; rows from
    # start_n + BLOCK_N on see all of it and need no mask.
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    hi = N_Q
    for g in range(0, group):
        off_h = off_hk * group + g
        off_bh = off_b * H + off_h
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        if MASK_KIND != 0:  # the query rows that may see any key of this block (a pre-pass), per query head
            r_off = off_b * stride_rb + off_h * stride_rh + tl.program_id(0) * stride_rm
            lo = tl.load(RangeLo + r_off) // BLOCK_M * BLOCK_M
            hi = tl.load(RangeHi + r_off)
            m_base = Mask + off_b * stride_mb + off_h * stride_mh + offs_n[:, None] * stride_mk
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < N_Q
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
            # Padded rows get lse = +inf, hence P = 0.
            lse2 = tl.load(LSE2 + off_bh * N_Q + offs_m, mask=m_ok, other=float("inf"))
            if MASK_KIND == 2:
                logl = tl.load(LSE2 + lse_plane + off_bh * N_Q + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(Delta + off_bh * N_Q + offs_m, mask=m_ok, other=0.0)
            # -- P^T for this (KV block, query block), float32, normalised by the LSE
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M), raw
            if MASK_KIND != 0:  # the mask read transposed: rows of the tile are keys
                ok = (offs_n[:, None] < N_KV) & m_ok[None, :]
                if MASK_KIND == 1:
                    keep_t = tl.load(m_base + offs_m[None, :] * stride_mn, mask=ok, other=0)
                    s_t = tl.where(keep_t != 0, s_t, float("-inf"))
                else:
                    bias = tl.load(m_base + offs_m[None, :] * stride_mn, mask=ok, other=float("-inf")).to(tl.float32)
                    bias = tl.where(bias <= FLOOR, float("-inf"), bias)
                    s_t = (s_t * scale + bias) * 1.4426950408889634
            if MASK_KIND == 2:
                p_t = tl.math.exp2((s_t - lse2[None, :]) - logl[None, :])
            else:
                p_t = tl.math.exp2(tl.fma(s_t, qk_scale, -lse2[None, :]))  # one FMA per score, as the forward
            if CAUSAL:
                p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
            # (PART 0 keeps the one-pass kernel's order of operations: dP's product first)
            if PART != 2:
                dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            if DROPOUT:
                # -- Z^T, from the (query, key) orientation of the forward's random numbers
                keep_d = tl.trans(_dropout_keep(k0, k1, thr, off_bh, offs_m, start_n, BLOCK_M, BLOCK_N))
            if PART != 1:
                if DROPOUT:  # -- dV += bf16(P * Z)^T dO (1/(1-p) at the end)
                    dv = tl.dot(tl.where(keep_d, p_t, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
                else:  # -- dV += bf16(P)^T dO
                    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            if PART != 2:
                # -- dP^T = (V dO^T) * Z^T; dS^T = P^T * (dP^T - delta), dK += bf16(dS)^T Q
                if DROPOUT:
                    dp_t = tl.where(keep_d, dp_t * drop_scale, 0.0)
                ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
                dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
                if FUSED_DQ:  # dQ += bf16(dS) K, this block's share, by atomics
                    dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * scale
                    tl.atomic_add(DQacc + off_bh * N_Q * D + offs_m[:, None] * D + offs_d[None, :], dq,
                                  mask=m_ok[:, None] & d_ok, sem="relaxed")

    if PART != 2:
        dk = dk * scale
    if DROPOUT and PART != 1:
        dv = dv * drop_scale
    if PART != 2:
        tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    if PART != 1:
        tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq(
    Q, K, V, O, DO, LSE2, Delta, DQ, Counts, Values, Mask, RangeLo, RangeHi, Seed, DMask,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don, stride_dqb, stride_dqh, stride_dqn,
    stride_mb, stride_mh, stride_mn, stride_mk, stride_rb, stride_rh, stride_rm,
    H, GROUP, N_Q, N_KV, D, lse_plane,
    qk_scale, scale, drop_thr, drop_scale,
    CAUSAL: tl.constexpr, SHADOW: tl.constexpr, DELTA_FROM_O: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One query block: delta = rowsum(dO * O) (stored for the dK/dV kernel, launched after this
    one), dQ, and on shadow steps delta_hp = rowsum(P * dP) and its drift from delta.

    With ``DELTA_FROM_O`` off, delta is read from ``Delta`` instead (a caller-supplied delta).
    """
    start_m, off_bh, off_b, off_h = _program_ids(H, BLOCK_M)
    off_hk = off_h // GROUP
    offs_m, offs_n0, offs_d = _tile_offsets(start_m, BLOCK_M, BLOCK_N, HEAD_DIM)
    m_ok = offs_m < N_Q
    d_ok = offs_d[None, :] < D
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
    lse2 = tl.load(LSE2 + off_bh * N_Q + offs_m, mask=m_ok, other=float("inf"))
    if MASK_KIND == 2:
        logl = tl.load(LSE2 + lse_plane + off_bh * N_Q + offs_m, mask=m_ok, other=float("inf"))
    if DELTA_FROM_O:
        # delta from the stored low-precision O, as FA2's preprocessing; the dK/dV kernel
        # reads it from here (same stream, launched next), so it needs no launch of its own.
        # Read back after a barrier rather than used directly: the load takes the layout the
        # loop wants, where a direct use had the compiler convert the broadcast 2-D
        # delta[:, None] instead, a tile of registers live through the loop.
        o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
        tl.store(Delta + off_bh * N_Q + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=m_ok)
        tl.debug_barrier()
    delta = tl.load(Delta + off_bh * N_Q + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    delta_hp = tl.zeros([BLOCK_M], dtype=tl.float32)

    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    if MASK_KIND != 0:
        m_base = Mask + off_b * stride_mb + off_h * stride_mh + offs_m[:, None] * stride_mn
    k0, k1, thr = _dropout_key(Seed, drop_thr, DROPOUT)
    lo = 0
    if MASK_KIND != 0:  # the keys any row of this tile may see (a pre-pass)
        r_off = off_b * stride_rb + off_h * stride_rh + (start_m // BLOCK_M) * stride_rm
        lo = tl.load(RangeLo + r_off) // BLOCK_N * BLOCK_N
        hi = tl.load(RangeHi + r_off)
    elif CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, N_KV)
    else:
        hi = N_KV
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = (offs_n[:, None] < N_KV) & d_ok
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK_KIND != 0:  # as the forward: qk_scale is log2(e) for an additive mask
            s = _masked_scores(s, m_base + offs_n0[None, :] * stride_mk, start_n, offs_n, m_ok, N_KV, stride_mk,
                               scale, MASK_KIND, True)
        if MASK_KIND == 2:
            p = tl.math.exp2((s - lse2[:, None]) - logl[:, None])
        else:
            p = tl.math.exp2(tl.fma(s, qk_scale, -lse2[:, None]))
        keep = offs_n[None, :] < N_KV
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(keep, p, 0.0)
        # -- dP = (dO V^T) * Z (Z: dropout's keep mask over 1 - p), dS = P * (dP - delta), dQ += bf16(dS) K
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            dp = tl.where(_dropout_keep(k0, k1, thr, off_bh, offs_m, start_n, BLOCK_M, BLOCK_N), dp * drop_scale, 0.0)
        if SHADOW:
            delta_hp += tl.sum(p * dp, 1)  # rowsum(dO * O_hp), O_hp = (P * Z) V never formed
        ds = p * (dp - delta[:, None])
        if MASK_GRAD:  # an additive mask's gradient is dS (float32, the whole (B, H, N, N_kv))
            tl.store(DMask + off_bh * N_Q * N_KV + offs_m[:, None] * N_KV + offs_n[None, :], ds,
                     mask=m_ok[:, None] & (offs_n[None, :] < N_KV))
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)

    dq = dq * scale
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok)
    if SHADOW:
        if MASK_KIND == 2:
            live = m_ok & (logl < float("inf"))  # rows that see a key
        else:
            live = m_ok & (lse2 < float("inf"))
        err = tl.where(live, delta - delta_hp, 0.0)
        tl.atomic_add(Values + V_DSUM * H + off_h, tl.sum(err, 0), sem="relaxed")
        tl.atomic_add(Values + V_DABS * H + off_h, tl.sum(tl.abs(err), 0), sem="relaxed")
        tl.atomic_add(Counts + C_DPOS * H + off_h, tl.sum((err > 0).to(tl.int64), 0), sem="relaxed")
        tl.atomic_add(Counts + C_SHADOW * H + off_h, tl.sum(live.to(tl.int64), 0), sem="relaxed")


@triton.jit
def _attn_bwd_delta(
    O, DO, Delta,
    stride_ob, stride_oh, stride_on,
    stride_dob, stride_doh, stride_don,
    H, N_Q, D,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) in float32 for one block of query rows (the fused backward's pre-pass)."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (offs_m[:, None] < N_Q) & (offs_d[None, :] < D)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :], mask=ok, other=0.0)
    tl.store(Delta + off_bh * N_Q + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < N_Q)


# ---------------------------------------------------------------------------
# Launchers


_launch_fwd, _launch_dq, _launch_dkdv = Launcher(_attn_fwd), Launcher(_attn_bwd_dq), Launcher(_attn_bwd_dkdv)
_launch_delta = Launcher(_attn_bwd_delta)
TIE_SAMPLE_MAX = 16  # at most 1 in 16 query tiles of unstabilized heads track ties for the probe


class _MaskArgs:
    """The call's mask as the kernels read it: kind, pointer and strides, and the key range pre-passes."""

    def __init__(self, attn_mask: Optional[torch.Tensor], B: int, H: int, N: int, n_kv: int):
        self.kind = MASK_NONE
        self.tensor = None
        self.strides = (0, 0, 0, 0)
        self._vis = None
        self._shape = (B, H, N, n_kv)
        self._ranges = {}
        if attn_mask is None:
            return
        m4 = mask4(attn_mask, B, H, N, n_kv)
        self.kind = MASK_BOOL if m4.dtype == torch.bool else MASK_ADD
        self.tensor = m4.view(torch.uint8) if self.kind == MASK_BOOL else m4
        self.strides = m4.stride()
        # what the pre-passes read: the mask's own extent (a dim broadcast, or of stride 0, is size 1)
        m = attn_mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        for d in range(3):
            if m.shape[d] > 1 and m.stride(d) == 0:
                m = m.narrow(d, 0, 1)
        m = m.expand(*m.shape[:3], n_kv)
        self._vis = m if m.dtype == torch.bool else ~(m <= MASK_FLOOR)  # NaN: seen (it makes the row NaN)

    def rows(self, block_m: int):
        """``(lo, hi, strides)``: per (batch, head, query block), the first and past-the-last key any row may see."""
        key = ("rows", block_m)
        if key not in self._ranges:
            B, H, N, n_kv = self._shape
            vis = self._vis
            if vis.shape[2] > 1:
                n_blocks = cdiv(N, block_m)
                if n_blocks * block_m != N:
                    pad = vis.new_zeros((*vis.shape[:2], n_blocks * block_m - N, n_kv))
                    vis = torch.cat([vis, pad], dim=2)
                vis = vis.reshape(*vis.shape[:2], n_blocks, block_m, n_kv).any(dim=3)
            else:
                n_blocks = cdiv(N, block_m)
            lo, hi = _first_last(vis, dim=-1, size=n_kv)
            self._ranges[key] = _expanded(lo, hi, (B, H, n_blocks))
        return self._ranges[key]

    def cols(self, block_n: int):
        """``(lo, hi, strides)``: per (batch, head, key block), the first and past-the-last query row that may see it."""
        key = ("cols", block_n)
        if key not in self._ranges:
            B, H, N, n_kv = self._shape
            vis = self._vis
            n_blocks = cdiv(n_kv, block_n)
            if n_blocks * block_n != n_kv:
                vis = torch.cat([vis, vis.new_zeros((*vis.shape[:3], n_blocks * block_n - n_kv))], dim=3)
            vis = vis.reshape(*vis.shape[:3], n_blocks, block_n).any(dim=4)  # (Bm, Hm, Nm, blocks)
            if vis.shape[2] > 1:
                lo, hi = _first_last(vis, dim=2, size=N)
            else:  # every row sees the same keys
                seen = vis[:, :, 0]
                lo = torch.zeros_like(seen, dtype=torch.int32)
                hi = torch.where(seen, N, 0).to(torch.int32)
            self._ranges[key] = _expanded(lo, hi, (B, H, n_blocks))
        return self._ranges[key]


def _first_last(vis: torch.Tensor, dim: int, size: int):
    """First index and past-the-last index of True along ``dim`` (both 0 where there is none), int32."""
    seen = vis.any(dim=dim)
    first = vis.to(torch.uint8).argmax(dim=dim)
    last = size - vis.flip(dims=(dim,)).to(torch.uint8).argmax(dim=dim)
    return torch.where(seen, first, 0).to(torch.int32), torch.where(seen, last, 0).to(torch.int32)


def _expanded(lo: torch.Tensor, hi: torch.Tensor, shape):
    lo, hi = lo.expand(shape), hi.expand(shape)
    return lo, hi, lo.stride()


def _dropout_args(dropout_p: float, seed: Optional[torch.Tensor]):
    if not dropout_p:
        return None, 0, 1.0
    return seed, dropout_threshold(dropout_p), dropout_scale(dropout_p)


def attention_forward_lse2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    causal: bool, scale: float, stabilize: Optional[torch.Tensor], beta: float, eps: float,
    counts: Optional[torch.Tensor], values: Optional[torch.Tensor], config=None,
    attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
    gluon: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward; ``config`` (a LaunchConfig or a tuple) overrides the launch configuration.

    q (B, H, N, D), k, v (B, H_kv, N_kv, D), bfloat16/float16/float32; ``stabilize`` bool (H,)
    or None; ``counts``/``values`` the probe's buffers or None. Returns ``(o, lse2)``: o
    (B, H, N, D) in q's dtype and layout, lse2 (B, H, N) float32 in log2 units (with an
    additive mask (2, B, H, N): the shift and log2(l) apart), for :func:`attention_backward_lse2`.
    ``gluon``: at D = 256 on an sm_90 GPU, a call without probe, mask, dropout or GQA (stabilized
    heads included) runs the Gluon forward (``gluon_attention.py``; the same online softmax and
    tie tracking); ``None`` does so where it can and ``config`` is not given, ``False`` never,
    ``True`` raises ValueError where it cannot.
    """
    B, H, N, D = q.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o = empty_like_layout(q)  # PyTorch's layout: the model's transpose back is free
    mask = _MaskArgs(attn_mask, B, H, N, n_kv)
    # an additive mask: (2, B, H, N), the shift and log2(l) (see the kernel's epilogue)
    lse_shape = (2, B, H, N) if mask.kind == MASK_ADD else (B, H, N)
    lse2 = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    # the kernels read the mask at Stab + head: one byte per head, contiguous (a strided mask too)
    stab = stabilize.contiguous().view(torch.uint8) if stabilize is not None else None
    if gluon if gluon is not None else (config is None and D == 256):
        why = "a probe, mask or dropout"
        if counts is None and mask.kind == MASK_NONE and not dropout_p:
            why = _gluon_call(
                "forward", lambda ga: ga.forward(q, k, v, o, lse2, causal=causal, qk_scale=scale * LOG2E,
                                                 stabilize=stab, eps_raw=eps / scale, beta=beta,
                                                 max_shift2=max_shift_for(q.dtype)),
                q, k, v, q, masked=False, block=128)
        if why is None:
            return o, lse2
        if gluon:
            raise ValueError(f"gluon=True: the Gluon forward cannot serve this call ({why})")
    head_dim = head_dim_tile(D)
    watched = stabilize is not None or counts is not None
    cfg = launch_config("fwd", head_dim, q.dtype, watched=watched, override=config)
    block_m, block_n = cfg.block_m, cfg.block_n
    # Query tiles per head in this call; sample about a quarter of them for the
    # multi-max statistic, at most 1 in TIE_SAMPLE_MAX (small calls: all of them).
    tiles = B * cdiv(N, block_m)
    tie_stride = max(1, min(TIE_SAMPLE_MAX, tiles // 4))
    has_probe = counts is not None
    lo, hi, r_strides = mask.rows(block_m) if mask.kind else (None, None, (0, 0, 0))
    seed, drop_thr, drop_scale = _dropout_args(dropout_p, seed)
    # an additive mask is added to the scaled scores, which the loop then takes in log2 units
    raw_scale = 1.0 / LOG2E if mask.kind == MASK_ADD else scale
    _launch_fwd(
        (cdiv(N, block_m), B * H),
        (q, k, v, o, lse2, stab, counts, values, mask.tensor, lo, hi, seed),
        (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *mask.strides, *r_strides,
         H, H // h_kv, N, n_kv, D, B * H * N,
         1.0 if mask.kind == MASK_ADD else scale * LOG2E, scale, raw_scale, eps / raw_scale, beta, max_shift_for(q.dtype), tie_stride,
         drop_thr, drop_scale),
        dict(
            CAUSAL=causal, HAS_STAB=stab is not None, HAS_PROBE=has_probe,
            MASK_KIND=mask.kind, DROPOUT=seed is not None,
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
            # computed here rather than by @triton.heuristics: its wrapper costs ~30 us of host time per launch
            EVEN_M=N % block_m == 0, EVEN_N=n_kv % block_n == 0, EVEN_D=D == head_dim,
            DOT_PRECISION=dot_precision(q.dtype), ASM=not INTERPRET,
            # the probe's warp-level statistics count a row once per warp: only where each row
            # lives in one warp (tensor-core tiles with the warps stacked along the rows)
            WARP_STATS=has_probe and not INTERPRET and q.dtype != torch.float32 and block_m >= 16 * cfg.num_warps,
            **cfg.options(),
        ),
    )
    return o, lse2


def _gluon_call(what: str, launch, q, k, v, do, *, masked: bool, dropout: bool = False,
                block: int = 64) -> Optional[str]:
    """Run ``launch(gluon_attention)`` (a Gluon kernel: the forward, or the backward's dQ or dK/dV)
    where it can serve the call; None if it did, else why not.

    A kernel that fails (a Triton whose Gluon differs, say) is reported once, on rank 0, and no
    Gluon kernel is tried again in this process: the Triton kernels serve instead."""
    if INTERPRET:
        return "Triton's interpreter"
    from instability_watch.kernels import gluon_attention

    if not gluon_attention.available():
        return "this Triton has no Gluon for Hopper"
    why = gluon_attention.supported(q, k, v, do, masked=masked, dropout=dropout, block=block)
    if why is not None:
        return why
    try:
        if launch(gluon_attention):
            return None
        return "a tensor layout without a 2-D TMA view"
    except Exception as exc:  # noqa: BLE001 - any failure: the Triton kernels serve from now on
        reason = f"{type(exc).__name__}: {str(exc)[:200]}"
        gluon_attention.disable(f"failed once ({reason})")
        from instability_watch._dist import rank

        if rank() == 0:
            warnings.warn(f"instability_watch: the Gluon {what} kernel (D = 256) failed ({reason}); "
                          "the Triton kernels serve every call from now on")
        return reason


def _gluon_dkdv(q, k, v, do, lse2, delta, dk, dv, causal, qk_scale, scale, mask_kind, seed) -> Optional[str]:
    """dK and dV by the Gluon kernel (gluon_attention.py); None if it served the call, else why not."""
    if not (lse2.is_contiguous() and delta.is_contiguous()):
        return "statistics not contiguous"
    return _gluon_call(
        "dK/dV", lambda ga: ga.dkdv(q, k, v, do, lse2, delta, dk, dv, causal=causal, qk_scale=qk_scale, scale=scale),
        q, k, v, do, masked=mask_kind != MASK_NONE, dropout=seed is not None)


def attention_backward_lse2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse2: torch.Tensor, do: torch.Tensor, *,
    causal: bool, scale: float, counts: Optional[torch.Tensor], values: Optional[torch.Tensor], shadow: bool,
    config_dkdv=None, config_dq=None, delta: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
    mask_grad: bool = False, fused: Optional[bool] = None, config_fused=None,
    split: Optional[bool] = None, config_dk=None, config_dv=None, gluon: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward. Two ways, with the same results up to float32 summation order.

    ``lse2`` is :func:`attention_forward_lse2`'s, in log2 units ((B, H, N) float32, or
    (2, B, H, N) with an additive mask); q, o, do (B, H, N, D), k, v (B, H_kv, N_kv, D),
    bfloat16/float16/float32; gradients in their inputs' dtype and layout. The two ways:

    * fused (FA2's): a pre-pass for delta = rowsum(dO * O), then one kernel per KV block that
      computes dK, dV and adds each query block's dQ into a float32 buffer with atomics;
    * two kernels: dQ (which computes delta, with the shadow statistics), then dK/dV.
      Bitwise deterministic.

    ``fused=None`` takes the fused way only where it is the faster one, calls with dropout at
    head dims up to 128 (it generates dropout's bits once instead of twice; without dropout, or
    at D = 256, the two kernels are faster on the H100: benchmarks/RESULTS.md), and never where
    the call needs what only the two kernels give: the shadow statistics (``shadow``), an
    additive mask's gradient (``mask_grad``), or determinism
    (``torch.use_deterministic_algorithms(True)``).
    The two kernels' dK/dV kernel runs in two passes (``split``: dK, then dV, each with one
    float32 accumulator) where the launch table has ``"dk"``/``"dv"`` entries (D = 256 on
    tensor cores, where two accumulators leave too few registers); ``split=True``/``False``
    forces it (a pass the table has no entry for takes the one-pass kernel's), ``config_dk``/
    ``config_dv`` override those passes' launch configurations (both ignored where the backward
    is fused or not split).
    ``gluon``: at D = 256 on an sm_90 GPU, the two kernels' dK/dV runs as one Gluon kernel
    (``gluon_attention.py``: one pass, 1.2 ms against the two Triton passes' 1.9 ms on the H100)
    where the call has no mask, dropout or GQA; ``None`` does so where it can and the dK/dV
    launch is not overridden, ``False`` never, ``True`` raises ValueError where it cannot (the
    dK/dV overrides ``split`` and ``config_dk*``/``config_dv`` then apply only to calls it cannot serve).
    dQ runs as a Gluon kernel too where it can (the same calls, N a multiple of 128, no shadow
    statistics or mask gradient) unless ``gluon=False``, or ``config_dq`` is given with ``gluon=None``;
    ``gluon=True`` does not require it (a call it cannot serve takes the Triton dQ kernel).
    ``delta`` (B, H, N) float32, if given, replaces ``rowsum(dO * O)``. Returns
    ``(dq, dk, dv, dmask)``; ``dmask`` (an additive mask's gradient, in its shape and
    dtype) only if ``mask_grad``, else None.
    """
    B, H, N, D = q.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    q, k, v, o, do = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, o, do))
    head_dim = head_dim_tile(D)
    precision = dot_precision(q.dtype)
    delta_from_o = delta is None
    if delta_from_o:
        delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    else:
        delta = delta.to(torch.float32).contiguous()
    dq, dk, dv = empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)
    mask = _MaskArgs(attn_mask, B, H, N, n_kv)
    mask_grad = mask_grad and mask.kind == MASK_ADD
    dmask = torch.zeros((B, H, N, n_kv), dtype=torch.float32, device=q.device) if mask_grad else None
    seed, drop_thr, drop_scale = _dropout_args(dropout_p, seed)
    shadow = shadow and counts is not None
    if fused is None:
        fused = (seed is not None and head_dim <= 128
                 and not (shadow or mask_grad or torch.are_deterministic_algorithms_enabled()))
    elif fused and (shadow or mask_grad):
        raise ValueError("fused=True: the fused backward computes neither the shadow statistics nor a mask's gradient")
    if fused and gluon:
        raise ValueError("gluon=True with a fused backward: the Gluon kernel serves only the two-kernel backward's dK/dV")
    qk_scale = 1.0 if mask.kind == MASK_ADD else scale * LOG2E

    def dkdv(cfg: LaunchConfig, dq_acc: Optional[torch.Tensor], part: int = 0) -> None:
        """The dK/dV kernel; with ``dq_acc`` (B, H, N, D) float32, the fused backward's (dQ added there);
        ``part`` 1 or 2: dK or dV alone."""
        lo, hi, r_strides = mask.cols(cfg.block_n) if mask.kind else (None, None, (0, 0, 0))
        _launch_dkdv(
            (cdiv(n_kv, cfg.block_n), B * h_kv),
            (q, k, v, do, lse2, delta, dk, dv, dq_acc, mask.tensor, lo, hi, seed),
            (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
             *mask.strides, *r_strides, H, h_kv, N, n_kv, D, B * H * N, qk_scale, scale, drop_thr, drop_scale),
            dict(CAUSAL=causal, MASK_KIND=mask.kind, DROPOUT=seed is not None, FUSED_DQ=dq_acc is not None,
                 HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION=precision,
                 PART=part, **cfg.options()),
        )

    if fused:
        if delta_from_o:
            bm = 16 if INTERPRET else (64 if head_dim <= 128 else 32)
            _launch_delta(
                (cdiv(N, bm), B * H), (o, do, delta),
                (*o.stride()[:3], *do.stride()[:3], H, N, D),
                dict(HEAD_DIM=head_dim, BLOCK_M=bm, num_warps=4, num_stages=1),
            )
        dq_acc = torch.zeros((B, H, N, D), dtype=torch.float32, device=q.device)
        dkdv(launch_config("fused", head_dim, q.dtype, override=config_fused), dq_acc)
        dq.copy_(dq_acc)
        return dq, dk, dv, None
    # dQ first: its programs write delta, which every dK/dV program reads
    why_dq = "off"
    if gluon is not False and (gluon or config_dq is None) and D == 256:  # the Gluon kernel, where it can
        why_dq = "shadow statistics, a mask's gradient or statistics not contiguous"
        if not (shadow or mask_grad) and lse2.is_contiguous():
            why_dq = _gluon_call(
                "dQ", lambda ga: ga.dq(q, k, v, o, do, lse2, delta, dq, causal=causal, qk_scale=qk_scale, scale=scale,
                                       delta_from_o=delta_from_o),
                q, k, v, do, masked=mask.kind != MASK_NONE, dropout=seed is not None, block=128)
    if why_dq is not None:  # the Triton kernel (also the shadow statistics, a mask's gradient)
        cfg = launch_config("dq", head_dim, q.dtype, override=config_dq)
        block_m, block_n = cfg.block_m, cfg.block_n
        lo, hi, r_strides = mask.rows(block_m) if mask.kind else (None, None, (0, 0, 0))
        _launch_dq(
            (cdiv(N, block_m), B * H),
            (q, k, v, o, do, lse2, delta, dq, counts, values, mask.tensor, lo, hi, seed, dmask),
            (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
             *mask.strides, *r_strides, H, H // h_kv, N, n_kv, D, B * H * N, qk_scale, scale, drop_thr, drop_scale),
            dict(CAUSAL=causal, SHADOW=shadow, DELTA_FROM_O=delta_from_o, MASK_KIND=mask.kind, DROPOUT=seed is not None,
                 MASK_GRAD=mask_grad, HEAD_DIM=head_dim, BLOCK_M=block_m,
                 BLOCK_N=block_n, DOT_PRECISION=precision, **cfg.options()),
        )
    want = gluon
    if want is None:
        want = split is None and config_dkdv is None and config_dk is None and config_dv is None and D == 256
    if want:
        why = _gluon_dkdv(q, k, v, do, lse2, delta, dk, dv, causal, qk_scale, scale, mask.kind, seed)
        if why is None:
            return dq, dk, dv, None  # served calls have no mask, so no mask gradient
        if gluon:
            raise ValueError(f"gluon=True: the Gluon dK/dV kernel cannot serve this call ({why})")
    if split is None:
        split = config_dkdv is None and all(has_launch_config(p, head_dim, q.dtype) for p in ("dk", "dv"))
    if split:
        for part, (kernel, override) in enumerate((("dk", config_dk), ("dv", config_dv)), start=1):
            if override is None and not has_launch_config(kernel, head_dim, q.dtype):
                kernel, override = "dkdv", config_dkdv  # split=True where the table has no pass of its own
            dkdv(launch_config(kernel, head_dim, q.dtype, override=override), None, part=part)
    else:
        dkdv(launch_config("dkdv", head_dim, q.dtype, override=config_dkdv), None)
    if dmask is not None:
        dmask = reduce_to(dmask, attn_mask.shape).to(attn_mask.dtype)
    return dq, dk, dv, dmask
