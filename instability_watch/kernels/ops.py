"""The kernels as ``torch.library`` ops, and the autograd Function over them.

Two custom ops, ``instability_watch::attention_fwd`` and ``::attention_bwd``,
run either backend (``"triton"`` or ``"reference"``) and write the probe's
statistics into its two buffers, which they declare as mutated. Each has a
fake (meta) implementation, so ``torch.compile`` traces a model through
:func:`~instability_watch.flash_attention` without a graph break, ``fullgraph=True``
included. ``torch.library`` does not allow an autograd formula on an op that
mutates its inputs, so the autograd glue is a ``torch.autograd.Function``
calling the two ops (Dynamo traces those too).

``lse`` is kept in each backend's own units (natural log for the reference,
log2 for Triton) and only ever passed back to the same backend's backward.
"""
from __future__ import annotations

import contextvars
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..probe import Probe
from . import reference
from .layout import empty_like_layout


def _into(like: Tensor, t: Tensor) -> Tensor:
    """``t`` in ``like``'s layout (a copy only if the layouts differ)."""
    out = empty_like_layout(like, t.shape, t.dtype)
    if out.stride() == t.stride():
        return t
    return out.copy_(t)


# Set by the watch around a routed call: where a failure in this call's backward
# is reported before the backward falls back to PyTorch (fail-open). ``None``:
# failures propagate (plain calls, ``strict=True``).
ERROR_HANDLER: contextvars.ContextVar = contextvars.ContextVar("instability_watch_error_handler", default=None)

# The paper's control experiment (its Claim 1): while True, the backward of an eager call
# takes delta = rowsum(dO * O_hp), O_hp the exact softmax(S) V in float32, instead of
# rowsum(dO * O) from the stored low-precision O. Read at the forward (the backward runs
# on autograd's threads); set through ``kernels.high_precision_delta()``.
HIGH_PRECISION_DELTA: contextvars.ContextVar = contextvars.ContextVar(
    "instability_watch_high_precision_delta", default=False
)


def _high_precision_delta(q: Tensor, k: Tensor, v: Tensor, do: Tensor, causal: bool, scale: float) -> Tensor:
    """``rowsum(dO * O_hp)`` (B, H, N), ``O_hp`` recomputed by PyTorch in float32 (float64 for float64 inputs)."""
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(q.device.type, enabled=False), torch.no_grad():
        o_hp = torch.nn.functional.scaled_dot_product_attention(
            q.to(cdt), k.to(cdt), v.to(cdt), is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return (do.to(cdt) * o_hp).sum(dim=-1)


def _pytorch_backward(q, k, v, do, causal: bool, scale: float):
    """Gradients from PyTorch's SDPA, recomputed from the saved inputs (the fail-open path)."""
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            qq, kk, vv, is_causal=causal, scale=scale, enable_gqa=qq.shape[1] != kk.shape[1]
        )
        return torch.autograd.grad(o, (qq, kk, vv), do)


_TRITON_MODULE = None


def _triton():
    global _TRITON_MODULE
    if _TRITON_MODULE is None:
        from . import triton_attention  # imported on first use: CPU-only users never load Triton

        _TRITON_MODULE = triton_attention
    return _TRITON_MODULE


def _forward(
    q: Tensor, k: Tensor, v: Tensor, stabilize: Optional[Tensor],
    counts: Optional[Tensor], values: Optional[Tensor],
    causal: bool, scale: float, beta: float, eps: float, backend: str,
) -> Tuple[Tensor, Tensor]:
    if backend == "triton":
        return _triton().attention_forward(
            q, k, v, causal=causal, scale=scale, stabilize=stabilize, beta=beta, eps=eps,
            counts=counts, values=values,
        )
    probe = None if counts is None else Probe.from_buffers(counts, values)
    o, lse = reference.attention_forward(
        q, k, v, causal=causal, scale=scale, stabilize=stabilize, beta=beta, eps=eps, probe=probe
    )
    return _into(q, o), lse


attention_fwd = torch.library.custom_op("instability_watch::attention_fwd", _forward, mutates_args=("counts", "values"))


@attention_fwd.register_fake
def _(q, k, v, stabilize, counts, values, causal, scale, beta, eps, backend):
    B, H, N, D = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return empty_like_layout(q), q.new_empty((B, H, N), dtype=lse_dtype)


def _backward_impl(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
    counts: Optional[Tensor], values: Optional[Tensor],
    causal: bool, scale: float, shadow: bool, backend: str, delta: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    shadow = shadow and counts is not None
    if backend == "triton":
        return _triton().attention_backward(
            q, k, v, o, lse, do, causal=causal, scale=scale, counts=counts, values=values, shadow=shadow,
            delta=delta,
        )
    probe = Probe.from_buffers(counts, values) if shadow else None
    dq, dk, dv = reference.attention_backward(
        q, k, v, o, lse, do, causal=causal, scale=scale, shadow_probe=probe, delta=delta
    )
    return _into(q, dq), _into(k, dk), _into(v, dv)


def _backward(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
    counts: Optional[Tensor], values: Optional[Tensor],
    causal: bool, scale: float, shadow: bool, backend: str,
) -> Tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(q, k, v, o, lse, do, counts, values, causal, scale, shadow, backend)


attention_bwd = torch.library.custom_op("instability_watch::attention_bwd", _backward, mutates_args=("counts", "values"))


@attention_bwd.register_fake
def _(q, k, v, o, lse, do, counts, values, causal, scale, shadow, backend):
    return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)


class FlashAttention(torch.autograd.Function):
    """Forward and backward through the two ops; the backward is FA2's, whatever the shift."""

    @staticmethod
    def forward(ctx, q, k, v, stabilize, counts, values, shadow, causal, scale, beta, eps, backend):
        # Eager calls skip the op dispatcher (tens of microseconds of host time per
        # call); under torch.compile the op is what gets traced.
        fwd = attention_fwd if torch.compiler.is_compiling() else _forward
        o, lse = fwd(q, k, v, stabilize, counts, values, causal, scale, beta, eps, backend)
        ctx.save_for_backward(q, k, v, o, lse)
        # The step that ran the forward is the step whose backward is shadowed.
        # The probe buffers are held as attributes, not saved tensors: other
        # forwards may add to them before this backward runs (gradient
        # accumulation, pipelining) and that must not trip autograd's version check.
        ctx.shadow = bool(shadow and counts is not None)
        ctx.probe_buffers = (counts, values) if ctx.shadow else (None, None)
        ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
        compiling = torch.compiler.is_compiling()
        ctx.on_error = None if compiling else ERROR_HANDLER.get()
        ctx.hp_delta = False if compiling else HIGH_PRECISION_DELTA.get()
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        counts, values = ctx.probe_buffers
        bwd = attention_bwd if torch.compiler.is_compiling() else _backward
        try:
            if ctx.hp_delta:
                delta = _high_precision_delta(q, k, v, do, ctx.causal, ctx.scale)
                dq, dk, dv = _backward_impl(
                    q, k, v, o, lse, do, counts, values, ctx.causal, ctx.scale, ctx.shadow, ctx.backend, delta
                )
            else:
                dq, dk, dv = bwd(
                    q, k, v, o, lse, do, counts, values, ctx.causal, ctx.scale, ctx.shadow, ctx.backend
                )
        except Exception as exc:
            if ctx.on_error is None:
                raise
            ctx.on_error(exc)  # reported once by the watch, which turns routing off
            dq, dk, dv = _pytorch_backward(q, k, v, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None
