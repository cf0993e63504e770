"""The run directory: per-step diagnostics that survive a crash, and loading them back.

A run directory holds three files::

    meta.json     what was watched (layers, heads, config), written at open
    metrics.csv   long format: one row per (step, layer, head), columns METRIC_COLUMNS
    events.csv    one row per alert, switch or QK-clip, columns EVENT_COLUMNS

:class:`RunWriter` is a listener of :class:`~instability_watch.InstabilityWatch`:
after every read-back it appends the steps just read and the new events, one
unbuffered write per file (fsynced with ``fsync=True``). A run that is killed
keeps every step read back before the kill; what is lost is at most the steps
since the last read-back (``WatchConfig.log_every``) and, at worst, one partly
written last line, which :func:`load_run` skips. A write that fails (a full
disk) is cut back: both files keep exactly the whole steps before it; the
failure is reported once ("writing failed at step N ...; later steps are not
recorded"), nothing more is written, training goes on (unless ``strict``).

Resuming from a checkpoint reopens the same directory with ``resume_step``:
rows after that step (written after the checkpoint by the run that died) are
cut, so the resumed run writes every later step exactly once. Lines that do not
parse are dropped then (their count in one warning); every whole row through
that step is kept, also those after a bad line.

Reading a run back (:func:`load_run`, :func:`stream_run`, and so the report)
follows one rule:

* Fatal, a :class:`RunDirError` whose one-line message names the path: the
  directory is missing, is not a directory, or holds no metrics.csv;
  metrics.csv is empty or its header is not :data:`METRIC_COLUMNS`; meta.json
  exists but is not a JSON object.
* Skipped, never silently: a line that does not parse (the wrong number of
  fields; step, layer or head not an integer within int64; a metric that is
  not a number, ``nan`` or ``inf``; bytes that are not UTF-8; a row spread over
  two lines); a last line without its newline (a torn write); the last step of
  metrics.csv when it has fewer rows than the run has heads, as a run killed
  mid-write leaves it (the heads are the (layer, head) pairs metrics.csv holds;
  meta.json's count only where it agrees with them). Every good row is kept,
  also those after a bad line. Each kind is one line of :attr:`Run.problems`
  (``"metrics.csv: 3 malformed lines skipped (first at line 1042)"``), which
  the report prints under its header.
* Treated as missing, with a note: an empty events.csv (no events), an
  events.csv with another header, a meta.json field of the wrong type or whose
  layers and heads disagree with metrics.csv. Nothing is sized from meta.json.
* A (step, layer, head) written twice (a resumed run whose file was not cut
  back): the later row wins.

Example::

    writer = RunWriter("runs/exp1")
    watch = InstabilityWatch(model, listeners=[writer])
    writer.open(watch)
    ...                                     # train; watch.step(loss) each step
    watch.detach(); writer.close()
    run = load_run("runs/exp1")             # run.metrics, run.events: DataFrames
"""
from __future__ import annotations

import bisect
import csv
import datetime as _dt
import errno
import io
import itertools
import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ._dist import rank
from .watch import METRICS, StepMetrics

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from .detectors import Alert
    from .watch import InstabilityWatch

FORMAT_VERSION = 1
META_FILE = "meta.json"
METRICS_FILE = "metrics.csv"
EVENTS_FILE = "events.csv"
RUN_DIR_NAME = "instability_watch"  # the run directory's name under a trainer's output or log directory

log = logging.getLogger("instability_watch")

METRIC_COLUMNS = ("step", "layer", "layer_name", "head", "loss") + METRICS
EVENT_COLUMNS = ("step", "layer", "layer_name", "head", "event", "kind", "value", "threshold", "action", "message")


class RunDirError(ValueError):
    """A run directory that is missing, not a run directory, or malformed."""


class RunWriteError(OSError):
    """Writing the run directory failed (e.g. the disk is full); the message says from which step on.

    ``errno`` is the failed call's (``errno.ENOSPC`` for a full disk).
    """

    def __init__(self, message: str, cause: Optional[OSError] = None) -> None:
        super().__init__(message)
        self.errno = cause.errno if cause is not None else None


def _csv_text(value: str) -> str:
    """Quote a text field when it needs it (RFC 4180); a line break becomes a space (one row, one line)."""
    value = value.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
    if any(c in value for c in ',"'):
        return '"' + value.replace('"', '""') + '"'
    return value


def _num(x: float) -> str:
    return "%.9g" % float(x)


def _line(fields: Sequence[str]) -> str:
    return ",".join(fields) + "\n"


def _row_step(line: bytes, n_fields: int) -> Optional[int]:
    """The step of one whole CSV row (``n_fields`` fields, integer step, layer and head, a final newline), else None."""
    if not line.endswith(b"\n"):
        return None  # a torn last line
    try:
        text = line[:-1].decode("utf-8")
        fields = next(csv.reader([text], strict=True)) if '"' in text else text.split(",")
        if len(fields) != n_fields:
            return None
        step, _, _ = int(fields[0]), int(fields[1]), int(fields[3])  # every run CSV starts step, layer, name, head
    except (UnicodeDecodeError, csv.Error, StopIteration, ValueError):
        return None
    return step


def _keep_through(path: Path, step: int, columns: Sequence[str]) -> Tuple[int, int]:
    """Rewrite a run CSV keeping its header and every whole row whose ``step`` is <= ``step``.

    The run's reader rule: a line that does not parse (a torn last line of a
    killed run, a line cut by a full disk) is skipped, and the good rows after
    it are kept. An empty file, or one whose header was cut short, gets the header.

    Returns:
        ``(kept, skipped)``: rows kept, and lines skipped because they do not parse.

    Raises:
        RunDirError: the file's header is not ``columns``.
    """
    header = _line(columns).encode()
    tmp = path.with_name(path.name + ".tmp")
    kept = skipped = 0
    try:
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            first = src.readline()
            if first.endswith(b"\n") and first != header:
                raise RunDirError(f"{path}: unexpected header {first[:60]!r}...; "
                                  f"expected columns {list(columns)[:6]}...")
            dst.write(header)  # also where the file was empty or its header torn (nothing else was written)
            for line in src:
                s = _row_step(line, len(columns))
                if s is None:
                    skipped += 1
                elif s <= step:
                    dst.write(line)
                    kept += 1
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    return kept, skipped


