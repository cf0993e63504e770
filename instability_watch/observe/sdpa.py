"""Observing ``F.scaled_dot_product_attention``: the per-layer ``TorchFunctionMode`` and the shadow tap.

The user's SDPA call runs exactly as without the watch: same function,
arguments, autocast, backend and random numbers. On probe steps a layer's
``forward`` runs inside :class:`SdpaObserver`, which catches its SDPA calls:

* each call is first run by PyTorch; then the statistics pass (:mod:`~instability_watch.kernels.stats`) reads
  the same ``q, k, attn_mask`` *in the dtype the call computes in* (autocast's rule for SDPA applied: floating
  tensors other than float64 are cast to the autocast dtype) and the output, with autocast disabled, and adds
  per-head counts into the layer's probe;
* on shadow steps the output also goes through :class:`ShadowTap`, an autograd
  node whose backward hands the gradient back unchanged and runs the shadow
  pass on ``dO``. The user's calls with dropout get no shadow (their keep mask
  is PyTorch's, which the pass cannot regenerate); they are counted. Calls with
  dropout on our kernels (a switched layer) are shadowed with their own keep
  mask (the seed is drawn here and handed to the kernel);
* a switched layer's calls run on :func:`~instability_watch.flash_attention`,
  standard for the other heads and stabilized for the switched ones, with
  autocast's rule applied to the inputs, the call's mask and its dropout
  (seeded from the device's default generator, as the SDPA call it replaces).
  A call the kernels cannot serve (e.g. a head dim above 256, float64 under
  autocast) stays on PyTorch; the layer's switch is then reported as not
  applied, with the reason.

The observer reads only its own attributes, which :class:`~instability_watch.observe.observation.Observation`
keeps current, never the model."""
from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from instability_watch.kernels import dropout_seed, flash_attention, flash_attention_varlen, unsupported
from instability_watch.kernels.attention.ops import ERROR_HANDLER, KEEP_DOCUMENTS, keeping_documents
from instability_watch.kernels import stats as _stats_kernels
from instability_watch.kernels.stats import attention_shadow, attention_stats
from instability_watch.kernels.stats.flex import (FLEX_OP, FlexCall, flex_shadow, flex_shadow_forward, flex_stats,
                                                  keep_mask, mask_inputs, op_outputs, switch_refusal)
from instability_watch.kernels.stats.varlen import VARLEN_OP, VarlenCall, varlen_shadow, varlen_stats
from instability_watch.observe.coverage import KIND_ROW, NOT_APPLIED, SHADOW_SKIPPED, UNOBSERVED
from instability_watch.observe.mha import MHA_FORWARD, TENSOR_UNFLATTEN, mha_call, unflatten
from instability_watch.probe.fields import COUNT_ROW

_SDPA = F.scaled_dot_product_attention
# ----------------------------------------------------------------------------- one SDPA call


