"""What the framework callbacks share: their arguments' checks and the scalars they log."""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

from ..config import WatchConfig
from ..locate import AttentionLayer


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
