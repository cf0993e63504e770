"""``InstabilityWatch``: the framework-free engine, a facade over parts that each do one job.

Use it in any training loop::

    watch = InstabilityWatch(model, WatchConfig(auto_switch=True))
    for batch in data:
        loss = model(batch)            # attention runs as always; on probe steps it is observed
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
        for alert in watch.step(loss): # once per optimizer step
            print(alert.message)
    watch.detach()

At each :meth:`InstabilityWatch.step`:

* on a probe step (every ``probe_every`` steps: 1, 1 + n, ...) every layer's
  probe is copied into one row of the device-side ring (:mod:`~.ring`) and
  reset, with sigma(W_Q) on spectral steps and the loss; nothing leaves the device;
* the next step is armed (:mod:`~.cadence`): observers are installed only for a
  probe step (and kept on layers with switched heads,
  :mod:`~instability_watch.observe`); between probe steps nothing runs;
* every ``log_every`` steps (and once after the first probe step, to check
  coverage) the ring is read back in one transfer, the one host sync, reduced
  across ranks under ``torch.distributed``, turned into per-step metrics
  (:mod:`~.metrics`) and fed to the detectors (:mod:`~instability_watch.detect`);
  the alerts act (:mod:`~instability_watch.act`: switching, QK-clip), and the
  listeners receive a :class:`~.readback.ReadBack`.

Failures inside the watch never stop training (:mod:`~.faults`): the failing
part is reported once with its traceback and turned off, unless ``strict=True``.
"""
from __future__ import annotations

import inspect
import logging
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn

from instability_watch.act.events import Event
from instability_watch.act.qkclip import Clip, QKClipper
from instability_watch.act.switching import Switchboard
from instability_watch.detect.detectors import Alert, Detector, build_detectors
from instability_watch.engine import state as watch_state
from instability_watch.engine.cadence import Cadence, StepCallCheck, check_loss
from instability_watch.engine.config import WatchConfig, config_fields
from instability_watch.engine.faults import Faults
from instability_watch.engine.metrics import CallTotals, MetricsBuilder, StepMetrics, head_shape, summarize
from instability_watch.engine.readback import Listener, ReadBack
from instability_watch.engine.reader import Reader
from instability_watch.engine.recorder import Recorder
from instability_watch.engine.ring import Ring, RingColumns
from instability_watch.errors import NothingObservedError, WatchError, checking_keywords
from instability_watch.kernels.attention.ops import forget_documents
from instability_watch.model.families import qk_projections
from instability_watch.model.layer import Layers, resolve_layers
from instability_watch.observe.coverage import NOT_APPLIED, LayerCoverage
from instability_watch.observe.mha import MHA_REASONS
from instability_watch.observe.observation import Site, observe
from instability_watch.probe.spectral import SpectralNorms
from instability_watch.ranks import distributed, log_rank_zero


