"""dK and dV at head dim 256 on Hopper, in Gluon (Triton's lower-level language, same package).

At D = 256 the Triton dK/dV kernel cannot hold both float32 accumulators of a 64-key block
next to its operands (it spills), so the backward computes them in two passes, five tile
products where one pass takes four. This kernel places every operand itself: K, V and the
query tiles (Q, dO, double-buffered by TMA) stay in shared memory, P^T and dS^T go through
shared memory into the next product, and the two warpgroups split the head dim of dK and dV
(64 registers a thread each). S^T and dP^T are issued together as asynchronous wgmma and the
softmax waits only for S^T. The numerics are the Triton kernel's: P = exp2(S * qk_scale - LSE2)
in float32, rounded to the input dtype for dV = P^T dO; dS = P (dP - delta), rounded, for
dK = dS^T Q; float32 accumulators (``benchmarks/RESULTS.md``: equal to the Triton passes on the
H100, 1.2 ms against their 1.9 ms at B4 H8 N4096 causal).

It serves the calls it can: sm_90, D = 256, BF16/FP16, no mask, no dropout, one KV head per
query head, N a multiple of 64, tiles addressable by 2-D TMA (see :func:`tma_view`). Every
other call stays on the Triton kernels. ``benchmarks/d256_gluon_lab.py`` holds the variants
that were tried (dQ in the same pass, by atomics or TMA reduce-add; a software-pipelined loop).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

BLOCK = 64  # keys per program and queries per step
HEAD_DIM = 256
NUM_WARPS = 8

_kernel = None
_failed: Optional[str] = None


def tma_view(t: torch.Tensor) -> Optional[Tuple[torch.Tensor, int, int, int]]:
    """A 2-D view of a (B, H, N, D) tensor for TMA tiles, or None if its strides allow none.

    Returns ``(view, row_b, row_h, col_h)``: element (b, h, n, d) of ``t`` is
    ``view[b * row_b + h * row_h + n, h * col_h + d]``. Two layouts qualify: heads along the rows
    (contiguous (B, H, N, D)) and heads along the columns ((B, N, H, D) memory, as HF models'
    ``view(B, N, H, D).transpose(1, 2)``, including column slices of a fused QKV projection).
    """
    B, H, N, D = t.shape
    sb, sh, sn, sd = t.stride()
    es = t.element_size()
    if sd != 1 or sn < D or (sn * es) % 16 or (t.data_ptr() % 16):
        return None
    if H == 1 or sh == sn * N:  # heads along the rows
        row_h, col_h = N, 0
    elif sh % D == 0 and (H - 1) * sh + D <= sn:  # heads along the columns
        row_h, col_h = 0, sh
    else:
        return None
    if B > 1 and sb % sn:
        return None
    row_b = sb // sn if B > 1 else 0
    if B > 1 and row_b < (H - 1) * row_h + N:
        return None
    rows = (B - 1) * row_b + (H - 1) * row_h + N
    cols = (H - 1) * col_h + D
    view = torch.as_strided(t, (rows, cols), (sn, 1))
    return view, row_b, row_h, col_h


def supported(q, k, v, do, *, masked: bool, dropout: bool) -> Optional[str]:
    """None if the Gluon kernel can serve this backward call, else why not (a short reason)."""
    if _failed is not None:
        return _failed
    if masked or dropout:
        return "mask or dropout"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "not an sm_90 GPU"
    B, H, N, D = q.shape
    if D != HEAD_DIM or q.dtype not in (torch.bfloat16, torch.float16):
        return "head dim or dtype"
    if k.shape != q.shape or v.shape != q.shape or do.shape != q.shape or N % BLOCK:
        return "GQA, cross-attention or N not a multiple of 64"
    if any(t.dtype != q.dtype for t in (k, v, do)):
        return "mixed dtypes"
    return None


def available() -> bool:
    """Whether this Triton has Gluon's Hopper language (Triton 3.6 and later); without it every call
    keeps the Triton kernels, with nothing to report."""
    import importlib.util

    try:
        return importlib.util.find_spec("triton.experimental.gluon.language.nvidia.hopper") is not None
    except ImportError:
        return False


def _get_kernel():
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    return _kernel


def _build_kernel():  # noqa: C901 (one kernel)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # Triton 3.6 names these async_copy_*; later versions async_load / async_store
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after 3.6

    @gluon.jit
    def _gluon_dkdv(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE2, Delta,
                    q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, do_rb, do_rh, do_ch,
                    dk_rb, dk_rh, dk_ch, dv_rb, dv_rh, dv_ch, H, N, qk_scale, scale,
                    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    num_warps: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        start_n = gl.program_id(0) * BLOCK_N
        off_bh = gl.program_id(1)
        b = off_bh // H
        h = off_bh % H
        q_row, q_col = b * q_rb + h * q_rh, h * q_ch
        do_row, do_col = b * do_rb + h * do_rh, h * do_ch
        WG: gl.constexpr = num_warps // 4
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                        instr_shape=[16, BLOCK_M // WG, 16])
        mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                        instr_shape=[16, HEAD_DIM // WG, 16])
        p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], p_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], p_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ld_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(ld_bars.index(0), count=1)
        mbarrier.init(ld_bars.index(1), count=1)

        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [b * k_rb + h * k_rh + start_n, h * k_ch], kv_bar, k_smem)
        tma_load(v_desc, [b * v_rb + h * v_rh + start_n, h * v_ch], kv_bar, v_smem)
        if CAUSAL:
            lo = start_n // BLOCK_M * BLOCK_M
        else:
            lo = 0
        n_iter = (N - lo) // BLOCK_M
        ld_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
        mbarrier.expect(ld_bars.index(0), ld_bytes)
        tma_load(q_desc, [q_row + lo, q_col], ld_bars.index(0), q_bufs.index(0))
        tma_load(do_desc, [do_row + lo, do_col], ld_bars.index(0), do_bufs.index(0))
        mbarrier.wait(kv_bar, 0)

        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_s))
        offs_m0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_s))
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, mma_d)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, mma_d)
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_s)
        stat0 = off_bh * N
        for i in range(n_iter):
            buf = i % 2
            start_m = lo + i * BLOCK_M
            if i + 1 < n_iter:  # the next tiles into the other buffer (its readers are done: barrier below)
                nb = (i + 1) % 2
                mbarrier.expect(ld_bars.index(nb), ld_bytes)
                tma_load(q_desc, [q_row + start_m + BLOCK_M, q_col], ld_bars.index(nb),
                                                q_bufs.index(nb))
                tma_load(do_desc, [do_row + start_m + BLOCK_M, do_col], ld_bars.index(nb),
                                                do_bufs.index(nb))
            mbarrier.wait(ld_bars.index(buf), (i // 2) & 1)
            q_s = q_bufs.index(buf)
            do_s = do_bufs.index(buf)
            # S^T = K Q^T and dP^T = V dO^T, both in flight; the softmax waits only for S^T
            s_t = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            offs_m = start_m + offs_m0
            lse = gl.load(LSE2 + stat0 + offs_m)
            delta = gl.load(Delta + stat0 + offs_m)
            s_t = warpgroup_mma_wait(1, deps=(s_t, ))
            p_t = gl.exp2(s_t * qk_scale - lse[None, :])
            if CAUSAL:
                p_t = gl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
            p_smem.store(p_t.to(dtype))
            fence_async_shared()
            cta_barrier()
            dv = warpgroup_mma(p_smem, do_s, dv, is_async=True)  # dV += P^T dO
            dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
            ds_t = p_t * (dp_t - delta[None, :])
            ds_smem.store(ds_t.to(dtype))
            fence_async_shared()
            cta_barrier()
            dk = warpgroup_mma(ds_smem, q_s, dk, is_async=True)  # dK += dS^T Q
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            cta_barrier()  # both warpgroups are done with P, dS and this buffer

        mbarrier.invalidate(kv_bar)
        mbarrier.invalidate(ld_bars.index(0))
        mbarrier.invalidate(ld_bars.index(1))
        out_k = q_bufs.index(0)
        out_v = q_bufs.index(1)
        out_k.store((dk * scale).to(dtype))
        out_v.store(dv.to(dtype))
        fence_async_shared()
        cta_barrier()
        tma_store(dk_desc, [b * dk_rb + h * dk_rh + start_n, h * dk_ch], out_k)
        tma_store(dv_desc, [b * dv_rb + h * dv_rh + start_n, h * dv_ch], out_v)
        tma.store_wait(0)

    return _gluon_dkdv


def _descriptor(view: torch.Tensor):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dt = gl.bfloat16 if view.dtype == torch.bfloat16 else gl.float16
    block = [BLOCK, HEAD_DIM]
    return TensorDescriptor.from_tensor(view, block, gl.NVMMASharedLayout.get_default_for(block, dt))


def dkdv(q, k, v, do, lse2, delta, dk, dv, *, causal: bool, qk_scale: float, scale: float) -> bool:
    """Write dK and dV with the Gluon kernel; False (nothing written) where some tensor's layout
    has no 2-D TMA view. ``lse2``, ``delta``: (B, H, N) float32, contiguous."""
    views = [tma_view(t) for t in (q, k, v, do, dk, dv)]
    if any(x is None for x in views):
        return False
    B, H, N, _ = q.shape
    kernel = _get_kernel()
    descs = [_descriptor(x[0]) for x in views]
    geo = [int(n) for x in views for n in x[1:]]
    kernel[(N // BLOCK, B * H)](*descs, lse2, delta, *geo, H, N, qk_scale, scale, CAUSAL=causal,
                                HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK, BLOCK_N=BLOCK, num_warps=NUM_WARPS)
    return True


def disable(reason: str) -> None:
    """Stop using the Gluon kernel in this process (it failed once; the Triton kernels serve instead)."""
    global _failed
    _failed = reason
