"""``InstabilityWatch``: the framework-free engine.

Use it in any training loop::

    watch = InstabilityWatch(model, WatchConfig(auto_switch=True))
    for batch in data:
        loss = model(batch)            # attention runs as always; on probe steps it is observed
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
        for alert in watch.step(loss): # once per optimizer step
            print(alert.message)
    watch.detach()

The model's attention is left to PyTorch (:mod:`~instability_watch.observe`).
At each :meth:`InstabilityWatch.step`:

* on a probe step (every ``probe_every`` steps: 1, 1 + n, ...) every layer's
  probe is copied into one row of a device-side ring buffer and reset, with
  sigma(W_Q) on spectral steps and the loss; nothing leaves the device;
* the next step is armed: observers are installed only for a probe step (and
  kept on layers with switched heads); between probe steps nothing is
  installed and nothing runs;
* every ``log_every`` steps (and once after the first probe step, to check
  coverage) the ring is read back in one transfer, the one host sync, reduced
  across ranks under ``torch.distributed``, turned into per-step metrics
  (:func:`derive_metrics`) and fed to the detectors; switch decisions move
  heads onto the stabilized kernel; the listeners (console, CSV, loggers)
  receive the metrics and alerts.

Failures inside the watch never stop training: the failing part is reported
once with its traceback and turned off (observing, statistics, spectral,
detectors, a listener), unless ``strict=True``.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn

from ._dist import log_rank_zero, rank
from .config import WatchConfig
from .detectors import Alert, Detector, build_detectors
from .locate import Layers, resolve_layers
from .observe import NOT_APPLIED, GatheredReadError, LayerCoverage, Observation, Site, observe
from ._sharding import fsdp1_units, full_params, innermost_unit
from .probe import CALL_FIELDS, COUNT_FIELDS, VALUE_FIELDS
from .qkclip import Clip, build_layouts
from .spectral import SpectralNorms

log = logging.getLogger("instability_watch")

STATE_VERSION = 2

# Per-step metric names, in the order the CSV writes them (see README).
METRICS = (
    "rows", "multi_max_rows", "multi_max_freq", "masked_rows", "max_score", "nonfinite_rows",
    "shadow_rows", "delta_err_sum", "delta_err_abs", "delta_err_pos_frac", "delta_cum",
    "sigma_wq", "stabilized",
)
RING_ROWS_MAX = 256  # read back early when this many steps wait on the device (bounds its memory)


class WatchError(RuntimeError):
    """A failure inside the watch, raised only with ``strict=True``."""


@dataclass
class Event:
    """Something the watch did or could not do.

    ``kind`` is ``"switch"`` (a head moved to the stabilized kernel),
    ``"switch_not_applied"`` (a switched head's layer made a call our kernels
    cannot serve; that call stayed on PyTorch's SDPA; ``reason`` says why) or
    ``"qk_clip_on"`` (``qk_clip="on_alert"``: the head is clipped from the next
    probe step on; ``reason`` is the alert kind). Clips themselves are
    :class:`~instability_watch.qkclip.Clip` records (``watch.last_clips``).
    """

    step: int
    layer: int
    head: int
    kind: str
    reason: str
    layer_name: str = ""

    def to_dict(self) -> dict:
        """The fields as a plain ``dict`` (JSON-ready)."""
        return asdict(self)


@dataclass
class StepMetrics:
    """Metrics of one observed step: ``values[name]`` is an ``(L, H_max)`` float array.

    ``NaN`` marks no observation (a padded head, a step without shadow or
    spectral computation, no rows). ``loss`` is NaN when no loss was passed.
    """

    step: int
    loss: float
    values: Dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]


Listener = Callable[[List[StepMetrics], List[Alert], "InstabilityWatch"], None]


def _due(step: int, every: int) -> bool:
    return every > 0 and (step - 1) % every == 0


class RingLayout:
    """The columns of one ring row (float64): every layer's ``counts``, every layer's ``values``, sigma, loss, ok.

    ``counts`` and ``values`` are :class:`~instability_watch.probe.ProbeBank`'s
    concatenations (per layer, field-major); ``ok`` is 1 where this rank
    recorded the step (summed across ranks, so a rank that failed shows).
    """

    def __init__(self, head_counts: Sequence[int], clip: bool = False) -> None:
        self.head_counts = list(head_counts)
        total = sum(self.head_counts)
        nc, nv = len(COUNT_FIELDS), len(VALUE_FIELDS)
        self.counts = slice(0, nc * total)
        self.values = slice(nc * total, (nc + nv) * total)
        self.sigma = slice((nc + nv) * total, (nc + nv + 1) * total)
        self.loss = (nc + nv + 1) * total
        self.ok = self.loss + 1
        # with qk_clip: each head's logit multiplier of the step (1: not clipped; NaN: no clip step)
        self.clip = slice(self.ok + 1, self.ok + 1 + (total if clip else 0))
        self.width = self.clip.stop

    def max_columns(self) -> torch.Tensor:
        """A ``(width,)`` bool CPU tensor: the columns reduced by max across ranks (the largest logit, sigma,
        the clip multipliers); the rest are summed."""
        cols = torch.zeros(self.width, dtype=torch.bool)
        i_max = VALUE_FIELDS.index("max_score")
        offset = self.values.start
        for h in self.head_counts:  # max_score sits in each layer's value block
            cols[offset + i_max * h: offset + (i_max + 1) * h] = True
            offset += len(VALUE_FIELDS) * h
        cols[self.sigma] = True
        cols[self.clip] = True  # the same on every rank
        return cols

    def per_head(self, flat: np.ndarray) -> np.ndarray:
        """A ``(total heads,)`` vector as a float64 ``(L, H_max)`` array, NaN in padded heads."""
        L, Hm = len(self.head_counts), max(self.head_counts, default=0)
        out = np.full((L, Hm), np.nan)
        o = 0
        for layer, h in enumerate(self.head_counts):
            out[layer, :h] = flat[o: o + h]
            o += h
        return out

    def unpack(self, row: np.ndarray) -> Dict[str, np.ndarray]:
        """Every probe field and ``sigma_wq`` of one float64 ``(width,)`` row as a float64 ``(L, H_max)`` array
        (NaN in padded heads)."""
        L, Hm = len(self.head_counts), max(self.head_counts, default=0)
        nc, nv = len(COUNT_FIELDS), len(VALUE_FIELDS)
        out = {name: np.full((L, Hm), np.nan) for name in COUNT_FIELDS + VALUE_FIELDS + ("sigma_wq",)}
        counts, values, sigma = row[self.counts], row[self.values], row[self.sigma]
        oc = ov = 0
        for layer, h in enumerate(self.head_counts):
            c = counts[oc: oc + nc * h].reshape(nc, h)
            v = values[ov: ov + nv * h].reshape(nv, h)
            for i, name in enumerate(COUNT_FIELDS):
                out[name][layer, :h] = c[i]
            for i, name in enumerate(VALUE_FIELDS):
                out[name][layer, :h] = v[i]
            out["sigma_wq"][layer, :h] = sigma[oc // nc: oc // nc + h]
            oc, ov = oc + nc * h, ov + nv * h
        return out


def derive_metrics(
    raw: Dict[str, np.ndarray], pad: np.ndarray, delta_cum: np.ndarray, stabilized: np.ndarray
) -> Tuple[Dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Per-step metrics from one step's raw probe sums (a pure function).

    Args:
        raw: :meth:`RingLayout.unpack` of the step's row.
        pad: ``(L, H_max)`` True where a layer has fewer heads.
        delta_cum: the running ``sum(delta_lp - delta_hp)`` before this step.
        stabilized: ``(L, H_max)`` 1 where the head runs the stabilized kernel.

    Returns:
        ``(metrics, delta_cum, broken)``: the :data:`METRICS` plus ``nonfinite``
        (what the non-finite rule reads: broken rows, a NaN/+inf logit, a
        non-finite sigma(W_Q)); the updated running sum; and where a shadow
        step gave a non-finite drift on finite attention rows (ignored, reported).
    """
    m: Dict[str, np.ndarray] = {}
    for name in ("rows", "multi_max_rows", "masked_rows", "nonfinite_rows", "shadow_rows"):
        m[name] = np.where(pad, np.nan, raw[name])
    with np.errstate(invalid="ignore", divide="ignore"):
        m["multi_max_freq"] = np.where(raw["rows"] > 0, raw["multi_max_rows"] / raw["rows"], np.nan)
        max_score = raw["max_score"]
        m["max_score"] = np.where((raw["rows"] > 0) & ~np.isneginf(max_score), max_score, np.nan)
        shadow = (raw["shadow_rows"] > 0) & ~pad
        dsum = np.where(shadow, raw["delta_err_sum"], np.nan)
        dabs = np.where(shadow, raw["delta_err_abs"], np.nan)
        m["delta_err_pos_frac"] = np.where(shadow, raw["delta_err_pos"] / np.maximum(raw["shadow_rows"], 1), np.nan)
    broken = shadow & ~np.isfinite(dsum) & ~(raw["nonfinite_rows"] > 0)
    good = shadow & np.isfinite(dsum)
    delta_cum = np.where(good, delta_cum + np.where(good, dsum, 0.0), delta_cum)
    m["delta_err_sum"] = np.where(shadow & ~broken, dsum, np.nan)
    m["delta_err_abs"] = np.where(shadow & ~broken, dabs, np.nan)
    m["delta_cum"] = np.where(pad, np.nan, delta_cum)
    sig = raw["sigma_wq"]
    m["sigma_wq"] = np.where(pad, np.nan, sig)
    m["stabilized"] = np.where(pad, np.nan, stabilized)
    bad_logit = (raw["rows"] > 0) & (np.isnan(max_score) | np.isposinf(max_score))
    bad_sigma = ~np.isnan(sig) & ~np.isfinite(sig)
    m["nonfinite"] = np.where(pad, np.nan, np.nan_to_num(raw["nonfinite_rows"], nan=0.0) + bad_logit + bad_sigma)
    return m, delta_cum, broken


class InstabilityWatch:
    """Watch every attention head of ``model`` while it trains.

    Args:
        model: the model; its code and its attention calls are not changed.
        config: a :class:`WatchConfig` (defaults if ``None``).
        layers: which layers to watch: ``None`` for the built-in locators
            (:mod:`~instability_watch.locate`), or :class:`AttentionLayer`
            descriptions (or a function of the model returning them).
        listeners: callables ``f(metrics, alerts, watch)`` run after each read-back.
        check_step_calls: warn once when :meth:`step` runs more often than the optimizer updates the
            model (a framework callback that counts optimizer steps itself turns this off).

    Raises:
        TypeError, ValueError: bad arguments; a model with no attention layer
            the locators know; a model whose attention cannot be observed at all
            (e.g. a Hugging Face model built with ``attn_implementation="eager"``).
            A model in which nothing could be observed on the first probe step
            raises ``ValueError`` from :meth:`step`, naming the reasons.

    Attributes:
        step_count: optimizer steps seen (the last step passed to :meth:`step`).
        alerts: every alert so far, in order.
        events: every switch (and switch not applied, qk_clip turned on) so far.
        switched: ``{(layer, head): step}`` of heads on the stabilized kernel.
        clip_enabled: ``{(layer, head): step}`` of heads ``qk_clip="on_alert"`` acts on.
        clip_counts: ``(L, H_max)`` clips per head so far; ``last_clips``: those of the last read-back.
        last_metrics: the per-step metrics of the last read-back.
        layer_names, head_counts: the watched layers.

    Example::

        watch = InstabilityWatch(model, WatchConfig(auto_switch=True))
        ...
        print(watch.coverage())
    """

    def __init__(
        self,
        model: nn.Module,
        config: Optional[WatchConfig] = None,
        *,
        layers: Optional[Layers] = None,
        listeners: Sequence[Listener] = (),
        check_step_calls: bool = True,
    ) -> None:
        if config is None:
            config = WatchConfig()
        if not isinstance(config, WatchConfig):
            raise TypeError(f"config must be an instability_watch.WatchConfig, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config
        self.model = model
        self.listeners: List[Listener] = list(listeners)
        self.step_count = 0
        self.alerts: List[Alert] = []
        self.events: List[Event] = []
        self.switched: Dict[Tuple[int, int], int] = {}
        self.last_metrics: List[StepMetrics] = []
        self.clip_enabled: Dict[Tuple[int, int], int] = {}  # qk_clip="on_alert": head -> step of its alert
        self.clip_counts = np.zeros((0, 0), dtype=np.int64)  # clips per head so far (read back)
        self.last_clips: List[Clip] = []  # the clips of the last read-back
        self._clip_mask: Optional[torch.Tensor] = None  # device (total heads,) bool: heads qk_clip may act on
        self._smax: Optional[torch.Tensor] = None  # the probe step's largest logits, kept for the clip
        self.disabled: Dict[str, str] = {}  # component -> why
        self.observation: Optional[Observation] = None
        self.layer_names: List[str] = []
        self.head_counts: List[int] = []
        self._pending_steps: List[int] = []
        self._flushed_through = 0  # last step read back
        self._ring: Optional[torch.Tensor] = None
        self._reported_problems: set = set()
        self._calls: List[Dict[str, int]] = []
        self._coverage_checked = False
        self._armed: Tuple[bool, bool] = (False, False)
        # step() once per optimizer step: a trained parameter's version counter moves with every
        # optimizer update (a host-side integer: reading it costs no device work)
        self._tracked = next((p for p in model.parameters() if p.requires_grad), None) if check_step_calls else None
        self._tracked_version = self._tracked._version if self._tracked is not None else 0
        self._calls_updated = self._calls_idle = 0
        self.spectral = SpectralNorms()
        try:
            found = resolve_layers(model, layers)
        except (TypeError, ValueError):
            raise  # bad input: the user has to fix it
        except Exception as exc:  # noqa: BLE001 - a user's locator function failed: train on without the watch
            self.fail("attach", exc)
            return
        # qk_clip: where each layer's query and key rows are (a model it cannot act on is refused here)
        self.qk_layouts = build_layouts(found, model) if config.qk_clip else []
        self.observation = observe(model, found, beta=config.beta, eps=config.eps)
        self.observation.on_error = self.fail
        self.observation.on_note = self._on_note
        self.layer_names = [s.name for s in self.observation.sites]
        self.head_counts = self.observation.head_counts
        self.layout = RingLayout(self.head_counts, clip=bool(config.qk_clip))
        self.clip_counts = np.zeros(self.shape, dtype=np.int64)
        self._calls = [dict.fromkeys(CALL_FIELDS, 0) for _ in self.head_counts]
        self.detectors: Dict[str, Detector] = build_detectors(config, self.shape)
        self._delta_cum = np.zeros(self.shape)
        self._pad = np.zeros(self.shape, dtype=bool)
        for i, h in enumerate(self.head_counts):
            self._pad[i, h:] = True
        self._arm(1)

    # ------------------------------------------------------------------ lifecycle

    @property
    def active(self) -> bool:
        """Attached and collecting statistics."""
        return self.observation is not None and self.observation.attached and "statistics" not in self.disabled

    @property
    def shape(self) -> Tuple[int, int]:
        """``(L, H)``: watched layers x the widest layer's heads, the shape of every per-head array."""
        return (len(self.head_counts), max(self.head_counts) if self.head_counts else 0)

    @property
    def attached(self) -> bool:
        """The model's attention calls are observed: attaching succeeded and :meth:`detach` was not called."""
        return self.observation is not None and self.observation.attached

    @property
    def sharding_roots(self) -> List[nn.Module]:
        """Modules outside the model that may hold FSDP1 units wrapping its layers (a framework's FSDP1 root);
        the engine gathers a layer's ``W_Q`` inside the unit holding it. Empty by default."""
        return list(self.observation.sharding_roots) if self.observation is not None else []

    @sharding_roots.setter
    def sharding_roots(self, roots: Sequence[nn.Module]) -> None:
        if self.observation is not None:
            self.observation.sharding_roots = list(roots)

    def detach(self, read_back: bool = True) -> None:
        """Read back the pending steps (alerts go to the listeners), then restore the model exactly.

        ``read_back=False`` restores the model at once and drops the pending steps: no collective runs,
        for use after a crash under ``torch.distributed`` (the other ranks may never reach one again).
        The model is restored even when the read-back fails.
        """
        if not self.attached:
            return
        try:
            if read_back:
                self.flush()
        finally:
            self.observation.detach()

    @property
    def flushed_through(self) -> int:
        """The last step read back (steps after it are still on the device)."""
        return self._flushed_through

    def pause_statistics(self) -> None:
        """Stop observing (e.g. during validation); switched heads stay on the stabilized kernel."""
        if self.observation is not None:
            self.observation.collect(False)

    def resume_statistics(self) -> None:
        """Observe again after :meth:`pause_statistics`."""
        if self.observation is not None:
            self.observation.collect(True)

    def start_at(self, step: int) -> None:
        """Continue counting after optimizer step ``step`` (a model resumed without watch state).

        Anything pending is discarded; the detectors' warm-up starts again from here.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self.step_count = step
        self._flushed_through = step
        self._pending_steps = []
        if self.observation is not None:
            self.observation.bank.zero_()
            self.detectors = build_detectors(self.config, self.shape)
            for d in self.detectors.values():
                d.warmup_steps = step + self.config.warmup_steps
            self._arm(step + 1)

    def __enter__(self) -> "InstabilityWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # ------------------------------------------------------------------ failures

    def fail(self, component: str, exc: BaseException) -> None:
        """A part of the watch failed: turn ``component`` off and report it once; re-raise ``exc`` with ``strict``.

        ``component`` names the part (``"statistics"``, ``"routing"``, ``"shadow"``, ``"run directory"``,
        ``"listener NAME"``, ...); it is recorded in :attr:`disabled`. Training goes on without it.
        """
        if self.config.strict:
            raise exc
        if component in self.disabled:
            return
        self.disabled[component] = f"{type(exc).__name__}: {exc}"
        if self.observation is not None:
            if component == "routing":  # our kernels failed: every call goes to PyTorch's SDPA from now on
                self.observation.routing = False
                for (layer, head) in sorted(self.switched):
                    site = self.observation.sites[layer]
                    self.events.append(Event(self.step_count + 1, layer, head, "switch_not_applied",
                                             f"our kernel failed ({type(exc).__name__})", site.name))
            elif component == "statistics":  # observe no more; switched heads stay on the stabilized kernel
                self._arm(self.step_count + 1)
        # A failure is reported by the process it happened in (once), with the rank.
        log.error(
            "instability_watch (rank %d): %s failed and is turned off; training goes on. %s",
            rank(), component, self.disabled[component],
            exc_info=None if isinstance(exc, OSError) else exc,  # a full disk needs no traceback; a bug does
        )

    def _problem(self, key: str, message: str) -> None:
        """A bad value inside the watch: ``WatchError`` with ``strict``, else reported once."""
        if self.config.strict:
            raise WatchError(message)
        if key not in self._reported_problems:
            self._reported_problems.add(key)
            log_rank_zero(logging.WARNING, "instability_watch: %s (ignored; reported once)", message)

    def _on_note(self, site: Site, kind: str, reason: str) -> None:
        """A layer met a reason for the first time (called by the observation, at call time)."""
        if kind != NOT_APPLIED:
            return
        for (layer, head) in sorted(self.switched):
            if layer == site.index:
                self.events.append(Event(self.step_count + 1, layer, head, "switch_not_applied", reason, site.name))

    # ------------------------------------------------------------------ the step

    def _arm(self, step: int) -> None:
        """Set up the observers for ``step``: statistics on probe steps, shadow on shadow steps."""
        if self.observation is None:
            return
        c = self.config
        stats = _due(step, c.probe_every) and "statistics" not in self.disabled
        shadow = stats and _due(step, c.shadow_every) and "shadow" not in self.disabled
        if (stats, shadow) != self._armed:
            self._armed = (stats, shadow)
            self.observation.arm(stats=stats, shadow=shadow)

    def records(self, step: int) -> bool:
        """Whether optimizer step ``step`` is recorded (a probe or spectral step): its loss is kept then only."""
        c = self.config
        return _due(step, c.probe_every) or _due(step, c.spectral_every)

    def _ensure_ring(self) -> torch.Tensor:
        device = self.observation.bank.device
        rows = min(self.config.log_every, RING_ROWS_MAX)
        if self._ring is None or self._ring.device != device:
            ring = torch.full((rows, self.layout.width), float("nan"), dtype=torch.float64, device=device)
            if self._ring is not None and not self._ring.is_meta:
                ring.copy_(self._ring.to(device))
            self._ring = ring
        return self._ring

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
        loss = self._check_loss(loss)
        self.step_count += 1
        s = self.step_count
        if self.observation is None or not self.observation.attached:
            return []
        self._count_updates()
        if self.records(s) and self.observation.bank.device.type == "meta":
            if "meta" not in self._reported_problems:
                self._reported_problems.add("meta")
                log_rank_zero(logging.WARNING, "instability_watch: the model is on the meta device (it holds no "
                              "data): nothing is recorded until it is materialized (e.g. model.to_empty())")
        elif self.records(s):
            if "statistics" not in self.disabled:
                try:
                    self._record(s, loss)
                except Exception as exc:  # noqa: BLE001
                    self.fail("statistics", exc)
            self._pending_steps.append(s)  # in lockstep with the other ranks, recorded or not
            if self.config.qk_clip and _due(s, self.config.probe_every):
                self._qk_clip()
        self._arm(s + 1)
        first_probe = not self._coverage_checked and _due(s, self.config.probe_every)
        if first_probe or s % self.config.log_every == 0 or len(self._pending_steps) >= self._ring_rows():
            alerts = self.flush()
            if first_probe:
                self._check_coverage()
            return alerts
        return []

    def _check_loss(self, loss):
        """``loss`` if it can be recorded; a bad one raises (``strict``, or several elements) or is dropped."""
        if loss is None:
            return None
        if isinstance(loss, torch.Tensor):
            if loss.numel() > 1:
                raise ValueError(f"loss must have one element (the loss you backpropagate), got a tensor of shape "
                                 f"{tuple(loss.shape)}; reduce it first, e.g. loss.mean()")
            if loss.numel() == 0:
                problem = ValueError(f"loss must have one element, got an empty tensor of shape {tuple(loss.shape)}")
            elif loss.is_meta:
                problem = ValueError("loss is a meta tensor (it holds no value)")
            elif loss.is_complex() or loss.dtype == torch.bool:
                problem = TypeError(f"loss must be a real number, got a tensor of dtype {loss.dtype}")
            else:
                return loss
        elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
            return loss
        elif isinstance(loss, np.number) and np.isrealobj(loss) and not isinstance(loss, np.bool_):
            return float(loss)
        else:
            problem = TypeError(f"loss must be None, a number or a one-element tensor, got "
                                f"{type(loss).__name__} ({loss!r:.40})")
        if self.config.strict:
            raise problem
        if "loss" not in self._reported_problems:
            self._reported_problems.add("loss")
            log_rank_zero(logging.WARNING, "instability_watch: step(loss): %s; this loss is left out (the CSV "
                          "shows nan) and statistics go on (reported once)", problem)
        return None

    def _count_updates(self) -> None:
        """Warn once when step() runs more often than the optimizer updates the model."""
        p = self._tracked
        if p is None or self._calls_idle < 0:
            return
        version = p._version
        if version == self._tracked_version:
            self._calls_idle += 1
        else:
            self._calls_updated += 1
            self._tracked_version = version
        calls = self._calls_idle + self._calls_updated
        # step() twice per update gives idle == updated; a skipped optimizer step now and then
        # (a GradScaler overflow) stays far below that. No update at all (frozen weights): no claim.
        if self._calls_updated >= 4 and 2 * self._calls_idle >= calls:
            log_rank_zero(
                logging.WARNING,
                "instability_watch: step() was called %d times while the optimizer updated the model %d times: "
                "call it once per optimizer step, after optimizer.step(); the step numbers and every cadence "
                "count step() calls (reported once)", calls, self._calls_updated)
            self._calls_idle = -1  # reported: stop counting

    def _ring_rows(self) -> int:
        return min(self.config.log_every, RING_ROWS_MAX)

    def _record(self, s: int, loss) -> None:
        ring = self._ensure_ring()
        bank = self.observation.bank
        lay = self.layout
        row = ring[len(self._pending_steps)]
        row[lay.counts].copy_(bank.counts)
        row[lay.values].copy_(bank.values)
        sig = row[lay.sigma]
        sig.fill_(float("nan"))
        if _due(s, self.config.spectral_every) and "spectral" not in self.disabled:
            try:
                sigmas = self.spectral.of_grams(self.observation.grams())
                sig.copy_(torch.cat(sigmas).to(sig.device))
            except GatheredReadError as exc:
                if self.distributed:
                    # turning spectral off on this rank alone would leave the others waiting in the next
                    # spectral step's FSDP gathers: this step's sigma is left to the other ranks (max-reduced)
                    self._problem("spectral-gather", f"rank {rank()}: {exc}; sigma comes from the other ranks")
                else:
                    self.fail("spectral", exc)
            except Exception as exc:  # noqa: BLE001
                self.fail("spectral", exc)
        if isinstance(loss, torch.Tensor):
            row[lay.loss: lay.loss + 1].copy_(loss.detach().reshape(1))
        else:
            row[lay.loss: lay.loss + 1].fill_(float("nan") if loss is None else float(loss))
        # fill_, not ``row[i] = 1.0``: item assignment of a Python number copies a
        # host scalar into device memory, which waits for the stream (a sync per step)
        row[lay.ok: lay.ok + 1].fill_(1.0)  # this rank recorded the step (summed across ranks)
        row[lay.clip].fill_(float("nan"))  # written by _qk_clip on probe steps
        if self.config.qk_clip and _due(s, self.config.probe_every):
            self._smax = torch.cat([p.max_score for p in bank.probes])  # a copy, before the reset
        bank.zero_()

    # ------------------------------------------------------------------ qk_clip

    def _qk_clip(self) -> None:
        """After the optimizer step of a probe step: scale ``W_q``/``W_k`` of the heads over ``qk_clip_tau``.

        On the device, no host sync: the step's largest logits (max-reduced across
        ranks, so every rank scales alike), the logit multiplier ``tau / S`` of
        each head that is over ``tau`` and enabled, then each layer's in-place
        multiply (:mod:`~instability_watch.qkclip`). Under torch.distributed every
        rank calls it at every probe step: a rank whose statistics or clip failed
        takes part with a flag that makes every rank skip the clip of that step
        (and turn it off at the next read-back).
        """
        smax, self._smax = self._smax, None
        healthy = smax is not None and "statistics" not in self.disabled and "qk_clip" not in self.disabled
        distributed = self.distributed
        if not healthy and not distributed:
            return
        dev = self.observation.bank.device
        tau = float(self.config.qk_clip_tau)
        total = sum(self.head_counts)
        try:
            if smax is None or not healthy:
                smax = torch.full((total,), float("-inf"), dtype=torch.float32, device=dev)
            ok = None
            if distributed:
                dist = torch.distributed
                flag = torch.full((1,), 0.0 if healthy else 1.0, dtype=torch.float32, device=dev)
                buf = torch.cat([torch.nan_to_num(smax.float(), nan=float("-inf")), flag])  # NaN: no MAX rule
                dist.all_reduce(buf, op=dist.ReduceOp.MAX)
                smax, ok = buf[:-1], buf[-1:] == 0
            over = self._clip_mask_on(dev) & torch.isfinite(smax) & (smax > tau)
            if ok is not None:
                over &= ok
            gamma = torch.where(over, tau / smax, torch.ones_like(smax))
            if healthy:
                self._apply_clip(gamma)
                row = self._ring[len(self._pending_steps) - 1]
                row[self.layout.clip].copy_(gamma if ok is None else torch.where(ok, gamma, float("nan")))
        except Exception as exc:  # noqa: BLE001
            self.fail("qk_clip", exc)

    def _apply_clip(self, gamma: torch.Tensor) -> None:
        """Each layer's in-place scaling (FSDP1 layers inside their unit's full parameters, written back)."""
        units = fsdp1_units([self.model, *self.observation.sharding_roots])
        error: Optional[BaseException] = None
        offset = 0
        for site, layout in zip(self.observation.sites, self.qk_layouts):
            g = gamma[offset: offset + site.num_heads]
            offset += site.num_heads
            unit = innermost_unit(site.layer.module, units) if units else None
            # every rank enters every unit's gather (a collective), also after a failure here
            with full_params(unit, writeback=True):
                if error is None:
                    try:
                        layout.apply(g)
                    except Exception as exc:  # noqa: BLE001
                        error = exc
        if self._tracked is not None:  # our own update is not an optimizer step (see _count_updates)
            self._tracked_version = self._tracked._version
        if error is not None:
            raise error

    def _clip_mask_on(self, device: torch.device) -> torch.Tensor:
        """The heads qk_clip acts on, on ``device``: all with ``"always"``, else the enabled ones."""
        if self._clip_mask is None or self._clip_mask.device != device:
            total = sum(self.head_counts)
            if self.config.qk_clip == "always":
                self._clip_mask = torch.ones(total, dtype=torch.bool, device=device)
            elif not self.clip_enabled:
                self._clip_mask = torch.zeros(total, dtype=torch.bool, device=device)
            else:  # a host-to-device copy: only after enabling heads (at a read-back) or a resume
                self._clip_mask = self._clip_mask_host().to(device)
        return self._clip_mask

    def _clip_mask_host(self) -> torch.Tensor:
        starts = np.cumsum([0] + self.head_counts[:-1])
        mask = torch.zeros(sum(self.head_counts), dtype=torch.bool)
        for (layer, head) in self.clip_enabled:
            mask[int(starts[layer]) + head] = True
        return mask

    def _enable_clip(self, layer: int, head: int, step: int, reason: str) -> None:
        """``qk_clip="on_alert"``: act on this head from the next probe step on (sticky; an event)."""
        if (layer, head) in self.clip_enabled:
            return
        self.clip_enabled[(layer, head)] = step
        self.events.append(Event(step, layer, head, "qk_clip_on", reason, self.layer_names[layer]))
        if self._clip_mask is not None:  # called inside a read-back (synchronised already)
            self._clip_mask = self._clip_mask_host().to(self._clip_mask.device)

    def _clips(self, step: int, row: np.ndarray, m: "StepMetrics") -> List[Clip]:
        """The clips recorded in one read-back row (its logit multipliers below 1)."""
        gamma = self.layout.per_head(row[self.layout.clip])
        if np.isnan(gamma[~self._pad]).any() and _due(step, self.config.probe_every) and "qk_clip" not in self.disabled:
            if self.distributed:  # another rank could not clip: every rank skipped it; now turn it off everywhere
                self.fail("qk_clip", WatchError("qk_clip failed on another rank; turned off on every rank"))
        out = []
        for layer, head in np.argwhere(gamma < 1.0):
            layer, head = int(layer), int(head)
            self.clip_counts[layer, head] += 1
            out.append(Clip(step, layer, head, float(gamma[layer, head]), float(m.values["max_score"][layer, head]),
                            float(self.config.qk_clip_tau), self.layer_names[layer]))
        return out

    def flush(self) -> List[Alert]:
        """Read back pending steps now (one host sync), run the detectors, act; returns new alerts.

        Under ``torch.distributed`` every rank must call it at the same steps
        (``step`` does): a rank whose statistics failed still takes part, and
        then every rank turns statistics off.
        """
        if self.observation is None:
            return []
        distributed = self.distributed
        if self.step_count <= self._flushed_through:
            return []
        steps = list(self._pending_steps)
        if not distributed and not steps:
            self._flushed_through = self.step_count
            return []
        recorded = "statistics" not in self.disabled
        self._flushed_through = self.step_count
        self._pending_steps = []
        if not distributed and not recorded:
            return []
        try:
            ring = self._ensure_ring()
            n = len(steps)
            if recorded:
                data = ring[:n].clone()
            else:  # this rank has nothing valid: take part with an "unhealthy" block
                data = torch.full((n, ring.shape[1]), float("nan"), dtype=torch.float64, device=ring.device)
                data[:, self.layout.ok].fill_(0.0)
            if distributed:
                data = self._reduce(data)
            host = data.cpu().numpy()  # the one host sync
        except Exception as exc:  # noqa: BLE001
            self.fail("statistics", exc)
            return []
        healthy = self._world() if distributed else 1
        if len(host) and not (host[:, self.layout.ok] == healthy).all():
            self.fail("statistics", WatchError("statistics failed on another rank; turned off on every rank"))
            return []
        self._count_calls(host)
        alerts: List[Alert] = []
        clips: List[Clip] = []
        try:
            metrics = [self._metrics(step, host[i]) for i, step in enumerate(steps)]
            if self.config.qk_clip:
                for i, m in enumerate(metrics):
                    clips.extend(self._clips(m.step, host[i], m))
            if "detectors" not in self.disabled:
                for m in metrics:
                    alerts.extend(self._detect(m))
        except WatchError:
            raise
        except Exception as exc:  # noqa: BLE001
            self.fail("detectors", exc)
            return alerts
        self.last_metrics = metrics
        self.last_clips = clips
        for listener in list(self.listeners):
            try:
                listener(metrics, alerts, self)
            except Exception as exc:  # noqa: BLE001
                self.listeners.remove(listener)  # a failing listener is dropped, with strict too (it raises once)
                if self.config.strict:
                    raise
                self.fail(f"listener {getattr(listener, '__name__', type(listener).__name__)}", exc)
        return alerts

    @property
    def distributed(self) -> bool:
        """Whether the statistics are reduced across ranks: ``torch.distributed`` is initialised with more than
        one rank and ``config.sync_distributed`` is on. Then :meth:`flush` (and every read-back) is a collective."""
        dist = torch.distributed
        return bool(
            self.config.sync_distributed and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1
        )

    def _world(self) -> int:
        return torch.distributed.get_world_size()

    def _reduce(self, data: torch.Tensor) -> torch.Tensor:
        """Under torch.distributed: sum counts, delta sums and loss (loss averaged), max the logits and sigma."""
        dist = torch.distributed
        world = dist.get_world_size()
        max_cols = self.layout.max_columns().to(data.device)
        # NaN does not survive all_reduce(MAX) portably: reduce with -inf in its place.
        maxed = torch.where(max_cols & ~torch.isnan(data), data, torch.full_like(data, float("-inf")))
        summed = torch.where(max_cols, torch.zeros_like(data), data)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        out = torch.where(max_cols, maxed, summed)
        out = torch.where(max_cols & torch.isneginf(out), torch.full_like(out, float("nan")), out)
        out[:, self.layout.loss] /= world  # the mean over ranks; the ok column stays a count
        return out

    # ------------------------------------------------------------------ metrics

    def _count_calls(self, host: np.ndarray) -> None:
        """Add the read-back rows' call counts to the coverage totals (each head column holds the same count)."""
        counts = host[:, self.layout.counts]
        nc, offset = len(COUNT_FIELDS), 0
        for layer, h in enumerate(self.head_counts):
            block = counts[:, offset: offset + nc * h].reshape(len(host), nc, h)
            for name in CALL_FIELDS:
                col = block[:, COUNT_FIELDS.index(name), 0]
                self._calls[layer][name] += int(np.nansum(col))
            offset += nc * h

    def _metrics(self, step: int, row: np.ndarray) -> StepMetrics:
        raw = self.layout.unpack(row)
        stab = np.zeros(self.shape)
        routing = "routing" not in self.disabled
        for (layer, head) in self.switched:  # 1 where the switch is applied to every call of the layer
            if routing and not self.observation.sites[layer].reasons.get(NOT_APPLIED):
                stab[layer, head] = 1.0
        values, self._delta_cum, broken = derive_metrics(raw, self._pad, self._delta_cum, stab)
        if broken.any():
            layer, head = map(int, np.argwhere(broken)[0])
            self._problem("delta", f"non-finite delta_err_sum at step {step}, layer {self.layer_names[layer]}, "
                                   f"head {head} with finite attention rows")
        return StepMetrics(step=step, loss=float(row[self.layout.loss]), values=values)

    def coverage(self) -> List[LayerCoverage]:
        """What was observed, per layer, over the steps read back so far (no host sync).

        Returns:
            One :class:`~instability_watch.observe.LayerCoverage` per watched
            layer: ``layer_name``, ``observed_calls``, ``unobserved_calls``
            (reason -> count), ``shadow_calls``, ``shadow_skipped``,
            ``kernel_calls`` and ``not_applied``, counted on probe steps.
        """
        if self.observation is None:
            return []
        return self.observation.coverage(self._calls)

    def _check_coverage(self) -> None:
        """After the first probe step: nothing observable is an error naming the reasons."""
        if "statistics" in self.disabled:  # turned off by a failure (reported): nothing to judge
            self._coverage_checked = True
            return
        cov = self.coverage()
        if any(c.observed_calls for c in cov):
            self._coverage_checked = True
            return
        reasons: Dict[str, int] = {}
        for c in cov:
            for r, n in c.unobserved_calls.items():
                reasons[r] = reasons.get(r, 0) + n
        if not reasons:
            return  # no watched layer ran yet: look again after the next probe step
        self._coverage_checked = True
        listed = "; ".join(f"{r} ({n} calls)" for r, n in reasons.items())
        raise ValueError(f"instability_watch observed no attention call on the first probe step: {listed}")

    # ------------------------------------------------------------------ detection and action

    def _detect(self, m: StepMetrics) -> List[Alert]:
        new: List[Alert] = []
        for kind, detector in self.detectors.items():
            for layer, head, value, threshold, message in detector.update(m.step, m.values[detector.metric]):
                action = "reported"
                if kind == "logit_growth" and self.config.qk_clip:
                    if self.config.qk_clip == "on_alert":
                        self._enable_clip(layer, head, m.step, kind)
                    action = f"QK-clip on (tau {self.config.qk_clip_tau:g})"
                elif (
                    self.config.auto_switch and kind in self.config.switch_on
                    and (layer, head) not in self.switched
                ):
                    self.switch(layer, head, reason=kind, step=m.step)
                    action = "switched to the stabilized kernel"
                elif (layer, head) in self.switched and kind in self.config.switch_on:
                    action = "already on the stabilized kernel"
                alert = Alert(m.step, layer, head, kind, value, threshold, message, self.layer_names[layer], action)
                new.append(alert)
                log_rank_zero(
                    logging.INFO, "instability_watch: step %d, %s head %d: %s alert: %s [%s]",
                    m.step, alert.layer_name, head, kind, message, action,
                )
        self.alerts.extend(new)
        return new

    def switch(self, layer: int, head: int, reason: str = "manual", step: Optional[int] = None) -> None:
        """Move one head to the stabilized kernel (sticky; recorded as an event).

        The head's layer then runs every call on our kernels (standard for its
        other heads). A call they cannot serve stays on PyTorch's SDPA, and a
        ``switch_not_applied`` event says why.
        """
        if self.observation is None:
            raise WatchError("the watch is not attached (see watch.disabled)")
        if not 0 <= layer < len(self.head_counts):
            raise ValueError(f"layer must be in [0, {len(self.head_counts)}), got {layer}")
        if (layer, head) in self.switched:
            return
        self.observation.set_stabilized(layer, head, True)
        step = self.step_count if step is None else step
        self.switched[(layer, head)] = step
        self.events.append(Event(step, layer, head, "switch", reason, self.layer_names[layer]))
        site = self.observation.sites[layer]
        for why in site.reasons.get(NOT_APPLIED, []):  # already known for this layer
            self.events.append(Event(step, layer, head, "switch_not_applied", why, site.name))

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything needed to resume identically, in plain Python types.

        Includes switched heads, cumulative delta sums, detector state, the
        spectral warm-start vectors, coverage counts and the steps not yet
        read back (a host sync). Under ``torch.distributed`` call :meth:`flush`
        on every rank first: pending rows are this rank's alone (the Lightning
        and Hugging Face callbacks do this).
        """
        pending: List[List[float]] = []
        if self._pending_steps and self.distributed:
            # this rank's rows, not yet reduced: resumed on every rank, rank 0's would count world-size times
            self._problem("state_dict", "state_dict() under torch.distributed with steps not yet read back: call "
                          "watch.flush() on every rank first (the callbacks do), or those steps are counted wrongly "
                          "after a resume")
        if self._pending_steps and self._ring is not None:
            pending = self._ring[: len(self._pending_steps)].cpu().tolist()
        return {
            "version": STATE_VERSION,
            "step": self.step_count,
            "layers": list(self.layer_names),
            "heads": list(self.head_counts),
            "switched": [[l, h, s] for (l, h), s in sorted(self.switched.items())],
            "delta_cum": self._delta_cum.tolist() if self.head_counts else [],
            "detectors": {k: d.state_dict() for k, d in getattr(self, "detectors", {}).items()},
            "spectral": self.spectral.state_dict(),
            "pending_steps": list(self._pending_steps),
            "flushed_through": self._flushed_through,
            "pending": pending,
            "calls": [dict(c) for c in self._calls],
            "coverage_checked": self._coverage_checked,
            "alerts": [a.to_dict() for a in self.alerts],
            "events": [e.to_dict() for e in self.events],
            "qk_clip": {"enabled": [[l, h, s] for (l, h), s in sorted(self.clip_enabled.items())],
                        "counts": self.clip_counts.tolist() if self.head_counts else []},
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; the model must have the same watched layers.

        Everything is checked before anything is applied: a state that does
        not fit raises ``ValueError`` naming the key, and the watch is unchanged.
        """
        if self.observation is None:  # attaching failed (reported); nothing to restore into
            return
        parsed = self._parse_state(state)
        # -- apply (nothing below raises on a parsed state)
        self.step_count = parsed["step"]
        self.observation.reset_switches()
        self.switched = {}
        for (layer, head), s in parsed["switched"].items():
            self.observation.set_stabilized(layer, head, True)
            self.switched[(layer, head)] = s
        self._delta_cum = parsed["delta_cum"]
        for kind, d in self.detectors.items():
            if kind in parsed["detectors"]:
                d.load_state_dict(parsed["detectors"][kind])
        self.spectral.load_state_dict(parsed["spectral"])
        self._pending_steps = parsed["pending_steps"]
        self._flushed_through = parsed["flushed_through"]
        self._calls = parsed["calls"]
        self._coverage_checked = parsed["coverage_checked"]
        self._ring = None
        if self._pending_steps:
            ring = self._ensure_ring()
            ring[: len(self._pending_steps)].copy_(parsed["pending"].to(ring.device))
        self.alerts = parsed["alerts"]
        self.events = parsed["events"]
        self.clip_enabled = parsed["clip_enabled"]
        self.clip_counts = parsed["clip_counts"]
        self._clip_mask = None  # rebuilt on the next probe step
        self._armed = (False, False)
        self._arm(self.step_count + 1)

    def _parse_state(self, state) -> dict:
        """Check a state from :meth:`state_dict` against this watch; every problem names its key."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not an InstabilityWatch state of version {STATE_VERSION} (got version {got!r})")

        def need(key):
            if key not in state:
                raise ValueError(f"InstabilityWatch state: missing key {key!r}")
            return state[key]

        def integer(key, value=None):
            v = need(key) if value is None else value
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"InstabilityWatch state: {key!r} must be a non-negative int, got {v!r}")
            return v

        if need("layers") != self.layer_names or need("heads") != self.head_counts:
            raise ValueError(
                f"state was saved for layers {state['layers']} with heads {state['heads']}, "
                f"this watch has {self.layer_names} with {self.head_counts}"
            )
        out = {"step": integer("step"), "flushed_through": integer("flushed_through")}
        def heads(key, items):
            found = {}
            for item in items:
                if not (isinstance(item, (list, tuple)) and len(item) == 3):
                    raise ValueError(f"InstabilityWatch state: {key!r} entries must be [layer, head, step], got {item!r}")
                layer, head, s = (integer(key, x) for x in item)
                if layer >= len(self.head_counts) or head >= self.head_counts[layer]:
                    raise ValueError(f"InstabilityWatch state: {key!r} names layer {layer} head {head}, "
                                     f"which this watch does not have")
                found[(layer, head)] = s
            return found

        out["switched"] = heads("switched", need("switched"))
        clip = state.get("qk_clip", {"enabled": [], "counts": []})  # states saved before qk_clip have none
        if not isinstance(clip, dict):
            raise ValueError("InstabilityWatch state: 'qk_clip' must be a dict")
        out["clip_enabled"] = heads("qk_clip.enabled", clip.get("enabled", []))
        counts = clip.get("counts", [])
        try:
            out["clip_counts"] = (np.asarray(counts, dtype=np.int64).reshape(self.shape) if len(counts)
                                  else np.zeros(self.shape, dtype=np.int64))
        except (TypeError, ValueError):
            raise ValueError(f"InstabilityWatch state: 'qk_clip.counts' must be {self.shape} integers") from None
        try:
            out["delta_cum"] = np.asarray(need("delta_cum"), dtype=np.float64).reshape(self.shape)
        except (TypeError, ValueError):
            raise ValueError(f"InstabilityWatch state: 'delta_cum' must be {self.shape} numbers") from None
        detectors = need("detectors")
        if not isinstance(detectors, dict):
            raise ValueError("InstabilityWatch state: 'detectors' must be a dict")
        for kind, d in self.detectors.items():  # load into copies first: nothing changes if one fails
            if kind in detectors:
                probe = build_detectors(self.config, self.shape)[kind]
                try:
                    probe.load_state_dict(detectors[kind])
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"InstabilityWatch state: 'detectors'[{kind!r}]: {exc}") from None
        out["detectors"] = detectors
        spectral = need("spectral")
        try:
            SpectralNorms().load_state_dict(spectral)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"InstabilityWatch state: 'spectral': {exc}") from None
        out["spectral"] = spectral
        out["pending_steps"] = [integer("pending_steps", s) for s in need("pending_steps")]
        pending = need("pending")
        try:
            t = torch.tensor(pending, dtype=torch.float64) if pending else torch.zeros(0, self.layout.width,
                                                                                       dtype=torch.float64)
        except (TypeError, ValueError):
            raise ValueError("InstabilityWatch state: 'pending' must be rows of numbers") from None
        if t.shape != (len(out["pending_steps"]), self.layout.width):
            raise ValueError(f"InstabilityWatch state: 'pending' has shape {tuple(t.shape)}, expected "
                             f"({len(out['pending_steps'])}, {self.layout.width})")
        out["pending"] = t
        calls = state.get("calls", [dict.fromkeys(CALL_FIELDS, 0) for _ in self.head_counts])
        if not (isinstance(calls, list) and len(calls) == len(self.head_counts)
                and all(isinstance(c, dict) for c in calls)):
            raise ValueError("InstabilityWatch state: 'calls' must hold one dict per layer")
        out["calls"] = [{k: int(c.get(k, 0)) for k in CALL_FIELDS} for c in calls]
        out["coverage_checked"] = bool(state.get("coverage_checked", True))
        try:
            out["alerts"] = [Alert(**a) for a in need("alerts")]
            out["events"] = [Event(**e) for e in need("events")]
        except TypeError as exc:
            raise ValueError(f"InstabilityWatch state: 'alerts'/'events' entries do not fit ({exc})") from None
        return out

    # ------------------------------------------------------------------ summaries

    def summary(self) -> Dict[str, float]:
        """A few aggregate scalars of the last read-back step (for loggers)."""
        if not self.last_metrics:
            return {}
        m = self.last_metrics[-1]
        with np.errstate(all="ignore"):
            out = {
                "multi_max_freq_max": float(np.nanmax(m["multi_max_freq"])) if np.isfinite(m["multi_max_freq"]).any() else math.nan,
                "max_score_max": float(np.nanmax(m["max_score"])) if np.isfinite(m["max_score"]).any() else math.nan,
                "delta_cum_absmax": float(np.nanmax(np.abs(m["delta_cum"]))),
                "nonfinite_rows": float(np.nansum(m["nonfinite_rows"])),
                "switched_heads": float(len(self.switched)),
                "alerts": float(len(self.alerts)),
            }
        sig = [x["sigma_wq"] for x in self.last_metrics if np.isfinite(x["sigma_wq"]).any()]
        if sig:
            out["sigma_wq_max"] = float(np.nanmax(sig[-1]))
        return out
