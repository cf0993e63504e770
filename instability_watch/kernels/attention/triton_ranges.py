"""The mask pre-pass in Triton: each tile's key range and run of whole tiles, in one launch (host side:
:class:`.triton._MaskArgs`).

Its PyTorch form took about forty small operations per range (a reduction per tile axis, argmax tricks for the
first and last tile and for the first run), about 1 ms of host time per call on the H200 machine and 0.2 ms of GPU
time: more than a sliding-window call's forward kernel. One program here walks one tile's row (or column) of
tiles of the mask, reading each once.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mask_ranges(
    Mask, Out,
    stride_mb, stride_mh, stride_mn, stride_mk,
    stride_ob, stride_oh, stride_ot,
    H_M, N, N_KV, N_OTHER,
    COLS: tl.constexpr, WHOLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One tile's ranges: ``Out[b, h, t] = (lo, hi, whole_lo, whole_hi)``, int32.

    ``Mask`` (B_m, H_m, N, N_KV) uint8, nonzero = kept (the mask's own extent, ``N`` > 1 rows). Without ``COLS``,
    program ``t`` is query tile ``t`` (``BLOCK_M`` rows) and walks the ``N_OTHER`` key tiles (``BLOCK_N`` keys):
    ``lo``/``hi`` the first and past-the-last key of the tiles some row sees (``hi`` at most ``N_KV``), and
    ``[whole_lo, whole_hi)`` the first run of key tiles every row sees whole (rows past ``N`` count as seeing
    everything, keys past ``N_KV`` as unseen; ``(0, 0)`` if there is none, or without ``WHOLE``). With ``COLS``,
    program ``t`` is key tile ``t`` and walks the query tiles, the ranges in query rows (``hi`` at most ``N``)."""
    t = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H_M
    off_h = off_bh % H_M
    base = Mask + off_b * stride_mb + off_h * stride_mh
    lo = -1
    hi = 0
    w0 = -1
    w1 = -1
    for j in range(0, N_OTHER):
        if COLS:
            rows = j * BLOCK_M + tl.arange(0, BLOCK_M)
            keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
        else:
            rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
            keys = j * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        key_ok = keys < N_KV
        inside = row_ok[:, None] & key_ok[None, :]
        keep = tl.load(base + rows[:, None] * stride_mn + keys[None, :] * stride_mk, mask=inside, other=0) != 0
        seen = tl.max(tl.max(keep.to(tl.int32), 1), 0) > 0
        lo = tl.where(seen & (lo < 0), j, lo)
        hi = tl.where(seen, j + 1, hi)
        if WHOLE:
            # a whole tile: every real row keeps every key, and every key is a real one
            whole = tl.min(tl.min((keep | ~row_ok[:, None]).to(tl.int32), 1), 0) > 0
            whole = whole & (tl.min(key_ok.to(tl.int32), 0) > 0)
            start = whole & (w0 < 0)
            w0 = tl.where(start, j, w0)
            w1 = tl.where(start | (whole & (w1 == j)), j + 1, w1)
    unit = BLOCK_M if COLS else BLOCK_N
    end = N if COLS else N_KV
    seen_any = lo >= 0
    lo = tl.where(seen_any, lo * unit, 0)
    hi = tl.where(seen_any, tl.minimum(hi * unit, end), 0)
    has_whole = w0 >= 0
    w0 = tl.where(has_whole, w0 * unit, 0)
    w1 = tl.where(has_whole, w1 * unit, 0)
    out = Out + off_b * stride_ob + off_h * stride_oh + t * stride_ot
    tl.store(out, lo)
    tl.store(out + 1, hi)
    tl.store(out + 2, w0)
    tl.store(out + 3, w1)
