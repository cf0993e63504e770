"""When the watch does what: the step schedule, the check that ``step()`` runs once per optimizer step, the loss.

Steps count from 1. A cadence of ``n`` is due on steps 1, 1 + n, 1 + 2n, ...
(:func:`due`); 0 means never.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from instability_watch.engine.config import WatchConfig
from instability_watch.engine.faults import Faults
from instability_watch.ranks import log_rank_zero


def due(step: int, every: int) -> bool:
    """Whether a cadence of ``every`` steps (0: off) is due at ``step`` (steps 1, 1 + every, ...)."""
    return every > 0 and (step - 1) % every == 0


class Cadence:
    """The step schedule of one :class:`~instability_watch.engine.config.WatchConfig`."""

    def __init__(self, config: WatchConfig) -> None:
        self.config = config

    def probe(self, step: int) -> bool:
        """A probe step: the attention calls are observed."""
        return due(step, self.config.probe_every)

    def shadow(self, step: int) -> bool:
        """A shadow step (always a probe step too): the backward runs the shadow pass."""
        return due(step, self.config.shadow_period)

    def spectral(self, step: int) -> bool:
        """sigma(W_Q) is computed at this step."""
        return due(step, self.config.spectral_every)

    def recorded(self, step: int) -> bool:
        """A probe or spectral step: a ring row (and its loss) is kept for it."""
        return self.probe(step) or self.spectral(step)

    def read_back(self, step: int) -> bool:
        """A regular read-back step (every ``log_every`` steps)."""
        return step % self.config.log_every == 0


class StepCallCheck:
    """Warns once when ``step()`` runs more often than the optimizer updates the model.

    A trained parameter's version counter moves with every optimizer update (a
    host-side integer: reading it costs no device work). ``None`` ``param`` (a
    framework callback that counts optimizer steps itself, or a frozen model)
    turns the check off.
    """

    def __init__(self, param: Optional[torch.Tensor]) -> None:
        self.param = param
        self.version = param._version if param is not None else 0
        self.updated = self.idle = 0

    @classmethod
    def of(cls, model: nn.Module, enabled: bool) -> "StepCallCheck":
        """The check on ``model``'s first trained parameter (off when not ``enabled``)."""
        return cls(next((p for p in model.parameters() if p.requires_grad), None) if enabled else None)

    def count(self) -> None:
        """One ``step()`` call."""
        p = self.param
        if p is None or self.idle < 0:
            return
        version = p._version
        if version == self.version:
            self.idle += 1
        else:
            self.updated += 1
            self.version = version
        calls = self.idle + self.updated
        # step() twice per update gives idle == updated; a skipped optimizer step now and then
        # (a GradScaler overflow) stays far below that. No update at all (frozen weights): no claim.
        if self.updated >= 4 and 2 * self.idle >= calls:
            log_rank_zero(
                logging.WARNING,
                "instability_watch: step() was called %d times while the optimizer updated the model %d times: "
                "call it once per optimizer step, after optimizer.step(); the step numbers and every cadence "
                "count step() calls (reported once)", calls, self.updated)
            self.idle = -1  # reported: stop counting

    def resync(self) -> None:
        """The watch itself updated the weights (a QK-clip): that is not an optimizer step."""
        if self.param is not None:
            self.version = self.param._version


def check_loss(loss, faults: Faults):
    """``loss`` if it can be recorded; a bad one raises (``strict``, or several elements) or is dropped.

    Raises:
        ValueError: ``loss`` has more than one element; with ``strict`` also an empty or meta tensor.
        TypeError: with ``strict``, ``loss`` is not a number or a tensor.
    """
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() > 1:
            raise ValueError(f"loss must have one element (the loss you backpropagate), got a tensor of shape "
                             f"{tuple(loss.shape)}; reduce it first, e.g. loss.mean()")
        if loss.numel() == 0:
            problem = ValueError(f"loss must have one element, got an empty tensor of shape {tuple(loss.shape)}")
        elif loss.is_meta:
            problem = ValueError("loss is a meta tensor (it holds no value)")
        elif loss.is_complex() or loss.dtype == torch.bool:
            problem = TypeError(f"loss must be a real number, got a tensor of dtype {loss.dtype}")
        else:
            return loss
    elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return loss
    elif isinstance(loss, np.number) and np.isrealobj(loss) and not isinstance(loss, np.bool_):
        return float(loss)
    else:
        problem = TypeError(f"loss must be None, a number or a one-element tensor, got "
                            f"{type(loss).__name__} ({loss!r:.40})")
    if faults.strict:
        raise problem
    faults.once("loss", logging.WARNING, "instability_watch: step(loss): %s; this loss is left out (the CSV "
                "shows nan) and statistics go on (reported once)", problem)
    return None
