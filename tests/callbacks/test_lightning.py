"""InstabilityWatchCallback in real Lightning Trainers (CPU)."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from instability_watch import InstabilityWatchCallback, WatchConfig, load_run
from instability_watch.callbacks.lightning import unsupported_strategy

from helpers import REPO, child_env, run_process
from lightning_models import TiedModule, TinyGPT

TIED_CFG = dict(probe_every=1, log_every=5, shadow_every=1, spectral_every=5, warmup_steps=5, sustain=3, auto_switch=True)


def _trainer(tmp_path, **kw):
    args = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    args.update(kw)
    return pl.Trainer(**args)


def test_csv_rows_logger_scalars_and_gradient_accumulation(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(val=True)
    cb = InstabilityWatchCallback(WatchConfig(probe_every=1, log_every=4, shadow_every=2, spectral_every=4, warmup_steps=4),
                                  alerts=False)
    logger = CSVLogger(str(tmp_path / "logs"))
    trainer = _trainer(
        tmp_path, callbacks=[cb], logger=logger, max_steps=12, accumulate_grad_batches=2, precision="bf16-mixed",
        limit_val_batches=2, val_check_interval=10, num_sanity_val_steps=2, log_every_n_steps=1,
    )
    trainer.fit(model)

    # the default run directory sits in the logger's version directory
    assert cb.run_dir == Path(logger.log_dir) / "instability_watch"
    run = load_run(cb.run_dir)
    m = run.metrics
    # one row per optimizer step (not per micro-batch), layer and head, each exactly once
    assert sorted(m["step"].unique()) == list(range(1, 13))
    assert len(m) == 12 * 2 * 2
    assert not m.duplicated(["step", "layer", "head"]).any()
    assert list(m["layer_name"].unique()) == ["model.h.0.attn", "model.h.1.attn"]
    # rows: both micro-batches add up into the step (2 x batch 2 x 24 positions); sanity
    # checking and validation (which ran through the same layers) are not counted
    assert (m["rows"] == 2 * 2 * 24).all()
    # shadow every 2 steps, sigma every 4 (steps count from 1)
    assert set(m.loc[m["shadow_rows"] > 0, "step"]) == set(range(1, 13, 2))
    assert set(m.loc[m["sigma_wq"].notna(), "step"]) == {1, 5, 9}
    # the loss column is the mean of the step's micro-batch losses
    by_step = {}
    for gs, loss in model.losses:
        by_step.setdefault(gs + 1, []).append(loss)
    steps = run.steps.set_index("step")["loss"]
    for s in range(1, 13):
        assert len(by_step[s]) == 2
        assert steps[s] == pytest.approx(np.mean(by_step[s]), rel=1e-5)
    # scalars reached the CSVLogger at the read-back steps
    logged = pd.read_csv(Path(logger.log_dir) / "metrics.csv")
    col = "instability_watch/multi_max_freq_max"
    assert col in logged.columns and "instability_watch/switched_heads" in logged.columns
    assert sorted(logged.loc[logged[col].notna(), "step"].astype(int)) == [1, 4, 8, 12]  # 1: the coverage check
    # detached at teardown: the model is untouched again
    assert not any("forward" in vars(mod) for mod in model.modules())
    meta = run.meta
    assert meta["layers"] == ["model.h.0.attn", "model.h.1.attn"] and meta["heads"] == [2, 2]
    assert meta["trainer"]["accumulate_grad_batches"] == 2


def _state_of(cb):
    st = cb.watch.state_dict()
    return {k: st[k] for k in ("step", "switched", "delta_cum", "detectors", "alerts", "events")}


def test_resume_from_checkpoint_is_identical_to_an_uninterrupted_run(tmp_path):
    full = TiedModule()
    cb_full = InstabilityWatchCallback(TIED_CFG, layers=full.watch_layers(), run_dir=tmp_path / "full", alerts=False)
    _trainer(tmp_path / "a", callbacks=[cb_full], max_steps=40).fit(full)
    assert cb_full.watch.switched, "the tied heads should have been switched in 40 steps"

    # the first run checkpoints at step 17 (steps 16-17 not yet read back), goes on to 23, dies
    first = TiedModule()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=17, save_top_k=-1)
    cb1 = InstabilityWatchCallback(TIED_CFG, layers=first.watch_layers(), run_dir=tmp_path / "resumed", alerts=False)
    _trainer(tmp_path / "b", callbacks=[cb1, ckpt], enable_checkpointing=True, max_steps=23).fit(first)
    path = tmp_path / "ckpt" / "epoch=0-step=17.ckpt"
    assert path.exists()
    assert torch.load(path, weights_only=False)["callbacks"]  # our state is in the checkpoint
    assert load_run(tmp_path / "resumed").metrics["step"].max() == 23

    second = TiedModule()
    cb2 = InstabilityWatchCallback(TIED_CFG, layers=second.watch_layers(), run_dir=tmp_path / "resumed", alerts=False)
    _trainer(tmp_path / "c", callbacks=[cb2], max_steps=40).fit(second, ckpt_path=str(path))

    assert cb2.watch.step_count == 40
    assert cb2.watch.switched == cb_full.watch.switched
    np.testing.assert_array_equal(cb2.watch.state_dict()["delta_cum"], cb_full.watch.state_dict()["delta_cum"])
    assert _state_of(cb2) == _state_of(cb_full)
    # the run directory holds every step once (rows the dead run wrote after the checkpoint were cut)
    a, b = load_run(tmp_path / "full"), load_run(tmp_path / "resumed")
    assert sorted(b.metrics["step"].unique()) == list(range(1, 41))
    assert len(b.metrics) == len(a.metrics) == 40 * 4
    pd.testing.assert_frame_equal(a.metrics, b.metrics)
    pd.testing.assert_frame_equal(a.events, b.events)
    assert b.meta["resumed_at"] == [15]


def test_default_run_dir_continues_after_resume(tmp_path):
    first = TiedModule()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
    cb1 = InstabilityWatchCallback(TIED_CFG, layers=first.watch_layers(), alerts=False)
    _trainer(tmp_path, callbacks=[cb1, ckpt], enable_checkpointing=True, logger=CSVLogger(str(tmp_path / "logs")),
             max_steps=10).fit(first)
    second = TiedModule()
    cb2 = InstabilityWatchCallback(TIED_CFG, layers=second.watch_layers(), alerts=False)
    _trainer(tmp_path, callbacks=[cb2], logger=CSVLogger(str(tmp_path / "logs")), max_steps=20).fit(
        second, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=10.ckpt"))
    assert cb2.run_dir == cb1.run_dir  # not the new logger version's directory
    assert sorted(load_run(cb1.run_dir).metrics["step"].unique()) == list(range(1, 21))


def _clean_env(tmp_path):
    return child_env(tmp_path)


# The 2-process runs (DDP, ModelParallel) that the tests below check, one after the other in one launch of
# tests/scripts/lightning_run.py (starting the processes and importing Lightning dominates on CPU):
# (folder, mode, steps, "-" | checkpoint every that many steps | the checkpoint to resume from)
TWO_PROCESS_RUNS = [
    ("ddp", "ddp", 40, "-"),  # uninterrupted
    ("ddp_res", "ddp", 23, 17),  # checkpoints at step 17 (16-17 not yet read back), goes on to 23, "dies"
    ("ddp_res", "ddp", 40, "ddp_res/ckpt/epoch=0-step=17.ckpt"),  # resumed from step 17, in the same folder
    ("mp", "mp", 6, 3),  # uninterrupted, a sharded checkpoint at step 3
    ("mp_res", "mp", 6, "mp/ckpt/epoch=0-step=3.ckpt"),  # resumed from it
]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """The launch's folder, holding each run's folder (run directory, checkpoints, rank JSONs)."""
    out = tmp_path_factory.mktemp("lightning")
    args = []
    for folder, mode, steps, last in TWO_PROCESS_RUNS:
        args += [mode, out / folder, steps, out / last if isinstance(last, str) and last != "-" else last]
    script = REPO / "tests" / "scripts" / "lightning_run.py"
    proc = run_process([sys.executable, str(script), *map(str, args)], env=_clean_env(out),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _ranks(folder, prefix=""):
    return [json.loads((folder / f"{prefix}rank{r}.json").read_text()) for r in (0, 1)]


def test_ddp_two_processes_switch_the_same_heads_and_write_one_csv(two_process_runs):
    folder = two_process_runs / "ddp"
    r0, r1 = _ranks(folder)
    assert r0["steps"] == r1["steps"] == 40
    assert r0["switched"], "the tied heads should be switched"
    assert r0["switched"] == r1["switched"]
    assert r0["alerts"] == r1["alerts"]
    assert r0["disabled"] == r1["disabled"] == []
    assert (r0["wrote"], r1["wrote"]) == (True, False)
    csvs = sorted(p.relative_to(folder) for p in folder.rglob("metrics.csv"))
    assert csvs == [Path("run/metrics.csv")]
    run = load_run(folder / "run")
    assert sorted(run.metrics["step"].unique()) == list(range(1, 41))
    switches = run.events[run.events["event"] == "switch"]
    assert sorted([int(l), int(h), int(s)] for l, h, s in zip(switches["layer"], switches["head"], switches["step"])) \
        == r0["switched"]


def test_model_parallel_strategy_fsdp2_on_cpu_and_its_distributed_checkpoint(two_process_runs):
    """ModelParallelStrategy (FSDP2 over a data-parallel mesh of 2; Lightning's FSDPStrategy refuses CPU):
    sigma of the sharded W_Q is the whole weight's, both ranks decide alike, only rank 0 writes, and a run
    resumed from the sharded checkpoint of step 3 ends in the uninterrupted run's state."""
    full = _ranks(two_process_runs / "mp", "mp_")
    r0, r1 = full
    assert r0["steps"] == r1["steps"] == 6 and r0["disabled"] == r1["disabled"] == []
    assert r0["switched"] and r0["switched"] == r1["switched"] and r0["alerts"] == r1["alerts"]
    assert r0["state"] == r1["state"]
    assert (r0["wrote"], r1["wrote"]) == (True, False)
    for got, ref in zip(r0["sigma"][0], r0["sigma_ref"]):
        for g, r in zip(got, ref):
            assert abs(g - r) <= 1e-5 * r, (g, r)
    assert (two_process_runs / "mp" / "ckpt" / "epoch=0-step=3.ckpt" / "meta.pt").exists()  # a sharded (distributed) checkpoint directory
    resumed = _ranks(two_process_runs / "mp_res", "mp_")
    for r in (0, 1):
        assert resumed[r]["state"] == full[r]["state"] and resumed[r]["switched"] == full[r]["switched"]


def test_ddp_resume_from_checkpoint_is_identical_to_an_uninterrupted_run(two_process_runs):
    """Under DDP the checkpoint holds rank 0's read-back state once (not summed per rank) and the
    resumed ranks continue exactly where the uninterrupted run's ranks were."""
    full = _ranks(two_process_runs / "ddp")
    assert (two_process_runs / "ddp_res" / "ckpt" / "epoch=0-step=17.ckpt").exists()
    resumed = _ranks(two_process_runs / "ddp_res")  # written last, by the resumed run
    for r in (0, 1):
        assert resumed[r]["steps"] == full[r]["steps"] == 40
        for key in ("switched", "alerts", "delta_cum"):
            assert resumed[r][key] == full[r][key], (r, key)
    assert full[0]["switched"], "the tied heads should be switched"
    a, b = load_run(two_process_runs / "ddp" / "run"), load_run(two_process_runs / "ddp_res" / "run")
    assert sorted(b.metrics["step"].unique()) == list(range(1, 41))
    pd.testing.assert_frame_equal(a.metrics, b.metrics)
    pd.testing.assert_frame_equal(a.events, b.events)


def test_killed_run_keeps_every_step_before_the_last_flush(tmp_path):
    script = REPO / "tests" / "scripts" / "lightning_run.py"
    proc = run_process([sys.executable, str(script), "kill", str(tmp_path), "24"], env=_clean_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    run = load_run(tmp_path / "run")
    # log_every=2: steps 1..22 were read back and written; 23 was on the device, 24 in flight
    assert sorted(run.metrics["step"].unique()) == list(range(1, 23))
    assert len(run.metrics) == 22 * 4
    assert run.metrics["rows"].notna().all()
    from instability_watch.cli import main

    assert main(["report", str(tmp_path / "run"), "--no-plots"]) == 0


class NoAttention(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.lin(batch.float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(8, 4), batch_size=2)


def test_setup_errors_and_argument_checks(tmp_path):
    cb = InstabilityWatchCallback()
    with pytest.raises(MisconfigurationException, match="in NoAttention: no attention layers found"):
        _trainer(tmp_path, callbacks=[cb], max_steps=2).fit(NoAttention())
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    for strategy in (FSDPStrategy(), ModelParallelStrategy(), DDPStrategy(), SingleDeviceStrategy("cpu")):
        assert unsupported_strategy(strategy) is None, strategy

    class DeepSpeedStrategy:  # Lightning's needs deepspeed installed; its zero_stage_3 property, as a stand-in
        zero_stage_3 = True

    why = unsupported_strategy(DeepSpeedStrategy())
    assert "ZeRO stage 3 partitions every parameter" in why and "use ZeRO stage 1 or 2" in why
    assert "not one of the supported strategies" in unsupported_strategy(object())
    with pytest.raises(TypeError, match="config must be a WatchConfig"):
        InstabilityWatchCallback(config=3)
    with pytest.raises(ValueError, match="log_every"):
        InstabilityWatchCallback(config={"log_every": 0})
    with pytest.raises(ValueError, match="top must be a positive integer, got 0"):
        InstabilityWatchCallback(top=0)
    with pytest.raises(TypeError, match="AttentionLayer"):
        InstabilityWatchCallback(layers=[torch.nn.Linear(2, 2)])


def test_existing_run_dir_is_not_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    for overwrite, expect_error in ((False, False), (False, True), (True, False)):
        model = TiedModule()
        cb = InstabilityWatchCallback(TIED_CFG, layers=model.watch_layers(), run_dir=run_dir, overwrite=overwrite,
                                      alerts=False)
        trainer = _trainer(tmp_path, callbacks=[cb], max_steps=5)
        if expect_error:
            with pytest.raises(MisconfigurationException, match="already holds a run; pass overwrite=True"):
                trainer.fit(model)
        else:
            trainer.fit(model)
            assert sorted(load_run(run_dir).metrics["step"].unique()) == [1, 2, 3, 4, 5]


def test_monitoring_failure_does_not_stop_training(tmp_path, caplog):
    model = TiedModule()
    cb = InstabilityWatchCallback(TIED_CFG, layers=model.watch_layers(), run_dir=tmp_path / "run", alerts=False)

    class Boom(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            def fail(*a, **k):
                raise RuntimeError("disk full")
            cb.writer.format_metrics = fail  # the CSV listener fails at the first read-back

    trainer = _trainer(tmp_path, callbacks=[cb, Boom()], max_steps=12)
    trainer.fit(model)
    assert trainer.global_step == 12
    assert cb.watch.step_count == 12
    assert any("disk full" in r.getMessage() for r in caplog.records)


def test_exception_in_training_reads_back_detaches_and_the_callback_can_be_reused(tmp_path):
    class Crash(TiedModule):
        def training_step(self, batch, batch_idx):
            if self.global_step == 13:
                raise RuntimeError("loss exploded")
            return super().training_step(batch, batch_idx)

    model = Crash()
    cb = InstabilityWatchCallback(TIED_CFG, layers=lambda module: module.watch_layers(), alerts=False)
    with pytest.raises(RuntimeError, match="loss exploded"):
        _trainer(tmp_path, callbacks=[cb], max_steps=30).fit(model)
    assert not any("forward" in vars(m) for m in model.modules())  # detached
    run_dir = cb.run_dir
    assert sorted(load_run(run_dir).metrics["step"].unique()) == list(range(1, 14))  # steps 11-13 read back too
    # the same callback on a second fit starts clean, in a new directory
    model2 = TiedModule()
    _trainer(tmp_path, callbacks=[cb], max_steps=5).fit(model2)
    assert cb.run_dir != run_dir and cb.watch.model is model2
    m2 = load_run(cb.run_dir).metrics
    assert sorted(m2["step"].unique()) == [1, 2, 3, 4, 5] and (m2["rows"] > 0).all()


class _RealModule(pl.LightningModule):
    """A model nobody here wrote, as a LightningModule: its own loss, AdamW."""

    def __init__(self, name):
        super().__init__()
        from real_models import MODELS

        self.spec = MODELS[name]
        self.model = self.spec.build()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.spec.loss(self.model, batch)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


@pytest.mark.parametrize("name", ["nanogpt-dropout", "hf-gpt2-default"])
def test_bf16_mixed_training_is_bitwise_identical_with_the_callback(tmp_path, name):
    """Lightning, precision="bf16-mixed", the models' default dropout: the watch changes no bit of training."""
    from real_models import MODELS

    g = torch.Generator().manual_seed(1)
    batches = [MODELS[name].batch(g) for _ in range(20)]

    def fit(watch):
        pl.seed_everything(0, verbose=False)
        module = _RealModule(name)
        callbacks = []
        if watch:
            callbacks.append(InstabilityWatchCallback(
                WatchConfig(probe_every=2, shadow_every=4, spectral_every=4, log_every=10),
                run_dir=tmp_path / "run", alerts=False))
        trainer = _trainer(tmp_path, callbacks=callbacks, max_steps=20, precision="bf16-mixed")
        trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
        return module, (callbacks[0] if watch else None)

    plain, _ = fit(False)
    watched, cb = fit(True)
    assert len(watched.losses) == 20
    assert all(torch.equal(a, b) for a, b in zip(watched.losses, plain.losses))
    for (n, p), q in zip(watched.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n
    run = load_run(tmp_path / "run")
    assert sorted(run.metrics["step"].unique()) == list(range(1, 20, 2))
    assert (run.metrics["rows"] > 0).all() and run.metrics["max_score"].notna().all()
    coverage = run.meta["coverage"]
    assert all(c["observed_calls"] == 10 and c["unobserved_calls"] == {} for c in coverage)
    assert all(c["shadow_skipped"] == {"dropout": 5} for c in coverage)  # dropout 0.1: no shadow, and said so


class _CompiledPerBlock(TinyGPT):
    """Compiles each block on its own in configure_model, after the callback attached in setup (torchtitan's
    regional compilation; aot_eager: Dynamo and AOT autograd, whose backward once failed on the shared graph)."""

    def configure_model(self):
        for i, block in enumerate(self.model.h):
            self.model.h[i] = torch.compile(block, backend="aot_eager")


def test_blocks_compiled_one_by_one_after_attach_are_each_watched(tmp_path):
    """The blocks compiled one by one after the watch attached: every block's metrics are its own, equal to the
    same training uncompiled (they once all went to the first block)."""
    cfg = WatchConfig(probe_every=1, shadow_every=1, spectral_every=1, log_every=2)
    runs, losses = {}, {}
    for name, cls in (("eager", TinyGPT), ("regional", _CompiledPerBlock)):
        torch._dynamo.reset()
        pl.seed_everything(0, verbose=False)
        cb = InstabilityWatchCallback(cfg, run_dir=tmp_path / name, alerts=False, live_table=False)
        module = cls(n_layer=3)
        _trainer(tmp_path, max_steps=4, callbacks=[cb]).fit(module)
        runs[name], losses[name] = load_run(tmp_path / name), module.losses
    assert losses["regional"] == losses["eager"] and len(losses["eager"]) == 4
    eager, regional = (runs[n].metrics.sort_values(["step", "layer", "head"]) for n in ("eager", "regional"))
    assert len(regional) == len(eager) == 4 * 3 * 2  # steps x layers x heads
    for column in ("rows", "multi_max_rows", "max_score", "shadow_rows", "delta_err_sum"):
        np.testing.assert_allclose(regional[column].to_numpy(float), eager[column].to_numpy(float), rtol=1e-5,
                                   atol=1e-7, err_msg=column)
    first = regional[regional["step"] == 1]
    assert first.groupby("layer")["max_score"].max().nunique() == 3  # each layer its own rows
    assert [c["observed_calls"] for c in runs["regional"].meta["coverage"]] == [4, 4, 4]
