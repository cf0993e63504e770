"""D = 256 backward in Gluon: dK, dV and dQ from one pass over the queries (five products per tile).

    PYTHONPATH=$PWD python benchmarks/d256_gluon_lab.py --out DIR      # GPU (Hopper): check, then time
    python benchmarks/d256_gluon_lab.py --compile-only                 # any machine: sm_90 registers, spills

Our Triton backward at D = 256 takes eight tile products in three launches (dV; dK; dQ), because
one pass with dK and dV both in registers spills and Triton has no other way to reduce dQ across
key blocks cheaply. Gluon (Triton's lower-level language, shipped in the same package) lets the
kernel place every operand itself: K, V, Q, dO, P and dS stay in shared memory, the two warpgroups
split the head dim of the dK and dV accumulators (64 registers a thread each at 64 keys), S^T and
dP^T are issued as asynchronous wgmma while the previous results are consumed, and dQ = dS K is
computed in column chunks and added to a float32 buffer with relaxed atomics. This lab measures
whether that reaches the D = 256 bar (fwd+bwd at least cuDNN's on the same call). Not used by the
package; benchmarks/RESULTS.md records what it found.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk tensor reduce-add of a shared-memory tile into global memory (cp.reduce.async.bulk.tensor).

    Triton 3.6 builds this op for ``tensor_descriptor.atomic_add`` but Gluon has no wrapper for it; the
    issuing thread's ``tma.store_wait`` covers it like a TMA store."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _g_bwd(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dqa_desc, LSE2, Delta, DQA, N, qk_scale, scale,
           CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
           DQ_CHUNK: gl.constexpr, DQ: gl.constexpr, DQ_PIPE: gl.constexpr, num_warps: gl.constexpr):
    """One key block of one (batch, head): dK, dV stored; dQ * (1/scale) added into DQA (float32)."""
    start_n = gl.program_id(0) * BLOCK_N
    row0 = gl.program_id(1) * N
    WG: gl.constexpr = num_warps // 4
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                    instr_shape=[16, BLOCK_M // WG, 16])
    mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                    instr_shape=[16, HEAD_DIM // WG, 16])
    mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                    instr_shape=[16, DQ_CHUNK // WG, 16])
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_M], p_layout)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_M], p_layout)
    if DQ == 2:  # dQ chunks staged for the TMA reduce, in boxes of dqa_desc's width (128 bytes)
        RW: gl.constexpr = dqa_desc.block_type.shape[1]
        dq_stage = gl.allocate_shared_memory(gl.float32, [BLOCK_M, DQ_CHUNK], dqa_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ld_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(ld_bars.index(0), count=1)
    mbarrier.init(ld_bars.index(1), count=1)

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row0 + start_n, 0], kv_bar, v_smem)
    if CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
    else:
        lo = 0
    n_iter = (N - lo) // BLOCK_M
    ld_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    mbarrier.expect(ld_bars.index(0), ld_bytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + lo, 0], ld_bars.index(0), q_bufs.index(0))
    tma.async_copy_global_to_shared(do_desc, [row0 + lo, 0], ld_bars.index(0), do_bufs.index(0))
    mbarrier.wait(kv_bar, 0)

    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_s))
    offs_m0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_s))
    rows_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_q))
    cols_q = gl.arange(0, DQ_CHUNK, layout=gl.SliceLayout(0, mma_q))
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, mma_d)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, mma_d)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_s)
    zero_q = gl.zeros([BLOCK_M, DQ_CHUNK], gl.float32, mma_q)
    for i in range(n_iter):
        buf = i % 2
        start_m = lo + i * BLOCK_M
        if i + 1 < n_iter:  # the next tiles, into the other buffer (its last readers finished: barrier below)
            nb = (i + 1) % 2
            mbarrier.expect(ld_bars.index(nb), ld_bytes)
            tma.async_copy_global_to_shared(q_desc, [row0 + start_m + BLOCK_M, 0], ld_bars.index(nb),
                                            q_bufs.index(nb))
            tma.async_copy_global_to_shared(do_desc, [row0 + start_m + BLOCK_M, 0], ld_bars.index(nb),
                                            do_bufs.index(nb))
        mbarrier.wait(ld_bars.index(buf), (i // 2) & 1)
        q_s = q_bufs.index(buf)
        do_s = do_bufs.index(buf)
        s_t = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        offs_m = start_m + offs_m0
        lse = gl.load(LSE2 + row0 + offs_m)
        delta = gl.load(Delta + row0 + offs_m)
        s_t = warpgroup_mma_wait(1, deps=(s_t, ))
        p_t = gl.exp2(s_t * qk_scale - lse[None, :])
        if CAUSAL:
            p_t = gl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        p_smem.store(p_t.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        dv = warpgroup_mma(p_smem, do_s, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
        ds_t = p_t * (dp_t - delta[None, :])
        ds_smem.store(ds_t.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        dk = warpgroup_mma(ds_smem, q_s, dk, is_async=True)
        if DQ:
            NC: gl.constexpr = HEAD_DIM // DQ_CHUNK
            ds_q = ds_smem.permute((1, 0))
            dq = warpgroup_mma(ds_q, k_smem.slice(0, DQ_CHUNK, dim=1), zero_q, use_acc=False, is_async=True)
            for c in gl.static_range(NC):
                if DQ_PIPE and c + 1 < NC:  # the next chunk's product runs while this one's atomics go out
                    dq_next = warpgroup_mma(ds_q, k_smem.slice((c + 1) * DQ_CHUNK, DQ_CHUNK, dim=1), zero_q,
                                            use_acc=False, is_async=True)
                    dq = warpgroup_mma_wait(1, deps=(dq, ))
                else:
                    dq = warpgroup_mma_wait(0, deps=(dq, ))
                dq = dq * scale
                if DQ == 2:
                    tma.store_wait(0)  # the last chunk's reduce has read the staging buffer
                    gl.thread_barrier()
                    dq_stage.store(dq)
                    fence_async_shared()
                    gl.thread_barrier()
                    for j in gl.static_range(DQ_CHUNK // RW):
                        _tma_reduce_add(dqa_desc, [row0 + start_m, c * DQ_CHUNK + j * RW],
                                        dq_stage.slice(j * RW, RW, dim=1))
                else:
                    ptrs = DQA + (row0 + start_m + rows_q)[:, None] * HEAD_DIM + (c * DQ_CHUNK + cols_q)[None, :]
                    gl.atomic_add(ptrs, dq, sem="relaxed")
                if c + 1 < NC:
                    if DQ_PIPE:
                        dq = dq_next
                    else:
                        dq = warpgroup_mma(ds_q, k_smem.slice((c + 1) * DQ_CHUNK, DQ_CHUNK, dim=1), zero_q,
                                           use_acc=False, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        gl.thread_barrier()  # every warpgroup is done with p, dS and this buffer before they are rewritten

    mbarrier.invalidate(kv_bar)
    mbarrier.invalidate(ld_bars.index(0))
    mbarrier.invalidate(ld_bars.index(1))
    if DQ == 2:
        tma.store_wait(0)
    out_k = q_bufs.index(0)
    out_v = q_bufs.index(1)
    out_k.store((dk * scale).to(gl.bfloat16))
    out_v.store(dv.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [row0 + start_n, 0], out_k)
    tma.async_copy_shared_to_global(dv_desc, [row0 + start_n, 0], out_v)
    tma.store_wait(0)


@gluon.jit
def _g_dkdv(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE2, Delta, N, qk_scale, scale,
            CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            num_warps: gl.constexpr):
    """dK and dV of one key block, software-pipelined: the next query tile's S^T and dP^T products are
    issued before waiting on this tile's dK and dV, so the tensor cores see no gap between tiles."""
    start_n = gl.program_id(0) * BLOCK_N
    row0 = gl.program_id(1) * N
    WG: gl.constexpr = num_warps // 4
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                    instr_shape=[16, BLOCK_M // WG, 16])
    mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                    instr_shape=[16, HEAD_DIM // WG, 16])
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_M], p_layout)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_M], p_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ld_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(ld_bars.index(0), count=1)
    mbarrier.init(ld_bars.index(1), count=1)

    if CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
    else:
        lo = 0
    n_iter = (N - lo) // BLOCK_M
    ld_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row0 + start_n, 0], kv_bar, v_smem)
    for j in gl.static_range(2):
        more = j < n_iter
        mbarrier.expect(ld_bars.index(j), ld_bytes, pred=more)
        tma.async_copy_global_to_shared(q_desc, [row0 + lo + j * BLOCK_M, 0], ld_bars.index(j), q_bufs.index(j),
                                        pred=more)
        tma.async_copy_global_to_shared(do_desc, [row0 + lo + j * BLOCK_M, 0], ld_bars.index(j),
                                        do_bufs.index(j), pred=more)
    mbarrier.wait(kv_bar, 0)
    mbarrier.wait(ld_bars.index(0), 0)

    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_s))
    offs_m0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_s))
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, mma_d)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, mma_d)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_s)
    s_t = warpgroup_mma(k_smem, q_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_smem, do_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    for i in range(n_iter):
        buf = i % 2
        q_s = q_bufs.index(buf)
        do_s = do_bufs.index(buf)
        offs_m = lo + i * BLOCK_M + offs_m0
        lse = gl.load(LSE2 + row0 + offs_m)
        delta = gl.load(Delta + row0 + offs_m)
        s_t = warpgroup_mma_wait(1, deps=(s_t, ))
        p_t = gl.exp2(s_t * qk_scale - lse[None, :])
        if CAUSAL:
            p_t = gl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        p_smem.store(p_t.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        dv = warpgroup_mma(p_smem, do_s, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
        ds_t = p_t * (dp_t - delta[None, :])
        ds_smem.store(ds_t.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        dk = warpgroup_mma(ds_smem, q_s, dk, is_async=True)
        # the next tile's S^T and dP^T go in behind dK (on the last tile: this tile again, discarded)
        nxt = gl.minimum(i + 1, n_iter - 1)
        mbarrier.wait(ld_bars.index(nxt % 2), (nxt // 2) & 1)
        s_t = warpgroup_mma(k_smem, q_bufs.index(nxt % 2).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_smem, do_bufs.index(nxt % 2).permute((1, 0)), zero_s, use_acc=False,
                             is_async=True)
        dv, dk = warpgroup_mma_wait(2, deps=(dv, dk))
        gl.thread_barrier()  # both warpgroups are done with this buffer, P and dS
        more = i + 2 < n_iter
        mbarrier.expect(ld_bars.index(buf), ld_bytes, pred=more)
        tma.async_copy_global_to_shared(q_desc, [row0 + lo + (i + 2) * BLOCK_M, 0], ld_bars.index(buf), q_s,
                                        pred=more)
        tma.async_copy_global_to_shared(do_desc, [row0 + lo + (i + 2) * BLOCK_M, 0], ld_bars.index(buf), do_s,
                                        pred=more)
    s_t, dp_t = warpgroup_mma_wait(0, deps=(s_t, dp_t))
    gl.thread_barrier()
    mbarrier.invalidate(kv_bar)
    mbarrier.invalidate(ld_bars.index(0))
    mbarrier.invalidate(ld_bars.index(1))
    out_k = q_bufs.index(0)
    out_v = q_bufs.index(1)
    out_k.store((dk * scale).to(gl.bfloat16))
    out_v.store(dv.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [row0 + start_n, 0], out_k)
    tma.async_copy_shared_to_global(dv_desc, [row0 + start_n, 0], out_v)
    tma.store_wait(0)


VARIANTS = [  # (BLOCK_M, BLOCK_N, DQ_CHUNK, num_warps, DQ, DQ_PIPE)
    (64, 64, 64, 8, 1, False),  # DQ=1: relaxed atomics from registers
    (64, 64, 128, 8, 1, False),
    (64, 64, 64, 8, 0, False),  # no dQ: what the atomics and the fifth product cost
    (64, 64, 64, 8, "pipe", False),  # no dQ, software-pipelined (_g_dkdv)
    (64, 64, 64, 8, 2, False),  # dQ through TMA reduce-add (DQ=2)
    (64, 64, 64, 8, 2, True),
    (64, 64, 32, 8, 2, True),
]


def _layout(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def _layout32(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.float32)


def _resources(cubin):
    """Registers and spill stores of a cubin, from cuobjdump (bundled with Triton)."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    spill = re.search(r"STACK:(\d+)", text)
    return dict(regs=int(regs.group(1)) if regs else None, stack=int(spill.group(1)) if spill else None)


def compile_only(variants, causal=True, D=256):
    """Compile each variant for sm_90 without a GPU; print registers, spills, shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    out = []
    for bm, bn, ch, w, dq, pipe in variants:
        def desc(rows):
            return f"tensordesc<bf16[{rows}, {D}],{_layout([rows, D])!r}>"

        sig = dict(q_desc=desc(bm), k_desc=desc(bn), v_desc=desc(bn), do_desc=desc(bm), dk_desc=desc(bn),
                   dv_desc=desc(bn), dqa_desc=f"tensordesc<fp32[{bm}, 32],{_layout32([bm, 32])!r}>", LSE2="*fp32", Delta="*fp32", DQA="*fp32", N="i32", qk_scale="fp32",
                   scale="fp32", CAUSAL="constexpr", HEAD_DIM="constexpr", BLOCK_M="constexpr",
                   BLOCK_N="constexpr", DQ_CHUNK="constexpr", DQ="constexpr", DQ_PIPE="constexpr",
                   num_warps="constexpr")
        const = dict(CAUSAL=causal, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, DQ_CHUNK=ch, DQ=dq, DQ_PIPE=pipe, num_warps=w)
        fn = _g_bwd
        if dq == "pipe":
            fn = _g_dkdv
            for name in ("dqa_desc", "DQA", "DQ_CHUNK", "DQ", "DQ_PIPE"):
                sig.pop(name)
                const.pop(name, None)
        try:
            k = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=w))
            rec = dict(cfg=(bm, bn, ch, w, dq, pipe), smem=k.metadata.shared, **_resources(k.asm["cubin"]))
        except Exception as exc:  # report and go on
            rec = dict(cfg=(bm, bn, ch, w, dq, pipe), error=f"{type(exc).__name__}: {str(exc)[:2000]}")
        print(rec, flush=True)
        out.append(rec)
    return out


class GluonBackward:
    """Launcher over (B, H, N, D) BF16 tensors, contiguous: delta pre-pass (the production kernel), the
    Gluon kernel, and dQ cast from its float32 buffer. Returns dq (None without DQ), dk, dv."""

    def __init__(self, q, k, v, o, do, lse2, causal, scale, cfg):
        import torch
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        self.B, self.H, self.N, self.D = q.shape
        self.bm, self.bn, self.ch, self.w, self.dq_mode, self.pipe = cfg
        BHN = self.B * self.H * self.N
        flat = lambda t: t.reshape(BHN, self.D)
        TD = lambda t, rows: TensorDescriptor.from_tensor(flat(t), [rows, self.D], _layout([rows, self.D]))
        self.dq = torch.empty_like(q)
        self.dk = torch.empty_like(k)
        self.dv = torch.empty_like(v)
        self.dqa = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        self.delta = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        self.descs = [TD(q, self.bm), TD(k, self.bn), TD(v, self.bn), TD(do, self.bm), TD(self.dk, self.bn),
                      TD(self.dv, self.bn),
                      TensorDescriptor.from_tensor(flat(self.dqa), [self.bm, 32], _layout32([self.bm, 32]))]
        self.o, self.do, self.lse2 = o, do, lse2.contiguous()
        self.causal, self.scale = causal, scale

    def delta_pass(self):
        from instability_watch.kernels.attention.triton import _attn_bwd_delta

        o, do = self.o, self.do
        _attn_bwd_delta[(self.N // 64, self.B * self.H)](o, do, self.delta, o.stride(0), o.stride(1), o.stride(2),
                                                         do.stride(0), do.stride(1), do.stride(2), self.H, self.N,
                                                         self.D, HEAD_DIM=self.D, BLOCK_M=64)

    def __call__(self, kernel_only=False):
        if not kernel_only:
            self.delta_pass()
            if self.dq_mode and self.dq_mode != "pipe":
                self.dqa.zero_()
        grid = (self.N // self.bn, self.B * self.H)
        if self.dq_mode == "pipe":
            _g_dkdv[grid](*self.descs[:6], self.lse2, self.delta, self.N, self.scale * LOG2E, self.scale,
                          CAUSAL=self.causal, HEAD_DIM=self.D, BLOCK_M=self.bm, BLOCK_N=self.bn, num_warps=self.w)
            return None, self.dk, self.dv
        _g_bwd[grid](*self.descs, self.lse2, self.delta, self.dqa, self.N, self.scale * LOG2E, self.scale,
                     CAUSAL=self.causal, HEAD_DIM=self.D, BLOCK_M=self.bm, BLOCK_N=self.bn, DQ_CHUNK=self.ch,
                     DQ=self.dq_mode, DQ_PIPE=self.pipe, num_warps=self.w)
        if not kernel_only and self.dq_mode:
            self.dq.copy_(self.dqa)
        return (self.dq if self.dq_mode else None), self.dk, self.dv


def gpu_main(args):
    import torch
    from triton.testing import do_bench

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import d256_lab

    def bench(fn):
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    results = dict(device=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
                   shapes={})
    for shape, sh in d256_lab.SHAPES.items():
        lab = d256_lab.Lab(sh, "cuda")
        rec = dict(shape=sh, variants=[])
        rec["sdpa"] = d256_lab.sdpa_times(sh, bench)
        rec["prod_fwd"], rec["prod_bwd"] = [], []
        gbs = []
        for cfg in VARIANTS:
            v = dict(cfg=cfg)
            try:
                gb = GluonBackward(lab.q, lab.k, lab.v, lab.o_ref, lab.do, lab.lse_ref, sh["causal"], lab.scale, cfg)
                dq, dk, dv = gb()
                torch.cuda.synchronize()

                def rel(a, b):
                    return float((a.float() - b.float()).abs().max() / b.float().abs().max())

                v["err"] = dict(dk=rel(dk, lab.dk_ref), dv=rel(dv, lab.dv_ref))
                if dq is not None:
                    v["err"]["dq"] = rel(dq, lab.dq_ref)
                v["ok"] = all(e < 2e-2 for e in v["err"].values())
                gbs.append((v, gb))
            except Exception as exc:
                v["ok"] = False
                v["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(shape, v, flush=True)
            rec["variants"].append(v)
        dq_lab = dict(kind="dq", cfg=(64, 64, 4, 2), tma=True)
        rec["triton_dq"] = []
        for _ in range(args.rounds):
            rec["triton_dq"].append(bench(lab.runner(dq_lab)))
            rec["prod_fwd"].append(bench(lab.prod_fwd))
            rec["prod_bwd"].append(bench(lab.prod_bwd))
            for v, gb in gbs:
                v.setdefault("ms", []).append(bench(gb))
                v.setdefault("ms_kernel", []).append(bench(lambda: gb(kernel_only=True)))
        results["shapes"][shape] = rec
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gluon_lab.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    print()
    for shape, rec in results["shapes"].items():
        cu = rec["sdpa"].get("cudnn", {})
        fw, bw = min(rec["prod_fwd"]), min(rec["prod_bwd"])
        cu_tot = cu.get("fwd", float("nan")) + cu.get("bwd", float("nan"))
        print(f"== {shape}: cuDNN fwd {cu.get('fwd', float('nan')):.3f} bwd {cu.get('bwd', float('nan')):.3f} | "
              f"ours (Triton) fwd {fw:.3f} bwd {bw:.3f}  fwd+bwd ratio {cu_tot / (fw + bw):.3f}")
        tdq = min(rec["triton_dq"])
        print(f"  Triton dQ alone (lab, TMA, (64, 64, 4, 2)) {tdq:.3f}")
        for v in rec["variants"]:
            if v.get("ms") and v["cfg"][4] in (0, "pipe"):
                g = min(v["ms"]) + tdq
                print(f"  split: gluon dK/dV {v['cfg']} + delta {min(v['ms']):.3f} + Triton dQ = {g:.3f}  "
                      f"fwd+bwd ratio with Triton fwd {cu_tot / (fw + g):.3f}")
            if v.get("ms"):
                g = min(v["ms"])
                print(f"  gluon {v['cfg']} bwd {g:.3f} (kernel {min(v['ms_kernel']):.3f})  err {v['err']}  "
                      f"fwd+bwd ratio with Triton fwd {cu_tot / (fw + g):.3f}")
            else:
                print(f"  gluon {v['cfg']} {v.get('error', v.get('err'))}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90, print registers (no GPU)")
    args = ap.parse_args(argv)
    if args.compile_only:
        recs = compile_only(VARIANTS)
        return 0 if all("error" not in r for r in recs) else 1
    return gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
