"""Live ``rich`` output: a panel per alert and a compact table of the worst heads.

The renderables (:class:`AlertPanel`, :class:`HeadTable`) are objects, separate
from printing; :class:`ConsoleReporter` is the watch listener that prints them
on a :class:`rich.console.Console` that is passed in (by default rich's global
console, the one Lightning's ``RichProgressBar`` draws on, so panels appear
above the progress bar instead of tearing it).

The live table (``live_table=True``) is a :class:`rich.live.Live` updated at
every read-back (every ``WatchConfig.log_every`` steps). When a progress bar
already holds a live display on the same console, the table nests under it
(rich >= 14.1 draws nested live displays together); where that is not possible,
or the console is not a terminal, the table is printed as a plain block instead
(when alerts arrive and at the end).

Example::

    from rich.console import Console
    reporter = ConsoleReporter(Console(), live_table=True)
    watch = InstabilityWatch(model, listeners=[reporter])
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from rich.console import Console, ConsoleOptions, RenderResult
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from instability_watch.detect.detectors import Alert
from instability_watch.detect.kinds import ALERT_KINDS

if TYPE_CHECKING:  # pragma: no cover
    from instability_watch.engine.metrics import StepMetrics
    from instability_watch.engine.readback import ReadBack
    from instability_watch.observe.coverage import LayerCoverage

def coverage_line(coverage: Sequence["LayerCoverage"], head_counts: Sequence[int]) -> str:
    """One line on what the watch observes, e.g. ``12 layers × 12 heads observed; 0 calls unobserved``."""
    n = len(head_counts)
    seen = [c for c in coverage if c.observed_calls]
    heads = f"{head_counts[0]} heads" if len(set(head_counts)) == 1 else f"{sum(head_counts)} heads in all"
    layers = f"{n} layers" if len(seen) == n else f"{len(seen)} of {n} layers"
    parts = [f"{layers} × {heads} observed"]

    def tally(field: str) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for c in coverage:
            for reason, k in getattr(c, field).items():
                out[reason] = out.get(reason, 0) + k
        return out

    def listed(d: Dict[str, int]) -> str:
        return "; ".join(f"{r}: {k}" for r, k in d.items())

    unobserved = tally("unobserved_calls")
    total = sum(unobserved.values())
    parts.append(f"{total} calls unobserved" + (f" ({listed(unobserved)})" if total else ""))
    skipped = tally("shadow_skipped")
    if skipped:
        parts.append(f"{sum(skipped.values())} calls without shadow ({listed(skipped)})")
    not_applied = tally("not_applied")
    if not_applied:
        parts.append(f"switch not applied to {sum(not_applied.values())} calls ({listed(not_applied)})")
    return "; ".join(parts)


def _fmt(x: float, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


class AlertPanel:
    """A rich panel for one :class:`Alert`: layer, head, what tripped, value vs threshold, action."""

    def __init__(self, alert: Alert) -> None:
        self.alert = alert

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        a = self.alert
        switched = a.action.startswith("switched")
        colour = "red" if a.kind == "nonfinite" else ("green" if switched else "yellow")
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_row("layer", Text(f"{a.layer_name or a.layer} (#{a.layer})"))
        grid.add_row("head", str(a.head))
        known = ALERT_KINDS.get(a.kind)
        grid.add_row("kind", escape(f"{a.kind}: {known.title if known else a.kind}"))
        grid.add_row("value", f"{_fmt(a.value)} vs threshold {_fmt(a.threshold)}  ({known.units if known else ''})")
        grid.add_row("action", Text(a.action, style="bold green" if switched else ""))
        grid.add_row("why", Text(a.message, style="dim"))
        yield Panel(
            grid,
            title=f"[bold]instability_watch[/] · step {a.step} · {a.kind}",
            title_align="left",
            border_style=colour,
            expand=False,
        )


class HeadTable:
    """A compact table of the ``top`` worst heads of the latest read-back.

    The state column says ``stabilized@STEP`` (``exact-δ@STEP`` with ``switch_to="exact_delta"``) for a switched
    head and lists the kinds that alerted. A head's score is the largest of its metrics relative to the median head:
    multi-max frequency, largest logit, ``|sum(delta_lp - delta_hp)|`` so far
    and sigma(W_Q) growth since first observed. Heads with alerts come first.

    Args:
        rows: per-head records, as built by :meth:`HeadTracker.rows`.
        step: the step the table describes.
        top: how many heads to show.
    """

    COLUMNS = ("layer", "head", "multi-max", "max logit", "Σδ drift", "σ growth", "state")

    def __init__(self, rows: List[dict], *, step: int, top: int = 8) -> None:
        self.rows = rows
        self.step = step
        self.top = top

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table = Table(
            title=f"instability_watch · worst heads at step {self.step}",
            title_justify="left",
            caption=(f"{len(self.rows) - self.top} more heads not shown" if len(self.rows) > self.top else None),
            caption_justify="left",
            show_edge=False,
            pad_edge=False,
            header_style="bold",
        )
        for name in self.COLUMNS:
            table.add_column(name, justify="left" if name in ("layer", "state") else "right",
                             no_wrap=name != "state", overflow="fold" if name == "layer" else "ellipsis")
        names = short_names([r["layer_name"] for r in self.rows])
        for r, name in zip(self.rows[: self.top], names):
            style = "green" if r["stabilized"] else ("yellow" if r["alerts"] else None)
            table.add_row(
                Text(name), str(r["head"]), _fmt(r["multi_max_freq"], 3), _fmt(r["max_score"], 4),
                _fmt(r["delta_cum"], 3), _fmt(r["sigma_growth"], 3), Text(r["state"]),
                style=style,
            )
        yield table


def short_names(names: List[str]) -> List[str]:
    """Drop the dotted prefix all names share (``model.h.0.attn`` -> ``h.0.attn``)."""
    if len(set(names)) < 2:
        return list(names)
    parts = [n.split(".") for n in names]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    common = max(common - 1, 0)  # keep the container's name: h.0.attn, not 0.attn
    return [".".join(p[common:]) for p in parts]


class HeadTracker:
    """Keeps what the head table needs between read-backs (first sigma(W_Q) seen, last values)."""

    def __init__(self) -> None:
        self.sigma0: Optional[np.ndarray] = None
        self.last: Dict[str, np.ndarray] = {}
        self.step = 0

    def update(self, metrics: Sequence["StepMetrics"]) -> None:
        """Take in a read-back's steps (each metric float64 ``(L, H)``): the last values, the first sigma(W_Q)."""
        if not metrics:
            return
        with np.errstate(all="ignore"):
            for m in metrics:
                sig = m["sigma_wq"]
                if self.sigma0 is None:
                    self.sigma0 = np.full(sig.shape, np.nan)
                first = np.isnan(self.sigma0) & np.isfinite(sig)
                self.sigma0 = np.where(first, sig, self.sigma0)
                if np.isfinite(sig).any():
                    self.last["sigma_wq"] = np.where(np.isnan(sig), self.last.get("sigma_wq", sig), sig)
            stacked = {k: np.stack([m[k] for m in metrics]) for k in ("multi_max_freq", "max_score")}
            self.last["multi_max_freq"] = _nanmean0(stacked["multi_max_freq"])
            self.last["max_score"] = _nanmax0(stacked["max_score"])
            self.last["delta_cum"] = metrics[-1]["delta_cum"]
        self.step = metrics[-1].step

    def rows(self, record: "ReadBack") -> List[dict]:
        """Per-head records of the watch as of ``record``, worst first."""
        if not self.last:
            return []
        shape = record.shape
        nan = np.full(shape, np.nan)
        mmf = self.last.get("multi_max_freq", nan)
        score = self.last.get("max_score", nan)
        dcum = self.last.get("delta_cum", nan)
        sig = self.last.get("sigma_wq", nan)
        with np.errstate(all="ignore"):
            growth = sig / self.sigma0 if self.sigma0 is not None else nan
            parts = [np.abs(x) / np.nanmedian(np.abs(x)) if np.isfinite(x).any() else np.zeros(shape)
                     for x in (mmf, score, dcum, growth)]
            badness = np.nanmax(np.stack([np.nan_to_num(p, nan=0.0, posinf=1e300) for p in parts]), axis=0)
        alerts: Dict[Tuple[int, int], List[str]] = {}
        for a in record.all_alerts:
            alerts.setdefault((a.layer, a.head), []).append(a.kind)
        out = []
        for layer, heads in enumerate(record.head_counts):
            for head in range(heads):
                kinds = alerts.get((layer, head), [])
                stab = (layer, head) in record.switched
                state = []
                if stab:  # what the switch did: the stabilized kernel, or the layer's exact delta
                    what = "exact-δ" if record.config.switch_to == "exact_delta" else "stabilized"
                    state.append(f"{what}@{record.switched[(layer, head)]}")
                if kinds:
                    state.append(",".join(ALERT_KINDS[k].short if k in ALERT_KINDS else k for k in dict.fromkeys(kinds)))
                out.append({
                    "layer": layer, "layer_name": record.layer_names[layer], "head": head,
                    "multi_max_freq": float(mmf[layer, head]), "max_score": float(score[layer, head]),
                    "delta_cum": float(dcum[layer, head]), "sigma_wq": float(sig[layer, head]),
                    "sigma_growth": float(growth[layer, head]), "alerts": len(kinds), "stabilized": stab,
                    "state": "; ".join(state) or "ok", "_badness": float(badness[layer, head]),
                })
        out.sort(key=lambda r: (-(r["alerts"] > 0 or r["stabilized"]), -r["_badness"]))
        return out


