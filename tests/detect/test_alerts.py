"""The table of alert kinds: complete, used by the detectors, and the README's alert table is its rendering."""
import re
import subprocess
import sys

import numpy as np
import pytest

from instability_watch import WatchConfig
from instability_watch.detect import detectors as det_mod
from instability_watch.detect.kinds import ALERT_KINDS, KINDS, STABILIZABLE, AlertKind, alert_table_markdown
from instability_watch.engine.config import STABILIZABLE as CONFIG_STABILIZABLE

from helpers import REPO

ROOT = REPO
BEGIN, END = "<!-- alert-kinds:begin -->", "<!-- alert-kinds:end -->"


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_kind_the_detectors_emit_is_in_the_table():
    built = det_mod.build_detectors(WatchConfig(), (2, 3))
    assert set(built) == set(KINDS) == set(ALERT_KINDS)
    emitting = {c.kind for c in _subclasses(det_mod.Detector) if c.kind}
    assert emitting == set(ALERT_KINDS)
    for kind, d in built.items():
        assert d.kind == kind and isinstance(ALERT_KINDS[kind], AlertKind)
    assert STABILIZABLE == CONFIG_STABILIZABLE == ("multi_max", "delta_drift", "spectral_growth")
    assert WatchConfig().detectors == KINDS


def test_every_field_is_filled_and_the_flags_match_the_actions():
    for kind, k in ALERT_KINDS.items():
        assert k.kind == kind
        for name in ("title", "short", "units", "trips_when", "meaning", "action", "message", "color"):
            assert getattr(k, name).strip(), (kind, name)
        # "switch the head" is advised exactly where switching helps
        assert ("switch the head" in k.action) == k.switching_helps, kind


def test_detector_messages_come_from_the_table():
    """A trip's message, as users see it (panels, events.csv), for each kind."""
    shape = (1, 4)
    cfg = WatchConfig(warmup_steps=2, sustain=2)
    d = det_mod.build_detectors(cfg, shape)
    trips = []
    for step in (1, 2):
        d["multi_max"].update(step, np.full(shape, 0.01))
        d["logit_growth"].update(step, np.full(shape, 10.0))
    for step in (3, 4):
        trips += d["multi_max"].update(step, np.array([[0.01, 0.2, 0.01, 0.01]]))
        trips += d["logit_growth"].update(step, np.array([[10.0, 10.0, 900.0, 10.0]]))
    trips += d["nonfinite"].update(5, np.array([[0.0, 0.0, 0.0, 3.0]]))
    got = {t[:2]: t[4] for t in trips}
    assert got[(0, 1)] == ("20.00% of rows have a repeated maximum score (threshold 3.00%, sustained 2 steps): "
                           "BF16 rounds their P to 1 together and biases O")
    assert got[(0, 2)] == ("max attention logit 900 above 500 for 2 steps: attention-logit growth (consider QK-norm "
                           "or a lower learning rate; the stabilized kernel does not address this)")
    assert got[(0, 3)] == "3 non-finite attention rows/values: the run is already numerically broken at this head"
    assert ALERT_KINDS["delta_drift"].describe(13.5, 13.0) == (
        "sum(delta_lp - delta_hp) keeps one sign over the shadow steps (sign CUSUM 13.5 > 13.0): the backward's "
        "delta is biased, and the error adds up along one direction of W_Q")
    assert ALERT_KINDS["spectral_growth"].describe(4.0, 3.25, 5) == (
        "sigma(W_Q) grew 4.00x since warm-up (threshold 3.25x, sustained 5 spectral steps): the head's query "
        "weights are growing along one direction")


def test_markdown_table_has_a_row_per_kind_and_plain_text_drops_the_markup():
    lines = alert_table_markdown().splitlines()
    assert lines[0].startswith("| kind | trips when |") and set(lines[1]) <= set("|-")
    assert [re.match(r"\| `(\w+)` \|", line)[1] for line in lines[2:]] == list(KINDS)
    assert all(line.count(" | ") == 4 for line in lines[2:])  # five cells: no stray pipe
    assert lines[5].endswith("| no |") and lines[2].endswith("| yes |")
    assert AlertKind.plain("`qk_clip` (see [docs/x.md](docs/x.md)), *a* [b](c)") == "qk_clip (see docs/x.md), a b (c)"


def test_module_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "instability_watch.detect"], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == alert_table_markdown()
    assert out.stderr == ""


def test_readme_alert_table_is_the_rendered_table():
    """README.md holds ``alert_table_markdown()`` between the alert-kinds markers (regenerate it with
    ``python -m instability_watch.detect``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    if BEGIN not in readme or END not in readme:
        pytest.fail(f"README.md lacks the markers {BEGIN} and {END} around its alert table")
    between = readme.split(BEGIN, 1)[1].split(END, 1)[0]
    assert between.strip() == alert_table_markdown().strip()
