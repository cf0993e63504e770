"""The report's per-head summary (:func:`head_summary`) and its console view (:class:`SummaryView`)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, List, Optional

import numpy as np
import pandas as pd
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from instability_watch.detect.kinds import ALERT_KINDS, KINDS

if TYPE_CHECKING:  # pragma: no cover
    pass


from instability_watch.outputs.report.digest import AnyRun, RunDigest, as_digest

SUMMARY_COLUMNS = (
    ("layer", "layer_name", "head")
    + tuple(f"first_{kind}" for kind in KINDS)
    + ("alerts", "peak_multi_max_freq", "peak_max_score", "final_delta_cum",
       "sigma_first", "sigma_last", "sigma_growth", "switched_at", "qk_clips", "first_qk_clip")
)


def head_index(d: RunDigest) -> pd.DataFrame:
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
    d = as_digest(run)
    out = head_index(d)
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
        self.run = as_digest(run)
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
        switch_to = (run.meta.get("config") or {}).get("switch_to", "stabilized")
        text.append(f", switched to {'the exact delta' if switch_to == 'exact_delta' else 'the stabilized kernel'}: "
                    f"{switched} heads", style="bold green" if switched else "")
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
