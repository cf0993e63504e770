"""The step side of the engine: a recorded step's probes, sigma(W_Q) and loss into its ring row; QK-clip after
the optimizer step of a probe step. Device work only: no host sync."""
from __future__ import annotations

import logging
from typing import Callable

import torch

from instability_watch.observe.observation import GatheredReadError
from instability_watch.ranks import rank


class Recorder:
    """Records the steps the cadence asks for (one row each in the ring); see :meth:`record`."""

    def __init__(self, *, config, cadence, faults, ring, observation, spectral, clipper, check, model,
                 distributed: Callable[[], bool]) -> None:
        self.config, self.cadence, self.faults, self.ring = config, cadence, faults, ring
        self.observation, self.spectral, self.clipper, self.check = observation, spectral, clipper, check
        self.model, self.distributed = model, distributed

    def record(self, s: int, loss) -> None:
        """Step ``s`` is recorded (a probe or spectral step): its row, then QK-clip on a probe step."""
        if self.observation.bank.device.type == "meta":
            self.faults.once("meta", logging.WARNING, "instability_watch: the model is on the meta device (it "
                             "holds no data): nothing is recorded until it is materialized (e.g. model.to_empty())")
            return
        if "statistics" not in self.faults:
            try:
                self._record(s, loss)
            except Exception as exc:  # noqa: BLE001
                self.faults.fail("statistics", exc)
        self.ring.add(s)  # in lockstep with the other ranks, recorded or not
        if self.config.qk_clip and self.cadence.probe(s):
            self._qk_clip()

    def _record(self, s: int, loss) -> None:
        """Copy the probes (and sigma, the loss) into the step's ring row and reset them: device work only."""
        bank, lay = self.observation.bank, self.ring.columns
        row = self.ring.next_row(bank.device)
        row[lay.counts].copy_(bank.counts)
        row[lay.values].copy_(bank.values)
        sig = row[lay.sigma]
        sig.fill_(float("nan"))
        if self.cadence.spectral(s) and "spectral" not in self.faults:
            try:
                sig.copy_(torch.cat(self.spectral.of_grams(self.observation.grams())).to(sig.device))
            except GatheredReadError as exc:
                if self.distributed():
                    # turning spectral off on this rank alone would leave the others waiting in the next
                    # spectral step's FSDP gathers: this step's sigma is left to the other ranks (max-reduced)
                    self.faults.problem("spectral-gather", f"rank {rank()}: {exc}; sigma comes from the other ranks")
                else:
                    self.faults.fail("spectral", exc)
            except Exception as exc:  # noqa: BLE001
                self.faults.fail("spectral", exc)
        if isinstance(loss, torch.Tensor):
            row[lay.loss: lay.loss + 1].copy_(loss.detach().reshape(1))
        else:
            row[lay.loss: lay.loss + 1].fill_(float("nan") if loss is None else float(loss))
        # fill_, not ``row[i] = 1.0``: item assignment of a Python number copies a
        # host scalar into device memory, which waits for the stream (a sync per step)
        row[lay.ok: lay.ok + 1].fill_(1.0)  # this rank recorded the step (summed across ranks)
        row[lay.clip].fill_(float("nan"))  # written by the clip on probe steps
        if self.config.qk_clip and self.cadence.probe(s):
            self.clipper.keep_logits(bank)
        bank.zero_()

    def _qk_clip(self) -> None:
        """After the optimizer step of a probe step: QK-clip (:meth:`QKClipper.clip`), its multipliers recorded."""
        healthy = "statistics" not in self.faults and "qk_clip" not in self.faults
        try:
            gamma = self.clipper.clip(healthy=healthy, distributed=self.distributed(),
                                      device=self.observation.bank.device,
                                      sharding_roots=[self.model, *self.observation.sharding_roots])
            if gamma is not None:
                self.ring.last_row()[self.ring.columns.clip].copy_(gamma)
        except Exception as exc:  # noqa: BLE001
            self.faults.fail("qk_clip", exc)
        finally:
            self.check.resync()  # our own update is not an optimizer step
