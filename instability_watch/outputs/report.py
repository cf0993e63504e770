"""`instability-watch report`: a postmortem of one run directory.

Reads a run directory written by :class:`~instability_watch.outputs.rundir.RunWriter`
(also one left by a killed run) and shows, per attention head, what the watch
saw and did:

* a summary table (:func:`head_summary`, rendered by :class:`SummaryView`):
  the step of the first alert of every kind, the number of alerts, the step at
  which the head was switched to the stabilized kernel, the peak multi-max
  frequency and peak attention logit, the final ``sum(delta_lp - delta_hp)``
  and the growth of sigma(W_Q). Heads that raised alerts come first (earliest
  alert first), then the heads with the largest accumulated delta drift. What
  the reader skipped or ignored (a torn last line, an incomplete last step,
  see :mod:`instability_watch.outputs.rundir`) is listed once under the header;
* one PNG per metric (:func:`write_plots`), the metric against the step above
  the loss: the heads most extreme in *that* metric in colour and labelled,
  heads that alerted or switched too, all others thin and gray; every alert (a
  vertical line, one colour per kind) and switch (dashed) marked. The figures
  correspond to those of the paper (Qiu & Yao, *Why Low-Precision Transformer
  Training Fails*):

  ================  ==========================================================
  ``sigma_wq.png``  spectral norm sigma(W_Q) per head: paper Fig. 3 / Fig. 11
  ``multi_max.png`` frequency of rows whose maximum repeats: paper Fig. 13
  ``delta_cum.png`` cumulative ``sum(delta_lp - delta_hp)`` over the shadow
                    steps: paper Fig. 5a
  ``max_score.png`` the largest attention logit per head
  ``loss.png``      the training loss alone, with the same marks
  ================  ==========================================================

The report reads metrics.csv a block at a time (:func:`digest_run`) and keeps
only what it shows: per head, the summary's values and at most
:data:`PLOT_POINTS` points per metric (a bucket of steps becomes one point:
its largest value, or for the running sum its last); per step, the loss. Its
memory does not grow with the number of steps times heads: a 200,000-step
GPT-2-small run (a 3.6 GB metrics.csv) is reported in 0.6 GB and 30 s on two
CPU cores (``benchmarks/report_memory.py``).

Metrics are sparse by design (sigma(W_Q) only every ``spectral_every`` steps,
the delta statistics only on shadow steps): ``NaN`` means "not observed" and
such points are left out of every plot and summary value.

Example::

    from instability_watch.outputs import report

    digest = report.digest_run("runs/exp1")     # or report.digest(load_run("runs/exp1"))
    print(report.head_summary(digest).head())
    report.write_plots(digest, "runs/exp1/report")
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from instability_watch.detect.kinds import ALERT_KINDS, KINDS
from instability_watch.outputs.rundir import BLOCK_BYTES, HeadIndex, Run, stream_run

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

INSTALL_PLOTS = 'install matplotlib: pip install "instability_watch[plots]"'

SUMMARY_COLUMNS = (
    ("layer", "layer_name", "head")
    + tuple(f"first_{kind}" for kind in KINDS)
    + ("alerts", "peak_multi_max_freq", "peak_max_score", "final_delta_cum",
       "sigma_first", "sigma_last", "sigma_growth", "switched_at", "qk_clips", "first_qk_clip")
)

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
"""Points per head and metric at most (an even number): a run of more steps is drawn from buckets of steps.
A 1100-pixel-wide figure shows no more; a run of up to this many steps is drawn exactly."""

# alert marks: one colour per kind (ALERT_KINDS[kind].color); switches: dashed dark gray. The heads' colours avoid all of them.
SWITCH_COLOR = "0.3"
CLIP_COLOR = "darkmagenta"
GRAY = "0.7"
HEAD_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:brown", "tab:cyan", "navy", "darkgoldenrod",
               "teal", "slateblue", "darkkhaki", "peru", "mediumseagreen")

_NO_STEP = np.iinfo(np.int64).min  # an empty bucket (or no finite value yet)
_NO_FIRST = np.iinfo(np.int64).max


# --------------------------------------------------------------------------- reading: the digest


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


class _Digester:
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
    read = stream_run(run_dir, lambda: _Digester(points), block_bytes=block_bytes)
    return read.sink.digest(read.run_dir, read.meta, read.events, read.problems)


def digest(run: Run, *, points: int = PLOT_POINTS) -> RunDigest:
    """The :class:`RunDigest` of a run already loaded by :func:`~instability_watch.outputs.rundir.load_run`."""
    sink = _Digester(points)
    if len(run.metrics):
        sink.add(run.metrics)
    return sink.digest(run.run_dir, run.meta, run.events, getattr(run, "problems", []))


AnyRun = Union[Run, RunDigest]


def _as_digest(run: AnyRun) -> RunDigest:
    return run if isinstance(run, RunDigest) else digest(run)


# --------------------------------------------------------------------------- summary


def _head_index(d: RunDigest) -> pd.DataFrame:
    """Every (layer, head) of the run's metrics and events, with its layer name and its per-head values.

    Only what the files hold: meta.json's head counts never add rows.
    """
    index = d.heads.copy()
    events = d.events
    if len(events):
        known = pd.MultiIndex.from_frame(index[["layer", "head"]])
        pairs = events[["layer", "layer_name", "head"]].astype({"layer": "int64", "head": "int64"})
        pairs = pairs.drop_duplicates(subset=["layer", "head"], keep="first")  # the first name seen
        new = ~pd.MultiIndex.from_frame(pairs[["layer", "head"]]).isin(known)
        if new.any():
            index = pd.concat([index, pairs[new]], ignore_index=True)
    index["layer_name"] = index["layer_name"].astype("string").fillna("")
    return index.sort_values(["layer", "head"], kind="mergesort").reset_index(drop=True)


def head_summary(run: AnyRun) -> pd.DataFrame:
    """One row per (layer, head): what the watch saw in that head and what it did.

    Args:
        run: a :class:`RunDigest` (:func:`digest_run`), or a run loaded by
            :func:`~instability_watch.outputs.rundir.load_run`.

    Returns:
        A DataFrame with the columns :data:`SUMMARY_COLUMNS`:

        * ``layer``, ``layer_name``, ``head``;
        * ``first_<kind>`` for every kind of :data:`~instability_watch.detect.detectors.KINDS`:
          the step of the first alert of that kind (nullable ``Int64``, ``<NA>``
          if none);
        * ``alerts``: the number of alerts of the head;
        * ``peak_multi_max_freq``, ``peak_max_score``: the largest observed value;
        * ``final_delta_cum``: the last finite cumulative ``sum(delta_lp - delta_hp)``;
        * ``sigma_first``, ``sigma_last``: the first and last finite sigma(W_Q),
          ``sigma_growth`` = ``sigma_last / sigma_first``;
        * ``switched_at``: the step at which the head moved to the stabilized
          kernel (nullable ``Int64``);
        * ``qk_clips``, ``first_qk_clip``: how often ``qk_clip`` rescaled the head,
          and first when (nullable ``Int64``).

        Missing observations are ``NaN``. Rows are sorted: heads with alerts
        first, by their earliest alert step; then by ``|final_delta_cum|``,
        largest first (heads without a delta value last); ties by layer, head.
    """
    d = _as_digest(run)
    out = _head_index(d)
    key = ["layer", "head"]

    def attach(per_head: pd.Series, name: str, dtype: str) -> None:
        """Left-join a Series indexed by (layer, head) onto ``out`` as column ``name``."""
        nonlocal out
        frame = per_head.rename(name).reset_index()
        frame = frame.astype({"layer": "int64", "head": "int64"})
        out = out.merge(frame, on=key, how="left")
        out[name] = out[name].astype(dtype)

    def event_steps(frame: pd.DataFrame, how: str) -> pd.Series:
        """``how`` ("min" or "size") of the event steps per head."""
        frame = frame[key + ["step"]].astype("int64")
        grouped = frame.groupby(key)["step"]
        return grouped.size() if how == "size" else grouped.min()

    event = d.events["event"].astype("string")
    alerts = d.events[(event == "alert").fillna(False).to_numpy()]
    switches = d.events[(event == "switch").fillna(False).to_numpy()]
    alert_kind = alerts["kind"].astype("string")
    for kind in KINDS:
        of_kind = alerts[(alert_kind == kind).fillna(False).to_numpy()]
        attach(event_steps(of_kind, "min"), f"first_{kind}", "Int64")
    attach(event_steps(alerts, "size"), "alerts", "float64")
    out["alerts"] = out["alerts"].fillna(0).astype("int64")
    with np.errstate(divide="ignore", invalid="ignore"):
        growth = out["sigma_last"].to_numpy(dtype="float64") / out["sigma_first"].to_numpy(dtype="float64")
    out["sigma_growth"] = np.where(np.isfinite(growth), growth, np.nan)
    attach(event_steps(switches, "min"), "switched_at", "Int64")
    clips = d.events[(event == "qk_clip").fillna(False).to_numpy()]
    attach(event_steps(clips, "size"), "qk_clips", "float64")
    out["qk_clips"] = out["qk_clips"].fillna(0).astype("int64")
    attach(event_steps(clips, "min"), "first_qk_clip", "Int64")

    # the order: alerted heads by earliest alert, then |final_delta_cum| descending (NaN last)
    attach(event_steps(alerts, "min"), "earliest_alert", "float64")  # of any kind; not a summary column
    drift = np.abs(out["final_delta_cum"].to_numpy(dtype="float64"))
    order = pd.DataFrame({
        "earliest": out["earliest_alert"].to_numpy(),  # NaN (no alert) sorts last
        "neg_drift": np.where(np.isnan(drift), np.inf, -drift),
        "layer": out["layer"].to_numpy(),
        "head": out["head"].to_numpy(),
    }).sort_values(["earliest", "neg_drift", "layer", "head"], kind="mergesort", na_position="last").index
    return out.loc[order, list(SUMMARY_COLUMNS)].reset_index(drop=True)


# --------------------------------------------------------------------------- console view


def _fmt(value, spec: str = ".4g", *, missing: str = "-") -> str:
    """Format a number, or ``missing`` for NaN / <NA> / None."""
    if value is None or value is pd.NA:
        return missing
    try:
        if np.isnan(value):
            return missing
    except TypeError:
        pass
    return format(value, spec)


def _first_finite(values: pd.Series, *, last: bool = False) -> float:
    v = values.to_numpy(dtype="float64")
    finite = v[np.isfinite(v)]
    if not len(finite):
        return float("nan")
    return float(finite[-1] if last else finite[0])


def _left_cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, cut at the left (a layer name's end tells layers apart)."""
    return text if len(text) <= width else "…" + text[len(text) - max(width - 1, 0):]


