"""The run directory: per-step diagnostics that survive a crash, and loading them back.

A run directory holds three files::

    meta.json     what was watched (layers, heads, config), written at open
    metrics.csv   long format: one row per (step, layer, head), columns METRIC_COLUMNS
    events.csv    one row per alert or switch, columns EVENT_COLUMNS

:class:`RunWriter` is a listener of :class:`~instability_watch.InstabilityWatch`:
after every read-back it appends the steps just read and the new events, then
flushes both files (and fsyncs them with ``fsync=True``). A run that is killed keeps every step read back
before the kill; what is lost is at most the steps since the last read-back
(``WatchConfig.log_every``) and, at worst, one partly written last line, which
:func:`load_run` drops.

Resuming from a checkpoint reopens the same directory with ``resume_step``:
rows after that step (written after the checkpoint by the run that died) are
cut, so the resumed run writes every later step exactly once.

Example::

    writer = RunWriter("runs/exp1")
    watch = InstabilityWatch(model, listeners=[writer])
    writer.open(watch)
    ...                                     # train; watch.step(loss) each step
    watch.detach(); writer.close()
    run = load_run("runs/exp1")             # run.metrics, run.events: DataFrames
"""
from __future__ import annotations

import datetime as _dt
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence

import numpy as np

from .watch import METRICS, StepMetrics

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from .detectors import Alert
    from .watch import InstabilityWatch

FORMAT_VERSION = 1
META_FILE = "meta.json"
METRICS_FILE = "metrics.csv"
EVENTS_FILE = "events.csv"

METRIC_COLUMNS = ("step", "layer", "layer_name", "head", "loss") + METRICS
EVENT_COLUMNS = ("step", "layer", "layer_name", "head", "event", "kind", "value", "threshold", "action", "message")


class RunDirError(ValueError):
    """A run directory that is missing, not a run directory, or malformed."""


def _csv_text(value: str) -> str:
    """Quote a text field when it needs it (RFC 4180)."""
    if any(c in value for c in ',"\n\r'):
        return '"' + value.replace('"', '""') + '"'
    return value


def _num(x: float) -> str:
    return "%.9g" % float(x)


def _line(fields: Sequence[str]) -> str:
    return ",".join(fields) + "\n"


def _keep_through(path: Path, step: int) -> int:
    """Rewrite a CSV keeping the header and the rows whose ``step`` is <= ``step``; returns rows kept."""
    tmp = path.with_name(path.name + ".tmp")
    kept = 0
    with open(path, "r", newline="") as src, open(tmp, "w", newline="") as dst:
        header = src.readline()
        dst.write(header)
        for line in src:
            if not line.endswith("\n"):
                break  # a partly written last line (the run was killed)
            head, _, _ = line.partition(",")
            try:
                s = int(head)
            except ValueError:
                break
            if s <= step:
                dst.write(line)
                kept += 1
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)
    return kept


