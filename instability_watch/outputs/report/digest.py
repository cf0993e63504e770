"""Reading a run for the report: a bounded digest of every head's series (:func:`digest_run`).

See :mod:`instability_watch.outputs.report`."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Tuple, Union

import numpy as np
import pandas as pd

from instability_watch.outputs.rundir import BLOCK_BYTES, HeadIndex, Run, stream_run

if TYPE_CHECKING:  # pragma: no cover
    pass


# (file stem, metrics column, title, y label, how); order = order of the files written. ``how``:
#   "peak":   a bucket of steps keeps its largest value; the heads with the largest value are coloured
#   "signed": a running sum: a bucket keeps its last value; the heads with the largest |value| are coloured
METRIC_PLOTS = (
    ("sigma_wq", "sigma_wq", "spectral norm σ(W_Q) per head (paper Fig. 3/11)", "σ(W_Q)", "peak"),
    ("multi_max", "multi_max_freq", "multi-max frequency: rows whose maximum repeats (paper Fig. 13)",
     "multi-max freq.", "peak"),
    ("delta_cum", "delta_cum", "cumulative Σ(δ_lp − δ_hp) over the shadow steps (paper Fig. 5a)",
     "Σ(δ_lp − δ_hp)", "signed"),
    ("max_score", "max_score", "largest attention logit per head", "max logit", "peak"),
)
PLOT_POINTS = 1000




_NO_STEP = np.iinfo(np.int64).min  # an empty bucket (or no finite value yet)


_NO_FIRST = np.iinfo(np.int64).max


class _Buckets:
    """One metric's downsampled series for every head: at most ``n`` points per head.

    The steps ``[lo, lo + n * width)`` are cut into ``n`` buckets; a bucket keeps
    one (step, value): its largest value (``how="peak"``) or its last
    (``"signed"``). When a step falls outside, the width doubles (pairs of
    buckets merge), so the range follows the run without knowing it in advance.
    """

    def __init__(self, how: str, n: int) -> None:
        self.how, self.n = how, n
        self.step = np.full((0, n), _NO_STEP, dtype=np.int64)  # (heads, n)
        self.value = np.full((0, n), np.nan)  # (heads, n)

    def grow(self, heads: int) -> None:
        if heads > len(self.step):
            cap = max(heads, 2 * len(self.step))
            self.step = np.concatenate([self.step, np.full((cap - len(self.step), self.n), _NO_STEP, np.int64)])
            self.value = np.concatenate([self.value, np.full((cap - len(self.value), self.n), np.nan)])

    def halve(self, down: bool) -> None:
        """Merge pairs of buckets: the series takes half the buckets, the lower half (or, ``down``, the upper)."""
        step = self.step.reshape(len(self.step), self.n // 2, 2)  # (heads, n/2, 2)
        value = self.value.reshape(len(self.value), self.n // 2, 2)
        if self.how == "peak":
            right = np.isnan(value[..., 0]) | (value[..., 1] > value[..., 0])
        else:
            right = step[..., 1] > step[..., 0]
        merged_step = np.where(right, step[..., 1], step[..., 0])  # (heads, n/2)
        merged_value = np.where(right, value[..., 1], value[..., 0])
        half = slice(self.n // 2, None) if down else slice(0, self.n // 2)
        self.step = np.full_like(self.step, _NO_STEP)
        self.value = np.full_like(self.value, np.nan)
        self.step[:, half], self.value[:, half] = merged_step, merged_value

    def add(self, cell: np.ndarray, step: np.ndarray, value: np.ndarray) -> None:
        """Put finite values in their flat cells (``head * n + bucket``)."""
        flat_step, flat_value = self.step.reshape(-1), self.value.reshape(-1)
        if self.how == "peak":
            np.fmax.at(flat_value, cell, value)
            won = value == flat_value[cell]
        else:
            np.maximum.at(flat_step, cell, step)
            won = step == flat_step[cell]
        flat_step[cell[won]], flat_value[cell[won]] = step[won], value[won]

    def series(self, head: int) -> Tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of one head, in step order (empty buckets left out)."""
        keep = ~np.isnan(self.value[head])
        return self.step[head, keep], self.value[head, keep]


