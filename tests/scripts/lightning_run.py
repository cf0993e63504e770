"""Lightning runs of the callback in a separate process (DDP and killed-run tests).

Usage:
    python lightning_run.py ddp OUT_DIR            # 2-process CPU DDP (gloo); writes OUT_DIR/rank{r}.json
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

from instability_watch import InstabilityWatchCallback  # noqa: E402
from lightning_models import TiedModule  # noqa: E402

CFG = dict(log_every=5, shadow_every=1, spectral_every=5, warmup_steps=5, sustain=3, auto_switch=True)


class KillAt(TiedModule):
    def __init__(self, kill_step: int) -> None:
        super().__init__()
        self.kill_step = kill_step

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 == self.kill_step:  # inside optimizer step kill_step
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "ddp":
        model = TiedModule(seed_stride=2)  # each rank its own data: tied_batch(2 * step + rank)
        cb = InstabilityWatchCallback(CFG, layers=model.watch_layers(), run_dir=os.path.join(out, "run"), alerts=False)
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_steps=40, callbacks=[cb], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        )
        trainer.fit(model)
        w = cb.watch
        with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({
                "switched": sorted([l, h, s] for (l, h), s in w.switched.items()),
                "alerts": [[a.step, a.layer, a.head, a.kind] for a in w.alerts],
                "steps": w.step_count,
                "disabled": sorted(w.disabled),
                "wrote": cb.writer is not None,
            }, f)
    elif mode == "kill":
        model = KillAt(int(sys.argv[3]))
        cfg = dict(CFG, log_every=2)
        cb = InstabilityWatchCallback(cfg, layers=model.watch_layers(), run_dir=os.path.join(out, "run"), alerts=False)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=1000, callbacks=[cb], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        )
        trainer.fit(model)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
