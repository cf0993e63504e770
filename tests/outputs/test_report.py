"""`instability-watch report`: the per-head summary, the plots and the CLI around them."""
import io
import json
import math
import re
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from instability_watch import WatchConfig, cli
from instability_watch.detect.detectors import KINDS
from instability_watch.detect.kinds import ALERT_KINDS
from instability_watch.outputs import report, rundir
from instability_watch.outputs.rundir import EVENT_COLUMNS, METRIC_COLUMNS, load_run

from helpers import REPO
from watch_models import write_tied_run

ROOT = REPO
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOT_FILES = ("sigma_wq.png", "multi_max.png", "delta_cum.png", "max_score.png", "loss.png")


# --------------------------------------------------------------------------- run directories


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A real 30-step run of TiedAttention: heads 0 and 1 alert (delta_drift) and switch at step 27."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    cfg = WatchConfig(probe_every=1, log_every=5, shadow_every=1, spectral_every=5, warmup_steps=5, sustain=3, auto_switch=True)
    write_tied_run(run_dir, cfg, 30)
    return run_dir


@pytest.fixture
def run_copy(real_run, tmp_path) -> Path:
    """A copy of the real run that a test may modify."""
    return Path(shutil.copytree(real_run, tmp_path / "run"))


def _cell(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    return str(value)


def write_synthetic_run(run_dir: Path, rows, events=(), *, layers, heads, resumed_at=(), events_file=True) -> Path:
    """Write a run directory by hand: ``rows`` are dicts of metric values (missing ones are NaN)."""
    run_dir.mkdir(parents=True)
    meta = {"format": 1, "layers": list(layers), "heads": list(heads), "config": {},
            "created": "2026-01-01T00:00:00+00:00", "resumed_at": list(resumed_at)}
    (run_dir / "meta.json").write_text(json.dumps(meta))
    lines = [",".join(METRIC_COLUMNS)]
    for row in rows:
        lines.append(",".join(_cell(row.get(c, float("nan"))) for c in METRIC_COLUMNS))
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")
    if events_file:
        lines = [",".join(EVENT_COLUMNS)]
        for e in events:
            lines.append(",".join(_cell(e.get(c, "")) for c in EVENT_COLUMNS))
        (run_dir / "events.csv").write_text("\n".join(lines) + "\n")
    return run_dir


def two_layer_rows(steps=10):
    """Layer 'a' with 2 heads and layer 'b' with 3 heads; delta_cum of (l, h) grows like (l*3 + h) * step."""
    rows = []
    for step in range(1, steps + 1):
        for layer, (name, n_heads) in enumerate((("a", 2), ("b", 3))):
            for head in range(n_heads):
                rows.append({
                    "step": step, "layer": layer, "layer_name": name, "head": head, "loss": 10.0 / step,
                    "multi_max_freq": 0.01 * head, "max_score": 5.0 + layer,
                    "delta_cum": (layer * 3 + head) * step * (-1 if head == 1 else 1),
                    "sigma_wq": float("nan"),  # never observed
                })
    return rows


def alert(step, layer, name, head, kind):
    return {"step": step, "layer": layer, "layer_name": name, "head": head, "event": "alert", "kind": kind,
            "value": 1.0, "threshold": 0.5, "action": "reported", "message": "test alert"}


def render(run_dir, **kwargs) -> str:
    out = io.StringIO()
    assert report.main(run_dir, console=Console(file=out, width=200), **kwargs) == 0
    return out.getvalue()


# --------------------------------------------------------------------------- head_summary


def test_head_summary_alerts_and_switches_on_a_real_run(real_run):
    summary = report.head_summary(load_run(real_run))
    assert list(summary.columns) == list(report.SUMMARY_COLUMNS)
    assert len(summary) == 4 and set(summary["head"]) == {0, 1, 2, 3}
    by_head = summary.set_index("head")
    for head in (0, 1):
        assert by_head.loc[head, "first_delta_drift"] == 27
        assert by_head.loc[head, "switched_at"] == 30  # decided at the read-back of step 30
        assert by_head.loc[head, "alerts"] == 1
    for head in (2, 3):
        assert by_head.loc[head, "first_delta_drift"] is pd.NA
        assert by_head.loc[head, "switched_at"] is pd.NA
        assert by_head.loc[head, "alerts"] == 0
    for kind in KINDS:
        assert str(summary[f"first_{kind}"].dtype) == "Int64"
        if kind != "delta_drift":
            assert summary[f"first_{kind}"].isna().all(), kind
    assert str(summary["switched_at"].dtype) == "Int64"
    # the alerted heads come first, then by |final_delta_cum|
    assert set(summary["head"].iloc[:2]) == {0, 1}
    rest = summary.iloc[2:]
    assert list(rest["final_delta_cum"].abs()) == sorted(rest["final_delta_cum"].abs(), reverse=True)


def test_head_summary_numbers_match_the_metrics(real_run):
    run = load_run(real_run)
    summary = report.head_summary(run).set_index("head")
    for head, m in run.metrics.sort_values("step").groupby("head"):
        row = summary.loc[head]
        assert row["peak_multi_max_freq"] == m["multi_max_freq"].max()
        assert row["peak_max_score"] == m["max_score"].max()
        delta = m["delta_cum"].dropna()
        assert row["final_delta_cum"] == delta.iloc[-1]
        sigma = m["sigma_wq"].dropna()
        assert len(sigma) >= 2  # sigma is observed only every 5 steps: NaN elsewhere
        assert m["sigma_wq"].isna().any()
        assert row["sigma_first"] == sigma.iloc[0] and row["sigma_last"] == sigma.iloc[-1]
        assert row["sigma_growth"] == pytest.approx(sigma.iloc[-1] / sigma.iloc[0], rel=1e-12)
    # the tied heads see repeated maxima in every row, the free ones never
    assert summary.loc[0, "peak_multi_max_freq"] == 1.0 and summary.loc[2, "peak_multi_max_freq"] == 0.0


def test_head_summary_order_over_layers(tmp_path):
    events = [alert(7, 1, "b", 2, "multi_max"), alert(4, 0, "a", 1, "spectral_growth"),
              alert(9, 0, "a", 1, "multi_max"), alert(7, 1, "b", 0, "delta_drift")]
    run_dir = write_synthetic_run(tmp_path / "run", two_layer_rows(), events, layers=["a", "b"], heads=[2, 3])
    summary = report.head_summary(load_run(run_dir))
    order = list(zip(summary["layer_name"], summary["head"]))
    # (a,1) alerts first at 4; (b,0) and (b,2) at 7, tie broken by |delta|: b2 (5*10) before b0 (3*10);
    # then the quiet heads by |delta|: b1 (|-4*10|), a0 (0)
    assert order == [("a", 1), ("b", 2), ("b", 0), ("b", 1), ("a", 0)]
    a1 = summary.iloc[0]
    assert a1["first_spectral_growth"] == 4 and a1["first_multi_max"] == 9 and a1["alerts"] == 2
    assert a1["final_delta_cum"] == -10.0
    assert summary["sigma_first"].isna().all() and summary["sigma_growth"].isna().all()
    assert summary["switched_at"].isna().all()


def test_head_summary_takes_finite_first_and_last_values(tmp_path):
    """sigma first/last and the final delta skip NaN and inf; a peak keeps inf (the head blew up)."""
    nan, inf = float("nan"), float("inf")
    sigma = [nan, 1.5, 3.0, inf, nan]
    delta = [0.5, nan, 2.0, -inf, nan]
    score = [4.0, 6.0, inf, nan, 5.0]
    rows = [{"step": s + 1, "layer": 0, "layer_name": "x", "head": 0, "loss": 1.0, "sigma_wq": sigma[s],
             "delta_cum": delta[s], "max_score": score[s], "multi_max_freq": nan} for s in range(5)]
    run_dir = write_synthetic_run(tmp_path / "run", rows, layers=["x"], heads=[1])
    row = report.head_summary(load_run(run_dir)).iloc[0]
    assert row["sigma_first"] == 1.5 and row["sigma_last"] == 3.0 and row["sigma_growth"] == 2.0
    assert row["final_delta_cum"] == 2.0
    assert row["peak_max_score"] == inf
    assert math.isnan(row["peak_multi_max_freq"])


def test_head_summary_without_events_file(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run", two_layer_rows(3), layers=["a", "b"], heads=[2, 3],
                                  events_file=False)
    summary = report.head_summary(load_run(run_dir))
    assert len(summary) == 5 and (summary["alerts"] == 0).all()
    assert summary[[f"first_{k}" for k in KINDS]].isna().all().all()


# --------------------------------------------------------------------------- the printed summary


def test_summary_view_header_table_and_hidden_heads(real_run):
    text = render(real_run, top=3, plots=False)
    assert str(real_run) in text
    assert "steps 1..30 (30 recorded)" in text
    assert "alerts: 2 on 2 of 4 heads" in text and "stabilized kernel: 2 heads" in text
    assert "27 delta_drift" in text
    assert "1 more head not shown" in text
    table_rows = [line.split() for line in text.splitlines() if line.strip().startswith("tied")]
    assert len(table_rows) == 3  # top=3
    assert {r[1] for r in table_rows[:2]} == {"h0", "h1"}
    assert table_rows[0][2:4] == ["27", "delta_drift"] and table_rows[2][2] == "-"  # no alert: "-"
    assert "note:" not in text  # a clean run: the reader has nothing to say
    # below the table: what the kinds that alerted mean and what to do (from alerts.ALERT_KINDS), one line each
    advice = " ".join(text[text.index("what the alerts mean:"):].split())  # the last lines, maybe wrapped
    kind = ALERT_KINDS["delta_drift"]
    assert advice == " ".join(f"what the alerts mean: delta_drift: {kind.meaning}; {kind.action}".replace("`", "").split())
    assert advice.startswith("what the alerts mean: delta_drift: the backward's δ is biased")
    assert "multi_max:" not in text and "logit_growth:" not in text


def test_summary_view_missing_values_and_resumes(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run", two_layer_rows(4), layers=["a", "b"], heads=[2, 3],
                                  resumed_at=[2])
    text = render(run_dir, plots=False)
    assert "resumed at step 2" in text
    assert "loss 10 -> 2.5" in text
    assert "more head" not in text and "what the alerts mean" not in text  # no alert, no advice
    rows = [line.split() for line in text.splitlines() if line.strip()[:2] in ("a ", "b ")]
    assert len(rows) == 5
    assert all(r[-1] == "-" for r in rows)  # sigma(W_Q) never observed


# --------------------------------------------------------------------------- the CLI


def test_cli_report_writes_plots_and_prints_the_table(run_copy, capsys):
    assert cli.main(["report", str(run_copy)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    out = captured.out
    assert "tied" in out and "27 delta_drift" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("tied")]
    assert sorted(r[1] for r in rows) == ["h0", "h1", "h2", "h3"]
    report_dir = run_copy / "report"
    for name in PLOT_FILES:
        path = report_dir / name
        assert path.exists(), name
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert len(data) > 10_000, (name, len(data))
        assert str(path) in out
    assert sorted(p.name for p in report_dir.iterdir()) == sorted(PLOT_FILES)


def test_cli_report_out_dir_and_no_plots(run_copy, tmp_path, capsys):
    out_dir = tmp_path / "elsewhere" / "plots"
    assert cli.main(["report", str(run_copy), "--out", str(out_dir), "--top", "2"]) == 0
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(PLOT_FILES)
    assert not (run_copy / "report").exists()
    assert "2 more heads not shown" in capsys.readouterr().out

    assert cli.main(["report", str(run_copy), "--no-plots"]) == 0
    assert "27 delta_drift" in capsys.readouterr().out
    assert not (run_copy / "report").exists()
    assert not list(run_copy.rglob("*.png"))


def test_cli_report_on_a_trainers_log_directory_reports_the_watchs_run_inside(tmp_path, capsys):
    """A trainer's log directory (Lightning's version_N: its logger's own metrics.csv beside the watch's run in
    instability_watch/) is reported as the watch's run, and stderr says so."""
    log_dir = tmp_path / "lightning_logs" / "version_0"
    write_synthetic_run(log_dir / "instability_watch", two_layer_rows(4), layers=["a", "b"], heads=[2, 3])
    (log_dir / "metrics.csv").write_text("epoch,instability_watch/alerts,step\n0,0,9\n")  # Lightning's CSVLogger
    assert cli.main(["report", str(log_dir), "--no-plots"]) == 0
    captured = capsys.readouterr()
    assert f"reporting on the watch's run in {log_dir / 'instability_watch'}" in captured.err
    assert "steps 1..4 (4 recorded)" in captured.out and "of 5 heads" in captured.out
    assert cli.main(["report", str(log_dir / "instability_watch"), "--no-plots"]) == 0
    assert capsys.readouterr().err == ""
    # Lightning without a logger: ROOT/instability_watch/version_N; the report names them
    root = tmp_path / "root"
    for n in (0, 1):
        write_synthetic_run(root / "instability_watch" / f"version_{n}", two_layer_rows(2), layers=["a", "b"],
                            heads=[2, 3])
    assert cli.main(["report", str(root), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the watch's runs are in: " in err
    assert f"{root / 'instability_watch' / 'version_0'}, {root / 'instability_watch' / 'version_1'}" in err


def _bad_dirs(tmp_path):
    missing = tmp_path / "missing"
    a_file = tmp_path / "a_file"
    a_file.write_text("not a run\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    wrong_header = tmp_path / "wrong_header"
    wrong_header.mkdir()
    (wrong_header / "metrics.csv").write_text("step,layer,something_else\n1,0,2\n")
    empty_csv = tmp_path / "empty_csv"
    empty_csv.mkdir()
    (empty_csv / "metrics.csv").write_text("")
    meta_list = write_synthetic_run(tmp_path / "meta_list", two_layer_rows(2), layers=["a", "b"], heads=[2, 3])
    (meta_list / "meta.json").write_text("[1, 2]")
    return {"missing": (missing, missing), "file": (a_file, a_file), "empty": (empty, empty),
            "wrong_header": (wrong_header, wrong_header / "metrics.csv"),
            "empty_csv": (empty_csv, empty_csv / "metrics.csv"), "meta_list": (meta_list, meta_list / "meta.json")}


@pytest.mark.parametrize("case", ["missing", "file", "empty", "wrong_header", "empty_csv", "meta_list"])
def test_cli_report_bad_run_dir(case, tmp_path, capsys):
    run_dir, named = _bad_dirs(tmp_path)[case]
    assert cli.main(["report", str(run_dir)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("instability-watch report: error: ")
    assert str(named) in lines[0]
    assert "Traceback" not in captured.err
    assert not list(tmp_path.rglob("*.png"))


def test_cli_report_bad_run_dir_in_a_process(tmp_path):
    """Through the real entry point: status 2, one stderr line, no traceback."""
    missing = tmp_path / "nope"
    out = subprocess.run([sys.executable, "-m", "instability_watch.cli", "report", str(missing)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [f"instability-watch report: error: {missing}: no such directory"]


def test_cli_report_rejects_bad_top(real_run, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", str(real_run), "--top", "0"])
    assert exc.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


def test_report_of_a_killed_run(run_copy, capsys):
    """A killed process leaves a torn last line and an incomplete last step: both dropped, and said once."""
    metrics = run_copy / "metrics.csv"
    data = metrics.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    last = data[last_start:]
    assert last.startswith(b"30,0,tied,3,")
    metrics.write_bytes(data[: last_start + len(last) // 2])  # cut in the middle of the last line

    run = load_run(run_copy)
    assert len(run.metrics) == 29 * 4 and run.metrics["step"].max() == 29
    summary = report.head_summary(run).set_index("head")
    head3 = run.metrics[run.metrics["head"] == 3].sort_values("step")
    assert summary.loc[3, "final_delta_cum"] == head3["delta_cum"].iloc[-1]

    assert cli.main(["report", str(run_copy)]) == 0
    out = capsys.readouterr().out
    assert "27 delta_drift" in out and "steps 1..29 (29 recorded)" in out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert notes == ["note: metrics.csv: last line has no newline (a torn write), skipped",
                     "note: metrics.csv: last step 30 incomplete (3 of 4 heads), dropped"]
    assert all((run_copy / "report" / name).exists() for name in PLOT_FILES)


# --------------------------------------------------------------------------- plots


def test_plots_mark_events_and_label_the_most_extreme_heads(real_run):
    run = load_run(real_run)
    fig = report.metric_figure(run, None, "delta_cum", "t", "y", top=1)
    ax, ax_loss = fig.axes[:2]
    labels = ax.get_legend_handles_labels()[1]
    # the head with the largest |delta_cum| first, then the other head that alerted (and switched); both
    # alerted, and each label says so
    extreme = run.metrics.assign(a=run.metrics["delta_cum"].abs()).groupby("head")["a"].max()
    first = int(extreme.idxmax())
    assert first in (0, 1)
    assert labels == [f"tied h{first} (alert)", f"tied h{1 - first} (alert)", "alert: delta_drift",
                      "switch to stabilized"]
    # 2 coloured + 2 gray head lines + one alert line (step 27) and one switch line (step 30)
    lines = ax.get_lines()
    assert len(lines) == 6
    gray = [ln for ln in lines if ln.get_color() == report.GRAY]
    assert len(gray) == 2
    marks = [ln for ln in lines if ln.get_label() in ("alert: delta_drift", "switch to stabilized")]
    assert [ln.get_xdata()[0] for ln in marks] == [27, 30]  # the switch decided at the read-back of step 30
    assert [ln.get_linestyle() for ln in marks] == ["-", "--"]
    # the loss panel carries the same marks, and shares the x axis
    vertical = [ln.get_xdata() for ln in ax_loss.get_lines()]
    assert sorted(x[0] for x in vertical if len(x) == 2 and x[0] == x[1]) == [27, 30]
    assert ax.get_shared_x_axes().joined(ax, ax_loss)


def _extreme_run(tmp_path) -> Path:
    """Head (a,0) alerts first but is tame; (b,1) has the largest logit and sigma(W_Q); (a,1) the largest |delta|."""
    rows = []
    for step in range(1, 41):
        for layer, name in enumerate("ab"):
            for head in range(3):
                wild = (layer, head) == (1, 1)
                rows.append({"step": step, "layer": layer, "layer_name": name, "head": head, "loss": 5.0,
                             "multi_max_freq": 0.01 * head + (0.5 if (layer, head) == (1, 2) else 0.0),
                             "max_score": 5.0 + head + (step * 3.0 if wild else 0.0),
                             "delta_cum": (-0.5 if (layer, head) == (0, 1) else 0.01 * head) * step,
                             "sigma_wq": (1.0 + (0.2 * step if wild else 0.01 * head)) if step % 5 == 1 else
                             float("nan")})
    return write_synthetic_run(tmp_path / "run", rows, [alert(3, 0, "a", 0, "spectral_growth")],
                               layers=["a", "b"], heads=[3, 3])


def test_each_plot_colours_the_heads_most_extreme_in_its_metric(tmp_path):
    """Not the first heads to alert: the head with the highest logit and sigma(W_Q) is coloured and labelled."""
    run = report.digest_run(_extreme_run(tmp_path))
    expect = {"max_score": "b h1", "sigma_wq": "b h1", "delta_cum": "a h1", "multi_max_freq": "b h2"}
    for column, head in expect.items():
        fig = report.metric_figure(run, None, column, "t", "y", top=1)
        ax = fig.axes[0]
        heads = [ln for ln in ax.get_lines() if not ln.get_label().startswith(("alert:", "switch"))]
        coloured = [ln for ln in heads if ln.get_color() != report.GRAY]
        assert [ln.get_label() for ln in coloured] == [head, "a h0 (alert)"], column
        gray = [ln for ln in heads if ln.get_color() == report.GRAY]
        assert len(gray) == 6 - 2 and all(ln.get_label().startswith("_") for ln in gray), column
    assert [label for _, label in report.highlighted_heads(run, "max_score", 3)] == [
        "b h1", "a h2", "b h2", "a h0 (alert)"]  # ties by layer, head


def test_an_alerted_head_says_so_among_the_top_heads_and_the_alerted_heads_left_gray_are_counted(tmp_path):
    """The most extreme head alerted too: labelled "(alert)" there (it was not); alerted heads beyond the extra
    colours are counted in the legend (they were gray and unnamed)."""
    rows = []
    for step in range(1, 11):
        for layer in (0, 1):
            for head in range(3):
                rows.append({"step": step, "layer": layer, "layer_name": "ab"[layer], "head": head, "loss": 1.0,
                             "multi_max_freq": 0.0, "max_score": 5.0 + 3 * layer + head, "delta_cum": 0.0,
                             "sigma_wq": float("nan")})
    alerts = [alert(4, 1, "b", 2, "logit_growth"), alert(5, 0, "a", 0, "logit_growth"),
              alert(6, 0, "a", 1, "logit_growth"), alert(7, 1, "b", 0, "logit_growth")]
    run = report.digest_run(write_synthetic_run(tmp_path / "run", rows, alerts, layers=["a", "b"], heads=[3, 3]))
    # b h2 is the largest logit and the first alert: one entry, labelled; then one extra colour (top=1)
    assert [label for _, label in report.highlighted_heads(run, "max_score", 1)] == ["b h2 (alert)", "a h0 (alert)"]
    fig = report.metric_figure(run, None, "max_score", "t", "y", top=1)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "2 more heads alerted or switched (gray)" in labels and "b h2 (alert)" in labels


def test_plot_series_are_bucketed_keeping_peaks_and_last_values(tmp_path):
    """A run longer than the plot's points: one point per bucket, its peak (or, for delta_cum, its last value)."""
    rows = [{"step": s, "layer": 0, "layer_name": "x", "head": 0, "loss": 1.0, "multi_max_freq": 0.0,
             "max_score": 100.0 if s == 37 else float(s % 7), "delta_cum": float(s), "sigma_wq": float("nan")}
            for s in range(1, 101)]
    run_dir = write_synthetic_run(tmp_path / "run", rows, layers=["x"], heads=[1])
    d = report.digest_run(run_dir, points=10)
    x, y = d.series("max_score", 0)
    assert len(x) <= 10 and list(x) == sorted(x)
    assert 37 in list(x) and y[list(x).index(37)] == 100.0  # the spike survives
    x, y = d.series("delta_cum", 0)
    assert len(x) <= 10 and x[-1] == 100 and y[-1] == 100.0  # the running sum ends where the run ends
    assert list(y) == [float(s) for s in x]  # each point is a real (step, value)
    # the same whatever order the steps come in (the buckets widen both ways)
    frame = load_run(run_dir).metrics
    sink = report.Digester(10)
    sink.add(frame[frame["step"] > 50])
    sink.add(frame[frame["step"] <= 50])
    x2, y2 = sink.digest(run_dir, {}, load_run(run_dir).events, []).series("max_score", 0)
    assert 37 in list(x2) and max(y2) == 100.0 and len(x2) <= 10 and list(x2) == sorted(x2)


def test_plots_skip_unobserved_steps(real_run):
    run = load_run(real_run)
    fig = report.metric_figure(run, None, "sigma_wq", "t", "y", top=1)
    index, label = report.highlighted_heads(run, "sigma_wq", 1)[0]
    head = int(report.digest(run).heads["head"].iat[index])
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == label)
    observed = run.metrics[(run.metrics["head"] == head) & run.metrics["sigma_wq"].notna()]
    assert list(line.get_xdata()) == sorted(observed["step"])
    assert np.isfinite(line.get_ydata()).all()
    assert len(line.get_xdata()) < 30


def test_plots_of_a_metric_without_data(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run", two_layer_rows(5), layers=["a", "b"], heads=[2, 3])
    run = load_run(run_dir)
    fig = report.metric_figure(run, report.head_summary(run), "sigma_wq", "t", "y", top=3)
    notes = [t.get_text() for t in fig.axes[0].texts]
    assert any(n.startswith("no data") for n in notes)
    assert not fig.axes[0].get_lines()
    written = report.write_plots(run, tmp_path / "plots")
    assert [p.name for p in written] == list(PLOT_FILES)
    assert all(p.read_bytes().startswith(PNG_SIGNATURE) for p in written)


def test_without_matplotlib(run_copy, monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run = load_run(run_copy)
    with pytest.raises(ImportError, match=r'install matplotlib: pip install "instability_watch\[plots\]"'):
        report.write_plots(run, run_copy / "report")
    text = render(run_copy)
    assert "27 delta_drift" in text
    skipped = [line for line in text.splitlines() if "plots skipped" in line]
    assert len(skipped) == 1 and 'pip install "instability_watch[plots]"' in skipped[0]
    assert not (run_copy / "report").exists()


def test_plots_leave_pyplot_alone(real_run, tmp_path):
    """write_plots uses Figure + FigureCanvasAgg only: pyplot (and its global backend) is never loaded."""
    code = (
        "import sys\n"
        "from instability_watch.outputs import report\n"
        "from instability_watch.outputs.rundir import load_run\n"
        f"report.write_plots(load_run({str(real_run)!r}), {str(tmp_path / 'out')!r})\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert len(list((tmp_path / "out").glob("*.png"))) == 5


# --------------------------------------------------------------------------- reading in bounded memory


def test_report_streams_the_metrics_and_never_loads_them_whole(run_copy, monkeypatch, capsys):
    """The report reads metrics.csv a block at a time: load_run is not used, and any block size gives one answer."""
    whole = report.head_summary(load_run(run_copy))
    for block_bytes in (2000, 7000):
        d = report.digest_run(run_copy, block_bytes=block_bytes)
        pd.testing.assert_frame_equal(report.head_summary(d), whole)
        pd.testing.assert_frame_equal(d.steps, load_run(run_copy).steps)

    def no(*args, **kwargs):
        raise AssertionError("the report loaded the whole run")

    monkeypatch.setattr(rundir, "load_run", no)
    monkeypatch.setattr(rundir.reader, "load_run", no)
    monkeypatch.setattr(report, "digest", no)
    assert cli.main(["report", str(run_copy)]) == 0
    assert "27 delta_drift" in capsys.readouterr().out


def test_meta_claiming_a_billion_heads_is_ignored_without_allocating(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run", two_layer_rows(4), layers=["a", "b"], heads=[2, 3])
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps({**meta, "heads": [10**9, 3], "resumed_at": 5}))
    tracemalloc.start()
    try:
        out = render(run_dir, plots=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20  # a table sized from meta.json would take gigabytes
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert notes == ["note: meta.json: layers and heads ignored (they declare 1000000003 heads, metrics.csv has 5)",
                     "note: meta.json: resumed_at ignored (expected a list of steps, got 5)"]
    assert "alerts: 0 on 0 of 5 heads" in out


# --------------------------------------------------------------------------- the table at 80 columns


def test_summary_table_is_one_line_per_head_at_80_columns(tmp_path):
    """GPT-2-small names, six-digit steps, several alert kinds, big numbers: no row wraps, no line over 80."""
    rows = []
    for step in (123454, 123455, 123456):
        for layer in range(12):
            for head in range(12):
                rows.append({"step": step, "layer": layer, "layer_name": f"transformer.h.{layer}.attn",
                             "head": head, "loss": 3.25, "multi_max_freq": 0.5 + 0.01 * head,
                             "max_score": 35000.0 + 100 * layer + head, "delta_cum": -1.234e-5 * (layer + 1),
                             "sigma_wq": 1.0 + step - 123454 + 0.1 * head})
    events = []
    for layer in range(12):
        name = f"transformer.h.{layer}.attn"
        events.append(alert(100000 + layer, layer, name, 11, "spectral_growth"))
        events.append(alert(100500 + layer, layer, name, 11, "logit_growth"))
        events.append({**alert(101000 + layer, layer, name, 11, "delta_drift"), "event": "switch", "value": "",
                       "threshold": "", "action": "", "message": f"{name} head 11 moved"})
    run_dir = write_synthetic_run(tmp_path / "run", rows, events, layers=[f"transformer.h.{i}.attn" for i in range(12)],
                                  heads=[12] * 12)
    console = Console(file=io.StringIO(), width=80, record=True)
    assert report.main(run_dir, console=console, top=20, plots=False) == 0
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    rule = next(i for i, line in enumerate(lines) if line.startswith("──"))
    table = lines[rule + 1: rule + 21]
    assert len(table) == 20 and lines[rule + 21].startswith("124 more heads not shown")
    for line in table:  # every cell of a head on its line: its name ... its sigma growth
        assert re.match(r"^\S+ h\d+ .* ×[\d.]+$", line), line
    first = table[0]  # the earliest alert: layer 0 head 11, spectral growth, one kind more, switched
    assert "h.0 h11" in first and "100000 spectral_growth +1" in first and "101000" in first
    assert "3.5e+04" in first and "-1.2e-05" in first
    assert any(".11 h11" in line for line in table)  # the layer's index stays visible
