"""The watch's state: saved as plain Python types, checked whole before anything is restored.

:func:`save` is :meth:`InstabilityWatch.state_dict`; :func:`parse` checks a
state against a watch (every problem a ``ValueError`` naming its key) and
returns what :func:`restore` then applies. Version :data:`STATE_VERSION`.
"""
from __future__ import annotations

import logging
from typing import List

import numpy as np
import torch

from instability_watch.act.events import Event
from instability_watch.detect.detectors import Alert, build_detectors
from instability_watch.probe.fields import CALL_FIELDS
from instability_watch.probe.spectral import SpectralNorms
from instability_watch.ranks import log_rank_zero

STATE_VERSION = 2


def save(watch) -> dict:
    """Everything needed to resume ``watch`` identically (see :meth:`InstabilityWatch.state_dict`)."""
    ring = watch.ring
    if ring.pending and watch.distributed:
        # this rank's rows, not yet reduced: resumed on every rank, rank 0's would count world-size times
        watch.faults.problem("state_dict", "state_dict() under torch.distributed with steps not yet read back: "
                             "call watch.read_back() on every rank first (the callbacks do), or those steps are "
                             "counted wrongly after a resume")
    clipper = watch.clipper
    return {
        "version": STATE_VERSION,
        "step": watch.step_count,
        "layers": list(watch.layer_names),
        "heads": list(watch.head_counts),
        "switched": [[l, h, s] for (l, h), s in sorted(watch.switched.items())],
        "switch_to": watch.config.switch_to,
        # plain Python types: a head no shadow pass has measured yet (NaN in the metrics) is None
        "delta_cum": [[None if np.isnan(x) else float(x) for x in row] for row in watch.builder.delta_cum]
        if watch.head_counts else [],
        "detectors": {k: d.state_dict() for k, d in watch.detectors.items()},
        "spectral": watch.spectral.state_dict(),
        "pending_steps": list(ring.pending),
        "flushed_through": ring.read_through,
        "pending": ring.pending_rows(),
        "calls": [dict(c) for c in watch.calls.per_layer],
        "coverage_checked": watch.coverage_checked,
        "alerts": [a.to_dict() for a in watch.alerts],
        # without a switch's target (restored from "switch_to" in parse) and its alert's step (in the run directory's
        # message; None when restored): the state's format stays as it was, so an earlier version can load it
        "events": [{k: v for k, v in e.to_dict().items() if k not in ("to", "alert_step")} for e in watch.events],
        "qk_clip": {"enabled": [[l, h, s] for (l, h), s in sorted(clipper.enabled.items())],
                    "counts": clipper.counts.tolist() if watch.head_counts else []},
    }


