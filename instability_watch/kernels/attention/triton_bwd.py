"""The attention backward in Triton: dK/dV, dQ (with delta and the shadow delta_hp), and delta alone
(host side: :mod:`.triton`)."""
from __future__ import annotations

import triton
import triton.language as tl

from instability_watch.kernels.triton_common import (
    C_DPOS,
    C_SHADOW,
    FLOOR,
    V_DABS,
    V_DSUM,
    dropout_keep,
    document_scores,
    dropout_key,
    edge_end,
    edge_kept,
    edge_scores,
    masked_scores,
)


@triton.jit
def _program_ids(H, Order, BLOCK: tl.constexpr, ORDERED: tl.constexpr):
    """This backward program's place (grid: blocks of ``BLOCK`` along dim 0, batch x ``H`` heads
    along dim 1; with ``ORDERED`` the other way round, the block read from ``Order``, a permutation of the
    blocks, the most work first): ``(start, off_bh, off_b, off_h, block)``, its block's first index, its
    (batch, head) and the block's number."""
    if ORDERED:
        block = tl.load(Order + tl.program_id(1))
        off_bh = tl.program_id(0)
    else:
        block = tl.program_id(0)
        off_bh = tl.program_id(1)
    start = block * BLOCK
    off_b = off_bh // H
    off_h = off_bh % H
    return start, off_bh, off_b, off_h, block


