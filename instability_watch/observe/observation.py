"""The watched layers of one model: their probes, ``stabilize`` masks and observers, installed only when needed.

* **Between probe steps** a layer with no switched head is left alone: its
  ``forward`` is the module's own (nothing is installed, nothing runs).
* **On probe steps** (and always on a switched layer) the layer's ``forward``
  runs inside its observer (:class:`~instability_watch.observe.sdpa.SdpaObserver`),
  which observes or routes its attention calls.
* ``W_Q`` of each layer is read here for sigma(W_Q) (:meth:`Observation.grams`),
  whole on every rank however it is sharded.

Only calls made while the module is in training mode are observed. Coverage:
:mod:`~instability_watch.observe.coverage`.
"""
from __future__ import annotations

import logging
import types
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from instability_watch.kernels.common import DEFAULT_BETA, DEFAULT_EPS
from instability_watch.model.layer import AttentionLayer, without_sdpa
from instability_watch.model.sharding import each_in_its_unit, fsdp1_pieces, whole_params, whole_plan, with_params
from instability_watch.observe.coverage import (KIND_ROW, NOT_APPLIED, SHADOW_SKIPPED, UNOBSERVED, LayerCoverage,
                                                layer_coverage)
from instability_watch.observe import flash_attn
from instability_watch.observe.sdpa import SdpaObserver, entered, param_device, traced
from instability_watch.probe.bank import ProbeBank
from instability_watch.probe.spectral import gram
from instability_watch.ranks import log_rank_zero


class GatheredReadError(RuntimeError):
    """Reading a layer's ``W_Q`` inside an FSDP1 gather failed (the rest of the gathers were still taken part in)."""

    def __init__(self, layer: str, exc: BaseException, rest: int) -> None:
        super().__init__(f"reading W_Q of layer {layer} inside its FSDP gather failed: {exc!r} "
                         f"(this rank still took part in the {rest} gathers after it)")



# ----------------------------------------------------------------------------- layers


@dataclass
class Site:
    """One watched layer: its probe, its ``stabilize`` mask and observer."""

    index: int
    layer: AttentionLayer
    stabilize: torch.Tensor
    observer: Optional[SdpaObserver] = field(default=None, repr=False)
    routed: bool = False  # runs on our kernels (a head switched, or asked for)
    high_precision_delta: bool = False  # routed calls' backward takes delta from a float32 O (research)
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


# the attribute of a watched module that holds its observer while the module is armed: the installed forward
# reads it from the module it runs on. Under torch.compile that read is what Dynamo follows, so the observer's
# tensors (probe buffers, the ``stabilize`` mask) become inputs of the graph it makes and one graph compiled for
# several modules of one class (torch.compile per block, torchtitan's regional compilation) reads each module's
# own; a copy of an observed module (an EMA or eval copy, a pickle) holds None there and runs its own forward.
OBSERVER_ATTR = "_instability_watch_observer"
# module -> the observation watching it (armed or not): a module is watched by one watch at a time
_WATCHED: "weakref.WeakKeyDictionary[nn.Module, Observation]" = weakref.WeakKeyDictionary()


def _observed_forward(self: nn.Module, *args, **kwargs):
    observer = getattr(self, OBSERVER_ATTR, None)
    if observer is None:  # a copy of an observed module
        return type(self).forward(self, *args, **kwargs)
    own = observer.site._own
    if not self.training:  # evaluation: not a training step, nothing to observe
        if not observer.route:
            return _forward(self, own, args, kwargs)
        observer = observer.evaluation  # a routed layer's: on our kernels still, through its route-only twin
    if torch.compiler.is_compiling():
        # no per-layer constant read here (it would make a graph per layer): reasons met while tracing are the
        # traced graph's, shared by the layers it serves (Observation.note)
        traced(observer.group, "compiled_forwards")
        with observer:
            return _forward(self, own, args, kwargs)
    before = observer.sdpa_calls
    previous = entered(observer.key)
    hooked = None
    try:
        hooked = flash_attn.hook(observer)  # FA4's calls, where FA4 is imported (observe.flash_attn)
        with observer:
            out = _forward(self, own, args, kwargs)
    finally:
        if hooked is not None:
            flash_attn.unhook(hooked)
        entered(previous)
    if (observer.sdpa_calls == before and not observer.observation.compiled_calls and observer.stats
            and self.training):
        observer.count(UNOBSERVED, "no attention call the watch can see (F.scaled_dot_product_attention, "
                                    "FlexAttention, varlen_attn, flash_attn.cute) in the layer's forward "
                                    "(attention computed another way, e.g. attn_implementation='eager')")
    return out


