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
* :data:`ALERT_KINDS` -- what each kind of alert means and what to do about it.
"""
import importlib

from .locate import AttentionLayer
from .config import WatchConfig
from .alerts import ALERT_KINDS, KINDS
from .detectors import Alert
from .kernels import flash_attention
from .probe import Probe
from .watch import Event, InstabilityWatch, StepMetrics, WatchError

__version__ = "0.1.0"

__all__ = [
    "flash_attention", "Probe", "InstabilityWatch", "WatchConfig", "Alert", "Event", "StepMetrics",
    "WatchError", "AttentionLayer", "KINDS", "ALERT_KINDS", "InstabilityWatchCallback", "load_run", "__version__",
]


# imported on first use: Lightning and pandas load only when asked for
_LAZY = {"InstabilityWatchCallback": ".callbacks.lightning", "load_run": ".export"}


def __getattr__(name):
    """The lazily imported names (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