def _short_labels(labels: List[str], names: List[str], width: int) -> List[str]:
    """Head labels (``f"{layer_name} h{head}"``) in ``width`` cells: what tells the layers apart is kept.

    A suffix all the layer names share is dropped first (``transformer.h.11.attn``
    -> ``transformer.h.11``), then the labels are cut at the left (``…h.11 h7``).
    """
    if max(map(cell_len, labels)) > width and len(set(names)) > 1:
        common = os.path.commonprefix([n[::-1] for n in names])[::-1]
        if common and all(len(n) > len(common) for n in names):
            labels = [label[: len(n) - len(common)] + label[len(n):] for label, n in zip(labels, names)]
    return [_left_cut(label, width) for label in labels]


class SummaryView:
    """Rich renderable of a run's summary: a header, what the reader skipped, and the per-head table.

    The table keeps each head on one line at any console width: the head's name
    is cut at the left to fit (at 80 columns a GPT-2 name keeps ``h.11.attn``).

    Args:
        run: a :class:`RunDigest` or a loaded :class:`~instability_watch.outputs.rundir.Run`.
        summary: its :func:`head_summary` (computed if not given).
        top: show at most this many heads (the first ones of the summary's
            order); a line says how many are not shown.
    """

    def __init__(self, run: AnyRun, summary: Optional[pd.DataFrame] = None, *, top: int = 20) -> None:
        self.run = _as_digest(run)
        self.summary = head_summary(self.run) if summary is None else summary
        self.top = max(int(top), 0)

    def header(self) -> Text:
        """The lines above the table: run dir, steps, loss, alerts, switches, resumes, reader notes."""
        run, summary = self.run, self.summary
        text = Text()
        text.append("instability_watch report: ", style="bold")
        text.append(str(run.run_dir), style="bold")
        text.append("\n")
        steps = run.steps
        if len(steps):
            first, last = int(steps["step"].iloc[0]), int(steps["step"].iloc[-1])
            text.append(f"steps {first}..{last} ({len(steps)} recorded)")
            loss0, loss1 = _first_finite(steps["loss"]), _first_finite(steps["loss"], last=True)
            text.append(f", loss {_fmt(loss0)} -> {_fmt(loss1)}")
        else:
            text.append("no steps recorded")
        n_alerts = int(summary["alerts"].sum()) if len(summary) else 0
        alerted = int((summary["alerts"] > 0).sum()) if len(summary) else 0
        switched = int(summary["switched_at"].notna().sum()) if len(summary) else 0
        text.append(f"\nalerts: {n_alerts} on {alerted} of {len(summary)} heads", style="bold red" if n_alerts else "")
        text.append(f", switched to the stabilized kernel: {switched} heads",
                    style="bold green" if switched else "")
        clipped = summary[summary["qk_clips"] > 0] if len(summary) else summary
        if len(clipped):
            text.append(f"\nQK-clip: {int(clipped['qk_clips'].sum())} clips on {len(clipped)} heads, the first at step "
                        f"{int(clipped['first_qk_clip'].min())}", style="bold magenta")
        resumed = run.meta.get("resumed_at") or []
        if resumed:
            text.append("\nresumed at step " + ", ".join(str(s) for s in resumed))
        for problem in run.problems:
            text.append(f"\nnote: {problem}", style="yellow")
        return text

    _COLUMNS = (  # header, justify
        ("head", "left"), ("first alert\nstep kind", "left"), ("alerts", "right"), ("switch\nstep", "right"),
        ("multi\nmax", "right"), ("max\nlogit", "right"), ("Σδlp−δhp\nfinal", "right"),
        ("σ(W_Q)\ngrowth", "right"),
    )

    def _cells(self) -> List[List[Text]]:
        rows = []
        for row in self.summary.head(self.top).itertuples(index=False):
            firsts = sorted((int(getattr(row, f"first_{k}")), k) for k in KINDS
                            if not pd.isna(getattr(row, f"first_{k}")))
            alert = "-"
            if firsts:  # the earliest; "+n": alerts of n other kinds came later
                alert = f"{firsts[0][0]} {firsts[0][1]}" + (f" +{len(firsts) - 1}" if len(firsts) > 1 else "")
            switch = "-" if pd.isna(row.switched_at) else str(int(row.switched_at))
            rows.append([
                Text(f"{row.layer_name} h{row.head}"),
                Text(alert, style="bold red" if firsts else ""),
                Text(str(row.alerts) if row.alerts else "-"),
                Text(switch, style="green" if switch != "-" else ""),
                Text(_fmt(row.peak_multi_max_freq, ".0%")),
                Text(_fmt(row.peak_max_score, ".3g")),
                Text(_fmt(row.final_delta_cum, "+.2g")),
                Text("-" if pd.isna(row.sigma_growth) else f"×{row.sigma_growth:.3g}"),
            ])
        return rows

    def table(self, width: Optional[int] = None) -> Table:
        """The per-head table (at most ``top`` rows), each row one line within ``width`` cells if given."""
        rows = self._cells()
        names = [str(name) for name in self.summary["layer_name"].head(self.top)]
        head_width = None
        if width is not None and rows:  # the head column gets what the others leave (one space between columns)
            others = sum(max(max(cell_len(line) for line in header.split("\n")), max(r[i].cell_len for r in rows))
                         for i, (header, _) in enumerate(self._COLUMNS) if i)
            room = max(width - others - (len(self._COLUMNS) - 1), len("head") + 1)
            head_width = min(room, max(r[0].cell_len for r in rows) + 1)  # + 1: two spaces before the alert
            labels = _short_labels([r[0].plain for r in rows], names, head_width - 1)
            for r, label in zip(rows, labels):
                r[0] = Text(label)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True, padding=(0, 0))
        for i, (header, justify) in enumerate(self._COLUMNS):
            table.add_column(header, justify=justify, no_wrap=True, overflow="ellipsis",
                             width=head_width if i == 0 else None)
        for r in rows:
            table.add_row(*r)
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.header()
        if not len(self.summary):
            yield Text("no heads recorded")
            return
        yield self.table(options.max_width)
        hidden = len(self.summary) - min(self.top, len(self.summary))
        if hidden:
            yield Text(f"{hidden} more head{'s' if hidden != 1 else ''} not shown (use --top to show more)",
                       style="dim")
        advice = self.advice()
        if advice.plain:
            yield advice

    def advice(self) -> Text:
        """One line per alert kind the run raised: what it means and what to do (from
        :data:`~instability_watch.detect.kinds.ALERT_KINDS`); empty without alerts."""
        text = Text()
        seen = [k for k in KINDS if len(self.summary) and self.summary[f"first_{k}"].notna().any()]
        if seen:
            text.append("what the alerts mean:", style="bold")
        for kind in seen:
            k = ALERT_KINDS[kind]
            text.append(f"\n  {kind}: ", style="bold")
            text.append(f"{k.plain(k.meaning)}; {k.plain(k.action)}")
        return text