class Digester:
    """A :func:`~instability_watch.outputs.rundir.stream_run` sink: reduces metrics rows to a :class:`RunDigest`."""

    def __init__(self, points: int = PLOT_POINTS) -> None:
        if points < 2 or points % 2:
            raise ValueError(f"points must be an even number >= 2, got {points!r}")
        self.points = points
        self.heads = HeadIndex()
        self.names: Dict[int, str] = {}
        self.cap = 0
        nan = np.empty(0)
        self.peak = {c: nan for c in ("multi_max_freq", "max_score")}  # largest observed value (inf kept)
        self.high = {column: nan for _, column, _, _, _ in METRIC_PLOTS}  # largest non-NaN value
        self.low = {column: nan for _, column, _, _, how in METRIC_PLOTS if how == "signed"}
        self.at = {  # (step, value) of a finite value: the last delta, the first and last sigma
            "delta_last": (np.empty(0, np.int64), nan), "sigma_first": (np.empty(0, np.int64), nan),
            "sigma_last": (np.empty(0, np.int64), nan)}
        self.buckets = {column: _Buckets(how, points) for _, column, _, _, how in METRIC_PLOTS}
        self.lo, self.width = 0, 0  # the buckets cover steps [lo, lo + points * width)
        self.losses: List[pd.Series] = []  # per piece: the first loss of each step

    def _grow(self, heads: int) -> None:
        if heads <= self.cap:
            return
        cap = max(heads, 2 * self.cap)

        def more(a: np.ndarray, fill) -> np.ndarray:
            return np.concatenate([a, np.full(cap - len(a), fill, dtype=a.dtype)])

        for table in (self.peak, self.high, self.low):
            for k in table:
                table[k] = more(table[k], np.nan)
        for k, (step, value) in self.at.items():
            self.at[k] = (more(step, _NO_FIRST if k == "sigma_first" else _NO_STEP), more(value, np.nan))
        for b in self.buckets.values():
            b.grow(cap)
        self.cap = cap

    def _fit(self, lo: int, hi: int) -> None:
        """Widen the buckets until they cover steps ``lo..hi``."""
        if self.width == 0:
            self.lo, self.width = lo, 1
        while lo < self.lo or hi >= self.lo + self.points * self.width:
            down = lo < self.lo
            for b in self.buckets.values():
                b.halve(down)
            if down:
                self.lo -= self.points * self.width
            self.width *= 2

    def add(self, frame: pd.DataFrame) -> None:
        """Take in a piece of metrics.csv\'s rows (a :func:`stream_run` sink)."""
        step = frame["step"].to_numpy()
        layer = frame["layer"].to_numpy()
        index = self.heads(layer, frame["head"].to_numpy())  # (rows,)
        self._grow(len(self.heads))
        for name_layer in pd.unique(layer).tolist():
            if name_layer not in self.names:
                self.names[name_layer] = str(frame["layer_name"].iat[int(np.argmax(layer == name_layer))])
        loss = frame["loss"].to_numpy(dtype="float64")
        self.losses.append(pd.Series(loss).groupby(step).first())
        self._fit(int(step.min()), int(step.max()))
        # in float: exact for any step below 2**53, and no int64 overflow for absurd ones
        bucket = np.clip((step - float(self.lo)) // self.width, 0, self.points - 1).astype(np.int64)
        values = {c: frame[c].to_numpy(dtype="float64") for c in ("multi_max_freq", "max_score", "delta_cum",
                                                                   "sigma_wq")}
        for column, v in values.items():
            seen = ~np.isnan(v)
            if column in self.peak:
                np.fmax.at(self.peak[column], index[seen], v[seen])
            np.fmax.at(self.high[column], index[seen], v[seen])
            if column in self.low:
                np.fmin.at(self.low[column], index[seen], v[seen])
            finite = np.isfinite(v)
            self.buckets[column].add(index[finite] * self.points + bucket[finite], step[finite], v[finite])
        for key, column, first in (("delta_last", "delta_cum", False), ("sigma_first", "sigma_wq", True),
                                   ("sigma_last", "sigma_wq", False)):
            v = values[column]
            finite = np.isfinite(v)
            at_step, at_value = self.at[key]
            i, s = index[finite], step[finite]
            (np.minimum if first else np.maximum).at(at_step, i, s)
            won = s == at_step[i]
            at_value[i[won]] = v[finite][won]

    def digest(self, run_dir: Path, meta: dict, events: pd.DataFrame, problems: List[str]) -> "RunDigest":
        """The :class:`RunDigest` of everything added."""
        n = len(self.heads)
        layers = self.heads.layers
        heads = pd.DataFrame({
            "layer": layers, "layer_name": pd.array([self.names[int(x)] for x in layers], dtype="string"),
            "head": self.heads.heads,
            "peak_multi_max_freq": self.peak["multi_max_freq"][:n], "peak_max_score": self.peak["max_score"][:n],
            "final_delta_cum": self.at["delta_last"][1][:n],
            "sigma_first": self.at["sigma_first"][1][:n], "sigma_last": self.at["sigma_last"][1][:n],
        })
        extreme = {}
        for _, column, _, _, how in METRIC_PLOTS:
            high = self.high[column][:n]
            extreme[column] = high if how == "peak" else np.fmax(np.abs(high), np.abs(self.low[column][:n]))
        if self.losses:
            steps = pd.concat(self.losses).groupby(level=0).first()
            steps = pd.DataFrame({"step": steps.index.to_numpy(dtype="int64"), "loss": steps.to_numpy()})
        else:
            steps = pd.DataFrame({"step": pd.Series(dtype="int64"), "loss": pd.Series(dtype="float64")})
        return RunDigest(run_dir=run_dir, meta=meta, events=events, problems=list(problems), heads=heads,
                         steps=steps, extreme=extreme, buckets=self.buckets)


@dataclass
class RunDigest:
    """What the report shows of a run, in memory that does not grow with steps times heads.

    Attributes:
        run_dir, meta, events, problems: as in :class:`~instability_watch.outputs.rundir.Run`.
        heads: one row per (layer, head) of metrics.csv: ``layer``, ``layer_name``,
            ``head``, ``peak_multi_max_freq``, ``peak_max_score`` (largest
            observed, inf kept), ``final_delta_cum`` (last finite),
            ``sigma_first``, ``sigma_last`` (first and last finite).
        steps: one row per step: ``step`` and ``loss`` (as :attr:`Run.steps`).
        extreme: per plotted column, how extreme each head of ``heads`` is (the
            largest value, or the largest |value| of a running sum).
        buckets: per plotted column, the downsampled series of each head.
    """

    run_dir: Path
    meta: dict
    events: pd.DataFrame
    problems: List[str]
    heads: pd.DataFrame
    steps: pd.DataFrame
    extreme: Dict[str, np.ndarray]
    buckets: Dict[str, _Buckets]

    def series(self, column: str, index: int) -> Tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of ``column`` for the head in row ``index`` of :attr:`heads` (finite values only)."""
        return self.buckets[column].series(index)


AnyRun = Union[Run, RunDigest]


def digest_run(run_dir: str | os.PathLike, *, points: int = PLOT_POINTS,
               block_bytes: int = BLOCK_BYTES) -> RunDigest:
    """Read a run directory into a :class:`RunDigest`, a block of metrics.csv at a time.

    Args:
        run_dir: the run directory.
        points: the most points per head in a plot (an even number).
        block_bytes: CSV bytes parsed at a time.

    Raises:
        RunDirError: as :func:`~instability_watch.outputs.rundir.load_run`.
    """
    read = stream_run(run_dir, lambda: Digester(points), block_bytes=block_bytes)
    return read.sink.digest(read.run_dir, read.meta, read.events, read.problems)


def digest(run: Run, *, points: int = PLOT_POINTS) -> RunDigest:
    """The :class:`RunDigest` of a run already loaded by :func:`~instability_watch.outputs.rundir.load_run`."""
    sink = Digester(points)
    if len(run.metrics):
        sink.add(run.metrics)
    return sink.digest(run.run_dir, run.meta, run.events, getattr(run, "problems", []))


def as_digest(run: AnyRun) -> RunDigest:
    """``run`` as a :class:`RunDigest` (a loaded :class:`Run` is digested; a digest is returned as it is)."""
    return run if isinstance(run, RunDigest) else digest(run)
