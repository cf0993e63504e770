"""What the framework callbacks share: their arguments, the watch's outputs, the run directory and the end.

:class:`WatchAdapter` is the framework-free part of a callback; the Lightning and
Hugging Face callbacks add their framework's hooks to it. It uses only public
names of the engine (:class:`~instability_watch.InstabilityWatch`) and of the
run directory (:mod:`~instability_watch.outputs.rundir`). The policy of writing that
directory from rank 0 alone (:func:`open_on_rank_zero`, :func:`run_dir_under`) is here;
plain loops under ``torchrun`` use it too.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Type, Union

from instability_watch.engine.config import WatchConfig, config_fields
from instability_watch.engine.metrics import summarize
from instability_watch.errors import checking_keywords
from instability_watch.model.layer import AttentionLayer, find_attention_layers
from instability_watch.outputs.console import ConsoleReporter
from instability_watch.outputs.rundir import RUN_DIR_NAME, RunWriter
from instability_watch.ranks import broadcast_from_rank_zero, rank

if TYPE_CHECKING:  # pragma: no cover
    from instability_watch.engine.watch import InstabilityWatch

log = logging.getLogger("instability_watch")


def missing_extra(what: str, package: str, extra: str) -> ImportError:
    """The error for a callback whose framework is not installed: what needs it, and the extra to install."""
    return ImportError(f'{what} needs {package}: pip install "instability_watch[{extra}]"')


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``, else a ``TypeError`` naming the argument ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_arguments(config: Any, layers: Any, run_dir: Any, top: Any, console: Any) -> Tuple[WatchConfig, Any]:
    """The callbacks' common arguments, checked: ``(config, layers)`` normalised, or a ``TypeError``/``ValueError``."""
    if config is None:
        config = WatchConfig()
    elif isinstance(config, dict):
        config = WatchConfig(**config)
    elif not isinstance(config, WatchConfig):
        raise TypeError(f"config must be a WatchConfig, a dict of its fields or None, got {type(config).__name__}")
    if layers is not None and not callable(layers):
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
            raise TypeError("layers must be None, a list of AttentionLayer or a function of the model returning "
                            f"one, got {type(layers).__name__}")
        layers = list(layers)
        bad = [type(x).__name__ for x in layers if not isinstance(x, AttentionLayer)]
        if bad:
            raise TypeError(f"layers must hold AttentionLayer descriptions, got {bad}")
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"run_dir must be None, a str or an os.PathLike, got {type(run_dir).__name__}")
    if isinstance(run_dir, str) and not run_dir.strip():
        raise ValueError(f"run_dir must be None or a non-empty path, got {run_dir!r}")
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a positive integer, got {top!r}")
    if console is not None and not hasattr(console, "print"):
        raise TypeError(f"console must be a rich.console.Console or None, got {type(console).__name__}")
    return config, layers


def scalars(record) -> Optional[Dict[str, float]]:
    """The aggregate scalars sent to the trainer's loggers after a read-back (``None``: nothing to send)."""
    if not record.metrics:
        return None
    summary = summarize(record.metrics, len(record.switched), len(record.all_alerts))
    out = {f"instability_watch/{k}": v for k, v in summary.items() if math.isfinite(v)}
    return out or None


# --------------------------------------------------------------------------- the run directory on rank 0

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


def finish(watch, reporter, writer, *, strict: bool, crashed: bool) -> None:
    """End a run: read back what is pending (not after a crash under torch.distributed: no collectives),
    restore the model, stop the console, close the run directory. Failures are logged (raised with
    ``strict``, never after a crash)."""
    try:
        # after a crash under torch.distributed the other ranks may never reach a collective again: no read-back;
        # else read back the steps still on the device, so the CSV has them
        watch.detach(read_back=not (crashed and watch.distributed))
    except Exception as exc:  # noqa: BLE001
        if strict and not crashed:
            raise
        log.error("instability_watch: detaching failed (%s)", exc, exc_info=exc)
        watch.detach(read_back=False)
    finally:
        try:
            if reporter is not None:
                reporter.close()
        finally:
            close_writer(writer, strict=strict, crashed=crashed)


def close_writer(writer, *, strict: bool, crashed: bool) -> None:
    """Close the run directory's files. A write failure was reported when it happened: closing after it
    never raises. A new failure in closing raises with ``strict``, never after a crash."""
    if writer is None:
        return
    try:
        writer.close()
    except Exception as exc:  # noqa: BLE001
        if strict and not crashed:
            raise
        log.error("instability_watch: closing the run directory failed (%s)", exc)


