"""instability_watch: catch and fix BF16 flash-attention training failures while a model trains.

Public API (grows with each milestone):

* :func:`flash_attention` -- FA2-precision attention with a per-head stabilized
  variant (paper Alg. 3) and per-head diagnostics written into a :class:`Probe`.
* :class:`Probe` -- the per-layer device-side statistic buffers.
"""
from .kernels import flash_attention
from .probe import Probe

__version__ = "0.1.0"

__all__ = ["flash_attention", "Probe", "__version__"]
