"""Observe each watched layer's attention; replace it only where a head is switched.

The user's ``F.scaled_dot_product_attention`` call runs exactly as without the
watch: same function, arguments, autocast, backend and random numbers. The
watch only looks, and only on the steps it was asked to:

* **Between probe steps** a layer with no switched head is left alone: its
  ``forward`` is the module's own (nothing is installed, nothing runs).
* **On probe steps** the layer's ``forward`` runs inside a ``TorchFunctionMode``
  (:class:`_Observer`) that catches its SDPA calls. Each call is first run by
  PyTorch; then the statistics pass (:mod:`~instability_watch.kernels.stats`)
  reads the same ``q, k, attn_mask`` *in the dtype the call computes in*
  (autocast's rule for SDPA applied: floating tensors other than float64 are
  cast to the autocast dtype) and the output, with autocast disabled, and adds
  per-head counts into the layer's probe.
* **On shadow steps** (a subset of probe steps) the output also goes through
  :class:`_ShadowTap`, an autograd node whose backward hands the gradient back
  unchanged and runs the shadow pass on ``dO``. The user's calls with dropout
  get no shadow (their keep mask is PyTorch's, which the pass cannot
  regenerate); they are counted. Calls with dropout on our kernels (a switched
  layer) are shadowed with their own keep mask (the seed is drawn here and
  handed to the kernel).
* **Switched layers** (a head moved to the stabilized kernel) run every call on
  :func:`~instability_watch.flash_attention`, standard for the other heads and
  stabilized for the switched ones, with autocast's rule applied to the
  inputs, the call's mask and its dropout (seeded from the device's default
  generator, as the SDPA call it replaces). A call the kernels cannot serve
  (e.g. a head dim above 256, float64 under autocast) stays on PyTorch; the
  layer's switch is then reported as not applied, with the reason.

Only calls made while the module is in training mode are observed.

Coverage is counted on the device, in the probe's call rows (see
``probe.CALL_FIELDS``), so it is exact in eager and compiled code alike and costs
no host sync: observed calls, shadowed calls, calls that could not be observed,
shadows skipped, calls on our kernels, and switched calls that stayed on
PyTorch. Each reason is recorded once per layer (at trace time under
``torch.compile``) and logged once.
"""
from __future__ import annotations

import itertools
import logging
import math
import types
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ._dist import log_rank_zero
from ._sharding import fsdp1_units, full_params, innermost_unit
from .kernels import dropout_seed, flash_attention, unsupported
from .kernels.ops import ERROR_HANDLER
from .kernels.stats import attention_shadow, attention_stats
from .locate import AttentionLayer, without_sdpa
from .probe import COUNT_FIELDS, ProbeBank
from .spectral import gram

_SDPA = F.scaled_dot_product_attention
_MHA_FORWARD = F.multi_head_attention_forward
_ROW = {name: i for i, name in enumerate(COUNT_FIELDS)}

# What a reason is about: each kind has its call-count row in the probe.
UNOBSERVED, SHADOW_SKIPPED, NOT_APPLIED = "unobserved", "shadow_skipped", "not_applied"
_KIND_ROW = {UNOBSERVED: "unobserved_calls", SHADOW_SKIPPED: "shadow_skipped_calls", NOT_APPLIED: "fallback_calls"}


