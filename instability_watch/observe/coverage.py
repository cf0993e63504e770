"""What the watch saw of each layer's attention calls: the kinds of reason a call is not observed, and
:class:`LayerCoverage`, the per-layer record that :meth:`InstabilityWatch.coverage` returns.

Coverage is counted on the device, in the probe's call rows (``probe.fields.CALL_FIELDS``), so it is exact in
eager and compiled code alike and costs no host sync; each reason is recorded once per layer (at trace time
under ``torch.compile``) and logged once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

# What a reason is about: each kind has its call-count row in the probe.
UNOBSERVED, SHADOW_SKIPPED, NOT_APPLIED = "unobserved", "shadow_skipped", "not_applied"
KIND_ROW = {UNOBSERVED: "unobserved_calls", SHADOW_SKIPPED: "shadow_skipped_calls", NOT_APPLIED: "fallback_calls"}


@dataclass(frozen=True)
class LayerCoverage:
    """What the watch saw of one layer's attention calls (training-mode calls on probe steps).

    Attributes:
        layer_name: the layer.
        observed_calls: calls whose statistics were taken.
        unobserved_calls: calls that could not be observed, by reason.
        shadow_calls: calls whose backward ran the shadow pass.
        shadow_skipped: calls on shadow steps without a shadow, by reason (dropout).
        kernel_calls: calls run on our kernels (a switched layer).
        not_applied: calls of a switched layer that stayed on PyTorch's SDPA, by reason.

    Counts are summed over ranks under ``torch.distributed``. Where one count
    has several reasons, the reasons are joined with ``" | "``.
    """

    layer_name: str
    observed_calls: int = 0
    unobserved_calls: Dict[str, int] = field(default_factory=dict)
    shadow_calls: int = 0
    shadow_skipped: Dict[str, int] = field(default_factory=dict)
    kernel_calls: int = 0
    not_applied: Dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The record as plain Python types (what ``meta.json``'s ``coverage`` holds)."""
        return {
            "layer_name": self.layer_name, "observed_calls": self.observed_calls,
            "unobserved_calls": dict(self.unobserved_calls), "shadow_calls": self.shadow_calls,
            "shadow_skipped": dict(self.shadow_skipped), "kernel_calls": self.kernel_calls,
            "not_applied": dict(self.not_applied),
        }


def layer_coverage(name: str, reasons: Dict[str, List[str]], calls: Dict[str, int]) -> LayerCoverage:
    """One layer's record from its reasons seen (kind -> reasons) and its call counts read back (row -> total)."""
    def by_reason(kind: str) -> Dict[str, int]:
        n = int(calls.get(KIND_ROW[kind], 0))
        return {" | ".join(reasons.get(kind, ["unknown"])): n} if n else {}

    return LayerCoverage(
        layer_name=name, observed_calls=int(calls.get("observed_calls", 0)),
        unobserved_calls=by_reason(UNOBSERVED), shadow_calls=int(calls.get("shadow_calls", 0)),
        shadow_skipped=by_reason(SHADOW_SKIPPED), kernel_calls=int(calls.get("kernel_calls", 0)),
        not_applied=by_reason(NOT_APPLIED),
    )