def _old_signature(listener, exc: BaseException) -> BaseException:
    """``exc``, or where a listener still takes ``(metrics, alerts, watch)`` a ``TypeError`` that says what changed."""
    if not isinstance(exc, TypeError):
        return exc
    try:
        params = [p for p in inspect.signature(listener).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return exc
    if len(params) != 3:
        return exc
    return TypeError(f"a listener takes one argument, a ReadBack (record.metrics, record.alerts, record.events, ...); "
                     f"this one takes ({', '.join(p.name for p in params)}), the signature before 2026-11-27 ({exc})")


class InstabilityWatch:
    """Watch every attention head of ``model`` while it trains.

    Args:
        model: the model; its code and its attention calls are not changed.
        config: a :class:`WatchConfig` (defaults if ``None``), or a dict of its fields.
        layers: which layers to watch: ``None`` for the built-in locators
            (:mod:`~instability_watch.model.families`), or :class:`AttentionLayer`
            descriptions (or a function of the model returning them).
        listeners: callables ``f(read_back)`` run after each read-back with a
            :class:`~instability_watch.engine.readback.ReadBack`.
        check_step_calls: warn once when :meth:`step` runs more often than the optimizer updates the
            model (a framework callback that counts optimizer steps itself turns this off).

    Raises:
        TypeError, ValueError: bad arguments; a model with no attention layer
            the locators know; a model whose attention cannot be observed at all
            (e.g. a Hugging Face model built with ``attn_implementation="eager"``).
            A model in which nothing could be observed on the first probe step
            gets one error from :meth:`step`, naming the reasons, and trains on watching
            sigma(W_Q) only (without it, the statistics turned off; ``strict``:
            :class:`~instability_watch.errors.WatchError`).

    Attributes:
        step_count: optimizer steps seen (the last step passed to :meth:`step`).
        alerts: every alert so far, in order.
        events: every switch (and switch not applied, qk_clip turned on) so far.
        switched: ``{(layer, head): step}`` of heads on the stabilized kernel.
        clip_enabled: ``{(layer, head): step}`` of heads ``qk_clip="on_alert"`` acts on.
        clip_counts: ``(L, H_max)`` clips per head so far; ``last_clips``: those of the last read-back.
        last_metrics: the per-step metrics of the last read-back.
        layer_names, head_counts: the watched layers.
        disabled: the parts turned off by a failure, and why.

    The parts, for those who extend it: ``observation`` (the watched layers), ``ring`` (the device
    rows), ``builder`` (metrics), ``detectors``, ``switchboard``, ``clipper`` (QK-clip), ``faults``.

    Example::

        watch = InstabilityWatch(model, WatchConfig(auto_switch=True))
        ...
        print(watch.coverage())
    """

    def __init__(self, model: nn.Module, config: Optional[WatchConfig] = None, *, layers: Optional[Layers] = None,
                 listeners: Sequence[Listener] = (), check_step_calls: bool = True) -> None:
        if config is None:
            config = WatchConfig()
        elif isinstance(config, dict):  # as the callbacks take it
            config = WatchConfig(**config)
        if not isinstance(config, WatchConfig):
            raise TypeError(f"config must be an instability_watch.WatchConfig, a dict of its fields or None, got "
                            f"{type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if callable(listeners) or isinstance(listeners, (str, bytes)) or not isinstance(listeners, Iterable):
            raise TypeError(f"listeners must be a list of callables (each called with a ReadBack), got "
                            f"{type(listeners).__name__}")
        listeners = list(listeners)
        for i, listener in enumerate(listeners):
            if not callable(listener):
                raise TypeError(f"listeners[{i}] must be callable (called with a ReadBack), got "
                                f"{type(listener).__name__}")
        if not isinstance(check_step_calls, bool):
            raise TypeError(f"check_step_calls must be a bool, got {type(check_step_calls).__name__}")
        self.config, self.model = config, model
        self.listeners: List[Listener] = listeners
        self.faults = Faults(config.strict)
        self.cadence = Cadence(config)
        self.step_count = 0
        self.alerts: List[Alert] = []
        self.events: List[Event] = []
        self.events_read = 0  # events already handed to the listeners
        self.last_metrics: List[StepMetrics] = []
        self.coverage_checked = False
        self.spectral = SpectralNorms()
        self._armed: Tuple[bool, bool] = (False, False)
        self._detached_at: Optional[int] = None  # the step of the user's detach(), until step() has said so
        self._check = StepCallCheck.of(model, check_step_calls)
        try:
            found = resolve_layers(model, layers)
        except (TypeError, ValueError):
            raise  # bad input: the user has to fix it
        except Exception as exc:  # noqa: BLE001 - a user's locator function failed: train on without the watch
            self.faults.fail("attach", exc)
            found = None
        # qk_clip: where each layer's query and key rows are (a model it cannot act on is refused here)
        projections = qk_projections(found, model) if config.qk_clip and found else []
        self.observation = observe(model, found or [], beta=config.beta, eps=config.eps)
        if found is None:  # a null observation: no layer, never attached
            self.observation.detach()
        self.observation.on_error = self.faults.fail
        self.observation.on_note = self._on_note
        self.layer_names = [s.name for s in self.observation.sites]
        self.head_counts = self.observation.head_counts
        self.ring = Ring(RingColumns(self.head_counts, clip=bool(config.qk_clip)), config.log_every)
        self.builder = MetricsBuilder(self.head_counts)
        self.calls = CallTotals(self.head_counts)
        self.switchboard = Switchboard(self.observation, self.events, self.config.switch_to)
        self.clipper = QKClipper(config.qk_clip, config.qk_clip_tau, projections, self.observation.sites,
                                 self.layer_names, self.events)
        dist = lambda: self.distributed  # noqa: E731 - read at call time
        self.recorder = Recorder(config=config, cadence=self.cadence, faults=self.faults, ring=self.ring,
                                 observation=self.observation, spectral=self.spectral, clipper=self.clipper,
                                 check=self._check, model=model, distributed=dist)
        self.reader = Reader(config=config, cadence=self.cadence, faults=self.faults, ring=self.ring,
                             builder=self.builder, calls=self.calls, detectors=build_detectors(config, self.shape),
                             switchboard=self.switchboard, clipper=self.clipper, layer_names=self.layer_names,
                             alerts=self.alerts, observation=self.observation, distributed=dist)
        self.faults.on_disable("routing", lambda exc: self.switchboard.routing_failed(exc, self.step_count + 1))
        self.faults.on_disable("statistics", lambda exc: self._arm(self.step_count + 1))
        self._arm(1)

    # ------------------------------------------------------------------ what it is

    @property
    def shape(self) -> Tuple[int, int]:
        """``(L, H)``: watched layers x the widest layer's heads, the shape of every per-head array."""
        return head_shape(self.head_counts)

    @property
    def attached(self) -> bool:
        """The model's attention calls are observed: attaching succeeded and :meth:`detach` was not called."""
        return self.observation.attached

    @property
    def active(self) -> bool:
        """Attached and collecting statistics."""
        return self.attached and "statistics" not in self.faults

    @property
    def disabled(self) -> Dict[str, str]:
        """The parts turned off by a failure: ``{part: "ExcType: message"}``."""
        return self.faults.disabled

    @property
    def switched(self) -> Dict[Tuple[int, int], int]:
        """``{(layer, head): step}`` of the heads on the stabilized kernel."""
        return self.switchboard.switched

    @property
    def clip_enabled(self) -> Dict[Tuple[int, int], int]:
        """``{(layer, head): step}`` of the heads ``qk_clip="on_alert"`` acts on."""
        return self.clipper.enabled

    @property
    def clip_counts(self) -> np.ndarray:
        """``(L, H)`` clips per head so far (read back)."""
        return self.clipper.counts

    @property
    def last_clips(self) -> List[Clip]:
        """The clips of the last read-back."""
        return self.clipper.last

    @property
    def flushed_through(self) -> int:
        """The last step read back (steps after it are still on the device)."""
        return self.ring.read_through

    @property
    def sharding_roots(self) -> List[nn.Module]:
        """Modules outside the model that may hold FSDP1 units wrapping its layers (a framework's FSDP1 root);
        the engine gathers a layer's ``W_Q`` inside the unit holding it. Empty by default."""
        return list(self.observation.sharding_roots)

    @sharding_roots.setter
    def sharding_roots(self, roots: Sequence[nn.Module]) -> None:
        self.observation.sharding_roots = list(roots)

    @property
    def distributed(self) -> bool:
        """Whether the statistics are reduced across ranks: ``torch.distributed`` is initialised with more than
        one rank and ``config.sync_distributed`` is on. Then :meth:`read_back` is a collective."""
        return self.config.sync_distributed and distributed()

    @property
    def detectors(self) -> Dict[str, Detector]:
        """The early-warning rules, by alert kind (:mod:`~instability_watch.detect.detectors`)."""
        return self.reader.detectors

    def is_recorded(self, step: int) -> bool:
        """Whether optimizer step ``step`` is recorded (a probe or spectral step): its loss is kept then only."""
        return self.cadence.recorded(step)

    # ------------------------------------------------------------------ lifecycle

    def detach(self, read_back: bool = True) -> None:
        """Read back the pending steps (alerts go to the listeners), then restore the model exactly.

        ``read_back=False`` restores the model at once and drops the pending steps: no collective runs,
        for use after a crash under ``torch.distributed`` (the other ranks may never reach one again).
        The model is restored even when the read-back fails.
        """
        if not self.attached:
            return
        self._detached_at = self.step_count
        try:
            if read_back:
                self.read_back()
        finally:
            self.observation.detach()

    def pause_statistics(self) -> None:
        """Stop observing (e.g. during validation); switched heads stay on the stabilized kernel."""
        self.observation.collect(False)

    def resume_statistics(self) -> None:
        """Observe again after :meth:`pause_statistics`."""
        self.observation.collect(True)

    def start_at(self, step: int) -> None:
        """Continue counting after optimizer step ``step`` (a model resumed without watch state).

        Anything pending is discarded; the detectors' warm-up starts again from here.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self.step_count = step
        self.ring.restart(step)
        self.observation.bank.zero_()
        self.reader.detectors = build_detectors(self.config, self.shape)
        for d in self.detectors.values():
            d.warmup_steps = step + self.config.warmup_steps
        self._arm(step + 1)

    def __enter__(self) -> "InstabilityWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def fail(self, part: str, exc: BaseException) -> None:
        """A part of the watch failed: turn ``part`` off and report it once; re-raise ``exc`` with ``strict``
        (see :meth:`~instability_watch.engine.faults.Faults.fail`)."""
        self.faults.fail(part, exc)

    def _on_note(self, site: Site, kind: str, reason: str) -> None:
        """A layer met a reason for the first time (called by the observation, at call time)."""
        if kind == NOT_APPLIED:
            self.switchboard.not_applied(site.index, reason, self.step_count + 1)

    # ------------------------------------------------------------------ the step

    def _arm(self, step: int) -> None:
        """Set up the observers for ``step``: statistics on probe steps, shadow on shadow steps."""
        stats = self.cadence.probe(step) and "statistics" not in self.faults
        shadow = stats and self.cadence.shadow(step) and "shadow" not in self.faults
        if (stats, shadow) != self._armed:
            self._armed = (stats, shadow)
            self.observation.arm(stats=stats, shadow=shadow)

    def step(self, loss: Optional[torch.Tensor | float] = None) -> List[Alert]:
        """Close optimizer step ``step_count + 1``; read back every ``log_every`` steps.

        Call it once per optimizer step, after ``optimizer.step()`` (all
        micro-batches of gradient accumulation add up into one step). Between
        probe steps it does nothing on the device.

        Args:
            loss: the step's loss, for the CSV and the report: ``None``, a
                number, or a one-element tensor (read on recorded steps only,
                without a sync). A tensor of several elements is an error; any
                other bad loss is an error with ``strict``, else it is reported
                once and left out (statistics go on).

        Returns:
            The alerts raised by this call (empty except on read-back steps).

        Raises:
            ValueError: ``loss`` has more than one element; with ``strict`` also
                an empty or meta tensor.
            TypeError: with ``strict``, ``loss`` is not a number or a tensor.
        """
        loss = check_loss(loss, self.faults)
        forget_documents()  # a packed batch's documents are kept for one step's layers (host only; nothing if none)
        self.step_count += 1
        s = self.step_count
        if not self.attached:
            if self._detached_at is not None:  # the user's detach(): said once, not silently nothing
                log_rank_zero(logging.WARNING, "instability_watch: step() after detach() (at step %d): nothing is "
                              "observed from here on; create a new InstabilityWatch to watch again",
                              self._detached_at)
                self._detached_at = None
            return []
        self._check.count()
        if self.cadence.recorded(s):
            self.recorder.record(s, loss)
        self._arm(s + 1)
        first_probe = not self.coverage_checked and self.cadence.probe(s)
        if first_probe or self.cadence.read_back(s) or self.ring.full:
            alerts = self.read_back()
            if first_probe:
                self._check_coverage()
            return alerts
        return []

    # ------------------------------------------------------------------ the read-back

    def read_back(self) -> List[Alert]:
        """Read back the pending steps now (one host sync), run the detectors, act, and hand a
        :class:`~instability_watch.engine.readback.ReadBack` to the listeners; returns the new alerts.

        Under ``torch.distributed`` every rank must call it at the same steps
        (``step`` does): a rank whose statistics failed still takes part, and
        then every rank turns statistics off.
        """
        metrics, alerts, clips = self.reader.read(self.step_count)
        if metrics is not None:
            self.last_metrics = metrics
            self._dispatch(metrics, alerts, clips)
        return alerts

    flush = read_back  # the earlier name, kept for code that calls it

    def _dispatch(self, metrics: List[StepMetrics], alerts: List[Alert], clips: List[Clip]) -> None:
        """Hand the read-back to each listener; a failing one is dropped (and reported, or raised with strict)."""
        events, self.events_read = self.events[self.events_read:], len(self.events)
        record = ReadBack(metrics=tuple(metrics), alerts=tuple(alerts), events=tuple(events), clips=tuple(clips),
                          coverage=tuple(self.coverage()), layer_names=tuple(self.layer_names),
                          head_counts=tuple(self.head_counts), switched=dict(self.switched),
                          all_alerts=tuple(self.alerts), config=self.config, report=self.faults.fail)
        for listener in list(self.listeners):
            try:
                listener(record)
            except Exception as exc:  # noqa: BLE001
                self.listeners.remove(listener)  # a failing listener is dropped, with strict too (it raises once)
                if self.config.strict:
                    raise
                self.faults.fail(f"listener {getattr(listener, '__name__', type(listener).__name__)}",
                                 _old_signature(listener, exc))

    def coverage(self) -> List[LayerCoverage]:
        """What was observed, per layer, over the steps read back so far (no host sync).

        Returns:
            One :class:`~instability_watch.observe.coverage.LayerCoverage` per watched
            layer: ``layer_name``, ``observed_calls``, ``unobserved_calls``
            (reason -> count), ``shadow_calls``, ``shadow_skipped``,
            ``kernel_calls`` and ``not_applied``, counted on probe steps.
        """
        return self.observation.coverage(self.calls.per_layer)

    def _tracks_sigma(self) -> bool:
        """sigma(W_Q) is measured and a detector reads it (what is left to watch where no call is observed)."""
        return bool(self.config.spectral_every) and "spectral_growth" in self.config.detectors

    def _check_coverage(self) -> None:
        """After the first probe step: nothing observable is an error naming the reasons."""
        if "statistics" in self.faults:  # turned off by a failure (reported): nothing to judge
            self.coverage_checked = True
            return
        cov = self.coverage()
        if any(c.observed_calls for c in cov):
            self.coverage_checked = True
            idle = [c.layer_name for c in cov if not c.observed_calls and not c.unobserved_calls]
            if idle:  # e.g. an AttentionLayer describing a module the model never calls
                log_rank_zero(logging.WARNING, "instability_watch: %d watched layer(s) made no attention call on the "
                              "first probe step, so nothing is observed there: %s (is the module one the model "
                              "calls?)", len(idle), ", ".join(repr(n) for n in idle[:5]) + (
                                  f" and {len(idle) - 5} more" if len(idle) > 5 else ""))
            return
        reasons: Dict[str, int] = {}
        for c in cov:
            for r, n in c.unobserved_calls.items():
                reasons[r] = reasons.get(r, 0) + n
        if not reasons and not self.observation.compiled_forwards:
            return  # no watched layer ran yet: look again after the next probe step
        self.coverage_checked = True
        listed = "; ".join(f"{r} ({n} calls)" for r, n in reasons.items())
        if not reasons:  # compiled forwards ran and made no call the watch sees, observed or refused
            listed = ("the watched layers' forwards ran compiled (torch.compile) and made no call the watch sees "
                      "there (flash-attn 4's functions are seen in eager forwards only)")
        if set(reasons) <= set(MHA_REASONS) and self._tracks_sigma():
            # nn.MultiheadAttention located, its calls not observable: watch what can be watched, and say so
            log_rank_zero(logging.WARNING, "instability_watch observed no attention call on the first probe step "
                          "(%s): only sigma(W_Q) is tracked (spectral_growth alerts); multi-max, logits and the "
                          "shadow delta need the layers' attention as an F.scaled_dot_product_attention call",
                          listed)
            return
        # the watch sees nothing of this model's attention: an error with strict, else said once and training goes on,
        # watching sigma(W_Q) where it is measured (the statistics stay armed: they cost nothing on such a model, and
        # the recorder writes sigma with them), else with the statistics turned off
        message = f"instability_watch observed no attention call on the first probe step: {listed}"
        if self.config.strict:
            raise NothingObservedError(message)
        if self._tracks_sigma():
            log_rank_zero(logging.ERROR, "%s. Only sigma(W_Q) is watched (spectral_growth alerts); training goes on.",
                          message)
            return
        self.faults.turn_off("statistics", message)

    # ------------------------------------------------------------------ acting, by hand

    def switch(self, layer: int, head: int, reason: str = "manual", step: Optional[int] = None) -> None:
        """Switch one head (sticky; recorded as an event): onto the stabilized kernel, or with
        ``WatchConfig.switch_to="exact_delta"`` its layer's backward onto the exact ``delta``.

        The head's layer then runs every call on our kernels (standard for its
        other heads). A call they cannot serve stays on PyTorch's attention, and a
        ``switch_not_applied`` event says why. ``step``, the event's step, is the last step run
        (``step_count``) unless given: the switch is in force from the next one.
        """
        if "attach" in self.faults:
            raise WatchError("the watch is not attached (see watch.disabled)")
        self.switchboard.switch(layer, head, reason, self.step_count if step is None else step)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything needed to resume identically, in plain Python types.

        Includes switched heads, cumulative delta sums, detector state, the
        spectral warm-start vectors, coverage counts and the steps not yet
        read back (a host sync). Under ``torch.distributed`` call :meth:`read_back`
        on every rank first: pending rows are this rank's alone (the Lightning
        and Hugging Face callbacks do this).
        """
        return watch_state.save(self)

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; the model must have the same watched layers.

        Everything is checked before anything is applied: a state that does
        not fit raises ``ValueError`` naming the key, and the watch is unchanged.
        """
        if "attach" in self.faults:  # attaching failed (reported); nothing to restore into
            return
        watch_state.restore(self, watch_state.parse(self, state))
        self._armed = (False, False)
        self._arm(self.step_count + 1)

    # ------------------------------------------------------------------ summaries

    def summary(self) -> Dict[str, float]:
        """A few aggregate scalars of the last read-back step (for loggers; :func:`~.metrics.summarize`)."""
        return summarize(self.last_metrics, len(self.switched), len(self.alerts))


InstabilityWatch.__init__ = checking_keywords(InstabilityWatch.__init__, config_fields)
