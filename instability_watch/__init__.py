"""instability_watch: catch and fix BF16 flash-attention training failures while a model trains.

Public API (grows with each milestone):

* :func:`flash_attention` -- FA2-precision attention with a per-head stabilized
  variant (paper Alg. 3) and per-head diagnostics written into a :class:`Probe`.
* :class:`Probe` -- the per-layer device-side statistic buffers.
* :class:`InstabilityWatch`, :class:`WatchConfig` -- the engine that attaches to
  a model, tracks every head and raises :class:`Alert` records.
* :class:`AttentionLayer` -- describe an attention layer the built-in locators
  do not know.
* :class:`InstabilityWatchCallback` -- the watch in a Lightning ``Trainer``
  (imported on first use, so ``import instability_watch`` does not load Lightning).
* :func:`load_run` -- a run directory's CSVs as pandas DataFrames.
"""
from .locate import AttentionLayer
from .config import WatchConfig
from .detectors import KINDS, Alert
from .kernels import flash_attention
from .probe import Probe
from .watch import Event, InstabilityWatch, StepMetrics, WatchError

__version__ = "0.1.0"

__all__ = [
    "flash_attention", "Probe", "InstabilityWatch", "WatchConfig", "Alert", "Event", "StepMetrics",
    "WatchError", "AttentionLayer", "KINDS", "InstabilityWatchCallback", "load_run", "__version__",
]


def __getattr__(name):
    if name == "InstabilityWatchCallback":
        from .callbacks.lightning import InstabilityWatchCallback

        return InstabilityWatchCallback
    if name == "load_run":
        from .export import load_run

        return load_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