def _remove(path: Path) -> None:
    """Remove a temporary file left by a failed write, if there is one (best effort)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _write_all(f, data: bytes, start: int = 0) -> Tuple[int, Optional[OSError]]:
    """Append ``data`` to the unbuffered file ``f`` of ``start`` bytes; returns ``(bytes written, the error or None)``.

    A write to a full disk writes what fits and returns the count, and the next
    one raises: the count is what lets the caller cut the file back to whole rows
    (where a failed call wrote without saying how much, the file's size tells).
    """
    view, done = memoryview(data), 0
    while done < len(data):
        try:
            n = f.write(view[done:])
        except OSError as exc:
            try:
                done = min(max(done, os.fstat(f.fileno()).st_size - start), len(data))
            except (OSError, ValueError):
                pass
            return done, exc
        if not n:
            return done, OSError(errno.EIO, "write made no progress")
        done += n
    return done, None


def _cut(f, size: int) -> None:
    """Truncate ``f`` back to ``size`` bytes (the end of its last whole row); best effort on a failing disk."""
    try:
        os.ftruncate(f.fileno(), size)
    except (OSError, ValueError):
        pass  # a torn last line stays; the loader skips it


def _why(exc: OSError) -> str:
    return exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))


class RunWriter:
    """Writes a run directory as the watch reads statistics back (a watch listener).

    Args:
        run_dir: the directory (created if missing).
        overwrite: replace an existing run in ``run_dir``. Without it, opening a
            directory that already holds a run is an error, unless resuming.
        fsync: also ``os.fsync`` after each append, so the data survives a
            machine crash, not only a killed process (each append is one
            unbuffered write, which survives a killed process). Off by default:
            the read-back happens while the GPU waits, and an fsync can take
            tens of milliseconds.

    A failed write (a full disk) never leaves half a step: both files are cut
    back to the whole steps before it, :class:`RunWriteError` says from which
    step on nothing is recorded, and the writer writes nothing more (the watch
    reports the error once and drops the listener). :meth:`close` always closes
    both files, and raises only for a failure not reported before, with ``strict``.

    Raises:
        FileExistsError: at :meth:`open`, ``run_dir`` holds a run and neither
            ``overwrite`` nor ``resume_step`` was given.
        RunDirError: at :meth:`open` with ``resume_step``, the directory holds a
            run of other layers or heads.
        OSError: at :meth:`open`, the directory cannot be created or written.
    """

    def __init__(self, run_dir: str | os.PathLike, *, overwrite: bool = False, fsync: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.overwrite = bool(overwrite)
        self.fsync = bool(fsync)
        self._metrics_f: Optional[io.RawIOBase] = None
        self._events_f: Optional[io.RawIOBase] = None
        self._sizes = [0, 0]  # bytes of whole rows in metrics.csv and events.csv
        self._watch: Optional["InstabilityWatch"] = None
        self._failed: Optional[str] = None  # why writing stopped (already reported)
        self._meta_failed = False
        self._events_written = 0
        self._unwritten: list = []  # restored events cut from the file on resume: written again
        self._meta: dict = {}
        self._coverage: Optional[list] = None
        self._layer_names: List[str] = []
        self._head_counts: List[int] = []

    @property
    def is_open(self) -> bool:
        """:meth:`open` succeeded and :meth:`close` was not called."""
        return self._metrics_f is not None

    def holds_run(self) -> bool:
        """``run_dir`` already holds a run (its ``metrics.csv`` or ``meta.json`` exists)."""
        return (self.run_dir / METRICS_FILE).exists() or (self.run_dir / META_FILE).exists()

    def conflict(self, *, resuming: bool = False) -> Optional[str]:
        """Why :meth:`open` would refuse ``run_dir`` (``None`` if it would not): it holds a run, and
        neither ``overwrite`` nor ``resuming`` (continuing that run from a checkpoint) was given."""
        if self.overwrite or resuming or not self.holds_run():
            return None
        return (f"run_dir {str(self.run_dir)!r} already holds a run; pass overwrite=True to replace it, "
                "or choose another directory")

    def open(self, watch: "InstabilityWatch", *, resume_step: Optional[int] = None, extra_meta: Optional[dict] = None) -> None:
        """Create (or, with ``resume_step``, continue) the run directory for ``watch``'s layers."""
        if self.is_open:
            return
        self._layer_names = list(watch.layer_names)
        self._head_counts = list(watch.head_counts)
        d = self.run_dir
        meta_path, metrics_path, events_path = d / META_FILE, d / METRICS_FILE, d / EVENTS_FILE
        exists = self.holds_run()
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
            skipped = {}
            for path, columns in ((metrics_path, METRIC_COLUMNS), (events_path, EVENT_COLUMNS)):
                if path.exists():
                    skipped[path.name] = _keep_through(path, resume_step, columns)[1]
                else:
                    path.write_bytes(_line(columns).encode())
            if any(skipped.values()):
                log.warning("instability_watch: resuming %s at step %d: skipped %s that do not parse (torn by a "
                            "kill or a full disk); every whole row through step %d is kept", d, resume_step,
                            ", ".join(f"{n} line{'s' * (n != 1)} of {name}" for name, n in skipped.items() if n),
                            resume_step)
            mode = "a"
        elif exists and not self.overwrite:
            raise FileExistsError(self.conflict())
        else:
            mode = "w"
        _write_json(meta_path, meta)
        self._meta = meta
        files = []
        try:  # unbuffered: each append is one write call, and a failed one leaves nothing behind to flush
            for path, columns in ((metrics_path, METRIC_COLUMNS), (events_path, EVENT_COLUMNS)):
                f = open(path, mode + "b", buffering=0)
                files.append(f)
                if mode == "w":
                    _, err = _write_all(f, _line(columns).encode())
                    if err is not None:
                        _cut(f, 0)
                        raise err
                if self.fsync:
                    os.fsync(f.fileno())
            sizes = [os.fstat(f.fileno()).st_size for f in files]
        except BaseException:
            for f in files:
                try:
                    f.close()
                except OSError:
                    pass
            raise
        self._metrics_f, self._events_f = files
        self._sizes = sizes
        self._watch, self._failed, self._meta_failed = watch, None, False
        # events restored from a checkpoint are in the file up to the resume step; later ones were cut
        self._events_written = len(watch.events)
        self._unwritten = [e for e in watch.events if resume_step is not None and e.step > resume_step]

    def __call__(self, metrics: List[StepMetrics], alerts: List["Alert"], watch: "InstabilityWatch") -> None:
        """Append the steps just read back and the new alerts and switches: one write per file.

        Raises:
            RunWriteError: a write failed (e.g. the disk is full). Both files are
                cut back to the whole steps before the failure, and the writer
                writes nothing more (later calls do nothing).
        """
        if self._failed is not None:
            return  # reported when it happened: later steps are not recorded
        if not self.is_open:
            self.open(watch)
        data = self.format_metrics(metrics).encode()
        rows = max(sum(self._head_counts), 1)  # per step
        ends = (np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n")) + 1)[rows - 1::rows].tolist()
        events = self._event_lines(alerts, self._unwritten + watch.events[self._events_written:],
                                   getattr(watch, "last_clips", []))
        self._events_written, self._unwritten = len(watch.events), []
        self._append([m.step for m in metrics], data, ends, events)
        coverage = [c.to_dict() for c in watch.coverage()]
        if coverage != self._coverage and not self._meta_failed:
            # what was observed, in meta.json (rewritten atomically when it changes)
            self._coverage = coverage
            self._meta["coverage"] = coverage
            try:
                _write_json(self.run_dir / META_FILE, self._meta)
            except OSError as exc:  # the CSV files go on; meta.json keeps the coverage it had
                self._meta_failed = True
                watch.fail(f"run directory {META_FILE}", RunWriteError(
                    f"run directory {self.run_dir}: updating {META_FILE} failed ({_why(exc)}); "
                    "its coverage stays that of an earlier step", exc))

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

    @staticmethod
    def _event_lines(alerts: List["Alert"], events: list, clips: list = ()) -> List[Tuple[int, bytes]]:
        """``(step, CSV line)`` of each alert, event and clip, in step order (alerts first within a step).

        A clip is a row with event ``qk_clip``: ``value`` its logit multiplier
        (``tau / max logit``), ``threshold`` tau, the largest logit in the message.
        """
        lines = []
        for a in alerts:
            lines.append((a.step, _line([
                str(a.step), str(a.layer), _csv_text(a.layer_name), str(a.head), "alert", _csv_text(a.kind),
                _num(a.value), _num(a.threshold), _csv_text(a.action), _csv_text(a.message),
            ]).encode()))
        for e in events:
            if e.kind == "switch_not_applied":
                what = (f"{e.layer_name} head {e.head}: switch not applied to calls with {e.reason}; "
                        "they stay on PyTorch's SDPA")
            elif e.kind == "qk_clip_on":
                what = f"{e.layer_name} head {e.head}: QK-clip acts on this head from the next probe step ({e.reason})"
            else:
                what = f"{e.layer_name} head {e.head} moved to the stabilized kernel ({e.reason})"
            lines.append((e.step, _line([
                str(e.step), str(e.layer), _csv_text(e.layer_name), str(e.head), _csv_text(e.kind), _csv_text(e.reason),
                "", "", "", _csv_text(what),
            ]).encode()))
        for c in clips:
            lines.append((c.step, _line([
                str(c.step), str(c.layer), _csv_text(c.layer_name), str(c.head), "qk_clip", "logit_cap",
                _num(c.factor), _num(c.tau), "", _csv_text(
                    f"{c.layer_name} head {c.head}: largest logit {c.max_logit:.4g} over {c.tau:g}: logits scaled by "
                    f"{c.factor:.4g} (W_q, W_k rescaled after the optimizer step)"),
            ]).encode()))
        return sorted(lines, key=lambda x: x[0])  # stable: a step's rows keep their order

    def _append(self, steps: List[int], data: bytes, ends: List[int], events: List[Tuple[int, bytes]]) -> None:
        """Append the rows of ``steps`` (``data``; step i's rows end at ``ends[i]``) to metrics.csv and the
        event lines to events.csv.

        On a failure both files are cut back to exactly the steps before the
        first one not wholly written (all its rows and events), so they hold
        whole lines only, and :class:`RunWriteError` is raised.
        """
        files = (self._metrics_f, self._events_f)
        stop = None  # the first step not wholly recorded
        done, error = _write_all(files[0], data, self._sizes[0])
        if error is not None:
            stop = steps[min(bisect.bisect_right(ends, done), len(steps) - 1)]
            _cut(files[0], self._sizes[0] + _kept(steps, ends, stop))  # frees room for the events kept
            events = [e for e in events if e[0] < stop]  # the events of the steps that are recorded
        lines = [line for _, line in events]
        line_ends = list(itertools.accumulate(map(len, lines)))
        done, err = _write_all(files[1], b"".join(lines), self._sizes[1])
        if err is not None:
            s = events[min(bisect.bisect_right(line_ends, done), len(events) - 1)][0]
            stop, error = (s if stop is None else min(stop, s)), (error or err)
        if error is None and self.fsync and (steps or events):
            try:
                for f in files:
                    os.fsync(f.fileno())
            except OSError as exc:  # nothing of this read-back is sure to be on disk
                stop, error = min(steps[:1] + [s for s, _ in events[:1]]), exc
        if error is None:
            self._sizes = [self._sizes[0] + len(data), self._sizes[1] + (line_ends[-1] if lines else 0)]
            return
        sizes = [self._sizes[0] + _kept(steps, ends, stop),
                 self._sizes[1] + _kept([s for s, _ in events], line_ends, stop)]
        for f, size in zip(files, sizes):
            _cut(f, size)
        self._sizes = sizes
        self._failed = (f"run directory {self.run_dir}: writing failed at step {stop} ({_why(error)}); "
                        "later steps are not recorded")
        raise RunWriteError(self._failed, error) from None

    def close(self) -> None:
        """Close both files, always both.

        Raises:
            RunWriteError: only with ``strict``, for a failure in closing that was
                not reported before. After a write failure (reported by the watch
                when it happened) closing never raises.
        """
        files = ((METRICS_FILE, self._metrics_f), (EVENTS_FILE, self._events_f))
        self._metrics_f = self._events_f = None
        failed = None
        for name, f in files:
            if f is None:
                continue
            try:
                f.close()
            except OSError as exc:
                failed = failed or (name, exc)
        if failed is None or self._failed is not None:
            return
        name, exc = failed
        self._failed = (f"run directory {self.run_dir}: closing {name} failed ({_why(exc)}); "
                        "its last rows may not be recorded")
        error = RunWriteError(self._failed, exc)
        if self._watch is None:
            raise error
        self._watch.fail("run directory", error)  # reported once; raises with strict


def broadcast_from_rank_zero(obj):
    """Rank 0's ``obj`` on every rank under ``torch.distributed`` (``obj`` itself without it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


Broadcast = Callable[[object], object]


def run_dir_under(base: str | os.PathLike, *, new_version: bool = False,
                  broadcast: Broadcast = broadcast_from_rank_zero) -> Path:
    """Where a run directory goes by default: ``<base>/instability_watch``, or with ``new_version`` its first
    ``version_N`` that does not exist yet (rank 0 looks; every rank gets its answer: call it on every rank)."""
    root = Path(base) / RUN_DIR_NAME
    if not new_version:
        return root
    n = 0
    if rank() == 0:
        while (root / f"version_{n}").exists():
            n += 1
    return root / f"version_{broadcast(n)}"


def open_on_rank_zero(writer: Optional[RunWriter], watch: "InstabilityWatch", *, resume_step: Optional[int] = None,
                      extra_meta: Optional[dict] = None,
                      broadcast: Broadcast = broadcast_from_rank_zero) -> Optional[RunWriter]:
    """Open the run directory for a run of one or more processes; call it on every rank, after the watch state
    was restored (``resume_step``: the step a restored run continues from, ``None`` for a new run).

    Only rank 0 holds a ``writer`` (the other ranks pass ``None``). It checks the directory
    (:meth:`RunWriter.conflict`) and every rank raises the same ``FileExistsError``, so no rank trains alone.
    A directory that cannot be written (``OSError``, ``ValueError``: a read-only disk, a run of other layers)
    does not stop training: it is logged, ``writer`` is removed from ``watch.listeners`` and ``None`` is
    returned (raised with ``watch.config.strict``). Returns the open writer otherwise.
    """
    problem = writer.conflict(resuming=resume_step is not None) if writer is not None else None
    problem = broadcast(problem)
    if problem:
        raise FileExistsError(problem)
    if writer is None:
        return None
    try:
        writer.open(watch, resume_step=resume_step, extra_meta=extra_meta)
    except FileExistsError:
        raise
    except (OSError, ValueError) as exc:
        if watch.config.strict:
            raise
        log.error("instability_watch: cannot write the run directory %s (%s); no CSV for this run",
                  writer.run_dir, exc)
        watch.listeners = [f for f in watch.listeners if f is not writer]
        return None
    return writer


def _kept(steps: List[int], ends: List[int], stop: int) -> int:
    """The bytes of the rows before step ``stop``: ``steps`` ascending, row (or step) i ends at ``ends[i]``."""
    n = bisect.bisect_left(steps, stop)
    return ends[n - 1] if n else 0


def _write_json(path: Path, obj: dict) -> None:
    """Replace ``path`` atomically; a failed write (a full disk) leaves the old file and no temporary one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=str))
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


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
        meta: ``meta.json`` (layers, heads, config, created, resumed_at), less
            the fields that were of the wrong type or disagreed with the CSV.
        metrics: one row per (step, layer, head); columns :data:`METRIC_COLUMNS`.
        events: one row per alert or switch; columns :data:`EVENT_COLUMNS`.
        problems: what the reader skipped, dropped or ignored, one line each
            (see the module docstring); empty for a clean run.
    """

    run_dir: Path
    meta: dict
    metrics: "pd.DataFrame"
    events: "pd.DataFrame"
    problems: List[str] = field(default_factory=list)

    @property
    def steps(self) -> "pd.DataFrame":
        """One row per step: ``step`` and ``loss``."""
        return self.metrics.groupby("step", as_index=False)["loss"].first()


# --------------------------------------------------------------------------- reading a run back

BLOCK_BYTES = 16 << 20
"""CSV bytes parsed at a time: what bounds the reader's memory, whatever the size of the file.
(Larger blocks parse no faster: each one is a fresh allocation the kernel must map.)"""

_INT_COLUMNS = ("step", "layer", "head")
_TEXT_COLUMNS = ("layer_name", "event", "kind", "action", "message")
_NAN_TEXT = ["nan", "NaN"]  # how "%.9g" (and numpy) write a value that was not observed
_BAD = (ValueError, OverflowError, TypeError)  # what pandas raises for a line that does not parse


@dataclass(frozen=True)
class _Table:
    """One run CSV: its columns and their types, and the key whose repeats the later row wins."""

    name: str
    columns: Tuple[str, ...]
    key: Tuple[str, ...]
    blank: Tuple[str, ...] = ()  # float columns in which an empty field means "no value" (a switch has none)

    @property
    def dtypes(self) -> Dict[str, object]:
        return {c: "int64" if c in _INT_COLUMNS else object if c in _TEXT_COLUMNS else "float64"
                for c in self.columns}

    def typed(self, frame: "pd.DataFrame") -> "pd.DataFrame":
        """``frame`` with its text columns as pandas strings (as :func:`load_run` returns them)."""
        return frame.astype({c: "string" for c in self.columns if c in _TEXT_COLUMNS})

    def empty(self) -> "pd.DataFrame":
        import pandas as pd

        return self.typed(pd.DataFrame({c: pd.Series(dtype=t) for c, t in self.dtypes.items()}))


_METRICS = _Table(METRICS_FILE, METRIC_COLUMNS, _INT_COLUMNS)
_EVENTS = _Table(EVENTS_FILE, EVENT_COLUMNS, ("step", "layer", "head", "event", "kind"), blank=("value", "threshold"))


def _parse(data: bytes, table: _Table) -> "pd.DataFrame":
    """The rows of ``data`` (whole lines) by pandas' C parser; raises one of ``_BAD`` if any line does not parse."""
    import pandas as pd

    dtypes = table.dtypes
    na = {c: _NAN_TEXT + ([""] if c in table.blank else []) for c, t in dtypes.items() if t == "float64"}
    with warnings.catch_warnings():  # a long row: pandas warns, and the count below catches it
        warnings.simplefilter("ignore", pd.errors.ParserWarning)
        frame = pd.read_csv(io.BytesIO(data), header=None, names=list(table.columns), index_col=False,
                            dtype=dtypes, na_values=na, keep_default_na=False, skip_blank_lines=False, engine="c",
                            encoding="utf-8")
    # pandas fills a short row's missing fields and drops a long row's extra ones: count the separators
    quoted = b'"' in data
    commas = data.count(b",")
    if quoted:
        commas -= sum(int(frame[c].str.count(",").sum()) for c in table.columns if c in _TEXT_COLUMNS)
    if commas != (len(table.columns) - 1) * len(frame):
        raise ValueError("a line with the wrong number of fields")
    if (quoted or b"\r" in data) and data.count(b"\n") != len(frame):
        raise ValueError("a row that is not one line")
    return frame