# --------------------------------------------------------------------------- plots


def _require_matplotlib():
    """Import the object-oriented matplotlib pieces (no pyplot, no global backend change).

    Returns:
        ``(Figure, FigureCanvasAgg)``.

    Raises:
        ImportError: matplotlib is not installed; the message says how to install it.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"plots need matplotlib, which is not installed; {INSTALL_PLOTS}") from exc
    return Figure, FigureCanvasAgg


def _head_label(layer_name: str, head: int) -> str:
    return f"{layer_name} h{head}"


def highlighted_heads(run: AnyRun, column: str, top: int,
                      summary: Optional[pd.DataFrame] = None) -> List[Tuple[int, str]]:
    """The heads a plot of ``column`` colours, in legend order: ``(row of RunDigest.heads, label)``.

    The ``top`` heads most extreme in that metric (the largest value; for the
    running sum ``delta_cum`` the largest |value|), then up to ``top`` heads
    that alerted or were switched (earliest first), labelled so.
    """
    d = _as_digest(run)
    extreme = d.extreme[column]
    heads = d.heads
    seen = np.flatnonzero(~np.isnan(extreme))
    # most extreme first; ties by layer, head
    order = seen[np.lexsort((heads["head"].to_numpy()[seen], heads["layer"].to_numpy()[seen], -extreme[seen]))]
    chosen = [(int(i), _head_label(heads["layer_name"].iat[i], int(heads["head"].iat[i]))) for i in order[:top]]
    summary = head_summary(d) if summary is None else summary
    flagged = summary[(summary["alerts"] > 0) | summary["switched_at"].notna()]
    if len(flagged) and len(heads):
        row_of = {(int(l), int(h)): i for i, (l, h) in enumerate(zip(heads["layer"], heads["head"]))}
        taken = {i for i, _ in chosen}
        extra = 0
        for r in flagged.itertuples(index=False):
            i = row_of.get((int(r.layer), int(r.head)))
            if i is None or i in taken or extra >= top or np.isnan(extreme[i]):
                continue
            what = "alert" if r.alerts else "switched"
            chosen.append((i, f"{_head_label(r.layer_name, int(r.head))} ({what})"))
            taken.add(i)
            extra += 1
    return chosen


def _mark_events(axes: Sequence["Axes"], run: RunDigest, *, legend: bool) -> None:
    """Draw a vertical line per (step, kind) of alert and per switch step on every axis, a tick per QK-clip step.

    Only the first axis gets legend labels (when ``legend``), one per kind.
    """
    events = run.events
    if not len(events):
        return
    kinds = events["kind"].astype("string").fillna("")
    steps = events["step"].astype("int64")
    is_alert = (events["event"].astype("string") == "alert").fillna(False).to_numpy()
    is_switch = (events["event"].astype("string") == "switch").fillna(False).to_numpy()
    is_clip = (events["event"].astype("string") == "qk_clip").fillna(False).to_numpy()
    alert_marks = sorted({(int(s), str(k)) for s, k in zip(steps[is_alert], kinds[is_alert])})
    switch_marks = sorted({int(s) for s in steps[is_switch]})
    clip_marks = np.array(sorted({int(s) for s in steps[is_clip]}), dtype="float64")
    for i, ax in enumerate(axes):
        labelled = set()
        for step, kind in alert_marks:
            label = None
            if legend and i == 0 and kind not in labelled:
                label, _ = f"alert: {kind}", labelled.add(kind)
            color = ALERT_KINDS[kind].color if kind in ALERT_KINDS else "tab:gray"
            ax.axvline(step, color=color, linewidth=1.2, alpha=0.8, label=label)
        for j, step in enumerate(switch_marks):
            label = "switch to stabilized" if legend and i == 0 and j == 0 else None
            ax.axvline(step, color=SWITCH_COLOR, linestyle="--", linewidth=1.2, label=label)
        if len(clip_marks):  # QK-clips can come every probe step: ticks along the bottom, not lines
            ax.plot(clip_marks, np.zeros_like(clip_marks), linestyle="none", marker="|", markersize=9,
                    color=CLIP_COLOR, transform=ax.get_xaxis_transform(),
                    label="QK-clip" if legend and i == 0 else None)


def _plot_loss(ax: "Axes", run: RunDigest) -> None:
    steps = run.steps
    loss = steps["loss"].to_numpy(dtype="float64")
    ok = np.isfinite(loss)
    if ok.any():
        ax.plot(steps["step"].to_numpy()[ok], loss[ok], color="tab:blue", linewidth=1.2)
    else:
        ax.text(0.5, 0.5, "no data: no loss recorded", transform=ax.transAxes, ha="center", va="center",
                color="tab:gray")
    ax.set_ylabel("loss")
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)


def _metric_figure(run: AnyRun, summary: Optional[pd.DataFrame], column: str, title: str, ylabel: str,
                   top: int) -> "Figure":
    """The figure of one metric: the metric per head above the loss, events marked.

    Args:
        run: the run (a :class:`RunDigest` or a loaded run).
        summary: its :func:`head_summary` (gives the heads that alerted or switched).
        column: the metrics column to plot.
        title, ylabel: the figure's title and the top panel's y label.
        top: how many of the heads most extreme in ``column`` get a colour and a
            label (and at most as many more that alerted or switched).

    Returns:
        An unsaved ``matplotlib.figure.Figure``.
    """
    Figure, FigureCanvasAgg = _require_matplotlib()
    d = _as_digest(run)
    fig = Figure(figsize=(11, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax_loss = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    fig.suptitle(f"{title}\n{d.run_dir}", fontsize="medium")

    chosen = highlighted_heads(d, column, top, summary)
    coloured = {i for i, _ in chosen}
    drawn = 0
    for i in range(len(d.heads)):
        if i not in coloured:
            x, y = d.series(column, i)
            if len(x):
                ax.plot(x, y, color=GRAY, linewidth=0.6, zorder=1)
                drawn += 1
    for n, (i, label) in enumerate(chosen):
        x, y = d.series(column, i)
        if len(x):
            few = len(x) <= 60
            ax.plot(x, y, color=HEAD_COLORS[n % len(HEAD_COLORS)], linewidth=1.6, zorder=3,
                    marker="o" if few else None, markersize=3, label=label)
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, f"no data: {column} was not observed in this run", transform=ax.transAxes,
                ha="center", va="center", color="tab:gray")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    _mark_events([ax, ax_loss], d, legend=True)
    _plot_loss(ax_loss, d)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


def _loss_figure(run: RunDigest) -> "Figure":
    """The loss against the step, with alerts and switches marked."""
    Figure, FigureCanvasAgg = _require_matplotlib()
    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    fig.suptitle(f"training loss\n{run.run_dir}", fontsize="medium")
    _mark_events([ax], run, legend=True)
    _plot_loss(ax, run)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


def write_plots(run: AnyRun, out_dir: str | os.PathLike, top: int = 6, *,
                summary: Optional[pd.DataFrame] = None) -> List[Path]:
    """Write the report's PNGs into ``out_dir`` (created if missing).

    Uses matplotlib's object-oriented API with the Agg canvas only: pyplot is
    not imported and the user's interactive backend is left alone.

    Args:
        run: a :class:`RunDigest` (:func:`digest_run`) or a loaded run.
        out_dir: where to write the files.
        top: in each metric's plot, how many of the heads most extreme in that
            metric are drawn in colour and labelled (plus at most as many that
            alerted or switched); all other heads are thin gray lines.
        summary: the run's :func:`head_summary`, if already computed.

    Returns:
        The paths written, in this order: ``sigma_wq.png``, ``multi_max.png``,
        ``delta_cum.png``, ``max_score.png``, ``loss.png``.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
        OSError: ``out_dir`` cannot be created or written.
    """
    _require_matplotlib()
    d = _as_digest(run)
    summary = head_summary(d) if summary is None else summary
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: List[Path] = []
    figures = [(stem, lambda c=column, t=title, y=ylabel: _metric_figure(d, summary, c, t, y, top))
               for stem, column, title, ylabel, _ in METRIC_PLOTS]
    figures.append(("loss", lambda: _loss_figure(d)))
    for stem, build in figures:
        path = out / f"{stem}.png"
        build().savefig(path, dpi=100)
        written.append(path)
    return written


# --------------------------------------------------------------------------- entry point


def _have_matplotlib() -> bool:
    try:
        _require_matplotlib()
    except ImportError:
        return False
    return True


def main(run_dir: str | os.PathLike, *, out_dir: str | os.PathLike | None = None, top: int = 20,
         plots: bool = True, console: Optional[Console] = None) -> int:
    """Print a run's summary and write its plots (the ``instability-watch report`` command).

    Reads the run with :func:`digest_run`: memory stays bounded however long the run.

    Args:
        run_dir: the run directory.
        out_dir: where the PNGs go (default ``RUN_DIR/report/``).
        top: rows of the summary table; each plot colours the ``min(top, 6)``
            heads most extreme in its metric.
        plots: write the PNGs. Without matplotlib installed they are skipped
            with a one-line note.
        console: where to print (default: a new ``rich.console.Console()``).

    Returns:
        The exit status, 0.

    Raises:
        RunDirError: ``run_dir`` is missing or not a readable run directory.
        OSError: the output directory cannot be written.
    """
    console = console or Console()
    d = digest_run(run_dir)
    summary = head_summary(d)
    console.print(SummaryView(d, summary, top=top))
    if not plots:
        return 0
    if not _have_matplotlib():
        console.print(f"plots skipped: matplotlib is not installed; {INSTALL_PLOTS}", markup=False, highlight=False)
        return 0
    out = Path(out_dir) if out_dir is not None else d.run_dir / "report"
    written = write_plots(d, out, top=max(1, min(top, 6)), summary=summary)
    console.print(f"wrote {len(written)} plots:", markup=False, highlight=False)
    for path in written:
        console.print(f"  {path}", markup=False, highlight=False, soft_wrap=True)
    return 0
