"""The mask pre-pass in Triton: each tile's key range, run of whole tiles and run of causal tiles, in two launches
(host side: :class:`.masks.MaskArgs`).

Its PyTorch form took about forty small operations per range (a reduction per tile axis, argmax tricks for the
first and last tile and for the first run), about 1 ms of host time per call on the H200 machine and 0.2 ms of GPU
time: more than a sliding-window call's forward kernel. A first Triton form walked one tile's row of mask tiles in
one program, a load at a time: 0.1-0.2 ms a launch on an 8,192 x 8,192 mask (H200, 2026-11-28), its loads waiting
on each other. Now one program per pair of tiles reads its tile of the mask once (:func:`mask_tile_flags`: every
load at once; the pairs along the grid's first axis, the mask's planes along its second, as every launch here) and
one program per tile reads that tile's row of flags, a byte per tile (:func:`mask_flag_ranges`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from instability_watch.kernels.triton_common import FLOOR

SEEN = tl.constexpr(1)  # some real row keeps some key of the tile
WHOLE = tl.constexpr(2)  # every real row keeps every key of the tile, and every key is a real one
CAUSAL_TILE = tl.constexpr(4)  # every real row keeps exactly the keys at or before its own position; every key is real


@triton.jit
def mask_tile_flags(
    Mask, Flags,
    stride_mb, stride_mh, stride_mn, stride_mk,
    stride_fb, stride_fh, stride_ft,
    H_M, N, N_KV, N_OTHER,
    COLS: tl.constexpr, ADDITIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr = False,
):
    """``Flags[b, h, t, j]`` (uint8): :data:`SEEN` | :data:`WHOLE` | :data:`CAUSAL_TILE` of the mask tile at tile
    ``t`` and tile ``j`` of the other axis (grid: ``t * N_OTHER + j``, batch x heads of the mask). ``Mask`` (B_m, H_m, N, N_KV): uint8,
    nonzero = kept, or with ``ADDITIVE`` a float mask, kept where not at or below ``FLOOR`` in float32 (as the
    attention and statistics kernels read it; NaN kept). Without ``COLS``, ``t`` is a query tile (``BLOCK_M`` rows) and ``j`` a
    key tile (``BLOCK_N`` keys); with it, the other way round. Rows past ``N`` count as seeing everything, keys past
    ``N_KV`` as unseen.

    With ``WORDS`` (a boolean mask whose rows start on 4-byte boundaries, ``N_KV`` a multiple of 4), ``Mask`` is the
    same memory as int32 words, four keys each (key ``4w + b`` in byte ``b``, little-endian), its strides in words
    (``stride_mk`` unused): a quarter of the loads and compares. A tile is whole where each of its words is
    ``0x01010101`` and causal where each word equals the causal pattern of its row; a byte other than 0 or 1 (not
    made by PyTorch's boolean operations) counts as seen but never as whole or causal, where the kernels read it."""
    t = tl.program_id(0) // N_OTHER
    j = tl.program_id(0) % N_OTHER
    off_bh = tl.program_id(1)
    off_b = off_bh // H_M
    off_h = off_bh % H_M
    if COLS:
        rows = j * BLOCK_M + tl.arange(0, BLOCK_M)
        keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
        keys = j * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    base = Mask + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
    if WORDS:  # four keys a word: the tile's first key and the words' first keys
        first = (t if COLS else j) * BLOCK_N
        words = first // 4 + tl.arange(0, BLOCK_N // 4)
        key_ok = 4 * words < N_KV  # (N_KV a multiple of 4: a word is all in or all out)
        inside = row_ok[:, None] & key_ok[None, :]
        x = tl.load(base + rows[:, None].to(tl.int64) * stride_mn + words[None, :], mask=inside, other=0)
        seen = tl.max(tl.max((x != 0).to(tl.int32), 1), 0) > 0
        whole = tl.min(tl.min(((x == 0x01010101) | ~row_ok[:, None]).to(tl.int32), 1), 0) > 0
        # the causal pattern of a row's word: its first n keys kept, n = row - first key + 1 in [0, 4]
        n = tl.minimum(tl.maximum(rows[:, None] - 4 * words[None, :] + 1, 0), 4)
        pattern = tl.where(n >= 4, 0x01010101, tl.where(n == 3, 0x010101, tl.where(n == 2, 0x0101, n)))
        causal = tl.min(tl.min((~inside | (x == pattern)).to(tl.int32), 1), 0) > 0
    else:
        key_ok = keys < N_KV
        inside = row_ok[:, None] & key_ok[None, :]
        x = tl.load(base + rows[:, None].to(tl.int64) * stride_mn + keys[None, :] * stride_mk, mask=inside, other=0)
        if ADDITIVE:
            keep = inside & ~(x.to(tl.float32) <= FLOOR)
        else:
            keep = x != 0
        seen = tl.max(tl.max(keep.to(tl.int32), 1), 0) > 0
        whole = tl.min(tl.min((keep | ~row_ok[:, None]).to(tl.int32), 1), 0) > 0
        causal = tl.min(tl.min((~inside | (keep == (rows[:, None] >= keys[None, :]))).to(tl.int32), 1), 0) > 0
    whole = whole & (tl.min(key_ok.to(tl.int32), 0) > 0)
    causal = causal & (tl.min(key_ok.to(tl.int32), 0) > 0)  # (the causal loops leave keys past N_KV to the caller)
    flag = tl.where(seen, SEEN, 0) | tl.where(whole, WHOLE, 0) | tl.where(causal, CAUSAL_TILE, 0)
    tl.store(Flags + off_b * stride_fb + off_h * stride_fh + t * stride_ft + j, flag.to(tl.uint8))


@triton.jit
def _tile_flags(row, t, idx, ok, stride_ft, stride_fo, R_T, R_O, T_SUB: tl.constexpr, O_SUB: tl.constexpr,
                COLS: tl.constexpr):
    """The flags of tile ``t`` against the tiles ``idx`` of the other axis (0 where not ``ok``), int32: each read
    from ``row`` (the plane's flags) at ``t * stride_ft + idx * stride_fo``, or with ``T_SUB`` x ``O_SUB`` > 1 made
    from that many base tiles (:data:`.masks.FLAG_BASE`; ``R_T`` x ``R_O`` of them): seen if any is seen, whole
    or causal if all are. A base tile past the last row counts as whole and causal, as the rows past the end do
    in :func:`mask_tile_flags`; one past the last key as neither (with ``COLS`` the tile axis is the keys)."""
    if T_SUB * O_SUB == 1:
        return tl.load(row + t * stride_ft + idx * stride_fo, mask=ok, other=0).to(tl.int32)
    seen = tl.zeros_like(idx)
    both = tl.zeros_like(idx) + (WHOLE | CAUSAL_TILE)
    for ts in tl.static_range(T_SUB):
        for so in tl.static_range(O_SUB):
            bt = t * T_SUB + ts
            bo = idx * O_SUB + so
            t_in = bt < R_T
            o_in = bo < R_O
            # (a scalar condition joins the vector ones through where: the interpreter takes no scalar & vector mask)
            f = tl.load(row + bt * stride_ft + bo * stride_fo, mask=tl.where(t_in, ok & o_in, False), other=0)
            f = f.to(tl.int32)
            if COLS:  # the tile axis is the keys, the other one the rows
                f = tl.where(tl.where(t_in, ~o_in, False), WHOLE | CAUSAL_TILE, f)
            else:
                f = tl.where(tl.where(t_in, False, o_in), WHOLE | CAUSAL_TILE, f)
            seen = seen | (f & SEEN)
            both = both & f
    return tl.where(ok, seen | (both & (WHOLE | CAUSAL_TILE)), 0)


@triton.jit
def mask_flag_ranges(
    Flags, Out,
    stride_fb, stride_fh, stride_ft,
    stride_ob, stride_oh, stride_ot,
    H_M, N_OTHER, END, stride_fo, R_T, R_O,
    UNIT: tl.constexpr, WANT_WHOLE: tl.constexpr, WANT_CAUSAL: tl.constexpr, COLS: tl.constexpr,
    CHUNK: tl.constexpr, T_SUB: tl.constexpr = 1, O_SUB: tl.constexpr = 1,
):
    """One tile's ranges from its row of flags (``N_OTHER`` tiles of ``UNIT`` along the other axis, which ends at
    ``END``): ``Out[b, h, t] = (lo, hi, whole_lo, whole_hi, causal_end)``, int32: ``lo``/``hi`` the first and
    past-the-last index of the tiles seen (``hi`` at most ``END``; ``(0, 0)`` if none), ``[whole_lo, whole_hi)`` the
    first run of whole tiles (without ``WANT_WHOLE``, or where there is none: ``(0, 0)``, and with ``COLS``
    ``(hi, hi)``), and a run of causal tiles beside it (:data:`CAUSAL_TILE`; ``WANT_CAUSAL``): without ``COLS``
    ``[whole_hi, causal_end)``, the run that starts where the whole run ends (or at ``lo`` if there is none), with
    ``COLS`` ``[causal_end, whole_lo)``, the run that ends where the whole run starts (or at ``hi``); without
    ``WANT_CAUSAL`` ``whole_hi`` (``whole_lo`` with ``COLS``): an empty run once the kernels clamp it. (The diagonal tiles: a query tile's keys end with them, a key tile's rows start
    with them.) ``stride_fo``: the flags' stride along the other axis; ``T_SUB``, ``O_SUB``, ``R_T``, ``R_O``: the
    tile made from base tiles (:func:`_tile_flags`)."""
    t = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H_M
    off_h = off_bh % H_M
    row = Flags + off_b * stride_fb + off_h * stride_fh
    lo = N_OTHER
    hi = 0
    w0 = N_OTHER
    for c in range(0, N_OTHER, CHUNK):
        idx = c + tl.arange(0, CHUNK)
        ok = idx < N_OTHER
        f = _tile_flags(row, t, idx, ok, stride_ft, stride_fo, R_T, R_O, T_SUB, O_SUB, COLS)
        seen = ok & ((f & SEEN) != 0)
        lo = tl.minimum(lo, tl.min(tl.where(seen, idx, N_OTHER), 0))
        hi = tl.maximum(hi, tl.max(tl.where(seen, idx + 1, 0), 0))
        w0 = tl.minimum(w0, tl.min(tl.where(ok & ((f & WHOLE) != 0), idx, N_OTHER), 0))
    w1 = N_OTHER
    if WANT_WHOLE:  # the first run ends at the first tile past w0 that is not whole
        for c in range(0, N_OTHER, CHUNK):
            idx = c + tl.arange(0, CHUNK)
            ok = idx < N_OTHER
            f = _tile_flags(row, t, idx, ok, stride_ft, stride_fo, R_T, R_O, T_SUB, O_SUB, COLS)
            ends = ok & (idx > w0) & ((f & WHOLE) == 0)
            w1 = tl.minimum(w1, tl.min(tl.where(ends, idx, N_OTHER), 0))
    else:
        w0 = N_OTHER
    seen_any = hi > 0
    has_whole = w0 < N_OTHER
    lo = tl.where(seen_any, lo, 0)
    hi = tl.where(seen_any, hi, 0)
    hi_u = tl.minimum(hi * UNIT, END)
    if COLS:  # without a run of whole tiles, it stands at hi (the causal run before it ends there)
        w0_u = tl.where(has_whole, w0 * UNIT, hi_u)
        w1_u = tl.where(has_whole, w1 * UNIT, hi_u)
        w0 = tl.where(has_whole, w0, hi)
        c_u = w0_u
    else:
        w0_u = tl.where(has_whole, w0 * UNIT, 0)
        w1_u = tl.where(has_whole, w1 * UNIT, 0)
        c_u = w1_u
    if WANT_CAUSAL:
        if COLS:  # back from the whole run (or hi) while the tiles are causal, not below lo
            last_not = lo - 1
            for c in range(0, N_OTHER, CHUNK):
                idx = c + tl.arange(0, CHUNK)
                f = _tile_flags(row, t, idx, idx < N_OTHER, stride_ft, stride_fo, R_T, R_O, T_SUB, O_SUB, COLS)
                bad = (idx < w0) & ((f & CAUSAL_TILE) == 0)
                last_not = tl.maximum(last_not, tl.max(tl.where(bad, idx, -1), 0))
            c_u = tl.minimum((last_not + 1) * UNIT, w0_u)
        else:  # on from the whole run's end (or lo) while the tiles are causal, not past hi
            start = tl.where(has_whole, w1, lo)
            first_not = N_OTHER
            for c in range(0, N_OTHER, CHUNK):
                idx = c + tl.arange(0, CHUNK)
                ok = idx < N_OTHER
                f = _tile_flags(row, t, idx, ok, stride_ft, stride_fo, R_T, R_O, T_SUB, O_SUB, COLS)
                bad = ok & (idx >= start) & ((f & CAUSAL_TILE) == 0)
                first_not = tl.minimum(first_not, tl.min(tl.where(bad, idx, N_OTHER), 0))
            c_u = tl.maximum(tl.minimum(first_not * UNIT, hi_u), start * UNIT)
    out = Out + off_b * stride_ob + off_h * stride_oh + t * stride_ot
    tl.store(out, lo * UNIT)
    tl.store(out + 1, hi_u)
    tl.store(out + 2, w0_u)
    tl.store(out + 3, w1_u)
    tl.store(out + 4, c_u)


@triton.jit
def tile_order(
    Ranges, Order,
    stride_rb, stride_rh, stride_rt,
    H_R, PLANES, T,
    BLOCK_T: tl.constexpr,
):
    """``Order[rank] = t`` for tile ``t`` (one program each): the tiles by their widest span ``hi - lo`` over the
    ``PLANES`` (batch x heads, ``H_R`` heads) planes of ``Ranges`` (..., T, R) int32, widest first, ties in tile
    order (``torch.argsort(span, descending=True, stable=True)``, found on the device in one launch)."""
    t = tl.program_id(0)
    idx = tl.arange(0, BLOCK_T)
    ok = idx < T
    span = tl.full([BLOCK_T], -1, dtype=tl.int32)
    for p in range(0, PLANES):
        base = Ranges + (p // H_R) * stride_rb + (p % H_R) * stride_rh + idx * stride_rt
        lo = tl.load(base, mask=ok, other=0)
        hi = tl.load(base + 1, mask=ok, other=0)
        span = tl.maximum(span, hi - lo)
    span = tl.where(ok, span, -2)  # (past the tiles: below any span)
    mine = tl.sum(tl.where(idx == t, span, 0), 0)
    before = (span > mine) | ((span == mine) & (idx < t))
    rank = tl.sum(before.to(tl.int32), 0)
    tl.store(Order + rank, t)