class _Tally:
    """The lines of one file that were skipped, for :attr:`Run.problems`."""

    def __init__(self, name: str) -> None:
        self.name, self.skipped, self.first, self.torn = name, 0, 0, False

    def skip(self, line: int) -> None:
        self.first = self.first or line  # lines are met in file order
        self.skipped += 1

    def notes(self) -> List[str]:
        out = []
        if self.skipped:
            s = "s" if self.skipped != 1 else ""
            out.append(f"{self.name}: {self.skipped} malformed line{s} skipped (first at line {self.first})")
        if self.torn:
            out.append(f"{self.name}: last line has no newline (a torn write), skipped")
        return out


def _good_rows(block: bytes, table: _Table, first_line: int, tally: _Tally) -> Tuple[List["pd.DataFrame"], int]:
    """The rows of the lines of ``block`` that parse, and the number of lines; the others are tallied.

    The block is parsed at once; only if that fails is it halved, and halved
    again, down to the lines that do not parse: a few bad lines cost a few more
    parses, and every good line is kept.
    """
    try:
        frame = _parse(block, table)
        return [frame], len(frame)
    except _BAD:
        pass
    ends = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == ord("\n")) + 1
    parts: List["pd.DataFrame"] = []

    def visit(lo: int, hi: int, known_bad: bool) -> None:  # lines [lo, hi) of the block
        if not known_bad:
            try:
                parts.append(_parse(block[ends[lo - 1] if lo else 0:ends[hi - 1]], table))
                return
            except _BAD:
                pass
        if hi - lo == 1:
            tally.skip(first_line + lo)
            return
        mid = (lo + hi) // 2
        visit(lo, mid, False)
        visit(mid, hi, False)

    visit(0, len(ends), True)
    return parts, len(ends)


