"""What a listener receives after each read-back: :class:`ReadBack`, a typed record (never the engine)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Sequence, Tuple

from instability_watch.act.events import Event
from instability_watch.act.qkclip import Clip
from instability_watch.detect.detectors import Alert
from instability_watch.engine.config import WatchConfig
from instability_watch.engine.metrics import StepMetrics, head_shape
from instability_watch.observe.coverage import LayerCoverage


@dataclass(frozen=True)
class ReadBack:
    """One read-back of the watch, as its listeners (console, run directory, loggers) see it.

    Attributes:
        metrics: the observed steps just read back, in order (empty on a read-back that found none).
        alerts: the alerts raised by this read-back.
        events: switches and other actions since the previous read-back (those made between read-backs,
            e.g. a manual ``watch.switch``, included).
        clips: the QK-clips of the steps just read back.
        coverage: what was observed so far, per layer.
        layer_names, head_counts: the watched layers.
        switched: ``{(layer, head): step}`` of the heads on the stabilized kernel.
        all_alerts: every alert so far (a resumed run's earlier ones included).
        config: the watch's configuration.
        report: ``report(part, exc)`` reports a failure that should not stop the listener (the watch turns
            ``part`` off and reports it once; it raises ``exc`` with ``strict``). A failure that should stop the
            listener is raised from it instead: the watch then drops it.
    """

    metrics: Sequence[StepMetrics]
    alerts: Sequence[Alert]
    events: Sequence[Event]
    clips: Sequence[Clip]
    coverage: Sequence[LayerCoverage]
    layer_names: Sequence[str]
    head_counts: Sequence[int]
    switched: Dict[Tuple[int, int], int]
    all_alerts: Sequence[Alert]
    config: WatchConfig = field(default_factory=WatchConfig)
    report: Callable[[str, BaseException], None] = field(default=None, repr=False)

    @property
    def shape(self) -> Tuple[int, int]:
        """``(L, H)``: watched layers x the widest layer's heads."""
        return head_shape(self.head_counts)

    @property
    def step(self) -> int:
        """The last step read back (0: none)."""
        return self.metrics[-1].step if self.metrics else 0


Listener = Callable[[ReadBack], None]
