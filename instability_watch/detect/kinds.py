"""The alert kinds: one table of what each kind means and what to do about it.

Everything the package says about an alert kind comes from :data:`ALERT_KINDS`:
the detectors' messages (:mod:`~instability_watch.detect.detectors`), the console's
panels and head table (:mod:`~instability_watch.outputs.console`), the report's plot
marks (:mod:`~instability_watch.outputs.report`), which kinds ``WatchConfig.switch_on``
accepts (:data:`STABILIZABLE`) and the README's alert table
(:func:`alert_table_markdown`; ``python -m instability_watch.detect`` prints it).

Example::

    from instability_watch.detect.kinds import ALERT_KINDS
    k = ALERT_KINDS["multi_max"]
    print(k.title, "->", k.action)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class AlertKind:
    """What one kind of alert is (no tensors: plain text and flags).

    Attributes:
        kind: the name (``Alert.kind``, ``events.csv``'s ``kind`` column, ``WatchConfig.detectors``).
        title: what tripped, in a few words (the console panel's ``kind`` row).
        short: a word or two for the worst-heads table's state column.
        units: what ``Alert.value`` and ``Alert.threshold`` measure.
        trips_when: the rule with its default thresholds (Markdown, for the README).
        meaning: what the alert means for training (Markdown).
        action: what to do about it (Markdown).
        switching_helps: the stabilized kernel addresses it: ``WatchConfig.switch_on``
            may name this kind, and ``auto_switch`` switches the head on it.
        message: the detector's one-sentence message, a :meth:`str.format` template with the
            fields ``value`` and ``threshold`` (floats) and ``sustain`` (int).
        color: the matplotlib colour of the kind's alert marks in the report's plots.
    """

    kind: str
    title: str
    short: str
    units: str
    trips_when: str
    meaning: str
    action: str
    switching_helps: bool
    message: str
    color: str

    @staticmethod
    def plain(markdown: str) -> str:
        """``markdown`` (one of the Markdown fields) as plain text: code marks and emphasis dropped, a link as
        its text followed by its target in parentheses unless they are the same."""
        text = re.sub(r"\[([^\]]*)\]\(([^)]*)\)", lambda m: m[1] if m[1] == m[2] else f"{m[1]} ({m[2]})", markdown)
        return re.sub(r"[`*]", "", text)

    def describe(self, value: float, threshold: float, sustain: int = 0) -> str:
        """The detector's message for one trip: :attr:`message` filled in with ``value``, ``threshold``, ``sustain``."""
        return self.message.format(value=value, threshold=threshold, sustain=sustain)


_TABLE: Tuple[AlertKind, ...] = (
    AlertKind(
        kind="multi_max",
        title="repeated row maxima became frequent",
        short="multi-max",
        units="fraction of rows whose maximum repeats",
        trips_when="the head's multi-max frequency (rows whose maximum score repeats within `eps`) stays above "
                   "`max(3×, +1 point)` of its warm-up level for `sustain` steps",
        meaning="more rows where BF16 rounds several `P` up to 1 together — the paper's trigger",
        action="switch the head (`auto_switch=True` does); at the paper's scale, switching to the stabilized kernel "
               "(the default target) did not prevent the failure, and in one run `switch_to=\"exact_delta\"` "
               "did (benchmarks/RESULTS.md, arms 1, 4, 5 and 7)",
        switching_helps=True,
        message="{value:.2%} of rows have a repeated maximum score (threshold {threshold:.2%}, sustained {sustain} "
                "steps): BF16 rounds their P to 1 together and biases O",
        color="tab:pink",
    ),
    AlertKind(
        kind="delta_drift",
        title="delta error keeps one sign (biased backward)",
        short="δ-drift",
        units="sign CUSUM of sum(delta_lp - delta_hp)",
        trips_when="the per-shadow-step `Σ(δ_lp − δ_hp)` keeps one sign: a two-sided sign CUSUM exceeds `h` "
                   "(13 ≈ 26 one-signed shadow steps; about one false alarm in 10⁷ shadow steps per head)",
        meaning="the backward's `δ` is biased and the error adds up along one direction of `W_Q` (paper Fig. 5a)",
        action="switch the head with `switch_to=\"exact_delta\"`: at the paper's scale, in one run, that switch "
               "from these alerts on kept every head's σ(W_Q) close to the control run's (benchmarks/RESULTS.md, "
               "arm 5); the stabilized kernel did not (arms 1, 4, 7); keep checkpoints from before the alert",
        switching_helps=True,
        message="sum(delta_lp - delta_hp) keeps one sign over the shadow steps (sign CUSUM {value:.1f} > "
                "{threshold:.1f}): the backward's delta is biased, and the error adds up along one direction of W_Q",
        color="tab:red",
    ),
    AlertKind(
        kind="spectral_growth",
        title="sigma(W_Q) grows faster than the other heads",
        short="σ-growth",
        units="sigma(W_Q) growth since warm-up",
        trips_when="σ(W_Q[h]) / its warm-up value exceeds `3×` the median head's growth for `sustain` spectral "
                   "steps (or `spectral_abs_factor`, if set)",
        meaning="the head's query weights grow along a low-rank direction, the paper's precursor of the explosion",
        action="switch the head; look at its `delta_cum` and `multi_max_freq`",
        switching_helps=True,
        message="sigma(W_Q) grew {value:.2f}x since warm-up (threshold {threshold:.2f}x, sustained {sustain} "
                "spectral steps): the head's query weights are growing along one direction",
        color="tab:purple",
    ),
    AlertKind(
        kind="logit_growth",
        title="attention logits grew",
        short="logits",
        units="largest attention logit",
        trips_when="the head's max attention logit stays above `max(500, 50×` warm-up) for `sustain` steps",
        meaning="attention-logit growth (Wortsman et al. 2023): a *different* instability the stabilized kernel "
                "does not fix",
        action="`qk_clip=\"on_alert\"` clips the head from then on (see [docs/qk_clip.md](docs/qk_clip.md)); else "
               "lower the learning rate or add QK-norm; no switch",
        switching_helps=False,
        message="max attention logit {value:.4g} above {threshold:.4g} for {sustain} steps: attention-logit growth "
                "(consider QK-norm or a lower learning rate; the stabilized kernel does not address this)",
        color="tab:olive",
    ),
    AlertKind(
        kind="nonfinite",
        title="non-finite values",
        short="non-finite",
        units="count",
        trips_when="a NaN/Inf output row, logit or σ(W_Q)",
        meaning="the run is already broken at this head",
        action="restart from a checkpoint",
        switching_helps=False,
        message="{value:.0f} non-finite attention rows/values: the run is already numerically broken at this head",
        color="black",
    ),
)

ALERT_KINDS: Dict[str, AlertKind] = {k.kind: k for k in _TABLE}
"""Every alert kind, by name, in the order the README lists them."""

KINDS: Tuple[str, ...] = tuple(ALERT_KINDS)
"""The alert kinds' names (``WatchConfig.detectors`` takes a subset)."""

STABILIZABLE: Tuple[str, ...] = tuple(k.kind for k in _TABLE if k.switching_helps)
"""The kinds the stabilized kernel addresses (``WatchConfig.switch_on`` takes a subset)."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def alert_table_markdown() -> str:
    """The README's alert table: one Markdown row per kind (kind, trips when, meaning, what to do, whether the
    stabilized kernel targets it)."""
    lines = ["| kind | trips when | what it means | what to do | the switch targets it |", "|---|---|---|---|---|"]
    for k in _TABLE:
        cells = (f"`{k.kind}`", k.trips_when, k.meaning, k.action, "yes" if k.switching_helps else "no")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)
