"""benchmarks/paper_scale_report.py on a tiny synthetic bundle (CPU, no GPU, no files outside tmp_path)."""
from __future__ import annotations

import importlib
import json
import tarfile
from pathlib import Path

import pytest

from helpers import REPO

BENCHMARKS = REPO / "benchmarks"
# the header of a real bundle's run/metrics.csv (issue 41's switch arm)
METRICS = ("step,layer,layer_name,head,loss,rows,multi_max_rows,multi_max_freq,masked_rows,max_score,nonfinite_rows,"
           "shadow_rows,delta_err_sum,delta_err_abs,delta_err_pos_frac,delta_cum,sigma_wq,stabilized")
EVENTS = "step,layer,layer_name,head,event,kind,value,threshold,action,message"
WARMUP, LAST = 20, 120
PROBES = list(range(1, LAST + 1, 10))  # 1, 11, ..., 111


def sigma(name: str, step: int) -> float:
    """sigma(W_Q) per head: L0H0 grows x4 (onset 61), L0H1 and L1H0 do not double, L1H1 doubles late (onset 101)."""
    if step <= WARMUP:
        return 0.7
    return {"L0H0": 1.0 if step <= 51 else 2.5 if step == 61 else 4.0,
            "L0H1": 1.0,
            "L1H0": 2.0 if step < 91 else 3.0,
            "L1H1": 0.5 if step < 101 else 1.5}[name]


def max_score(name: str, step: int) -> float:
    return {"L0H0": 50.0 if step == 71 else 10.0, "L1H1": 900.0 if step == 111 else 5.0}.get(name, 2.0)


@pytest.fixture(scope="module")
def report():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        return importlib.import_module("paper_scale_report")


def make_run(run: Path) -> None:
    (run / "run").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"arm": "standard", "watch": "switch", "warmup": WARMUP,
                                                 "batch": 4, "block": 8, "log_every": 10}))
    (run / "status.json").write_text(json.dumps({"step": LAST, "seconds": 50.0, "steps_per_s": 2.4,
                                                 "steps_per_s_warm": 2.5, "max_memory_gib": 1.5,
                                                 "tokens_per_step": 524288, "processes": 4, "device": "Test GPU"}))
    # loss 1.0 up to step 69, 5.0 from step 70: EMA 0.05 crosses min + 0.2 at step 71 and min + 1 at step 75
    losses = [1.0 if s < 70 else 5.0 for s in range(1, LAST + 1)]
    (run / "train.csv").write_text("step,loss,lr,grad_norm\n" + "".join(
        f"{s},{v},0.001,1.0\n" for s, v in enumerate(losses, 1)))
    rows = [METRICS]
    for s in PROBES:
        for layer in range(2):
            for h in range(2):
                n = f"L{layer}H{h}"
                rows.append(f"{s},{layer},h.{layer}.attn,{h},{losses[s - 1]},64,1,0.015625,0,{max_score(n, s)},0,64,"
                            f"1e-06,1e-05,0.6,{1e-6 * s},{sigma(n, s)},{int(n == 'L0H0' and s > 60)}")
    (run / "run" / "metrics.csv").write_text("\n".join(rows) + "\n")
    (run / "run" / "events.csv").write_text("\n".join([
        EVENTS,
        "51,0,h.0.attn,0,alert,delta_drift,13.5,13,switched to the stabilized kernel,drift",
        "51,0,h.0.attn,0,switch,delta_drift,,,,moved",
        "41,0,h.0.attn,1,alert,multi_max,0.05,0.03,switched to the stabilized kernel,ties",
        "41,0,h.0.attn,1,switch,multi_max,,,,moved",
        "111,1,h.1.attn,1,alert,spectral_growth,3.0,2.5,switched to the stabilized kernel,grew",
        "111,1,h.1.attn,1,switch,spectral_growth,,,,moved"]) + "\n")
    (run / "run" / "meta.json").write_text(json.dumps({"format": 1, "layers": ["h.0.attn", "h.1.attn"],
                                                       "heads": [2, 2]}))