def _nanmean0(a: np.ndarray) -> np.ndarray:
    ok = np.isfinite(a)
    n = ok.sum(axis=0)
    return np.where(n > 0, np.where(ok, a, 0.0).sum(axis=0) / np.maximum(n, 1), np.nan)


def _nanmax0(a: np.ndarray) -> np.ndarray:
    ok = ~np.isnan(a)
    return np.where(ok.any(axis=0), np.where(ok, a, -np.inf).max(axis=0), np.nan)


class ConsoleReporter:
    """A watch listener that prints alert panels and (optionally) the live worst-heads table.

    Args:
        console: where to print; rich's global console if ``None`` (the one
            Lightning's ``RichProgressBar`` uses).
        alerts: print a panel per new alert.
        live_table: keep a table of the worst heads, refreshed at every read-back.
        top: rows in that table.
        coverage: print, once, a line saying what the watch observes (after the first
            probe step), and a line for each switch that could not be applied.
        clip_every_s: QK-clips (``WatchConfig(qk_clip=...)``) are summed into one line
            printed at most this often (seconds; the first clip at once).
        clock: the time source for ``clip_every_s`` (``time.monotonic``).
    """

    def __init__(self, console: Optional[Console] = None, *, alerts: bool = True, live_table: bool = False,
                 top: int = 8, coverage: bool = True, clip_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(top, int) or isinstance(top, bool) or top < 1:
            raise ValueError(f"top must be a positive integer, got {top!r}")
        if (not isinstance(clip_every_s, (int, float)) or isinstance(clip_every_s, bool)
                or not math.isfinite(clip_every_s) or clip_every_s < 0):
            raise ValueError(f"clip_every_s must be a finite number of seconds >= 0, got {clip_every_s!r}")
        self.clip_every_s = float(clip_every_s)
        self._clock = clock
        self._clip_printed_at: Optional[float] = None
        self._clips_unshown: list = []
        if console is None:
            from rich import get_console

            console = get_console()
        self.console = console
        self.show_alerts = bool(alerts)
        self.live_table = bool(live_table)
        self.top = top
        self.tracker = HeadTracker()
        self._live = None
        self._closed = False
        self._record: Optional["ReadBack"] = None  # the last read-back
        self.show_coverage = bool(coverage)
        self._coverage_shown = False

    def table(self, record: Optional["ReadBack"] = None) -> Optional[HeadTable]:
        """The current worst-heads table (``None`` before the first read-back)."""
        record = record or self._record
        if record is None or not self.tracker.last:
            return None
        return HeadTable(self.tracker.rows(record), step=self.tracker.step, top=self.top)

    def __call__(self, record: "ReadBack") -> None:
        self._record = record
        if self.show_coverage and not self._coverage_shown:
            coverage = record.coverage
            if any(c.observed_calls or c.unobserved_calls for c in coverage):
                self._coverage_shown = True
                self.console.print(Text(f"instability_watch: {coverage_line(coverage, record.head_counts)}"))
        for e in record.events if self.show_coverage else ():
            if e.kind == "switch_not_applied":
                self.console.print(Text(f"instability_watch: {e.sentence()}", style="yellow"))
        self._show_clips(record.clips)
        if self.live_table:
            self.tracker.update(record.metrics)
        if self.show_alerts:
            for a in record.alerts:
                self.console.print(AlertPanel(a))
        if self.live_table:
            table = self.table(record)
            if table is not None:
                self._show(table, force_print=bool(record.alerts))

    def _show_clips(self, clips: list, final: bool = False) -> None:
        """One line summing the clips since the last such line, at most every ``clip_every_s``."""
        self._clips_unshown.extend(clips)
        pending = self._clips_unshown
        if not pending:
            return
        now = self._clock()
        if not final and self._clip_printed_at is not None and now - self._clip_printed_at < self.clip_every_s:
            return
        self._clip_printed_at = now
        heads = {(c.layer, c.head) for c in pending}
        low = min(pending, key=lambda c: c.factor)
        first, last = min(c.step for c in pending), max(c.step for c in pending)
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        self.console.print(Text(
            f"instability_watch: QK-clip, {steps}: {len(pending)} clips in {len(heads)} heads (largest logit "
            f"{low.max_logit:.4g} in {low.layer_name} head {low.head}, scaled by {low.factor:.3g} to {low.tau:g})",
            style="magenta"))
        self._clips_unshown = []

    # -- the live display

    def _on_console(self, live) -> bool:
        """``live`` is still on the console's live stack (a progress bar restarting can pop it)."""
        stack = getattr(self.console, "_live_stack", None)
        return live is not None and (stack is None or live in stack)

    def _show(self, table: HeadTable, *, force_print: bool) -> None:
        if not self.console.is_terminal:
            if force_print:
                self.console.print(table)
            return
        if self._on_console(self._live):
            self._live.update(table, refresh=True)
            return
        self._live = None  # never started, or removed from the console by someone else
        from rich.errors import LiveError
        from rich.live import Live

        live = Live(table, console=self.console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False)
        try:
            live.start(refresh=True)
        except LiveError:  # an older rich with another live display active: print instead
            self.console.print(table)
            return
        self._live = live

    def close(self) -> None:
        """Print the clips held back; stop the live table, leaving its last state on screen (printed once on
        non-terminals)."""
        if self._closed:
            return
        self._closed = True
        self._show_clips([], final=True)  # clips held back by the rate limit
        if self._live is not None:
            live, self._live = self._live, None
            if self._on_console(live):
                try:
                    live.stop()
                except Exception:  # the console's live stack was changed under us
                    pass
        elif self.live_table and not self.console.is_terminal:
            table = self.table()
            if table is not None:
                self.console.print(table)