class RunWriter:
    """Writes a run directory as the watch reads statistics back (a watch listener).

    Args:
        run_dir: the directory (created if missing).
        overwrite: replace an existing run in ``run_dir``. Without it, opening a
            directory that already holds a run is an error, unless resuming.
        fsync: also ``os.fsync`` after each append, so the data survives a
            machine crash, not only a killed process (a flush alone survives a
            killed process). Off by default: the read-back happens while the GPU
            waits, and an fsync can take tens of milliseconds.

    Raises:
        FileExistsError: at :meth:`open`, ``run_dir`` holds a run and neither
            ``overwrite`` nor ``resume_step`` was given.
        RunDirError: at :meth:`open` with ``resume_step``, the directory holds a
            run of other layers or heads.
    """

    def __init__(self, run_dir: str | os.PathLike, *, overwrite: bool = False, fsync: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.overwrite = bool(overwrite)
        self.fsync = bool(fsync)
        self._metrics_f: Optional[io.TextIOBase] = None
        self._events_f: Optional[io.TextIOBase] = None
        self._events_written = 0
        self._meta: dict = {}
        self._coverage: Optional[list] = None
        self._layer_names: List[str] = []
        self._head_counts: List[int] = []

    @property
    def is_open(self) -> bool:
        return self._metrics_f is not None

    def open(self, watch: "InstabilityWatch", *, resume_step: Optional[int] = None, extra_meta: Optional[dict] = None) -> None:
        """Create (or, with ``resume_step``, continue) the run directory for ``watch``'s layers."""
        if self.is_open:
            return
        self._layer_names = list(watch.layer_names)
        self._head_counts = list(watch.head_counts)
        d = self.run_dir
        meta_path, metrics_path, events_path = d / META_FILE, d / METRICS_FILE, d / EVENTS_FILE
        exists = metrics_path.exists() or meta_path.exists()
        d.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT_VERSION,
            "layers": self._layer_names,
            "heads": self._head_counts,
            "config": watch.config.to_dict(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "resumed_at": [],
        }
        if extra_meta:
            meta.update(extra_meta)
        if exists and resume_step is not None and metrics_path.exists():
            old = _read_meta(d)
            if old.get("layers") != self._layer_names or old.get("heads") != self._head_counts:
                raise RunDirError(
                    f"{d}: holds a run of layers {old.get('layers')} with heads {old.get('heads')}; "
                    f"this model has {self._layer_names} with {self._head_counts}"
                )
            meta["created"] = old.get("created", meta["created"])
            meta["resumed_at"] = list(old.get("resumed_at", [])) + [int(resume_step)]
            _keep_through(metrics_path, resume_step)
            if events_path.exists():
                _keep_through(events_path, resume_step)
            else:
                events_path.write_text(_line(EVENT_COLUMNS))
            mode = "a"
        elif exists and not self.overwrite:
            raise FileExistsError(
                f"run_dir {str(d)!r} already holds a run; pass overwrite=True to replace it, "
                "or choose another directory"
            )
        else:
            mode = "w"
        _write_json(meta_path, meta)
        self._meta = meta
        self._metrics_f = open(metrics_path, mode, newline="", encoding="utf-8")
        self._events_f = open(events_path, mode, newline="", encoding="utf-8")
        if mode == "w":
            self._metrics_f.write(_line(METRIC_COLUMNS))
            self._events_f.write(_line(EVENT_COLUMNS))
        # events already in the watch (restored from a checkpoint) are in the file
        self._events_written = len(watch.events)
        self._sync()

    def __call__(self, metrics: List[StepMetrics], alerts: List["Alert"], watch: "InstabilityWatch") -> None:
        """Append the steps just read back and the new alerts and switches; flush."""
        if not self.is_open:
            self.open(watch)
        self._metrics_f.write(self.format_metrics(metrics))
        lines = []
        for a in alerts:
            lines.append(_line([
                str(a.step), str(a.layer), _csv_text(a.layer_name), str(a.head), "alert", _csv_text(a.kind),
                _num(a.value), _num(a.threshold), _csv_text(a.action), _csv_text(a.message),
            ]))
        for e in watch.events[self._events_written:]:
            if e.kind == "switch_not_applied":
                what = (f"{e.layer_name} head {e.head}: switch not applied to calls with {e.reason}; "
                        "they stay on PyTorch's SDPA")
            else:
                what = f"{e.layer_name} head {e.head} moved to the stabilized kernel ({e.reason})"
            lines.append(_line([
                str(e.step), str(e.layer), _csv_text(e.layer_name), str(e.head), _csv_text(e.kind), _csv_text(e.reason),
                "", "", "", _csv_text(what),
            ]))
        self._events_written = len(watch.events)
        self._events_f.write("".join(lines))
        self._sync()
        coverage = [c.to_dict() for c in watch.coverage()]
        if coverage != self._coverage:  # what was observed, in meta.json (rewritten atomically when it changes)
            self._coverage = coverage
            self._meta["coverage"] = coverage
            _write_json(self.run_dir / META_FILE, self._meta)

    def format_metrics(self, metrics: List[StepMetrics]) -> str:
        """The CSV lines of ``metrics`` (padded heads of narrower layers left out).

        One C-level ``%`` format per row: a GPT-2-small read-back (10 steps x
        144 heads) formats in a few milliseconds.
        """
        names = [_csv_text(n) for n in self._layer_names]
        layer_idx = np.repeat(np.arange(len(self._head_counts)), self._head_counts)
        head_idx = np.concatenate([np.arange(h) for h in self._head_counts]) if self._head_counts else layer_idx
        rows = list(zip(layer_idx.tolist(), head_idx.tolist()))
        fmt = "%d,%d,%s,%d,%.9g," + ",".join("%.9g" for _ in METRICS) + "\n"
        out: List[str] = []
        for m in metrics:
            block = np.stack([m.values[k][layer_idx, head_idx] for k in METRICS], axis=1).tolist()
            out.extend(fmt % (m.step, l, names[l], h, m.loss, *r) for (l, h), r in zip(rows, block))
        return "".join(out)

    def _sync(self) -> None:
        for f in (self._metrics_f, self._events_f):
            if f is not None:
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())

    def close(self) -> None:
        for f in (self._metrics_f, self._events_f):
            if f is not None:
                try:
                    f.flush()
                finally:
                    f.close()
        self._metrics_f = self._events_f = None


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def _read_meta(d: Path) -> dict:
    path = d / META_FILE
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise RunDirError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    return meta