def _open_table(path: Path, table: _Table) -> Tuple[Optional[io.BufferedReader], str]:
    """Open a run CSV past its header: ``(file, "")``, or ``(None, why)``: unreadable, empty, another header."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        return None, f"not readable ({exc.strerror or type(exc).__name__})"
    first = f.readline(1 << 16)
    if not first:
        f.close()
        return None, "empty file (no header)"
    fields = first.rstrip(b"\r\n").decode("utf-8", "replace").strip().split(",")
    if fields != list(table.columns):
        f.close()
        return None, f"unexpected header {fields[:6]}...; expected columns {list(table.columns)[:6]}..."
    return f, ""


def _rows(f: io.BufferedReader, table: _Table, tally: _Tally, block_bytes: int) -> Iterator["pd.DataFrame"]:
    """The good rows after the header, a block of whole lines at a time, in file order."""
    line, carry, skipping = 2, b"", False  # the header is line 1
    while True:
        chunk = f.read(block_bytes)
        if not chunk:
            break
        if skipping:  # inside a line longer than a block, which no writer writes: skipped
            nl = chunk.find(b"\n")
            if nl < 0:
                continue
            chunk, skipping, line = chunk[nl + 1:], False, line + 1
        data = carry + chunk if carry else chunk
        cut = data.rfind(b"\n") + 1
        carry = data[cut:]
        if cut:
            frames, n_lines = _good_rows(data[:cut], table, line, tally)
            line += n_lines
            yield from (frame for frame in frames if len(frame))
        if len(carry) > block_bytes:
            tally.skip(line)
            carry, skipping = b"", True
    tally.torn = bool(carry)


def _key_le(s: np.ndarray, l: np.ndarray, h: np.ndarray, key: Tuple[int, int, int]) -> np.ndarray:
    """Which rows have ``(step, layer, head) <= key``."""
    k0, k1, k2 = key
    return (s < k0) | ((s == k0) & ((l < k1) | ((l == k1) & (h <= k2))))


class HeadIndex:
    """Dense indices of the (layer, head) pairs met so far, in the order met.

    Sized by what the file holds, never by what meta.json claims: a new pair
    gets the next index. ``layers`` and ``heads`` list the pairs by index.
    """

    def __init__(self) -> None:
        import pandas as pd

        self._codes = pd.Index(np.empty(0, dtype=np.int64))
        self._odd: Dict[Tuple[int, int], int] = {}  # pairs outside the packed range: codes -1, -2, ...
        self.layers = np.empty(0, dtype=np.int64)
        self.heads = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._codes)

    def __call__(self, layer: np.ndarray, head: np.ndarray) -> np.ndarray:
        """The index of each row's (layer, head); pairs not met before are added."""
        import pandas as pd

        packed = (layer >= 0) & (layer < 1 << 31) & (head >= 0) & (head < 1 << 32)
        code = (layer << 32) | head
        if not packed.all():
            odd = list(zip(layer[~packed].tolist(), head[~packed].tolist()))
            for pair in odd:
                self._odd.setdefault(pair, -1 - len(self._odd))
            code[~packed] = [self._odd[pair] for pair in odd]
        index = self._codes.get_indexer(code)
        new = index < 0
        if new.any():
            fresh, first = np.unique(code[new], return_index=True)
            order = np.argsort(first)
            rows = np.flatnonzero(new)[first[order]]
            self._codes = self._codes.append(pd.Index(fresh[order]))
            self.layers = np.concatenate([self.layers, layer[rows]])
            self.heads = np.concatenate([self.heads, head[rows]])
            index = self._codes.get_indexer(code)
        return index