@dataclass
class SdpaCall:
    """One SDPA call's arguments, however they were passed."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    dropout_p: float
    is_causal: bool
    scale: Optional[float]
    enable_gqa: bool

    @classmethod
    def parse(cls, args, kwargs) -> "SdpaCall":
        """The call's arguments, however they were passed (``TypeError`` for a call SDPA itself would refuse)."""
        return cls(*_sdpa_args(*args, **kwargs))

    def unobservable(self, num_heads: int) -> Optional[str]:
        """Why the statistics passes cannot read this call (``None`` if they can)."""
        q, k, v, m = self.q, self.k, self.v, self.attn_mask
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return "inputs are not tensors"
        if any(t.is_nested for t in (q, k, v)):
            return "nested tensors"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return f"inputs not 4-D (B, H, N, D): q {tuple(q.shape)}"
        if q.shape[1] != num_heads:
            return f"{q.shape[1]} query heads in the call, the layer has {num_heads}"
        if k.shape[1] < 1 or q.shape[1] % k.shape[1] or v.shape[1] != k.shape[1]:
            return f"key/value heads {k.shape[1]}/{v.shape[1]} do not divide query heads {q.shape[1]}"
        if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3]:
            return "q, k, v shapes do not match"
        if not q.is_floating_point() or q.device.type not in ("cuda", "cpu"):
            return f"{q.dtype} on {q.device.type}"
        if m is not None and (not isinstance(m, torch.Tensor) or not (m.dtype == torch.bool or m.is_floating_point())):
            return "attn_mask is neither boolean nor floating point"
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale)):
            return f"scale {self.scale!r}"
        return None

    def computed(self):
        """``q, k, v, attn_mask`` in the dtypes the call computes in (autocast's rule for SDPA)."""
        device_type = self.q.device.type
        if not torch.is_autocast_enabled(device_type):
            return self.q, self.k, self.v, self.attn_mask
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):
            if t is None or not t.is_floating_point() or t.dtype in (torch.float64, dtype):
                return t
            return t.to(dtype)

        return cast(self.q), cast(self.k), cast(self.v), cast(self.attn_mask)


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def no_autocast(device_type: str):
    """Autocast off on ``device_type`` (the statistics compute in the dtypes given)."""
    return torch.autocast(device_type, enabled=False)


def _shadow_pass(on_error, counts: torch.Tensor, run: Callable[[], None]) -> None:
    """A tap's backward: ``run()`` the shadow pass (no grad, autocast off) and count the call; a failure goes
    to ``on_error`` (monitoring never breaks the backward), or is raised without one or under compile."""
    try:
        with torch.no_grad(), no_autocast(counts.device.type):
            run()
            counts[COUNT_ROW["shadow_calls"]] += 1
    except Exception as exc:  # noqa: BLE001
        if on_error is None or torch.compiler.is_compiling():
            raise
        on_error(exc)


class ShadowTap(torch.autograd.Function):
    """Identity on ``o``; its backward runs the shadow pass on ``dO`` and returns ``dO`` unchanged."""

    @staticmethod
    def forward(ctx, o, q, k, v, attn_mask, counts, values, causal, scale, on_error, dropout_p=0.0, seed=None,
                group=0):
        ctx.save_for_backward(o, q, k, v, attn_mask, seed)
        # the probe buffers as attributes, not saved tensors: other forwards add to them
        # before this backward runs, which must not trip autograd's version check
        ctx.buffers = (counts, values)
        ctx.causal, ctx.scale, ctx.on_error, ctx.dropout_p, ctx.group = causal, scale, on_error, dropout_p, group
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        o, q, k, v, attn_mask, seed = ctx.saved_tensors
        counts, values = ctx.buffers
        _shadow_pass(ctx.on_error, counts, lambda: attention_shadow(
            q, k, v, o, do, attn_mask, counts, values, causal=ctx.causal, scale=ctx.scale, dropout_p=ctx.dropout_p,
            seed=seed, group=ctx.group))
        return do, None, None, None, None, None, None, None, None, None, None, None, None


class FlexShadowTap(torch.autograd.Function):
    """Identity on a FlexAttention call's ``o``; its backward runs the shadow pass on ``dO`` against ``O_hp``
    (the call in float32, computed in the forward) and returns ``dO`` unchanged."""

    @staticmethod
    def forward(ctx, o, o_hp, live, counts, values, on_error):
        ctx.save_for_backward(o, o_hp, live)
        ctx.buffers, ctx.on_error = (counts, values), on_error  # attributes: see ShadowTap
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        o, o_hp, live = ctx.saved_tensors
        counts, values = ctx.buffers
        _shadow_pass(ctx.on_error, counts, lambda: flex_shadow(o, o_hp, live, do, counts, values))
        return do, None, None, None, None, None


