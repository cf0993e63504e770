"""The kernels as ``torch.library`` ops, and the autograd Function over them.

Two custom ops, ``instability_watch::attention_fwd`` and ``::attention_bwd``,
run either backend (``"triton"`` or ``"reference"``) and write the probe's
statistics into its two buffers, which they declare as mutated. Each has a
fake (meta) implementation, so ``torch.compile`` traces a model through
:func:`~instability_watch.flash_attention` without a graph break, ``fullgraph=True``
included. ``torch.library`` does not allow an autograd formula on an op that
mutates its inputs, so the autograd glue is a ``torch.autograd.Function``
calling the two ops (Dynamo traces those too).

``lse`` is kept in each backend's own units (natural log for the reference's
``attention_forward_lse``, log2 for Triton's ``attention_forward_lse2``) and only ever
passed back to the same backend's backward.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import math
import os
import threading
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor

from instability_watch.kernels.attention import reference
from instability_watch.kernels.attention.alloc import empty_like_layout
from instability_watch.kernels.common import documents, dropout_mask, dropout_scale, expand_kv, mask4, mask_bias
from instability_watch.probe.bank import Probe


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
# rowsum(dO * O) from the stored low-precision O. Read by ``flash_attention`` when its own
# ``high_precision_delta`` argument is None (eager calls only: torch.compile cannot read a
# context variable; a compiled call takes the argument); set through
# ``instability_watch.experimental.high_precision_delta()``.
HIGH_PRECISION_DELTA: contextvars.ContextVar = contextvars.ContextVar(
    "instability_watch_high_precision_delta", default=False
)
# Backward calls that took the control's delta (counted where the op runs, compiled or not):
# a run meant to be the control can check that it is one.
HIGH_PRECISION_DELTA_CALLS = 0
_LN2 = math.log(2.0)


def _dense_attention(q, k, v, attn_mask, keep, inv_keep: float, causal: bool, scale: float, cdt,
                     return_lse: bool = False):
    """``(softmax(S) * Z) V`` with PyTorch ops in ``cdt`` (differentiable), ``Z`` the scaled dropout keep
    mask (``keep=None``: none); a row whose every key is masked gives 0, as SDPA. ``return_lse``: also the
    rows' log-sum-exp of ``S`` (differentiable; 0 for a row without keys)."""
    B, H, N, _ = q.shape
    group = H // k.shape[1]
    qf = q.to(cdt)
    kf = expand_kv(k, group).to(cdt)
    vf = expand_kv(v, group).to(cdt)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(reference.causal_mask(0, N, 0, k.shape[2], q.device), float("-inf"))
    if attn_mask is not None:
        s = s + mask_bias(mask4(attn_mask, B, H, N, k.shape[2]), cdt)
    p = torch.softmax(s, dim=-1)
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)
    p = torch.where(dead, 0.0, p)
    if keep is not None:
        p = torch.where(keep, p * inv_keep, 0.0)
    if return_lse:
        lse = torch.logsumexp(torch.where(dead, 0.0, s), dim=-1)
        return p @ vf, torch.where(dead[..., 0], 0.0, lse)
    return p @ vf


