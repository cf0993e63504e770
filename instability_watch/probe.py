"""Per-layer, per-head statistic buffers that the attention kernels write into.

A :class:`Probe` lives on the same device as the layer's activations. Kernels add
to it in place (atomics on the GPU, tensor ops on the reference path), so nothing
here ever synchronises with the host; the watch reads all probes once per
logging step and then calls :meth:`Probe.zero_`.

Counters (each a tensor of shape ``(H,)``, one entry per *query* head):

=================  =======  ==========================================================
``rows``           int64    query rows processed (B * N per forward call)
``multi_max_rows`` int64    rows whose maximum score is attained more than once
                            (scores within ``eps`` of it): the rows where the
                            paper's rounding bias arises; the same count for
                            standard and stabilized heads
``max_score``      float32  largest attention logit ``scale * q.k`` seen
``nonfinite_rows`` int64    rows whose output or log-sum-exp is not finite
``shadow_rows``    int64    rows that went through a shadow backward
``delta_err_sum``  float32  sum over rows of ``delta_lp - delta_hp`` (shadow only)
``delta_err_abs``  float32  sum over rows of ``|delta_lp - delta_hp|`` (shadow only)
``delta_err_pos``  int64    rows with ``delta_lp - delta_hp > 0`` (shadow only)
=================  =======  ==========================================================

``delta_lp = rowsum(dO * O)`` is what FA2's backward uses, with ``O`` the stored
low-precision output; ``delta_hp = rowsum(dO * O_hp)`` with ``O_hp`` the output
recomputed in float32 without rounding ``P`` to the low-precision type. The paper
(Qiu & Yao 2026, Sec. 3.3) shows that the sum of their difference keeps one sign
before a BF16 training run fails.
"""
from __future__ import annotations

from typing import Dict

import torch

# name -> (dtype, value after zero_()); the order is the order of ``counters()``.
COUNTERS: Dict[str, tuple] = {
    "rows": (torch.int64, 0),
    "multi_max_rows": (torch.int64, 0),
    "max_score": (torch.float32, float("-inf")),
    "nonfinite_rows": (torch.int64, 0),
    "shadow_rows": (torch.int64, 0),
    "delta_err_sum": (torch.float32, 0.0),
    "delta_err_abs": (torch.float32, 0.0),
    "delta_err_pos": (torch.int64, 0),
}


class Probe:
    """Device-side statistics of one attention layer, accumulated over a step.

    Args:
        num_heads: number of query heads ``H`` of the layer.
        device: where the layer's activations live.

    Attributes:
        shadow: host-side flag. While ``True``, forward calls made through
            ``flash_attention(..., probe=self)`` also compute the shadow
            ``delta_lp - delta_hp`` statistics in their backward pass. The watch
            turns it on for shadow steps only.

    Example::

        probe = Probe(num_heads=12, device="cuda")
        o = flash_attention(q, k, v, causal=True, probe=probe)
        stats = {name: t.tolist() for name, t in probe.counters().items()}
        probe.zero_()
    """

    def __init__(self, num_heads: int, device: torch.device | str | None = None) -> None:
        if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.num_heads = num_heads
        self.device = torch.device(device if device is not None else "cpu")
        self.shadow = False
        for name, (dtype, value) in COUNTERS.items():
            setattr(self, name, torch.full((num_heads,), value, dtype=dtype, device=self.device))

    def counters(self) -> Dict[str, torch.Tensor]:
        """The counter tensors by name (the live buffers, not copies)."""
        return {name: getattr(self, name) for name in COUNTERS}

    def zero_(self) -> "Probe":
        """Reset every counter in place (no reallocation, no host sync)."""
        for name, (_, value) in COUNTERS.items():
            getattr(self, name).fill_(value)
        return self

    def to(self, device: torch.device | str) -> "Probe":
        """Move the buffers to ``device`` (a new allocation; call it once, at attach time)."""
        self.device = torch.device(device)
        for name in COUNTERS:
            setattr(self, name, getattr(self, name).to(self.device))
        return self

    def __repr__(self) -> str:
        return f"Probe(num_heads={self.num_heads}, device={str(self.device)!r}, shadow={self.shadow})"