# cumulative steps/s as reproduce.py prints it: elapsed 10, 16, 20, 40 | 44.44, 50 s at steps 20 ... 120
LOG = """[tiny-switch] new run: {...}
[tiny-switch] step 20 loss 1.0 lr 1e-3 gnorm 1.0 2.00 steps/s
[tiny-switch] step 40 loss 1.0 lr 1e-3 gnorm 1.0 2.50 steps/s
[tiny-switch] step 60 loss 1.0 lr 1e-3 gnorm 1.0 3.00 steps/s
[tiny-switch] step 80 loss 5.0 lr 1e-3 gnorm 1.0 2.00 steps/s
[rank0]:W1127 torch/_dynamo/convert_frame.py:1743] [0/8] torch._dynamo hit config.recompile_limit (8)
[tiny-switch] step 100 loss 5.0 lr 1e-3 gnorm 1.0 2.25 steps/s
[tiny-switch] step 120 loss 5.0 lr 1e-3 gnorm 1.0 2.40 steps/s
"""


@pytest.fixture
def bundle(tmp_path) -> Path:
    root = tmp_path / "root"
    make_run(root / "tiny-switch")
    tar = tmp_path / "b" / "paper-tiny.tar.xz"
    tar.parent.mkdir()
    with tarfile.open(tar, "w:xz") as t:
        t.add(root / "tiny-switch", arcname="tiny-switch")
    (tar.parent / "train.log").write_text(LOG)
    return tar