class _Facts:
    """What the first pass over metrics.csv learns, besides the rows."""

    def __init__(self) -> None:
        self.rows = 0  # good rows
        self.heads = HeadIndex()
        self.names: Dict[int, str] = {}  # layer -> the first name met
        self.steps = (0, -1)  # the smallest and the largest step
        self.tail = (0, 0)  # (first row, step) of the last step's rows


class _MetricsPass:
    """One pass over the good rows of metrics.csv, applying the row rule (see the module docstring).

    The rows of one run come in increasing (step, layer, head). A row whose key
    is not above the previous row's starts a *segment*: rows written again by a
    resumed run whose file was not cut back. The first pass sends rows to the
    sink as they come, holding back the last step's rows (they may be
    incomplete) until a later step shows they are not the last. If it meets a
    segment it drops its sink and only learns which keys come again; a second
    pass, with that ``plan``, sends the rows that win.
    """

    def __init__(self, sink, plan: Optional[Tuple[int, "pd.DataFrame"]] = None) -> None:
        self.sink = sink
        self.plan = plan  # (the first row dropped as incomplete, the last segment of each repeated key)
        self.facts = _Facts()
        self.held: List["pd.DataFrame"] = []  # the last step's rows so far (first pass)
        self.repeats: List["pd.DataFrame"] = []  # keys of a later segment that an earlier one may hold
        self.repeated = 0  # rows dropped because a later segment has their key (second pass)
        self._last: Optional[Tuple[int, int, int]] = None  # the key of the previous row
        self._above: Optional[Tuple[int, int, int]] = None  # the largest key before the current segment
        self._segment = 0

    @property
    def clean(self) -> bool:
        """No segment met: every row was sent or held."""
        return self._segment == 0

    def add(self, frame: "pd.DataFrame") -> None:
        s, l, h = (frame[c].to_numpy() for c in _INT_COLUMNS)
        n, first_row = len(s), self.facts.rows
        prev = [np.empty_like(s), np.empty_like(l), np.empty_like(h)]
        for p, x, last in zip(prev, (s, l, h), self._last or (0, 0, 0)):
            p[1:], p[0] = x[:-1], last
        starts = ~((s > prev[0]) | ((s == prev[0]) & ((l > prev[1]) | ((l == prev[1]) & (h > prev[2])))))
        if self._last is None:
            starts[0] = False
        segment = self._segment + np.cumsum(starts)
        if self.plan is None:
            self._learn(frame, s, l, h, starts, segment)
        else:
            self._send_planned(frame, s, l, h, first_row, segment)
        self._last = (int(s[-1]), int(l[-1]), int(h[-1]))
        self._segment = int(segment[-1])
        self.facts.rows += n

    def _learn(self, frame, s, l, h, starts, segment) -> None:
        import pandas as pd

        facts, n = self.facts, len(s)
        facts.heads(l, h)
        for layer in pd.unique(l).tolist():
            if layer not in facts.names:
                facts.names[layer] = str(frame["layer_name"].iat[int(np.argmax(l == layer))])
        lo, hi = int(s.min()), int(s.max())
        facts.steps = (lo, hi) if not facts.rows else (min(facts.steps[0], lo), max(facts.steps[1], hi))
        # the last step's rows: the longest run at the end with the last row's step and no segment start inside
        at = np.flatnonzero(starts)
        other = np.flatnonzero(s != s[-1])
        begin = max(int(other[-1]) + 1 if len(other) else 0, int(at[-1]) if len(at) else 0)
        goes_on = begin == 0 and not starts[0] and facts.rows > 0 and facts.tail[1] == s[-1]
        if not goes_on:
            facts.tail = (facts.rows + begin, int(s[-1]))
        if self.clean and not len(at):
            if goes_on:
                self.held.append(frame)
            else:
                for part in self.held + [frame.iloc[:begin]]:
                    if len(part):
                        self.sink.add(part)
                self.held = [frame.iloc[begin:]]
            return
        self.sink, self.held = None, []  # rows come again: the second pass sends them
        # the rows of a later segment whose key an earlier segment may hold (usually a few steps' worth)
        edges = [0] + at.tolist() + [n]
        for a, b in zip(edges[:-1], edges[1:]):
            if a == b:
                continue
            if starts[a]:  # the segment before ended at the previous row
                before = self._last if a == 0 else (int(s[a - 1]), int(l[a - 1]), int(h[a - 1]))
                self._above = before if self._above is None else max(self._above, before)
            if self._above is None:
                continue
            mine = a + np.flatnonzero(_key_le(s[a:b], l[a:b], h[a:b], self._above))
            if len(mine):
                self.repeats.append(_frame(step=s[mine], layer=l[mine], head=h[mine], segment=segment[mine],
                                             row=facts.rows + mine))

    def plan_for(self, drop_from: int) -> Tuple[int, "pd.DataFrame"]:
        """The second pass's plan: rows from ``drop_from`` on are dropped (they neither win nor lose)."""
        import pandas as pd

        keys = pd.concat(self.repeats, ignore_index=True) if self.repeats else _frame(
            step=np.empty(0, np.int64), layer=np.empty(0, np.int64), head=np.empty(0, np.int64),
            segment=np.empty(0, np.int64), row=np.empty(0, np.int64))
        keys = keys[keys["row"] < drop_from]
        last = keys.groupby(list(_INT_COLUMNS), as_index=False)["segment"].max()
        return drop_from, last.rename(columns={"segment": "last"})

    def _send_planned(self, frame, s, l, h, first_row, segment) -> None:
        drop_from, last = self.plan
        keep = np.arange(first_row, first_row + len(s)) < drop_from
        if len(last):
            near = (s >= last["step"].min()) & (s <= last["step"].max()) & keep
            if near.any():
                rows = np.flatnonzero(near)
                found = _frame(step=s[rows], layer=l[rows], head=h[rows]).merge(
                    last, how="left", on=list(_INT_COLUMNS))["last"].to_numpy()
                beaten = found > segment[rows]  # NaN (no repeat) compares False
                keep[rows[beaten]] = False
                self.repeated += int(beaten.sum())
        if keep.all():
            self.sink.add(frame)
        elif keep.any():
            self.sink.add(frame[keep])


