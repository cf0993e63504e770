"""Per-step metrics from the raw probe sums read back from the device (pure functions and small holders).

:data:`METRICS` names the per-head metrics in the order the run directory
writes them; :class:`StepMetrics` holds one observed step of them;
:func:`derive_metrics` computes them from one ring row;
:class:`MetricsBuilder` keeps what they need across read-backs (the running
``sum(delta_lp - delta_hp)``, which heads are padding); :class:`CallTotals`
adds up the call counts that :meth:`InstabilityWatch.coverage` reports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np

from instability_watch.probe.fields import CALL_FIELDS, COUNT_FIELDS

# Per-step metric names, in the order the CSV writes them (see README).
METRICS = (
    "rows", "multi_max_rows", "multi_max_freq", "masked_rows", "max_score", "nonfinite_rows",
    "shadow_rows", "delta_err_sum", "delta_err_abs", "delta_err_pos_frac", "delta_cum",
    "sigma_wq", "stabilized",
)


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


def derive_metrics(
    raw: Dict[str, np.ndarray], pad: np.ndarray, delta_cum: np.ndarray, stabilized: np.ndarray
) -> Tuple[Dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Per-step metrics from one step's raw probe sums (a pure function).

    Args:
        raw: :meth:`~instability_watch.engine.ring.RingColumns.unpack` of the step's row.
        pad: ``(L, H_max)`` True where a layer has fewer heads.
        delta_cum: the running ``sum(delta_lp - delta_hp)`` before this step (NaN for a head no shadow
            pass has measured yet).
        stabilized: ``(L, H_max)`` 1 where the head's switch is applied (the stabilized kernel, or with
            ``switch_to="exact_delta"`` its layer's exact delta).

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
    # NaN until the head's first shadow observation (no pass ran: nothing measured, not a sum of 0)
    delta_cum = np.where(good, np.nan_to_num(delta_cum, nan=0.0) + np.where(good, dsum, 0.0), delta_cum)
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


def head_shape(head_counts: Sequence[int]) -> Tuple[int, int]:
    """``(L, H)``: layers x the widest layer's heads, the shape of every per-head array."""
    return (len(head_counts), max(head_counts) if head_counts else 0)


class MetricsBuilder:
    """Turns read-back rows into :class:`StepMetrics`, keeping the running drift sum across read-backs.

    Attributes:
        delta_cum: ``(L, H)`` running ``sum(delta_lp - delta_hp)`` per head (NaN before its first shadow
            observation).
        pad: ``(L, H)`` True where a layer has fewer heads than the widest.
    """

    def __init__(self, head_counts: Sequence[int]) -> None:
        self.shape = head_shape(head_counts)
        self.delta_cum = np.full(self.shape, np.nan)  # NaN until a head's first shadow observation
        self.pad = np.zeros(self.shape, dtype=bool)
        for i, h in enumerate(head_counts):
            self.pad[i, h:] = True

    def build(self, step: int, raw: Dict[str, np.ndarray], loss: float,
              stabilized: np.ndarray) -> Tuple[StepMetrics, np.ndarray]:
        """One step's metrics from its unpacked row; also ``broken`` (see :func:`derive_metrics`)."""
        values, self.delta_cum, broken = derive_metrics(raw, self.pad, self.delta_cum, stabilized)
        return StepMetrics(step=step, loss=loss, values=values), broken


class CallTotals:
    """Per layer, the call counts read back so far (what :meth:`InstabilityWatch.coverage` reports)."""

    def __init__(self, head_counts: Sequence[int]) -> None:
        self.head_counts = list(head_counts)
        self.per_layer: List[Dict[str, int]] = [dict.fromkeys(CALL_FIELDS, 0) for _ in self.head_counts]

    def add(self, counts: np.ndarray) -> None:
        """Add the counts block of read-back rows ``(n, len(COUNT_FIELDS) * total heads)`` (each head column of
        a layer holds the same call count)."""
        nc, offset = len(COUNT_FIELDS), 0
        for layer, h in enumerate(self.head_counts):
            block = counts[:, offset: offset + nc * h].reshape(len(counts), nc, h)
            for name in CALL_FIELDS:
                col = block[:, COUNT_FIELDS.index(name), 0]
                self.per_layer[layer][name] += int(np.nansum(col))
            offset += nc * h


def summarize(metrics: Sequence[StepMetrics], switched: int, alerts: int) -> Dict[str, float]:
    """A few aggregate scalars of a read-back's last step, for loggers (``{}`` without steps): the largest
    multi-max frequency, logit, ``|delta_cum|`` and sigma(W_Q), the non-finite rows, and the counts of
    switched heads and alerts so far (``delta_cum_absmax`` and ``sigma_wq_max`` only once measured)."""
    if not metrics:
        return {}
    m = metrics[-1]
    with np.errstate(all="ignore"):
        out = {
            "multi_max_freq_max": float(np.nanmax(m["multi_max_freq"])) if np.isfinite(m["multi_max_freq"]).any() else math.nan,
            "max_score_max": float(np.nanmax(m["max_score"])) if np.isfinite(m["max_score"]).any() else math.nan,
            "nonfinite_rows": float(np.nansum(m["nonfinite_rows"])),
            "switched_heads": float(switched),
            "alerts": float(alerts),
        }
    if np.isfinite(m["delta_cum"]).any():  # left out until a shadow pass has measured a head
        out["delta_cum_absmax"] = float(np.nanmax(np.abs(m["delta_cum"])))
    sig = [x["sigma_wq"] for x in metrics if np.isfinite(x["sigma_wq"]).any()]
    if sig:
        out["sigma_wq_max"] = float(np.nanmax(sig[-1]))
    return out