# a bound method pickles as getattr(its object, its function's name): named "forward", a pickled armed module loads
# with its class's forward (unwatched), as a deep copy runs
_observed_forward.__name__ = "forward"


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
        bank: the layers' probes (:class:`~instability_watch.probe.bank.ProbeBank`).
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
        self._pieces: dict = {}  # FSDP1: id(parameter) -> its piece in this rank's flat shard (model.sharding)
        self._pieces_key: Optional[tuple] = None
        self.beta, self.eps = float(beta), float(eps)
        self.on_error: Optional[Callable[[str, BaseException], None]] = None
        self.on_note: Optional[Callable[[Site, str, str], None]] = None
        # reasons met by compiled calls that several layers share (see note), and whether any attention call
        # of this watch was compiled inside an eager layer forward (such a layer's calls cannot be counted there)
        self.shared_reasons: Dict[str, List[str]] = {}
        self.compiled_calls = False
        self.compiled_forwards = False  # a watched layer's forward was compiled (sdpa.traced)
        # this watch's key for the observers' trace-time helpers (sdpa.py): one its model's last watch gave back, or
        # None (the first observer takes a new one)
        self.group_key: Optional[int] = take_group(self)
        self._stats = self._shadow = False
        self._collect = True
        self._routing = True
        device = param_device(model)
        self.bank = ProbeBank([layer.num_heads for layer in layers], device)
        self.sites: List[Site] = []
        try:
            for i, layer in enumerate(layers):
                if layer.module in _WATCHED or any(layer.module is s.layer.module for s in self.sites):
                    raise ValueError(f"layer {layer.name!r} is already watched; detach that watch first")
                site = Site(i, layer, torch.zeros(layer.num_heads, dtype=torch.bool, device=device))
                site.observer = SdpaObserver(site, self)
                site.observer.evaluation = SdpaObserver(site, self)
                site._own = layer.module.__dict__.get("forward")  # an instance-level forward the user set, if any
                site._bound = types.MethodType(_observed_forward, layer.module)  # one object: no recompiles
                self.sites.append(site)
            self._check_implementations()
        except BaseException:
            give_back_group(self)  # not attached: its key goes to the model's next watch
            raise
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
            self.note(site, UNOBSERVED, f"{setting} does not call F.scaled_dot_product_attention")

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
            ob.high_precision_delta = site.high_precision_delta
            ob.on_error = self.on_error
            ev = ob.evaluation  # evaluation forwards: the same routing, nothing observed
            ev.counts, ev.values, ev.stabilize, ev.route = ob.counts, ob.values, ob.stabilize, ob.route
            ev.beta, ev.eps, ev.on_error = ob.beta, ob.eps, ob.on_error
            ev.high_precision_delta = ob.high_precision_delta

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
            setattr(module, OBSERVER_ATTR, site.observer)
            module.forward = site._bound
        else:
            module.__dict__.pop(OBSERVER_ATTR, None)
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
        give_back_group(self)  # the model's next watch takes this one's key, and the graphs compiled for it

    def relocate(self, device: torch.device) -> None:
        """Move probes and masks to the device the layers run on (once, e.g. after ``model.to``)."""
        self.bank.to(device)
        for site in self.sites:  # from the meta device (a model materialized after attaching): none switched
            site.stabilize = (torch.zeros_like(site.stabilize, device=device) if site.stabilize.is_meta
                              else site.stabilize.to(device))
        self._sync()

    def note(self, site: Optional[Site], kind: str, reason: str, *, log: bool = True) -> None:
        """``site`` met ``reason`` (of ``kind``): recorded and logged the first time, then handed to ``on_note``.

        ``site`` None: a call compiled once and shared by several layers (a compiled attention function inside
        eager layer forwards, as Hugging Face compiles its FlexAttention call) met it; the reason is recorded for
        the watch and read by every layer whose count has no reason of its own."""
        seen = (site.reasons if site is not None else self.shared_reasons).setdefault(kind, [])
        if reason in seen:
            return
        seen.append(reason)
        what = {UNOBSERVED: "cannot be observed", SHADOW_SKIPPED: "get no shadow pass",
                NOT_APPLIED: "stay on PyTorch's attention although a head is switched"}[kind]
        where = f"layer {site.name}" if site is not None else "compiled attention calls"
        if log:
            log_rank_zero(logging.WARNING, "instability_watch: %s: calls %s: %s", where, what, reason)
        if self.on_note is not None and site is not None:
            self.on_note(site, kind, reason)

    # -- switching ---------------------------------------------------------------------

    def route(self, layer: int, on: bool = True, *, high_precision_delta: bool = False) -> None:
        """Run ``layer`` on our kernels (``on``) or on PyTorch's SDPA; its ``stabilize`` mask picks the heads.

        ``high_precision_delta``: the routed calls' backward takes ``delta`` from ``O`` in float32,
        compiled or not (the paper's control experiment, a research tool; see
        :func:`~instability_watch.experimental.high_precision_delta`).
        """
        if not isinstance(high_precision_delta, bool):
            raise TypeError(f"high_precision_delta must be True or False, got {high_precision_delta!r}")
        site = self.sites[layer]
        site.routed = bool(on)
        site.high_precision_delta = high_precision_delta and site.routed
        room_for_routed_layers(sum(s.routed for s in self.sites))
        self.arm(stats=self._stats, shadow=self._shadow)

    def set_stabilized(self, layer: int, head: int, on: bool = True) -> None:
        """Stabilize (or not) one head; the layer is routed onto our kernels from now on."""
        site = self.sites[layer]
        if not 0 <= head < site.num_heads:
            raise ValueError(f"head must be in [0, {site.num_heads}) for layer {site.name}, got {head}")
        site.stabilize[head:head + 1].fill_(bool(on))  # a kernel, not a host-to-device copy
        if on and not site.routed:
            self.route(layer, True, high_precision_delta=site.high_precision_delta)

    def reset_switches(self) -> None:
        """Every head standard and every layer back on PyTorch's SDPA."""
        for site in self.sites:
            site.stabilize.zero_()
            site.routed = site.high_precision_delta = False
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
        (:func:`~instability_watch.probe.spectral.gram`); under FSDP1 the attention modules'
        weights are rebuilt whole with one all-reduce (:func:`~instability_watch.model.sharding.whole_params`),
        or, where that cannot be done, each layer's unit is gathered while its ``W_Q`` is read
        (:mod:`~instability_watch.model.sharding`). A collective when sharded: every rank calls it
        at the same steps.
        """
        roots = [self.model, *self.sharding_roots]
        key = tuple(id(r) for r in roots)
        if self._pieces_key != key:  # FSDP1's pieces of each parameter: found once per set of roots
            self._pieces, self._pieces_key = fsdp1_pieces(roots), key
        # built-in locators read W_Q from the attention module's own weights, which whole_params rebuilds
        plan = whole_plan([site.layer.module for site in self.sites], self._pieces) \
            if self._pieces and all(site.layer.family for site in self.sites) else None
        if plan is not None:
            out, failed = [], None
            for group in plan:
                # every rank takes part in every group's all-reduce with its pieces, also after a failure here
                # (the others' copies need them)
                whole = whole_params(group)
                for (i, _), params in zip(group, whole):
                    if failed is not None:
                        continue
                    site = self.sites[i]
                    try:
                        with with_params(site.layer.module, params):
                            out.append(gram(self._w_q(site)))
                    except Exception as exc:  # noqa: BLE001
                        failed = (i, exc)
            if failed is not None:
                i, exc = failed
                rest = sum(1 for group in plan if group[0][0] > i)
                raise GatheredReadError(self.sites[i].name, exc, rest) from exc
            return out
        out: List[torch.Tensor] = []
        failed = each_in_its_unit([site.layer.module for site in self.sites], [self.model, *self.sharding_roots],
                                  lambda i: out.append(gram(self._w_q(self.sites[i]))))
        if failed is not None:
            i, exc, gathered = failed
            if not gathered:
                raise exc
            raise GatheredReadError(self.sites[i].name, exc, len(self.sites) - i - 1) from exc
        return out

    def claim_shared_reasons(self, calls: Sequence[Dict[str, int]]) -> None:
        """After a read-back: a layer whose calls of a kind were counted (``calls``: per layer, row -> total) but
        which has no reason of that kind of its own takes the compiled graphs' (recorded while tracing a graph that
        layers share, see :meth:`note`), as if it had met them: a switch not applied is then an event and its head
        is not reported as stabilized. Not logged again (the graph's reason was)."""
        if not self.shared_reasons:
            return
        for site, c in zip(self.sites, calls):
            for kind, rs in list(self.shared_reasons.items()):
                if c.get(KIND_ROW[kind], 0) and not site.reasons.get(kind):
                    for reason in list(rs):
                        self.note(site, kind, reason, log=False)

    def coverage(self, calls: Sequence[Dict[str, int]]) -> List[LayerCoverage]:
        """One :class:`LayerCoverage` per layer from ``calls`` (per layer: call row name -> total read back)."""
        def reasons(site: Site) -> Dict[str, List[str]]:
            merged = {kind: list(rs) for kind, rs in site.reasons.items()}
            for kind, rs in self.shared_reasons.items():
                merged.setdefault(kind, []).extend(r for r in rs if r not in merged[kind])
            return merged

        return [layer_coverage(site.name, reasons(site), c) for site, c in zip(self.sites, calls)]


# Group keys given back by detached watches, per model: key -> what tracing recorded for that watch. A watch's key is
# a constant of every graph traced for it (Dynamo guards on it: sdpa.traced, follow_device, the statistics ops'
# ``group``), so a new watch of the same model takes the lowest key given back and the graphs compiled for it serve
# the new watch too: a new watch per round or per fit (the overhead benchmark's kind rounds) would otherwise compile
# Hugging Face's FlexAttention again each time, and past Dynamo's recompile limit (8) FlexAttention runs its
# unfused eager path. Those graphs' trace-time bookkeeping (sdpa.traced, _note) does not run again: the new watch
# takes it over. Per model: another model's facts (e.g. "its calls were compiled") would be wrong for this one.
_GIVEN_BACK: "weakref.WeakKeyDictionary[nn.Module, Dict[int, tuple]]" = weakref.WeakKeyDictionary()


def take_group(observation: "Observation") -> Optional[int]:
    """A new watch's group key: the lowest one a detached watch of the same model gave back (with what its graphs'
    tracing recorded: compiled calls and forwards, the shared reasons), else None (its first observer takes a new
    key)."""
    given = _GIVEN_BACK.get(observation.model)
    if not given:
        return None
    key = min(given)
    observation.compiled_calls, observation.compiled_forwards, reasons = given.pop(key)
    observation.shared_reasons.update(reasons)
    return key


def give_back_group(observation: "Observation") -> None:
    """``observation`` detached: its key, and what tracing recorded for it, go to the model's next watch."""
    if observation.group_key is None:  # no observer: no key taken
        return
    _GIVEN_BACK.setdefault(observation.model, {})[observation.group_key] = (
        observation.compiled_calls, observation.compiled_forwards,
        {kind: list(rs) for kind, rs in observation.shared_reasons.items()})


# Each layer routed onto our kernels adds, under torch.compile, up to four variants of the compiled forward (a
# plain step, a probe step, a probe and shadow step, and an evaluation forward, with that layer routed). Past
# Dynamo's recompile limit (8) the forward runs uncompiled for the rest of the run (seen at the paper's scale: 17-19%
# fewer steps/s from the third switched layer on), or, compiled with fullgraph=True, the step fails. The limit is
# raised by that much per routed layer, over what it was when the first layer was routed (a limit set lower on
# purpose is raised too; the log says so once).
VARIANTS_PER_ROUTED_LAYER = 4
_LIMIT_BASE: List[int] = []  # Dynamo's recompile limit before the watch first raised it (this process)


def room_for_routed_layers(routed: int) -> None:
    """Keep Dynamo's recompile limit at least its first value + 4 per routed layer (never lowered; said once)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    current = getattr(config, name, None)
    if not isinstance(current, int):
        return
    if not _LIMIT_BASE:
        _LIMIT_BASE.append(current)
    want = _LIMIT_BASE[0] + VARIANTS_PER_ROUTED_LAYER * routed
    if want <= current:
        return
    setattr(config, name, want)
    if len(_LIMIT_BASE) == 1:
        _LIMIT_BASE.append(want)  # said once a process
        log_rank_zero(logging.INFO, "instability_watch: raised torch._dynamo.config.%s from %d to %d (and by %d for "
                      "each further switched layer): under torch.compile each layer switched onto our kernels adds "
                      "up to %d variants of the compiled forward, and past the limit it would run uncompiled",
                      name, current, want, VARIANTS_PER_ROUTED_LAYER, VARIANTS_PER_ROUTED_LAYER)


def observe(model: nn.Module, layers: Sequence[AttentionLayer], *, beta: float = DEFAULT_BETA,
            eps: float = DEFAULT_EPS) -> Observation:
    """Prepare ``layers`` of ``model`` for observation (nothing is installed until :meth:`Observation.arm`).

    Each layer gets a :class:`Probe` (int64 ``counts`` and float32 ``values``, one column
    per query head) and a bool ``(H,)`` ``stabilize`` mask on the model's device;
    ``beta`` and ``eps`` are the stabilized kernel's shift factor and tie tolerance.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return Observation(model, layers, beta=beta, eps=eps)
