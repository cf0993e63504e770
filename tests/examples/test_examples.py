"""The examples, shortened, on CPU (the README's main job is examples/train_gpt2.py)."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import rich
import torch

from instability_watch import load_run
from instability_watch.cli import main as cli_main

from helpers import REPO, child_env, run_process

EXAMPLES = REPO / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _restore_console_and_threads():
    threads = torch.get_num_threads()
    yield
    rich.reconfigure()  # RichProgressBar reconfigures rich's global console
    torch.set_num_threads(threads)  # train_gpt2.py takes every core on CPU


def test_train_gpt2_cpu_demo_shortened(tmp_path, capsys, monkeypatch):
    mod = _load("train_gpt2")
    # the tests' one thread (conftest.py): the script takes every core on CPU, and two threads beside other
    # busy processes (a second pytest-xdist worker) wait on each other at every op (15 s -> 25 s here)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    # the cpu-demo preset's model and watch, on 2 sequences per step (the preset's 8 take 4x as long on CPU);
    # 24 steps: past the preset's watch warm-up (20), so the detectors judge the last probe steps
    assert mod.main(["--steps", "24", "--batch", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "cpu-demo" / "version_0" / "instability_watch"
    assert f"report {run_dir}" in out
    run = load_run(run_dir)
    p = mod.PRESETS["cpu-demo"]
    assert p.watch_warmup < 24
    assert sorted(run.metrics["step"].unique()) == list(range(1, 25, 2))  # probe steps: every other step
    assert len(run.metrics) == 12 * p.n_layer * p.n_head
    assert (run.metrics["rows"] == 2 * p.block).all()
    summary = json.loads((tmp_path / "cpu-demo" / "version_0" / "summary_rank0.json").read_text())
    assert summary["steps"] == 24 and summary["watch"] is True
    assert cli_main(["report", str(run_dir), "--out", str(tmp_path / "report")]) == 0
    assert len(list((tmp_path / "report").glob("*.png"))) == 5


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_the_main_job_runs_attention_in_bf16_on_every_cpu(tmp_path, capsys, monkeypatch, fast_bf16):
    """On a CPU with native BF16 the whole model trains in bf16-mixed; on one without (emulated BF16 products
    are ~30x slower) only the attention runs in BF16, the rest in float32, and the run says so in one line.
    Either way every attention call the watch observes computes in BF16."""
    mod = _load("train_gpt2")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(mod, "cpu_has_fast_bf16", lambda: fast_bf16)
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return real_sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(sys.modules["nanogpt"].F, "scaled_dot_product_attention", sdpa)
    assert mod.main(["--steps", "4", "--batch", "2", "--out", str(tmp_path), "--no-checkpoint"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "cpu-demo" / "version_0" / "summary_rank0.json").read_text())
    notice = "this CPU has no native BF16 matrix products"
    if fast_bf16:
        assert summary["precision"] == "bf16-mixed" and notice not in out
        assert all(autocast for *_, autocast in seen)  # SDPA casts float32 inputs to BF16 under autocast
    else:
        assert summary["precision"] == "attention-bf16" and out.count(notice) == 1
        assert seen and all(tuple(d) == (torch.bfloat16,) * 3 and not autocast for *d, autocast in seen)
    assert mod.choose_precision("bf16-mixed", gpu=False) == "bf16-mixed"
    assert mod.choose_precision("auto", gpu=True) == "bf16-mixed"


def test_train_gpt2_argument_errors(capsys):
    mod = _load("train_gpt2")
    with pytest.raises(SystemExit):
        mod.main(["--steps", "0"])
    assert "--steps must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.main(["--preset", "gpt5"])
    assert "invalid choice: 'gpt5'" in capsys.readouterr().err


def test_hf_llama_shortened(tmp_path, capsys):
    pytest.importorskip("transformers")
    mod = _load("hf_llama")
    assert mod.main(["--steps", "6", "--batch", "2", "--block", "32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "watched 2 layers x 4 query heads (0 calls not observed)" in out
    assert "2 layers × 4 heads observed; 0 calls unobserved" in out
    run = load_run(tmp_path / "hf-llama" / "version_0" / "instability_watch")
    assert sorted(run.metrics["step"].unique()) == [1, 6]  # probe steps
    assert (run.metrics["rows"] == 2 * 32).all()  # every query head of the GQA model is watched


def test_plain_pytorch_shortened(tmp_path, capsys):
    mod = _load("plain_pytorch")
    run_dir = tmp_path / "run"
    assert mod.main(["--steps", "6", "--batch", "2", "--run-dir", str(run_dir)]) == 0
    run = load_run(run_dir)
    assert sorted(run.metrics["step"].unique()) == [1, 6]  # probe steps (every 5th)
    assert (run.metrics["rows"] == 2 * 2 * 128).all()  # 2 micro-batches of 2 x 128 per step
    assert (run_dir / "checkpoint.pt").exists()
    assert "report" in capsys.readouterr().out


def test_train_gpt2_fsdp2_on_two_cpu_processes(tmp_path):
    """``--devices 2 --strategy fsdp2``: Lightning's ModelParallelStrategy, FSDP2 on every block (in
    GPTModule.configure_model), gloo; a subprocess, since Lightning launches rank 1 by re-running the script."""

    env = child_env(tmp_path)
    proc = run_process([sys.executable, str(EXAMPLES / "train_gpt2.py"), "--devices", "2", "--strategy", "fsdp2",
                           "--steps", "6", "--batch", "2", "--no-live-table", "--no-checkpoint", "--out",
                           str(tmp_path / "runs")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    version = tmp_path / "runs" / "cpu-demo" / "version_0"
    ranks = [json.loads((version / f"summary_rank{r}.json").read_text()) for r in (0, 1)]
    for s in ranks:
        assert s["strategy"] == "fsdp2" and s["devices"] == 2 and s["steps"] == 6 and s["watch"] is True
        assert s["data_parallel"] == 2  # FSDP2 over a data-parallel mesh of both ranks
    # each rank trained on its own batches (its own loss: logged without sync_dist)
    assert ranks[0]["final_loss"] != ranks[1]["final_loss"]
    assert ranks[0]["alerts"] == ranks[1]["alerts"] and ranks[0]["switched"] == ranks[1]["switched"]
    run = load_run(version / "instability_watch")
    p = _load("train_gpt2").PRESETS["cpu-demo"]
    assert sorted(run.metrics["step"].unique()) == [1, 3, 5]  # probe steps
    assert len(run.metrics) == 3 * p.n_layer * p.n_head
    assert (run.metrics["rows"] == 2 * 2 * p.block).all()  # both ranks' rows, summed by the watch's reduction
    assert run.metrics["sigma_wq"].notna().any()  # sigma(W_Q) of sharded weights


def test_train_gpt2_refuses_fsdp1_on_cpu(capsys, monkeypatch):
    mod = _load("train_gpt2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        mod.main(["--strategy", "fsdp", "--devices", "2"])
    assert "--strategy fsdp needs GPUs" in capsys.readouterr().err


def test_the_shipped_failure_run_reports_the_heads_that_blew_up(tmp_path, capsys):
    """examples/failure_run (a thinned run directory of the first 4-GPU arm): the report reads it cleanly, names
    layer 1's heads whose sigma(W_Q) grew about x100 first, and draws every plot."""
    run_dir = EXAMPLES / "failure_run"
    run = load_run(run_dir)
    assert run.problems == [] and run.metrics["step"].max() == 4491 and run.metrics["head"].nunique() == 12
    assert cli_main(["report", str(run_dir), "--out", str(tmp_path), "--top", "6"]) == 0
    out = capsys.readouterr().out
    assert "alerts: 50 on 19 of 144 heads" in out
    for head in ("h.1.attn h4", "h.1.attn h5"):
        line = next(ln for ln in out.splitlines() if ln.startswith(head))
        assert "×10" in line  # sigma(W_Q) grew about a hundredfold
    assert len(list(tmp_path.glob("*.png"))) == 5
