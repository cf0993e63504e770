"""`instability-watch report`: a postmortem of one run directory.

Reads a run directory written by :class:`~instability_watch.export.RunWriter`
(also one left by a killed run) and shows, per attention head, what the watch
saw and did:

* a summary table (:func:`head_summary`, rendered by :class:`SummaryView`):
  the step of the first alert of every kind, the number of alerts, the step at
  which the head was switched to the stabilized kernel, the peak multi-max
  frequency and peak attention logit, the final ``sum(delta_lp - delta_hp)``
  and the growth of sigma(W_Q). Heads that raised alerts come first (earliest
  alert first), then the heads with the largest accumulated delta drift;
* one PNG per metric (:func:`write_plots`), the metric against the step for the
  worst heads (all other heads thin and gray) above the loss, with every alert
  (a vertical line, one colour per kind) and switch (dashed) marked. The
  figures correspond to those of the paper (Qiu & Yao, *Why Low-Precision
  Transformer Training Fails*):

  ================  ==========================================================
  ``sigma_wq.png``  spectral norm sigma(W_Q) per head: paper Fig. 3 / Fig. 11
  ``multi_max.png`` frequency of rows whose maximum repeats: paper Fig. 13
  ``delta_cum.png`` cumulative ``sum(delta_lp - delta_hp)`` over the shadow
                    steps: paper Fig. 5a
  ``max_score.png`` the largest attention logit per head
  ``loss.png``      the training loss alone, with the same marks
  ================  ==========================================================

Metrics are sparse by design (sigma(W_Q) only every ``spectral_every`` steps,
the delta statistics only on shadow steps): ``NaN`` means "not observed" and
such points are left out of every plot and summary value.

Example::

    from instability_watch.export import load_run
    from instability_watch import report

    run = load_run("runs/exp1")
    print(report.head_summary(run).head())
    report.write_plots(run, "runs/exp1/report")
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from .detectors import KINDS
from .export import load_run

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .export import Run

INSTALL_PLOTS = 'install matplotlib: pip install "instability_watch[plots]"'

SUMMARY_COLUMNS = (
    ("layer", "layer_name", "head")
    + tuple(f"first_{kind}" for kind in KINDS)
    + ("alerts", "peak_multi_max_freq", "peak_max_score", "final_delta_cum",
       "sigma_first", "sigma_last", "sigma_growth", "switched_at")
)

# (file stem, metrics column, title, y label); order = order of the files written
METRIC_PLOTS = (
    ("sigma_wq", "sigma_wq", "spectral norm σ(W_Q) per head (paper Fig. 3/11)", "σ(W_Q)"),
    ("multi_max", "multi_max_freq", "multi-max frequency: rows whose maximum repeats (paper Fig. 13)",
     "multi-max freq."),
    ("delta_cum", "delta_cum", "cumulative Σ(δ_lp − δ_hp) over the shadow steps (paper Fig. 5a)",
     "Σ(δ_lp − δ_hp)"),
    ("max_score", "max_score", "largest attention logit per head", "max logit"),
)

# alert marks: one colour per kind; switches: dashed dark gray. The heads' colours avoid all of them.
KIND_COLORS = {
    "multi_max": "tab:pink",
    "delta_drift": "tab:red",
    "spectral_growth": "tab:purple",
    "logit_growth": "tab:olive",
    "nonfinite": "black",
}
SWITCH_COLOR = "0.3"
HEAD_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:brown", "tab:cyan", "navy", "darkgoldenrod",
               "teal", "slateblue", "darkkhaki")


# --------------------------------------------------------------------------- summary


def _finite(values: pd.Series) -> pd.Series:
    """The finite entries of a float column (drops NaN and +-inf)."""
    v = values.astype("float64")
    return v[np.isfinite(v.to_numpy())]


def _head_index(run: "Run") -> pd.DataFrame:
    """Every (layer, head) the run knows of, from its metrics, events and meta, with its layer name."""
    parts = []
    for frame in (run.metrics, run.events):
        if len(frame):
            parts.append(frame[["layer", "layer_name", "head"]].astype({"layer": "int64", "head": "int64"}))
    layers, heads = run.meta.get("layers"), run.meta.get("heads")
    if isinstance(layers, list) and isinstance(heads, list) and len(layers) == len(heads):
        rows = [(i, str(name), h) for i, (name, n) in enumerate(zip(layers, heads))
                if isinstance(n, int) for h in range(n)]
        if rows:
            parts.append(pd.DataFrame(rows, columns=["layer", "layer_name", "head"]))
    if not parts:
        return pd.DataFrame({"layer": pd.Series(dtype="int64"), "layer_name": pd.Series(dtype="string"),
                             "head": pd.Series(dtype="int64")})
    index = pd.concat(parts, ignore_index=True)
    index["layer_name"] = index["layer_name"].astype("string").fillna("")
    # the first name seen for a layer wins (metrics before events before meta)
    index = index.drop_duplicates(subset=["layer", "head"], keep="first")
    return index.sort_values(["layer", "head"], kind="mergesort").reset_index(drop=True)


def head_summary(run: "Run") -> pd.DataFrame:
    """One row per (layer, head): what the watch saw in that head and what it did.

    Args:
        run: a loaded run directory (:func:`~instability_watch.export.load_run`).

    Returns:
        A DataFrame with the columns :data:`SUMMARY_COLUMNS`:

        * ``layer``, ``layer_name``, ``head``;
        * ``first_<kind>`` for every kind of :data:`~instability_watch.detectors.KINDS`:
          the step of the first alert of that kind (nullable ``Int64``, ``<NA>``
          if none);
        * ``alerts``: the number of alerts of the head;
        * ``peak_multi_max_freq``, ``peak_max_score``: the largest observed value;
        * ``final_delta_cum``: the last finite cumulative ``sum(delta_lp - delta_hp)``;
        * ``sigma_first``, ``sigma_last``: the first and last finite sigma(W_Q),
          ``sigma_growth`` = ``sigma_last / sigma_first``;
        * ``switched_at``: the step at which the head moved to the stabilized
          kernel (nullable ``Int64``).

        Missing observations are ``NaN``. Rows are sorted: heads with alerts
        first, by their earliest alert step; then by ``|final_delta_cum|``,
        largest first (heads without a delta value last); ties by layer, head.
    """
    out = _head_index(run)
    key = ["layer", "head"]
    metrics = run.metrics.sort_values("step", kind="mergesort")

    def attach(per_head: pd.Series, name: str, dtype: str) -> None:
        """Left-join a Series indexed by (layer, head) onto ``out`` as column ``name``."""
        nonlocal out
        frame = per_head.rename(name).reset_index()
        frame = frame.astype({"layer": "int64", "head": "int64"})
        out = out.merge(frame, on=key, how="left")
        out[name] = out[name].astype(dtype)

    def metric_per_head(column: str, how: str) -> pd.Series:
        """``how`` ("max", "first", "last") of the observed values of ``column`` per head.

        Peaks keep +-inf (a blown-up logit is worth seeing); first/last take finite values only.
        """
        col = metrics[column].to_numpy(dtype="float64")
        keep = ~np.isnan(col) if how == "max" else np.isfinite(col)
        return metrics.loc[keep, key + [column]].groupby(key)[column].agg(how)

    def event_steps(frame: pd.DataFrame, how: str) -> pd.Series:
        """``how`` ("min" or "size") of the event steps per head."""
        frame = frame[key + ["step"]].astype("int64")
        grouped = frame.groupby(key)["step"]
        return grouped.size() if how == "size" else grouped.min()

    event = run.events["event"].astype("string")
    alerts = run.events[(event == "alert").fillna(False).to_numpy()]
    switches = run.events[(event == "switch").fillna(False).to_numpy()]
    alert_kind = alerts["kind"].astype("string")
    for kind in KINDS:
        of_kind = alerts[(alert_kind == kind).fillna(False).to_numpy()]
        attach(event_steps(of_kind, "min"), f"first_{kind}", "Int64")
    attach(event_steps(alerts, "size"), "alerts", "float64")
    out["alerts"] = out["alerts"].fillna(0).astype("int64")
    attach(metric_per_head("multi_max_freq", "max"), "peak_multi_max_freq", "float64")
    attach(metric_per_head("max_score", "max"), "peak_max_score", "float64")
    attach(metric_per_head("delta_cum", "last"), "final_delta_cum", "float64")
    attach(metric_per_head("sigma_wq", "first"), "sigma_first", "float64")
    attach(metric_per_head("sigma_wq", "last"), "sigma_last", "float64")
    with np.errstate(divide="ignore", invalid="ignore"):
        growth = out["sigma_last"].to_numpy(dtype="float64") / out["sigma_first"].to_numpy(dtype="float64")
    out["sigma_growth"] = np.where(np.isfinite(growth), growth, np.nan)
    attach(event_steps(switches, "min"), "switched_at", "Int64")

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
    finite = _finite(values)
    if not len(finite):
        return float("nan")
    return float(finite.iloc[-1] if last else finite.iloc[0])


class SummaryView:
    """Rich renderable of a run's summary: a header and the per-head table.

    Args:
        run: the loaded run.
        summary: its :func:`head_summary` (computed if not given).
        top: show at most this many heads (the first ones of the summary's
            order); a line says how many are not shown.
    """

    def __init__(self, run: "Run", summary: Optional[pd.DataFrame] = None, *, top: int = 20) -> None:
        self.run = run
        self.summary = head_summary(run) if summary is None else summary
        self.top = max(int(top), 0)

    def header(self) -> Text:
        """The lines above the table: run dir, steps, loss, alerts, switches, resumes."""
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
        resumed = run.meta.get("resumed_at") or []
        if resumed:
            text.append("\nresumed at step " + ", ".join(str(s) for s in resumed))
        return text

    def table(self) -> Table:
        """The per-head table (at most ``top`` rows)."""
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        table.add_column("layer", overflow="fold")
        table.add_column("head", justify="right", no_wrap=True)
        table.add_column("first alert\nstep kind", overflow="fold")
        table.add_column("alerts", justify="right", no_wrap=True)
        table.add_column("switch\nstep", justify="right", no_wrap=True)
        table.add_column("multi\nmax", justify="right", no_wrap=True)
        table.add_column("max\nlogit", justify="right", no_wrap=True)
        table.add_column("Σδlp−δhp\nfinal", justify="right", no_wrap=True)
        table.add_column("σ(W_Q)\ngrowth", justify="right", no_wrap=True)
        for row in self.summary.head(self.top).itertuples(index=False):
            firsts = sorted((int(getattr(row, f"first_{k}")), k) for k in KINDS
                            if not pd.isna(getattr(row, f"first_{k}")))
            alert_text = Text("\n".join(f"{s} {k}" for s, k in firsts) or "-",
                              style="bold red" if firsts else "")
            switch = "-" if pd.isna(row.switched_at) else str(int(row.switched_at))
            table.add_row(
                Text(str(row.layer_name)),
                str(row.head),
                alert_text,
                str(row.alerts) if row.alerts else "-",
                Text(switch, style="green" if switch != "-" else ""),
                _fmt(row.peak_multi_max_freq, ".0%"),
                _fmt(row.peak_max_score, ".4g"),
                _fmt(row.final_delta_cum, "+.3g"),
                "-" if pd.isna(row.sigma_growth) else f"×{row.sigma_growth:.3g}",
            )
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.header()
        if not len(self.summary):
            yield Text("no heads recorded")
            return
        yield self.table()
        hidden = len(self.summary) - min(self.top, len(self.summary))
        if hidden:
            yield Text(f"{hidden} more head{'s' if hidden != 1 else ''} not shown (use --top to show more)",
                       style="dim")


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


def _mark_events(axes: Sequence["Axes"], run: "Run", *, legend: bool) -> None:
    """Draw a vertical line per (step, kind) of alert and per switch step on every axis.

    Only the first axis gets legend labels (when ``legend``), one per kind.
    """
    events = run.events
    if not len(events):
        return
    kinds = events["kind"].astype("string").fillna("")
    steps = events["step"].astype("int64")
    is_alert = (events["event"].astype("string") == "alert").to_numpy()
    is_switch = (events["event"].astype("string") == "switch").to_numpy()
    alert_marks = sorted({(int(s), str(k)) for s, k in zip(steps[is_alert], kinds[is_alert])})
    switch_marks = sorted({int(s) for s in steps[is_switch]})
    for i, ax in enumerate(axes):
        labelled = set()
        for step, kind in alert_marks:
            label = None
            if legend and i == 0 and kind not in labelled:
                label, _ = f"alert: {kind}", labelled.add(kind)
            ax.axvline(step, color=KIND_COLORS.get(kind, "tab:gray"), linewidth=1.2, alpha=0.8, label=label)
        for j, step in enumerate(switch_marks):
            label = "switch to stabilized" if legend and i == 0 and j == 0 else None
            ax.axvline(step, color=SWITCH_COLOR, linestyle="--", linewidth=1.2, label=label)


def _plot_loss(ax: "Axes", run: "Run") -> None:
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


def _metric_figure(run: "Run", summary: pd.DataFrame, column: str, title: str, ylabel: str,
                   top: int) -> "Figure":
    """The figure of one metric: the metric per head above the loss, events marked.

    Args:
        run: the run.
        summary: its :func:`head_summary` (gives the order of the worst heads).
        column: the metrics column to plot.
        title, ylabel: the figure's title and the top panel's y label.
        top: how many heads (the first of ``summary``) get a colour and a label.

    Returns:
        An unsaved ``matplotlib.figure.Figure``.
    """
    Figure, FigureCanvasAgg = _require_matplotlib()
    fig = Figure(figsize=(11, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax_loss = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    fig.suptitle(f"{title}\n{run.run_dir}", fontsize="medium")

    values = run.metrics[["step", "layer", "head", column]]
    col = values[column].to_numpy(dtype="float64")
    values = values[np.isfinite(col)].sort_values("step", kind="mergesort")
    series: Dict[Tuple[int, int], pd.DataFrame] = {
        (int(layer), int(head)): g for (layer, head), g in values.groupby(["layer", "head"])
    }
    worst = [(int(r.layer), int(r.head), str(r.layer_name)) for r in summary.head(top).itertuples(index=False)]
    worst_keys = {(layer, head) for layer, head, _ in worst}
    if series:
        for key, g in series.items():
            if key not in worst_keys:
                ax.plot(g["step"].to_numpy(), g[column].to_numpy(), color="0.7", linewidth=0.6, zorder=1)
        for i, (layer, head, name) in enumerate(worst):
            g = series.get((layer, head))
            if g is None:
                continue
            few = len(g) <= 60
            ax.plot(g["step"].to_numpy(), g[column].to_numpy(), color=HEAD_COLORS[i % len(HEAD_COLORS)], linewidth=1.6, zorder=3,
                    marker="o" if few else None, markersize=3, label=_head_label(name, head))
    else:
        ax.text(0.5, 0.5, f"no data: {column} was not observed in this run", transform=ax.transAxes,
                ha="center", va="center", color="tab:gray")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    _mark_events([ax, ax_loss], run, legend=True)
    _plot_loss(ax_loss, run)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


def _loss_figure(run: "Run") -> "Figure":
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


def write_plots(run: "Run", out_dir: str | os.PathLike, top: int = 6, *,
                summary: Optional[pd.DataFrame] = None) -> List[Path]:
    """Write the report's PNGs into ``out_dir`` (created if missing).

    Uses matplotlib's object-oriented API with the Agg canvas only: pyplot is
    not imported and the user's interactive backend is left alone.

    Args:
        run: a loaded run directory.
        out_dir: where to write the files.
        top: how many of the worst heads (in :func:`head_summary`'s order) are
            drawn in colour and labelled; all other heads are thin gray lines.
        summary: the run's :func:`head_summary`, if already computed.

    Returns:
        The paths written, in this order: ``sigma_wq.png``, ``multi_max.png``,
        ``delta_cum.png``, ``max_score.png``, ``loss.png``.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
        OSError: ``out_dir`` cannot be created or written.
    """
    _require_matplotlib()
    summary = head_summary(run) if summary is None else summary
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: List[Path] = []
    figures = [(stem, lambda c=column, t=title, y=ylabel: _metric_figure(run, summary, c, t, y, top))
               for stem, column, title, ylabel in METRIC_PLOTS]
    figures.append(("loss", lambda: _loss_figure(run)))
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

    Args:
        run_dir: the run directory.
        out_dir: where the PNGs go (default ``RUN_DIR/report/``).
        top: rows of the summary table; the plots colour the first ``min(top, 6)`` heads.
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
    run = load_run(run_dir)
    summary = head_summary(run)
    console.print(SummaryView(run, summary, top=top))
    if not plots:
        return 0
    if not _have_matplotlib():
        console.print(f"plots skipped: matplotlib is not installed; {INSTALL_PLOTS}", markup=False, highlight=False)
        return 0
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    written = write_plots(run, out, top=max(1, min(top, 6)), summary=summary)
    console.print(f"wrote {len(written)} plots:", markup=False, highlight=False)
    for path in written:
        console.print(f"  {path}", markup=False, highlight=False, soft_wrap=True)
    return 0
