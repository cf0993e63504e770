"""The Gluon kernels (Triton's lower-level language, same package) for attention at head dim 256 on Hopper:
the backward's dK/dV, its dQ, and the forward; built on first use (host side: :mod:`.gluon`).

**dK/dV.** At D = 256 the Triton dK/dV kernel cannot hold both float32 accumulators of a 64-key
block next to its operands (it spills), so the backward computes them in two passes, five tile
products where one pass takes four. This kernel places every operand itself: K, V and the
query tiles (Q, dO, double-buffered by TMA) stay in shared memory, P^T and dS^T go through
shared memory into the next product, and the two warpgroups split the head dim of dK and dV
(64 registers a thread each). S^T and dP^T are issued together as asynchronous wgmma and the
softmax waits only for S^T. The numerics are the Triton kernel's: P = exp2(S * qk_scale - LSE2)
in float32, rounded to the input dtype for dV = P^T dO; dS = P (dP - delta), rounded, for
dK = dS^T Q; float32 accumulators (``benchmarks/RESULTS.md``: equal to the Triton passes on the
H100, 1.2 ms against their 1.9 ms at B4 H8 N4096 causal).

**dQ** (128 queries a program, two warpgroups of 64 rows): Q and dO in shared memory, K
double-buffered, V in one buffer refilled as soon as dP = dO V^T is done; dS stays in
registers as wgmma's A operand for dQ += dS K; delta = rowsum(dO * O) in the prologue, written
for the dK/dV kernel (0.7 against the Triton kernel's 1.1 ms).

**Forward** (128 queries a program; calls without a probe, whose statistics stay in the Triton
kernel): Q in shared memory, K and V double-buffered, P in registers; S of the next key block
is issued before P V of this one, so the softmax overlaps the tensor cores (FA3's order inside a
warpgroup); the Triton forward's online softmax and, for stabilized heads, its tie tracking and
shift: O and LSE bit for bit (B4 H8 N4096 causal: 0.51 against 0.62 ms; with every other head
stabilized 0.57 against 0.61).
"""
from __future__ import annotations

BLOCK = 64  # keys per program and queries per step


HEAD_DIM = 256


NUM_WARPS = 8


FWD_BLOCK_M = 128  # queries per program of the forward (two warpgroups of 64 rows)


def _gluon_api():
    """The Gluon names the kernels use, Triton version differences resolved (the builders bind
    them as locals: the kernels read them as closure variables)."""
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
    query_program, store_tile = _shared(gluon, gl, fence_async_shared, tma, tma_store, cta_barrier)
    return (gluon, gl, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait, tma_load, tma_store,
            cta_barrier, query_program, store_tile)


