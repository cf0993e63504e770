"""What the watch does about an alert: the one rule from alert kind to action."""
from __future__ import annotations

from typing import Tuple

REPORTED = "reported"
# the alert's action text, by WatchConfig.switch_to
SWITCHED = {"stabilized": "switched to the stabilized kernel", "exact_delta": "switched to the exact delta"}
ALREADY = {"stabilized": "already switched to the stabilized kernel",
           "exact_delta": "already switched to the exact delta"}


def action_for(kind: str, head: Tuple[int, int], config, switched) -> Tuple[str, str]:
    """``(what to do, the alert's action text)`` for an alert of ``kind`` on ``head``.

    What to do is ``"clip"`` (``logit_growth`` with ``qk_clip`` on: QK-clip acts on the head), ``"switch"``
    (``auto_switch`` and a kind the stabilized kernel addresses, on a head not yet switched) or ``""``
    (report only). ``switched`` holds the heads already switched (``config.switch_to`` says to what).
    """
    if kind == "logit_growth" and config.qk_clip:
        return "clip", f"QK-clip on (tau {config.qk_clip_tau:g})"
    if config.auto_switch and kind in config.switch_on and head not in switched:
        return "switch", SWITCHED[config.switch_to]
    if head in switched and kind in config.switch_on:
        return "", ALREADY[config.switch_to]
    return "", REPORTED
