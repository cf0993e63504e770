"""Per-layer, per-head statistic buffers that the attention kernels write into.

A :class:`Probe` lives on the same device as the layer's activations. Kernels add
to it in place (atomics on the GPU, tensor ops on the reference path), so nothing
here ever synchronises with the host; the watch reads all probes once per
logging step and then calls :meth:`Probe.zero_`.

Statistics (each of shape ``(H,)``, one entry per *query* head):

=================  =======  ==========================================================
``rows``           int64    query rows processed (B * N per forward call)
``multi_max_rows`` int64    rows whose maximum score is attained more than once
                            (scores within ``eps`` of it): the rows where the
                            paper's rounding bias arises; counted among
                            ``tie_rows``
``tie_rows``       int64    rows over which ``multi_max_rows`` was counted: all
                            rows on the reference path and for stabilized heads;
                            for the other heads the Triton kernel samples about
                            a quarter of the query tiles (at most 1 in 16), a
                            rotating sample, because counting costs a compare
                            per score. The multi-max frequency is
                            ``multi_max_rows / tie_rows``
``max_score``      float32  largest attention logit ``scale * q.k`` seen
``nonfinite_rows`` int64    rows whose output or log-sum-exp is not finite
``masked_rows``    int64    rows whose every key is masked (the statistics pass, see
                            ``kernels/stats.py``, and our kernels); counted in nothing else
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

from typing import Dict, List, Optional, Sequence

import torch

from instability_watch.probe.fields import COUNT_FIELDS, VALUE_FIELDS, VALUE_RESET


class Probe:
    """Device-side statistics of one attention layer, accumulated over a step.

    The statistics live in two buffers, ``counts`` (int64) and ``values``
    (float32), one row per statistic and one column per query head, so that a
    kernel receives two pointers and the watch reads two tensors per layer.
    Each statistic is also an attribute (``probe.rows``, ``probe.max_score``...),
    a view into its row.

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
        self.shadow = False
        dev = torch.device(device if device is not None else "cpu")
        self.counts = torch.zeros(len(COUNT_FIELDS), num_heads, dtype=torch.int64, device=dev)
        self.values = torch.zeros(len(VALUE_FIELDS), num_heads, dtype=torch.float32, device=dev)
        self.zero_()

    @classmethod
    def from_buffers(cls, counts: torch.Tensor, values: torch.Tensor) -> "Probe":
        """A probe over existing buffers (no copy), e.g. inside a ``torch.library`` op.

        Args:
            counts: int64 ``(len(COUNT_FIELDS), H)``.
            values: float32 ``(len(VALUE_FIELDS), H)``, on the same device.
        """
        probe = cls.__new__(cls)
        probe.num_heads = counts.shape[1]
        probe.shadow = False
        probe.counts, probe.values = counts, values
        return probe

    @property
    def device(self) -> torch.device:
        """The device of the ``counts`` and ``values`` buffers."""
        return self.counts.device

    def __getattr__(self, name: str) -> torch.Tensor:
        # Only reached for names that are not regular attributes: the statistics.
        buffers = self.__dict__
        if name in COUNT_FIELDS and "counts" in buffers:
            return buffers["counts"][COUNT_FIELDS.index(name)]
        if name in VALUE_FIELDS and "values" in buffers:
            return buffers["values"][VALUE_FIELDS.index(name)]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def counters(self) -> Dict[str, torch.Tensor]:
        """Every statistic by name, as views into the live buffers (not copies).

        Each is a ``(H,)`` row: int64 for :data:`COUNT_FIELDS`, float32 for :data:`VALUE_FIELDS`.
        """
        return {name: getattr(self, name) for name in COUNT_FIELDS + VALUE_FIELDS}

    def zero_(self) -> "Probe":
        """Reset every statistic in place (no reallocation, no host sync)."""
        self.counts.zero_()
        for i, name in enumerate(VALUE_FIELDS):
            self.values[i].fill_(VALUE_RESET[name])
        return self

    def to(self, device: torch.device | str) -> "Probe":
        """Move the buffers to ``device`` (a new allocation; call it once, at attach time)."""
        self.counts = self.counts.to(device)
        self.values = self.values.to(device)
        return self

    def __repr__(self) -> str:
        return f"Probe(num_heads={self.num_heads}, device={str(self.device)!r}, shadow={self.shadow})"


