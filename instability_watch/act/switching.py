"""Switching heads onto the stabilized kernel: which heads are switched, since when, and the events it makes.

A switched head's layer runs every call on our kernels (standard for its other
heads, stabilized for the switched ones); a call they cannot serve stays on
PyTorch's SDPA, and a ``switch_not_applied`` event says why (once per head and
reason). Switches are sticky.
"""
from __future__ import annotations

import numbers
from typing import Dict, List, Optional, Tuple

import numpy as np

from instability_watch.act.events import Event
from instability_watch.observe.coverage import NOT_APPLIED


class Switchboard:
    """The switched heads of one observation.

    Args:
        observation: the watched layers (:class:`~instability_watch.observe.observation.Observation`).
        events: the watch's event list (switches are events).
        switch_to: ``"stabilized"`` or ``"exact_delta"`` (``WatchConfig.switch_to``).

    Attributes:
        switched: ``{(layer, head): step}`` of the switched heads, each from the step after ``step``.
    """

    def __init__(self, observation, events: List[Event], switch_to: str = "stabilized") -> None:
        self.observation = observation
        self.events = events
        self.switch_to = switch_to
        self.switched: Dict[Tuple[int, int], int] = {}

    def __contains__(self, head: Tuple[int, int]) -> bool:
        return head in self.switched

    def switch(self, layer: int, head: int, reason: str, step: int, alert_step: Optional[int] = None) -> None:
        """Switch one head (sticky; recorded as an event): onto the stabilized kernel, or with
        ``switch_to="exact_delta"`` its layer onto our kernel with the exact ``delta``. ``step``: the step at
        whose end it is decided (the next one runs switched); ``alert_step``: the measured step of the alert that
        called for it, if any.

        Raises:
            TypeError: ``layer`` or ``head`` is not an int.
            ValueError: ``layer`` or ``head`` is out of range.
        """
        sites = self.observation.sites
        for name, value in (("layer", layer), ("head", head)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                hint = " (the index in the CSV's `layer` column, not its `layer_name`)" if name == "layer" else ""
                raise TypeError(f"{name} must be an int{hint}, got {type(value).__name__} {value!r}")
        layer, head = int(layer), int(head)
        if not 0 <= layer < len(sites):
            raise ValueError(f"layer must be in [0, {len(sites)}), got {layer}")
        if not 0 <= head < sites[layer].num_heads:
            raise ValueError(f"head must be in [0, {sites[layer].num_heads}) for layer {sites[layer].name}, got {head}")
        if (layer, head) in self.switched:
            return
        self._apply(layer, head)
        self.switched[(layer, head)] = step
        site = sites[layer]
        self.events.append(Event(step, layer, head, "switch", reason, site.name, self.switch_to, alert_step))
        for why in site.reasons.get(NOT_APPLIED, []):  # already known for this layer
            self.events.append(Event(step, layer, head, "switch_not_applied", why, site.name))

    def not_applied(self, layer: int, reason: str, step: int) -> None:
        """A layer met a call our kernels cannot serve: an event for each of its switched heads."""
        site = self.observation.sites[layer]
        for (l, head) in sorted(self.switched):
            if l == layer:
                self.events.append(Event(step, l, head, "switch_not_applied", reason, site.name))

    def routing_failed(self, exc: BaseException, step: int) -> None:
        """Our kernels failed: every call goes to PyTorch's SDPA from now on; each switched head says so."""
        self.observation.routing = False
        for (layer, head) in sorted(self.switched):
            site = self.observation.sites[layer]
            self.events.append(Event(step, layer, head, "switch_not_applied",
                                     f"our kernel failed ({type(exc).__name__})", site.name))

    def stabilized(self, shape: Tuple[int, int], routing: bool) -> np.ndarray:
        """``(L, H)``: 1 where a head's switch is applied to every call of its layer."""
        out = np.zeros(shape)
        for (layer, head) in self.switched:
            if routing and not self.observation.sites[layer].reasons.get(NOT_APPLIED):
                out[layer, head] = 1.0
        return out

    def restore(self, switched: Dict[Tuple[int, int], int]) -> None:
        """Exactly these heads switched (a resumed state)."""
        self.observation.reset_switches()
        self.switched = {}
        for (layer, head), s in switched.items():
            self._apply(layer, head)
            self.switched[(layer, head)] = s

    def _apply(self, layer: int, head: int) -> None:
        if self.switch_to == "exact_delta":
            if not self.observation.sites[layer].high_precision_delta:
                self.observation.route(layer, True, high_precision_delta=True)
        else:
            self.observation.set_stabilized(layer, head, True)