class VarlenShadowTap(torch.autograd.Function):
    """Identity on a varlen call's ``o`` (T, H, D_v); its backward runs the shadow pass document by document
    on ``dO`` and returns ``dO`` unchanged."""

    @staticmethod
    def forward(ctx, o, q, k, v, cu_q, cu_k, causal, scale, window, counts, values, on_error, keep=False):
        ctx.save_for_backward(o, q, k, v, cu_q, cu_k)
        ctx.buffers, ctx.on_error = (counts, values), on_error  # attributes: see ShadowTap
        ctx.causal, ctx.scale, ctx.window, ctx.keep = causal, scale, window, keep
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        o, q, k, v, cu_q, cu_k = ctx.saved_tensors
        counts, values = ctx.buffers
        call = VarlenCall(q, k, v, cu_q, cu_k, ctx.causal, ctx.scale, ctx.window, False)
        if ctx.keep and not torch.compiler.is_compiling():  # the forward's kept documents (this runs later)
            with keeping_documents():
                _shadow_pass(ctx.on_error, counts, lambda: varlen_shadow(call, o, do, counts, values))
        else:
            _shadow_pass(ctx.on_error, counts, lambda: varlen_shadow(call, o, do, counts, values))
        return do, None, None, None, None, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------- the mode


_OBSERVERS: "weakref.WeakValueDictionary[int, SdpaObserver]" = weakref.WeakValueDictionary()
_observer_keys = itertools.count()
# one key per Observation (every layer of one watch; a model's next watch takes back its last one's: observation.
# take_group): what the trace-time helpers take, so the code an attention call traces reads nothing of its layer's
# own and one compiled graph serves every layer (a compiled attention function called from eager layer forwards, as
# HF compiles FlexAttention, would otherwise be compiled per layer, and per watch, and run eagerly past the limit)
_GROUPS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_group_keys = itertools.count(1)  # from 1: group 0 is "no watch" to the statistics ops
# the observer whose layer's forward is running (set by the layer's wrapper, eagerly or at trace time)
_CURRENT: list = [None]


