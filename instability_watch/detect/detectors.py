"""Early-warning rules: per-head metric streams in, :class:`Alert` records out.

Every detector sees one step at a time, as an array ``(L, H)`` of float64
(layers x heads) in which ``NaN`` marks "no observation this step" (a head that
does not exist in a narrower layer, a step without a shadow or spectral
computation). All arithmetic is vectorised over heads with numpy on the host;
the watch runs the detectors once per logging step over the steps it has just
read back.

Each kind alerts at most once per head (the alert is latched); the metric keeps
going to the CSV. Baselines come from the warm-up window ``step <=
warmup_steps``; no baseline-relative alert fires inside it. What each kind
means, its message and what to do about it are in
:data:`~instability_watch.detect.kinds.ALERT_KINDS`; each detector class states its
rule in terms of its ``WatchConfig`` fields.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from instability_watch.detect.kinds import ALERT_KINDS, KINDS


@dataclass(frozen=True)
class Alert:
    """One early warning about one head.

    Attributes:
        step: optimizer step at which the rule tripped.
        layer, head: the watched layer's index (module order) and query head.
        kind: one of :data:`KINDS`.
        value: the metric that tripped (its units: ``ALERT_KINDS[kind].units``).
        threshold: what it was compared against.
        message: one plain sentence.
        layer_name: the layer's module name.
        action: what was done: ``"reported"``, ``"switched to the stabilized kernel"`` (or ``"... the exact
            delta"``), ``"already on ..."``, or QK-clip's.
    """

    step: int
    layer: int
    head: int
    kind: str
    value: float
    threshold: float
    message: str
    layer_name: str = ""
    action: str = "reported"

    def to_dict(self) -> dict:
        """The fields as a plain ``dict`` (JSON-ready)."""
        return asdict(self)


Trip = Tuple[int, int, float, float, str]  # (layer, head, value, threshold, message)

__all__ = ["KINDS", "Alert", "Trip", "Detector", "MultiMaxRise", "LogitGrowth", "DeltaDrift", "SpectralGrowth",
           "NonFinite", "build_detectors"]


def _as_list(a: Optional[np.ndarray]):
    return None if a is None else np.asarray(a, dtype=np.float64).tolist()


def _from_list(x, shape, fill=np.nan) -> np.ndarray:
    if x is None:
        return np.full(shape, fill)
    a = np.asarray(x, dtype=np.float64)
    if a.shape != shape:
        raise ValueError(f"detector state has shape {a.shape}, the watched model has {shape}")
    return a


class Detector:
    """Base: latching, warm-up bookkeeping and plain-type state.

    Args:
        shape: ``(L, H)``: watched layers x the widest layer's heads.
        warmup_steps: the last step of the warm-up window (baselines form inside it).

    ``metric`` names the per-step metric the rule reads (a key of
    ``StepMetrics.values``; see ``watch.derive_metrics``); ``kind`` is its key
    in :data:`~instability_watch.detect.kinds.ALERT_KINDS`.
    """

    kind = ""
    metric = ""
    sustain = 0
    _state_arrays: Tuple[str, ...] = ()

    def __init__(self, shape: Tuple[int, int], warmup_steps: int) -> None:
        self.shape = tuple(shape)
        self.warmup_steps = int(warmup_steps)
        self.fired = np.zeros(self.shape, dtype=bool)  # (L, H) bool: latched heads

    def update(self, step: int, x: np.ndarray) -> List[Trip]:
        """Feed step ``step``'s metric ``x`` (float64 ``(L, H)``, ``NaN``: not observed); return the new trips
        as ``(layer, head, value, threshold, message)``."""
        raise NotImplementedError

    def message(self, value: float, threshold: float) -> str:
        """One trip's sentence, from :data:`~instability_watch.detect.kinds.ALERT_KINDS`."""
        return ALERT_KINDS[self.kind].describe(value, threshold, self.sustain)

    def _trips(self, hit: np.ndarray, value: np.ndarray, threshold: np.ndarray) -> List[Trip]:
        hit = hit & ~self.fired
        self.fired |= hit
        out = []
        for layer, head in zip(*np.nonzero(hit)):
            v, t = float(value[layer, head]), float(threshold[layer, head])
            out.append((int(layer), int(head), v, t, self.message(v, t)))
        return out

    def state_dict(self) -> dict:
        """The detector's state as plain lists and numbers (``(L, H)`` arrays as nested lists)."""
        state = {"fired": self.fired.tolist(), "warmup_steps": self.warmup_steps}
        for name in self._state_arrays:
            state[name] = _as_list(getattr(self, name))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; ``ValueError`` if its arrays are not ``(L, H)``."""
        # the warm-up's end moves when a watch starts on a resumed model (InstabilityWatch.start_at)
        self.warmup_steps = int(state.get("warmup_steps", self.warmup_steps))
        self.fired = _from_list(state["fired"], self.shape).astype(bool)
        for name in self._state_arrays:
            setattr(self, name, _from_list(state[name], self.shape))


class _Baseline:
    """Mean of a stream over the warm-up window, per head."""

    def __init__(self, shape) -> None:
        self.sum = np.zeros(shape)
        self.n = np.zeros(shape)

    def add(self, x: np.ndarray) -> None:
        ok = np.isfinite(x)
        self.sum[ok] += x[ok]
        self.n[ok] += 1

    @property
    def mean(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.n > 0, self.sum / np.maximum(self.n, 1), np.nan)


class _WithBaseline(Detector):
    """A detector with a warm-up baseline; its arrays are part of the state."""

    _state_arrays = ("base_sum", "base_n", "run")

    base_sum = property(lambda self: self._base.sum, lambda self, v: setattr(self._base, "sum", v))
    base_n = property(lambda self: self._base.n, lambda self, v: setattr(self._base, "n", v))

    def __init__(self, shape, warmup_steps: int, sustain: int) -> None:
        super().__init__(shape, warmup_steps)
        self.sustain = int(sustain)
        self._base = _Baseline(self.shape)
        self.run = np.zeros(self.shape)  # consecutive observations over threshold


class _Sustained(_WithBaseline):
    """Baseline-relative level rule: ``x > threshold(baseline)`` for ``sustain`` observations.

    ``factor`` scales the baseline; ``floor`` is the rule's other bound (see :meth:`threshold`).
    """

    def __init__(self, shape, warmup_steps: int, sustain: int, factor: float, floor: float) -> None:
        super().__init__(shape, warmup_steps, sustain)
        self.factor, self.floor = float(factor), float(floor)

    def threshold(self, base: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def update(self, step: int, x: np.ndarray) -> List[Trip]:
        """See :meth:`Detector.update`: ``x`` is float64 ``(L, H)``, ``NaN`` where not observed."""
        seen = np.isfinite(x)
        if step <= self.warmup_steps:
            self._base.add(x)
            return []
        base = self._base.mean
        # Heads with no warm-up observation take their first observation as the baseline.
        late = seen & (self._base.n == 0)
        if late.any():
            self._base.add(np.where(late, x, np.nan))
            base = self._base.mean
        thr = self.threshold(base)
        above = seen & (x > thr)
        self.run = np.where(above, self.run + 1, np.where(seen, 0, self.run))
        return self._trips(self.run >= self.sustain, x, thr)


class MultiMaxRise(_Sustained):
    """``multi_max``: the multi-max frequency (float64 ``(L, H)``, a fraction of rows) above
    ``min(max(factor * baseline, baseline + floor), baseline + (1 - baseline) / 2)`` for ``sustain``
    consecutive probe steps (``factor = multi_max_factor``, ``floor = multi_max_min_rise``)."""

    kind = "multi_max"
    metric = "multi_max_freq"

    def threshold(self, base: np.ndarray) -> np.ndarray:
        """The level per head (float64 ``(L, H)``) for a baseline ``base`` (float64 ``(L, H)``)."""
        # capped halfway between the baseline and 1, so a head that starts high can still alert
        return np.minimum(np.maximum(self.factor * base, base + self.floor), base + (1.0 - base) / 2)


class LogitGrowth(_Sustained):
    """``logit_growth``: the largest attention logit (float64 ``(L, H)``) above ``max(floor, factor *
    |baseline|)`` for ``sustain`` consecutive probe steps (``factor = logit_factor``, ``floor = logit_min``)."""

    kind = "logit_growth"
    metric = "max_score"

    def threshold(self, base: np.ndarray) -> np.ndarray:
        """The level per head (float64 ``(L, H)``) for a baseline ``base`` (float64 ``(L, H)``)."""
        return np.maximum(self.floor, self.factor * np.abs(base))


class DeltaDrift(Detector):
    """``delta_drift``: a two-sided CUSUM of the signs of the per-shadow-step ``sum(delta_lp - delta_hp)``
    (float64 ``(L, H)``; +1 / -1 per shadow step, allowance ``k``) exceeds ``h``."""

    kind = "delta_drift"
    metric = "delta_err_sum"
    _state_arrays = ("pos", "neg", "n_obs")

    def __init__(self, shape, warmup_steps: int, k: float, h: float) -> None:
        super().__init__(shape, warmup_steps)
        self.k, self.h = float(k), float(h)
        self.pos = np.zeros(self.shape)
        self.neg = np.zeros(self.shape)
        self.n_obs = np.zeros(self.shape)

    def update(self, step: int, x: np.ndarray) -> List[Trip]:
        """See :meth:`Detector.update`: ``x`` is float64 ``(L, H)``, ``NaN`` where not observed."""
        seen = np.isfinite(x)
        if not seen.any():
            return []
        s = np.where(seen, np.sign(np.where(seen, x, 0.0)), 0.0)
        self.pos = np.where(seen, np.maximum(0.0, self.pos + s - self.k), self.pos)
        self.neg = np.where(seen, np.maximum(0.0, self.neg - s - self.k), self.neg)
        self.n_obs += seen
        if step <= self.warmup_steps:
            return []
        stat = np.maximum(self.pos, self.neg)
        thr = np.full(self.shape, self.h)
        return self._trips(seen & (stat > self.h), stat, thr)


class SpectralGrowth(_WithBaseline):
    """``spectral_growth``: sigma(W_Q[h]) (float64 ``(L, H)``) over its warm-up baseline exceeds ``rel_factor``
    times the median head's growth (or ``abs_factor``, if set and lower) for ``sustain`` spectral steps."""

    kind = "spectral_growth"
    metric = "sigma_wq"

    def __init__(self, shape, warmup_steps: int, sustain: int, rel_factor: float, abs_factor: Optional[float]) -> None:
        super().__init__(shape, warmup_steps, sustain)
        self.rel_factor = float(rel_factor)
        self.abs_factor = None if abs_factor is None else float(abs_factor)

    def update(self, step: int, x: np.ndarray) -> List[Trip]:
        """See :meth:`Detector.update`: ``x`` is float64 ``(L, H)``, ``NaN`` where not observed."""
        seen = np.isfinite(x) & (x > 0)
        if not seen.any():
            return []
        if step <= self.warmup_steps or not (self._base.n > 0).any():
            self._base.add(np.where(seen, x, np.nan))
            return []
        late = seen & (self._base.n == 0)
        if late.any():
            self._base.add(np.where(late, x, np.nan))
        with np.errstate(invalid="ignore", divide="ignore"):
            growth = np.where(seen, x / self._base.mean, np.nan)
        ok = np.isfinite(growth) & (growth > 0)
        thr = np.full(self.shape, np.inf)
        if ok.sum() >= 3:  # a median needs a few heads to mean anything
            median = float(np.median(growth[ok]))
            thr = np.full(self.shape, self.rel_factor * median)
        if self.abs_factor is not None:
            thr = np.minimum(thr, self.abs_factor)
        above = ok & (growth > thr)
        self.run = np.where(above, self.run + 1, np.where(ok, 0, self.run))
        return self._trips(self.run >= self.sustain, np.where(ok, growth, np.nan), thr)


class NonFinite(Detector):
    """``nonfinite``: any non-finite attention row, logit or sigma(W_Q) (a count, float64 ``(L, H)``), at once."""

    kind = "nonfinite"
    metric = "nonfinite"

    def update(self, step: int, x: np.ndarray) -> List[Trip]:
        """See :meth:`Detector.update`: ``x`` is float64 ``(L, H)``, ``NaN`` where not observed."""
        hit = np.isfinite(x) & (x > 0)
        return self._trips(hit, np.where(hit, x, 0.0), np.zeros(self.shape))


def build_detectors(config, shape: Tuple[int, int]) -> Dict[str, Detector]:
    """The detectors ``config.detectors`` names, configured from a :class:`~instability_watch.WatchConfig`,
    for ``shape = (L, H)`` (layers x the widest layer's heads)."""
    c = config
    make = {
        "multi_max": lambda: MultiMaxRise(shape, c.warmup_steps, c.sustain, c.multi_max_factor, c.multi_max_min_rise),
        "delta_drift": lambda: DeltaDrift(shape, c.warmup_steps, c.delta_cusum_k, c.delta_cusum_h),
        "spectral_growth": lambda: SpectralGrowth(
            shape, c.warmup_steps, c.sustain, c.spectral_rel_factor, c.spectral_abs_factor
        ),
        "logit_growth": lambda: LogitGrowth(shape, c.warmup_steps, c.sustain, c.logit_factor, c.logit_min),
        "nonfinite": lambda: NonFinite(shape, c.warmup_steps),
    }
    return {kind: make[kind]() for kind in c.detectors}
