"""Writing a run directory: :class:`RunWriter`, a watch listener that survives a kill or a full disk."""
from __future__ import annotations

import bisect
import datetime as _dt
import errno
import io
import itertools
import json
import logging
import os
import socket
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

import numpy as np

from instability_watch.engine.metrics import StepMetrics
from instability_watch.outputs.rundir.schema import (
    EVENT_COLUMNS,
    EVENTS_FILE,
    FORMAT_VERSION,
    META_FILE,
    METRIC_COLUMNS,
    METRICS,
    METRICS_FILE,
    RunDirError,
    RunWriteError,
    csv_line,
    csv_text,
    num,
    read_meta,
    row_step,
)

if TYPE_CHECKING:  # pragma: no cover
    from instability_watch.detect.detectors import Alert
    from instability_watch.engine.readback import ReadBack
    from instability_watch.engine.watch import InstabilityWatch

log = logging.getLogger("instability_watch")

# a writer's mark in its run directory while it is open: {"host", "pid", "since"}, removed when it closes
WRITER_MARK = ".writer.json"


_OPEN: "weakref.WeakSet[RunWriter]" = weakref.WeakSet()  # this process's open writers


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a.absolute() == b.absolute()


def _process_start(pid: int) -> Optional[str]:
    """When process ``pid`` started (``/proc/PID/stat``'s start time, in clock ticks since boot), ``""`` where this
    system has no ``/proc``, None where the process is gone (or a zombie)."""
    if not os.path.isdir("/proc/self"):
        return ""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else fields[19].decode()


