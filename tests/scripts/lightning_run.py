"""Lightning runs of the callback in separate processes (DDP, ModelParallel and killed-run tests).

Usage:
    python lightning_run.py MODE OUT_DIR STEPS LAST [MODE OUT_DIR STEPS LAST ...]
        # 2-process CPU runs (gloo), one after the other in the same two processes (one launch: starting
        # them dominates on CPU). Each: STEPS optimizer steps, run dir OUT_DIR/run; LAST is "-", a number
        # (checkpoint every that many steps into OUT_DIR/ckpt) or a checkpoint path (resume from it).
        # MODE ddp: DDP, TiedModule; writes OUT_DIR/rank{r}.json.
        # MODE mp: ModelParallelStrategy (FSDP2 over a data-parallel mesh of 2), a nanoGPT sharded in
        # configure_model; writes OUT_DIR/mp_rank{r}.json.
    python lightning_run.py kill OUT_DIR STEP      # SIGKILLs itself inside optimizer step STEP
"""
import json
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from instability_watch import InstabilityWatchCallback  # noqa: E402

from lightning_models import TiedModule, TinyGPT  # noqa: E402
from nanogpt import GPT, GPTConfig  # noqa: E402

CFG = dict(probe_every=1, log_every=5, shadow_every=1, spectral_every=5, warmup_steps=5, sustain=3, auto_switch=True)


class ShardedGPT(TinyGPT):
    """TinyGPT sharded with FSDP2 over the strategy's data-parallel mesh; each rank its own data."""

    def __init__(self) -> None:
        super().__init__(n_layer=2, n_head=4, n_embd=32)
        # no position embedding and few distinct tokens: repeated maxima, so the detector switches heads
        self.model = GPT(GPTConfig(vocab_size=64, block_size=self.seq, n_layer=2, n_head=4, n_embd=32,
                                   pos_embedding=False))

    def _tokens(self, i: int):
        return torch.randint(0, 7, (self.batch, self.seq + 1), generator=torch.Generator().manual_seed(int(i)))

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        t = self._tokens(2 * self.global_step + self.global_rank)
        _, loss = self.model(t[:, :-1], t[:, 1:])
        return loss


def _result(cb, trainer):
    w = cb.watch
    return {
        "switched": sorted([l, h, s] for (l, h), s in w.switched.items()),
        "alerts": [[a.step, a.layer, a.head, a.kind] for a in w.alerts],
        "delta_cum": w.state_dict()["delta_cum"],
        "steps": w.step_count,
        "disabled": sorted(w.disabled),
        "wrote": cb.writer is not None,
        "sigma": [m["sigma_wq"].tolist() for m in w.last_metrics][-1:],
        "sigma_ref": [  # the gathered float64 W_Q (sharded runs only)
            torch.linalg.matrix_norm(s.layer.w_q().detach().full_tensor().double(), ord=2).tolist()
            for s in w.observation.sites
        ] if type(trainer.strategy).__name__ == "ModelParallelStrategy" else None,
        "state": {k: v for k, v in w.state_dict().items() if k not in ("alerts", "events")},
    }


class KillAt(TiedModule):
    def __init__(self, kill_step: int) -> None:
        super().__init__()
        self.kill_step = kill_step

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 == self.kill_step:  # inside optimizer step kill_step
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def fit(mode: str, out: str, steps: int, last: str) -> None:
    """One 2-process run (see the module's docstring); writes this rank's JSON into ``out``."""
    ckpt_every = int(last) if last.isdigit() else None
    resume = last if last != "-" and ckpt_every is None else None
    if mode == "ddp":
        model = TiedModule(seed_stride=2)  # each rank its own data: tied_batch(2 * step + rank)
        cb = InstabilityWatchCallback(CFG, layers=model.watch_layers(), run_dir=os.path.join(out, "run"),
                                      alerts=False)
        strategy = "ddp"
    elif mode == "mp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        pl.seed_everything(0, verbose=False)  # the same initial weights on both ranks and in every run
        model = ShardedGPT()
        cfg = dict(CFG, log_every=3, spectral_every=1, warmup_steps=2, sustain=1, multi_max_factor=1.2,
                   multi_max_min_rise=0.0)
        cb = InstabilityWatchCallback(cfg, run_dir=os.path.join(out, "run"), alerts=False,
                                      overwrite=resume is None)
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    callbacks = [cb]
    if ckpt_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=ckpt_every,
                                         save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, callbacks=callbacks, logger=False,
        enable_checkpointing=bool(ckpt_every), enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(model, ckpt_path=resume)
    name = f"rank{trainer.global_rank}.json" if mode == "ddp" else f"mp_rank{trainer.global_rank}.json"
    with open(os.path.join(out, name), "w") as f:
        json.dump(_result(cb, trainer), f)


def main() -> None:
    if sys.argv[1] == "kill":
        out = sys.argv[2]
        model = KillAt(int(sys.argv[3]))
        cfg = dict(CFG, log_every=2)
        cb = InstabilityWatchCallback(cfg, layers=model.watch_layers(), run_dir=os.path.join(out, "run"), alerts=False)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=1000, callbacks=[cb], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        )
        trainer.fit(model)
        return
    runs = sys.argv[1:]
    if not runs or len(runs) % 4:
        raise SystemExit("usage: lightning_run.py MODE OUT_DIR STEPS LAST [MODE OUT_DIR STEPS LAST ...]")
    # Lightning launches rank 1 (this script, these arguments) at the first fit; the later fits reuse
    # both processes and their process group
    for i in range(0, len(runs), 4):
        mode, out, steps, last = runs[i:i + 4]
        fit(mode, out, int(steps), last)


if __name__ == "__main__":
    main()
