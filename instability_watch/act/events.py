"""What the watch did, or could not do, to a head: the :class:`Event` record."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


@dataclass
class Event:
    """Something the watch did or could not do.

    ``kind`` is ``"switch"`` (a head moved to the stabilized kernel, or with ``to="exact_delta"`` its
    layer onto our kernel with the exact ``delta``),
    ``"switch_not_applied"`` (a switched head's layer made a call our kernels
    cannot serve; that call stayed on PyTorch's SDPA; ``reason`` says why) or
    ``"qk_clip_on"`` (``qk_clip="on_alert"``: the head is clipped from the next
    probe step on; ``reason`` is the alert kind). Clips themselves are
    :class:`~instability_watch.act.qkclip.Clip` records.

    ``step`` is the step at whose end the action was decided; it is in force from the next step. An alert
    is known only when its step is read back (every ``log_every`` steps), so the switch or clip it calls
    for is decided at that read-back, up to ``log_every`` steps after the alert's own step, which is
    ``alert_step`` (None for a switch by hand).
    """

    step: int
    layer: int
    head: int
    kind: str
    reason: str
    layer_name: str = ""
    to: str = "stabilized"  # a switch's target: WatchConfig.switch_to
    alert_step: Optional[int] = None  # the measured step of the alert that called for it

    def to_dict(self) -> dict:
        """The fields as a plain ``dict`` (JSON-ready)."""
        return asdict(self)

    def sentence(self) -> str:
        """The event in words (the run directory's ``message`` column)."""
        if self.kind == "switch_not_applied":
            return (f"{self.layer_name} head {self.head}: switch not applied to calls with {self.reason}; "
                    "they stay on PyTorch's attention")
        why = self.reason if self.alert_step is None else f"{self.reason} alert at step {self.alert_step}"
        if self.kind == "qk_clip_on":
            return (f"{self.layer_name} head {self.head}: QK-clip acts on this head from the next probe step "
                    f"({why})")
        if self.to == "exact_delta":
            return (f"{self.layer_name} head {self.head}: its layer moved to our kernel with the exact delta "
                    f"from the next step ({why})")
        return f"{self.layer_name} head {self.head} moved to the stabilized kernel from the next step ({why})"