def delta_from_float32_o(q, k, v, do, attn_mask, seed, causal: bool, scale: float, dropout_p: float) -> Tensor:
    """``rowsum(dO * O_hp)`` (B, H, N), ``O_hp`` recomputed by PyTorch in float32 (float64 for float64 inputs)."""
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(q.device.type, enabled=False), torch.no_grad():
        if attn_mask is None and not dropout_p:
            o_hp = torch.nn.functional.scaled_dot_product_attention(
                q.to(cdt), k.to(cdt), v.to(cdt), is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        else:
            B, H, N, _ = q.shape
            keep = (dropout_mask(seed, B, H, N, k.shape[2], dropout_p, device=q.device)
                    if dropout_p else None)
            o_hp = _dense_attention(q, k, v, attn_mask, keep, dropout_scale(dropout_p) if dropout_p else 1.0,
                                    causal, scale, cdt)
        return (do.to(cdt) * o_hp).sum(dim=-1)


def _pytorch_backward(q, k, v, do, attn_mask, seed, causal: bool, scale: float, dropout_p: float, mask_grad: bool,
                      dlse: Optional[Tensor] = None):
    """Gradients from PyTorch, recomputed from the saved inputs (the fail-open path): SDPA's own
    backward without a mask or dropout, else the same attention (mask, dropout mask) in float32.
    ``dlse``: the gradient of the rows' log-sum-exp too (natural log, (B, H, N))."""
    with torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        if attn_mask is None and not dropout_p and dlse is None:
            o = torch.nn.functional.scaled_dot_product_attention(
                qq, kk, vv, is_causal=causal, scale=scale, enable_gqa=qq.shape[1] != kk.shape[1]
            )
            return (*torch.autograd.grad(o, (qq, kk, vv), do), None)
        B, H, N, _ = q.shape
        keep = dropout_mask(seed, B, H, N, k.shape[2], dropout_p, device=q.device) if dropout_p else None
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        mm = attn_mask.detach().requires_grad_(True) if mask_grad else attn_mask
        o, lse = _dense_attention(qq, kk, vv, mm, keep, dropout_scale(dropout_p) if dropout_p else 1.0,
                                  causal, scale, cdt, return_lse=True)
        inputs = (qq, kk, vv, mm) if mask_grad else (qq, kk, vv)
        if dlse is None:
            grads = torch.autograd.grad(o, inputs, do.to(cdt))
        else:
            grads = torch.autograd.grad((o, lse), inputs, (do.to(cdt), dlse.reshape(lse.shape).to(cdt)))
        grads = [g.to(t.dtype) for g, t in zip(grads, inputs)]
        return (*grads[:3], grads[3] if mask_grad else None)


_TRITON_MODULE = None


def _triton():
    global _TRITON_MODULE
    if _TRITON_MODULE is None:
        from instability_watch.kernels.attention import triton  # on first use: CPU-only users never load Triton

        _TRITON_MODULE = triton
    return _TRITON_MODULE


# The documents of one packed batch serve every layer of a step, forward and backward: their tiles' ranges are
# found once (about a hundred small device operations a call otherwise, which set the pace of an eager packed
# call). Keyed by the boundary tensors themselves, held weakly (identity, storage and in-place version: a buffer
# refilled by a torch operation is new documents), the lengths, the window and the CUDA stream; a few batches at
# most, and the watch forgets them at every step (a write PyTorch does not count, through .data, NumPy or DLPack,
# is then seen from the next step on; within a step the boundaries must change only through torch operations).
# Only the calls a watch routes keep them (it sets KEEP_DOCUMENTS around its layers' packed calls and forgets them
# at every step); a direct call of flash_attention_varlen finds its documents each time.
KEEP_DOCUMENTS: contextvars.ContextVar = contextvars.ContextVar("instability_watch_keep_documents", default=False)
_DOCUMENTS: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_DOCUMENTS_LOCK = threading.Lock()  # threads (nn.DataParallel's) share them
DOCUMENTS_KEPT = 4


def kept_documents(cu_q: Tensor, cu_k: Tensor, t_q: int, t_k: int, window: Tuple[int, int]):
    """The packed batch's documents (the Triton kernels' :class:`~.triton.Documents`, their tiles' ranges found
    as the kernels ask for them): the ones kept for these boundary tensors and this window, else found and kept."""
    # the stream too: documents found on one stream are used on that stream only (no wait for them elsewhere,
    # and their memory is never in use on a stream the caching allocator does not know of)
    stream = torch.cuda.current_stream(cu_q.device).cuda_stream if cu_q.is_cuda else None
    try:
        key = (id(cu_q), cu_q.data_ptr(), cu_q._version, id(cu_k), cu_k.data_ptr(), cu_k._version, t_q, t_k, window,
               stream)
    except RuntimeError:  # an inference tensor has no version counter: not kept
        return _triton().Documents(cu_q, cu_k, t_q, t_k, window)
    with _DOCUMENTS_LOCK:
        hit = _DOCUMENTS.get(key)
        if hit is not None and hit[0]() is cu_q and hit[1]() is cu_k:
            _DOCUMENTS.move_to_end(key)
            return hit[2]
    docs = _triton().Documents(cu_q, cu_k, t_q, t_k, window)
    with _DOCUMENTS_LOCK:
        _DOCUMENTS[key] = (weakref.ref(cu_q), weakref.ref(cu_k), docs)
        while len(_DOCUMENTS) > DOCUMENTS_KEPT:
            _DOCUMENTS.popitem(last=False)
    return docs


@contextlib.contextmanager
def keeping_documents():
    """Within it, packed calls keep their documents (:data:`KEEP_DOCUMENTS`). Eager code only (not for code
    Dynamo traces)."""
    token = KEEP_DOCUMENTS.set(True)
    try:
        yield
    finally:
        KEEP_DOCUMENTS.reset(token)


def forget_documents() -> None:
    """Drop the documents kept from earlier packed calls (their ranges are found again on the next call)."""
    if _DOCUMENTS:
        with _DOCUMENTS_LOCK:
            _DOCUMENTS.clear()


def _documents(q: Tensor, k: Tensor, cu_q: Optional[Tensor], cu_k: Optional[Tensor], win_l: int, win_r: int,
                backend: str):
    """``(documents, attn_mask)`` of a packed call (``cu_q`` given): the Triton kernels' document mask, or for
    the reference a dense boolean mask (1, 1, T_q, T_k) (the oracle may form it); ``(None, None)`` otherwise."""
    if cu_q is None:
        return None, None
    t_q, t_k = q.shape[2], k.shape[2]
    if backend == "triton":
        if KEEP_DOCUMENTS.get():
            return kept_documents(cu_q, cu_k, t_q, t_k, (win_l, win_r)), None
        return _triton().Documents(cu_q, cu_k, t_q, t_k, (win_l, win_r)), None
    doc_q, pos_q, doc_k, pos_k = documents(cu_q, cu_k, t_q, t_k)
    keep = doc_q[:, None] == doc_k[None, :]
    if win_l >= 0:
        keep &= pos_k[None, :] >= pos_q[:, None] - win_l
    if win_r >= 0:
        keep &= pos_k[None, :] <= pos_q[:, None] + win_r
    return None, keep.view(1, 1, t_q, t_k)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], seed: Optional[Tensor], stabilize: Optional[Tensor],
    counts: Optional[Tensor], values: Optional[Tensor],
    causal: bool, scale: float, beta: float, eps: float, dropout_p: float, backend: str,
    cu_q: Optional[Tensor], cu_k: Optional[Tensor], win_l: int, win_r: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(o, lse, mask_flags)`` (the op; an empty ``mask_flags`` where the call has none)."""
    o, lse, flags = _run_forward(q, k, v, attn_mask, seed, stabilize, counts, values, causal, scale, beta, eps,
                                 dropout_p, backend, cu_q, cu_k, win_l, win_r)
    return o, lse, (flags if flags is not None else q.new_empty(0, dtype=torch.uint8))


def _run_forward(q, k, v, attn_mask, seed, stabilize, counts, values, causal, scale, beta, eps, dropout_p, backend,
                 cu_q, cu_k, win_l, win_r):
    """``(o, lse, mask_flags)``: ``mask_flags`` the mask's base tile flags for the backward (the mask read once a
    call: :data:`.masks.FLAGS_ONCE`), uint8 of :func:`_flag_shape`, or None where the call has none (eager calls
    skip the op and its empty tensor)."""
    docs, doc_mask = _documents(q, k, cu_q, cu_k, win_l, win_r, backend)
    if doc_mask is not None:
        attn_mask = doc_mask
    shape = _flag_shape(attn_mask, k, backend)
    flags = torch.empty(shape, dtype=torch.uint8, device=q.device) if shape != (0,) else None
    if backend == "triton":
        o, lse = _triton().attention_forward_lse2(
            q, k, v, causal=causal, scale=scale, stabilize=stabilize, beta=beta, eps=eps,
            counts=counts, values=values, attn_mask=attn_mask, dropout_p=dropout_p, seed=seed, documents=docs,
            mask_flags=flags,
        )
        return o, lse, flags
    probe = None if counts is None else Probe.from_buffers(counts, values)
    o, lse = reference.attention_forward_lse(
        q, k, v, causal=causal, scale=scale, stabilize=stabilize, beta=beta, eps=eps, probe=probe,
        attn_mask=attn_mask, dropout_p=dropout_p, seed=seed,
    )
    return _into(q, o), lse, flags


def _flag_shape(attn_mask: Optional[Tensor], k: Tensor, backend: str) -> Tuple[int, ...]:
    """The shape of a call's base tile flags: the Triton kernels' over a mask (:func:`.masks.base_flag_shape`),
    else ``(0,)``."""
    if backend != "triton" or attn_mask is None:
        return (0,)
    from instability_watch.kernels.attention.masks import base_flag_shape
    return base_flag_shape(attn_mask, k.shape[2])


attention_fwd = torch.library.custom_op("instability_watch::attention_fwd", _forward, mutates_args=("counts", "values"))


@attention_fwd.register_fake
def _(q, k, v, attn_mask, seed, stabilize, counts, values, causal, scale, beta, eps, dropout_p, backend, cu_q, cu_k,
      win_l, win_r):
    B, H, N, D = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse_shape = (2, B, H, N) if attn_mask is not None and attn_mask.is_floating_point() else (B, H, N)
    return (empty_like_layout(q), q.new_empty(lse_shape, dtype=lse_dtype),
            q.new_empty(_flag_shape(attn_mask, k, backend), dtype=torch.uint8))


def _backward_impl(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
    attn_mask: Optional[Tensor], seed: Optional[Tensor], counts: Optional[Tensor], values: Optional[Tensor],
    causal: bool, scale: float, dropout_p: float, shadow: bool, mask_grad: bool, backend: str,
    delta: Optional[Tensor] = None, delta_hp: bool = False, docs=None, dlse: Optional[Tensor] = None,
    mask_flags: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dmask)``; ``dmask`` is an empty tensor unless ``mask_grad``. ``delta_hp``
    (Triton only): the kernels compute the control's delta themselves. ``docs``: a packed call's
    documents (Triton; the reference gets them as ``attn_mask``). ``dlse`` (Triton only; the reference
    gets it inside ``delta``): the log-sum-exp's gradient, which the kernels take into delta. ``mask_flags``
    (Triton only): the forward's base tile flags of the mask."""
    shadow = shadow and counts is not None
    if backend == "triton":
        dq, dk, dv, dmask = _triton().attention_backward_lse2(
            q, k, v, o, lse, do, causal=causal, scale=scale, counts=counts, values=values, shadow=shadow,
            delta=delta, attn_mask=attn_mask, dropout_p=dropout_p, seed=seed, mask_grad=mask_grad, delta_hp=delta_hp,
            documents=docs, dlse=dlse, mask_flags=mask_flags,
        )
    else:
        probe = Probe.from_buffers(counts, values) if shadow else None
        dq, dk, dv, dmask = reference.attention_backward_lse(
            q, k, v, o, lse, do, causal=causal, scale=scale, shadow_probe=probe, delta=delta,
            attn_mask=attn_mask, dropout_p=dropout_p, seed=seed, mask_grad=mask_grad,
        )
        dq, dk, dv = _into(q, dq), _into(k, dk), _into(v, dv)
    return dq, dk, dv, (dmask if dmask is not None else q.new_empty(0))


