"""The read-back side of the engine: the ring's rows (one host sync) into per-step metrics, the detectors'
alerts, and the actions they call for (a switch, QK-clip turned on), by the rule in :mod:`~instability_watch.act.policy`."""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, Tuple

import numpy as np

from instability_watch.act.policy import action_for
from instability_watch.act.qkclip import Clip, QKClipper
from instability_watch.detect.detectors import Alert
from instability_watch.engine.metrics import StepMetrics
from instability_watch.errors import WatchError
from instability_watch.ranks import log_rank_zero, world_size


class Reader:
    """Reads back the pending steps (:meth:`read`); ``detectors`` are the rules it runs (rebuilt on a restart)."""

    def __init__(self, *, config, cadence, faults, ring, builder, calls, detectors, switchboard, clipper, layer_names,
                 alerts: List[Alert], observation, distributed: Callable[[], bool]) -> None:
        self.config, self.cadence, self.faults, self.ring = config, cadence, faults, ring
        self.builder, self.calls, self.detectors = builder, calls, detectors
        self.switchboard, self.clipper, self.layer_names, self.alerts = switchboard, clipper, layer_names, alerts
        self.observation, self.distributed = observation, distributed
        self.deciding_at = 0  # the step of the current read-back: its actions are in force from the next step

    def read(self, step_count: int) -> Tuple[Optional[List[StepMetrics]], List[Alert], List[Clip]]:
        """Read back the steps pending through ``step_count`` (one host sync), run the detectors and act:
        ``(metrics, alerts, clips)``; ``metrics`` is ``None`` when there is nothing to hand to the listeners
        (nothing pending, or a part failed: then ``alerts`` holds those raised before the failure)."""
        if step_count <= self.ring.read_through:
            return None, [], []
        self.deciding_at = step_count  # what an alert read now calls for is in force from the next step
        is_dist = self.distributed()
        steps = list(self.ring.pending)
        recorded = "statistics" not in self.faults
        if not is_dist and (not steps or not recorded):
            self.ring.restart(step_count)
            return None, [], []
        try:
            host = self.ring.take(self.observation.bank.device, recorded=recorded, distributed=is_dist)
        except Exception as exc:  # noqa: BLE001
            self.ring.restart(step_count)
            self.faults.fail("statistics", exc)
            return None, [], []
        self.ring.restart(step_count)
        lay = self.ring.columns
        if len(host) and not (host[:, lay.ok] == (world_size() if is_dist else 1)).all():
            self.faults.fail("statistics", WatchError("statistics failed on another rank; turned off on every rank"))
            return None, [], []
        self.calls.add(host[:, lay.counts])
        self.observation.claim_shared_reasons(self.calls.per_layer)  # compiled graphs' reasons, per layer
        alerts: List[Alert] = []
        clips: List[Clip] = []
        try:
            metrics = [self._metrics(step, host[i]) for i, step in enumerate(steps)]
            if self.config.qk_clip:
                for i, m in enumerate(metrics):
                    clips.extend(self._clips(m, host[i]))
            if "detectors" not in self.faults:
                for m in metrics:
                    alerts.extend(self._detect(m))
        except WatchError:
            raise
        except Exception as exc:  # noqa: BLE001
            self.faults.fail("detectors", exc)
            return None, alerts, []
        self.clipper.last = clips
        return metrics, alerts, clips

    def _metrics(self, step: int, row: np.ndarray) -> StepMetrics:
        lay = self.ring.columns
        stab = self.switchboard.stabilized(self.builder.shape, routing="routing" not in self.faults)
        m, broken = self.builder.build(step, lay.unpack(row), float(row[lay.loss]), stab)
        if broken.any():
            layer, head = map(int, np.argwhere(broken)[0])
            self.faults.problem("delta", f"non-finite delta_err_sum at step {step}, layer {self.layer_names[layer]}, "
                                         f"head {head} with finite attention rows")
        return m

    def _clips(self, m: StepMetrics, row: np.ndarray) -> List[Clip]:
        """The clips recorded in one read-back row (its logit multipliers below 1)."""
        gamma = self.ring.columns.per_head(row[self.ring.columns.clip])
        if (QKClipper.skipped(gamma, self.builder.pad) and self.cadence.probe(m.step)
                and "qk_clip" not in self.faults and self.distributed()):
            # another rank could not clip: every rank skipped it; now turn it off everywhere
            self.faults.fail("qk_clip", WatchError("qk_clip failed on another rank; turned off on every rank"))
        return self.clipper.clips(m.step, gamma, m.values["max_score"])

    def _detect(self, m: StepMetrics) -> List[Alert]:
        new: List[Alert] = []
        for kind, detector in self.detectors.items():
            for layer, head, value, threshold, message in detector.update(m.step, m.values[detector.metric]):
                act, action = action_for(kind, (layer, head), self.config, self.switchboard.switched)
                if act == "clip" and self.config.qk_clip == "on_alert":
                    self.clipper.enable(layer, head, self.deciding_at, kind, alert_step=m.step)
                elif act == "switch":
                    self.switchboard.switch(layer, head, kind, self.deciding_at, alert_step=m.step)
                alert = Alert(m.step, layer, head, kind, value, threshold, message, self.layer_names[layer], action)
                new.append(alert)
                log_rank_zero(logging.INFO, "instability_watch: step %d, %s head %d: %s alert: %s [%s]",
                              m.step, alert.layer_name, head, kind, message, action)
        self.alerts.extend(new)
        return new