def live_writer(run_dir: Path) -> Optional[dict]:
    """The mark of another process on this host still writing ``run_dir`` (None if there is none: no mark, the
    mark's process is this one or has ended, its process id now another process's (the start times differ), or it
    is on another host or on Windows, where it is not checked)."""
    try:
        mark = json.loads((run_dir / WRITER_MARK).read_text())
        pid, host = int(mark["pid"]), str(mark["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname() or pid == os.getpid() or pid <= 0 or os.name != "posix":
        return None  # (on Windows os.kill(pid, 0) would send the process a CTRL_C_EVENT: not checked there)
    start = _process_start(pid)
    if start is None:
        return None  # a run that was killed left its mark
    if start:  # /proc: the same process only if it started when the mark says
        return mark if str(mark.get("start", start)) == start else None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass  # it exists, owned by another user
    return mark


def keep_through(path: Path, step: int, columns: Sequence[str]) -> Tuple[int, int]:
    """Rewrite a run CSV keeping its header and every whole row whose ``step`` is <= ``step``.

    The run's reader rule: a line that does not parse (a torn last line of a
    killed run, a line cut by a full disk) is skipped, and the good rows after
    it are kept. An empty file, or one whose header was cut short, gets the header.

    Returns:
        ``(kept, skipped)``: rows kept, and lines skipped because they do not parse.

    Raises:
        RunDirError: the file's header is not ``columns``.
    """
    header = csv_line(columns).encode()
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
                s = row_step(line, len(columns))
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


def _has_rows(path: Path) -> bool:
    """``path`` is a CSV with a row below its header."""
    try:
        with open(path, "rb") as f:
            f.readline()
            return bool(f.read(1).strip())
    except FileNotFoundError:
        return False
    except OSError:  # unreadable (a folder, no permission): counted as a run, so nothing is overwritten
        return True


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
        self._on_error: Optional[Callable[[str, BaseException], None]] = None  # the watch's report of a failure
        self._failed: Optional[str] = None  # why writing stopped (already reported)
        self._meta_failed = False
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
        """``run_dir`` already holds a run: a step in its ``metrics.csv`` or an event in its ``events.csv``.
        A run that recorded nothing (it stopped before its first read-back) holds nothing to lose."""
        return _has_rows(self.run_dir / METRICS_FILE) or _has_rows(self.run_dir / EVENTS_FILE)

    def conflict(self, *, resuming: bool = False) -> Optional[str]:
        """Why :meth:`open` would refuse ``run_dir`` (``None`` if it would not): another process on this host is
        writing it (whatever the options: two runs' rows would interleave), or it holds a run and neither
        ``overwrite`` nor ``resuming`` (continuing that run from a checkpoint) was given."""
        mark = None if self.is_open else live_writer(self.run_dir)
        if mark is not None:
            return (f"run_dir {str(self.run_dir)!r} is being written by another run (process {mark['pid']} on this "
                    f"host, since {mark.get('since', '?')}): two runs in one directory would mix their rows; "
                    f"choose another directory, or stop that run (if none is running, delete "
                    f"{str(self.run_dir / WRITER_MARK)!r})")
        if self.overwrite or resuming or not self.holds_run():
            return None
        return (f"run_dir {str(self.run_dir)!r} already holds a run; pass overwrite=True to replace it, "
                "or choose another directory")

    def open(self, watch: "InstabilityWatch", *, resume_step: Optional[int] = None, extra_meta: Optional[dict] = None) -> None:
        """Create (or, with ``resume_step``, continue) the run directory for ``watch``'s layers.

        A failure the writer meets later (a full disk) is reported through ``watch.fail``.
        """
        self._open(watch.layer_names, watch.head_counts, watch.config, events=watch.events, on_error=watch.fail,
                   resume_step=resume_step, extra_meta=extra_meta)

    def _open(self, layer_names, head_counts, config, *, events=(), on_error=None, resume_step: Optional[int] = None,
              extra_meta: Optional[dict] = None) -> None:
        if self.is_open:
            return
        self._layer_names = list(layer_names)
        self._head_counts = list(head_counts)
        d = self.run_dir
        meta_path, metrics_path, events_path = d / META_FILE, d / METRICS_FILE, d / EVENTS_FILE
        exists = meta_path.exists() or metrics_path.exists()  # resuming continues what is there, rows or not
        busy = self.conflict(resuming=True)  # another run writing it, whatever the options
        if busy is not None:
            raise FileExistsError(busy)
        d.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT_VERSION,
            "layers": self._layer_names,
            "heads": self._head_counts,
            "config": config.to_dict(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "resumed_at": [],
        }
        if extra_meta:
            meta.update(extra_meta)
        if exists and resume_step is not None and metrics_path.exists():
            old = read_meta(d)
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
                    skipped[path.name] = keep_through(path, resume_step, columns)[1]
                else:
                    path.write_bytes(csv_line(columns).encode())
            if any(skipped.values()):
                log.warning("instability_watch: resuming %s at step %d: skipped %s that do not parse (torn by a "
                            "kill or a full disk); every whole row through step %d is kept", d, resume_step,
                            ", ".join(f"{n} line{'s' * (n != 1)} of {name}" for name, n in skipped.items() if n),
                            resume_step)
            mode = "a"
        elif not self.overwrite and self.holds_run():  # a run that recorded nothing holds nothing to lose
            raise FileExistsError(self.conflict())
        else:
            mode = "w"
        self._take_over()
        _write_json(meta_path, meta)
        self._meta = meta
        files = []
        try:  # unbuffered: each append is one write call, and a failed one leaves nothing behind to flush
            for path, columns in ((metrics_path, METRIC_COLUMNS), (events_path, EVENT_COLUMNS)):
                f = open(path, mode + "b", buffering=0)
                files.append(f)
                if mode == "w":
                    _, err = _write_all(f, csv_line(columns).encode())
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
        _OPEN.add(self)
        self._mark()
        self._on_error, self._failed, self._meta_failed = on_error, None, False
        # events restored from a checkpoint are in the file up to the resume step; later ones were cut
        self._unwritten = [e for e in events if resume_step is not None and e.step > resume_step]

    def __call__(self, record: "ReadBack") -> None:
        """Append the steps just read back and the new alerts, switches and clips: one write per file.

        Raises:
            RunWriteError: a write failed (e.g. the disk is full). Both files are
                cut back to the whole steps before the failure, and the writer
                writes nothing more (later calls do nothing).
        """
        if self._failed is not None:
            return  # reported when it happened: later steps are not recorded
        if not self.is_open:
            self._open(record.layer_names, record.head_counts, record.config, on_error=record.report)
        metrics = record.metrics
        data = self.format_metrics(metrics).encode()
        rows = max(sum(self._head_counts), 1)  # per step
        ends = (np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n")) + 1)[rows - 1::rows].tolist()
        events = self._event_lines(record.alerts, self._unwritten + list(record.events), record.clips)
        self._unwritten = []
        self._append([m.step for m in metrics], data, ends, events)
        coverage = [c.to_dict() for c in record.coverage]
        if coverage != self._coverage and not self._meta_failed:
            # what was observed, in meta.json (rewritten atomically when it changes)
            self._coverage = coverage
            self._meta["coverage"] = coverage
            try:
                _write_json(self.run_dir / META_FILE, self._meta)
            except OSError as exc:  # the CSV files go on; meta.json keeps the coverage it had
                self._meta_failed = True
                self._report(f"run directory {META_FILE}", RunWriteError(
                    f"run directory {self.run_dir}: updating {META_FILE} failed ({_why(exc)}); "
                    "its coverage stays that of an earlier step", exc))

    def format_metrics(self, metrics: List[StepMetrics]) -> str:
        """The CSV lines of ``metrics`` (padded heads of narrower layers left out).

        One C-level ``%`` format per row: a GPT-2-small read-back (10 steps x
        144 heads) formats in a few milliseconds.
        """
        names = [csv_text(n) for n in self._layer_names]
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
            lines.append((a.step, csv_line([
                str(a.step), str(a.layer), csv_text(a.layer_name), str(a.head), "alert", csv_text(a.kind),
                num(a.value), num(a.threshold), csv_text(a.action), csv_text(a.message),
            ]).encode()))
        for e in events:
            lines.append((e.step, csv_line([
                str(e.step), str(e.layer), csv_text(e.layer_name), str(e.head), csv_text(e.kind), csv_text(e.reason),
                "", "", "", csv_text(e.sentence()),
            ]).encode()))
        for c in clips:
            lines.append((c.step, csv_line([
                str(c.step), str(c.layer), csv_text(c.layer_name), str(c.head), "qk_clip", "logit_cap",
                num(c.factor), num(c.tau), "", csv_text(
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
        if self.is_open:
            self._unmark()
            _OPEN.discard(self)
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
        if self._on_error is None:
            raise error
        self._on_error("run directory", error)  # reported once; raises with strict

    def _take_over(self) -> None:
        """An earlier writer of this process still open on this directory (a watch never closed, e.g. a notebook
        cell run again) is closed and writes nothing more: its rows would mix with this run's."""
        for w in list(_OPEN):
            if w is not self and w.is_open and _same_dir(w.run_dir, self.run_dir):
                log.warning("instability_watch: run_dir %s was still open in an earlier writer of this process (a "
                            "watch not closed?); that writer is closed and records nothing more, this run writes "
                            "there", self.run_dir)
                w._failed = f"run directory {w.run_dir}: taken over by a later writer of this process"
                for f in (w._metrics_f, w._events_f):
                    try:
                        f.close()
                    except OSError:
                        pass
                w._metrics_f = w._events_f = None
                _OPEN.discard(w)

    def _mark(self) -> None:
        """Leave this process's mark in the run directory while it is open (a mark that cannot be written only
        loses the check against a second run)."""
        since = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        try:
            _write_json(self.run_dir / WRITER_MARK, {"host": socket.gethostname(), "pid": os.getpid(), "since": since,
                                                     "start": _process_start(os.getpid())})
        except OSError as exc:
            log.debug("instability_watch: no writer mark in %s (%s)", self.run_dir, exc)

    def _unmark(self) -> None:
        path = self.run_dir / WRITER_MARK
        try:
            if int(json.loads(path.read_text()).get("pid", -1)) == os.getpid():
                path.unlink()
        except (OSError, ValueError, AttributeError):
            pass

    def _report(self, part: str, exc: BaseException) -> None:
        """A failure that does not stop the writer: the watch reports it (or the log, opened without a watch)."""
        if self._on_error is not None:
            self._on_error(part, exc)
        else:
            log.error("instability_watch: %s", exc)



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