@triton.jit
def _tile_offsets(start, BLOCK: tl.constexpr, BLOCK_OTHER: tl.constexpr, HEAD_DIM: tl.constexpr):
    """int32 offsets of a tile: ``start + [0, BLOCK)``, the other axis' ``[0, BLOCK_OTHER)``, the head dim's."""
    return start + tl.arange(0, BLOCK), tl.arange(0, BLOCK_OTHER), tl.arange(0, HEAD_DIM)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, q_base, do_base, m_base, Docs, LSE2, Delta, DQacc,
    stride_qn, stride_don, stride_mn, stride_mh, lse_plane,
    offs_n, offs_m0, offs_d, d_ok, N_Q, N_KV, D, off_bh, start_n, qk_scale, scale, k0, k1, thr, drop_scale,
    lo, hi,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    FUSED_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PART: tl.constexpr,
    skip_lo=0, skip_hi=0, c_lo=0, c_hi=0, EDGES: tl.constexpr = False, EVEN_MD: tl.constexpr = False,
    EDGE_HOW: tl.constexpr = 0,
):
    """dK/dV's loop over the query blocks ``[lo, hi)`` of one query head: ``(dk, dv)`` accumulated (and with
    ``FUSED_DQ`` their dQ shares added). (With MASK_KIND 3, ``stride_mh``/``stride_mn`` carry the documents'
    window bounds.) With ``EDGES`` (a boolean mask), the blocks outside ``[skip_lo, skip_hi)``, those in
    ``[c_lo, c_hi)`` by the causal compare. With ``EVEN_MD`` (every query block whole, D the tile's width), the
    rows' loads take no mask."""
    for start_m in range(lo, edge_end(hi, skip_lo, skip_hi, EDGES), BLOCK_M):
        if EDGES:  # inline: through a helper, the forward's registers spill (sm_90, triton 3.6)
            start_m = start_m + tl.where(start_m >= skip_lo, skip_hi - skip_lo, 0)
        offs_m = start_m + offs_m0
        m_ok = offs_m < N_Q
        if EVEN_MD:
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :])
            do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :])
            lse2 = tl.load(LSE2 + off_bh * N_Q + offs_m)
            delta = tl.load(Delta + off_bh * N_Q + offs_m)
        else:
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :], mask=m_ok[:, None] & d_ok,
                         other=0.0)
            # Padded rows get lse = +inf, hence P = 0.
            lse2 = tl.load(LSE2 + off_bh * N_Q + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(Delta + off_bh * N_Q + offs_m, mask=m_ok, other=0.0)
        if MASK_KIND == 2:
            logl = tl.load(LSE2 + lse_plane + off_bh * N_Q + offs_m, mask=m_ok, other=float("inf"))
        # -- P^T for this (KV block, query block), float32, normalised by the LSE
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M), raw
        if MASK_KIND == 3:  # a packed call's documents: the mask strides carry (n_docs, win_l, win_r, 0)
            s_t = document_scores(s_t, Docs, offs_n, offs_m, N_Q, N_KV, stride_mh, stride_mn, True)
        elif MASK_KIND != 0:  # the mask read transposed: rows of the tile are keys
            ok = (offs_n[:, None] < N_KV) & m_ok[None, :]
            if EDGES:
                keep_t = edge_kept(m_base + offs_m0[None, :] * stride_mn, start_m, offs_m[None, :], offs_n[:, None],
                                   ok, stride_mn, c_lo, c_hi, EDGE_HOW)
                s_t = tl.where(keep_t, s_t, float("-inf"))
            elif MASK_KIND == 1:
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
            keep_d = tl.trans(dropout_keep(k0, k1, thr, off_bh, offs_m, start_n, BLOCK_M, BLOCK_N))
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
    return dk, dv


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, LSE2, Delta, DK, DV, DQacc, Mask, Ranges, Order, Seed,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_mb, stride_mh, stride_mn, stride_mk, stride_rb, stride_rh, stride_rm,
    H, H_KV, KV_DIV, N_Q, N_KV, D, lse_plane,
    qk_scale, scale, drop_thr, drop_scale,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, WHOLE_TILES: tl.constexpr, DROPOUT: tl.constexpr,
    FUSED_DQ: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PART: tl.constexpr, ORDERED: tl.constexpr = False, EDGE_LOOP: tl.constexpr = False,
    EVEN_MD: tl.constexpr = False, EDGE_HOW: tl.constexpr = 0,
):
    """One KV block of one KV head: dK, dV summed over the query heads that read it (GQA).

    ``EVEN_MD``: the query length a multiple of ``BLOCK_M`` and D equal to ``HEAD_DIM`` (the loops' loads take
    no mask).

    ``PART`` 0 computes both; 1 only dK, 2 only dV (the split backward: two launches, each
    with one float32 accumulator, where two would not fit the registers; D = 256).

    ``KV_DIV`` > 1 (grouped-query attention spread over more programs): the launch passes ``H_KV = H``, each
    program serves one query head, reads K/V head ``head // KV_DIV`` and writes that query head's share of
    dK/dV into (B, H, N_KV, D) buffers, which the host sums over each group.

    With ``FUSED_DQ`` (the fused backward, FA2's), also each query block's share of dQ,
    added into ``DQacc`` (B, H, N, D) float32 with atomics: five products per tile where the
    two-kernel backward takes seven, and dropout's bits generated once, not twice. The order
    of those float32 additions varies from run to run: dQ is not bitwise deterministic."""
    tl.static_assert(PART == 0 or not FUSED_DQ, "the fused backward computes dK and dV in one pass")
    tl.static_assert(not EDGE_LOOP or (MASK_KIND == 1 and WHOLE_TILES), "EDGE_LOOP: a boolean mask's tiles")
    start_n, off_bhk, off_b, off_hk, tile = _program_ids(H_KV, Order, BLOCK_N, ORDERED)
    group = H // H_KV
    offs_n, offs_m0, offs_d = _tile_offsets(start_n, BLOCK_N, BLOCK_M, HEAD_DIM)
    d_ok = offs_d[None, :] < D
    kv_mask = (offs_n[:, None] < N_KV) & d_ok
    kv_h = off_hk // KV_DIV  # the K/V head (KV_DIV > 1: one program per query head, dK/dV per query head)
    k = tl.load(K + off_b * stride_kb + kv_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + off_b * stride_vb + kv_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    k0, k1, thr = dropout_key(Seed, drop_thr, DROPOUT)
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
            r_off = off_b * stride_rb + off_h * stride_rh + tile * stride_rm
            lo = tl.load(Ranges + r_off) // BLOCK_M * BLOCK_M
            hi = tl.load(Ranges + r_off + 1)
        if MASK_KIND == 1 or MASK_KIND == 2:
            m_base = Mask + off_b * stride_mb + off_h * stride_mh + offs_n[:, None] * stride_mk
        else:
            m_base = Mask  # not read
        if WHOLE_TILES:
            # A boolean mask (or documents): with EDGE_LOOP, every query block outside the whole run in one loop
            # (in row order where the mask is causal: as causal=True), then the whole run; else the mask's blocks
            # before the run, the last of them that equal the causal mask (the diagonal) by the causal compare, the
            # run (no mask), and the mask's blocks after it (the last loop, below).
            w0 = tl.minimum(tl.maximum(tl.load(Ranges + r_off + 2), lo), hi)
            w1 = tl.minimum(tl.maximum(tl.load(Ranges + r_off + 3), w0), hi)
            c0 = w0
            if MASK_KIND == 1:
                c0 = tl.minimum(tl.maximum(tl.load(Ranges + r_off + 4), lo), w0)
            if EDGE_LOOP:
                dk, dv = _dkdv_inner(
                    dk, dv, k, v, q_base, do_base, m_base, Mask, LSE2, Delta, DQacc,
                    stride_qn, stride_don, stride_mn, stride_mh, lse_plane,
                    offs_n, offs_m0, offs_d, d_ok, N_Q, N_KV, D, off_bh, start_n, qk_scale, scale, k0, k1, thr,
                    drop_scale, lo, hi, CAUSAL=False, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT, FUSED_DQ=FUSED_DQ,
                    BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, PART=PART,
                    skip_lo=w0, skip_hi=w1, c_lo=c0, c_hi=w0, EDGES=True, EVEN_MD=EVEN_MD,
                    EDGE_HOW=EDGE_HOW)
            else:
                dk, dv = _dkdv_inner(
                    dk, dv, k, v, q_base, do_base, m_base, Mask, LSE2, Delta, DQacc,
                    stride_qn, stride_don, stride_mn, stride_mh, lse_plane,
                    offs_n, offs_m0, offs_d, d_ok, N_Q, N_KV, D, off_bh, start_n, qk_scale, scale, k0, k1, thr,
                    drop_scale, lo, c0, CAUSAL=False, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT, FUSED_DQ=FUSED_DQ,
                    BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, PART=PART,
                    EVEN_MD=EVEN_MD)
                if MASK_KIND == 1:
                    dk, dv = _dkdv_inner(
                        dk, dv, k, v, q_base, do_base, m_base, Mask, LSE2, Delta, DQacc,
                        stride_qn, stride_don, stride_mn, stride_mh, lse_plane,
                        offs_n, offs_m0, offs_d, d_ok, N_Q, N_KV, D, off_bh, start_n, qk_scale, scale, k0, k1, thr,
                        drop_scale, c0, w0, CAUSAL=True, MASK_KIND=0, DROPOUT=DROPOUT, FUSED_DQ=FUSED_DQ,
                        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, PART=PART,
                        EVEN_MD=EVEN_MD)
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, m_base, Mask, LSE2, Delta, DQacc,
                stride_qn, stride_don, stride_mn, stride_mh, lse_plane,
                offs_n, offs_m0, offs_d, d_ok, N_Q, N_KV, D, off_bh, start_n, qk_scale, scale, k0, k1, thr,
                drop_scale, w0, w1, CAUSAL=False, MASK_KIND=0, DROPOUT=DROPOUT, FUSED_DQ=FUSED_DQ,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, PART=PART,
                EVEN_MD=EVEN_MD)
            lo = w1
        if not (WHOLE_TILES and EDGE_LOOP):
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, m_base, Mask, LSE2, Delta, DQacc,
                stride_qn, stride_don, stride_mn, stride_mh, lse_plane,
                offs_n, offs_m0, offs_d, d_ok, N_Q, N_KV, D, off_bh, start_n, qk_scale, scale, k0, k1, thr,
                drop_scale, lo, hi, CAUSAL=CAUSAL, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT, FUSED_DQ=FUSED_DQ,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, PART=PART,
                EVEN_MD=EVEN_MD)

    if PART != 2:
        dk = dk * scale
    if DROPOUT and PART != 1:
        dv = dv * drop_scale
    if PART != 2:
        tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    if PART != 1:
        tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(
    dq, delta_hp, q, do, lse2, logl, delta, k_base, v_base, m_base, Docs, DMask,
    stride_kn, stride_vn, stride_mn, stride_mk, stride_mh,
    offs_m, offs_n0, offs_d, m_ok, d_ok, N_Q, N_KV, off_bh, qk_scale, scale, k0, k1, thr, drop_scale,
    lo, hi,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, SHADOW: tl.constexpr, DELTA_HP_ONLY: tl.constexpr,
    DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, skip_lo=0, skip_hi=0, c_lo=0, c_hi=0, EDGES: tl.constexpr = False,
    EVEN_ND: tl.constexpr = False, EDGE_HOW: tl.constexpr = 0,
):
    """dQ's loop over the KV blocks ``[lo, hi)`` of one query block: ``(dq, delta_hp)`` accumulated.
    (With MASK_KIND 3, ``stride_mh``/``stride_mn`` carry the documents' window bounds.) With ``EDGES`` (a
    boolean mask), the blocks outside ``[skip_lo, skip_hi)``, those in ``[c_lo, c_hi)`` by the causal compare
    (as the forward's loop). With ``EVEN_ND`` (every KV block whole, D the tile's width), the keys' loads take no
    mask and no key is past the end."""
    for start_n in range(lo, edge_end(hi, skip_lo, skip_hi, EDGES), BLOCK_N):
        if EDGES:  # inline: through a helper, the forward's registers spill (sm_90, triton 3.6)
            start_n = start_n + tl.where(start_n >= skip_lo, skip_hi - skip_lo, 0)
        offs_n = start_n + offs_n0
        if EVEN_ND:
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :])
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :])
        else:
            kv_mask = (offs_n[:, None] < N_KV) & d_ok
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK_KIND == 3:  # a packed call's documents: the mask strides carry (n_docs, win_l, win_r, 0)
            s = document_scores(s, Docs, offs_m, offs_n, N_Q, N_KV, stride_mh, stride_mn, False)
        elif EDGES:
            s = edge_scores(s, m_base + offs_n0[None, :] * stride_mk, start_n, offs_m, offs_n, m_ok, N_KV, stride_mk,
                            c_lo, c_hi, not EVEN_ND, EDGE_HOW)
        elif MASK_KIND != 0:  # as the forward: qk_scale is log2(e) for an additive mask
            s = masked_scores(s, m_base + offs_n0[None, :] * stride_mk, start_n, offs_n, m_ok, N_KV, stride_mk,
                              scale, MASK_KIND, not EVEN_ND)
        if MASK_KIND == 2:
            p = tl.math.exp2((s - lse2[:, None]) - logl[:, None])
        else:
            p = tl.math.exp2(tl.fma(s, qk_scale, -lse2[:, None]))
        if not EVEN_ND:
            keep = offs_n[None, :] < N_KV
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(keep, p, 0.0)
        elif CAUSAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        # -- dP = (dO V^T) * Z (Z: dropout's keep mask over 1 - p), dS = P * (dP - delta), dQ += bf16(dS) K
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            dp = tl.where(dropout_keep(k0, k1, thr, off_bh, offs_m, start_n, BLOCK_M, BLOCK_N), dp * drop_scale, 0.0)
        if SHADOW or DELTA_HP_ONLY:
            delta_hp += tl.sum(p * dp, 1)  # rowsum(dO * O_hp), O_hp = (P * Z) V never formed
        if not DELTA_HP_ONLY:
            ds = p * (dp - delta[:, None])
            if MASK_GRAD:  # an additive mask's gradient is dS (float32, the whole (B, H, N, N_kv))
                tl.store(DMask + off_bh * N_Q * N_KV + offs_m[:, None] * N_KV + offs_n[None, :], ds,
                         mask=m_ok[:, None] & (offs_n[None, :] < N_KV))
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq, delta_hp