def _shared(gluon, gl, fence_async_shared, tma, tma_store, cta_barrier):
    """The Gluon functions the forward and dQ kernels share: their program's coordinates, and the epilogue that
    stores an output tile from shared memory by TMA."""

    @gluon.jit
    def query_program(H, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
        """``(b * H + h, start_m, b, h, k_row, k_col, v_row, v_col)`` of this program (one head, BLOCK_M
        queries); causal: the longest rows first (blocks start in order of their linear id, heads fastest)."""
        off_bh = gl.program_id(0)
        pid_m = gl.program_id(1)
        if CAUSAL:
            pid_m = gl.num_programs(1) - 1 - pid_m
        b = off_bh // H
        h = off_bh % H
        return off_bh, pid_m * BLOCK_M, b, h, b * k_rb + h * k_rh, h * k_ch, b * v_rb + h * v_rh, h * v_ch

    @gluon.jit
    def store_tile(desc, row, col, smem):
        """Every warp's writes to ``smem`` done and visible to TMA, then ``smem`` to ``desc`` at ``[row, col]``."""
        fence_async_shared()
        cta_barrier()
        tma_store(desc, [row, col], smem)
        tma.store_wait(0)

    return query_program, store_tile


def build_dkdv_kernel():  # noqa: C901 (one kernel)
    """The dK/dV kernel (see the module docstring), built with this Triton's Gluon names."""
    (gluon, gl, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait, tma_load, tma_store, cta_barrier,
     _, _) = _gluon_api()

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
            p_t = gl.exp2(gl.fma(s_t, qk_scale, -lse[None, :]))
            if CAUSAL:
                if i == 0:  # the only query block on the diagonal (the loop starts there)
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


def build_fwd_kernel():  # noqa: C901 (one kernel)
    """The forward kernel (see the module docstring), built with this Triton's Gluon names."""
    (gluon, gl, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait, tma_load, tma_store, cta_barrier,
     query_program, store_tile) = _gluon_api()

    @gluon.jit
    def _stabilized_shift2(m_std, r, beta, max_shift2):
        """The Triton kernel's extra shift (log2 units) above m_std = r * qk_scale (reference.stabilized_shift)."""
        d = gl.where(r > 0, beta - 1.0, -1.0) * m_std  # beta > 1: d >= 0
        return gl.minimum(d, (max_shift2 - 1.0) + (d - gl.floor(d)))

    @gluon.jit
    def _softmax_step(s, r_i, m_i, l_i, c_i, qk_scale, eps_raw, beta, max_shift2, offs_m, cols, MASK,
                      TRACK: gl.constexpr):
        """The Triton forward's online-softmax update of one tile of raw scores ``s`` (float32):
        P = exp2(s * qk_scale - m) in float32, the rescale alpha (exactly 1 while the row maximum r
        holds). ``TRACK`` (a stabilized head): c counts the scores within eps of the running maximum,
        and where it repeats the shift moves up (paper Alg. 3, as the Triton kernel)."""
        if MASK:
            s = gl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
        r_new = gl.maximum(r_i, gl.max(s, 1))
        m_std = gl.where(r_new > float("-inf"), r_new, 0.0) * qk_scale
        m_new = gl.where(r_new == r_i, m_i, m_std)
        if TRACK:
            thr = r_new - eps_raw
            c_i = gl.where(r_i >= thr, c_i, 0) + gl.sum(gl.where(s >= thr[:, None], 1.0, 0.0), 1).to(gl.int32)
            tie = (c_i > 1) & (r_new > float("-inf"))
            d = _stabilized_shift2(m_std, r_new, beta, max_shift2)
            # rounded once (PTX add.rn: no FMA with m_std's product), as the Triton kernel's
            m_new = gl.maximum(m_new, gl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f",
                                                                [m_std, gl.where(tie, d, 0.0)], dtype=gl.float32,
                                                                is_pure=True, pack=1))
            m_new = gl.where(r_i > float("-inf"), gl.maximum(m_i, m_new), m_new)  # the shift never moves down
        alpha = gl.exp2(gl.where(r_i > float("-inf"), m_i - m_new, float("-inf")))
        p = gl.exp2(gl.fma(s, qk_scale, -m_new[:, None]))  # the Triton kernel's FMA
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, r_new, m_new, l_i, c_i

    @gluon.jit
    def _overlap_step(j, acc, p, r_i, m_i, l_i, c_i, q_smem, k_bufs, v_bufs, k_bars, v_bars, k_desc, v_desc,
                      k_row, k_col, v_row, v_col, n_iter, qk_scale, eps_raw, beta, max_shift2, offs_m, offs_n, zero_s,
                      p_op: gl.constexpr, mma_o: gl.constexpr, BLOCK_N: gl.constexpr, TRACK: gl.constexpr):
        """Key block j (below the diagonal) of the overlapped loop: S_j issued, then P_{j-1} V_{j-1};
        the softmax of S_j while the latter runs; then the buffers of K_j and V_{j-1} take K_{j+2}
        and V_{j+1}."""
        dtype: gl.constexpr = k_desc.dtype
        kv_bytes: gl.constexpr = k_desc.block_type.nbytes
        buf = j % 2
        pb = 1 - buf
        mbarrier.wait(k_bars.index(buf), (j // 2) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(buf).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_bars.index(pb), ((j - 1) // 2) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_op), v_bufs.index(pb), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))
        p, alpha, r_i, m_i, l_i, c_i = _softmax_step(s, r_i, m_i, l_i, c_i, qk_scale, eps_raw, beta, max_shift2,
                                                     offs_m, offs_n, False, TRACK)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
        cta_barrier()  # every warp is done with K_j and V_{j-1}
        more_k = j + 2 < n_iter
        mbarrier.expect(k_bars.index(buf), kv_bytes, pred=more_k)
        tma_load(k_desc, [k_row + (j + 2) * BLOCK_N, k_col], k_bars.index(buf), k_bufs.index(buf), pred=more_k)
        more_v = j + 1 < n_iter
        mbarrier.expect(v_bars.index(pb), kv_bytes, pred=more_v)
        tma_load(v_desc, [v_row + (j + 1) * BLOCK_N, v_col], v_bars.index(pb), v_bufs.index(pb), pred=more_v)
        return acc, p, r_i, m_i, l_i, c_i

    @gluon.jit
    def _plain_step(j, acc, r_i, m_i, l_i, c_i, q_smem, k_bufs, v_bufs, k_bars, v_bars, k_desc, v_desc,
                    k_row, k_col, v_row, v_col, n_iter, qk_scale, eps_raw, beta, max_shift2, offs_m, offs_n, zero_s,
                    p_op: gl.constexpr, mma_o: gl.constexpr, MASK: gl.constexpr, BLOCK_N: gl.constexpr,
                    TRACK: gl.constexpr):
        """Key block j, one product after the other; then its buffers take K_{j+2} and V_{j+2}."""
        dtype: gl.constexpr = k_desc.dtype
        kv_bytes: gl.constexpr = k_desc.block_type.nbytes
        buf = j % 2
        phase = (j // 2) & 1
        mbarrier.wait(k_bars.index(buf), phase)
        s = warpgroup_mma(q_smem, k_bufs.index(buf).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        p, alpha, r_i, m_i, l_i, c_i = _softmax_step(s, r_i, m_i, l_i, c_i, qk_scale, eps_raw, beta, max_shift2,
                                                     offs_m, j * BLOCK_N + offs_n, MASK, TRACK)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
        mbarrier.wait(v_bars.index(buf), phase)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_op), v_bufs.index(buf), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        cta_barrier()  # every warp is done with K_j, V_j
        more = j + 2 < n_iter
        mbarrier.expect(k_bars.index(buf), kv_bytes, pred=more)
        tma_load(k_desc, [k_row + (j + 2) * BLOCK_N, k_col], k_bars.index(buf), k_bufs.index(buf), pred=more)
        mbarrier.expect(v_bars.index(buf), kv_bytes, pred=more)
        tma_load(v_desc, [v_row + (j + 2) * BLOCK_N, v_col], v_bars.index(buf), v_bufs.index(buf), pred=more)
        return acc, r_i, m_i, l_i, c_i

    @gluon.jit
    def _fwd_loops(q_smem, k_bufs, v_bufs, k_bars, v_bars, k_desc, v_desc, k_row, k_col, v_row, v_col, n_a, n_iter,
                   qk_scale, eps_raw, beta, max_shift2, offs_m, offs_n, zero_s, p_op: gl.constexpr,
                   mma_o: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, TRACK: gl.constexpr):
        """O (unnormalised), the shift m and l of one query block, from the key blocks [0, n_iter).

        FA3's order inside a warpgroup: S_j = Q K_j^T is issued, then O += P_{j-1} V_{j-1} behind
        it, so the softmax of S_j runs while the tensor cores work on P_{j-1} V_{j-1}. Causal: the
        blocks below the diagonal [0, n_a) (none in the first query block) so, the diagonal's one
        product after the other, in a loop of their own (a mask branch in the overlapped loop cost
        8%; the separate loop also needs fewer registers)."""
        dtype: gl.constexpr = k_desc.dtype
        kv_bytes: gl.constexpr = k_desc.block_type.nbytes
        row_l: gl.constexpr = offs_m.type.layout
        r_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_l)
        m_i = gl.zeros([BLOCK_M], gl.float32, row_l)  # finite while r is -inf: P = exp2(-inf - m) = 0
        l_i = gl.zeros([BLOCK_M], gl.float32, row_l)
        c_i = gl.zeros([BLOCK_M], gl.int32, row_l)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, mma_o)
        if n_a > 0:
            mbarrier.wait(k_bars.index(0), 0)
            s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            p, alpha, r_i, m_i, l_i, c_i = _softmax_step(s, r_i, m_i, l_i, c_i, qk_scale, eps_raw, beta, max_shift2,
                                                         offs_m, offs_n, False, TRACK)
            cta_barrier()  # every warp is done with K_0: its buffer takes K_2
            more = 2 < n_iter
            mbarrier.expect(k_bars.index(0), kv_bytes, pred=more)
            tma_load(k_desc, [k_row + 2 * BLOCK_N, k_col], k_bars.index(0), k_bufs.index(0), pred=more)
            for j in range(1, n_a):
                acc, p, r_i, m_i, l_i, c_i = _overlap_step(
                    j, acc, p, r_i, m_i, l_i, c_i, q_smem, k_bufs, v_bufs, k_bars, v_bars, k_desc, v_desc, k_row,
                    k_col, v_row, v_col, n_iter, qk_scale, eps_raw, beta, max_shift2, offs_m, offs_n, zero_s, p_op,
                    mma_o, BLOCK_N, TRACK)
            # the last P V of the overlapped loop
            last = (n_a - 1) % 2
            mbarrier.wait(v_bars.index(last), ((n_a - 1) // 2) & 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_op), v_bufs.index(last), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            if CAUSAL:
                cta_barrier()  # every warp is done with V_{n_a - 1}: its buffer takes V_{n_a + 1}
                more = n_a + 1 < n_iter
                mbarrier.expect(v_bars.index(last), kv_bytes, pred=more)
                tma_load(v_desc, [v_row + (n_a + 1) * BLOCK_N, v_col], v_bars.index(last), v_bufs.index(last),
                         pred=more)
        if CAUSAL:
            for j in range(n_a, n_iter):
                acc, r_i, m_i, l_i, c_i = _plain_step(
                    j, acc, r_i, m_i, l_i, c_i, q_smem, k_bufs, v_bufs, k_bars, v_bars, k_desc, v_desc, k_row,
                    k_col, v_row, v_col, n_iter, qk_scale, eps_raw, beta, max_shift2, offs_m, offs_n, zero_s, p_op,
                    mma_o, True, BLOCK_N, TRACK)
        return acc, m_i, l_i

    @gluon.jit
    def _gluon_fwd(q_desc, k_desc, v_desc, o_desc, LSE2, Stab,
                   q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, o_rb, o_rh, o_ch, H, N,
                   qk_scale, eps_raw, beta, max_shift2,
                   CAUSAL: gl.constexpr, HAS_STAB: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        off_bh, start_m, b, h, k_row, k_col, v_row, v_col = query_program(H, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch,
                                                                          BLOCK_M, CAUSAL)
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)

        if CAUSAL:
            n_iter = (start_m + BLOCK_M) // BLOCK_N
            n_a = start_m // BLOCK_N  # key blocks below the diagonal: no mask
        else:
            n_iter = N // BLOCK_N
            n_a = n_iter
        kv_bytes: gl.constexpr = k_desc.block_type.nbytes
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma_load(q_desc, [b * q_rb + h * q_rh + start_m, h * q_ch], q_bar, q_smem)
        for i in gl.static_range(2):
            more = i < n_iter
            mbarrier.expect(k_bars.index(i), kv_bytes, pred=more)
            tma_load(k_desc, [k_row + i * BLOCK_N, k_col], k_bars.index(i), k_bufs.index(i), pred=more)
            mbarrier.expect(v_bars.index(i), kv_bytes, pred=more)
            tma_load(v_desc, [v_row + i * BLOCK_N, v_col], v_bars.index(i), v_bufs.index(i), pred=more)

        offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_s))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_s)
        mbarrier.wait(q_bar, 0)
        stabilized = False
        if HAS_STAB:
            stabilized = gl.load(Stab + h) != 0
        if stabilized:  # uniform per program: other heads' programs skip all of the tie work
            acc, m_i, l_i = _fwd_loops(q_smem, k_bufs, v_bufs, k_bars, v_bars, k_desc, v_desc, k_row, k_col, v_row,
                                       v_col, n_a, n_iter, qk_scale, eps_raw, beta, max_shift2, offs_m, offs_n, zero_s,
                                       p_op, mma_o, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, True)
        else:
            acc, m_i, l_i = _fwd_loops(q_smem, k_bufs, v_bufs, k_bars, v_bars, k_desc, v_desc, k_row, k_col, v_row,
                                       v_col, n_a, n_iter, qk_scale, eps_raw, beta, max_shift2, offs_m, offs_n, zero_s,
                                       p_op, mma_o, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, False)

        cta_barrier()  # every warp is past its last wait on the barriers
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(2):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))
        # epilogue: O rounded once (through Q's buffer, by TMA), LSE in log2 units
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, mma_o))
        q_smem.store((acc / l_o[:, None]).to(dtype))
        lse2 = m_i + gl.log2(l_i)
        gl.store(LSE2 + off_bh * N + offs_m, lse2)
        store_tile(o_desc, b * o_rb + h * o_rh + start_m, h * o_ch, q_smem)

    return _gluon_fwd


