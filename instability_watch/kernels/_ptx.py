"""Inline-PTX helpers of the Triton kernels, each with a plain-Triton fallback.

The PTX paths run only on NVIDIA GPUs (the ``ASM`` / ``WARP`` constexprs, off in Triton's
interpreter, which takes the plain paths). Each helper is inlined into the kernel that
calls it, as a helper defined in the kernel's own module would be.
"""
from __future__ import annotations

import triton
import triton.language as tl


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
