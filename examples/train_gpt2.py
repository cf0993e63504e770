"""Train a GPT-2-style model on the Python standard library's source, with the watch attached.

    python examples/train_gpt2.py                          # cpu-demo: about 2 minutes on 2 CPU cores
    python examples/train_gpt2.py --preset gpt2-small      # GPT-2 small (124M) on a GPU, Triton kernels
    python examples/train_gpt2.py --preset gpt2-small --devices 2 --strategy ddp
    python examples/train_gpt2.py --preset gpt2-small --devices 2 --strategy fsdp    # or fsdp2

The model is the nanoGPT-style GPT of ``nanogpt`` (a fused
``c_attn`` projection and ``F.scaled_dot_product_attention``; it knows nothing
about the watch), wrapped in a LightningModule below. The corpus is the
byte-level text of the Python standard library, which every machine with
Python has: no download. Training runs in BF16 mixed precision; the
``InstabilityWatchCallback`` observes the model's own attention calls (training
is bitwise what it is without the watch until a head is switched; a switched
layer runs on our kernels: Triton on a GPU, the PyTorch reference path on a
CPU), prints an alert panel for every alert, keeps a live table of the worst
heads, and writes the run directory that ``instability-watch report`` reads.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from instability_watch import InstabilityWatchCallback, WatchConfig
from instability_watch.cli import report_command

from byte_corpus import ByteWindows, stdlib_text, train_val_split
from nanogpt import GPT, Block, GPTConfig


@dataclass(frozen=True)
class Preset:
    # model (GPT-2 small is 12 / 12 / 768 with a 1024-token context)
    n_layer: int
    n_head: int
    n_embd: int
    block: int
    # optimisation (nanoGPT's recipe: AdamW 0.9/0.95, wd 0.1, warm-up then cosine, clip 1.0)
    batch: int
    accumulate: int
    steps: int
    lr: float
    warmup: int
    watch_warmup: int
    val_every: int = 0           # optimizer steps between validations (0: none)
    pos_embedding: bool = True
    watch: dict = field(default_factory=dict)  # WatchConfig fields other than its defaults
    corpus_bytes: Optional[int] = None


PRESETS = {
    # Small enough for 2 CPU cores in about two minutes; the attention runs through the
    # reference path (a PyTorch emulation of the BF16 kernel), which is the slow part.
    # The learning rate is high on purpose, and the logit and spectral thresholds tighter than
    # the defaults, so that two minutes of real training show alerts: attention logits grow
    # (Wortsman et al.'s instability, reported, not switched), and a head whose sigma(W_Q) outgrows
    # the others would be switched (--auto-switch). It does not reproduce the paper's rounding failure.
    # It probes every other step (the default is every 50th) so the short run has enough observations;
    # main() prints these settings at the start.
    "cpu-demo": Preset(n_layer=4, n_head=4, n_embd=128, block=128, batch=8, accumulate=1, steps=600, lr=1e-2,
                       warmup=15, watch_warmup=20, corpus_bytes=4_000_000,
                       watch=dict(probe_every=2, shadow_every=2, spectral_every=4, log_every=10, sustain=3,
                                  logit_factor=20.0, logit_min=50.0, spectral_rel_factor=2.0)),
    # The paper's model (nanoGPT GPT-2 small) for one GPU; batch 16 x 1024 tokens per micro-batch.
    # The watch at its defaults.
    "gpt2-small": Preset(n_layer=12, n_head=12, n_embd=768, block=1024, batch=16, accumulate=1, steps=2000,
                         lr=6e-4, warmup=100, watch_warmup=100, val_every=500),
}


class GPTModule(pl.LightningModule):
    """nanoGPT's GPT as a LightningModule: next-byte prediction, AdamW, warm-up + cosine schedule."""

    def __init__(self, preset: Preset, compile: bool = False, attention_bf16: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters({"preset": asdict(preset), "compile": compile, "attention_bf16": attention_bf16})
        self.preset = preset
        self.model = GPT(GPTConfig(vocab_size=256, block_size=preset.block, n_layer=preset.n_layer,
                                   n_head=preset.n_head, n_embd=preset.n_embd,
                                   pos_embedding=preset.pos_embedding,
                                   attention_dtype=torch.bfloat16 if attention_bf16 else None))
        self.compile = compile

    def configure_model(self) -> None:
        # --strategy fsdp2 (ModelParallelStrategy gives the module a device mesh): FSDP2 on every block
        if self.device_mesh is not None and not hasattr(self.model, "reshard"):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        # after the callback attached in setup: the compiled graph includes the routed attention
        if self.compile and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model)

    def training_step(self, batch, batch_idx):
        x, y = batch                                  # (B, T) bytes, (B, T) next bytes
        _, loss = self.model(x, y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # --strategy fsdp: Lightning's FSDP precision refuses clipping by norm; the FSDP root unit clips
        # over the sharded gradients itself
        from lightning.pytorch.strategies import FSDPStrategy

        if gradient_clip_val and isinstance(self.trainer.strategy, FSDPStrategy):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        p = self.preset
        decay = [q for q in self.parameters() if q.dim() >= 2]
        no_decay = [q for q in self.parameters() if q.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=p.lr, betas=(0.9, 0.95),  # not fused: Lightning clips gradients before the step
        )

        def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10%
            if step < p.warmup:
                return (step + 1) / p.warmup
            t = min(1.0, (step - p.warmup) / max(1, p.steps - p.warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Speed(pl.Callback):
    """Optimizer steps per second between step ``skip`` (after compilation, warm-up) and the last step."""

    def __init__(self, skip: int = 10) -> None:
        self.skip = skip
        self.t0: Optional[float] = None
        self.s0 = 0
        self.result: dict = {}

    def _now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self.skip and self.t0 is None:
            self.t0, self.s0 = self._now(), step
        elif self.t0 is not None and step == trainer.max_steps and not self.result:
            dt = self._now() - self.t0
            self.result = {"steps": step - self.s0, "seconds": dt, "steps_per_s": (step - self.s0) / dt}


def strategy_for(name: str, devices: int = 1):
    """``--strategy``: ``fsdp`` is Lightning's FSDPStrategy with every transformer block a unit, ``fsdp2``
    its ModelParallelStrategy over a data-parallel mesh of every device (FSDP2's ``fully_shard`` on every
    block, in ``GPTModule.configure_model``); any other name goes to Lightning as it is."""
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(auto_wrap_policy={Block})
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # its "auto" sizes put a node's devices on the tensor-parallel dimension: every rank would train on
        # the same batches and fully_shard over a data-parallel mesh of one would shard nothing
        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return name


PRECISIONS = ("auto", "bf16-mixed", "attention-bf16")


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies BF16 matrices natively (oneDNN with AVX-512 BF16 or AMX; ``ONEDNN_MAX_CPU_ISA``
    limits it as it limits oneDNN). Without, BF16 products are emulated, ~30x slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def choose_precision(requested: str, gpu: bool) -> str:
    """``--precision`` resolved: ``auto`` is ``bf16-mixed``, except on a CPU without fast BF16."""
    if requested != "auto":
        return requested
    return "bf16-mixed" if gpu or cpu_has_fast_bf16() else "attention-bf16"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-demo", help="model and schedule (default cpu-demo)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    ap.add_argument("--batch", type=int, help="sequences per micro-batch per device")
    ap.add_argument("--accumulate", type=int, help="micro-batches per optimizer step")
    ap.add_argument("--out", default="runs", help="where runs go: OUT/<preset>/version_N (default runs)")
    ap.add_argument("--no-watch", action="store_true", help="train without the watch (for speed comparisons)")
    ap.add_argument("--no-csv", action="store_true", help="watch without writing the run directory")
    ap.add_argument("--auto-switch", action=argparse.BooleanOptionalAction, default=True,
                    help="switch alerted heads to the stabilized kernel (default on)")
    ap.add_argument("--live-table", action=argparse.BooleanOptionalAction, default=True,
                    help="show the live worst-heads table (default on)")
    ap.add_argument("--pos-embedding", action=argparse.BooleanOptionalAction, default=None,
                    help="learned position embeddings (default: the preset's)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--precision", choices=PRECISIONS, default="auto",
                    help="bf16-mixed: the whole model in BF16 (autocast); attention-bf16: the attention in BF16, the "
                         "rest in float32; auto (default): bf16-mixed, except on a CPU without native BF16 matrix "
                         "products (AVX-512 BF16, AMX), where it is attention-bf16 (bf16-mixed is ~10x slower there)")
    ap.add_argument("--devices", type=int, default=1, help="devices (GPUs, or CPU processes) to train on")
    ap.add_argument("--strategy", default="auto",
                    help="Lightning strategy: ddp, fsdp (FSDP1, a unit per block; GPUs only), fsdp2 (FSDP2), or "
                         "another of Lightning's names (default auto)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--resume", metavar="CKPT", help="resume from this checkpoint")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps (0: only at the end)")
    ap.add_argument("--no-checkpoint", action="store_true", help="save no checkpoint (speed runs)")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "accumulate"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name} must be a positive integer, got {v}")
    if args.lr is not None and not args.lr > 0:
        ap.error(f"--lr must be > 0, got {args.lr}")
    if args.strategy == "fsdp" and not torch.cuda.is_available():
        ap.error("--strategy fsdp needs GPUs (Lightning's FSDPStrategy refuses the CPU); fsdp2 runs on CPU too")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    preset = replace(preset, **{k: v for k, v in (("steps", args.steps), ("lr", args.lr), ("batch", args.batch),
                                                    ("accumulate", args.accumulate),
                                                    ("pos_embedding", args.pos_embedding)) if v is not None})
    if preset.warmup >= preset.steps:
        preset = replace(preset, warmup=max(1, preset.steps // 10))
    pl.seed_everything(args.seed, verbose=False)
    gpu = torch.cuda.is_available()
    if not gpu:
        torch.set_num_threads(max(1, os.cpu_count() or 1))

    # -- data: random windows of the stdlib's source, the same on every run
    train_bytes, val_bytes = train_val_split(stdlib_text(preset.corpus_bytes))
    world = args.devices  # every strategy here is data parallel: each device takes its own batches
    n_train = preset.steps * preset.batch * preset.accumulate * world
    train = DataLoader(ByteWindows(train_bytes, preset.block, n_train, seed=args.seed), batch_size=preset.batch,
                       shuffle=False, num_workers=0, drop_last=True)
    val = None
    if preset.val_every:
        val = DataLoader(ByteWindows(val_bytes, preset.block, 20 * preset.batch, seed=args.seed + 1),
                         batch_size=preset.batch)

    precision = choose_precision(args.precision, gpu)
    if precision == "attention-bf16" and args.precision == "auto" and os.environ.get("LOCAL_RANK", "0") == "0":
        print("this CPU has no native BF16 matrix products: the attention (what the watch observes) runs in BF16, "
              "the rest of the model in float32 (--precision bf16-mixed: all in BF16, ~10x slower here)", flush=True)
    model = GPTModule(preset, compile=args.compile, attention_bf16=precision == "attention-bf16")
    logger = CSVLogger(args.out, name=args.preset)
    callbacks = [RichProgressBar(leave=True), Speed()]
    if not args.no_checkpoint:
        callbacks.append(ModelCheckpoint(every_n_train_steps=args.ckpt_every or None, save_last=True))
    watch_cb = None
    if not args.no_watch:
        config = WatchConfig(warmup_steps=preset.watch_warmup, auto_switch=args.auto_switch, **preset.watch)
        changed = {"warmup_steps": preset.watch_warmup, **preset.watch}
        default = WatchConfig()
        changed = {k: v for k, v in changed.items() if getattr(default, k) != v}
        if changed and os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"{args.preset}: the watch's settings differ from its defaults for this short run: "
                  + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in changed.items())
                  + " (the defaults: README, Configuration)", flush=True)
        watch_cb = InstabilityWatchCallback(config, live_table=args.live_table, top=6, write_csv=not args.no_csv)
        callbacks.insert(0, watch_cb)
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu", devices=args.devices,
        strategy=strategy_for(args.strategy, args.devices),
        precision="bf16-mixed" if precision == "bf16-mixed" else "32-true",
        max_steps=preset.steps, accumulate_grad_batches=preset.accumulate,
        gradient_clip_val=1.0, logger=logger, callbacks=callbacks, log_every_n_steps=10,
        val_check_interval=(preset.val_every * preset.accumulate if val is not None else None),
        check_val_every_n_epoch=None if val is not None else 1, limit_val_batches=20 if val is not None else 0,
        num_sanity_val_steps=0, enable_model_summary=False, enable_checkpointing=not args.no_checkpoint,
    )
    trainer.fit(model, train, val, ckpt_path=args.resume)

    # -- what happened
    speed = next(c for c in callbacks if isinstance(c, Speed)).result
    summary = {
        "preset": args.preset, "steps": trainer.global_step, "devices": args.devices, "strategy": args.strategy,
        "watch": watch_cb is not None, "compile": args.compile, "precision": precision, "speed": speed,
        # ranks that train on their own batches (the distributed sampler's replicas)
        "data_parallel": (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1),
        "final_loss": float(trainer.callback_metrics.get("loss", float("nan"))),
    }
    if args.compile:  # a recompile or a graph break would show here
        from torch._dynamo.utils import counters

        summary["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
    if watch_cb is not None and watch_cb.watch is not None:
        w = watch_cb.watch
        summary["switched"] = sorted([w.layer_names[l], h, s] for (l, h), s in w.switched.items())
        summary["alerts"] = [[a.step, a.layer_name, a.head, a.kind] for a in w.alerts]
        summary["run_dir"] = str(watch_cb.run_dir) if watch_cb.run_dir else None
    log_dir = trainer.log_dir or args.out
    with open(os.path.join(log_dir, f"summary_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if trainer.is_global_zero:
        rate = f"{speed['steps_per_s']:.2f} steps/s" if speed else "n/a"
        print(f"\ntrained {trainer.global_step} steps, final loss {summary['final_loss']:.3f}, {rate}")
        if watch_cb is not None and watch_cb.watch is not None:
            print(f"alerts: {len(summary['alerts'])}, heads switched: {len(summary['switched'])}")
            print(f"run directory: {watch_cb.run_dir}")
            print(f"postmortem:    {report_command(watch_cb.run_dir)}")
    _close_process_group()
    return 0


def _close_process_group() -> None:
    """Every rank done, the process group closed, and the process left without the interpreter's
    teardown: there gloo's threads were sometimes destroyed while running ("terminate called without
    an active exception", a rank aborted after a finished run; still 1 run in about 50 with the group
    destroyed first). Every file is written and closed by now; only a distributed run exits here."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