def build_dq_kernel():  # noqa: C901 (one kernel)
    """The dQ kernel (see the module docstring), built with this Triton's Gluon names."""
    (gluon, gl, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait, tma_load, tma_store, cta_barrier,
     query_program, store_tile) = _gluon_api()

    @gluon.jit
    def _dq_step(j, dq, q_smem, do_smem, k_bufs, v_smem, k_bars, v_bar, k_desc, v_desc, k_row, k_col, v_row, v_col,
                 n_iter, qk_scale, lse, delta, offs_m, offs_n, zero_s,
                 ds_op: gl.constexpr, MASK, BLOCK_N: gl.constexpr):
        """Key block j: dP = dO V_j^T and S = Q K_j^T in flight together, P = exp2(S * qk_scale - LSE),
        dS = P (dP - delta), dQ += dS K_j (dS from registers). V's one buffer takes V_{j+1} as soon as
        dP is done (before the softmax), K_j's buffer takes K_{j+2} once dQ's product is."""
        dtype: gl.constexpr = k_desc.dtype
        kv_bytes: gl.constexpr = k_desc.block_type.nbytes
        buf = j % 2
        mbarrier.wait(v_bar, j & 1)
        dp = warpgroup_mma(do_smem, v_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(k_bars.index(buf), (j // 2) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(buf).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma_wait(1, deps=(dp, ))
        cta_barrier()  # every warp is done with V_j
        more = j + 1 < n_iter
        mbarrier.expect(v_bar, kv_bytes, pred=more)
        tma_load(v_desc, [v_row + (j + 1) * BLOCK_N, v_col], v_bar, v_smem, pred=more)
        s = warpgroup_mma_wait(0, deps=(s, ))
        p = gl.exp2(gl.fma(s, qk_scale, -lse[:, None]))  # the Triton kernel's FMA
        if MASK:
            p = gl.where(offs_m[:, None] >= (j * BLOCK_N + offs_n)[None, :], p, 0.0)
        ds = p * (dp - delta[:, None])
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), ds_op), k_bufs.index(buf), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        cta_barrier()  # every warp is done with K_j
        more = j + 2 < n_iter
        mbarrier.expect(k_bars.index(buf), kv_bytes, pred=more)
        tma_load(k_desc, [k_row + (j + 2) * BLOCK_N, k_col], k_bars.index(buf), k_bufs.index(buf), pred=more)
        return dq

    @gluon.jit
    def _gluon_dq(q_desc, k_desc, v_desc, do_desc, dq_desc, O, DO, LSE2, Delta,
                  q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, do_rb, do_rh, do_ch, dq_rb, dq_rh, dq_ch,
                  o_sb, o_sh, o_sn, do_sb, do_sh, do_sn, H, N, qk_scale, scale,
                  CAUSAL: gl.constexpr, DELTA_FROM_O: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
        mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
        ds_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_q, k_width=2)
        dtype: gl.constexpr = q_desc.dtype
        off_bh, start_m, b, h, k_row, k_col, v_row, v_col = query_program(H, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch,
                                                                          BLOCK_M, CAUSAL)

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], do_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
        qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(qdo_bar, count=1)
        mbarrier.init(k_bars.index(0), count=1)
        mbarrier.init(k_bars.index(1), count=1)
        mbarrier.init(v_bar, count=1)

        if CAUSAL:
            hi = start_m + BLOCK_M
            n_a = start_m // BLOCK_N  # key blocks below the diagonal: no mask
        else:
            hi = N
            n_a = N // BLOCK_N
        n_iter = hi // BLOCK_N
        kv_bytes: gl.constexpr = k_desc.block_type.nbytes
        mbarrier.expect(qdo_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [b * q_rb + h * q_rh + start_m, h * q_ch], qdo_bar, q_smem)
        tma_load(do_desc, [b * do_rb + h * do_rh + start_m, h * do_ch], qdo_bar, do_smem)
        for i in gl.static_range(2):
            more = i < n_iter
            mbarrier.expect(k_bars.index(i), kv_bytes, pred=more)
            tma_load(k_desc, [k_row + i * BLOCK_N, k_col], k_bars.index(i), k_bufs.index(i), pred=more)
        mbarrier.expect(v_bar, kv_bytes)
        tma_load(v_desc, [v_row, v_col], v_bar, v_smem)

        offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_s))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
        stat = off_bh * N + offs_m
        if DELTA_FROM_O:
            # delta = rowsum(dO * O) in float32, 64 columns at a time; the dK/dV kernel reads it from Delta
            CH: gl.constexpr = 64
            blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
            cols = gl.arange(0, CH, layout=gl.SliceLayout(0, blk))
            o_ptr = O + b * o_sb + h * o_sh + rows[:, None] * o_sn + cols[None, :]
            do_ptr = DO + b * do_sb + h * do_sh + rows[:, None] * do_sn + cols[None, :]
            acc_d = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, blk))
            for c in gl.static_range(HEAD_DIM // CH):
                o_c = gl.load(o_ptr + c * CH).to(gl.float32)
                do_c = gl.load(do_ptr + c * CH).to(gl.float32)
                acc_d += gl.sum(o_c * do_c, 1)
            gl.store(Delta + off_bh * N + rows, acc_d)
            delta = gl.convert_layout(acc_d, gl.SliceLayout(1, mma_s))
        else:
            delta = gl.load(Delta + stat)
        lse = gl.load(LSE2 + stat)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, mma_q)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_s)
        mbarrier.wait(qdo_bar, 0)
        # one loop (causal: a branch masks the blocks on the diagonal; two loops spill)
        for j in range(0, n_iter):
            dq = _dq_step(j, dq, q_smem, do_smem, k_bufs, v_smem, k_bars, v_bar, k_desc, v_desc, k_row, k_col,
                          v_row, v_col, n_iter, qk_scale, lse, delta, offs_m, offs_n, zero_s, ds_op,
                          CAUSAL and j >= n_a, BLOCK_N)

        mbarrier.invalidate(qdo_bar)
        mbarrier.invalidate(k_bars.index(0))
        mbarrier.invalidate(k_bars.index(1))
        mbarrier.invalidate(v_bar)
        q_smem.store((dq * scale).to(dtype))  # through Q's buffer, by TMA
        store_tile(dq_desc, b * dq_rb + h * dq_rh + start_m, h * dq_ch, q_smem)

    return _gluon_dq
