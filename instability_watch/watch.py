"""``InstabilityWatch``: the framework-free engine.

Use it in any training loop::

    watch = InstabilityWatch(model, WatchConfig(auto_switch=True))
    for batch in data:
        loss = model(batch)            # attention runs through our kernels,
        loss.backward()                # each layer's probe accumulates on device
        optimizer.step(); optimizer.zero_grad()
        for alert in watch.step(loss): # once per optimizer step
            print(alert.message)
    watch.detach()

What happens at each :meth:`InstabilityWatch.step` (no host sync):

1. every layer's probe is copied into one row of a device-side ring buffer
   (one concatenation per buffer type, no per-layer copies) and reset;
2. on spectral steps, sigma(W_Q) per head (:mod:`~instability_watch.spectral`)
   goes into the same row; the loss too;
3. the next step's shadow flag is set.

Every ``log_every`` steps the ring is read back in one transfer (the one host
sync), reduced across ranks first under ``torch.distributed``, turned into
per-step metrics, and fed step by step to the detectors; alerts are logged,
switch decisions are written into the layers' ``stabilize`` masks, and the
listeners (console, CSV, loggers) receive the metrics and alerts.

Failures inside the watch never stop training: the failing part is reported
once with its traceback and turned off (routing, statistics, spectral,
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

from .attach import Attachment, Layers, _log_rank_zero, _rank, attach
from .config import WatchConfig
from .detectors import Alert, Detector, build_detectors
from .probe import COUNT_FIELDS, VALUE_FIELDS
from .spectral import SpectralNorms

log = logging.getLogger("instability_watch")

STATE_VERSION = 1

# Per-step metric names, in the order the CSV writes them (see README).
METRICS = (
    "rows", "tie_rows", "multi_max_rows", "multi_max_freq", "max_score", "nonfinite_rows",
    "shadow_rows", "delta_err_sum", "delta_err_abs", "delta_err_pos_frac", "delta_cum",
    "sigma_wq", "stabilized",
)


class WatchError(RuntimeError):
    """A failure inside the watch, raised only with ``strict=True``."""


@dataclass
class Event:
    """Something the watch did: ``kind`` is ``"switch"`` (a head moved to the stabilized kernel)."""

    step: int
    layer: int
    head: int
    kind: str
    reason: str
    layer_name: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepMetrics:
    """Metrics of one optimizer step: ``values[name]`` is an ``(L, H_max)`` float array.

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


