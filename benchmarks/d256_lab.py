"""D = 256 lab: where our attention kernels lose to cuDNN at head dim 256, and what would close it.

    PYTHONPATH=$PWD python benchmarks/d256_lab.py --out DIR            # GPU: compile in workers, check, time
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/d256_lab.py --quick   # CPU: the lab kernels' numerics

Stripped copies of our kernels (no masks, dropout, GQA, probe or stabilizer: the plain path the
D = 256 bar is measured on), with switches that the production kernels do not have:

* ``TMA``: Q, K, V, dO tiles through host-side tensor descriptors (Hopper's bulk tensor copies)
  instead of pointer tiles;
* ``REVERSE``: causal query tiles longest first;
* ``STORE_DS``: the dK/dV kernel also writes dS (bf16, (B, H, N, N)), and dQ becomes one product
  per tile (``dq_ds``) instead of recomputing S and dP (``dq``): five products per tile instead of
  seven, for N^2 bf16 of memory.

Each variant is checked against the production kernels on the same inputs, then timed with
``triton.testing.do_bench`` next to the production kernels and SDPA (cuDNN, flash). Not used by
the package; kept as the record of what was tried (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: the TMA variants are skipped
    TensorDescriptor = None

LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------
# forward


@triton.jit
def _online_softmax(qk, acc, l_i, r_i, m_i, qk_scale):
    """One KV block of the plain forward's softmax (the production rule: the shift moves only with
    the raw maximum r): ``(p, acc rescaled, l, r, m)``; the caller adds P V to acc."""
    r_new = tl.maximum(r_i, tl.max(qk, 1))
    m_std = tl.where(r_new > float("-inf"), r_new, 0.0) * qk_scale
    m_new = tl.where(r_new == r_i, m_i, m_std)
    alpha = tl.math.exp2(tl.where(r_i > float("-inf"), m_i - m_new, float("-inf")))
    p = tl.math.exp2(tl.fma(qk, qk_scale, -m_new[:, None]))
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, acc * alpha[:, None], l_i, r_new, m_new


@triton.jit
def _fwd_range(start_m, N, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(n_full, hi)``: keys [0, n_full) need no causal mask, [n_full, hi) do."""
    if CAUSAL:
        hi = (start_m + 1) * BLOCK_M
        n_full = start_m * BLOCK_M // BLOCK_N * BLOCK_N
    else:
        hi = N
        n_full = N
    return n_full, hi