class SdpaObserver(TorchFunctionMode):
    """Entered around one layer's ``forward``: its SDPA calls are observed or routed.

    A call reads only this object's own attributes (flags, probe buffers, the
    ``stabilize`` mask, ``beta``, ``eps``), which :class:`Observation` keeps
    current, never the model: ``torch.compile`` traces a call without reaching
    the model a second time (Dynamo refuses to track one module from two
    places), and flipping a head's mask, a tensor changed in place, never
    recompiles.
    """

    def __init__(self, site, observation) -> None:
        super().__init__()
        self.key = next(_observer_keys)
        _OBSERVERS[self.key] = self
        if observation.group_key is None:  # else a key taken back (observation.take_group), or its first observer's
            observation.group_key = next(_group_keys)
        _GROUPS[observation.group_key] = observation
        self.group = observation.group_key
        self.site = site  # bookkeeping at trace time / eager only
        self.observation = observation
        self.num_heads = site.num_heads
        self.stats = False  # probe step: statistics pass
        self.shadow = False  # shadow step
        self.route = False  # the layer runs on our kernels
        self.stabilize = site.stabilize
        self.counts: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.beta, self.eps = observation.beta, observation.eps
        self.high_precision_delta = False  # the paper's control on this layer's routed calls (research)
        self.on_error: Optional[Callable[[str, BaseException], None]] = None
        self.sdpa_calls = 0  # eager only: attention calls seen (SDPA, FlexAttention), to find a forward without any
        self._in_other = False  # inside a FlexAttention or varlen call's statistics (their own calls pass through)
        self.mha_forward: Optional[Callable] = None  # nn.MultiheadAttention's function for this layer (observe.mha)
        # a routed layer's evaluation forwards go through this twin: the same routing, nothing observed (Observation)
        self.evaluation: Optional["SdpaObserver"] = None

    # an observer belongs to the one module it watches: a copy of that module (copy.deepcopy, a pickle) gets None
    # in its place, and runs unwatched (observation.OBSERVER_ATTR)
    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return _no_observer, ()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self._sdpa(args, kwargs)
        if self._in_other:  # the statistics' own calls
            return func(*args, **kwargs)
        if func is FLEX_OP and FLEX_OP is not None:
            return self._flex(func, args, kwargs)
        if func is VARLEN_OP and VARLEN_OP is not None:
            return self._varlen(func, args, kwargs)
        if func is MHA_FORWARD:
            return mha_call(self, func, args, kwargs)
        if func is TENSOR_UNFLATTEN and torch.compiler.is_compiling():
            return unflatten(func, args, kwargs)
        return func(*args, **kwargs)

    # -- bookkeeping: the reason noted once; on probe steps, a device add for the count
    def count(self, kind: str, reason: str) -> None:
        """A call met ``reason`` (of ``kind``): noted once; on probe steps its count row is incremented."""
        if torch.compiler.is_compiling():
            _note(self.group, kind, reason)
        else:
            self.observation.note(self.site, kind, reason)
        if self.counts is not None and (self.stats or self.shadow):
            self.counts[COUNT_ROW[KIND_ROW[kind]]] += 1

    def _sdpa(self, args, kwargs):
        try:
            call = SdpaCall.parse(args, kwargs)
        except TypeError:
            return _SDPA(*args, **kwargs)  # PyTorch reports the bad call
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self.sdpa_calls += 1
        watching = self.stats or self.shadow
        if not (watching or self.route):
            return _SDPA(*args, **kwargs)
        why = call.unobservable(self.num_heads)
        if why is None:
            # before any buffer is read: under torch.compile this runs at trace time (the buffers
            # the graph then reads are the ones on the call's device)
            why = follow_device(self.group, call.q.device)
        if why is not None:
            if self.route:
                self.count(NOT_APPLIED, why)
            if watching:
                self.count(UNOBSERVED, why)
            return _SDPA(*args, **kwargs)
        if self.route:  # what the call computes with; our kernels differentiate through the cast
            q, k, v, mask = call.computed()
        else:
            with torch.no_grad():
                q, k, v, mask = call.computed()
        o, seed = self._routed(call, q, k, v, mask) if self.route else (None, None)
        if o is None:
            o = _SDPA(*args, **kwargs)  # the user's call, exactly as without the watch
        if not watching:
            return o
        scale = float(call.scale) if call.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        try:
            if self.stats:
                with torch.no_grad(), no_autocast(q.device.type):
                    attention_stats(q, k, mask, o, self.counts, self.values, causal=bool(call.is_causal),
                                    scale=scale, eps=self.eps, group=self.group)
                    self.counts[COUNT_ROW["observed_calls"]] += 1
            if self.shadow:
                if call.dropout_p and seed is None:
                    self.count(SHADOW_SKIPPED, "dropout")  # PyTorch's keep mask cannot be regenerated
                elif o.requires_grad:
                    o = ShadowTap.apply(
                        o, q.detach(), k.detach(), v.detach(), None if mask is None else mask.detach(),
                        self.counts, self.values, bool(call.is_causal), scale,
                        None if compiling or self.on_error is None else self._statistics_failed,
                        float(call.dropout_p) if seed is not None else 0.0, seed, self.group,
                    )
        except Exception as exc:  # noqa: BLE001 - fail open: the user's output stands
            if self.on_error is None or compiling:
                raise
            self.on_error("statistics", exc)
        return o

    def _flex(self, func, args, kwargs):
        """A FlexAttention call (the ``flex_attention`` op, eager or compiled): run as the user called it;
        on probe steps its statistics on the call's own scores (:mod:`~instability_watch.kernels.stats.flex`),
        on shadow steps the shadow pass against the call in float32."""
        return self._other(func, args, kwargs, FlexCall, "FlexAttention", flex_stats)

    def _varlen(self, func, args, kwargs):
        """A packed call of ``varlen_attn`` (the ``_varlen_attn`` op): run as the user called it; on probe
        steps its statistics and on shadow steps its shadow pass, document by document
        (:mod:`~instability_watch.kernels.stats.varlen`)."""
        return self._other(func, args, kwargs, VarlenCall, "varlen_attn", varlen_stats)

    def _other(self, func, args, kwargs, parser, name: str, stats):
        """An attention call other than SDPA's: the call itself untouched, then its statistics and its shadow
        tap; what cannot be done (switching it, a call the statistics cannot read) is counted with its reason."""
        if torch.compiler.is_compiling():  # e.g. Hugging Face compiles its flex calls inside an eager forward
            traced(self.group, "compiled_calls")
        else:
            self.sdpa_calls += 1
            if parser is FlexCall and _replayed(args, kwargs):
                return func(*args, **kwargs)  # a compiled graph's own call: this handler ran when it was traced
        watching = self.stats or self.shadow
        if not (watching or self.route):
            return func(*args, **kwargs)
        try:
            call = parser.parse(args, kwargs)
        except TypeError:
            return func(*args, **kwargs)  # PyTorch reports the bad call
        why = call.unobservable(self.num_heads)
        if why is None:
            why = follow_device(self.group, call.q.device)
        out = None
        if self.route:
            if why is not None:
                self.count(NOT_APPLIED, why)
            elif parser is VarlenCall:
                out = self.varlen_routed(call)
            else:
                out = self._flex_routed(call)
        if out is None:
            out = func(*args, **kwargs)  # the user's call, exactly as without the watch
        if why is not None:
            if watching:
                self.count(UNOBSERVED, why)
            return out
        self._in_other = True
        # a packed batch's documents kept for the step's other layers (forgotten at every step), eager calls only
        keep = parser is VarlenCall and not torch.compiler.is_compiling()
        token = KEEP_DOCUMENTS.set(True) if keep else None
        try:
            sdpa = mask_inputs(call) if parser is FlexCall and (self.stats or self.shadow) else None
            if self.stats:
                if sdpa is not None:  # flex.VIA_MASK: SDPA's pass over the call's mask
                    attention_stats(*sdpa[:2], sdpa[3], out[0], self.counts, self.values, causal=False,
                                    scale=sdpa[4], eps=self.eps, group=self.group)
                else:
                    stats(call, out[0], self.counts, self.values, eps=self.eps)
                self.counts[COUNT_ROW["observed_calls"]] += 1
            if self.shadow and out[0].requires_grad:
                on_error = None if torch.compiler.is_compiling() or self.on_error is None else self._statistics_failed
                if sdpa is not None:
                    q, k, v, keep, scale = sdpa
                    tapped = ShadowTap.apply(out[0], q, k, v, keep, self.counts, self.values, False, scale, on_error,
                                             0.0, None, self.group)
                elif parser is FlexCall:
                    o_hp, live = flex_shadow_forward(call)
                    tapped = FlexShadowTap.apply(out[0], o_hp, live, self.counts, self.values, on_error)
                else:
                    cu_k = call.cu_seq_k if call.cu_seq_k is not None else call.cu_seq_q
                    tapped = VarlenShadowTap.apply(out[0], call.q.detach(), call.k.detach(), call.v.detach(),
                                                   call.cu_seq_q, cu_k, call.is_causal, call.scale, call.window,
                                                   self.counts, self.values, on_error, keep)
                out = (tapped, *out[1:])
        except Exception as exc:  # noqa: BLE001 - fail open: the user's output stands
            if self.on_error is None or torch.compiler.is_compiling():
                raise
            self.on_error("statistics", exc)
        finally:
            self._in_other = False
            if token is not None:
                KEEP_DOCUMENTS.reset(token)
        return out

    def _flex_routed(self, call: FlexCall):
        """A switched layer's FlexAttention call on our kernels, its mask evaluated from its ``mask_mod``
        (the op's outputs ``(out, lse, max_scores)``), or None: it stays on FlexAttention, reason counted."""
        # what the call computes in: FlexAttention's autocast rule (the autocast dtype for all three), else q's
        device = call.q.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else call.q.dtype
        q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (call.q, call.k, call.v))
        reason = switch_refusal(call)
        if reason is None:
            reason = unsupported(q, k, v, scale=call.scale, enable_gqa=True)
        if reason is not None:
            self.count(NOT_APPLIED, reason)
            return None

        def run():
            with no_autocast(device):
                keep = keep_mask(call)
                return flash_attention(q, k, v, attn_mask=keep, scale=float(call.scale),
                                       stabilize=self.stabilize, beta=self.beta, eps=self.eps,
                                       high_precision_delta=self.high_precision_delta, return_lse=True)

        out = self._on_our_kernels(run)
        return None if out is None else op_outputs(call, *out)

    def varlen_routed(self, call: VarlenCall):
        """A switched layer's varlen call on our kernels, over its documents (the op's outputs: ``(o, lse,
        rng_state)``), or None: it stays on PyTorch's, reason counted."""
        reason = unsupported(call.q.transpose(0, 1)[None], call.k.transpose(0, 1)[None],
                             call.v.transpose(0, 1)[None], enable_gqa=True)
        if reason is not None:
            self.count(NOT_APPLIED, reason)
            return None
        kw = dict(window=call.window, scale=call.scale, stabilize=self.stabilize, beta=self.beta, eps=self.eps,
                  return_lse=True, high_precision_delta=self.high_precision_delta)
        def run():
            if torch.compiler.is_compiling():  # traced (Dynamo cannot set a context variable): the op body finds them
                return flash_attention_varlen(call.q, call.k, call.v, call.cu_seq_q, call.cu_seq_k, **kw)
            with keeping_documents():  # the documents kept for the step's other layers (forgotten each step)
                return flash_attention_varlen(call.q, call.k, call.v, call.cu_seq_q, call.cu_seq_k, **kw)

        out = self._on_our_kernels(run)
        if out is None:
            return None
        o, lse = out
        return o, lse, torch.zeros(2, dtype=torch.uint64, device=o.device)

    def _on_our_kernels(self, run: Callable):
        """``run()``, a switched layer's call on our kernels: traced as it is under torch.compile; eagerly
        with the watch's error handler set (a failure, in this forward or in its backward, is reported once and
        the call goes back to PyTorch's: None here); a kernel call counted on probe steps."""
        if torch.compiler.is_compiling():  # traced: no error handling around the op
            out = run()
        else:
            token = ERROR_HANDLER.set(None if self.on_error is None else self._routing_failed)
            try:
                out = run()
            except Exception as exc:  # noqa: BLE001 - fail open: this call goes to PyTorch's
                if self.on_error is None:
                    raise
                self.on_error("routing", exc)
                return None
            finally:
                ERROR_HANDLER.reset(token)
        if self.counts is not None and (self.stats or self.shadow):
            self.counts[COUNT_ROW["kernel_calls"]] += 1
        return out

    def _statistics_failed(self, exc: BaseException) -> None:
        self.on_error("statistics", exc)

    def _routing_failed(self, exc: BaseException) -> None:
        self.on_error("routing", exc)

    def _routed(self, call: SdpaCall, q, k, v, mask) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(o, seed)``: the call on our kernels (inputs in the autocast dtype) and its dropout seed (``None``
        without dropout), or ``(None, None)``: it stays on PyTorch, reason counted."""
        reason = unsupported(q, k, v, attn_mask=mask, dropout_p=call.dropout_p, is_causal=bool(call.is_causal),
                             scale=call.scale, enable_gqa=call.enable_gqa)
        if reason is not None:
            self.count(NOT_APPLIED, reason)
            return None, None
        # dropout: the seed drawn here, from the device's default generator as the SDPA call it replaces
        # would draw, so the shadow pass can regenerate the same keep mask
        seed = dropout_seed(None, q.device) if call.dropout_p else None
        o = self._on_our_kernels(lambda: self._kernel(call, q, k, v, mask, seed))
        return (None, None) if o is None else (o, seed)

    def _kernel(self, call: SdpaCall, q, k, v, mask, seed) -> torch.Tensor:
        # dropout's seed comes from the device's default generator, as for the SDPA call it replaces
        with no_autocast(q.device.type):
            return flash_attention(q, k, v, attn_mask=mask, dropout_p=float(call.dropout_p),
                                   causal=bool(call.is_causal), scale=call.scale, stabilize=self.stabilize,
                                   beta=self.beta, eps=self.eps, seed=seed,
                                   high_precision_delta=self.high_precision_delta)


def _no_observer() -> None:
    """What a pickled observer loads as: none (see ``SdpaObserver.__reduce__``)."""
    return None


def _replayed(args, kwargs) -> bool:
    """A FlexAttention op call made by a compiled graph as it runs (its ``score_mod`` is the graph's traced
    module, not a function of the user's): even an eager ``flex_attention`` is traced (with Dynamo's eager
    backend), and that trace already holds this handler's work."""
    score_mod = args[3] if len(args) > 3 else kwargs.get("score_mod")
    return isinstance(score_mod, torch.fx.GraphModule)


