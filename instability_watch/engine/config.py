"""``WatchConfig``: every knob of the watch, validated when it is built."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import List, Optional, Tuple

from instability_watch.detect.kinds import (  # STABILIZABLE: the kinds the stabilized kernel addresses
    KINDS,
    STABILIZABLE,
)
from instability_watch.errors import checking_keywords
from instability_watch.kernels.common import DEFAULT_BETA, DEFAULT_EPS, FLOAT32_MAX, MAX_BETA

SWITCH_TO = ("stabilized", "exact_delta")
"""What a switch can do (``WatchConfig.switch_to``)."""


@dataclass(frozen=True)
class WatchConfig:
    """Configuration of :class:`~instability_watch.InstabilityWatch`.

    Cadence (in optimizer steps; steps count from 1):
        probe_every: observe the attention calls on steps 1, 1 + n, ... (probe
            steps): a statistics pass over each call's inputs. Between probe
            steps the watch does nothing at all. The default keeps the watch
            under 1% of a GPT-2-small step on an H100 (benchmarks/RESULTS.md).
        shadow_every: also run the shadow pass (``delta_lp - delta_hp``) in the
            backward on steps 1, 1 + n, ...; a multiple of ``probe_every``
            (shadow steps are probe steps), or 0 for off. Default (None):
            ``probe_every``, every probe step; it stays None in the config, so
            ``dataclasses.replace(config, probe_every=20)`` moves it along
            (``shadow_period`` is the period in force).
        spectral_every: compute sigma(W_Q) per head on steps 1, 1 + n, ... (0 off).
        log_every: read the device statistics back (one host sync) and run the
            detectors every this many steps (and once after the first probe step,
            to check what is observed). The observed steps in between stay on the
            device (at most 256; more read back early), so none is lost.

    Detectors (see :mod:`instability_watch.detect.detectors`):
        detectors: which rules run, a subset of ``KINDS``.
        warmup_steps: steps whose metrics form the baselines; no
            baseline-relative alert fires before it ends.
        sustain: consecutive observations over threshold before an alert (K).
        multi_max_factor, multi_max_min_rise: multi-max frequency threshold is
            ``max(factor * baseline, baseline + min_rise)`` (``min_rise`` is a
            fraction of rows, 0.01 = 1%).
        delta_cusum_k, delta_cusum_h: allowance and decision level of the sign
            CUSUM on ``sum(delta_lp - delta_hp)``; ``h = 13`` needs about 26
            one-signed shadow steps and false-alarms about once in 10^7 per head.
        spectral_rel_factor: alert when a head's sigma(W_Q) growth since warm-up
            exceeds this multiple of the median head's growth.
        spectral_abs_factor: also alert when growth alone exceeds this (``None`` off).
        logit_factor, logit_min: max-logit threshold ``max(logit_min, factor * baseline)``.

    Action:
        auto_switch: move a head to the stabilized kernel when an alert of a
            kind in ``switch_on`` trips (sticky; recorded as an event).
        switch_on: the kinds that switch, a subset of ``("multi_max",
            "delta_drift", "spectral_growth")`` (what the stabilized kernel fixes).
        switch_to: what a switch does. ``"stabilized"`` (the default): the head
            runs the stabilized kernel (the paper's fix), its layer's other heads
            our standard kernel. ``"exact_delta"``: the head's layer runs our
            standard kernel with the backward's ``delta`` from a float32 ``O``
            (the paper's control; about one attention forward more per backward
            of that layer). At the paper's scale the exact ``delta`` in every
            layer prevented the failure and the stabilized kernel did not, and
            switching alerted layers to it prevented it in place where the same
            run unswitched exploded (benchmarks/RESULTS.md, issue 41's arms 2, 4,
            5 and 6; one run each).
        beta, eps: the stabilized kernel's shift factor and tie tolerance.
        qk_clip: ``None`` (off), ``"on_alert"`` or ``"always"``: after the optimizer
            step of each probe step, rescale ``W_q``/``W_k`` of the heads whose
            largest logit (measured in that step's forward) exceeds
            ``qk_clip_tau``, so it comes back to ``qk_clip_tau``
            (:mod:`~instability_watch.act.qkclip`). ``"on_alert"`` acts on the heads
            that raised ``logit_growth`` (from that read-back on; sticky),
            ``"always"`` on every head. Each clip is an event.
        qk_clip_tau: the logit cap (Kimi K2 uses 100).

    Robustness:
        strict: re-raise failures inside the watch instead of turning the
            failing part off.
        sync_distributed: under ``torch.distributed``, reduce the statistics
            across ranks before the detectors run, so every rank decides the same.
    """

    # every 50 steps: inside Lightning a probe step (with its shadow and sigma) costs ~9 ms on a
    # GPT-2-small step of ~38 ms on an H100, and a read-back ~10 ms; every 20 steps that was
    # +1.1..+2.6% of the run, over the 1% bar (benchmarks/RESULTS.md, 2026-11-24)
    probe_every: int = 50
    shadow_every: Optional[int] = None  # None: probe_every (set probe_every alone and every probe step is shadowed)
    spectral_every: int = 50
    log_every: int = 200
    detectors: Tuple[str, ...] = KINDS
    warmup_steps: int = 500  # 10 probe steps at the default cadence form the baselines
    sustain: int = 5
    multi_max_factor: float = 3.0
    multi_max_min_rise: float = 0.01
    delta_cusum_k: float = 0.5
    delta_cusum_h: float = 13.0
    spectral_rel_factor: float = 3.0
    spectral_abs_factor: Optional[float] = None
    logit_factor: float = 50.0
    logit_min: float = 500.0
    auto_switch: bool = False
    switch_on: Tuple[str, ...] = STABILIZABLE
    switch_to: str = "stabilized"
    beta: float = DEFAULT_BETA
    eps: float = DEFAULT_EPS
    qk_clip: Optional[str] = None
    qk_clip_tau: float = 100.0
    strict: bool = False
    sync_distributed: bool = True

    def __post_init__(self) -> None:
        def integer(name: str, low: int) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):  # the wrong kind of value: TypeError, as flag()'s
                raise TypeError(f"WatchConfig.{name} must be an int >= {low}, got {v!r}")
            if v < low:
                raise ValueError(f"WatchConfig.{name} must be an int >= {low}, got {v!r}")

        def number(name: str, low: float, inclusive: bool = True, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            rel = ">=" if inclusive else ">"
            extra = " or None" if optional else ""
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise TypeError(f"WatchConfig.{name} must be a finite number {rel} {low}{extra}, got {v!r}")
            if not (math.isfinite(v) and (v >= low if inclusive else v > low)):
                raise ValueError(f"WatchConfig.{name} must be a finite number {rel} {low}{extra}, got {v!r}")

        def flag(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"WatchConfig.{name} must be a bool, got {getattr(self, name)!r}")

        def kinds(name: str, allowed: Tuple[str, ...]) -> None:
            v = getattr(self, name)
            if isinstance(v, str) or not isinstance(v, (tuple, list)):
                raise TypeError(f"WatchConfig.{name} must be a tuple of names from {allowed}, got {v!r}")
            bad = [k for k in v if k not in allowed]
            if bad:
                raise ValueError(f"WatchConfig.{name} must name kinds from {allowed}, got unknown {bad}")
            object.__setattr__(self, name, tuple(dict.fromkeys(v)))  # frozen: normalised once, here

        integer("log_every", 1)
        integer("probe_every", 1)
        if self.shadow_every is not None:  # None stays None: it follows probe_every, through replace() too
            integer("shadow_every", 0)
        integer("spectral_every", 0)
        integer("warmup_steps", 0)
        integer("sustain", 1)
        number("multi_max_factor", 1.0)
        number("multi_max_min_rise", 0.0)
        number("delta_cusum_k", 0.0)
        number("delta_cusum_h", 0.0, inclusive=False)
        number("spectral_rel_factor", 1.0, inclusive=False)
        number("spectral_abs_factor", 1.0, inclusive=False, optional=True)
        number("logit_factor", 1.0)
        number("logit_min", 0.0)
        number("beta", 1.0, inclusive=False)
        number("eps", 0.0)
        number("qk_clip_tau", 0.0, inclusive=False)
        from instability_watch.act.qkclip import MODES

        if self.switch_to not in SWITCH_TO:
            raise ValueError(f"WatchConfig.switch_to must be {' or '.join(map(repr, SWITCH_TO))}, "
                             f"got {self.switch_to!r}")
        if self.qk_clip is not None and self.qk_clip not in MODES:
            raise ValueError(f"WatchConfig.qk_clip must be None (off), {' or '.join(map(repr, MODES))}, "
                             f"got {self.qk_clip!r}")

        if self.beta > MAX_BETA:
            raise ValueError(f"WatchConfig.beta must be in (1, {MAX_BETA:g}] (the paper uses 2 to 8; the kernels cap "
                             f"the shift, so a larger beta changes nothing), got {self.beta!r}")
        if self.eps > FLOAT32_MAX:
            raise ValueError(f"WatchConfig.eps must be at most {FLOAT32_MAX:.4g} (the largest float32), got {self.eps!r}")
        for name in ("auto_switch", "strict", "sync_distributed"):
            flag(name)
        kinds("detectors", KINDS)
        kinds("switch_on", STABILIZABLE)
        if self.qk_clip == "on_alert" and "logit_growth" not in self.detectors:
            raise ValueError("WatchConfig.qk_clip='on_alert' acts on logit_growth alerts, but 'logit_growth' is not "
                             f"in detectors {tuple(self.detectors)}: add it, or use qk_clip='always'")
        if self.shadow_period % self.probe_every:
            raise ValueError(
                f"WatchConfig.shadow_every must be 0 or a multiple of probe_every ({self.probe_every}): shadow "
                f"steps are probe steps; got {self.shadow_every!r}"
            )
        if self.delta_cusum_k >= 1.0:
            raise ValueError(
                f"WatchConfig.delta_cusum_k must be < 1 (a sign step is +-1, so k >= 1 never accumulates), "
                f"got {self.delta_cusum_k!r}"
            )

    @property
    def shadow_period(self) -> int:
        """The shadow pass's period in steps: ``shadow_every``, or ``probe_every`` where that is None."""
        return self.probe_every if self.shadow_every is None else self.shadow_every

    def to_dict(self) -> dict:
        """The fields as a plain ``dict`` (tuples as lists: JSON-ready, as in ``meta.json``; ``shadow_every`` as
        the period in force)."""
        d = asdict(self)
        d["shadow_every"] = self.shadow_period
        for f in fields(self):
            if isinstance(d[f.name], tuple):
                d[f.name] = list(d[f.name])
        return d


WatchConfig.__init__ = checking_keywords(WatchConfig.__init__)


def config_fields() -> List[str]:
    """``WatchConfig``'s field names (for the classes that take a ``config``: a field given to them directly is
    pointed to ``config=WatchConfig(...)``)."""
    return [f.name for f in fields(WatchConfig)]
