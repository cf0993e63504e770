"""Serving attention calls with the Gluon kernels at head dim 256 on Hopper (:mod:`.gluon_kernels`).

They serve the calls they can: sm_90, D = 256, BF16/FP16, no mask, no dropout, one KV head per
query head, N a multiple of 64 (dK/dV) or 128 (dQ, forward), tiles addressable by 2-D TMA (see
:func:`tma_view`). Every other call stays on the Triton kernels. The variants that were tried and
their timings are in ``benchmarks/RESULTS.md`` (the lab scripts that measured them, in git history).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from instability_watch.kernels.attention.gluon_kernels import (
    BLOCK,
    FWD_BLOCK_M,
    HEAD_DIM,
    NUM_WARPS,
    build_dkdv_kernel,
    build_dq_kernel,
    build_fwd_kernel,
)

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


def supported(q, k, v, do, *, masked: bool, dropout: bool, block: int = BLOCK) -> Optional[str]:
    """None if the Gluon kernels can serve this call (``do``: the backward's, or ``q`` again for the
    forward, whose query tiles are ``block`` = FWD_BLOCK_M rows), else why not (a short reason)."""
    if _failed is not None:
        return _failed
    if masked or dropout:
        return "mask or dropout"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "not an sm_90 GPU"
    B, H, N, D = q.shape
    if D != HEAD_DIM or q.dtype not in (torch.bfloat16, torch.float16):
        return "head dim or dtype"
    if k.shape != q.shape or v.shape != q.shape or do.shape != q.shape or N % block:
        return f"GQA, cross-attention or N not a multiple of {block}"
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


_launchers = {}


def _launch(build, grid, descs, tensors, scalars, meta) -> None:
    """Launch a Gluon kernel through the package's launcher (``launch.Launcher``: after its first
    launch, a kernel's compiled launcher is called directly, tens of microseconds of host time
    less than ``kernel[grid](...)``; the same path Triton takes elsewhere)."""
    from instability_watch.kernels.launch import Launcher

    launcher = _launchers.get(build)
    if launcher is None:
        launcher = _launchers[build] = Launcher(build())
    launcher(grid, tensors, scalars, meta, descs)


_built = {}


def _get(build):
    """``build()``'s kernel, built once per process."""
    kernel = _built.get(build)
    if kernel is None:
        kernel = _built[build] = build()
    return kernel


def _get_kernel():
    return _get(build_dkdv_kernel)


def _get_fwd_kernel():
    return _get(build_fwd_kernel)


def _get_dq_kernel():
    return _get(build_dq_kernel)


_layouts = {}


def _descriptor(view: torch.Tensor, rows: int = BLOCK):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = _layouts.get((rows, view.dtype))
    if layout is None:
        dt = gl.bfloat16 if view.dtype == torch.bfloat16 else gl.float16
        layout = _layouts[(rows, view.dtype)] = gl.NVMMASharedLayout.get_default_for([rows, HEAD_DIM], dt)
    return TensorDescriptor.from_tensor(view, [rows, HEAD_DIM], layout)


def dkdv(q, k, v, do, lse2, delta, dk, dv, *, causal: bool, qk_scale: float, scale: float) -> bool:
    """Write dK and dV with the Gluon kernel; False (nothing written) where some tensor's layout
    has no 2-D TMA view. ``lse2``, ``delta``: (B, H, N) float32, contiguous."""
    views = [tma_view(t) for t in (q, k, v, do, dk, dv)]
    if any(x is None for x in views):
        return False
    B, H, N, _ = q.shape
    descs = [_descriptor(x[0]) for x in views]
    geo = [int(n) for x in views for n in x[1:]]
    _launch(_get_kernel, (N // BLOCK, B * H), descs, (lse2, delta), (*geo, H, N, float(qk_scale), float(scale)),
            dict(CAUSAL=causal, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK, BLOCK_N=BLOCK, num_warps=NUM_WARPS))
    return True


def disable(reason: str) -> None:
    """Stop using the Gluon kernel in this process (it failed once; the Triton kernels serve instead)."""
    global _failed
    _failed = reason


def forward(q, k, v, o, lse2, *, causal: bool, qk_scale: float, stabilize: Optional[torch.Tensor] = None,
            eps_raw: float = 0.0, beta: float = 1.0, max_shift2: float = 0.0) -> bool:
    """O and LSE (log2 units) with the Gluon forward; False (nothing written) where some tensor's
    layout has no 2-D TMA view. ``lse2``: (B, H, N) float32, contiguous. ``stabilize``: (H,) uint8
    (nonzero: the head's shift moves above a repeated maximum; ``eps_raw``, ``beta``, ``max_shift2``
    as the Triton forward's) or None."""
    views = [tma_view(t) for t in (q, k, v, o)]
    if any(x is None for x in views):
        return False
    B, H, N, _ = q.shape
    descs = [_descriptor(x[0], rows) for x, rows in zip(views, (FWD_BLOCK_M, BLOCK, BLOCK, FWD_BLOCK_M))]
    geo = [int(n) for x in views for n in x[1:]]
    _launch(_get_fwd_kernel, (B * H, N // FWD_BLOCK_M), descs, (lse2, stabilize),
            (*geo, H, N, float(qk_scale), float(eps_raw), float(beta), float(max_shift2)),
            dict(CAUSAL=causal, HAS_STAB=stabilize is not None, HEAD_DIM=HEAD_DIM, BLOCK_M=FWD_BLOCK_M, BLOCK_N=BLOCK,
                 num_warps=NUM_WARPS))
    return True


def dq(q, k, v, o, do, lse2, delta, dq, *, causal: bool, qk_scale: float, scale: float, delta_from_o: bool) -> bool:
    """dQ with the Gluon kernel (and delta = rowsum(dO * O) into ``delta`` if ``delta_from_o``, else
    read from it); False (nothing written) where some tensor's layout has no 2-D TMA view.
    ``lse2``, ``delta``: (B, H, N) float32, contiguous."""
    views = [tma_view(t) for t in (q, k, v, do, dq)]
    if any(x is None for x in views):
        return False
    B, H, N, _ = q.shape
    descs = [_descriptor(x[0], rows) for x, rows in zip(views, (FWD_BLOCK_M, BLOCK, BLOCK, FWD_BLOCK_M, FWD_BLOCK_M))]
    geo = [int(n) for x in views for n in x[1:]]
    _launch(_get_dq_kernel, (B * H, N // FWD_BLOCK_M), descs, (o, do, lse2, delta),
            (*geo, *o.stride()[:3], *do.stride()[:3], H, N, float(qk_scale), float(scale)),
            dict(CAUSAL=causal, DELTA_FROM_O=delta_from_o, HEAD_DIM=HEAD_DIM, BLOCK_M=FWD_BLOCK_M, BLOCK_N=BLOCK,
                 num_warps=NUM_WARPS))
    return True
