"""QK-clip: cap each head's largest attention logit by rescaling its ``W_q`` and ``W_k`` in place.

Kimi K2's QK-Clip (Moonshot AI, 2025), applied by the watch after the optimizer
step of each probe step (``WatchConfig(qk_clip=...)``). For query head ``h``
with largest logit ``S_h`` (measured by the probe in that step's forward,
``scale * q.k``) over ``tau``, the logit multiplier is ``gamma_h = tau / S_h``
(1 elsewhere), computed on the device; then:

* **Multi-head attention** (one key head per query head): ``W_q[h]`` and
  ``W_k[h]`` (and their biases) are each multiplied by ``sqrt(gamma_h)``.
* **Grouped keys** (GQA, multi-query; ``KV < H``): a key head serves several
  query heads, so scaling it would move heads that are not over ``tau``. The
  key head is never scaled; ``W_q[h]`` (and its bias) takes the whole
  ``gamma_h``. The head's logits ``(gamma q).k`` come back to ``tau`` all the
  same, and every other head stays bitwise unchanged.

Heads not clipped are multiplied by exactly 1.0 (bitwise unchanged): one
in-place multiply per projection weight and bias, no Python loop over heads,
no host sync.

Where each layer's query and key rows are is model knowledge
(:class:`~instability_watch.model.qk.QKProjections`, built per family in
:mod:`~instability_watch.model.families`; layers with QK-norm are refused).
:class:`QKClipper` is the runtime part the engine drives: it keeps the probe
step's largest logits, computes the multipliers on the device after the
optimizer step (max-reduced across ranks, so every rank scales alike), scales
each layer (FSDP1 layers inside ``summon_full_params(writeback=True)`` of
their unit), and turns the multipliers read back into :class:`Clip` records.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn

from instability_watch.act.events import Event
from instability_watch.model.sharding import each_in_its_unit

MODES = ("on_alert", "always")


@dataclass
class Clip:
    """One head clipped at one step: its logits were multiplied by ``factor`` (= ``tau / max_logit``)."""

    step: int
    layer: int
    head: int
    factor: float
    max_logit: float
    tau: float
    layer_name: str = ""


class QKClipper:
    """QK-clip for the watched layers of one model (``WatchConfig(qk_clip=...)``).

    Args:
        mode: ``"on_alert"`` (the heads :meth:`enable` names, from their ``logit_growth`` alert on) or
            ``"always"`` (every head).
        tau: the logit cap.
        projections: one :class:`~instability_watch.model.qk.QKProjections` per watched layer.
        sites: the observation's layers (their modules and head counts), in order.
        layer_names: the watched layers' names.
        events: the watch's event list (a head enabled is an event).

    Attributes:
        enabled: ``{(layer, head): step}`` of the heads ``"on_alert"`` acts on.
        counts: ``(L, H)`` clips per head so far (read back).
        last: the clips of the last read-back.
    """

    def __init__(self, mode: str, tau: float, projections: Sequence, sites: Sequence, layer_names: List[str],
                 events: List[Event]) -> None:
        self.mode, self.tau = mode, float(tau)
        self.projections = list(projections)
        self.sites = list(sites)
        self.layer_names = layer_names
        self.events = events
        self.head_counts = [s.num_heads for s in self.sites]
        self.enabled: Dict[Tuple[int, int], int] = {}
        self.counts = np.zeros((len(self.head_counts), max(self.head_counts, default=0)), dtype=np.int64)
        self.last: List[Clip] = []
        self._mask: Optional[torch.Tensor] = None  # device (total heads,) bool: the heads it may act on
        # the probe step's largest logits (this rank's), kept from its statistics until the clip after its update
        self.pending_logits: Optional[torch.Tensor] = None

    # -- the probe step

    def keep_logits(self, bank) -> None:
        """Keep the probe step's largest logits (a copy, before the probes are reset)."""
        self.pending_logits = torch.cat([p.max_score for p in bank.probes])

    def clip(self, *, healthy: bool, distributed: bool, device: torch.device,
             sharding_roots: Sequence[nn.Module]) -> Optional[torch.Tensor]:
        """After the optimizer step of a probe step: scale ``W_q``/``W_k`` of the heads over ``tau``.

        On the device, no host sync: the step's largest logits (max-reduced across ranks, so every rank
        scales alike), the logit multiplier ``tau / S`` of each head that is over ``tau`` and enabled,
        then each layer's in-place multiply. Under torch.distributed every rank calls it at every probe
        step: a rank that is not ``healthy`` (its statistics or clip failed) takes part with a flag that
        makes every rank skip the clip of that step (and turn it off at the next read-back).

        Returns:
            The multipliers to record in the step's ring row (NaN where every rank skipped), or ``None``
            (nothing to record: this rank is not healthy).
        """
        smax, self.pending_logits = self.pending_logits, None
        healthy = healthy and smax is not None
        if not healthy and not distributed:
            return None
        total = sum(self.head_counts)
        if smax is None or not healthy:
            smax = torch.full((total,), float("-inf"), dtype=torch.float32, device=device)
        ok = None
        if distributed:
            dist = torch.distributed
            flag = torch.full((1,), 0.0 if healthy else 1.0, dtype=torch.float32, device=device)
            buf = torch.cat([torch.nan_to_num(smax.float(), nan=float("-inf")), flag])  # NaN: no MAX rule
            dist.all_reduce(buf, op=dist.ReduceOp.MAX)
            smax, ok = buf[:-1], buf[-1:] == 0
        over = self._mask_on(device) & torch.isfinite(smax) & (smax > self.tau)
        if ok is not None:
            over &= ok
        gamma = torch.where(over, self.tau / smax, torch.ones_like(smax))
        if not healthy:
            return None
        self._apply(gamma, sharding_roots)
        return gamma if ok is None else torch.where(ok, gamma, float("nan"))

    def _apply(self, gamma: torch.Tensor, sharding_roots: Sequence[nn.Module]) -> None:
        """Each layer's in-place scaling (FSDP1 layers inside their unit's full parameters, written back)."""
        bounds = np.cumsum([0] + self.head_counts)

        def scale(i: int) -> None:
            self.projections[i].apply(gamma[int(bounds[i]): int(bounds[i + 1])])

        failed = each_in_its_unit([site.layer.module for site in self.sites], sharding_roots, scale, writeback=True)
        if failed is not None:
            raise failed[1]

    def _mask_on(self, device: torch.device) -> torch.Tensor:
        """The heads it acts on, on ``device``: all with ``"always"``, else the enabled ones."""
        if self._mask is None or self._mask.device != device:
            total = sum(self.head_counts)
            if self.mode == "always":
                self._mask = torch.ones(total, dtype=torch.bool, device=device)
            elif not self.enabled:
                self._mask = torch.zeros(total, dtype=torch.bool, device=device)
            else:  # a host-to-device copy: only after enabling heads (at a read-back) or a resume
                self._mask = self._mask_host().to(device)
        return self._mask

    def _mask_host(self) -> torch.Tensor:
        starts = np.cumsum([0] + self.head_counts[:-1])
        mask = torch.zeros(sum(self.head_counts), dtype=torch.bool)
        for (layer, head) in self.enabled:
            mask[int(starts[layer]) + head] = True
        return mask

    # -- the read-back

    def enable(self, layer: int, head: int, step: int, reason: str, alert_step: Optional[int] = None) -> None:
        """``"on_alert"``: act on this head from the first probe step after ``step`` on (sticky; an event);
        ``alert_step``: the measured step of the alert that called for it."""
        if (layer, head) in self.enabled:
            return
        self.enabled[(layer, head)] = step
        self.events.append(Event(step, layer, head, "qk_clip_on", reason, self.layer_names[layer],
                                 alert_step=alert_step))
        if self._mask is not None:  # called inside a read-back (synchronised already)
            self._mask = self._mask_host().to(self._mask.device)

    def clips(self, step: int, gamma: np.ndarray, max_score: np.ndarray) -> List[Clip]:
        """The clips of one read-back step, from its ``(L, H)`` logit multipliers (those below 1)."""
        out = []
        for layer, head in np.argwhere(gamma < 1.0):
            layer, head = int(layer), int(head)
            self.counts[layer, head] += 1
            out.append(Clip(step, layer, head, float(gamma[layer, head]), float(max_score[layer, head]),
                            self.tau, self.layer_names[layer]))
        return out

    @staticmethod
    def skipped(gamma: np.ndarray, pad: np.ndarray) -> bool:
        """Whether a probe step's multipliers are missing on some head (a rank could not clip)."""
        return bool(np.isnan(gamma[~pad]).any())

    def restore(self, enabled: Dict[Tuple[int, int], int], counts: np.ndarray) -> None:
        """A resumed state: these heads enabled, these clip counts."""
        self.enabled, self.counts = dict(enabled), counts
        self._mask = None  # rebuilt on the next probe step

