"""instability_watch: catch and fix BF16 flash-attention training failures while a model trains.

Public API (grows with each milestone):

* :func:`flash_attention` -- FA2-precision attention with a per-head stabilized
  variant (paper Alg. 3) and per-head diagnostics written into a :class:`Probe`.
* :class:`Probe` -- the per-layer device-side statistic buffers.
* :class:`InstabilityWatch`, :class:`WatchConfig` -- the engine that attaches to
  a model, tracks every head and raises :class:`Alert` records.
* :class:`AttentionLayer` -- describe an attention layer the built-in locators
  do not know.
"""
from .attach import AttentionLayer
from .config import WatchConfig
from .detectors import KINDS, Alert
from .kernels import flash_attention
from .probe import Probe
from .watch import Event, InstabilityWatch, StepMetrics, WatchError

__version__ = "0.1.0"

__all__ = [
    "flash_attention", "Probe", "InstabilityWatch", "WatchConfig", "Alert", "Event", "StepMetrics",
    "WatchError", "AttentionLayer", "KINDS", "__version__",
]
