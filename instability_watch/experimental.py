"""Research tools: not fixes, and not part of the stable API.

:func:`high_precision_delta` is the paper's control experiment (its Claim 1), kept for
reproducing it (``benchmarks/reproduce.py``'s control arm). The watch can switch an alerted head's layer
onto it (``WatchConfig(switch_to="exact_delta")``): at the paper's scale it prevented the failure when
applied to every layer from step 1, where the stabilized kernel did not (benchmarks/RESULTS.md, issue 41).
"""
from __future__ import annotations

import contextlib

from instability_watch.kernels.attention import ops
from instability_watch.kernels.attention.ops import HIGH_PRECISION_DELTA

__all__ = ["high_precision_delta", "high_precision_delta_calls"]


def high_precision_delta_calls() -> int:
    """How many attention backward calls in this process took ``delta`` from a float32 ``O``
    (the control experiment's check that it is running: a run meant to be the control with 0 is not one)."""
    return ops.HIGH_PRECISION_DELTA_CALLS


@contextlib.contextmanager
def high_precision_delta(enabled: bool = True):
    """The paper's control experiment: the backward's ``delta`` from a high-precision ``O``.

    Calls to :func:`~instability_watch.flash_attention` whose forward runs inside this context
    (routed calls of a watched model included) compute, in their backward,
    ``delta = rowsum(dO * O_hp)`` with ``O_hp = softmax(S) V`` and ``P`` never
    rounded, instead of ``rowsum(dO * O)`` from the stored BF16 ``O``. Everything else (the forward output, the rest of the backward) is
    unchanged, so a training run inside it differs from a standard one only by
    the rounding bias the paper blames (Claim 1). On CUDA our dQ kernel computes it in a
    pre-pass, ``rowsum(P * (dO V^T))`` with ``P`` in float32 (about one attention forward per
    backward; ``INSTABILITY_WATCH_HP_DELTA=pytorch`` takes the other way); elsewhere PyTorch
    recomputes ``O_hp`` in float32 (float64 for float64 inputs). Eager calls only: ``torch.compile`` cannot read
    the context, so compiled code passes ``flash_attention(..., high_precision_delta=True)``
    or routes a watched layer with ``watch.observation.route(layer, high_precision_delta=True)``;
    :func:`high_precision_delta_calls` counts the backward calls that took it, compiled or not.
    A shadow step's ``delta`` drift then measures this ``delta`` against the
    kernel's own ``delta_hp`` (about 0).

    Example::

        with high_precision_delta():
            loss = model(x).loss
        loss.backward()
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    token = HIGH_PRECISION_DELTA.set(enabled)
    try:
        yield
    finally:
        HIGH_PRECISION_DELTA.reset(token)
