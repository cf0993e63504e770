"""InstabilityWatchTrainerCallback in real Hugging Face ``Trainer`` runs (CPU)."""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: every model is built from a config
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

from transformers import Trainer, TrainerCallback  # noqa: E402

from instability_watch import WatchConfig, load_run  # noqa: E402
from instability_watch.callbacks.hf import STATE_FILE, InstabilityWatchTrainerCallback  # noqa: E402
from instability_watch.callbacks.hf_setup import clean_name, unsupported  # noqa: E402

from helpers import REPO, child_env, run_process  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "hf_trainer_run.py"
_spec = importlib.util.spec_from_file_location("hf_trainer_run", SCRIPT)
run_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_script)
build, TokenDataset, training_args, plain = (
    run_script.build, run_script.TokenDataset, run_script.training_args, run_script.plain)

SCALARS = {f"instability_watch/{k}" for k in (
    "multi_max_freq_max", "max_score_max", "delta_cum_absmax", "nonfinite_rows", "switched_heads", "alerts",
    "sigma_wq_max")}
DELTA_SCALAR = "instability_watch/delta_cum_absmax"  # logged once a shadow pass has measured a head
LAYERS = {"gpt2": ["transformer.h.0.attn", "transformer.h.1.attn"],
          "llama": ["model.layers.0.self_attn", "model.layers.1.self_attn"]}
ROWS = 2 * 2 * run_script.SEQ  # per head and optimizer step: 2 micro-batches of 2 sequences