class WatchAdapter:
    """The framework-free part of a callback that runs an :class:`~instability_watch.InstabilityWatch`.

    Takes the callbacks' common arguments (see the callbacks' docs), checks them, and then for one training
    run: builds the listeners (console panels and the run directory on rank 0; the scalars on every rank),
    opens the run directory (:func:`open_on_rank_zero`), and ends the run
    (:func:`finish`). A subclass adds the framework's hooks and sets :attr:`error`, the exception its
    framework shows for a run it cannot start.

    Attributes:
        watch: the engine (from the start of training on).
        writer: the run directory's :class:`~instability_watch.outputs.rundir.RunWriter` (rank 0, while writable).
        reporter: the :class:`~instability_watch.outputs.console.ConsoleReporter` (rank 0, with alerts or live_table).
        run_dir: the run directory (the argument until training starts, then where the run is written).
    """

    error: Type[Exception] = ValueError

    def __init__(
        self,
        config: Optional[Union[WatchConfig, Dict[str, Any]]] = None,
        *,
        layers: Any = None,
        run_dir: Optional[Union[str, os.PathLike]] = None,
        overwrite: bool = False,
        write_csv: bool = True,
        console: Any = None,
        alerts: bool = True,
        live_table: bool = False,
        top: int = 8,
        log_scalars: bool = True,
    ) -> None:
        config, layers = check_arguments(config, layers, run_dir, top, console)
        self.config: WatchConfig = config
        self.layers = layers
        self.run_dir_arg: Optional[Path] = Path(run_dir) if run_dir is not None else None
        self.run_dir: Optional[Path] = self.run_dir_arg
        self.overwrite = check_bool("overwrite", overwrite)
        self.write_csv = check_bool("write_csv", write_csv)
        self.console = console
        self.alerts = check_bool("alerts", alerts)
        self.live_table = check_bool("live_table", live_table)
        self.top = top
        self.log_scalars = check_bool("log_scalars", log_scalars)
        self.watch = None
        self.writer: Optional[RunWriter] = None
        self.reporter: Optional[ConsoleReporter] = None
        self._finished = True  # no run, or its end was handled
        self._init_state()

    def _init_state(self) -> None:
        """A subclass's own state, set up after the arguments are checked."""

    def _start_run(self) -> None:
        """Forget the previous run (a callback reused for another fit starts clean)."""
        self.watch, self.writer, self.reporter = None, None, None
        self.run_dir = self.run_dir_arg
        self._finished = False

    def _find_layers(self, model: Any) -> List[AttentionLayer]:
        """The ``layers`` argument applied to ``model``: its list, its function's list, or the locators' finds."""
        if callable(self.layers):
            return list(self.layers(model))
        if self.layers is not None:
            return list(self.layers)
        return find_attention_layers(model)

    def _listeners(self, run_dir: Path, *, is_zero: bool, scalars: Callable) -> List[Callable]:
        """The watch's listeners: on rank 0 the console reporter and the run directory's writer (kept in
        :attr:`reporter` and :attr:`writer`); ``scalars`` on every rank with ``log_scalars``."""
        listeners: List[Callable] = []
        if is_zero and (self.alerts or self.live_table):
            self.reporter = ConsoleReporter(self.console, alerts=self.alerts, live_table=self.live_table, top=self.top)
            listeners.append(self.reporter)
        if is_zero and self.write_csv:
            self.writer = RunWriter(run_dir, overwrite=self.overwrite)
            listeners.append(self.writer)
        if self.log_scalars:
            listeners.append(scalars)
        return listeners

    def _open_run_dir(self, *, restored: bool, extra_meta: Dict[str, Any], broadcast: Broadcast) -> None:
        """Open the run directory on rank 0 (every rank calls this); a run already there raises :attr:`error`
        on every rank, a directory that cannot be written leaves the run without one."""
        try:
            self.writer = open_on_rank_zero(
                self.writer, self.watch, resume_step=self.watch.flushed_through if restored else None,
                extra_meta=extra_meta, broadcast=broadcast)
        except FileExistsError as exc:
            raise self.error(str(exc)) from None
        if self.writer is not None:
            self.run_dir = self.writer.run_dir

    def _finish(self, *, crashed: bool) -> None:
        """End the run once: read back (not after a crash under torch.distributed), detach, close the outputs."""
        if self.watch is None or self._finished:
            return
        self._finished = True
        finish(self.watch, self.reporter, self.writer, strict=self.config.strict, crashed=crashed)


WatchAdapter.__init__ = checking_keywords(WatchAdapter.__init__, config_fields)
