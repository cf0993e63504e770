"""Alert panels and the worst-heads table, rendered into string consoles."""
from __future__ import annotations

import dataclasses
import io

import lightning.pytorch as pl
import pytest
import rich
import torch
from lightning.pytorch.callbacks import RichProgressBar
from rich.console import Console
from rich.progress import Progress

from instability_watch import Alert, InstabilityWatch, InstabilityWatchCallback, WatchConfig
from instability_watch.outputs.console import AlertPanel, ConsoleReporter, short_names

from lightning_models import TiedModule
from watch_models import TiedAttention, train_tied

CFG = WatchConfig(probe_every=1, log_every=5, shadow_every=1, spectral_every=5, warmup_steps=5, sustain=3, auto_switch=True)


def _console(terminal: bool = False) -> Console:
    return Console(file=io.StringIO(), width=140, force_terminal=terminal, color_system=None)


def _text(console: Console) -> str:
    return console.file.getvalue()


def test_alert_panel_shows_layer_head_kind_value_threshold_and_action():
    c = _console()
    alert = Alert(step=1234, layer=3, head=7, kind="multi_max", value=0.4375, threshold=0.125,
                  message="multi-max frequency 0.44 above 0.12", layer_name="transformer.h.3.attn",
                  action="switched to the stabilized kernel")
    c.print(AlertPanel(alert))
    out = _text(c)
    for piece in ("step 1234", "transformer.h.3.attn (#3)", "head    7", "multi_max", "0.4375", "threshold 0.125",
                  "switched to the stabilized kernel", "multi-max frequency 0.44 above 0.12"):
        assert piece in out, piece


def _run(reporter, steps=30):
    torch.manual_seed(0)
    model = TiedAttention()
    watch = InstabilityWatch(model, CFG, layers=model.layers(), listeners=[reporter])
    train_tied(model, watch, 0, steps)
    watch.detach()
    reporter.close()
    return watch


def test_reporter_prints_a_panel_per_alert_and_the_worst_heads_table():
    c = _console()
    watch = _run(ConsoleReporter(c, live_table=True, top=3))
    out = _text(c)
    assert [(a.step, a.head, a.kind) for a in watch.alerts] == [(27, 0, "delta_drift"), (27, 1, "delta_drift")]
    assert out.count("instability_watch · step 27 · delta_drift") == 2
    assert out.count("switched to the stabilized kernel") == 2
    # the table: the alerted, switched heads first, with their state; 3 of 4 heads shown
    table = out[out.rindex("worst heads at step 30"):]
    lines = [ln for ln in table.splitlines() if ln.startswith("tied")]
    assert len(lines) == 3
    assert {ln.split("│")[1].strip() for ln in lines[:2]} == {"0", "1"}
    assert all("stabilized@30" in ln and "δ-drift" in ln for ln in lines[:2])  # decided at the read-back of 30
    assert lines[2].rstrip().endswith("ok")
    assert "1 more heads not shown" in table


def test_live_table_on_a_terminal_and_nested_under_a_progress_bar():
    c = _console(terminal=True)
    with Progress(console=c) as progress:  # what Lightning's RichProgressBar runs
        progress.add_task("epoch", total=10)
        reporter = ConsoleReporter(c, live_table=True)
        _run(reporter)
        assert not c._live_stack or c._live_stack[0] is progress.live
    out = _text(c)
    assert "worst heads at step 30" in out and "stabilized@30" in out
    assert "instability_watch · step 27 · delta_drift" in out


def test_quiet_reporter_and_argument_check():
    c = _console()
    _run(ConsoleReporter(c, alerts=False, live_table=False))
    assert _text(c) == "instability_watch: 1 layers × 4 heads observed; 0 calls unobserved\n"  # said once
    c = _console()
    _run(ConsoleReporter(c, alerts=False, live_table=False, coverage=False))
    assert _text(c) == ""
    with pytest.raises(ValueError, match="top must be a positive integer, got 0"):
        ConsoleReporter(c, top=0)


def test_short_names_keep_the_container():
    assert short_names(["model.h.0.attn", "model.h.1.attn"]) == ["h.0.attn", "h.1.attn"]
    assert short_names(["tied"]) == ["tied"]


def test_lightning_rich_progress_bar_with_live_table(tmp_path):
    buf = io.StringIO()
    try:
        model = TiedModule()
        cb = InstabilityWatchCallback(CFG, layers=model.watch_layers(), run_dir=tmp_path / "run", live_table=True)
        bar = RichProgressBar(console_kwargs={"file": buf, "force_terminal": True, "width": 140, "color_system": None})
        trainer = pl.Trainer(accelerator="cpu", max_steps=30, callbacks=[cb, bar], logger=False,
                             enable_checkpointing=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(model)
    finally:
        rich.reconfigure()  # give the global console back its defaults
    out = buf.getvalue()
    assert "instability_watch · step 27 · delta_drift" in out
    assert "worst heads at step 30" in out
    assert trainer.global_step == 30


def test_a_switch_to_the_exact_delta_says_so_in_the_panel_and_the_table():
    c = _console()
    torch.manual_seed(0)
    model = TiedAttention()
    reporter = ConsoleReporter(c, live_table=True, top=3)
    watch = InstabilityWatch(model, dataclasses.replace(CFG, switch_to="exact_delta"), layers=model.layers(),
                             listeners=[reporter])
    train_tied(model, watch, 0, 30)
    watch.detach()
    reporter.close()
    out = _text(c)
    assert out.count("switched to the exact delta") == 2 and "switched to the stabilized kernel" not in out
    table = out[out.rindex("worst heads at step 30"):]
    assert table.count("exact-δ@30") == 2 and "stabilized@" not in table
