"""benchmarks/_common.py's StepTimes and step_cost: the watch's cost read step by step (the multi-GPU drivers'
and the Lightning measurement's arithmetic), on marks whose times the test sets."""
from __future__ import annotations

import pytest

from helpers import benchmark_module
from instability_watch import WatchConfig


@pytest.fixture(scope="module")
def common():
    return benchmark_module("_common")


def _fit(common, config, ms_of, skip=0, stop=30):
    """A StepTimes whose step s took ms_of(s) milliseconds (host-clock marks, set by hand)."""
    st = common.StepTimes(skip, stop, config)
    st.cuda = False
    t = 0.0
    for s in range(1, stop + 1):
        st.mark(s)
        if st.marks and st.marks[-1][0] == s:
            st.marks[-1] = (s, t)
        t += ms_of(s) / 1e3
    return st


def test_step_times_separate_probe_and_read_back_steps_from_the_others(common):
    cfg = WatchConfig(probe_every=10, shadow_every=10, spectral_every=10, log_every=20)
    # every step 10 ms; probe steps (1, 11, 21) 14 ms; the read-back step 20 takes 13 ms
    ms = lambda s: 14.0 if (s - 1) % 10 == 0 else (13.0 if s % 20 == 0 else 10.0)  # noqa: E731
    st = _fit(common, cfg, ms, skip=2)
    steps = dict(st.durations())
    assert sorted(steps) == list(range(3, 30))  # marks 3..30; the last mark ends step 29
    assert steps[11] == pytest.approx(14.0) and steps[20] == pytest.approx(13.0)
    w = st.summary(watched=True)
    assert w["other_ms"] == pytest.approx(10.0)
    assert w["other_steps"] == 27 - 3  # 11 and 21 probe steps, 20 read-back
    assert w["probe_extra_ms"] == pytest.approx(4.0)
    assert w["read_back_extra_ms"] == [pytest.approx(3.0)]
    assert w["share"] == pytest.approx((4 + 4 + 3) / sum(steps.values()))
    assert "share" not in st.summary(watched=False)


def test_step_cost_combines_rounds_into_the_estimate_and_its_range(common):
    rounds = [
        {"watched": 9.9, "unwatched": 10.0, "watched_steps": {"other_ms": 100.0, "share": 0.01},
         "unwatched_steps": {"other_ms": 101.0}},
        {"watched": 10.2, "unwatched": 10.0, "watched_steps": {"other_ms": 100.0, "share": 0.02},
         "unwatched_steps": {"other_ms": 99.0}},
        {"watched": 9.5, "unwatched": 10.0, "watched_steps": {"other_ms": 100.0, "share": 0.03},
         "unwatched_steps": {"other_ms": 100.0}},
    ]
    c = common.step_cost(rounds)
    assert c["fit_ratio"] == {"median": pytest.approx(0.99), "min": pytest.approx(0.95), "max": pytest.approx(1.02),
                              "n": 3}
    assert c["other_step_ratio"]["median"] == pytest.approx(1.0) and c["other_step_ratio"]["n"] == 3
    assert c["share"]["median"] == pytest.approx(0.02)
    assert c["estimate"] == pytest.approx(1.0 * (1 - 0.02))
    # a round without step times still counts in the whole-fit ratio, not in the estimate
    c = common.step_cost([{"watched": 1.0, "unwatched": 2.0}])
    assert c["fit_ratio"]["median"] == 0.5 and c["other_step_ratio"] is None and "estimate" not in c


def test_block_cost_compares_watched_and_unwatched_blocks_of_one_fit(common):
    cfg = WatchConfig(probe_every=10, shadow_every=10, spectral_every=10, log_every=20)
    size = 20
    # block 0 warm-up (slow, left out); watched blocks 1 and 3, unwatched 2 and 4. A drift: every block 1 ms
    # slower than the one before, so a watched block's other steps are 1 ms faster than the next unwatched one's.
    # In watched blocks the watch's probe steps (its steps 1 and 11) take +4 ms, its read-back (step 20) +3 ms.

    def ms(s):
        b, pos = (s - 1) // size, (s - 1) % size + 1
        base = 50.0 if b == 0 else 10.0 + b
        if b % 2 == 1:
            base += 4.0 if pos in (1, 11) else (3.0 if pos == 20 else 0.0)
        return base

    steps = [(s, ms(s)) for s in range(1, 5 * size + 1)]
    r = common.block_cost(steps, size, cfg)
    assert [p["watched_block"] for p in r["pairs"]] == [1, 3]
    first = r["pairs"][0]
    assert first["watched_other_ms"] == pytest.approx(11.0) and first["unwatched_other_ms"] == pytest.approx(12.0)
    assert first["other_ratio"] == pytest.approx(12.0 / 11.0)
    assert first["probe_extra_ms"] == pytest.approx(4.0)
    # positions 2..20 (19 steps) plus the attach step counted as a median step with a median probe
    total = 19 * 11.0 + 4.0 + 3.0 + (11.0 + 4.0)
    assert first["share"] == pytest.approx((4.0 + 3.0 + 4.0) / total)
    assert first["estimate"] == pytest.approx(12.0 / 11.0 * (1 - first["share"]))
    assert r["share"]["n"] == 2 and r["estimate"]["median"] == pytest.approx(
        (first["estimate"] + r["pairs"][1]["estimate"]) / 2)
