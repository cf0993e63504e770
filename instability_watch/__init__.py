"""instability_watch: catch and fix BF16 flash-attention training failures while a model trains.

Public API (grows with each milestone):

* :func:`flash_attention` -- FA2-precision attention with a per-head stabilized
  variant (paper Alg. 3) and per-head diagnostics written into a :class:`Probe`;
  :func:`flash_attention_varlen` the same over packed documents (``cu_seqlens``).
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

from instability_watch.act.events import Event
from instability_watch.detect.detectors import Alert
from instability_watch.detect.kinds import ALERT_KINDS, KINDS
from instability_watch.engine.config import WatchConfig
from instability_watch.engine.metrics import StepMetrics
from instability_watch.engine.readback import ReadBack
from instability_watch.engine.watch import InstabilityWatch
from instability_watch.errors import WatchError
from instability_watch.kernels import flash_attention, flash_attention_varlen
from instability_watch.model.layer import AttentionLayer
from instability_watch.probe.bank import Probe

__version__ = "0.1.0"

__all__ = [
    "flash_attention", "flash_attention_varlen", "Probe", "InstabilityWatch", "WatchConfig", "Alert", "Event", "StepMetrics", "ReadBack",
    "WatchError", "AttentionLayer", "KINDS", "ALERT_KINDS", "InstabilityWatchCallback", "load_run", "RunWriter",
    "ConsoleReporter", "__version__",
]


# imported on first use: Lightning and pandas load only when asked for
_LAZY = {"InstabilityWatchCallback": ".callbacks.lightning", "load_run": ".outputs.rundir",
         "RunWriter": ".outputs.rundir", "ConsoleReporter": ".outputs.console"}


def __getattr__(name):
    """The lazily imported names (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