def test_numbers_tables_and_figures(report, bundle, tmp_path, capsys):
    md, figs = tmp_path / "t.md", tmp_path / "figs"
    assert report.main([str(bundle), "--out", str(figs), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert text in capsys.readouterr().out
    row = next(ln for ln in text.splitlines() if ln.startswith("| tiny-switch"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # arm, device, steps, tokens, wall, steps/s, memory, final loss, explosion, divergence, peak, peak before
    assert cells[1:6] == ["4× Test GPU", "120", "0.06B", "50.0 s", "2.4 (2.5 warm)"]
    assert cells[7:10] == ["3.0400", "75", "71"]  # (49 x 1.0 + 51 x 5.0) / 100; the explosion rule recomputed
    assert cells[10:] == ["900 (L1H1, step 111)", "50 (L0H0, step 71)"]

    arm = report.analyse(report.load_arms([str(bundle)], tmp_path / "unpacked")[0])
    assert (arm.explosion, arm.divergence, arm.base_step, arm.last_step) == (75, 71, 21, 111)
    heads = arm.heads
    assert heads.loc["L0H0", "growth"] == pytest.approx(4.0) and heads.loc["L0H0", "onset"] == 61
    assert heads.loc["L1H1", "growth"] == pytest.approx(3.0) and heads.loc["L1H1", "onset"] == 101
    assert heads.loc["L1H0", "growth"] == pytest.approx(1.5) and heads["onset"].isna()["L1H0"]
    assert list(arm.top[:2]) == ["L0H0", "L1H1"]
    fa = report.first_alerts(arm).set_index("name")
    assert fa.loc["L0H0", "lead"] == 10 and fa.loc["L1H1", "lead"] == -10 and fa["lead"].isna()["L0H1"]
    assert "| L0H0 | delta_drift | 51 | switched to the stabilized kernel | 61 | +10 | +24 |" in text
    assert "| L1H1 | spectral_growth | 111 | switched to the stabilized kernel | 101† | -10 | -36 |" in text
    assert "False alarms (alerts on heads that never grew): L0H1 (multi_max 41)." in text
    assert "Alerts on heads whose onset came only at or after the explosion: L1H1 (spectral_growth 111)." in text
    assert "| L0H0 | 1 | 4 | ×4.0 | ×4.0 (71) | 61 | 51 |" in text
    # on the stabilized kernel from the first probe after the read-back (the metrics' stabilized column)
    assert "L0H1 41 (multi_max, –), L0H0 51 (delta_drift, 61), L1H1 111 (spectral_growth, –)." in text

    # step times from train.log: medians 6 s before the recompile-limit warning, 5 s after; 60-80 is 14 s slow
    t = report.step_times(arm)
    assert t["limit_after"] == 80 and t["median"] == pytest.approx({"before": 6.0, "after": 5.0}, abs=1e-6)
    assert "Slow intervals: 60–80 20.0 s (+14.0 s)." in text
    assert "| L0H0 | 51 | 60 | 60–80 | 20.0 | +14.0 |" in text  # the switch read back at step 60

    for key in ("sigma_wq", "max_score", "multi_max_freq", "delta_cum", "loss"):
        png = figs / f"{key}.png"
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_switches_dated_at_their_deciding_read_back_are_reported_at_their_alerts(report, tmp_path):
    """Run directories written since 2026-11-28 date a switch at the read-back that decided it (every log_every =
    10 steps here), not at its alert: the report still names each switch by its alert's step and the read-back
    after which it took effect, as for the older runs."""
    run = tmp_path / "d" / "tiny-switch"
    make_run(run)
    events = run / "run" / "events.csv"
    text = events.read_text()
    for alert, decided in (("51", "60"), ("41", "50"), ("111", "120")):
        text = text.replace(f"{alert},", f"{decided},", 2).replace(f"{decided},", f"{alert},", 1)
    assert "60,0,h.0.attn,0,switch" in text and "51,0,h.0.attn,0,alert" in text
    events.write_text(text)
    (tmp_path / "d" / "train.log").write_text(LOG)
    md = tmp_path / "t.md"
    assert report.main([str(tmp_path / "d"), "--out", str(tmp_path / "figs"), "--markdown", str(md)]) == 0
    out = md.read_text()
    assert "L0H1 41 (multi_max, –), L0H0 51 (delta_drift, 61), L1H1 111 (spectral_growth, –)." in out
    assert "| L0H0 | 51 | 60 | 60–80 | 20.0 | +14.0 |" in out


@pytest.mark.parametrize("status", ["running", "none"])
def test_a_run_cut_off_is_marked_and_timed_from_what_it_left(report, tmp_path, status):
    """A run cut off before it stopped: its last status.json written while running ("stopped": null), or none at all
    (then wall time and steps/s from train.log's last progress line: 120 steps at 2.40 steps/s). A switch to the
    exact delta is named as such."""
    run = tmp_path / "d" / "tiny-switch"
    make_run(run)
    if status == "none":
        (run / "status.json").unlink()
    else:
        st = json.loads((run / "status.json").read_text())
        (run / "status.json").write_text(json.dumps({**st, "stopped": None}))
    events = run / "run" / "events.csv"
    events.write_text(events.read_text().replace("switched to the stabilized kernel", "switched to the exact delta"))
    (tmp_path / "d" / "train.log").write_text(LOG)
    md = tmp_path / "t.md"
    assert report.main([str(tmp_path / "d"), "--out", str(tmp_path / "figs"), "--markdown", str(md)]) == 0
    text = md.read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| tiny-switch"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    if status == "none":
        assert cells[1:6] == ["? (cut off‡)", "120", "0.00B", "120 steps in 50.0 s‡", "2.4‡"]  # tokens: the config's
    else:
        assert cells[1:6] == ["4× Test GPU", "120", "0.06B", "50.0 s to step 120‡", "2.4 (2.5 warm)‡"]
    assert "‡ tiny-switch: cut off before it stopped" in text
    assert "Switched to the exact δ (the head's layer on our kernel, δ from a float32 O) (3;" in text


def test_errors_name_the_path(report, bundle, tmp_path):
    missing = tmp_path / "nowhere.tar.xz"
    with pytest.raises(SystemExit, match=str(missing)):
        report.main([str(missing), "--out", str(tmp_path / "f")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="holds no run folder"):
        report.main([str(empty), "--out", str(tmp_path / "f")])


def test_a_second_run_of_the_same_arm_is_kept_apart(report, bundle, tmp_path):
    # the bundle and its unpacked folder: two runs of one arm (a replicate), both reported, in the order given
    # (the second's train.log gives its lines as the runner wrote them: "[tiny-switch]", its folder's name)
    table = tmp_path / "t.md"
    (tmp_path / "root" / "train.log").write_text(LOG)
    report.main([str(bundle), str(tmp_path / "root"), "--out", str(tmp_path / "f"), "--markdown", str(table)])
    text = table.read_text()
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| tiny-switch")]
    assert rows[:2] == ["| tiny-switch", "| tiny-switch (2)"]
    assert text.count("Slow intervals: 60–80 20.0 s (+14.0 s).") == 2  # both runs' step times, from their logs
    arms = report.load_arms([str(bundle), str(tmp_path / "root")], tmp_path / "unpacked")
    assert [a.name for a in arms] == ["tiny-switch", "tiny-switch (2)"] and report.last_progress(arms[1]) == (
        120, 2.4)