class Recorder(TrainerCallback):
    """Keeps a copy of every ``logs`` it is shown (as a report_to integration sees them)."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


class AtStep(TrainerCallback):
    """Runs ``actions[step](control)`` at the end of optimizer step ``step``."""

    def __init__(self, actions):
        self.actions = actions

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.actions:
            self.actions[state.global_step](control)


def _train(out, model, callbacks, resume=None, trainer_attrs=None, **args):
    trainer = Trainer(model=model, args=training_args(out, **args), train_dataset=TokenDataset(), callbacks=callbacks)
    for k, v in (trainer_attrs or {}).items():
        setattr(trainer, k, v)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _detached(model) -> bool:
    """The watch left no trace: no forward of ours on a module, no hook (under mixed precision Accelerate
    puts its own autocast forward on the top module: not looked at)."""
    return not any("forward" in vars(m) for m in model.modules() if m is not model) and not model._forward_hooks


# ---------------------------------------------------------------------------------------------- one run


@pytest.mark.parametrize("name, loss_kwargs", [("gpt2", True), ("llama", False)])
def test_one_watch_step_per_optimizer_step_csv_loss_scalars_and_detach(tmp_path, name, loss_kwargs):
    """GPT-2 (its dropout) and Llama (GQA), gradient accumulation 2: one watch step per optimizer step,
    a CSV row per step, layer and head, the Trainer's loss in it, the scalars in the Trainer's logs."""
    model = build(name)
    recorder = Recorder()
    cb = InstabilityWatchTrainerCallback(
        WatchConfig(probe_every=1, shadow_every=1, spectral_every=1, log_every=4, warmup_steps=2), alerts=False)
    # the recorder is listed first, like the report_to integrations (which the Trainer puts before user callbacks)
    trainer = _train(tmp_path, model, [recorder, cb],
                     trainer_attrs=None if loss_kwargs else {"model_accepts_loss_kwargs": False})
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.index("InstabilityWatchTrainerCallback") == names.index("DefaultFlowCallback") + 1

    assert trainer.state.global_step == 6
    assert cb.watch.step_count == 6  # one watch step per optimizer step, not per micro-batch
    assert cb.watch.disabled == {}
    assert cb.run_dir == tmp_path / "instability_watch"
    run = load_run(cb.run_dir)
    m = run.metrics
    assert sorted(m["step"].unique()) == [1, 2, 3, 4, 5, 6]
    assert len(m) == 6 * 2 * 4 and not m.duplicated(["step", "layer", "head"]).any()
    assert list(m["layer_name"].unique()) == LAYERS[name]
    assert run.meta["heads"] == [4, 4]  # Llama: 4 query heads (on 2 key/value heads)
    assert run.meta["trainer"]["gradient_accumulation_steps"] == 2
    assert (m["rows"] == ROWS).all()  # both micro-batches add up into their optimizer step
    assert m["max_score"].notna().all() and m["sigma_wq"].notna().all()

    history = trainer.state.log_history
    # the loss column is the loss the Trainer logs for the step (logging_steps=1)
    logged = {h["step"]: h["loss"] for h in history if "loss" in h}
    steps = run.steps.set_index("step")["loss"]
    for s in range(1, 7):
        assert steps[s] == pytest.approx(logged[s], rel=1e-5), s

    # the scalars of each read-back (step 1: the coverage check, 4, 6: the last step) are in the next log
    with_scalars = [h for h in history if "instability_watch/switched_heads" in h]
    assert [h["step"] for h in with_scalars] == [1, 4, 6]
    assert all(SCALARS - {DELTA_SCALAR} <= set(h) for h in with_scalars)
    # GPT-2's attention dropout leaves its calls without a shadow pass: no drift is logged, not a drift of 0
    assert all((DELTA_SCALAR in h) == (name == "llama") for h in with_scalars)
    assert with_scalars[-1]["instability_watch/switched_heads"] == 0.0
    last_max = m.loc[m["step"] == 6, "max_score"].max()
    assert with_scalars[-1]["instability_watch/max_score_max"] == pytest.approx(last_max)
    # ... and the callbacks listed before this one (as report_to integrations are) saw them in the logs
    seen = [(s, logs) for s, logs in recorder.logs if "instability_watch/switched_heads" in logs]
    assert [s for s, _ in seen] == [1, 4, 6] and all(SCALARS - {DELTA_SCALAR} <= set(logs) for _, logs in seen)

    # the watch state is in each checkpoint; the model is its own again
    assert (tmp_path / "checkpoint-3" / STATE_FILE).is_file() and (tmp_path / "checkpoint-6" / STATE_FILE).is_file()
    assert _detached(model) and not cb.watch.observation.attached


# ---------------------------------------------------------------------------------------------- resume


def test_resume_from_checkpoint_is_identical_to_an_uninterrupted_run(tmp_path):
    """GPT-2 with its dropout; heads switched at steps 2 and 4. A run stops after step 4, past its step-3
    checkpoint; continued from checkpoint-3 it ends where the uninterrupted run ends."""
    cfg = WatchConfig(probe_every=1, shadow_every=1, spectral_every=2, log_every=2, warmup_steps=2)

    def switch(cb, layer, head):
        return lambda control: cb.watch.switch(layer, head)

    def leg(out, resume=None, stop_at=None):
        cb = InstabilityWatchTrainerCallback(cfg, alerts=False)
        actions = {2: switch(cb, 0, 1), 4: switch(cb, 1, 2)}
        if stop_at is not None:
            first = actions[stop_at]
            actions[stop_at] = lambda control: (first(control), setattr(control, "should_training_stop", True))
        model = build("gpt2")
        trainer = _train(out, model, [cb, AtStep(actions)], resume=resume)
        assert _detached(model)
        return cb, trainer

    full, _ = leg(tmp_path / "full")
    assert full.watch.switched == {(0, 1): 2, (1, 2): 4}

    _, stopped = leg(tmp_path / "resumed", stop_at=4)
    assert stopped.state.global_step == 4
    assert load_run(tmp_path / "resumed" / "instability_watch").metrics["step"].max() == 4
    saved = torch.load(tmp_path / "resumed" / "checkpoint-3" / STATE_FILE, weights_only=True)
    # read back before saving (log_every=2 had left step 3 on the device): no rank-local rows in checkpoints
    assert saved["global_step"] == 3 and saved["watch"]["pending_steps"] == []
    assert saved["watch"]["flushed_through"] == 3 and saved["watch"]["switched"] == [[0, 1, 2]]

    resumed, trainer = leg(tmp_path / "resumed", resume=str(tmp_path / "resumed" / "checkpoint-3"))
    assert trainer.state.global_step == 6 and resumed.watch.step_count == 6
    assert resumed.watch.switched == full.watch.switched
    assert plain(resumed.watch.state_dict()) == plain(full.watch.state_dict())
    # the run directory holds every step once: the rows the stopped run wrote after its checkpoint were cut
    import pandas as pd

    a, b = load_run(tmp_path / "full" / "instability_watch"), load_run(tmp_path / "resumed" / "instability_watch")
    assert sorted(b.metrics["step"].unique()) == [1, 2, 3, 4, 5, 6]
    pd.testing.assert_frame_equal(a.metrics, b.metrics)
    pd.testing.assert_frame_equal(a.events, b.events)
    assert b.meta["resumed_at"] == [3]


# ---------------------------------------------------------------------------------------------- DDP


def _clean_env(tmp_path):
    return child_env(tmp_path)


TORCHRUN_MODES = ("ddp", "fsdp1", "fsdp2")


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory):
    """tests/scripts/hf_trainer_run.py under torchrun, 2 CPU processes (gloo), every mode of TORCHRUN_MODES
    one after the other in one launch (starting the processes dominates on CPU): ``{mode: (its folder,
    {(leg, rank): that rank's report of that leg})}``."""
    out = tmp_path_factory.mktemp("hf_torchrun")
    proc = run_process(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
         str(out), *TORCHRUN_MODES],
        env=_clean_env(out), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {mode: (out / mode, {(p.name.split("-rank")[0], int(p.stem.split("-rank")[1])): json.loads(p.read_text())
                                for p in (out / mode).glob("*-rank*.json")})
            for mode in TORCHRUN_MODES}


def _ranks_agree_and_rank_zero_writes(r, legs=("full", "resumed")):
    for leg in legs:
        for rank in (0, 1):
            x = r[leg, rank]
            assert x["world_size"] == 2 and x["steps"] == 6 and x["disabled"] == [] and x["detached"], (leg, rank)
            assert x["wrote"] == (rank == 0), (leg, rank)
            scalars = [h for h in x["log_history"] if "instability_watch/switched_heads" in h]
            assert scalars and all(SCALARS - {DELTA_SCALAR} <= set(h) for h in scalars), (leg, rank)


def test_ddp_two_processes_decide_the_same_write_once_and_resume_identically(torchrun_runs):
    """torchrun, 2 CPU processes (gloo), each on its own data; multi-max alerts switch heads from the
    statistics reduced across ranks. Then the run continued from its checkpoint-3 (in a copy)."""
    out, r = torchrun_runs["ddp"]
    _ranks_agree_and_rank_zero_writes(r)
    # under DDP the Trainer hands the callbacks the model itself (not its DDP wrapper): nothing to gather
    assert r["full", 0]["seen"] == {"model": "GPT2LMHeadModel", "watched": "GPT2LMHeadModel", "roots": []}
    assert r["full", 0]["sharding"] is None
    full = r["full", 0]["state"]
    assert full["switched"], "the low multi-max threshold should switch heads"
    assert r["full", 1]["state"] == full  # every rank decided the same, from the same reduced statistics
    assert r["resumed", 0]["state"] == r["resumed", 1]["state"] == full
    # one run directory per run, written by rank 0; the watch state once per checkpoint
    csvs = sorted(str(p.relative_to(out)) for p in out.rglob("metrics.csv"))
    assert csvs == ["full/instability_watch/metrics.csv", "resumed/instability_watch/metrics.csv"]
    assert sorted(p.name for p in (out / "full" / "checkpoint-3").glob("instability_watch*")) == [STATE_FILE]
    a, b = load_run(out / "full" / "instability_watch"), load_run(out / "resumed" / "instability_watch")
    import pandas as pd

    assert sorted(a.metrics["step"].unique()) == [1, 2, 3, 4, 5, 6]
    pd.testing.assert_frame_equal(a.metrics, b.metrics)
    assert (a.metrics["rows"] == 2 * ROWS).all()  # summed over the two ranks
    # the loss column is the Trainer's logged loss (averaged over ranks, tokens counted across them)
    logged = {h["step"]: h["loss"] for h in r["full", 0]["log_history"] if "loss" in h}
    steps = a.steps.set_index("step")["loss"]
    for s in range(1, 7):
        assert steps[s] == pytest.approx(logged[s], rel=1e-5), s
    switches = a.events[a.events["event"] == "switch"]
    assert sorted([int(l), int(h), int(s)] for l, h, s in zip(switches["layer"], switches["head"], switches["step"])) \
        == full["switched"]


# ---------------------------------------------------------------------------------------------- FSDP


# What the Trainer hands the callbacks in on_train_begin, what the watch attaches to, the modules it
# searches for FSDP1 units besides the model (observation.sharding_roots), and the model's parameters
FSDP_SEEN = {
    "fsdp1": ({"model": "FullyShardedDataParallel", "watched": "LlamaForCausalLM",
               "roots": ["FullyShardedDataParallel"]}, "FullyShardedDataParallel", ["Parameter"]),
    "fsdp2": ({"model": "FSDPLlamaForCausalLM", "watched": "FSDPLlamaForCausalLM", "roots": []},
              "FSDPLlamaForCausalLM", ["DTensor"]),
}


def _sigma_is_the_whole_weights(got, ref):
    """sigma_wq per layer and head within 1e-5 relative of the float64 norm of the gathered W_Q."""
    assert len(got) == len(ref) == 2
    for g_layer, r_layer in zip(got, ref):
        assert len(g_layer) == len(r_layer) == 4
        for g, ref_ in zip(g_layer, r_layer):
            assert abs(g - ref_) <= 1e-5 * ref_, (g, ref_)


@pytest.mark.parametrize("mode", ["fsdp1", "fsdp2"])
def test_fsdp_two_processes_gather_w_q_decide_the_same_and_resume_identically(torchrun_runs, mode):
    """Llama (GQA) sharded by the Trainer itself: TrainingArguments(fsdp=True, fsdp_config={"version": 1 or 2,
    decoder layers auto-wrapped}), gradient accumulation 2, torchrun with 2 CPU processes (gloo; Accelerate
    ignores FSDP on CPU, the script's CpuFsdpTrainer turns it on). Heads switch (multi-max, and one by hand
    at step 2); then the run continued from its FSDP checkpoint-3 (in a copy)."""
    import pandas as pd

    out, r = torchrun_runs[mode]
    _ranks_agree_and_rank_zero_writes(r)
    seen, trainer_model, params = FSDP_SEEN[mode]
    for key, x in r.items():
        if key[0] in ("full", "resumed"):
            assert x["seen"] == seen and x["trainer_model"] == trainer_model and x["param_types"] == params, key
            assert x["sharding"] == mode, key
    full = r["full", 0]["state"]
    assert [1, 1, 2] in full["switched"] and len(full["switched"]) > 1
    assert r["full", 1]["state"] == full  # every rank decided the same, from the same reduced statistics
    assert r["resumed", 0]["state"] == r["resumed", 1]["state"] == full  # resumed: the uninterrupted run's state
    # sigma of the last step (6, spectral) is the whole W_Q's, gathered (FSDP1: summon_full_params of the
    # Trainer's root; FSDP2: full_tensor()), on both ranks
    for key in (("full", 0), ("full", 1), ("resumed", 0)):
        assert r[key]["sigma_last_step"] == 6
        _sigma_is_the_whole_weights(r[key]["sigma_last"], r[key]["sigma_ref"])

    # one run directory per run, written by rank 0; the watch state once per checkpoint
    csvs = sorted(str(p.relative_to(out)) for p in out.rglob("metrics.csv"))
    runs = ["full", "gpt2", "resumed"] if mode == "fsdp1" else ["full", "resumed"]  # (the bad leg never began)
    assert csvs == [f"{run}/instability_watch/metrics.csv" for run in runs]
    assert sorted(p.name for p in (out / "full" / "checkpoint-3").glob("instability_watch*")) == [STATE_FILE]
    a, b = load_run(out / "full" / "instability_watch"), load_run(out / "resumed" / "instability_watch")
    assert sorted(a.metrics["step"].unique()) == [1, 2, 3, 4, 5, 6]
    pd.testing.assert_frame_equal(a.metrics, b.metrics)
    assert b.meta["resumed_at"] == [3] and a.meta["trainer"]["sharding"] == mode
    # the user's layer names, not FSDP1's wrapped ones (model.layers.0._fsdp_wrapped_module.self_attn)
    assert list(a.metrics["layer_name"].unique()) == LAYERS["llama"] and full["layers"] == LAYERS["llama"]
    assert a.meta["heads"] == [4, 4] and (a.metrics["rows"] == 2 * ROWS).all()
    last = a.metrics[a.metrics["step"] == 6].sort_values(["layer", "head"])
    _sigma_is_the_whole_weights(last["sigma_wq"].to_numpy().reshape(2, 4).tolist(), r["full", 0]["sigma_ref"])
    # the loss column is the Trainer's logged loss (the model's loss copied before the Trainer scales it in place)
    logged = {h["step"]: h["loss"] for h in r["full", 0]["log_history"] if "loss" in h}
    steps = a.steps.set_index("step")["loss"]
    for s in range(1, 7):
        assert steps[s] == pytest.approx(logged[s], rel=1e-5), s

    if mode == "fsdp1":
        # GPT-2 with the Trainer's default use_orig_params=True: outside the forward its Conv1D weight is a
        # piece of the flat shard (empty on one rank); the layers are located on gathered weights. No unit but
        # the root (NO_WRAP), which wraps the model from outside: found through observation.sharding_roots
        for rank in (0, 1):
            g = r["gpt2", rank]
            assert g["steps"] == 2 and g["disabled"] == [] and g["sharding"] == "fsdp1", rank
            assert g["seen"] == {"model": "FullyShardedDataParallel", "watched": "GPT2LMHeadModel",
                                 "roots": ["FullyShardedDataParallel"]}
            assert g["state"]["layers"] == LAYERS["gpt2"]
            _sigma_is_the_whole_weights(g["sigma_last"], g["sigma_ref"])
        assert r["gpt2", 0]["state"] == r["gpt2", 1]["state"]
        # layers= of the user's whose w_q reads a shape taken outside the gather: refused on every rank alike
        errors = [r["bad", rank]["error"] for rank in (0, 1)]
        assert errors[0] == errors[1] and r["bad", 0]["steps"] == 0
        assert re.search(r"under FSDP1, W_Q of layer 'transformer\.h\.[01]\.attn' read inside summon_full_params is "
                         r"\(.*\) on rank [01] and \(.*\) on rank 0", errors[0]), errors[0]
        assert "its locator does not read the whole weight" in errors[0]


# ---------------------------------------------------------------------------------------------- errors


class NoAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(run_script.VOCAB, 8)

    def forward(self, input_ids, labels=None):
        return {"loss": self.emb(input_ids).pow(2).mean()}


def test_bad_arguments_and_runs_that_cannot_be_watched(tmp_path):
    with pytest.raises(TypeError, match="config must be a WatchConfig, a dict of its fields or None, got int"):
        InstabilityWatchTrainerCallback(config=3)
    with pytest.raises(ValueError, match="log_every must be an int >= 1, got 0"):
        InstabilityWatchTrainerCallback(config={"log_every": 0})
    with pytest.raises(ValueError, match="top must be a positive integer, got 0"):
        InstabilityWatchTrainerCallback(top=0)
    with pytest.raises(TypeError, match=r"layers must hold AttentionLayer descriptions, got \['Linear'\]"):
        InstabilityWatchTrainerCallback(layers=[torch.nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="layers must be None, a list of AttentionLayer .* got int"):
        InstabilityWatchTrainerCallback(layers=5)
    with pytest.raises(TypeError, match="overwrite must be True or False, got 'yes'"):
        InstabilityWatchTrainerCallback(overwrite="yes")
    with pytest.raises(TypeError, match="run_dir must be None, a str or an os.PathLike, got int"):
        InstabilityWatchTrainerCallback(run_dir=3)
    with pytest.raises(TypeError, match="console must be a rich.console.Console or None, got int"):
        InstabilityWatchTrainerCallback(console=3)

    def why(model=None, **kw):
        args = SimpleNamespace(**dict(dict(deepspeed=None, fsdp=None, n_gpu=1), **kw))
        return unsupported(args, model if model is not None else build("gpt2"))

    assert why() is None
    # FSDP is decided by the model the Trainer hands over, not by the arguments (on CPU Accelerate ignores
    # fsdp=True and trains with DDP); sharded runs are in test_fsdp_two_processes_...
    assert why(fsdp=True) is None
    zero3 = "DeepSpeed ZeRO-3 partitions every parameter, W_Q included, and the watch has no gather"
    assert zero3 in why(deepspeed={"zero_optimization": {"stage": 3}})
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert zero3 in why(deepspeed=str(ds_file))
    partitioned = build("gpt2")
    next(partitioned.parameters()).ds_id = 0  # what DeepSpeed ZeRO-3 puts on the parameters it partitions
    assert zero3 in why(partitioned)
    assert "DeepSpeed (ZeRO stage 2) is not tested with this callback" in why(
        deepspeed={"zero_optimization": {"stage": 2}})
    assert "DeepSpeed (its ZeRO stage not known) is not tested" in why(deepspeed="missing.json")
    assert "nn.DataParallel" in why(n_gpu=2)
    assert "tensor parallelism (tp_size=2) splits each attention layer's heads across ranks" in why(
        parallelism_config=SimpleNamespace(tp_size=2))
    assert "context parallelism (cp_size=4)" in why(parallelism_config=SimpleNamespace(tp_size=1, cp_size=4))
    assert "sequence parallelism (sp_size=2" in why(parallelism_config=SimpleNamespace(sp_size=2))
    split = build("llama")
    split._tp_size = 2  # from_pretrained(tp_plan=...)
    assert "tensor parallelism (tp_size=2)" in why(split)
    piped = build("llama")
    piped.config.distributed_config = SimpleNamespace(tp_size=1, pp_size=2)
    assert "pipeline parallelism (pp_size=2) puts different layers on different ranks" in why(piped)
    assert clean_name("model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.self_attn") == \
        "model.layers.0.self_attn"

    # a model without attention: an error at train begin, before any step, naming what was seen
    with pytest.raises(ValueError, match="in NoAttention: no attention layers found"):
        _train(tmp_path / "none", NoAttention(), [InstabilityWatchTrainerCallback()])

    # attention computed without SDPA: nothing to observe, said at train begin
    eager = build("gpt2")
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="eager"):
        _train(tmp_path / "eager", eager, [InstabilityWatchTrainerCallback()], max_steps=1, save_strategy="no")
    assert _detached(eager)

    # a run directory already holding a run is not overwritten, unless asked to
    out = tmp_path / "out"
    _train(out, build("gpt2"), [InstabilityWatchTrainerCallback(alerts=False)], max_steps=2, save_strategy="no")
    model = build("gpt2")
    with pytest.raises(ValueError, match="already holds a run; pass overwrite=True"):
        _train(out, model, [InstabilityWatchTrainerCallback(alerts=False)], max_steps=2, save_strategy="no")
    assert _detached(model)  # the failed attach left nothing behind
    cb = InstabilityWatchTrainerCallback(WatchConfig(probe_every=1, log_every=2), alerts=False, overwrite=True)
    _train(out, build("gpt2"), [cb], max_steps=3, save_strategy="no")
    assert sorted(load_run(out / "instability_watch").metrics["step"].unique()) == [1, 2, 3]


def test_import_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    monkeypatch.delitem(sys.modules, "instability_watch.callbacks.hf")
    with pytest.raises(ImportError, match=r'pip install "instability_watch\[hf\]"'):
        importlib.import_module("instability_watch.callbacks.hf")


def test_a_failing_run_directory_does_not_stop_training(tmp_path, caplog):
    cb = InstabilityWatchTrainerCallback(WatchConfig(probe_every=1, log_every=2), alerts=False)

    class Boom(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            def fail(*a, **k):
                raise OSError("disk full")
            cb.writer.format_metrics = fail  # the CSV listener fails at the first read-back

    model = build("llama")
    with caplog.at_level(logging.ERROR, logger="instability_watch"):
        trainer = _train(tmp_path, model, [cb, Boom()])
    assert trainer.state.global_step == 6 and cb.watch.step_count == 6
    assert any("disk full" in r.getMessage() for r in caplog.records)
    assert [h["step"] for h in trainer.state.log_history if "instability_watch/alerts" in h] == [1, 2, 4, 6]
    assert _detached(model)


def test_after_an_exception_close_detaches_and_the_callback_can_be_reused(tmp_path):
    """The Trainer has no hook for an exception in training: ``close()`` reads back and detaches; a callback
    reused for another ``train()`` also starts clean."""
    cb = InstabilityWatchTrainerCallback(WatchConfig(probe_every=1, log_every=4), alerts=False)

    def explode(control):
        raise RuntimeError("loss exploded")

    model = build("gpt2")
    with pytest.raises(RuntimeError, match="loss exploded"):
        _train(tmp_path / "a", model, [cb, AtStep({3: explode})])
    assert not _detached(model)  # nothing told the callback
    cb.close()
    assert _detached(model)
    assert sorted(load_run(tmp_path / "a" / "instability_watch").metrics["step"].unique()) == [1, 2, 3]

    model2 = build("llama")
    _train(tmp_path / "b", model2, [cb], max_steps=2, save_strategy="no", bf16=True)  # under CPU autocast
    assert cb.watch.model is model2 and cb.watch.step_count == 2 and _detached(model2)
    m = load_run(tmp_path / "b" / "instability_watch").metrics
    assert sorted(m["step"].unique()) == [1, 2] and (m["rows"] == ROWS).all()


# ---------------------------------------------------------------------------------------------- packed batches


class DocDataset(torch.utils.data.Dataset):
    """Documents of different lengths (each its own labels), for padding-free packing."""

    def __init__(self, n: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.docs = [torch.randint(1, run_script.VOCAB, (int(n_),), generator=g).tolist()
                     for n_ in torch.randint(5, 30, (n,), generator=g)]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.docs[i], "labels": list(self.docs[i])}


def test_packed_batches_through_the_trainer_are_watched_document_by_document(tmp_path):
    """DataCollatorWithFlattening packs each micro-batch into one row (position_ids restart per document);
    with use_cache=False (as for training) HF masks the documents from each other on sdpa. Every call is
    observed and each probe step counts every token of the packed micro-batches as a row."""
    from transformers import DataCollatorWithFlattening

    model = build("llama")
    model.config.use_cache = False
    data = DocDataset()
    cb = InstabilityWatchTrainerCallback(
        WatchConfig(probe_every=1, shadow_every=1, spectral_every=1, log_every=2, warmup_steps=2), alerts=False)
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=4, save_steps=100), train_dataset=data,
                      data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True), callbacks=[cb])
    trainer.train()
    run = load_run(cb.run_dir)
    coverage = run.meta["coverage"]
    assert all(c["unobserved_calls"] == {} and c["observed_calls"] > 0 for c in coverage), coverage
    assert all(c["shadow_calls"] > 0 for c in coverage)
    m = run.metrics
    assert sorted(m["step"].unique()) == [1, 2, 3, 4]
    # rows per head and step: the tokens of the step's micro-batches (2 x 2 documents, 4 steps = all 16 documents)
    per_step = m.groupby("step")["rows"].first().sum()
    assert per_step == sum(len(d) for d in data.docs)
    assert m["max_score"].notna().all() and m["delta_cum"].notna().all()