@dataclass(frozen=True)
class LayerCoverage:
    """What the watch saw of one layer's attention calls (training-mode calls on probe steps).

    Attributes:
        layer_name: the layer.
        observed_calls: calls whose statistics were taken.
        unobserved_calls: calls that could not be observed, by reason.
        shadow_calls: calls whose backward ran the shadow pass.
        shadow_skipped: calls on shadow steps without a shadow, by reason (dropout).
        kernel_calls: calls run on our kernels (a switched layer).
        not_applied: calls of a switched layer that stayed on PyTorch's SDPA, by reason.

    Counts are summed over ranks under ``torch.distributed``. Where one count
    has several reasons, the reasons are joined with ``" | "``.
    """

    layer_name: str
    observed_calls: int = 0
    unobserved_calls: Dict[str, int] = field(default_factory=dict)
    shadow_calls: int = 0
    shadow_skipped: Dict[str, int] = field(default_factory=dict)
    kernel_calls: int = 0
    not_applied: Dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The record as plain Python types (what ``meta.json``'s ``coverage`` holds)."""
        return {
            "layer_name": self.layer_name, "observed_calls": self.observed_calls,
            "unobserved_calls": dict(self.unobserved_calls), "shadow_calls": self.shadow_calls,
            "shadow_skipped": dict(self.shadow_skipped), "kernel_calls": self.kernel_calls,
            "not_applied": dict(self.not_applied),
        }


# ----------------------------------------------------------------------------- one SDPA call


@dataclass
class _Call:
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
    def parse(cls, args, kwargs) -> "_Call":
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


def _no_autocast(device_type: str):
    return torch.autocast(device_type, enabled=False)


class _ShadowTap(torch.autograd.Function):
    """Identity on ``o``; its backward runs the shadow pass on ``dO`` and returns ``dO`` unchanged."""

    @staticmethod
    def forward(ctx, o, q, k, v, attn_mask, counts, values, causal, scale, on_error, dropout_p=0.0, seed=None):
        ctx.save_for_backward(o, q, k, v, attn_mask, seed)
        # the probe buffers as attributes, not saved tensors: other forwards add to them
        # before this backward runs, which must not trip autograd's version check
        ctx.buffers = (counts, values)
        ctx.causal, ctx.scale, ctx.on_error, ctx.dropout_p = causal, scale, on_error, dropout_p
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        o, q, k, v, attn_mask, seed = ctx.saved_tensors
        counts, values = ctx.buffers
        try:
            with torch.no_grad(), _no_autocast(q.device.type):
                attention_shadow(q, k, v, o, do, attn_mask, counts, values, causal=ctx.causal, scale=ctx.scale,
                                 dropout_p=ctx.dropout_p, seed=seed)
                counts[_ROW["shadow_calls"]] += 1
        except Exception as exc:  # noqa: BLE001 - monitoring never breaks the backward
            if ctx.on_error is None or torch.compiler.is_compiling():
                raise
            ctx.on_error(exc)
        return do, None, None, None, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------- the mode


_OBSERVERS: "weakref.WeakValueDictionary[int, _Observer]" = weakref.WeakValueDictionary()
_observer_keys = itertools.count()


class _Observer(TorchFunctionMode):
    """Entered around one layer's ``forward``: its SDPA calls are observed or routed.

    A call reads only this object's own attributes (flags, probe buffers, the
    ``stabilize`` mask, ``beta``, ``eps``), which :class:`Observation` keeps
    current, never the model: ``torch.compile`` traces a call without reaching
    the model a second time (Dynamo refuses to track one module from two
    places), and flipping a head's mask, a tensor changed in place, never
    recompiles.
    """

    def __init__(self, site: "Site", observation: "Observation") -> None:
        super().__init__()
        self.key = next(_observer_keys)
        _OBSERVERS[self.key] = self
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
        self.on_error: Optional[Callable[[str, BaseException], None]] = None
        self.sdpa_calls = 0  # eager only: calls seen, to find a forward without any

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self._sdpa(args, kwargs)
        if func is _MHA_FORWARD and self.stats:
            self._count(UNOBSERVED, "nn.MultiheadAttention hides its SDPA call in F.multi_head_attention_forward")
        return func(*args, **kwargs)

    # -- bookkeeping: the reason noted once; on probe steps, a device add for the count
    def _count(self, kind: str, reason: str) -> None:
        _note(self.key, kind, reason)
        if self.counts is not None and (self.stats or self.shadow):
            self.counts[_ROW[_KIND_ROW[kind]]] += 1

    def _sdpa(self, args, kwargs):
        try:
            call = _Call.parse(args, kwargs)
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
            why = _follow_device(self.key, call.q.device)
        if why is not None:
            if self.route:
                self._count(NOT_APPLIED, why)
            if watching:
                self._count(UNOBSERVED, why)
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
                with torch.no_grad(), _no_autocast(q.device.type):
                    attention_stats(q, k, mask, o, self.counts, self.values, causal=bool(call.is_causal),
                                    scale=scale, eps=self.eps)
                    self.counts[_ROW["observed_calls"]] += 1
            if self.shadow:
                if call.dropout_p and seed is None:
                    self._count(SHADOW_SKIPPED, "dropout")  # PyTorch's keep mask cannot be regenerated
                elif o.requires_grad:
                    o = _ShadowTap.apply(
                        o, q.detach(), k.detach(), v.detach(), None if mask is None else mask.detach(),
                        self.counts, self.values, bool(call.is_causal), scale,
                        None if compiling or self.on_error is None else self._statistics_failed,
                        float(call.dropout_p) if seed is not None else 0.0, seed,
                    )
        except Exception as exc:  # noqa: BLE001 - fail open: the user's output stands
            if self.on_error is None or compiling:
                raise
            self.on_error("statistics", exc)
        return o

    def _statistics_failed(self, exc: BaseException) -> None:
        self.on_error("statistics", exc)

    def _routing_failed(self, exc: BaseException) -> None:
        self.on_error("routing", exc)

    def _routed(self, call: _Call, q, k, v, mask) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(o, seed)``: the call on our kernels (inputs in the autocast dtype) and its dropout seed (``None``
        without dropout), or ``(None, None)``: it stays on PyTorch, reason counted."""
        reason = unsupported(q, k, v, attn_mask=mask, dropout_p=call.dropout_p, is_causal=bool(call.is_causal),
                             scale=call.scale, enable_gqa=call.enable_gqa)
        if reason is not None:
            self._count(NOT_APPLIED, reason)
            return None, None
        # dropout: the seed drawn here, from the device's default generator as the SDPA call it replaces
        # would draw, so the shadow pass can regenerate the same keep mask
        seed = dropout_seed(None, q.device) if call.dropout_p else None
        if torch.compiler.is_compiling():  # traced: no error handling around the op
            o = self._kernel(call, q, k, v, mask, seed)
        else:
            # where a failure in this call's backward is reported (it then falls back to PyTorch's)
            token = ERROR_HANDLER.set(None if self.on_error is None else self._routing_failed)
            try:
                o = self._kernel(call, q, k, v, mask, seed)
            except Exception as exc:  # noqa: BLE001 - fail open: this call goes to PyTorch
                if self.on_error is None:
                    raise
                self.on_error("routing", exc)
                return None, None
            finally:
                ERROR_HANDLER.reset(token)
        if self.counts is not None and (self.stats or self.shadow):
            self.counts[_ROW["kernel_calls"]] += 1
        return o, seed

    def _kernel(self, call: _Call, q, k, v, mask, seed) -> torch.Tensor:
        # dropout's seed comes from the device's default generator, as for the SDPA call it replaces
        with _no_autocast(q.device.type):
            return flash_attention(q, k, v, attn_mask=mask, dropout_p=float(call.dropout_p),
                                   causal=bool(call.is_causal), scale=call.scale, stabilize=self.stabilize,
                                   beta=self.beta, eps=self.eps, seed=seed)


class GatheredReadError(RuntimeError):
    """Reading a layer's ``W_Q`` inside an FSDP1 gather failed (the rest of the gathers were still taken part in)."""

    def __init__(self, layer: str, exc: BaseException, rest: int) -> None:
        super().__init__(f"reading W_Q of layer {layer} inside its FSDP gather failed: {exc!r} "
                         f"(this rank still took part in the {rest} gathers after it)")


@torch._dynamo.assume_constant_result
def _note(key: int, kind: str, reason: str) -> int:
    """Record ``reason`` for the observer ``key`` (once; logged once). Runs eagerly, at trace time when compiled."""
    observer = _OBSERVERS.get(key)
    if observer is not None:
        observer.observation._note(observer.site, kind, reason)
    return 0


@torch._dynamo.assume_constant_result
def _follow_device(key: int, device: torch.device) -> Optional[str]:
    """Bring the watch to ``device`` if the model was moved there; else why this call cannot be watched.

    Eager code: called directly by eager calls, and run by Dynamo at trace time
    (``assume_constant_result``) for compiled ones.
    """
    observer = _OBSERVERS[key]
    observation = observer.observation
    if observation.bank.device == device:
        return None
    if _param_device(observation.model) != device:
        return f"layer on {device}, apart from the model's other layers"
    observation._relocate(device)  # the model was moved after attaching
    return None


# ----------------------------------------------------------------------------- layers


@dataclass
class Site:
    """One watched layer: its probe, its ``stabilize`` mask and observer."""

    index: int
    layer: AttentionLayer
    stabilize: torch.Tensor
    observer: Optional[_Observer] = field(default=None, repr=False)
    routed: bool = False  # runs on our kernels (a head switched, or asked for)
    armed: bool = False  # its forward goes through the observer now
    reasons: Dict[str, List[str]] = field(default_factory=dict)  # kind -> reasons seen
    _bound: Optional[Callable] = field(default=None, repr=False)
    _own: Optional[Callable] = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """The layer's module name."""
        return self.layer.name

    @property
    def num_heads(self) -> int:
        """The layer's number of query heads ``H`` (the length of ``stabilize``, a bool ``(H,)``)."""
        return self.layer.num_heads


# module -> observer: the installed forward looks its observer up here, so a deepcopy of an
# observed model (an EMA or eval copy) runs its own forward on its own weights, and pickling works.
_OBSERVED: "weakref.WeakKeyDictionary[nn.Module, Tuple[_Observer, Optional[Callable]]]" = weakref.WeakKeyDictionary()
# module -> the observation watching it (armed or not): a module is watched by one watch at a time
_WATCHED: "weakref.WeakKeyDictionary[nn.Module, Observation]" = weakref.WeakKeyDictionary()


def _observed_forward(self: nn.Module, *args, **kwargs):
    entry = _OBSERVED.get(self)
    if entry is None:  # a copy of an observed module
        return type(self).forward(self, *args, **kwargs)
    observer, own = entry
    if not self.training and not observer.route:
        return _forward(self, own, args, kwargs)  # evaluation: not a training step, nothing to observe
    if torch.compiler.is_compiling():
        with observer:
            return _forward(self, own, args, kwargs)
    before = observer.sdpa_calls
    with observer:
        out = _forward(self, own, args, kwargs)
    if observer.sdpa_calls == before and observer.stats and self.training:
        observer._count(UNOBSERVED, "no F.scaled_dot_product_attention call in the layer's forward "
                                    "(attention computed another way, e.g. attn_implementation='eager')")
    return out


def _forward(module: nn.Module, own: Optional[Callable], args, kwargs):
    """The module's own forward: an instance-level one the user set, else its class's."""
    if own is not None:
        return own(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


class Observation:
    """The watched layers of one model: their probes, masks and observers. Created by :func:`observe`.

    Attributes:
        model: the model.
        sites: one :class:`Site` per layer, in module order.
        bank: the layers' probes (:class:`~instability_watch.probe.ProbeBank`).
        beta, eps: the stabilized kernel's shift factor and tie tolerance.
        on_error: called as ``on_error(component, exc)`` when observing a call
            (``"statistics"``: the user's output then stands) or running it on
            our kernels (``"routing"``: the call then goes to PyTorch) fails;
            ``None`` re-raises.
        on_note: called as ``on_note(site, kind, reason)`` the first time a
            layer meets a reason (``"unobserved"``, ``"shadow_skipped"``,
            ``"not_applied"``).
    """

    def __init__(self, model: nn.Module, layers: Sequence[AttentionLayer], *, beta: float, eps: float) -> None:
        self.model = model
        # modules above ``model`` that may hold FSDP1 units wrapping it (e.g. Lightning's
        # FSDPStrategy wraps the LightningModule itself): searched for units too
        self.sharding_roots: List[nn.Module] = []
        self.beta, self.eps = float(beta), float(eps)
        self.on_error: Optional[Callable[[str, BaseException], None]] = None
        self.on_note: Optional[Callable[[Site, str, str], None]] = None
        self._stats = self._shadow = False
        self._collect = True
        self._routing = True
        device = _param_device(model)
        self.bank = ProbeBank([layer.num_heads for layer in layers], device)
        self.sites: List[Site] = []
        for i, layer in enumerate(layers):
            if layer.module in _WATCHED or any(layer.module is s.layer.module for s in self.sites):
                raise ValueError(f"layer {layer.name!r} is already watched; detach that watch first")
            site = Site(i, layer, torch.zeros(layer.num_heads, dtype=torch.bool, device=device))
            site.observer = _Observer(site, self)
            site._own = layer.module.__dict__.get("forward")  # an instance-level forward the user set, if any
            site._bound = types.MethodType(_observed_forward, layer.module)  # one object: no recompiles
            self.sites.append(site)
        self._check_implementations()
        for site in self.sites:
            _WATCHED[site.layer.module] = self
        self.attached = True
        self._sync()

    def _check_implementations(self) -> None:
        """Layers built to compute attention without SDPA cannot be observed: an error if none can.

        E.g. Hugging Face models with ``attn_implementation='eager'`` (see :func:`~.locate.without_sdpa`).
        """
        off = [(s, without_sdpa(s.layer.module, self.model)) for s in self.sites]
        off = [(s, why) for s, why in off if why is not None]
        if off and len(off) == len(self.sites):
            setting, remedy = off[0][1]
            raise ValueError(
                f"the model computes attention with {setting}, without F.scaled_dot_product_attention, "
                f"so no attention call can be observed; {remedy}"
            )
        for site, (setting, _) in off:
            self._note(site, UNOBSERVED, f"{setting} does not call F.scaled_dot_product_attention")

    # -- what the observers read -------------------------------------------------------

    def _sync(self) -> None:
        for site in self.sites:
            ob = site.observer
            probe = self.bank.probes[site.index]
            ob.counts, ob.values = probe.counts, probe.values
            ob.stabilize = site.stabilize
            ob.stats = self._stats and self._collect
            ob.shadow = self._shadow and self._collect
            ob.route = site.routed and self._routing
            ob.beta, ob.eps = self.beta, self.eps
            ob.on_error = self.on_error

    def arm(self, *, stats: bool, shadow: bool) -> None:
        """Set what the next calls do: statistics, shadow; install or remove the layers' observers.

        Only layers that observe or route get an observer; the others keep
        their own ``forward``. Cheap when nothing changes.
        """
        self._stats, self._shadow = bool(stats), bool(shadow)
        self._sync()
        for site in self.sites:
            self._install(site, self.attached and (site.observer.stats or site.observer.shadow or site.observer.route))

    def collect(self, on: bool) -> None:
        """Pause (``False``) or resume observation, e.g. around validation; routing is unaffected."""
        self._collect = bool(on)
        self.arm(stats=self._stats, shadow=self._shadow)

    @property
    def routing(self) -> bool:
        """Whether switched layers may run on our kernels (``False``: every call on PyTorch's SDPA)."""
        return self._routing

    @routing.setter
    def routing(self, on: bool) -> None:
        """``False`` sends every call to PyTorch's SDPA (the fail-open switch for our kernels)."""
        self._routing = bool(on)
        self.arm(stats=self._stats, shadow=self._shadow)

    def _install(self, site: Site, on: bool) -> None:
        if on == site.armed:
            return
        module = site.layer.module
        if on:
            _OBSERVED[module] = (site.observer, site._own)
            module.forward = site._bound
        else:
            _OBSERVED.pop(module, None)
            if site._own is not None:
                module.forward = site._own
            else:
                module.__dict__.pop("forward", None)
        site.armed = on

    def detach(self) -> None:
        """Restore every module's ``forward`` exactly as it was."""
        if not self.attached:
            return
        for site in self.sites:
            self._install(site, False)
            if _WATCHED.get(site.layer.module) is self:
                del _WATCHED[site.layer.module]
        self.attached = False

    def _relocate(self, device: torch.device) -> None:
        """Move probes and masks to the device the layers run on (once, e.g. after ``model.to``)."""
        self.bank.to(device)
        for site in self.sites:  # from the meta device (a model materialized after attaching): none switched
            site.stabilize = (torch.zeros_like(site.stabilize, device=device) if site.stabilize.is_meta
                              else site.stabilize.to(device))
        self._sync()

    def _note(self, site: Site, kind: str, reason: str) -> None:
        seen = site.reasons.setdefault(kind, [])
        if reason in seen:
            return
        seen.append(reason)
        what = {UNOBSERVED: "cannot be observed", SHADOW_SKIPPED: "get no shadow pass",
                NOT_APPLIED: "stay on PyTorch's SDPA although a head is switched"}[kind]
        log_rank_zero(logging.WARNING, "instability_watch: layer %s: calls %s: %s", site.name, what, reason)
        if self.on_note is not None:
            self.on_note(site, kind, reason)

    # -- switching ---------------------------------------------------------------------

    def route(self, layer: int, on: bool = True) -> None:
        """Run ``layer`` on our kernels (``on``) or on PyTorch's SDPA; its ``stabilize`` mask picks the heads."""
        site = self.sites[layer]
        site.routed = bool(on)
        self.arm(stats=self._stats, shadow=self._shadow)

    def set_stabilized(self, layer: int, head: int, on: bool = True) -> None:
        """Stabilize (or not) one head; the layer is routed onto our kernels from now on."""
        site = self.sites[layer]
        if not 0 <= head < site.num_heads:
            raise ValueError(f"head must be in [0, {site.num_heads}) for layer {site.name}, got {head}")
        site.stabilize[head:head + 1].fill_(bool(on))  # a kernel, not a host-to-device copy
        if on and not site.routed:
            self.route(layer, True)

    def reset_switches(self) -> None:
        """Every head standard and every layer back on PyTorch's SDPA."""
        for site in self.sites:
            site.stabilize.zero_()
            site.routed = False
        self.arm(stats=self._stats, shadow=self._shadow)

    # -- introspection -----------------------------------------------------------------

    @property
    def head_counts(self) -> List[int]:
        """The number of query heads of each watched layer, in layer order."""
        return [s.num_heads for s in self.sites]

    def stabilized(self) -> List[List[bool]]:
        """Per layer, which heads run the stabilized kernel (a host sync; not for the hot path)."""
        return [s.stabilize.tolist() if s.routed else [False] * s.num_heads for s in self.sites]

    def w_q(self) -> List[torch.Tensor]:
        """``W_Q`` per layer, each ``(H, head_dim, d_in)``, detached (FSDP2: ``DTensor`` objects; not for FSDP1, see :meth:`grams`)."""
        return [self._w_q(site) for site in self.sites]

    def _w_q(self, site: "Site") -> torch.Tensor:
        w = site.layer.w_q()
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.shape[0] != site.num_heads:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(
                f"w_q() of layer {site.name} must return a tensor (H={site.num_heads}, head_dim, d_in), got {got}"
            )
        return w.detach()

    def grams(self) -> List[torch.Tensor]:
        """``W_Q W_Q^T`` per layer and head, float32 ``(H, D, D)``, whole on every rank however ``W_Q`` is sharded.

        Under FSDP2 the Grams are computed where the rows are and gathered
        (:func:`~instability_watch.spectral.gram`); under FSDP1 each layer's unit is
        gathered while its ``W_Q`` is read (:mod:`~instability_watch._sharding`). A
        collective when sharded: every rank calls it at the same steps.
        """
        units = fsdp1_units([self.model, *self.sharding_roots])
        out = []
        for site in self.sites:
            unit = innermost_unit(site.layer.module, units) if units else None
            with full_params(unit):
                if unit is None:
                    out.append(gram(self._w_q(site)))
                    continue
                # every rank enters every unit's gather (a collective): a failure here must not
                # make this rank skip the next ones, or the others wait for it forever
                try:
                    out.append(gram(self._w_q(site)))
                except Exception as exc:  # noqa: BLE001
                    raise GatheredReadError(site.name, exc, self._finish_gathers(units, site.index + 1)) from exc
        return out

    def _finish_gathers(self, units, start: int) -> int:
        """Enter (and leave) the gathers of the layers from ``start`` on, as the other ranks do; how many."""
        n = 0
        for site in self.sites[start:]:
            with full_params(innermost_unit(site.layer.module, units)):
                n += 1
        return n

    def coverage(self, calls: Sequence[Dict[str, int]]) -> List[LayerCoverage]:
        """One :class:`LayerCoverage` per layer from ``calls`` (per layer: call row name -> total read back)."""
        out = []
        for site, c in zip(self.sites, calls):
            def by_reason(kind: str) -> Dict[str, int]:
                n = int(c.get(_KIND_ROW[kind], 0))
                return {" | ".join(site.reasons.get(kind, ["unknown"])): n} if n else {}

            out.append(LayerCoverage(
                layer_name=site.name, observed_calls=int(c.get("observed_calls", 0)),
                unobserved_calls=by_reason(UNOBSERVED), shadow_calls=int(c.get("shadow_calls", 0)),
                shadow_skipped=by_reason(SHADOW_SKIPPED), kernel_calls=int(c.get("kernel_calls", 0)),
                not_applied=by_reason(NOT_APPLIED),
            ))
        return out


def _param_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def observe(model: nn.Module, layers: Sequence[AttentionLayer], *, beta: float = 2.0, eps: float = 1e-3) -> Observation:
    """Prepare ``layers`` of ``model`` for observation (nothing is installed until :meth:`Observation.arm`).

    Each layer gets a :class:`Probe` (int64 ``counts`` and float32 ``values``, one column
    per query head) and a bool ``(H,)`` ``stabilize`` mask on the model's device;
    ``beta`` and ``eps`` are the stabilized kernel's shift factor and tie tolerance.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return Observation(model, layers, beta=beta, eps=eps)
