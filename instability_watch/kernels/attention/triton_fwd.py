"""The attention forward in Triton: the inner loop over KV blocks and the kernel (host side: :mod:`.triton`)."""
from __future__ import annotations

import triton
import triton.language as tl

from instability_watch.kernels.triton_common import (
    C_MASKED,
    C_MULTI,
    C_NONFINITE,
    C_ROWS,
    C_TIE_ROWS,
    V_MAXS,
    add_rn,
    add_rows,
    at_least,
    dropout_keep,
    dropout_key,
    document_scores,
    edge_end,
    edge_scores,
    masked_scores,
    max_rows,
    stabilized_shift2,
)


@triton.jit
def _fwd_inner(
    acc, l_i, r_i, m_i, c_i,
    q, K_ptrs, V_ptrs, M_ptrs, stride_kn, stride_vn, stride_mk,
    offs_m, offs_n, offs_d, row_ok, D, N_KV,
    qk_scale, sm_scale, eps_raw, beta, max_shift2, stab_h, track,
    k0, k1, drop_thr, off_bh,
    lo, hi, N_Q, win_l, win_r,
    MASK_CAUSAL: tl.constexpr, MASK_KV: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    TRACK_TIES: tl.constexpr, HAS_STAB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ASM: tl.constexpr, skip_lo=0, skip_hi=0, c_lo=0, c_hi=0, EDGES: tl.constexpr = False,
    EDGE_HOW: tl.constexpr = 0,
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
    # With EDGES (a boolean mask): the tiles of [lo, hi) outside [skip_lo, skip_hi) (the whole run, a loop of its
    # own), those in [c_lo, c_hi) by the causal compare, the others read from the mask: one loop where there were
    # three (each loop costs the kernel, even where it runs no tile).
    for start_n in range(lo, edge_end(hi, skip_lo, skip_hi, EDGES), BLOCK_N):
        if EDGES:  # inline: through a helper, the forward's registers spill (sm_90, triton 3.6)
            start_n = start_n + tl.where(start_n >= skip_lo, skip_hi - skip_lo, 0)
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
        if MASK_KIND == 3:  # a packed call's documents (M_ptrs: the document vector)
            qk = document_scores(qk, M_ptrs, offs_m, cols, N_Q, N_KV, win_l, win_r, False)
        elif EDGES:
            qk = edge_scores(qk, M_ptrs, start_n, offs_m, cols, row_ok, N_KV, stride_mk, c_lo, c_hi, MASK_KV,
                             EDGE_HOW)
        elif MASK_KIND != 0:  # the call's mask (an additive one turns qk into scaled scores, in nats)
            qk = masked_scores(qk, M_ptrs, start_n, cols, row_ok, N_KV, stride_mk, sm_scale, MASK_KIND, MASK_KV)
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
                    d = stabilized_shift2(m_std, r_new, beta, max_shift2)
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
            p = tl.where(dropout_keep(k0, k1, drop_thr, off_bh, offs_m, start_n, BLOCK_M, BLOCK_N), p, 0.0)
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
def attn_fwd(
    Q, K, V, O, LSE2, Stab, Counts, Values, Mask, Ranges, Order, Seed,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_mb, stride_mh, stride_mn, stride_mk,
    stride_rb, stride_rh, stride_rm,
    H, GROUP, N_Q, N_KV, D, lse_plane,
    qk_scale, sm_scale, stat_scale, eps_raw, beta, max_shift2, tie_stride, drop_thr, drop_scale,
    CAUSAL: tl.constexpr, HAS_STAB: tl.constexpr, HAS_PROBE: tl.constexpr,
    MASK_KIND: tl.constexpr, WHOLE_TILES: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ASM: tl.constexpr, WARP_STATS: tl.constexpr, ORDERED: tl.constexpr = False, EDGE_LOOP: tl.constexpr = False,
    EDGE_HOW: tl.constexpr = 0,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(not EDGE_LOOP or (MASK_KIND == 1 and WHOLE_TILES), "EDGE_LOOP: a boolean mask's tiles")
    if ORDERED:  # the grid is (batch x heads, tiles) and Order the query tiles, the most work first
        start_m = tl.load(Order + tl.program_id(1))
        off_bh = tl.program_id(0)
    else:
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

    # MASK_KIND 3 (a packed call's documents): Mask is the document vector and the mask's stride arguments
    # carry (n_docs, win_l, win_r, 0)
    if MASK_KIND == 3:
        m_ptrs = Mask
    elif MASK_KIND != 0:
        m_ptrs = Mask + off_b * stride_mb + off_h * stride_mh + offs_m[:, None] * stride_mn + offs_n[None, :] * stride_mk
    else:
        m_ptrs = Mask
    k0, k1, thr = dropout_key(Seed, drop_thr, DROPOUT)

    # -- KV range: causal (top-left) rows see keys <= row; split the blocks that
    #    need no causal mask from the ones on the diagonal. With a mask: the blocks
    #    between the first and the last key any row of this tile may see (a pre-pass), and
    #    within them (WHOLE_TILES) a run of blocks every row sees whole, which need no mask.
    if MASK_KIND != 0:
        r_off = off_b * stride_rb + off_h * stride_rh + start_m * stride_rm
        lo = tl.load(Ranges + r_off) // BLOCK_N * BLOCK_N
        hi = tl.load(Ranges + r_off + 1)
        if WHOLE_TILES:
            w0 = tl.minimum(tl.maximum(tl.load(Ranges + r_off + 2), lo), hi)
            w1 = tl.minimum(tl.maximum(tl.load(Ranges + r_off + 3), w0), hi)
            if MASK_KIND == 1:  # then the tiles that equal the causal mask
                c1 = tl.minimum(tl.maximum(tl.load(Ranges + r_off + 4), w1), hi)
    elif CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_KV)
        n_full = tl.minimum(start_m * BLOCK_M, N_KV) // BLOCK_N * BLOCK_N
    elif EVEN_N:
        hi = N_KV
        n_full = N_KV
    else:
        hi = N_KV
        n_full = N_KV // BLOCK_N * BLOCK_N
    # Consecutive loops, not a branch around two (which would give each its own software
    # pipeline and double the shared memory).
    TRACK_TIES: tl.constexpr = HAS_STAB or HAS_PROBE
    if MASK_KIND == 0:
        acc, l_i, r_i, m_i, c_i = _fwd_inner(
            acc, l_i, r_i, m_i, c_i, q, k_ptrs, v_ptrs, m_ptrs, stride_kn, stride_vn, stride_mk,
            offs_m, offs_n, offs_d, row_ok, D, N_KV, qk_scale, sm_scale, eps_raw, beta, max_shift2, stab_h, track,
            k0, k1, thr, off_bh,
            0, n_full, N_Q, stride_mh, stride_mn,
            MASK_CAUSAL=False, MASK_KV=False, MASK_KIND=0, DROPOUT=DROPOUT, TRACK_TIES=TRACK_TIES, HAS_STAB=HAS_STAB,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION, ASM=ASM,
        )
        lo = n_full
    elif WHOLE_TILES:
        # A boolean mask (or documents): with EDGE_LOOP, the whole run (as a call without a mask) and then every
        # other tile in one loop (in key order where the mask is causal: as causal=True); else the mask's tiles
        # before the whole run, the run, the tiles that equal the causal mask (the causal compare), and the
        # mask's tiles after it (the last loop, below).
        if not EDGE_LOOP:
            acc, l_i, r_i, m_i, c_i = _fwd_inner(
                acc, l_i, r_i, m_i, c_i, q, k_ptrs, v_ptrs, m_ptrs, stride_kn, stride_vn, stride_mk,
                offs_m, offs_n, offs_d, row_ok, D, N_KV, qk_scale, sm_scale, eps_raw, beta, max_shift2, stab_h, track,
                k0, k1, thr, off_bh,
                lo, w0, N_Q, stride_mh, stride_mn,
                MASK_CAUSAL=False, MASK_KV=not EVEN_N, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT,
                TRACK_TIES=TRACK_TIES, HAS_STAB=HAS_STAB,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION, ASM=ASM,
            )
        acc, l_i, r_i, m_i, c_i = _fwd_inner(
            acc, l_i, r_i, m_i, c_i, q, k_ptrs, v_ptrs, m_ptrs, stride_kn, stride_vn, stride_mk,
            offs_m, offs_n, offs_d, row_ok, D, N_KV, qk_scale, sm_scale, eps_raw, beta, max_shift2, stab_h, track,
            k0, k1, thr, off_bh,
            w0, w1, N_Q, stride_mh, stride_mn,
            MASK_CAUSAL=False, MASK_KV=False, MASK_KIND=0, DROPOUT=DROPOUT, TRACK_TIES=TRACK_TIES,
            HAS_STAB=HAS_STAB, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION,
            ASM=ASM,
        )
        if EDGE_LOOP:
            acc, l_i, r_i, m_i, c_i = _fwd_inner(
                acc, l_i, r_i, m_i, c_i, q, k_ptrs, v_ptrs, m_ptrs, stride_kn, stride_vn, stride_mk,
                offs_m, offs_n, offs_d, row_ok, D, N_KV, qk_scale, sm_scale, eps_raw, beta, max_shift2, stab_h, track,
                k0, k1, thr, off_bh,
                lo, hi, N_Q, stride_mh, stride_mn,
                MASK_CAUSAL=False, MASK_KV=not EVEN_N, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT,
                TRACK_TIES=TRACK_TIES, HAS_STAB=HAS_STAB,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION, ASM=ASM,
                skip_lo=w0, skip_hi=w1, c_lo=w1, c_hi=c1, EDGES=True, EDGE_HOW=EDGE_HOW,
            )
        else:
            lo = w1
            if MASK_KIND == 1:
                acc, l_i, r_i, m_i, c_i = _fwd_inner(
                    acc, l_i, r_i, m_i, c_i, q, k_ptrs, v_ptrs, m_ptrs, stride_kn, stride_vn, stride_mk,
                    offs_m, offs_n, offs_d, row_ok, D, N_KV, qk_scale, sm_scale, eps_raw, beta, max_shift2,
                    stab_h, track,
                    k0, k1, thr, off_bh,
                    w1, c1, N_Q, stride_mh, stride_mn,
                    MASK_CAUSAL=True, MASK_KV=not EVEN_N, MASK_KIND=0, DROPOUT=DROPOUT, TRACK_TIES=TRACK_TIES,
                    HAS_STAB=HAS_STAB, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION,
                    ASM=ASM,
                )
                lo = c1
    if not (WHOLE_TILES and EDGE_LOOP):  # the last loop: a mask's tiles after its whole run
        acc, l_i, r_i, m_i, c_i = _fwd_inner(
            acc, l_i, r_i, m_i, c_i, q, k_ptrs, v_ptrs, m_ptrs, stride_kn, stride_vn, stride_mk,
            offs_m, offs_n, offs_d, row_ok, D, N_KV, qk_scale, sm_scale, eps_raw, beta, max_shift2, stab_h, track,
            k0, k1, thr, off_bh,
            lo, hi, N_Q, stride_mh, stride_mn,
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
        counted = row_ok
        if MASK_KIND == 3:  # rows past the last document count nowhere
            counted = row_ok & (tl.load(Mask + offs_m, mask=row_ok, other=stride_mb) < stride_mb)
            n_rows = tl.sum(counted.to(tl.int64), 0)
        else:
            n_rows = tl.minimum(N_Q - start_m * BLOCK_M, BLOCK_M).to(tl.int64)
        live = counted
        if MASK_KIND != 0:  # rows that see no key count as masked rows, and in nothing else
            masked = counted & (r_i == float("-inf"))
            n_masked = tl.sum(masked.to(tl.int64), 0)
            tl.atomic_add(Counts + C_MASKED * H + off_h, n_masked, sem="relaxed")
            n_rows -= n_masked
            live = counted & ~masked
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