@triton.jit
def attn_bwd_dq(
    Q, K, V, O, DO, LSE2, Delta, DQ, Counts, Values, Mask, Ranges, Order, Seed, DMask, DLse,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don, stride_dqb, stride_dqh, stride_dqn,
    stride_mb, stride_mh, stride_mn, stride_mk, stride_rb, stride_rh, stride_rm,
    H, GROUP, N_Q, N_KV, D, lse_plane,
    qk_scale, scale, drop_thr, drop_scale,
    CAUSAL: tl.constexpr, SHADOW: tl.constexpr, DELTA_FROM_O: tl.constexpr,
    MASK_KIND: tl.constexpr, WHOLE_TILES: tl.constexpr, DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DELTA_HP_ONLY: tl.constexpr = False,
    HAS_DLSE: tl.constexpr = False, ORDERED: tl.constexpr = False, EDGE_LOOP: tl.constexpr = False,
    EVEN_ND: tl.constexpr = False, EDGE_HOW: tl.constexpr = 0,
):
    """One query block: delta = rowsum(dO * O) (stored for the dK/dV kernel, launched after this
    one), dQ, and on shadow steps delta_hp = rowsum(P * dP) and its drift from delta.

    With ``DELTA_FROM_O`` off, delta is read from ``Delta`` instead (a caller-supplied delta).
    With ``HAS_DLSE``, ``DLse`` (B, H, N) float32 is the log-sum-exp's gradient: subtracted from the delta
    computed from O (a read delta already has it subtracted), and added back for the shadow statistics.
    With ``DELTA_HP_ONLY`` (the paper's control, a pre-pass), only delta_hp = rowsum(P * dP) =
    rowsum(dO * O_hp) is computed, P unrounded in float32, and stored into ``Delta``: no dQ.
    """
    tl.static_assert(not EDGE_LOOP or (MASK_KIND == 1 and WHOLE_TILES), "EDGE_LOOP: a boolean mask's tiles")
    start_m, off_bh, off_b, off_h, tile = _program_ids(H, Order, BLOCK_M, ORDERED)
    off_hk = off_h // GROUP
    offs_m, offs_n0, offs_d = _tile_offsets(start_m, BLOCK_M, BLOCK_N, HEAD_DIM)
    m_ok = offs_m < N_Q
    d_ok = offs_d[None, :] < D
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
    lse2 = tl.load(LSE2 + off_bh * N_Q + offs_m, mask=m_ok, other=float("inf"))
    if MASK_KIND == 2:
        logl = tl.load(LSE2 + lse_plane + off_bh * N_Q + offs_m, mask=m_ok, other=float("inf"))
    else:
        logl = lse2  # not read
    if DELTA_FROM_O:
        # delta from the stored low-precision O, as FA2's preprocessing; the dK/dV kernel
        # reads it from here (same stream, launched next), so it needs no launch of its own.
        # Read back after a barrier rather than used directly: the load takes the layout the
        # loop wants, where a direct use had the compiler convert the broadcast 2-D
        # delta[:, None] instead, a tile of registers live through the loop.
        o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
        d_o = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        if HAS_DLSE:  # the log-sum-exp's gradient enters delta: dS = P * (dP - (delta - dlse))
            d_o -= tl.load(DLse + off_bh * N_Q + offs_m, mask=m_ok, other=0.0)
        tl.store(Delta + off_bh * N_Q + offs_m, d_o, mask=m_ok)
        tl.debug_barrier()
    if DELTA_HP_ONLY:
        delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        delta = tl.load(Delta + off_bh * N_Q + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    delta_hp = tl.zeros([BLOCK_M], dtype=tl.float32)

    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    if MASK_KIND == 1 or MASK_KIND == 2:
        m_base = Mask + off_b * stride_mb + off_h * stride_mh + offs_m[:, None] * stride_mn
    else:
        m_base = Mask  # not read
    k0, k1, thr = dropout_key(Seed, drop_thr, DROPOUT)
    lo = 0
    if MASK_KIND != 0:  # the keys any row of this tile may see (a pre-pass)
        r_off = off_b * stride_rb + off_h * stride_rh + tile * stride_rm
        lo = tl.load(Ranges + r_off) // BLOCK_N * BLOCK_N
        hi = tl.load(Ranges + r_off + 1)
    elif CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, N_KV)
    else:
        hi = N_KV
    if WHOLE_TILES:
        # A boolean mask (or documents): the mask's blocks before those every row sees whole (not with EDGE_LOOP),
        # the whole run (read as no mask), then with EDGE_LOOP every other block in one loop (as the forward), else
        # the blocks that equal the causal mask (the causal compare) and the mask's blocks after them (the last
        # loop, below).
        w0 = tl.minimum(tl.maximum(tl.load(Ranges + r_off + 2), lo), hi)
        w1 = tl.minimum(tl.maximum(tl.load(Ranges + r_off + 3), w0), hi)
        if not EDGE_LOOP:
            dq, delta_hp = _dq_inner(
                dq, delta_hp, q, do, lse2, logl, delta, k_base, v_base, m_base, Mask, DMask,
                stride_kn, stride_vn, stride_mn, stride_mk, stride_mh,
                offs_m, offs_n0, offs_d, m_ok, d_ok, N_Q, N_KV, off_bh, qk_scale, scale, k0, k1, thr, drop_scale,
                lo, w0, CAUSAL=False, MASK_KIND=MASK_KIND, SHADOW=SHADOW, DELTA_HP_ONLY=DELTA_HP_ONLY,
                DROPOUT=DROPOUT, MASK_GRAD=MASK_GRAD, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
                EVEN_ND=EVEN_ND)
        dq, delta_hp = _dq_inner(
            dq, delta_hp, q, do, lse2, logl, delta, k_base, v_base, m_base, Mask, DMask,
            stride_kn, stride_vn, stride_mn, stride_mk, stride_mh,
            offs_m, offs_n0, offs_d, m_ok, d_ok, N_Q, N_KV, off_bh, qk_scale, scale, k0, k1, thr, drop_scale,
            w0, w1, CAUSAL=False, MASK_KIND=0, SHADOW=SHADOW, DELTA_HP_ONLY=DELTA_HP_ONLY, DROPOUT=DROPOUT,
            MASK_GRAD=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
            EVEN_ND=EVEN_ND)
        if EDGE_LOOP:
            c1 = tl.minimum(tl.maximum(tl.load(Ranges + r_off + 4), w1), hi)
            dq, delta_hp = _dq_inner(
                dq, delta_hp, q, do, lse2, logl, delta, k_base, v_base, m_base, Mask, DMask,
                stride_kn, stride_vn, stride_mn, stride_mk, stride_mh,
                offs_m, offs_n0, offs_d, m_ok, d_ok, N_Q, N_KV, off_bh, qk_scale, scale, k0, k1, thr, drop_scale,
                lo, hi, CAUSAL=False, MASK_KIND=MASK_KIND, SHADOW=SHADOW, DELTA_HP_ONLY=DELTA_HP_ONLY,
                DROPOUT=DROPOUT, MASK_GRAD=MASK_GRAD, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
                skip_lo=w0, skip_hi=w1, c_lo=w1, c_hi=c1, EDGES=True, EVEN_ND=EVEN_ND, EDGE_HOW=EDGE_HOW)
        else:
            lo = w1
            if MASK_KIND == 1 and EDGE_HOW == 0:  # (EDGE_READ: the tiles after the run all read, in the last loop)
                c1 = tl.minimum(tl.maximum(tl.load(Ranges + r_off + 4), w1), hi)
                dq, delta_hp = _dq_inner(
                    dq, delta_hp, q, do, lse2, logl, delta, k_base, v_base, m_base, Mask, DMask,
                    stride_kn, stride_vn, stride_mn, stride_mk, stride_mh,
                    offs_m, offs_n0, offs_d, m_ok, d_ok, N_Q, N_KV, off_bh, qk_scale, scale, k0, k1, thr, drop_scale,
                    w1, c1, CAUSAL=True, MASK_KIND=0, SHADOW=SHADOW, DELTA_HP_ONLY=DELTA_HP_ONLY, DROPOUT=DROPOUT,
                    MASK_GRAD=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
                    EVEN_ND=EVEN_ND)
                lo = c1
    if not (WHOLE_TILES and EDGE_LOOP):
        dq, delta_hp = _dq_inner(
            dq, delta_hp, q, do, lse2, logl, delta, k_base, v_base, m_base, Mask, DMask,
            stride_kn, stride_vn, stride_mn, stride_mk, stride_mh,
            offs_m, offs_n0, offs_d, m_ok, d_ok, N_Q, N_KV, off_bh, qk_scale, scale, k0, k1, thr, drop_scale,
            lo, hi, CAUSAL=CAUSAL, MASK_KIND=MASK_KIND, SHADOW=SHADOW, DELTA_HP_ONLY=DELTA_HP_ONLY, DROPOUT=DROPOUT,
            MASK_GRAD=MASK_GRAD, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
            EVEN_ND=EVEN_ND)

    if DELTA_HP_ONLY:
        tl.store(Delta + off_bh * N_Q + offs_m, delta_hp, mask=m_ok)
    else:
        dq = dq * scale
        tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok)
    if SHADOW and not DELTA_HP_ONLY:
        if MASK_KIND == 2:
            live = m_ok & (logl < float("inf"))  # rows that see a key
        else:
            live = m_ok & (lse2 < float("inf"))
        if HAS_DLSE:  # the shadow compares rowsum(dO * O) itself: the lse's share added back
            delta += tl.load(DLse + off_bh * N_Q + offs_m, mask=m_ok, other=0.0)
        err = tl.where(live, delta - delta_hp, 0.0)
        tl.atomic_add(Values + V_DSUM * H + off_h, tl.sum(err, 0), sem="relaxed")
        tl.atomic_add(Values + V_DABS * H + off_h, tl.sum(tl.abs(err), 0), sem="relaxed")
        tl.atomic_add(Counts + C_DPOS * H + off_h, tl.sum((err > 0).to(tl.int64), 0), sem="relaxed")
        tl.atomic_add(Counts + C_SHADOW * H + off_h, tl.sum(live.to(tl.int64), 0), sem="relaxed")


@triton.jit
def attn_bwd_delta(
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