def _backward(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
    attn_mask: Optional[Tensor], seed: Optional[Tensor], counts: Optional[Tensor], values: Optional[Tensor],
    causal: bool, scale: float, dropout_p: float, shadow: bool, mask_grad: bool, backend: str, hp_delta: bool,
    cu_q: Optional[Tensor], cu_k: Optional[Tensor], win_l: int, win_r: int, dlse: Optional[Tensor] = None,
    mask_flags: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    docs, doc_mask = _documents(q, k, cu_q, cu_k, win_l, win_r, backend)
    if doc_mask is not None:
        attn_mask = doc_mask
    # hp_delta (the paper's control) is an argument of the op, so a compiled graph carries it
    delta, in_kernel = None, False
    if hp_delta:
        global HIGH_PRECISION_DELTA_CALLS
        HIGH_PRECISION_DELTA_CALLS += 1
        # Triton: a pre-pass of the dQ kernel (about a forward's work); elsewhere, or with
        # INSTABILITY_WATCH_HP_DELTA=pytorch, O recomputed by PyTorch in float32 (an attention forward in float32)
        in_kernel = backend == "triton" and os.environ.get("INSTABILITY_WATCH_HP_DELTA", "kernel") != "pytorch"
        if not in_kernel:
            # a packed call's documents as a dense mask for PyTorch (the Triton kernels get them as ``docs``)
            hp_mask = _documents(q, k, cu_q, cu_k, win_l, win_r, "reference")[1] if docs is not None else attn_mask
            delta = delta_from_float32_o(q, k, v, do, hp_mask, seed, causal, scale, dropout_p)
    if dlse is not None and backend != "triton":
        # the log-sum-exp's gradient: d lse_i / d S_ij = P_ij, so dS = P * (dP - (delta - dlse))
        # (the Triton kernels take dlse themselves)
        if delta is None:
            cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
            delta = (do.to(cdt) * o.to(cdt)).sum(dim=-1)
        delta = delta - dlse.reshape(delta.shape).to(delta.dtype)
        dlse = None
    return _backward_impl(q, k, v, o, lse, do, attn_mask, seed, counts, values, causal, scale, dropout_p, shadow,
                          mask_grad, backend, delta, in_kernel, docs, dlse, mask_flags)


attention_bwd = torch.library.custom_op("instability_watch::attention_bwd", _backward, mutates_args=("counts", "values"))


@attention_bwd.register_fake
def _(q, k, v, o, lse, do, attn_mask, seed, counts, values, causal, scale, dropout_p, shadow, mask_grad, backend,
      hp_delta, cu_q, cu_k, win_l, win_r, dlse=None, mask_flags=None):
    dmask = torch.empty_like(attn_mask) if mask_grad else q.new_empty(0)
    return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v), dmask