def parse(watch, state) -> dict:
    """Check a state from :func:`save` against ``watch``; every problem names its key (nothing is changed)."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not an InstabilityWatch state of version {STATE_VERSION} (got version {got!r})")

    def need(key):
        if key not in state:
            raise ValueError(f"InstabilityWatch state: missing key {key!r}")
        return state[key]

    def integer(key, value=None):
        v = need(key) if value is None else value
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"InstabilityWatch state: {key!r} must be a non-negative int, got {v!r}")
        return v

    if need("layers") != watch.layer_names or need("heads") != watch.head_counts:
        raise ValueError(
            f"state was saved for layers {state['layers']} with heads {state['heads']}, "
            f"this watch has {watch.layer_names} with {watch.head_counts}"
        )
    out = {"step": integer("step"), "flushed_through": integer("flushed_through")}

    def heads(key, items):
        found = {}
        for item in items:
            if not (isinstance(item, (list, tuple)) and len(item) == 3):
                raise ValueError(f"InstabilityWatch state: {key!r} entries must be [layer, head, step], got {item!r}")
            layer, head, s = (integer(key, x) for x in item)
            if layer >= len(watch.head_counts) or head >= watch.head_counts[layer]:
                raise ValueError(f"InstabilityWatch state: {key!r} names layer {layer} head {head}, "
                                 f"which this watch does not have")
            found[(layer, head)] = s
        return found

    shape = watch.shape
    out["switched"] = heads("switched", need("switched"))
    out["switch_to"] = state.get("switch_to", "stabilized")  # states saved before switch_to: the stabilized kernel
    clip = state.get("qk_clip", {"enabled": [], "counts": []})  # states saved before qk_clip have none
    if not isinstance(clip, dict):
        raise ValueError("InstabilityWatch state: 'qk_clip' must be a dict")
    out["clip_enabled"] = heads("qk_clip.enabled", clip.get("enabled", []))
    counts = clip.get("counts", [])
    try:
        out["clip_counts"] = (np.asarray(counts, dtype=np.int64).reshape(shape) if len(counts)
                              else np.zeros(shape, dtype=np.int64))
    except (TypeError, ValueError):
        raise ValueError(f"InstabilityWatch state: 'qk_clip.counts' must be {shape} integers") from None
    try:
        out["delta_cum"] = np.asarray(need("delta_cum"), dtype=np.float64).reshape(shape)
    except (TypeError, ValueError):
        raise ValueError(f"InstabilityWatch state: 'delta_cum' must be {shape} numbers (or None)") from None
    detectors = need("detectors")
    if not isinstance(detectors, dict):
        raise ValueError("InstabilityWatch state: 'detectors' must be a dict")
    for kind in watch.detectors:  # load into copies first: nothing changes if one fails
        if kind in detectors:
            probe = build_detectors(watch.config, shape)[kind]
            try:
                probe.load_state_dict(detectors[kind])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"InstabilityWatch state: 'detectors'[{kind!r}]: {exc}") from None
    out["detectors"] = detectors
    spectral = need("spectral")
    try:
        SpectralNorms().load_state_dict(spectral)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"InstabilityWatch state: 'spectral': {exc}") from None
    out["spectral"] = spectral
    out["pending_steps"] = [integer("pending_steps", s) for s in need("pending_steps")]
    pending = need("pending")
    width = watch.ring.columns.width
    try:
        t = torch.tensor(pending, dtype=torch.float64) if pending else torch.zeros(0, width, dtype=torch.float64)
    except (TypeError, ValueError):
        raise ValueError("InstabilityWatch state: 'pending' must be rows of numbers") from None
    if t.shape != (len(out["pending_steps"]), width):
        raise ValueError(f"InstabilityWatch state: 'pending' has shape {tuple(t.shape)}, expected "
                         f"({len(out['pending_steps'])}, {width})")
    out["pending"] = t
    calls = state.get("calls", [dict.fromkeys(CALL_FIELDS, 0) for _ in watch.head_counts])
    if not (isinstance(calls, list) and len(calls) == len(watch.head_counts)
            and all(isinstance(c, dict) for c in calls)):
        raise ValueError("InstabilityWatch state: 'calls' must hold one dict per layer")
    out["calls"] = [{k: int(c.get(k, 0)) for k in CALL_FIELDS} for c in calls]
    out["coverage_checked"] = bool(state.get("coverage_checked", True))
    try:
        out["alerts"] = [Alert(**a) for a in need("alerts")]
        out["events"] = [Event(**{**e, "to": e.get("to", out["switch_to"])}) for e in need("events")]
    except TypeError as exc:
        raise ValueError(f"InstabilityWatch state: 'alerts'/'events' entries do not fit ({exc})") from None
    return out


def restore(watch, parsed: dict) -> None:
    """Apply a :func:`parse`'d state to ``watch`` (nothing here raises)."""
    watch.step_count = parsed["step"]
    watch.switchboard.restore(parsed["switched"])
    if parsed["switched"] and parsed["switch_to"] != watch.config.switch_to:
        log_rank_zero(logging.WARNING, "instability_watch: the state's %d switched heads were switched to %s; this "
                      "watch's WatchConfig.switch_to is %r, so from now on they run that way",
                      len(parsed["switched"]), parsed["switch_to"], watch.config.switch_to)
    watch.builder.delta_cum = parsed["delta_cum"]  # None (not measured yet) read as NaN
    for kind, d in watch.detectors.items():
        if kind in parsed["detectors"]:
            d.load_state_dict(parsed["detectors"][kind])
    watch.spectral.load_state_dict(parsed["spectral"])
    watch.ring.load(parsed["pending_steps"], parsed["flushed_through"], parsed["pending"],
                    watch.observation.bank.device)
    watch.calls.per_layer = parsed["calls"]
    watch.coverage_checked = parsed["coverage_checked"]
    # the lists are the watch's own (the switchboard and the clipper append to them): replaced in place
    watch.alerts[:] = parsed["alerts"]
    watch.events[:] = parsed["events"]
    watch.events_read = len(watch.events)  # restored events are not new to the listeners
    watch.clipper.restore(parsed["clip_enabled"], parsed["clip_counts"])


__all__: List[str] = ["STATE_VERSION", "parse", "restore", "save"]
