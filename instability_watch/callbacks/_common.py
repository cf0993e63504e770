"""What the framework callbacks share: their arguments' checks and the scalars they log."""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Dict, List, Optional, Tuple

from ..config import WatchConfig
from ..locate import AttentionLayer

log = logging.getLogger("instability_watch")


def check_bool(name: str, value: Any) -> bool:
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
        raise ValueError("run_dir must be None or a non-empty path, got ''")
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a positive integer, got {top!r}")
    if console is not None and not hasattr(console, "print"):
        raise TypeError(f"console must be a rich.console.Console or None, got {type(console).__name__}")
    return config, layers


def scalars(watch, metrics: List[Any]) -> Optional[Dict[str, float]]:
    """The aggregate scalars sent to the trainer's loggers after a read-back (``None``: nothing to send)."""
    if not metrics:
        return None
    out = {f"instability_watch/{k}": v for k, v in watch.summary().items() if math.isfinite(v)}
    return out or None


def finish(watch, reporter, writer, *, strict: bool, crashed: bool) -> None:
    """End a run: read back what is pending (not after a crash under torch.distributed: no collectives),
    restore the model, stop the console, close the run directory. Failures are logged (raised with
    ``strict``, never after a crash)."""
    try:
        if crashed and watch._distributed():
            if watch.observation is not None:  # the other ranks may never reach a collective again
                watch.observation.detach()
        else:
            watch.detach()  # reads back the steps still on the device, so the CSV has them
    except Exception as exc:  # noqa: BLE001
        if strict and not crashed:
            raise
        log.error("instability_watch: detaching failed (%s)", exc, exc_info=exc)
        if watch.observation is not None and watch.observation.attached:
            watch.observation.detach()
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