class InstabilityWatch:
    """Watch every attention head of ``model`` while it trains.

    Args:
        model: the model; attached at construction (its code is not changed).
        config: a :class:`WatchConfig` (defaults if ``None``).
        layers: which layers to watch (see :func:`~instability_watch.attach.attach`):
            ``None`` for the built-in locators, or :class:`AttentionLayer` descriptions.
        listeners: callables ``f(metrics, alerts, watch)`` run after each read-back.

    Attributes:
        step_count: optimizer steps seen (the last step passed to :meth:`step`).
        alerts: every alert so far, in order.
        events: every switch so far.
        switched: ``{(layer, head): step}`` of heads on the stabilized kernel.
        last_metrics: the per-step metrics of the last read-back.
        layer_names, head_counts: the watched layers.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Optional[WatchConfig] = None,
        *,
        layers: Optional[Layers] = None,
        listeners: Sequence[Listener] = (),
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
        self.disabled: Dict[str, str] = {}  # component -> why
        self.attachment: Optional[Attachment] = None
        self.layer_names: List[str] = []
        self.head_counts: List[int] = []
        self._pending_steps: List[int] = []
        self._flushed_through = 0  # last step read back
        self._ring: Optional[torch.Tensor] = None
        self._reported_problems: set = set()
        self.spectral = SpectralNorms()
        try:
            self.attachment = attach(model, layers, beta=config.beta, eps=config.eps)
        except Exception as exc:
            self._fail("attach", exc)
            return
        self.attachment.on_error = lambda exc: self._fail("routing", exc)
        self.layer_names = [s.name for s in self.attachment.sites]
        self.head_counts = self.attachment.head_counts
        shape = (len(self.head_counts), max(self.head_counts))
        self.detectors: Dict[str, Detector] = build_detectors(config, shape)
        self._delta_cum = np.zeros(shape)
        self._pad = np.zeros(shape, dtype=bool)
        for i, h in enumerate(self.head_counts):
            self._pad[i, h:] = True
        self._set_shadow(_due(1, config.shadow_every))

    # ------------------------------------------------------------------ lifecycle

    @property
    def active(self) -> bool:
        """Attached and collecting statistics."""
        return self.attachment is not None and self.attachment.attached and "statistics" not in self.disabled

    @property
    def shape(self) -> Tuple[int, int]:
        return (len(self.head_counts), max(self.head_counts) if self.head_counts else 0)

    def detach(self) -> None:
        """Read back the pending steps (alerts go to the listeners), then restore the model exactly."""
        if self.attachment is None or not self.attachment.attached:
            return
        self.flush()
        self.attachment.detach()

    @property
    def flushed_through(self) -> int:
        """The last step read back (steps after it are still on the device)."""
        return self._flushed_through

    def pause_statistics(self) -> None:
        """Stop collecting (e.g. during validation); attention stays routed, so switched heads stay stabilized."""
        if self.attachment is not None:
            self.attachment.probes = False

    def resume_statistics(self) -> None:
        """Collect again after :meth:`pause_statistics` (unless statistics were turned off by a failure)."""
        if self.attachment is not None and "statistics" not in self.disabled:
            self.attachment.probes = True

    def start_at(self, step: int) -> None:
        """Continue counting after optimizer step ``step`` (a model resumed without watch state).

        Anything pending is discarded; the detectors' warm-up starts again from here.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self.step_count = step
        self._flushed_through = step
        self._pending_steps = []
        if self.attachment is not None:
            self.attachment.bank.zero_()
            shape = self.shape
            self.detectors = build_detectors(self.config, shape)
            for d in self.detectors.values():
                d.warmup_steps = step + self.config.warmup_steps
        self._set_shadow(_due(step + 1, self.config.shadow_every))

    def __enter__(self) -> "InstabilityWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # ------------------------------------------------------------------ failures

    def _fail(self, component: str, exc: BaseException) -> None:
        """Turn ``component`` off and report it once; re-raise with ``strict``."""
        if self.config.strict:
            raise exc
        if component in self.disabled:
            return
        self.disabled[component] = f"{type(exc).__name__}: {exc}"
        if self.attachment is not None:
            if component == "routing":
                self.attachment.routing = False  # every call goes to PyTorch's SDPA
            elif component == "statistics":
                # keep routing: heads already switched stay on the stabilized kernel
                self.attachment.probes = False
        # A failure is reported by the process it happened in (once), with the rank.
        log.error(
            "instability_watch (rank %d): %s failed and is turned off; training goes on. %s",
            _rank(), component, self.disabled[component], exc_info=exc,
        )

    def _problem(self, key: str, message: str) -> None:
        """A bad value inside the watch: ``WatchError`` with ``strict``, else reported once."""
        if self.config.strict:
            raise WatchError(message)
        if key not in self._reported_problems:
            self._reported_problems.add(key)
            _log_rank_zero(logging.WARNING, "instability_watch: %s (ignored; reported once)", message)

    # ------------------------------------------------------------------ the step

    def _set_shadow(self, on: bool) -> None:
        if self.attachment is not None and "shadow" not in self.disabled:
            self.attachment.bank.set_shadow(on)

    def _ensure_ring(self) -> torch.Tensor:
        bank = self.attachment.bank
        total = sum(self.head_counts)
        width = (len(COUNT_FIELDS) + len(VALUE_FIELDS) + 1) * total + 2  # + loss, + ok
        if self._ring is None or self._ring.device != bank.device:
            ring = torch.full((self.config.log_every, width), float("nan"), dtype=torch.float64, device=bank.device)
            if self._ring is not None:
                ring.copy_(self._ring.to(bank.device))
            self._ring = ring
        return self._ring

    def step(self, loss: Optional[torch.Tensor | float] = None) -> List[Alert]:
        """Close optimizer step ``step_count + 1``; every ``log_every`` steps, read back and detect.

        Call it once per optimizer step, after ``optimizer.step()`` (all
        micro-batches of gradient accumulation add up into one step).

        Returns:
            The alerts raised by this call (empty except on read-back steps).
        """
        self.step_count += 1
        s = self.step_count
        if self.attachment is None or not self.attachment.attached:
            return []
        if "statistics" not in self.disabled:
            try:
                self._record(s, loss)
            except Exception as exc:
                self._fail("statistics", exc)
        self._set_shadow(_due(s + 1, self.config.shadow_every))
        if s % self.config.log_every == 0:
            return self.flush()
        return []

    def _record(self, s: int, loss) -> None:
        ring = self._ensure_ring()
        bank = self.attachment.bank
        total = sum(self.head_counts)
        nc, nv = len(COUNT_FIELDS), len(VALUE_FIELDS)
        slot = len(self._pending_steps)
        row = ring[slot]
        row[: nc * total].copy_(bank.counts)
        row[nc * total: (nc + nv) * total].copy_(bank.values)
        sig = row[(nc + nv) * total: -2]
        sig.fill_(float("nan"))
        if _due(s, self.config.spectral_every) and "spectral" not in self.disabled:
            try:
                sigmas = self.spectral(self.attachment.w_q())
                sig.copy_(torch.cat(sigmas).to(sig.device))
            except Exception as exc:
                self._fail("spectral", exc)
        if isinstance(loss, torch.Tensor):
            row[-2:-1].copy_(loss.detach().reshape(-1)[:1])
        else:
            row[-2:-1].fill_(float("nan") if loss is None else float(loss))
        # fill_, not ``row[-1] = 1.0``: item assignment of a Python number copies a
        # host scalar into device memory, which waits for the stream (a sync per step)
        row[-1:].fill_(1.0)  # this rank recorded the step (summed across ranks)
        bank.zero_()
        self._pending_steps.append(s)

    def flush(self) -> List[Alert]:
        """Read back pending steps now (one host sync), run the detectors, act; returns new alerts.

        Under ``torch.distributed`` every rank must call it at the same steps
        (``step`` does, every ``log_every`` steps): a rank whose statistics
        failed still takes part, and then every rank turns statistics off.
        """
        if self.attachment is None:
            return []
        distributed = self._distributed()
        n = self.step_count - self._flushed_through
        if n <= 0 or (not distributed and not self._pending_steps):
            return []
        steps = list(range(self._flushed_through + 1, self.step_count + 1))
        recorded = len(self._pending_steps) == n and "statistics" not in self.disabled
        self._flushed_through = self.step_count
        self._pending_steps = []
        if not distributed and not recorded:
            return []
        try:
            ring = self._ensure_ring()
            if recorded:
                data = ring[:n].clone()
            else:  # this rank has nothing valid: take part with an "unhealthy" block
                data = torch.full((n, ring.shape[1]), float("nan"), dtype=torch.float64, device=ring.device)
                data[:, -1:].fill_(0.0)
            if distributed:
                data = self._reduce(data)
            host = data.cpu().numpy()  # the one host sync
        except Exception as exc:
            self._fail("statistics", exc)
            return []
        healthy_ranks = self._world() if distributed else 1
        if not (host[:, -1] == healthy_ranks).all():
            self._fail("statistics", WatchError("statistics failed on another rank; turned off on every rank"))
            return []
        alerts: List[Alert] = []
        try:
            metrics = [self._metrics(step, host[i]) for i, step in enumerate(steps)]
            if "detectors" not in self.disabled:
                for m in metrics:
                    alerts.extend(self._detect(m))
        except WatchError:
            raise
        except Exception as exc:
            self._fail("detectors", exc)
            return alerts
        self.last_metrics = metrics
        for listener in list(self.listeners):
            try:
                listener(metrics, alerts, self)
            except Exception as exc:
                if self.config.strict:
                    raise
                self.listeners.remove(listener)
                self._fail(f"listener {getattr(listener, '__name__', type(listener).__name__)}", exc)
        return alerts

    def _distributed(self) -> bool:
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
        total = sum(self.head_counts)
        nc, nv = len(COUNT_FIELDS), len(VALUE_FIELDS)
        max_cols = torch.zeros(data.shape[1], dtype=torch.bool)
        i_max = VALUE_FIELDS.index("max_score")
        offs = 0
        for h in self.head_counts:  # max_score sits in each layer's value block
            start = nc * total + nv * offs + i_max * h
            max_cols[start:start + h] = True
            offs += h
        max_cols[(nc + nv) * total: -2] = True  # sigma
        max_cols = max_cols.to(data.device)
        # NaN does not survive all_reduce(MAX) portably: reduce with -inf in its place.
        maxed = torch.where(max_cols & ~torch.isnan(data), data, torch.full_like(data, float("-inf")))
        summed = torch.where(max_cols, torch.zeros_like(data), data)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        out = torch.where(max_cols, maxed, summed)
        out = torch.where(max_cols & torch.isneginf(out), torch.full_like(out, float("nan")), out)
        out[:, -2] /= world  # loss: the mean over ranks; the ok column stays a count
        return out

    # ------------------------------------------------------------------ metrics

    def _unpack(self, row: np.ndarray) -> Dict[str, np.ndarray]:
        L, Hm = self.shape
        total = sum(self.head_counts)
        nc, nv = len(COUNT_FIELDS), len(VALUE_FIELDS)
        out = {name: np.full((L, Hm), np.nan) for name in COUNT_FIELDS + VALUE_FIELDS + ("sigma_wq",)}
        if all(h == Hm for h in self.head_counts):
            counts = row[: nc * total].reshape(L, nc, Hm)
            values = row[nc * total: (nc + nv) * total].reshape(L, nv, Hm)
            for i, name in enumerate(COUNT_FIELDS):
                out[name] = counts[:, i].copy()
            for i, name in enumerate(VALUE_FIELDS):
                out[name] = values[:, i].copy()
            out["sigma_wq"] = row[(nc + nv) * total: -2].reshape(L, Hm).copy()
            return out
        oc = ov = os_ = 0
        for l, h in enumerate(self.head_counts):  # non-uniform layers: per layer, at read-back only
            c = row[oc: oc + nc * h].reshape(nc, h)
            v = row[nc * total + ov: nc * total + ov + nv * h].reshape(nv, h)
            for i, name in enumerate(COUNT_FIELDS):
                out[name][l, :h] = c[i]
            for i, name in enumerate(VALUE_FIELDS):
                out[name][l, :h] = v[i]
            out["sigma_wq"][l, :h] = row[(nc + nv) * total + os_: (nc + nv) * total + os_ + h]
            oc, ov, os_ = oc + nc * h, ov + nv * h, os_ + h
        return out

    def _metrics(self, step: int, row: np.ndarray) -> StepMetrics:
        raw = self._unpack(row)
        pad = self._pad
        m: Dict[str, np.ndarray] = {}
        for name in ("rows", "tie_rows", "multi_max_rows", "nonfinite_rows", "shadow_rows"):
            m[name] = np.where(pad, np.nan, raw[name])
        with np.errstate(invalid="ignore", divide="ignore"):
            m["multi_max_freq"] = np.where(raw["tie_rows"] > 0, raw["multi_max_rows"] / raw["tie_rows"], np.nan)
            max_score = raw["max_score"]
            m["max_score"] = np.where((raw["rows"] > 0) & ~np.isneginf(max_score), max_score, np.nan)
            shadow = (raw["shadow_rows"] > 0) & ~pad
            dsum = np.where(shadow, raw["delta_err_sum"], np.nan)
            dabs = np.where(shadow, raw["delta_err_abs"], np.nan)
            dpos = np.where(shadow, raw["delta_err_pos"] / np.maximum(raw["shadow_rows"], 1), np.nan)
        broken = shadow & ~np.isfinite(dsum) & ~(raw["nonfinite_rows"] > 0)
        if broken.any():
            l, h = map(int, np.argwhere(broken)[0])
            self._problem("delta", f"non-finite delta_err_sum at step {step}, layer {self.layer_names[l]}, head {h} "
                                   "with finite attention rows")
        good = shadow & np.isfinite(dsum)
        self._delta_cum = np.where(good, self._delta_cum + np.where(good, dsum, 0.0), self._delta_cum)
        m["delta_err_sum"] = np.where(shadow & ~broken, dsum, np.nan)
        m["delta_err_abs"] = np.where(shadow & ~broken, dabs, np.nan)
        m["delta_err_pos_frac"] = dpos
        m["delta_cum"] = np.where(pad, np.nan, self._delta_cum.copy())
        m["sigma_wq"] = np.where(pad, np.nan, raw["sigma_wq"])
        stab = np.zeros(self.shape)
        for (l, h) in self.switched:
            stab[l, h] = 1.0
        m["stabilized"] = np.where(pad, np.nan, stab)
        values = {k: m[k] for k in METRICS}
        # not a CSV column: a logit that is NaN or +inf where rows ran (for the nonfinite rule)
        values["_bad_logit"] = ((raw["rows"] > 0) & (np.isnan(max_score) | np.isposinf(max_score))).astype(float)
        return StepMetrics(step=step, loss=float(row[-2]), values=values)

    # ------------------------------------------------------------------ detection and action

    def _detector_input(self, kind: str, m: StepMetrics) -> np.ndarray:
        if kind == "multi_max":
            return m["multi_max_freq"]
        if kind == "logit_growth":
            return m["max_score"]
        if kind == "delta_drift":
            return m["delta_err_sum"]
        if kind == "spectral_growth":
            return m["sigma_wq"]
        # nonfinite: broken rows, a logit that is NaN/+inf, a sigma(W_Q) that is not finite
        bad = np.nan_to_num(m["nonfinite_rows"], nan=0.0) + m.values["_bad_logit"]
        sig = m["sigma_wq"]
        return np.where(self._pad, np.nan, bad + (~np.isnan(sig) & ~np.isfinite(sig)))

    def _detect(self, m: StepMetrics) -> List[Alert]:
        new: List[Alert] = []
        for kind, detector in self.detectors.items():
            for layer, head, value, threshold, message in detector.update(m.step, self._detector_input(kind, m)):
                action = "reported"
                if (
                    self.config.auto_switch and kind in self.config.switch_on
                    and (layer, head) not in self.switched
                ):
                    self.switch(layer, head, reason=kind, step=m.step)
                    action = "switched to the stabilized kernel"
                elif (layer, head) in self.switched and kind in self.config.switch_on:
                    action = "already on the stabilized kernel"
                alert = Alert(m.step, layer, head, kind, value, threshold, message, self.layer_names[layer], action)
                new.append(alert)
                _log_rank_zero(
                    logging.INFO, "instability_watch: step %d, %s head %d: %s alert: %s [%s]",
                    m.step, alert.layer_name, head, kind, message, action,
                )
        self.alerts.extend(new)
        return new

    def switch(self, layer: int, head: int, reason: str = "manual", step: Optional[int] = None) -> None:
        """Move one head to the stabilized kernel (sticky; recorded as an event)."""
        if not 0 <= layer < len(self.head_counts):
            raise ValueError(f"layer must be in [0, {len(self.head_counts)}), got {layer}")
        if (layer, head) in self.switched:
            return
        self.attachment.set_stabilized(layer, head, True)
        step = self.step_count if step is None else step
        self.switched[(layer, head)] = step
        self.events.append(Event(step, layer, head, "switch", reason, self.layer_names[layer]))

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything needed to resume identically, in plain Python types.

        Includes switched heads, cumulative delta sums, detector state, the
        spectral warm-start vectors and the steps not yet read back (a host sync).
        """
        pending: List[List[float]] = []
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
            "alerts": [a.to_dict() for a in self.alerts],
            "events": [e.to_dict() for e in self.events],
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; the model must have the same watched layers."""
        if self.attachment is None:  # attaching failed (reported); nothing to restore into
            return
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not an InstabilityWatch state (version {STATE_VERSION}): {type(state).__name__}")
        if state["layers"] != self.layer_names or state["heads"] != self.head_counts:
            raise ValueError(
                f"state was saved for layers {state['layers']} with heads {state['heads']}, "
                f"this watch has {self.layer_names} with {self.head_counts}"
            )
        self.step_count = int(state["step"])
        for site in self.attachment.sites:
            site.stabilize.zero_()
        self.switched = {}
        for l, h, s in state["switched"]:
            self.attachment.set_stabilized(int(l), int(h), True)
            self.switched[(int(l), int(h))] = int(s)
        self._delta_cum = np.asarray(state["delta_cum"], dtype=np.float64).reshape(self.shape)
        for kind, d in self.detectors.items():
            if kind in state["detectors"]:
                d.load_state_dict(state["detectors"][kind])
        self.spectral.load_state_dict(state["spectral"])
        self._pending_steps = [int(s) for s in state["pending_steps"]]
        self._flushed_through = int(state.get("flushed_through", self.step_count - len(self._pending_steps)))
        self._ring = None
        if self._pending_steps:
            ring = self._ensure_ring()
            ring[: len(self._pending_steps)].copy_(torch.tensor(state["pending"], dtype=torch.float64))
        self.alerts = [Alert(**a) for a in state["alerts"]]
        self.events = [Event(**e) for e in state["events"]]
        self._set_shadow(_due(self.step_count + 1, self.config.shadow_every))

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
