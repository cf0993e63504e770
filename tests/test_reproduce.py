"""benchmarks/reproduce.py on CPU, tiny: resume across commands, arms, the summary, the explosion rule."""
from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pandas as pd
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block", "32", "--batch", "2", "--warmup", "5",
        "--watch-warmup", "10", "--corpus-bytes", "50000", "--lr", "1e-2", "--log-every", "5"]


@pytest.fixture(scope="module")
def repro():
    # `python benchmarks/reproduce.py` runs with benchmarks/ first on sys.path (it imports _common from there)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        return importlib.import_module("reproduce")


def test_resumed_run_equals_an_uninterrupted_one(repro, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert repro.main(["train", "--out", str(a), *TINY, "--steps", "20"]) == 0
    assert json.loads((a / "status.json").read_text())["step"] == 20
    assert repro.main(["train", "--out", str(a), *TINY, "--steps", "40"]) == 0  # resumes at 20
    assert repro.main(["train", "--out", str(b), *TINY, "--steps", "40"]) == 0
    ta, tb = (pd.read_csv(d / "train.csv") for d in (a, b))
    assert ta["step"].tolist() == list(range(1, 41))
    pd.testing.assert_frame_equal(ta, tb)
    ma, mb = (pd.read_csv(d / "run" / "metrics.csv").sort_values(["step", "layer", "head"]).reset_index(drop=True)
              for d in (a, b))
    pd.testing.assert_frame_equal(ma, mb)
    # Another configuration in the same directory is refused, naming what differs.
    with pytest.raises(SystemExit, match="lr"):
        repro.main(["train", "--out", str(a), *TINY[:-4], "--lr", "2e-2", "--log-every", "5", "--steps", "50"])


def test_launch_runs_the_arms_and_summarizes(repro, tmp_path, capsys):
    runs = "standard:observe,control:observe,stabilized:observe,standard:off"
    assert repro.main(["launch", "--root", str(tmp_path), "--runs", runs, *TINY, "--steps", "15"]) == 0
    rows = {r["run"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    assert set(rows) == {"standard-observe", "control-observe", "stabilized-observe", "standard-off"}
    assert all(r["steps"] == 15 and "error" not in r for r in rows.values())
    # The watch does not change training: the unwatched run has the same losses.
    same = [pd.read_csv(tmp_path / n / "train.csv")["loss"] for n in ("standard-observe", "standard-off")]
    pd.testing.assert_series_equal(*same)
    # The stabilized arm starts with every head switched; the control arm runs on our kernel.
    ev = pd.read_csv(tmp_path / "stabilized-observe" / "run" / "events.csv")
    assert (ev[ev["event"] == "switch"]["step"] == 0).sum() == 4
    for name, on_ours in (("standard-observe", False), ("control-observe", True), ("stabilized-observe", True)):
        coverage = json.loads((tmp_path / name / "run" / "meta.json").read_text())["coverage"]
        assert all((c["kernel_calls"] > 0) == on_ours and c["unobserved_calls"] == {} for c in coverage), name
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_explosion_rule(repro):
    calm = [(s, 3.0 - 0.001 * s) for s in range(1, 200)]
    assert repro.explosion_step(calm) is None
    jump = calm + [(s, 6.0) for s in range(200, 260)]
    step = repro.explosion_step(jump, ema=0.05, jump=1.0)
    assert 200 < step < 215  # the EMA needs a few steps to rise by one nat
    # Steps up to `start` set no minimum: an early spike is no explosion.
    spike = [(1, 5.0), (2, 6.5)] + [(s, 4.0) for s in range(3, 50)]
    assert repro.explosion_step(spike, jump=0.05) == 2 and repro.explosion_step(spike, jump=0.05, start=10) is None
    assert repro.explosion_step(calm[:50] + [(50, math.nan)]) == 50
    with pytest.raises(ValueError, match="arm must be one of"):
        repro.RunConfig(arm="fp32")


def test_resume_after_a_stop_between_log_steps(repro, tmp_path):
    """A run stopped at a step that is not a multiple of --log-every resumes without gaps or stale rows."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert repro.main(["train", "--out", str(a), *TINY, "--steps", "12"]) == 0  # log every 5: 5, 10, 12
    assert repro.main(["train", "--out", str(a), *TINY, "--steps", "20"]) == 0
    assert repro.main(["train", "--out", str(b), *TINY, "--steps", "20"]) == 0
    ta, tb = (pd.read_csv(d / "train.csv") for d in (a, b))
    assert ta["step"].tolist() == list(range(1, 21))
    pd.testing.assert_frame_equal(ta, tb)
