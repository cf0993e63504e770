"""The run directory: CSV layout, crash safety, resume truncation, loading back."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from instability_watch import AttentionLayer, InstabilityWatch, WatchConfig
from instability_watch.engine.metrics import METRICS
from instability_watch.outputs.rundir import EVENT_COLUMNS, METRIC_COLUMNS, RunDirError, RunWriter, load_run

from watch_models import TiedAttention, train_tied, write_tied_run

CFG = WatchConfig(probe_every=1, log_every=5, shadow_every=1, spectral_every=5, warmup_steps=5, sustain=3, auto_switch=True)


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    metrics = []
    watch, _ = write_tied_run(d, CFG, 30, listeners=[lambda r: metrics.extend(r.metrics)])
    return d, watch, metrics


def test_csv_holds_every_metric_of_every_step_and_the_events(tied_run):
    d, watch, metrics = tied_run
    run = load_run(d)
    assert list(run.metrics.columns) == list(METRIC_COLUMNS)
    assert list(run.events.columns) == list(EVENT_COLUMNS)
    assert len(run.metrics) == 30 * 4
    for m in metrics:  # the CSV equals what the watch computed (9 significant digits)
        rows = run.metrics[run.metrics["step"] == m.step].sort_values("head")
        for name in METRICS:
            np.testing.assert_allclose(rows[name].to_numpy(), m.values[name][0], rtol=1e-8, equal_nan=True)
        assert rows["loss"].iloc[0] == pytest.approx(m.loss, rel=1e-8)
    alerts = run.events[run.events["event"] == "alert"]
    switches = run.events[run.events["event"] == "switch"]
    assert [(int(r.step), int(r.head), r.kind) for r in alerts.itertuples()] == \
        [(a.step, a.head, a.kind) for a in watch.alerts]
    assert [(int(r.step), int(r.head), r.kind) for r in switches.itertuples()] == \
        [(e.step, e.head, e.reason) for e in watch.events]
    assert alerts["value"].notna().all() and switches["value"].isna().all()
    meta = json.loads((d / "meta.json").read_text())
    assert meta["layers"] == ["tied"] and meta["heads"] == [4] and meta["config"]["log_every"] == 5


def test_partly_written_last_line_is_dropped(tied_run, tmp_path):
    d, _, _ = tied_run
    for name in ("meta.json", "metrics.csv", "events.csv"):
        (tmp_path / name).write_bytes((d / name).read_bytes())
    data = (tmp_path / "metrics.csv").read_bytes()
    (tmp_path / "metrics.csv").write_bytes(data[: len(data) - 40])  # a kill in the middle of the last row
    run = load_run(tmp_path)
    # the torn line is skipped, and step 30, now with 3 of its 4 heads, is dropped as incomplete
    assert len(run.metrics) == 29 * 4
    assert run.metrics["step"].max() == 29
    assert run.metrics["rows"].notna().all()
    assert run.problems == ["metrics.csv: last line has no newline (a torn write), skipped",
                            "metrics.csv: last step 30 incomplete (3 of 4 heads), dropped"]


def test_resume_cuts_rows_after_the_checkpoint_and_writes_each_step_once(tmp_path):
    torch.manual_seed(0)
    model = TiedAttention()
    writer = RunWriter(tmp_path)
    watch = InstabilityWatch(model, CFG, layers=model.layers(), listeners=[writer])
    writer.open(watch)
    train_tied(model, watch, 0, 17)
    state = json.loads(json.dumps(watch.state_dict()))  # a checkpoint at step 17 (flushed through 15)
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    train_tied(model, watch, 17, 23)  # the run goes on, then dies
    writer.close()
    assert load_run(tmp_path).metrics["step"].max() == 20

    model2 = TiedAttention()
    model2.load_state_dict(model_state)
    writer2 = RunWriter(tmp_path)
    watch2 = InstabilityWatch(model2, CFG, layers=model2.layers(), listeners=[writer2])
    watch2.load_state_dict(state)
    writer2.open(watch2, resume_step=watch2.flushed_through)
    train_tied(model2, watch2, 17, 30)
    watch2.detach()
    writer2.close()
    run = load_run(tmp_path)
    assert sorted(run.metrics["step"]) == sorted(list(range(1, 31)) * 4)
    assert run.meta["resumed_at"] == [15]
    assert len(run.events) == len(watch2.alerts) + len(watch2.events)


class _Attn(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(16, 16)

    def forward(self, x):  # (B, H, N, 16)
        q = self.q(x[:, : self.heads]).to(torch.bfloat16)
        return F.scaled_dot_product_attention(q, q, q).float().sum()


def test_layers_of_different_widths_and_names_that_need_quoting(tmp_path):
    wide, narrow = _Attn(3), _Attn(2)
    wq = lambda m: (lambda: m.q.weight.detach().reshape(1, 16, 16).expand(m.heads, 16, 16))
    layers = [AttentionLayer(wide, 3, wq(wide), name='first,"odd" name'), AttentionLayer(narrow, 2, wq(narrow))]
    writer = RunWriter(tmp_path)
    watch = InstabilityWatch(nn.ModuleList([wide, narrow]), WatchConfig(probe_every=1, log_every=2), layers=layers,
                             listeners=[writer])
    writer.open(watch)
    for _ in range(4):
        x = torch.randn(1, 3, 16, 16)
        (wide(x) + narrow(x)).backward()
        watch.step()
    watch.detach()
    writer.close()
    run = load_run(tmp_path)
    names = list(dict.fromkeys(run.metrics["layer_name"]))
    assert names[0] == 'first,"odd" name' and len(names) == 2
    # padded heads of the narrow layer are not rows: 3 + 2 heads per step
    assert len(run.metrics) == 4 * 5
    assert sorted(run.metrics.loc[run.metrics["layer"] == 1, "head"].unique()) == [0, 1]
    assert (run.metrics["rows"] == 16).all()
    assert run.metrics["loss"].isna().all()


def test_refuses_to_overwrite_and_rejects_other_layers_on_resume(tied_run, tmp_path):
    d, watch, _ = tied_run
    with pytest.raises(FileExistsError, match="already holds a run; pass overwrite=True"):
        RunWriter(d).open(watch)
    for name in ("meta.json", "metrics.csv", "events.csv"):
        (tmp_path / name).write_bytes((d / name).read_bytes())
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["heads"] = [8]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RunDirError, match="holds a run of layers"):
        RunWriter(tmp_path).open(watch, resume_step=10)


def test_a_run_that_recorded_nothing_holds_nothing_to_lose(tied_run, tmp_path):
    """A run stopped before its first read-back leaves headers only: a new run may take its directory; one
    row of metrics or of events makes it a run."""
    d, watch, _ = tied_run
    for name in ("meta.json", "metrics.csv", "events.csv"):
        text = (d / name).read_text()
        (tmp_path / name).write_text(text if name == "meta.json" else text.splitlines(keepends=True)[0])
    assert not RunWriter(tmp_path).holds_run()
    for name in ("metrics.csv", "events.csv"):
        sub = tmp_path / name.split(".")[0]
        sub.mkdir()
        (sub / name).write_text("".join((d / name).read_text().splitlines(keepends=True)[:2]))
        assert RunWriter(sub).holds_run(), name
    # resuming into it is still a resume: its layers are checked against the model's
    meta = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "heads": [8]}))
    with pytest.raises(RunDirError, match="holds a run of layers"):
        RunWriter(tmp_path).open(watch, resume_step=10)
    writer = RunWriter(tmp_path)
    writer.open(watch)
    writer.close()
    assert json.loads((tmp_path / "meta.json").read_text())["heads"] == watch.head_counts


def test_loader_errors_name_the_path(tmp_path):
    with pytest.raises(RunDirError, match="no such directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="not a directory"):
        load_run(tmp_path / "file")
    with pytest.raises(RunDirError, match="no metrics.csv"):
        load_run(tmp_path)
    (tmp_path / "metrics.csv").write_text("a,b,c\n1,2,3\n")
    with pytest.raises(RunDirError, match="unexpected header"):
        load_run(tmp_path)
    (tmp_path / "metrics.csv").write_text("")
    with pytest.raises(RunDirError, match="metrics.csv: empty file"):
        load_run(tmp_path)
    (tmp_path / "metrics.csv").write_text(",".join(METRIC_COLUMNS) + "\nnot-a-step,0,x,0\n")
    assert load_run(tmp_path).problems == ["metrics.csv: 1 malformed line skipped (first at line 2)"]
    (tmp_path / "metrics.csv").write_text(",".join(METRIC_COLUMNS) + "\n")
    (tmp_path / "meta.json").write_text("[1, 2]")
    with pytest.raises(RunDirError, match="meta.json: expected a JSON object, got list"):
        load_run(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(RunDirError, match="meta.json: not readable as JSON"):
        load_run(tmp_path)