class FlashAttention(torch.autograd.Function):
    """Forward and backward through the two ops; the backward is FA2's, whatever the shift."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, seed, stabilize, counts, values, shadow, causal, scale, beta, eps,
                dropout_p, backend, hp_delta, cu_q=None, cu_k=None, win_l=-1, win_r=-1, need_lse=False):
        """o (B, H, N, D) in q's dtype, from q (B, H, N, D), k, v (B, H_kv, N_kv, D); ``attn_mask``
        broadcastable to (B, H, N, N_kv) or None, ``seed`` int64 (2,) or None, ``stabilize`` bool (H,)
        or None, ``counts``/``values`` the probe's buffers or None, ``hp_delta`` the backward's delta
        from a float32 ``O`` (the paper's control), ``cu_q``/``cu_k`` a packed call's documents (the views
        (1, H, T, D) of its tensors) and ``win_l``/``win_r`` their window (arguments checked by the caller).
        Returns ``(o, lse)``, ``lse`` (B, H, N) float32 (float64 for float64 inputs) natural log, with
        ``need_lse`` (else None: no extra work); its gradient, where one reaches it, enters the backward's
        ``delta``."""
        # Eager calls skip the op dispatcher (tens of microseconds of host time per
        # call); under torch.compile the op is what gets traced.
        fwd = attention_fwd if torch.compiler.is_compiling() else _run_forward
        o, lse, flags = fwd(q, k, v, attn_mask, seed, stabilize, counts, values, causal, scale, beta, eps, dropout_p,
                            backend, cu_q, cu_k, win_l, win_r)
        ctx.save_for_backward(q, k, v, o, lse, attn_mask, seed, cu_q, cu_k, flags)
        ctx.window = (win_l, win_r)
        # a routed packed call's documents serve its backward too, which runs later, outside the watch's
        # KEEP_DOCUMENTS (on a GPU in autograd's own thread, which does not see this one's context variables)
        ctx.keep_documents = cu_q is not None and not torch.compiler.is_compiling() and KEEP_DOCUMENTS.get()
        # The step that ran the forward is the step whose backward is shadowed.
        # The probe buffers are held as attributes, not saved tensors: other
        # forwards may add to them before this backward runs (gradient
        # accumulation, pipelining) and that must not trip autograd's version check.
        ctx.shadow = bool(shadow and counts is not None)
        ctx.probe_buffers = (counts, values) if ctx.shadow else (None, None)
        ctx.causal, ctx.scale, ctx.dropout_p, ctx.backend = causal, scale, dropout_p, backend
        compiling = torch.compiler.is_compiling()
        ctx.on_error = None if compiling else ERROR_HANDLER.get()
        ctx.hp_delta = bool(hp_delta)
        ctx.set_materialize_grads(False)  # an output nobody differentiates reaches the backward as None
        if not need_lse:
            return o, None
        nat = lse[0] + lse[1] if lse.dim() == 4 else lse  # an additive mask's two planes: the shift and log(l)
        nat = (nat * _LN2 if backend == "triton" else nat)  # Triton's are in log2 units
        nat = nat.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        return o, nat

    @staticmethod
    def backward(ctx, do, dlse=None):
        """Gradients of q, k, v (their shapes and dtypes) and of a float ``attn_mask`` that requires
        one, from ``do`` (B, H, N, D) and the log-sum-exp's ``dlse`` (None: none); on a failure with an
        error handler set, PyTorch's instead."""
        q, k, v, o, lse, attn_mask, seed, cu_q, cu_k, flags = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        if dlse is not None:  # rows without a key (lse +inf) take no gradient
            seen = torch.isfinite(lse[0] + lse[1] if lse.dim() == 4 else lse)
            dlse = torch.where(seen, dlse, 0.0)
        counts, values = ctx.probe_buffers
        mask_grad = bool(attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3])
        bwd = attention_bwd if torch.compiler.is_compiling() else _backward
        args = (q, k, v, o, lse, do, attn_mask, seed, counts, values, ctx.causal, ctx.scale, ctx.dropout_p,
                ctx.shadow, mask_grad, ctx.backend, ctx.hp_delta, cu_q, cu_k, *ctx.window, dlse, flags)
        try:
            if ctx.keep_documents and not torch.compiler.is_compiling():  # (a backward traced: compiled autograd)
                with keeping_documents():
                    dq, dk, dv, dmask = bwd(*args)
            else:
                dq, dk, dv, dmask = bwd(*args)
        except Exception as exc:
            if ctx.on_error is None:
                raise
            ctx.on_error(exc)  # reported once by the watch, which turns routing off
            if cu_q is not None:  # a packed call: its documents as a dense mask for PyTorch
                attn_mask = _documents(q, k, cu_q, cu_k, *ctx.window, "reference")[1]
            dq, dk, dv, dmask = _pytorch_backward(q, k, v, do, attn_mask, seed, ctx.causal, ctx.scale, ctx.dropout_p,
                                                  mask_grad, dlse)
        return (dq, dk, dv, (dmask if mask_grad else None), None, None, None, None, None, None, None, None, None,
                None, None, None, None, None, None, None, None)