@triton.jit
def _fwd_loop(acc, l_i, r_i, m_i, q, K, V, desc_k, desc_v, row0, offs_m, offs_n, offs_d, qk_scale, lo, hi,
              MASK: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if TMA:
            k = desc_k.load([row0 + start_n, 0])
        else:
            k = tl.load(K + (row0 + start_n + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k))
        if MASK:
            qk = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], qk, float("-inf"))
        p, acc, l_i, r_i, m_i = _online_softmax(qk, acc, l_i, r_i, m_i, qk_scale)
        if TMA:  # V loaded after the softmax (the production order)
            v = desc_v.load([row0 + start_n, 0])
        else:
            v = tl.load(V + (row0 + start_n + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, r_i, m_i


@triton.jit
def _lab_fwd(Q, K, V, O, LSE2, desc_q, desc_k, desc_v, desc_o, N, qk_scale,
             CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             TMA: tl.constexpr, REVERSE: tl.constexpr):
    if REVERSE:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    row0 = off_bh * N
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if TMA:
        q = desc_q.load([row0 + start_m * BLOCK_M, 0])
    else:
        q = tl.load(Q + (row0 + offs_m)[:, None] * HEAD_DIM + offs_d[None, :])
    r_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full, hi = _fwd_range(start_m, N, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, r_i, m_i = _fwd_loop(acc, l_i, r_i, m_i, q, K, V, desc_k, desc_v, row0, offs_m, offs_n, offs_d,
                                   qk_scale, 0, n_full, False, TMA, BLOCK_N, HEAD_DIM)
    if CAUSAL:
        acc, l_i, r_i, m_i = _fwd_loop(acc, l_i, r_i, m_i, q, K, V, desc_k, desc_v, row0, offs_m, offs_n, offs_d,
                                       qk_scale, n_full, hi, True, TMA, BLOCK_N, HEAD_DIM)
    o = (acc / l_i[:, None]).to(O.dtype.element_ty)
    if TMA:
        desc_o.store([row0 + start_m * BLOCK_M, 0], o)
    else:
        tl.store(O + (row0 + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], o)
    tl.store(LSE2 + row0 + offs_m, m_i + tl.math.log2(l_i))


@triton.jit
def _fwd_loop_dev(acc, l_i, r_i, m_i, q, desc_k, desc_v, row0, offs_m, offs_n, qk_scale, lo, hi,
                  MASK: tl.constexpr, WS: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([row0 + start_n, 0])
        v = desc_v.load([row0 + start_n, 0])
        qk = tl.dot(q, tl.trans(k))
        if MASK:
            qk = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], qk, float("-inf"))
        p, acc, l_i, r_i, m_i = _online_softmax(qk, acc, l_i, r_i, m_i, qk_scale)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, r_i, m_i


@triton.jit
def _lab_fwd_dev(Q, K, V, O, LSE2, N, BH, qk_scale,
                 CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WS: tl.constexpr):
    """The forward through descriptors made on the device, optionally warp-specialized (Triton's
    Hopper warp specialization takes device-side descriptors)."""
    desc_q = tl.make_tensor_descriptor(Q, shape=[BH * N, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    desc_k = tl.make_tensor_descriptor(K, shape=[BH * N, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(V, shape=[BH * N, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    desc_o = tl.make_tensor_descriptor(O, shape=[BH * N, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    row0 = off_bh * N
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([row0 + start_m * BLOCK_M, 0])
    r_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full, hi = _fwd_range(start_m, N, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, r_i, m_i = _fwd_loop_dev(acc, l_i, r_i, m_i, q, desc_k, desc_v, row0, offs_m, offs_n, qk_scale,
                                       0, n_full, False, WS, BLOCK_N)
    if CAUSAL:
        acc, l_i, r_i, m_i = _fwd_loop_dev(acc, l_i, r_i, m_i, q, desc_k, desc_v, row0, offs_m, offs_n, qk_scale,
                                           n_full, hi, True, WS, BLOCK_N)
    desc_o.store([row0 + start_m * BLOCK_M, 0], (acc / l_i[:, None]).to(O.dtype.element_ty))
    tl.store(LSE2 + row0 + offs_m, m_i + tl.math.log2(l_i))


# ---------------------------------------------------------------------------
# backward


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q, DO, LSE2, Delta, DS, desc_q, desc_do, row0, ds_base, N, offs_n, offs_m0, offs_d,
               qk_scale, lo, hi, MASK: tl.constexpr, TMA: tl.constexpr, STORE_DS: tl.constexpr,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PART: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        if TMA:
            q = desc_q.load([row0 + start_m, 0])
        else:
            q = tl.load(Q + (row0 + offs_m)[:, None] * HEAD_DIM + offs_d[None, :])
        lse2 = tl.load(LSE2 + row0 + offs_m)
        s_t = tl.dot(k, tl.trans(q))
        p_t = tl.math.exp2(tl.fma(s_t, qk_scale, -lse2[None, :]))
        if MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        if TMA:
            do = desc_do.load([row0 + start_m, 0])
        else:
            do = tl.load(DO + (row0 + offs_m)[:, None] * HEAD_DIM + offs_d[None, :])
        if PART != 1:
            dv = tl.dot(p_t.to(do.dtype), do, dv)
        if PART != 2:
            delta = tl.load(Delta + row0 + offs_m)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
            dk = tl.dot(ds_t, q, dk)
            if STORE_DS:
                tl.store(DS + ds_base + offs_n[:, None] * N + offs_m[None, :], ds_t)
    return dk, dv


@triton.jit
def _lab_dkdv(Q, K, V, DO, LSE2, Delta, DK, DV, DS, desc_q, desc_k, desc_v, desc_do, N, qk_scale, scale,
              CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              TMA: tl.constexpr, STORE_DS: tl.constexpr, PART: tl.constexpr):
    """dK and dV of one KV block (PART 0), or only dK (1), or only dV (2)."""
    start_n = tl.program_id(0) * BLOCK_N
    off_bh = tl.program_id(1)
    row0 = off_bh * N
    ds_base = off_bh.to(tl.int64) * N * N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if TMA:
        k = desc_k.load([row0 + start_n, 0])
        v = desc_v.load([row0 + start_n, 0])
    else:
        k = tl.load(K + (row0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
        v = tl.load(V + (row0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
        mid = tl.minimum((start_n + BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M, N)
        dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, LSE2, Delta, DS, desc_q, desc_do, row0, ds_base, N, offs_n, offs_m0,
                            offs_d, qk_scale, lo, mid, True, TMA, STORE_DS, BLOCK_M, HEAD_DIM, PART)
    else:
        mid = 0
    dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, LSE2, Delta, DS, desc_q, desc_do, row0, ds_base, N, offs_n, offs_m0,
                        offs_d, qk_scale, mid, N, False, TMA, STORE_DS, BLOCK_M, HEAD_DIM, PART)
    if PART != 2:
        tl.store(DK + (row0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty))
    if PART != 1:
        tl.store(DV + (row0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def _lab_dq_ds(K, DS, DQ, desc_k, N, scale,
               CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               TMA: tl.constexpr):
    """dQ = scale * dS K from the stored dS (one product per tile)."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    row0 = off_bh * N
    ds_base = off_bh.to(tl.int64) * N * N
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        n_full = start_m // BLOCK_N * BLOCK_N
        hi = start_m + BLOCK_M
    else:
        n_full = N
        hi = N
    for start_n in range(0, n_full, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        ds_t = tl.load(DS + ds_base + offs_n[:, None] * N + offs_m[None, :])
        if TMA:
            k = desc_k.load([row0 + start_n, 0])
        else:
            k = tl.load(K + (row0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
        dq = tl.dot(tl.trans(ds_t), k, dq)
    for start_n in range(n_full, hi, BLOCK_N):  # the diagonal: only entries the dK/dV kernel wrote
        offs_n = start_n + offs_n0
        ds_t = tl.load(DS + ds_base + offs_n[:, None] * N + offs_m[None, :], mask=offs_m[None, :] >= offs_n[:, None],
                       other=0.0)
        if TMA:
            k = desc_k.load([row0 + start_n, 0])
        else:
            k = tl.load(K + (row0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
        dq = tl.dot(tl.trans(ds_t), k, dq)
    tl.store(DQ + (row0 + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty))


@triton.jit
def _lab_dq(Q, K, V, DO, LSE2, Delta, DQ, desc_k, desc_v, N, qk_scale, scale,
            CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            TMA: tl.constexpr):
    """The two-kernel backward's dQ: S and dP recomputed per tile (three products)."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    row0 = off_bh * N
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (row0 + offs_m)[:, None] * HEAD_DIM + offs_d[None, :])
    do = tl.load(DO + (row0 + offs_m)[:, None] * HEAD_DIM + offs_d[None, :])
    lse2 = tl.load(LSE2 + row0 + offs_m)
    delta = tl.load(Delta + row0 + offs_m)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = start_m + BLOCK_M if CAUSAL else N
    for start_n in range(0, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        if TMA:
            k = desc_k.load([row0 + start_n, 0])
            v = desc_v.load([row0 + start_n, 0])
        else:
            k = tl.load(K + (row0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
            v = tl.load(V + (row0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(tl.fma(s, qk_scale, -lse2[:, None]))
        if CAUSAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    tl.store(DQ + (row0 + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty))


# ---------------------------------------------------------------------------
# variants


SHAPES = {"causal": dict(B=4, H=8, N=4096, D=256, causal=True), "full": dict(B=4, H=8, N=2048, D=256, causal=False)}
QUICK = {"causal": dict(B=1, H=2, N=128, D=256, causal=True), "full": dict(B=1, H=2, N=64, D=256, causal=False)}

# Round 1 (2026-11-24, H100): pointer and TMA tiles over these grids, dS stored or not
# (benchmarks/results/kernels_2026-11-24/d256_lab/round1.json). Round 2: the survivors, device-side
# descriptors with warp specialization, dK and dV in separate passes, the production forward's tiles.
ROUNDS = {
    1: dict(
        fwd=[(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2),
             (128, 64, 8, 3), (128, 128, 8, 2)],
        fwd_tma=(False, True), fwd_reverse=[(64, 32, 4, 2), (128, 64, 8, 2)], fwd_dev=[], prod_fwd=[],
        dkdv=[(64, 64, 8, 2), (32, 64, 4, 2), (64, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2), (128, 64, 8, 2)],
        dkdv_tma=(False, True), dkdv_store=(False, True), dkdv_parts=(0,),
        dq_ds=[(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2), (128, 32, 8, 3)],
        dq=[(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2)], dq_tma=(False, True),
    ),
    2: dict(
        fwd=[(128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 4), (64, 64, 4, 3), (128, 128, 8, 1)],
        fwd_tma=(True,), fwd_reverse=[], prod_fwd=[(64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3)],
        fwd_dev=[(128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 3)],
        dkdv=[(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 128, 8, 2), (32, 128, 8, 2), (64, 128, 4, 2),
              (128, 128, 8, 2)],
        dkdv_tma=(True,), dkdv_store=(False,), dkdv_parts=(0, 1, 2),
        dq_ds=[], dq=[(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 128, 4, 2)], dq_tma=(True,),
    ),
    3: dict(  # the production kernels: forward tiles (plain, stabilized, probed), the split dK/dV passes
        fwd=[], fwd_tma=(), fwd_reverse=[], fwd_dev=[], prod_fwd=[(64, 32, 4, 2), (128, 64, 8, 2)],
        prod_fwd_watched=[(64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3)],
        prod_bwd=[None, ((32, 128, 8, 2), (64, 128, 8, 2)), ((64, 64, 8, 2), (64, 128, 8, 2)),
                  ((64, 64, 4, 2), (64, 128, 8, 2)), ((32, 128, 8, 2), (64, 64, 4, 2)),
                  ((32, 64, 4, 2), (64, 128, 8, 2)), ((32, 128, 8, 3), (32, 128, 8, 2))],
        dkdv=[], dkdv_tma=(), dkdv_store=(), dkdv_parts=(), dq_ds=[], dq=[], dq_tma=(),
    ),
    4: dict(  # 16 warps (512 threads): the float32 accumulators over twice the threads, so one-pass dK/dV
        # at 64 keys holds dK and dV in 64 registers a thread; the 8-warp tables' tiles beside them
        fwd=[(128, 64, 16, 2), (128, 128, 16, 1), (128, 32, 16, 3), (128, 64, 8, 2)],
        fwd_tma=(True,), fwd_reverse=[], fwd_dev=[], prod_fwd=[(128, 64, 8, 2), (128, 64, 16, 2)],
        dkdv=[(64, 64, 16, 2), (64, 64, 16, 1), (32, 64, 16, 2), (32, 128, 16, 2), (64, 128, 16, 1),
              (32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 8, 2)],
        dkdv_tma=(True,), dkdv_store=(False,), dkdv_parts=(0, 1, 2),
        dq_ds=[], dq=[(128, 32, 16, 2), (128, 64, 16, 1), (128, 32, 16, 3), (64, 64, 8, 2), (64, 64, 4, 2)],
        dq_tma=(True,),
        prod_bwd=[((32, 128, 8, 2), (64, 128, 8, 2)), ((32, 128, 16, 2), (64, 128, 16, 2)),
                  ((32, 128, 16, 2), (64, 128, 8, 2)), ((64, 64, 16, 2), (64, 128, 8, 2))],
    ),
}


def variants(quick=False, rnd=2):
    """Every lab variant of a round: dicts with kind, shape, cfg and switches (the name is their string)."""
    R = ROUNDS[rnd]
    out = []
    has_tma = TensorDescriptor is not None
    one = [(16, 16, 4, 1)]
    for shape in SHAPES:
        for cfg in one if quick else R["fwd"]:
            for tma in R["fwd_tma"] if has_tma else (False,):
                out.append(dict(kind="fwd", shape=shape, cfg=cfg, tma=tma, reverse=False))
                if shape == "causal" and (quick or cfg in R["fwd_reverse"]):
                    out.append(dict(kind="fwd", shape=shape, cfg=cfg, tma=tma, reverse=True))
        for cfg in (one if quick else R["fwd_dev"]) if has_tma else []:
            for ws in (False, True):
                out.append(dict(kind="fwd_dev", shape=shape, cfg=cfg, tma=True, ws=ws))
        for cfg in one if quick else R["prod_fwd"]:
            out.append(dict(kind="prod_fwd", shape=shape, cfg=cfg, tma=False))
        for cfg in one if quick else R.get("prod_fwd_watched", []):
            for mode in ("stabilized", "probe"):
                out.append(dict(kind="prod_fwd_watched", shape=shape, cfg=cfg, tma=False, mode=mode))
        for cfg in [None, (one[0], one[0])] if quick else R.get("prod_bwd", []):
            out.append(dict(kind="prod_bwd", shape=shape, cfg=cfg, tma=False))
        for cfg in one if quick else R["dkdv"]:
            for tma in R["dkdv_tma"] if has_tma else (False,):
                for store in (False, True) if quick else R["dkdv_store"]:
                    for part in (0, 1, 2) if quick else R["dkdv_parts"]:
                        if store and part == 2:
                            continue
                        out.append(dict(kind="dkdv", shape=shape, cfg=cfg, tma=tma, store_ds=store, part=part))
        for cfg in one if quick else R["dq_ds"]:
            for tma in (False, True) if has_tma else (False,):
                out.append(dict(kind="dq_ds", shape=shape, cfg=cfg, tma=tma))
        for cfg in one if quick else R["dq"]:
            for tma in (False, True) if quick else R["dq_tma"]:
                out.append(dict(kind="dq", shape=shape, cfg=cfg, tma=tma))
    for v in out:
        v["name"] = " ".join(f"{k}={v[k]}" for k in v)
    return out


def make_inputs(sh, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    B, H, N, D = sh["B"], sh["H"], sh["N"], sh["D"]
    dt = torch.bfloat16
    q, k, v, do = (torch.randn(B, H, N, D, device=device, generator=g, dtype=torch.float32).to(dt) for _ in range(4))
    return q, k, v, do


class Lab:
    """Inputs and outputs of one shape, and a launcher per variant."""

    def __init__(self, sh, device):
        from instability_watch.kernels.attention.triton import attention_backward_lse2, attention_forward_lse2

        self.sh = sh
        self.q, self.k, self.v, self.do = make_inputs(sh, device)
        B, H, N, D = self.q.shape
        self.scale = 1.0 / math.sqrt(D)
        kw = dict(causal=sh["causal"], scale=self.scale)
        self.prod_fwd = lambda: attention_forward_lse2(self.q, self.k, self.v, stabilize=None, beta=1.0, eps=0.0,
                                                       counts=None, values=None, **kw)
        self.o_ref, self.lse_ref = self.prod_fwd()
        self.prod_bwd = lambda: attention_backward_lse2(self.q, self.k, self.v, self.o_ref, self.lse_ref, self.do,
                                                        counts=None, values=None, shadow=False, **kw)
        self.dq_ref, self.dk_ref, self.dv_ref, _ = self.prod_bwd()
        self.delta = (self.o_ref.float() * self.do.float()).sum(-1).contiguous()
        self.o = torch.empty_like(self.q)
        self.lse = torch.empty_like(self.lse_ref)
        self.dq, self.dk, self.dv = torch.empty_like(self.q), torch.empty_like(self.k), torch.empty_like(self.v)
        self.ds = torch.empty((B, H, N, N), device=device, dtype=torch.bfloat16)
        self.flat = {n: t.view(B * H * N, D) for n, t in
                     dict(q=self.q, k=self.k, v=self.v, do=self.do, o=self.o).items()}

    def descs(self, names, rows):
        if TensorDescriptor is None:
            return [None] * len(names)
        return [TensorDescriptor.from_tensor(self.flat[n], [r, self.sh["D"]]) for n, r in zip(names, rows)]

    def runner(self, v):
        if v["kind"] in ("prod_bwd", "prod_fwd_watched"):
            return self.prod_runner(v)
        bm, bn, w, s = v["cfg"]
        B, H, N, D = self.q.shape
        causal = self.sh["causal"]
        opts = dict(num_warps=w, num_stages=s)
        qk_scale = self.scale * LOG2E
        tma = v["tma"]
        if v["kind"] == "fwd":
            dq_, dk_, dv_, do_ = self.descs(["q", "k", "v", "o"], [bm, bn, bn, bm]) if tma else [None] * 4
            grid = (N // bm, B * H)

            def run():
                return _lab_fwd[grid](self.q, self.k, self.v, self.o, self.lse, dq_, dk_, dv_, do_, N, qk_scale,
                               CAUSAL=causal, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, TMA=tma, REVERSE=v["reverse"],
                               **opts)
        elif v["kind"] == "fwd_dev":
            grid = (N // bm, B * H)

            def run():
                return _lab_fwd_dev[grid](self.q, self.k, self.v, self.o, self.lse, N, B * H, qk_scale,
                                          CAUSAL=causal, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, WS=v["ws"], **opts)
        elif v["kind"] == "prod_fwd":
            from instability_watch.kernels.attention.triton import attention_forward_lse2

            def run():
                self.o_prod, self.lse_prod = attention_forward_lse2(self.q, self.k, self.v, causal=causal, scale=self.scale,
                                                          stabilize=None, beta=1.0, eps=0.0, counts=None,
                                                          values=None, config=v["cfg"])
        elif v["kind"] == "dkdv":
            dq_, dk_, dv_, ddo = self.descs(["q", "k", "v", "do"], [bm, bn, bn, bm]) if tma else [None] * 4
            grid = (N // bn, B * H)

            def run():
                return _lab_dkdv[grid](self.q, self.k, self.v, self.do, self.lse_ref, self.delta, self.dk, self.dv, self.ds,
                                dq_, dk_, dv_, ddo, N, qk_scale, self.scale,
                                CAUSAL=causal, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, TMA=tma,
                                STORE_DS=v["store_ds"], PART=v["part"], **opts)
        elif v["kind"] == "dq_ds":
            (dk_,) = self.descs(["k"], [bn]) if tma else [None]
            grid = (N // bm, B * H)

            def run():
                return _lab_dq_ds[grid](self.k, self.ds, self.dq, dk_, N, self.scale,
                                 CAUSAL=causal, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, TMA=tma, **opts)
        else:
            dk_, dv_ = self.descs(["k", "v"], [bn, bn]) if tma else [None, None]
            grid = (N // bm, B * H)

            def run():
                return _lab_dq[grid](self.q, self.k, self.v, self.do, self.lse_ref, self.delta, self.dq, dk_, dv_, N,
                              qk_scale, self.scale, CAUSAL=causal, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, TMA=tma, **opts)
        return run

    def prod_runner(self, v):
        from instability_watch import Probe
        from instability_watch.kernels.attention.triton import attention_backward_lse2, attention_forward_lse2

        kw = dict(causal=self.sh["causal"], scale=self.scale)
        if v["kind"] == "prod_bwd":
            split = v["cfg"] is not None
            dk_cfg, dv_cfg = v["cfg"] if split else (None, None)

            def run():
                self.grads = attention_backward_lse2(self.q, self.k, self.v, self.o_ref, self.lse_ref, self.do,
                                                     counts=None, values=None, shadow=False, split=split,
                                                     config_dk=dk_cfg, config_dv=dv_cfg, **kw)
            return run
        H = self.q.shape[1]
        stab = torch.ones(H, dtype=torch.bool, device=self.q.device)
        probe = Probe(H, self.q.device) if v["mode"] == "probe" else None
        if probe is not None:
            stab = torch.zeros_like(stab)

        def run():
            self.o_prod, self.lse_prod = attention_forward_lse2(
                self.q, self.k, self.v, stabilize=stab, beta=2.0, eps=1e-3, counts=probe and probe.counts,
                values=probe and probe.values, config=v["cfg"], **kw)
        return run

    def check(self, v):
        """Relative max error of the variant's outputs against the production kernels' (same inputs)."""
        def rel(a, b):
            return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

        out = self._check(v, rel)
        if self.compiled is not None:
            out["regs"] = getattr(self.compiled, "n_regs", None)
            out["spills"] = getattr(self.compiled, "n_spills", None)
        return out

    def _launch(self, v):
        self.compiled = self.runner(v)()

    def _check(self, v, rel):
        self.compiled = None
        kind = v["kind"]
        if kind == "prod_bwd":
            self._launch(v)
            return dict(dq=rel(self.grads[0], self.dq_ref), dk=rel(self.grads[1], self.dk_ref),
                        dv=rel(self.grads[2], self.dv_ref))
        if kind in ("prod_fwd", "prod_fwd_watched"):
            self._launch(v)
            return dict(o=rel(self.o_prod, self.o_ref), lse=rel(self.lse_prod, self.lse_ref))
        if kind in ("fwd", "fwd_dev"):
            self.o.fill_(float("nan"))
            self._launch(v)
            return dict(o=rel(self.o, self.o_ref), lse=rel(self.lse, self.lse_ref))
        if kind == "dkdv":
            self.dk.fill_(float("nan"))
            self.dv.fill_(float("nan"))
            self._launch(v)
            out = {}
            if v["part"] != 2:
                out["dk"] = rel(self.dk, self.dk_ref)
            if v["part"] != 1:
                out["dv"] = rel(self.dv, self.dv_ref)
            if v["store_ds"]:  # leave a dS in place for the dq_ds variants
                self.have_ds = True
            return out
        if kind == "dq_ds":
            if not getattr(self, "have_ds", False):
                return dict(dq=float("nan"), note="no dS stored")
            self.dq.fill_(float("nan"))
            self._launch(v)
            return dict(dq=rel(self.dq, self.dq_ref))
        self.dq.fill_(float("nan"))
        self._launch(v)
        return dict(dq=rel(self.dq, self.dq_ref))


def sdpa_times(sh, bench):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, do = make_inputs(sh, "cuda")
    out = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=sh["causal"]))
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=sh["causal"])
                bwd = bench(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
            out[name] = dict(fwd=fwd, bwd=bwd)
        except RuntimeError as exc:
            out[name] = dict(error=str(exc)[:200])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for lab.json")
    ap.add_argument("--quick", action="store_true", help="small shapes, one config (the interpreter)")
    ap.add_argument("--workers", type=int, default=8, help="processes that compile the variants first (GPU)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "i/n": compile every n-th variant
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", type=int, default=2, choices=sorted(ROUNDS), help="which variant set (ROUNDS)")
    ap.add_argument("--only", default="", help="comma-separated kinds to run (fwd,dkdv,dq_ds,dq)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = QUICK if args.quick else SHAPES
    vs = variants(args.quick, args.set)
    if TensorDescriptor is not None and torch.cuda.is_available():  # device-side descriptors' scratch
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    if args.only:
        kinds = args.only.split(",")
        vs = [v for v in vs if v["kind"] in kinds]

    if args.worker:  # compile (and run once) every n-th variant: fills Triton's cache on disk
        i, n = map(int, args.worker.split("/"))
        labs = {}
        for j, v in enumerate(vs):
            if j % n != i:
                continue
            lab = labs.setdefault(v["shape"], Lab(shapes[v["shape"]], device))
            try:
                lab.runner(v)()
            except Exception as exc:  # reported by the main process, which runs it again
                print(f"worker {i}: {v['name']}: {type(exc).__name__}", file=sys.stderr)
        torch.cuda.synchronize()
        return 0

    t0 = time.time()
    if device == "cuda" and args.workers > 1:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", f"{i}/{args.workers}", "--set", str(args.set)]
                                  + (["--only", args.only] if args.only else []))
                 for i in range(args.workers)]
        for p in procs:
            p.wait()
        print(f"compiled in workers: {time.time() - t0:.0f} s", flush=True)

    results = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", triton=triton.__version__,
                   torch=torch.__version__, variants=[], sdpa={}, production={})
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    # DS variants need a stored dS first: order dkdv(store) before dq_ds within a shape
    order = {"fwd": 0, "fwd_dev": 0, "prod_fwd": 0, "prod_fwd_watched": 0, "prod_bwd": 1, "dkdv": 1, "dq_ds": 2,
             "dq": 3}
    vs.sort(key=lambda v: (v["shape"], order[v["kind"]]))
    labs = {}
    for v in vs:
        lab = labs.setdefault(v["shape"], Lab(shapes[v["shape"]], device))
        rec = dict(v)
        try:
            rec["err"] = lab.check(v)
            rec["ok"] = True
        except Exception as exc:
            rec["ok"] = False
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        results["variants"].append(rec)
        print(v["name"], rec.get("err", rec.get("error")), flush=True)
    if device != "cuda":
        bad = [r for r in results["variants"] if not r["ok"] or any(x > 2e-2 for x in r["err"].values()
                                                                     if isinstance(x, float))]
        for r in bad:
            print("BAD", r["name"], r.get("err", r.get("error")))
        return 1 if bad else 0

    from _common import warm_gpu

    warm_gpu(1.0)
    for shape, lab in labs.items():
        results["sdpa"][shape] = sdpa_times(shapes[shape], bench)
        results["production"][shape] = dict(fwd=[], bwd=[])
    for rnd in range(args.rounds):
        for shape, lab in labs.items():
            results["production"][shape]["fwd"].append(bench(lab.prod_fwd))
            results["production"][shape]["bwd"].append(bench(lab.prod_bwd))
        for rec in results["variants"]:
            if rec["ok"]:
                rec.setdefault("ms", []).append(bench(labs[rec["shape"]].runner(rec)))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lab.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)

    # the table: per shape and kind, the best variants
    for shape in labs:
        sd = results["sdpa"][shape]
        pr = results["production"][shape]
        print(f"\n== {shape} {shapes[shape]}")
        print(f"  cudnn fwd {sd['cudnn'].get('fwd', float('nan')):.3f} bwd {sd['cudnn'].get('bwd', float('nan')):.3f}"
              f" | flash fwd {sd['flash'].get('fwd', float('nan')):.3f} bwd {sd['flash'].get('bwd', float('nan')):.3f}"
              f" | ours fwd {min(pr['fwd']):.3f} bwd {min(pr['bwd']):.3f}")
        for kind in ("fwd", "fwd_dev", "prod_fwd", "prod_fwd_watched", "prod_bwd", "dkdv", "dq_ds", "dq"):
            recs = [r for r in results["variants"] if r["shape"] == shape and r["kind"] == kind and r.get("ms")]
            recs.sort(key=lambda r: min(r["ms"]))
            top = recs[:4] if kind != "prod_bwd" else recs
            top = top + [r for r in recs[4:] if r.get("part") in (1, 2) and r is min(
                [x for x in recs if x.get("part") == r.get("part")], key=lambda x: min(x["ms"]))]
            for r in top:
                sw = {k: r[k] for k in ("tma", "reverse", "ws", "store_ds", "part", "mode") if k in r}
                print(f"  {kind:6s} {str(r['cfg']):36s} {sw} {min(r['ms']):.3f} ms  err {r['err']}")
            bad = [r["name"] for r in results["variants"] if r["shape"] == shape and r["kind"] == kind and not r["ok"]]
            if bad:
                print(f"  {kind}: {len(bad)} failed, e.g. {bad[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
