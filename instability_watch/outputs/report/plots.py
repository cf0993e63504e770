"""The report's plots: one PNG per metric with the most extreme heads coloured, alerts and actions marked."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

from instability_watch.detect.kinds import ALERT_KINDS

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


from instability_watch.outputs.report.digest import METRIC_PLOTS, AnyRun, RunDigest, as_digest
from instability_watch.outputs.report.summary import head_summary

INSTALL_PLOTS = 'install matplotlib: pip install "instability_watch[plots]"'


# alert marks: one colour per kind (ALERT_KINDS[kind].color); switches: dashed dark gray. The heads' colours avoid all of them.
SWITCH_COLOR = "0.3"


CLIP_COLOR = "darkmagenta"


GRAY = "0.7"


HEAD_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:brown", "tab:cyan", "navy", "darkgoldenrod",
               "teal", "slateblue", "darkkhaki", "peru", "mediumseagreen")


def require_matplotlib():
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
    d = as_digest(run)
    extreme = d.extreme[column]
    heads = d.heads
    seen = np.flatnonzero(~np.isnan(extreme))
    # most extreme first; ties by layer, head
    order = seen[np.lexsort((heads["head"].to_numpy()[seen], heads["layer"].to_numpy()[seen], -extreme[seen]))]
    summary = head_summary(d) if summary is None else summary
    flagged = summary[(summary["alerts"] > 0) | summary["switched_at"].notna()]
    flag = {(int(r.layer), int(r.head)): "alert" if r.alerts else "switched" for r in flagged.itertuples(index=False)}

    def label(i: int) -> str:  # an alerted or switched head says so wherever it is in the legend
        key = (int(heads["layer"].iat[i]), int(heads["head"].iat[i]))
        return _head_label(heads["layer_name"].iat[i], key[1]) + (f" ({flag[key]})" if key in flag else "")

    chosen = [(int(i), label(int(i))) for i in order[:top]]
    if len(flagged) and len(heads):
        row_of = {(int(l), int(h)): i for i, (l, h) in enumerate(zip(heads["layer"], heads["head"]))}
        taken = {i for i, _ in chosen}
        extra = 0
        for r in flagged.itertuples(index=False):
            i = row_of.get((int(r.layer), int(r.head)))
            if i is None or i in taken or extra >= top or np.isnan(extreme[i]):
                continue
            chosen.append((i, label(i)))
            taken.add(i)
            extra += 1
    return chosen


def _flagged_in_gray(d, summary: pd.DataFrame, coloured: set, column: str) -> int:
    """How many heads that alerted or were switched (with data in ``column``) the plot leaves gray."""
    flagged = summary[(summary["alerts"] > 0) | summary["switched_at"].notna()]
    row_of = {(int(l), int(h)): i for i, (l, h) in enumerate(zip(d.heads["layer"], d.heads["head"]))}
    rows = (row_of.get((int(r.layer), int(r.head))) for r in flagged.itertuples(index=False))
    return sum(1 for i in rows if i is not None and i not in coloured and not np.isnan(d.extreme[column][i]))


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


def metric_figure(run: AnyRun, summary: Optional[pd.DataFrame], column: str, title: str, ylabel: str,
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
    Figure, FigureCanvasAgg = require_matplotlib()
    d = as_digest(run)
    fig = Figure(figsize=(11, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax_loss = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    fig.suptitle(f"{title}\n{d.run_dir}", fontsize="medium")

    summary = head_summary(d) if summary is None else summary
    chosen = highlighted_heads(d, column, top, summary)
    coloured = {i for i, _ in chosen}
    gray_flagged = _flagged_in_gray(d, summary, coloured, column)
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
    if gray_flagged:  # the legend says how many alerted heads it had no colour for
        ax.plot([], [], color=GRAY, linewidth=0.6, label=f"{gray_flagged} more heads alerted or switched (gray)")
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
    Figure, FigureCanvasAgg = require_matplotlib()
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
    require_matplotlib()
    d = as_digest(run)
    summary = head_summary(d) if summary is None else summary
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: List[Path] = []
    figures = [(stem, lambda c=column, t=title, y=ylabel: metric_figure(d, summary, c, t, y, top))
               for stem, column, title, ylabel, _ in METRIC_PLOTS]
    figures.append(("loss", lambda: _loss_figure(d)))
    for stem, build in figures:
        path = out / f"{stem}.png"
        build().savefig(path, dpi=100)
        written.append(path)
    return written


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (the report\'s PNGs need it)."""
    try:
        require_matplotlib()
    except ImportError:
        return False
    return True