def _frame(**columns) -> "pd.DataFrame":
    import pandas as pd

    return pd.DataFrame(columns)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63


def _one_line(name: str) -> str:
    """A layer name as the writer puts it in a CSV row (a line break becomes a space)."""
    return name.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


def _layers_heads_why(layers, heads, facts: _Facts) -> str:
    """Why meta.json's ``layers`` and ``heads`` cannot be used for this metrics.csv ("" if they can)."""
    if not (isinstance(layers, list) and isinstance(heads, list) and len(layers) == len(heads)
            and all(isinstance(x, str) for x in layers) and all(_is_count(x) for x in heads)):
        return "expected a list of layer names and a list of as many head counts"
    if not facts.rows:
        return ""
    L, H = facts.heads.layers, facts.heads.heads  # the CSV's pairs: a few hundred, whatever meta.json says
    outside = (L < 0) | (L >= len(layers))
    inside = np.flatnonzero(~outside)
    if len(inside):
        counts = np.array([heads[layer] for layer in L[inside].tolist()], dtype=np.int64)
        outside[inside] = (H[inside] < 0) | (H[inside] >= counts)
    if outside.any():
        i = int(np.argmax(outside))
        return f"{METRICS_FILE} has layer {L[i]} head {H[i]}, which they do not declare"
    for layer, name in sorted(facts.names.items()):
        if _one_line(layers[layer]) != name:
            return f"layer {layer} is {_short(name)} in {METRICS_FILE}, {_short(layers[layer])} in {META_FILE}"
    total = sum(heads)
    if total != len(facts.heads) and facts.steps[0] != facts.steps[1]:
        return f"they declare {total} heads, {METRICS_FILE} has {len(facts.heads)}"
    return ""