@torch._dynamo.assume_constant_result
def entered(key: Optional[int]) -> Optional[int]:
    """The observer ``key``'s layer forward begins (None: it ended); returns the key it replaces. Called by the
    layer's wrapper, eagerly, or at trace time where the wrapper is compiled."""
    previous = _CURRENT[0]
    _CURRENT[0] = key
    return previous


def _current_site(observation):
    """The site of the layer whose forward is running, if it belongs to ``observation``."""
    observer = _OBSERVERS.get(_CURRENT[0]) if _CURRENT[0] is not None else None
    return observer.site if observer is not None and observer.observation is observation else None


def _compiled_pass_failed(group: int, exc: BaseException) -> bool:
    """A statistics or shadow pass failed inside a compiled graph (its op has no caller's try/except around
    it): the watch ``group`` reports it and turns its statistics off (``strict``: raises); False if no
    such watch is left."""
    observation = _GROUPS.get(group)
    if observation is None or observation.on_error is None:
        return False
    observation.on_error("statistics", exc)
    return True


_stats_kernels.COMPILED_FAILURE = _compiled_pass_failed


@torch._dynamo.assume_constant_result
def traced(group: int, what: str) -> int:
    """The watch ``group``'s ``what`` is being compiled (runs at trace time, once a graph): ``"compiled_calls"``
    (an attention call) or ``"compiled_forwards"`` (a watched layer's forward), set True on its observation."""
    observation = _GROUPS.get(group)
    if observation is not None:
        setattr(observation, what, True)
    return 0


@torch._dynamo.assume_constant_result
def _note(group: int, kind: str, reason: str) -> int:
    """Record ``reason`` (once; logged once) at trace time: for the layer being traced where its wrapper said
    which, else for the watch (a graph every layer shares)."""
    observation = _GROUPS.get(group)
    if observation is not None:
        observation.note(_current_site(observation), kind, reason)
    return 0


@torch._dynamo.assume_constant_result
def follow_device(group: int, device: torch.device) -> Optional[str]:
    """Bring the watch to ``device`` if the model was moved there; else why this call cannot be watched.

    Eager code: called directly by eager calls, and run by Dynamo at trace time
    (``assume_constant_result``) for compiled ones.
    """
    observation = _GROUPS[group]
    if observation.bank.device == device:
        return None
    if param_device(observation.model) != device:
        return f"layer on {device}, apart from the model's other layers"
    observation.relocate(device)  # the model was moved after attaching
    return None


def param_device(model: nn.Module) -> torch.device:
    """Where ``model``'s first parameter lives (the CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
