"""What the Triton kernels share: probe row numbers, the call's mask kinds, the masked score, dropout's keep
mask, the stabilized shift, and inline-PTX helpers (warp-level row counts and maxima, a round-to-nearest add).

Used by the attention kernels (:mod:`.attention.triton_fwd`, :mod:`.attention.triton_bwd`)
and the statistics kernels (:mod:`.stats.triton`). The numbers they share come from
:mod:`instability_watch.probe.fields` and :mod:`.common`.

Inline-PTX helpers of the Triton kernels, each with a plain-Triton fallback.

The PTX paths run only on NVIDIA GPUs (the ``ASM`` / ``WARP`` constexprs, off in Triton's
interpreter, which takes the plain paths). Each helper is inlined into the kernel that
calls it, as a helper defined in the kernel's own module would be.
"""
import triton
import triton.language as tl

from instability_watch.kernels.common import MASK_FLOOR, PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0, PHILOX_W1
from instability_watch.probe.fields import COUNT_ROW, VALUE_ROW

# Rows of the probe buffers, as constexprs for the kernels.
C_ROWS = tl.constexpr(COUNT_ROW["rows"])
C_MULTI = tl.constexpr(COUNT_ROW["multi_max_rows"])
C_TIE_ROWS = tl.constexpr(COUNT_ROW["tie_rows"])
C_NONFINITE = tl.constexpr(COUNT_ROW["nonfinite_rows"])
C_SHADOW = tl.constexpr(COUNT_ROW["shadow_rows"])
C_DPOS = tl.constexpr(COUNT_ROW["delta_err_pos"])
C_MASKED = tl.constexpr(COUNT_ROW["masked_rows"])
V_MAXS = tl.constexpr(VALUE_ROW["max_score"])
V_DSUM = tl.constexpr(VALUE_ROW["delta_err_sum"])
V_DABS = tl.constexpr(VALUE_ROW["delta_err_abs"])

# The call's attn_mask, as a kernel's MASK_KIND reads it (host-side values).
MASK_NONE = 0
MASK_BOOL = 1  # uint8 view of a bool mask: nonzero = attend
MASK_ADD = 2  # additive float mask, added to the scaled scores; <= MASK_FLOOR (or -inf) = masked
# documents of a packed call (varlen): the "mask" is the int64 vector [doc_q (N_Q), pos_q (N_Q), doc_k (N_KV),
# pos_k (N_KV)] (kernels/stats/varlen.documents); a key is seen from its own document, within the window
MASK_DOCS = 3
FLOOR = tl.constexpr(MASK_FLOOR)
P_M0, P_M1 = tl.constexpr(PHILOX_M0), tl.constexpr(PHILOX_M1)
P_W0, P_W1 = tl.constexpr(PHILOX_W0), tl.constexpr(PHILOX_W1)
P_ROUNDS = tl.constexpr(PHILOX_ROUNDS)