def _checked_meta(meta: dict, facts: _Facts) -> Tuple[dict, int, List[str]]:
    """meta.json less the fields of the wrong type or at odds with metrics.csv, the run's head count, and notes.

    The head count is that of the CSV; meta.json's only when its layers and
    heads agree with the CSV: they declare the same heads, or the CSV holds a
    single step (which may be incomplete). Nothing is ever sized from meta.json.
    """
    meta, notes = dict(meta), []

    def drop(names: Sequence[str], why: str) -> None:
        for name in names:
            meta.pop(name, None)
        notes.append(f"{META_FILE}: {' and '.join(names)} ignored ({why})")

    expected = len(facts.heads)
    if "layers" in meta or "heads" in meta:
        why = _layers_heads_why(meta.get("layers"), meta.get("heads"), facts)
        if why:
            drop(("layers", "heads"), why)
        elif facts.rows:
            expected = sum(meta["heads"])
    checks = (("resumed_at", lambda v: isinstance(v, list) and all(_is_count(x) for x in v), "a list of steps"),
              ("config", lambda v: isinstance(v, dict), "an object"),
              ("created", lambda v: isinstance(v, str), "a date"),
              ("format", _is_count, "a version number"))
    for name, ok, what in checks:
        if name in meta and not ok(meta[name]):
            drop((name,), f"expected {what}, got {_short(meta[name])}")
    return meta, expected, notes


