"""The device-side ring: one row per recorded step, read back in one transfer (the one host sync).

:class:`RingColumns` says where each probe field, sigma(W_Q), the loss, the
"this rank recorded" flag and the QK-clip multipliers sit in a row;
:class:`Ring` holds the rows of the steps not yet read back and reads them
back, reduced across ranks under ``torch.distributed`` (sums for counts, drift
and loss, maxima for logits, sigma and clip multipliers).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from instability_watch.probe.fields import COUNT_FIELDS, VALUE_FIELDS
from instability_watch.ranks import world_size

RING_ROWS_MAX = 256  # read back early when this many steps wait on the device (bounds its memory)


class RingColumns:
    """The columns of one ring row (float64): every layer's ``counts``, every layer's ``values``, sigma, loss, ok.

    ``counts`` and ``values`` are :class:`~instability_watch.probe.bank.ProbeBank`'s
    concatenations (per layer, field-major); ``ok`` is 1 where this rank
    recorded the step (summed across ranks, so a rank that failed shows).
    """

    def __init__(self, head_counts: Sequence[int], clip: bool = False) -> None:
        self.head_counts = list(head_counts)
        total = sum(self.head_counts)
        nc, nv = len(COUNT_FIELDS), len(VALUE_FIELDS)
        self.counts = slice(0, nc * total)
        self.values = slice(nc * total, (nc + nv) * total)
        self.sigma = slice((nc + nv) * total, (nc + nv + 1) * total)
        self.loss = (nc + nv + 1) * total
        self.ok = self.loss + 1
        # with qk_clip: each head's logit multiplier of the step (1: not clipped; NaN: no clip step)
        self.clip = slice(self.ok + 1, self.ok + 1 + (total if clip else 0))
        self.width = self.clip.stop

    def max_columns(self) -> torch.Tensor:
        """A ``(width,)`` bool CPU tensor: the columns reduced by max across ranks (the largest logit, sigma,
        the clip multipliers); the rest are summed."""
        cols = torch.zeros(self.width, dtype=torch.bool)
        i_max = VALUE_FIELDS.index("max_score")
        offset = self.values.start
        for h in self.head_counts:  # max_score sits in each layer's value block
            cols[offset + i_max * h: offset + (i_max + 1) * h] = True
            offset += len(VALUE_FIELDS) * h
        cols[self.sigma] = True
        cols[self.clip] = True  # the same on every rank
        return cols

    def per_head(self, flat: np.ndarray) -> np.ndarray:
        """A ``(total heads,)`` vector as a float64 ``(L, H_max)`` array, NaN in padded heads."""
        L, Hm = len(self.head_counts), max(self.head_counts, default=0)
        out = np.full((L, Hm), np.nan)
        o = 0
        for layer, h in enumerate(self.head_counts):
            out[layer, :h] = flat[o: o + h]
            o += h
        return out

    def unpack(self, row: np.ndarray) -> Dict[str, np.ndarray]:
        """Every probe field and ``sigma_wq`` of one float64 ``(width,)`` row as a float64 ``(L, H_max)`` array
        (NaN in padded heads)."""
        L, Hm = len(self.head_counts), max(self.head_counts, default=0)
        nc, nv = len(COUNT_FIELDS), len(VALUE_FIELDS)
        out = {name: np.full((L, Hm), np.nan) for name in COUNT_FIELDS + VALUE_FIELDS + ("sigma_wq",)}
        counts, values, sigma = row[self.counts], row[self.values], row[self.sigma]
        oc = ov = 0
        for layer, h in enumerate(self.head_counts):
            c = counts[oc: oc + nc * h].reshape(nc, h)
            v = values[ov: ov + nv * h].reshape(nv, h)
            for i, name in enumerate(COUNT_FIELDS):
                out[name][layer, :h] = c[i]
            for i, name in enumerate(VALUE_FIELDS):
                out[name][layer, :h] = v[i]
            out["sigma_wq"][layer, :h] = sigma[oc // nc: oc // nc + h]
            oc, ov = oc + nc * h, ov + nv * h
        return out


class Ring:
    """The rows of the recorded steps not yet read back, on the probes' device.

    Attributes:
        columns: where each quantity sits in a row.
        pending: the recorded steps waiting on the device, in order (row ``i`` is ``pending[i]``'s).
        read_through: the last step read back.
    """

    def __init__(self, columns: RingColumns, log_every: int) -> None:
        self.columns = columns
        self.rows = min(log_every, RING_ROWS_MAX)
        self.pending: List[int] = []
        self.read_through = 0
        self._tensor: Optional[torch.Tensor] = None
        self._max_cols: Optional[torch.Tensor] = None  # max_columns() on the ring's device (copied there once)

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The ring on ``device`` (made, or moved there keeping its rows, on first use)."""
        if self._tensor is None or self._tensor.device != device:
            ring = torch.full((self.rows, self.columns.width), float("nan"), dtype=torch.float64, device=device)
            if self._tensor is not None and not self._tensor.is_meta:
                ring.copy_(self._tensor.to(device))
            self._tensor = ring
        return self._tensor

    def next_row(self, device: torch.device) -> torch.Tensor:
        """The row the step being recorded writes (it becomes pending with :meth:`add`)."""
        return self.tensor(device)[len(self.pending)]

    def last_row(self) -> torch.Tensor:
        """The row of the last pending step."""
        return self._tensor[len(self.pending) - 1]

    def add(self, step: int) -> None:
        """``step`` is pending (recorded, or taking part in the read-back without a row of its own)."""
        self.pending.append(step)

    @property
    def full(self) -> bool:
        """As many steps wait as the ring holds: read back now."""
        return len(self.pending) >= self.rows

    def take(self, device: torch.device, *, recorded: bool, distributed: bool) -> np.ndarray:
        """The pending rows on the host (reduced across ranks when ``distributed``): the one host sync.

        A rank that recorded nothing valid (``recorded`` False) takes part with rows whose ``ok`` column is 0.
        """
        ring = self.tensor(device)
        n = len(self.pending)
        if recorded:
            data = ring[:n].clone()
        else:
            data = torch.full((n, ring.shape[1]), float("nan"), dtype=torch.float64, device=ring.device)
            data[:, self.columns.ok].fill_(0.0)
        if distributed:
            data = self._reduce(data)
        return data.cpu().numpy()

    def _reduce(self, data: torch.Tensor) -> torch.Tensor:
        """Sum counts, delta sums and loss (loss averaged) over ranks; max the logits, sigma and clip multipliers."""
        dist = torch.distributed
        if self._max_cols is None or self._max_cols.device != data.device:
            self._max_cols = self.columns.max_columns().to(data.device)  # once: a copy to the device syncs
        max_cols = self._max_cols
        # NaN does not survive all_reduce(MAX) portably: reduce with -inf in its place.
        maxed = torch.where(max_cols & ~torch.isnan(data), data, torch.full_like(data, float("-inf")))
        summed = torch.where(max_cols, torch.zeros_like(data), data)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        out = torch.where(max_cols, maxed, summed)
        out = torch.where(max_cols & torch.isneginf(out), torch.full_like(out, float("nan")), out)
        out[:, self.columns.loss] /= world_size()  # the mean over ranks; the ok column stays a count
        return out

    def restart(self, step: int) -> None:
        """Drop what is pending; the next read-back starts after ``step``."""
        self.pending = []
        self.read_through = step

    def pending_rows(self) -> List[List[float]]:
        """The pending rows as Python lists (a host sync; for the watch's state)."""
        if not self.pending or self._tensor is None:
            return []
        return self._tensor[: len(self.pending)].cpu().tolist()

    def load(self, pending: List[int], read_through: int, rows: torch.Tensor, device: torch.device) -> None:
        """Resume: these steps pending with these rows (float64 ``(len(pending), width)``)."""
        self._tensor = None
        self.pending = list(pending)
        self.read_through = read_through
        if self.pending:
            self.tensor(device)[: len(self.pending)].copy_(rows.to(device))