def probe_buffers(probe: Optional[Probe]):
    """``(counts, values)`` of a probe, or ``(None, None)``.

    ``counts`` is int64 ``(len(COUNT_FIELDS), H)``, ``values`` float32
    ``(len(VALUE_FIELDS), H)``: the live buffers, not copies.
    """
    return (None, None) if probe is None else (probe.counts, probe.values)


class ProbeBank:
    """The probes of all watched layers, read and reset together.

    Each layer's :class:`Probe` owns its two buffers, a ``(len(COUNT_FIELDS), H_l)``
    ``counts`` and a ``(len(VALUE_FIELDS), H_l)`` ``values``; :attr:`counts` and
    :attr:`values` are their concatenation in layer order (one ``cat`` per
    read), and :meth:`zero_` resets all of them with two multi-tensor ops.
    Separate buffers rather than views into one flat buffer: under
    ``torch.compile`` with inductor on CUDA, a backward that adds into several
    views of one buffer (the shadow statistics) corrupted all but the first
    (seen with torch 2.11; aot_eager and CPU inductor were right).
    """

    def __init__(self, head_counts: Sequence[int], device: torch.device | str = "cpu") -> None:
        self.head_counts = list(head_counts)
        self._device = torch.device(device)
        self.probes: List[Probe] = [Probe(h, device) for h in self.head_counts]
        self._make_resets()

    @property
    def device(self) -> torch.device:
        """Where the probes' buffers live (the bank's device while it has no probes)."""
        return self.probes[0].device if self.probes else self._device

    @property
    def counts(self) -> torch.Tensor:
        """Every layer's ``counts``, flattened and concatenated in layer order (a copy).

        int64, ``(len(COUNT_FIELDS) * sum(H_l),)``: layer ``l``'s block is its
        ``(len(COUNT_FIELDS), H_l)`` buffer in row-major order.
        """
        if not self.probes:
            return torch.zeros(0, dtype=torch.int64, device=self._device)
        return torch.cat([p.counts.reshape(-1) for p in self.probes])

    @property
    def values(self) -> torch.Tensor:
        """Every layer's ``values``, flattened and concatenated in layer order (a copy).

        float32, ``(len(VALUE_FIELDS) * sum(H_l),)``, laid out as :attr:`counts`.
        """
        if not self.probes:
            return torch.zeros(0, dtype=torch.float32, device=self._device)
        return torch.cat([p.values.reshape(-1) for p in self.probes])

    def _make_resets(self) -> None:
        reset = torch.tensor([VALUE_RESET[f] for f in VALUE_FIELDS], dtype=torch.float32, device=self.device)
        self._value_resets = [reset[:, None].expand(len(VALUE_FIELDS), h).contiguous() for h in self.head_counts]

    def to(self, device: torch.device | str) -> "ProbeBank":
        """Move all buffers (keeping their contents and the :class:`Probe` objects).

        From the meta device (a model built there, then materialized) there is
        nothing to keep: the buffers come back fresh (zeroed).
        """
        fresh = self._device.type == "meta"
        self._device = torch.device(device)
        for p in self.probes:
            if fresh:
                p.counts = torch.empty_like(p.counts, device=device)
                p.values = torch.empty_like(p.values, device=device)
            else:
                p.to(device)
        self._make_resets()
        if fresh:
            self.zero_()
        return self

    def zero_(self) -> None:
        """Reset every probe's statistics in place (two multi-tensor ops, no host sync)."""
        if self.probes:
            torch._foreach_zero_([p.counts for p in self.probes])
            torch._foreach_copy_([p.values for p in self.probes], self._value_resets)