def _read_metrics(path: Path, make_sink: Callable[[], object], meta: dict,
                  block_bytes: int) -> Tuple[object, dict, List[str]]:
    """Send metrics.csv's rows to a sink by the row rule; returns the sink, the checked meta, and notes."""
    f, why = _open_table(path, _METRICS)
    if f is None:
        raise RunDirError(f"{path}: {why}")
    tally = _Tally(METRICS_FILE)
    first = _MetricsPass(make_sink())
    with f:
        for frame in _rows(f, _METRICS, tally, block_bytes):
            first.add(frame)
    facts = first.facts
    meta, expected, notes = _checked_meta(meta, facts)
    notes += tally.notes()
    tail_row, tail_step = facts.tail
    drop_from = facts.rows
    if facts.rows and facts.rows - tail_row < expected:
        drop_from = tail_row
        notes.append(f"{METRICS_FILE}: last step {tail_step} incomplete "
                     f"({facts.rows - tail_row} of {expected} heads), dropped")
    if first.clean:
        if drop_from == facts.rows:
            for part in first.held:
                first.sink.add(part)
        return first.sink, meta, notes
    second = _MetricsPass(make_sink(), plan=first.plan_for(drop_from))
    f, why = _open_table(path, _METRICS)
    if f is None:  # changed under us
        raise RunDirError(f"{path}: {why}")
    with f:
        for frame in _rows(f, _METRICS, _Tally(METRICS_FILE), block_bytes):
            second.add(frame)
    if second.repeated:
        s = "s" if second.repeated != 1 else ""
        notes.append(f"{METRICS_FILE}: {second.repeated} row{s} written again by a resumed run "
                     "(the file was not cut back); the later ones kept")
    return second.sink, meta, notes


def _read_events(path: Path, block_bytes: int) -> Tuple["pd.DataFrame", List[str]]:
    """events.csv's rows by the row rule (a missing file, or an empty one, holds none), and notes."""
    import pandas as pd

    if not path.exists():
        return _EVENTS.empty(), []
    f, why = _open_table(path, _EVENTS)
    if f is None:
        what = "read as no events" if why.startswith("empty") else "events ignored"
        return _EVENTS.empty(), [f"{EVENTS_FILE}: {why}; {what}"]
    tally = _Tally(EVENTS_FILE)
    with f:
        frames = list(_rows(f, _EVENTS, tally, block_bytes))
    events = pd.concat(frames, ignore_index=True) if frames else _EVENTS.empty()
    events = events.drop_duplicates(subset=list(_EVENTS.key), keep="last").reset_index(drop=True)
    return _EVENTS.typed(events), tally.notes()


def _run_dir(run_dir: str | os.PathLike) -> Path:
    d = Path(run_dir)
    if not d.exists():
        raise RunDirError(f"{d}: no such directory")
    if not d.is_dir():
        raise RunDirError(f"{d}: not a directory")
    if not (d / METRICS_FILE).exists():
        raise RunDirError(f"{d}: not an instability_watch run directory (no {METRICS_FILE})")
    return d


class StreamedRun(NamedTuple):
    """What :func:`stream_run` returns: a :class:`Run` whose metrics went to ``sink``."""

    run_dir: Path
    meta: dict
    sink: object
    events: "pd.DataFrame"
    problems: List[str]


def stream_run(run_dir: str | os.PathLike, make_sink: Callable[[], object], *,
               block_bytes: int = BLOCK_BYTES) -> StreamedRun:
    """Read a run directory in bounded memory: metrics.csv's rows go to a sink, a block at a time.

    The rows are those :func:`load_run` returns, in the same order, in pieces
    (DataFrames with the columns :data:`METRIC_COLUMNS`, ``layer_name`` as
    Python strings). The reader holds at most about ``block_bytes`` of CSV at a
    time, plus one step's rows.

    Args:
        run_dir: the run directory.
        make_sink: called with no arguments, returns an object with an
            ``add(frame)`` method. It is called a second time (and the first
            sink dropped) when metrics.csv holds rows written again by a
            resumed run that was not cut back; the file is then read twice.
        block_bytes: CSV bytes parsed at a time.

    Raises:
        RunDirError: as :func:`load_run`.
    """
    d = _run_dir(run_dir)
    meta = _read_meta(d)
    sink, meta, problems = _read_metrics(d / METRICS_FILE, make_sink, meta, block_bytes)
    events, notes = _read_events(d / EVENTS_FILE, block_bytes)
    return StreamedRun(run_dir=d, meta=meta, sink=sink, events=events, problems=problems + notes)


class _Collect:
    """A sink that keeps every piece (for :func:`load_run`)."""

    def __init__(self) -> None:
        self.parts: List["pd.DataFrame"] = []

    def add(self, frame: "pd.DataFrame") -> None:
        self.parts.append(frame)


def load_run(run_dir: str | os.PathLike, *, block_bytes: int = BLOCK_BYTES) -> Run:
    """Read a run directory written by :class:`RunWriter` (also one of a killed run), whole.

    Lines that do not parse, a torn last line and an incomplete last step are
    left out and listed in :attr:`Run.problems` (the rule is in the module
    docstring). For a long run, :func:`stream_run` reads in bounded memory.

    Raises:
        RunDirError: the directory is missing or holds no ``metrics.csv``,
            metrics.csv is empty or has another header, or meta.json is not a
            JSON object; the message names the path.
    """
    import pandas as pd

    read = stream_run(run_dir, _Collect, block_bytes=block_bytes)
    parts = read.sink.parts
    metrics = pd.concat(parts, ignore_index=True) if parts else _METRICS.empty()
    return Run(run_dir=read.run_dir, meta=read.meta, metrics=_METRICS.typed(metrics), events=read.events,
               problems=read.problems)