@triton.jit
def at_least(x, thr, ASM: tl.constexpr):
    """1.0 where x >= thr, else 0.0 (NaN: 0.0): float32 tiles of one shape in and out.

    ``ASM``: one PTX ``set`` instruction per element; otherwise ``tl.where``.
    """
    if ASM:
        return tl.inline_asm_elementwise(
            "set.ge.f32.f32 $0, $1, $2;", "=f,f,f", [x, thr], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.where(x >= thr, 1.0, 0.0)


@triton.jit
def add_rn(x, y, ASM: tl.constexpr):
    """x + y rounded once (float32 tiles of one shape): PTX ``add.rn``, which ptxas never fuses
    with a product feeding it into an FMA (a plain add may be, differently from kernel to kernel).

    ``ASM``: the PTX instruction; otherwise ``x + y`` (the interpreter's numpy adds round once)."""
    if ASM:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return x + y


# Per-row statistics go to per-head counters in global memory. A tile-wide reduction in
# Triton is a shared-memory round trip with barriers, and a per-row atomic makes Triton
# move the operands to another layout through shared memory too; these two helpers can
# reduce over each warp in registers instead, and one lane adds the warp's result.


def _warp_row_count(i: int) -> str:
    """PTX: n{i} = the warp's rows of element i (flag f{i}, row index operand 4 + i) with the
    flag set, each counted once, by the lowest lane that ``match.any`` finds holding it."""
    return f"""
            match.any.sync.b32 same, ${4 + i}, 0xffffffff;
            neg.s32 low, same;
            and.b32 low, low, same;
            setp.eq.and.u32 lead, low, eq, f{i};
            vote.sync.ballot.b32 bal, lead, 0xffffffff;
            popc.b32 n{i}, bal;"""


ADD_ROWS_PTX = tl.constexpr(
    f"""
            {{
            .reg .pred f0, f1, any, lead;
            .reg .b32 same, low, eq, bal, n0, n1;
            .reg .b64 n64;
            setp.ne.u32 f0, $2, 0;
            setp.ne.u32 f1, $3, 0;
            or.pred any, f0, f1;
            vote.sync.any.pred any, any, 0xffffffff;
            mov.u32 n0, 0;
            @!any bra.uni skip;
            mov.u32 eq, %lanemask_eq;{_warp_row_count(0)}{_warp_row_count(1)}
            add.u32 n0, n0, n1;
            setp.eq.u32 lead, eq, 1;
            cvt.u64.u32 n64, n0;
            @lead red.relaxed.gpu.global.add.u64 [$6], n64;
            skip:
            mov.u32 $0, n0;
            mov.u32 $1, n0;
            }}
            """
)


@triton.jit
def add_rows(ptr, flag, row, WARP: tl.constexpr):
    """Add to the int64 counter ``ptr`` the number of distinct rows ``row`` whose ``flag`` is set.

    ``flag`` (bool) and ``row`` (int32, the row indices) are 1-D tiles of one shape, one
    entry per row of the caller's tile; returns an int32 tile of that shape (the PTX path's
    output, ``flag`` as int32 on the other), for the caller to ignore.

    ``WARP`` (PTX, for layouts where each row lives in one warp): two rows per lane (the
    forward's MMA layouts hold two); nothing but a vote when no lane of the warp has a flag
    (the common case); else a row held by several lanes (the MMA layouts spread a row over a
    quad) counts once, by the lowest of the lanes that ``match.any`` finds holding it, and
    lane 0 adds the warp's count. Otherwise a masked atomic per row.
    """
    if WARP:
        return tl.inline_asm_elementwise(
            ADD_ROWS_PTX, "=r,=r,r,r,r,r,l,l", [flag.to(tl.int32), row, ptr.to(tl.int64)],
            dtype=tl.int32, is_pure=False, pack=2,
        )
    else:
        tl.atomic_add(ptr + tl.zeros_like(row), tl.full(row.shape, 1, tl.int64), mask=flag, sem="relaxed")
        return flag.to(tl.int32)


@triton.jit
def max_rows(ptr, x, floor, WARP: tl.constexpr):
    """Raise the float32 ``ptr`` to the maximum of ``x`` (NaN ignored) where that exceeds ``floor``.

    ``x``: a 1-D float32 tile, one value per row; ``floor``: a float32 scalar. Returns a
    float32 tile of ``x``'s shape, for the caller to ignore.

    ``WARP`` (PTX): two values per lane; nothing but a vote when no lane of the warp exceeds
    ``floor``; else the warp's maximum through an order-preserving integer key of the float
    (bits ^ ((bits >> 31) & 0x7fffffff), its own inverse) and ``redux.sync``, and lane 0
    applies it with the integer atomics on the float's bits: signed max where >= +0,
    unsigned min where negative. Otherwise a masked atomic per row.
    """
    if WARP:
        return tl.inline_asm_elementwise(
            """
            {
            .reg .pred p, pos, up, down;
            .reg .b32 k, t, m, lane;
            .reg .f32 a, b;
            setp.num.f32 p, $2, $2;
            selp.f32 a, $2, 0fFF800000, p;
            setp.num.f32 p, $3, $3;
            selp.f32 b, $3, 0fFF800000, p;
            max.f32 a, a, b;
            mov.f32 $0, a;
            mov.f32 $1, a;
            setp.gt.f32 p, a, $4;
            vote.sync.any.pred p, p, 0xffffffff;
            @!p bra.uni skip;
            mov.b32 k, a;
            shr.s32 t, k, 31;
            and.b32 t, t, 0x7fffffff;
            xor.b32 k, k, t;
            redux.sync.max.s32 m, k, 0xffffffff;
            shr.s32 t, m, 31;
            and.b32 t, t, 0x7fffffff;
            xor.b32 m, m, t;
            mov.u32 lane, %laneid;
            setp.eq.u32 p, lane, 0;
            setp.ge.s32 pos, m, 0;
            and.pred up, p, pos;
            and.pred down, p, !pos;
            @up red.relaxed.gpu.global.max.s32 [$6], m;
            @down red.relaxed.gpu.global.min.u32 [$6], m;
            skip:
            }
            """,
            "=f,=f,f,f,f,f,l,l", [x, floor, ptr.to(tl.int64)], dtype=tl.float32, is_pure=False, pack=2,
        )
    else:
        tl.atomic_max(ptr + tl.zeros_like(x).to(tl.int32), x, mask=x > floor, sem="relaxed")
        return x


@triton.jit
def stabilized_shift2(m_std, r, beta, max_shift2):
    """Extra shift (log2 units) above the shift m_std = r * qk_scale of a row maximum r; see reference.stabilized_shift."""
    d = tl.where(r > 0, beta - 1.0, -1.0) * m_std  # beta > 1: d >= 0
    return tl.minimum(d, (max_shift2 - 1.0) + (d - tl.floor(d)))


@triton.jit
def document_scores(qk, Docs, rows, cols, N_Q, N_KV, win_l, win_r, TRANSPOSED: tl.constexpr):
    """``qk`` with a key of another document, or outside the window, at ``-inf`` (MASK_DOCS).

    ``qk`` is (rows, cols) of (query rows, keys), or with ``TRANSPOSED`` (keys, query rows) and ``rows`` the
    keys. ``Docs``: the document vector (see MASK_DOCS); positions are aligned bottom-right per document, the
    window keeps keys ``pos_q - win_l .. pos_q + win_r`` (a negative bound: none). Rows past ``N_Q`` and keys past
    ``N_KV`` read as belonging to no document."""
    if TRANSPOSED:
        q_idx = cols
        k_idx = rows
    else:
        q_idx = rows
        k_idx = cols
    q_ok = q_idx < N_Q
    k_ok = k_idx < N_KV
    doc_q = tl.load(Docs + q_idx, mask=q_ok, other=-1)
    pos_q = tl.load(Docs + N_Q + q_idx, mask=q_ok, other=0)
    doc_k = tl.load(Docs + 2 * N_Q + k_idx, mask=k_ok, other=-2)
    pos_k = tl.load(Docs + 2 * N_Q + N_KV + k_idx, mask=k_ok, other=0)
    if TRANSPOSED:
        keep = doc_k[:, None] == doc_q[None, :]
        keep = keep & ((win_l < 0) | (pos_k[:, None] >= pos_q[None, :] - win_l))
        keep = keep & ((win_r < 0) | (pos_k[:, None] <= pos_q[None, :] + win_r))
    else:
        keep = doc_q[:, None] == doc_k[None, :]
        keep = keep & ((win_l < 0) | (pos_k[None, :] >= pos_q[:, None] - win_l))
        keep = keep & ((win_r < 0) | (pos_k[None, :] <= pos_q[:, None] + win_r))
    return tl.where(keep, qk, float("-inf"))


@triton.jit
def masked_scores(qk, M_blk, start_n, cols, row_ok, N_KV, stride_mk, sm_scale,
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
def edge_end(hi, skip_lo, skip_hi, EDGES: tl.constexpr):
    """Where a loop over the tiles of ``[lo, hi)`` ends: with ``EDGES``, ``[skip_lo, skip_hi)`` (a run of whole
    tiles) skipped (each loop maps its step ``start`` onto its tile: ``start + where(start >= skip_lo,
    skip_hi - skip_lo, 0)``, written in the loop: through a helper, the forward's registers spill on sm_90)."""
    end = hi
    if EDGES:
        end = hi - (skip_hi - skip_lo)
    return end


# How an edge loop takes a boolean mask's tile (the kernels' constexpr HOW / EDGE_HOW; the kernels compare literals):
EDGE_SELECT = 0  # the causal compare and the (predicated) mask read on every tile, one select between them
EDGE_READ = 1  # the mask read on every tile (no causal compare)


@triton.jit
def edge_kept(M_blk, start_n, rows, cols, ok, stride_mk, c_lo, c_hi, HOW: tl.constexpr = 0):
    """Which entries of a boolean mask's tile are kept, the tile starting at key ``start_n`` (or, transposed, at
    row ``start_n``: ``M_blk`` then walks the rows): compared by position (row >= key) where ``start_n`` lies in
    ``[c_lo, c_hi)`` (tiles the pre-pass found equal to the causal mask), else read from the mask where ``ok``
    (False elsewhere). ``rows`` and ``cols`` broadcast to the tile's shape. ``HOW``: the same entries two ways
    (:data:`EDGE_SELECT`; :data:`EDGE_READ`, every tile read, ``c_lo``/``c_hi``, ``rows`` and ``cols`` unused)."""
    if HOW == 1:  # EDGE_READ
        keep = tl.load(M_blk + start_n * stride_mk, mask=ok, other=0) != 0
    else:
        causal = (start_n >= c_lo) & (start_n < c_hi)
        keep = tl.load(M_blk + start_n * stride_mk, mask=tl.where(causal, False, ok), other=0)
        keep = (keep != 0) | ((rows >= cols) & causal)
    return keep


@triton.jit
def edge_scores(qk, M_blk, start_n, offs_m, cols, row_ok, N_KV, stride_mk, c_lo, c_hi, MASK_KV: tl.constexpr,
                HOW: tl.constexpr = 0):
    """:func:`masked_scores` of a boolean mask's tile outside its whole run (``-inf`` where not kept), the tiles
    that equal the causal mask by the causal compare (:func:`edge_kept`)."""
    ok = row_ok[:, None]
    if MASK_KV:
        ok = ok & (cols[None, :] < N_KV)
    keep = edge_kept(M_blk, start_n, offs_m[:, None], cols[None, :], ok, stride_mk, c_lo, c_hi, HOW)
    return tl.where(keep, qk, float("-inf"))


@triton.jit
def philox(k0, k1, c0, c1, c2, c3):
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
def dropout_key(Seed, drop_thr, DROPOUT: tl.constexpr):
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
def halves(x):
    """A word's two 16-bit halves on a new last axis: ``(.., 2)``, low first."""
    return tl.join(x & 0xFFFF, x >> 16)


@triton.jit
def dropout_keep(k0, k1, thr, bh, offs_m, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
        x0, x1, x2, x3 = philox(k0, k1, c0, c1, c2, c3)
        second = (start_n // 16) % 2 == 1
        ws = tl.join(halves(tl.where(second, x2, x0)), halves(tl.where(second, x3, x1)))  # (M, 1, t, h, w)
        bits = tl.reshape(tl.permute(ws, (0, 1, 4, 2, 3)), (BLOCK_M, BLOCK_N))
    else:
        G: tl.constexpr = BLOCK_N // 32
        shape: tl.constexpr = (BLOCK_M, G, 4)
        g = start_n // 32 + tl.arange(0, G)
        c0 = tl.broadcast_to((4 * g[None, :, None] + T[None, None, :]).to(tl.uint32), shape)
        c1 = tl.broadcast_to(offs_m.to(tl.uint32)[:, None, None], shape)
        c2 = tl.zeros(shape, dtype=tl.uint32) + bh.to(tl.uint32)
        c3 = tl.zeros(shape, dtype=tl.uint32)
        x0, x1, x2, x3 = philox(k0, k1, c0, c1, c2, c3)
        # (M, g, t, h, a, b) with word w = 2 a + b, then (M, g, a, b, t, h): column 32 g + 8 w + 2 t + h
        ws = tl.join(tl.join(halves(x0), halves(x2)), tl.join(halves(x1), halves(x3)))
        bits = tl.reshape(tl.permute(ws, (0, 1, 4, 5, 2, 3)), (BLOCK_M, BLOCK_N))
    return bits >= thr