@dataclass
class Run:
    """A loaded run directory.

    Attributes:
        run_dir: where it was read from.
        meta: ``meta.json`` (layers, heads, config, created, resumed_at).
        metrics: one row per (step, layer, head); columns :data:`METRIC_COLUMNS`.
        events: one row per alert or switch; columns :data:`EVENT_COLUMNS`.
    """

    run_dir: Path
    meta: dict
    metrics: "pd.DataFrame"
    events: "pd.DataFrame"

    @property
    def steps(self) -> "pd.DataFrame":
        """One row per step: ``step`` and ``loss``."""
        return self.metrics.groupby("step", as_index=False)["loss"].first()


def _read_csv(path: Path, columns: Sequence[str], key: Sequence[str]) -> "pd.DataFrame":
    import pandas as pd

    data = path.read_bytes()
    if not data:
        raise RunDirError(f"{path}: empty file (no header)")
    cut = data.rfind(b"\n")
    data = data[: cut + 1]  # a partly written last line, if any, is dropped
    header = data.split(b"\n", 1)[0].decode("utf-8", "replace").strip().split(",")
    if header != list(columns):
        raise RunDirError(f"{path}: unexpected header {header[:6]}...; expected columns {list(columns)[:6]}...")
    dtypes = {"step": "int64", "layer": "int64", "head": "int64", "layer_name": "string"}
    text_cols = {"event", "kind", "action", "message"}
    dtypes.update({c: "string" for c in columns if c in text_cols})
    floats = [c for c in columns if c not in dtypes]
    try:
        df = pd.read_csv(io.BytesIO(data), dtype={c: t for c, t in dtypes.items() if c in columns},
                         keep_default_na=False, na_values={c: ["nan", ""] for c in floats})
        df[floats] = df[floats].astype("float64")
    except (ValueError, pd.errors.ParserError) as exc:
        raise RunDirError(f"{path}: malformed CSV ({str(exc).splitlines()[0]})") from None
    # a resumed run that was not truncated would repeat rows: the later one wins
    return df.drop_duplicates(subset=list(key), keep="last").reset_index(drop=True)


def load_run(run_dir: str | os.PathLike) -> Run:
    """Read a run directory written by :class:`RunWriter` (also one of a killed run).

    Raises:
        RunDirError: the directory is missing, holds no ``metrics.csv``, or a
            file is malformed; the message names the path.
    """
    d = Path(run_dir)
    if not d.exists():
        raise RunDirError(f"{d}: no such directory")
    if not d.is_dir():
        raise RunDirError(f"{d}: not a directory")
    if not (d / METRICS_FILE).exists():
        raise RunDirError(f"{d}: not an instability_watch run directory (no {METRICS_FILE})")
    meta = _read_meta(d)
    metrics = _read_csv(d / METRICS_FILE, METRIC_COLUMNS, ("step", "layer", "head"))
    if (d / EVENTS_FILE).exists():
        events = _read_csv(d / EVENTS_FILE, EVENT_COLUMNS, EVENT_COLUMNS[:2] + ("head", "event", "kind"))
    else:
        import pandas as pd

        events = pd.DataFrame({c: pd.Series(dtype="object") for c in EVENT_COLUMNS})
    return Run(run_dir=d, meta=meta, metrics=metrics, events=events)
