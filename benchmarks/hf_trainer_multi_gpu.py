"""Issue 26, the Hugging Face part: the Trainer callback under DDP, watched vs unwatched, in one launch.

    torchrun --standalone --nproc_per_node 2 benchmarks/hf_trainer_multi_gpu.py --out runs/hf_ddp   # 2 GPUs
    python benchmarks/hf_trainer_multi_gpu.py --out runs/hf_1gpu                                   # 1 process
    torchrun --standalone --nproc_per_node 2 benchmarks/hf_trainer_multi_gpu.py --share-device ...  # 2 ranks, 1 GPU
    torchrun --standalone --nproc_per_node 2 benchmarks/hf_trainer_multi_gpu.py --cpu --tiny ...    # the CPU test

A small HF Llama with GQA (12 layers, 12 query and 4 key/value heads, 768 wide, context 1024, byte-level
vocabulary: 85M parameters besides the embeddings; ``--tiny``: 2 layers, 64 wide), built from its config,
trained by ``transformers.Trainer`` (BF16, AdamW, the Trainer's defaults otherwise) on the standard
library's source. In the same processes, one after the other:

* ``--rounds`` rounds of two runs of ``--steps`` optimizer steps, unwatched and watched
  (``InstabilityWatchTrainerCallback`` at the ``WatchConfig`` defaults unless ``--every``; the order
  swapped every round): steps/s between steps ``--skip`` and ``--steps`` (devices synchronised);
* a watched run to step ``--ckpt-step`` with a checkpoint there, with a watch that alerts on any rise of
  the multi-max frequency and switches heads (each rank trains on its own batches; the watch decides on
  the statistics reduced over the ranks): σ(W_Q) per head at the last spectral step against σ computed
  in float64 from that step's ``q_proj`` weights (``torch.linalg.matrix_norm`` of each head's rows, what
  one GPU computes from the same weights); then the checkpoint resumed for two more steps, continuing its
  run directory: the watch state the resumed run starts with equals the one the checkpoint holds, on
  every rank (that watch switches most heads early, so the resumed steps add few decisions of their own);
* with ``--pairs``, one run of a warm-up block and ``--pairs`` pairs of a watched and an unwatched block of
  ``--block-steps`` steps (a watch attached and detached within the run: :func:`_common.block_cost`);
* every watched run: each rank's alerts and switched heads, which must agree.

Each rank writes ``OUT/<run>_rank<r>.json``; rank 0 writes ``OUT/results.json`` and prints a table (and
exits 1 when no σ came back at the step compared). A new command first removes what an earlier one left in
OUT (``trainer/``, ``run/``, ``ckpt_run/``, ``*_rank*.json``, ``results.json``), nothing else.
``--share-device`` puts every rank on the first GPU (gloo: NCCL refuses two ranks on one device): the
ranks' agreement and the checkpoint on a one-GPU machine, not a speed measurement.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/hf_trainer_multi_gpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps of each timed run")
    ap.add_argument("--skip", type=int, default=20, help="steps of each timed run left out of its timing")
    ap.add_argument("--ckpt-step", type=int, default=60, help="the checkpointed run's length")
    ap.add_argument("--every", type=int, default=0,
                    help="probe/shadow/spectral cadence of the timed runs (0: WatchConfig's defaults)")
    ap.add_argument("--check-every", type=int, default=5, help="the same cadence in the checkpointed run")
    ap.add_argument("--pairs", type=int, default=0,
                    help="also one run of a warm-up block and this many pairs of watched and unwatched blocks")
    ap.add_argument("--block-steps", type=int, default=200,
                    help="steps per block of that run (200: one read-back per watched block at the defaults)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per device and step")
    ap.add_argument("--block", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide Llama (the CPU test)")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU (gloo)")
    ap.add_argument("--share-device", action="store_true",
                    help="every rank on the first GPU, gloo (agreement on a one-GPU machine; not for speed)")
    args = ap.parse_args(argv)
    for name in ("rounds", "steps", "ckpt_step", "check_every", "batch", "block"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.pairs < 0 or args.block_steps < 2:
        ap.error(f"--pairs must be >= 0 and --block-steps >= 2, got {args.pairs} and {args.block_steps}")
    if args.every < 0:
        ap.error(f"--every must be 0 (the defaults) or a positive integer, got {args.every}")
    if not 0 < args.skip < args.steps:
        ap.error(f"--skip must be in (0, --steps = {args.steps}), got {args.skip}")
    if args.cpu and args.share_device:
        ap.error("--share-device is for a GPU; --cpu puts every rank on the CPU already")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.share_device:
    # before Accelerate reads it: the device every rank takes is cuda:LOCAL_RANK
    os.environ["LOCAL_RANK"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model is built from its config: never download

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from instability_watch import InstabilityWatch, WatchConfig  # noqa: E402
from instability_watch.callbacks.hf import STATE_FILE, InstabilityWatchTrainerCallback  # noqa: E402

from _common import StepTimes, block_cost, device_name, step_cost, synced_clock  # noqa: E402
from byte_corpus import ByteWindows, stdlib_text, train_val_split  # noqa: E402

# the checkpointed run's watch: alerts on any rise of a head's multi-max frequency over its first
# observations and switches the head, so the ranks have decisions to agree on
DECIDING = dict(warmup_steps=1, sustain=1, multi_max_factor=1.0, multi_max_min_rise=0.0, auto_switch=True)


def build(tiny: bool) -> LlamaForCausalLM:
    """The Llama (float32 weights, seeded: the same on every rank and in every run)."""
    torch.manual_seed(0)
    c = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2) if tiny else \
        dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4)
    cfg = LlamaConfig(vocab_size=256, max_position_embeddings=1024, bos_token_id=0, eos_token_id=0, **c)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


class Windows(torch.utils.data.Dataset):
    """The corpus' byte windows as the Trainer's causal-LM items (the model shifts the labels)."""

    def __init__(self, data: torch.Tensor, block: int, n: int) -> None:
        self.w = ByteWindows(data, block - 1, n, seed=1)

    def __len__(self) -> int:
        return len(self.w)

    def __getitem__(self, i: int) -> dict:
        x, y = self.w[i]
        ids = torch.cat([x, y[-1:]])
        return {"input_ids": ids, "labels": ids}


class Timer(TrainerCallback):
    """Steps/s between optimizer steps ``skip`` and ``stop`` (this rank's clock, device synchronised), and
    each step's duration in between (:class:`_common.StepTimes`, the watch's cadence ``config``)."""

    def __init__(self, skip: int, stop: int, config: WatchConfig) -> None:
        self.skip, self.stop, self.t0, self.rate = skip, stop, None, None
        self.steps = StepTimes(skip, stop, config)

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.mark(state.global_step + 1)  # the step about to run, counted from 1 as the watch does

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.skip:
            self.t0 = synced_clock()
        elif state.global_step == self.stop and self.t0 is not None:
            self.rate = (self.stop - self.skip) / (synced_clock() - self.t0)


class Blocks(TrainerCallback):
    """One run in blocks of ``size`` steps (:func:`_common.block_cost`): block 0 unwatched (warm-up), then a
    watched block (a fresh ``InstabilityWatch`` at ``config`` on the Trainer's model, attached at the block's first
    step, stepped after every optimizer step, detached after its last) and an unwatched one in turn."""

    def __init__(self, size: int, steps: int, config: WatchConfig) -> None:
        self.size, self.config = size, config
        self.times = StepTimes(0, steps, config)
        self.watch = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        s = state.global_step + 1
        if ((s - 1) // self.size) % 2 == 1 and (s - 1) % self.size == 0:
            self.watch = InstabilityWatch(model, self.config)
        self.times.mark(s)

    def on_step_end(self, args, state, control, **kwargs):
        if self.watch is None:
            return
        self.watch.step()
        if state.global_step % self.size == 0:
            self.watch.detach()  # reads back what is pending first
            self.watch = None

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.detach()
            self.watch = None


class Check(TrainerCallback):
    """After the watch's callback (which puts itself right after the Trainer's flow callback): every
    read-back's sigma; the float64 reference from the weights at step ``sigma_step``; the watch state the
    run starts with."""

    def __init__(self, cb: InstabilityWatchTrainerCallback, sigma_step: int = 0) -> None:
        self.cb, self.sigma_step = cb, sigma_step
        self.sigma, self.sigma_ref, self.restored = {}, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        w = self.cb.watch
        w.listeners.append(lambda record: self.sigma.update(
            {str(m.step): m["sigma_wq"].tolist() for m in record.metrics}))
        self.restored = plain(w.state_dict())

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.sigma_step:
            # from the model's own q_proj weights, not the watch's locator: a wrong slicing of the query
            # rows per head (GQA: 12 query heads on 4 key/value heads) would show here
            model = self.cb.model
            h = model.config.num_attention_heads
            with torch.no_grad():
                self.sigma_ref = [torch.linalg.matrix_norm(
                    layer.self_attn.q_proj.weight.detach().double().reshape(h, -1, model.config.hidden_size),
                    ord=2).tolist() for layer in model.model.layers]


def plain(obj):
    """JSON's view of a state (tuples as lists, numbers as JSON writes them), to compare two states."""
    return json.loads(json.dumps(obj, default=str))


def rank_world():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def main(args) -> int:
    gpu = torch.cuda.is_available() and not args.cpu
    out = Path(args.out).resolve()
    world = int(os.environ.get("WORLD_SIZE", 1))
    # every run's TrainingArguments but its length and checkpoints (DDP without the search for unused
    # parameters, which the Trainer turns on by default: an extra graph traversal every step, both arms; the
    # Trainer's logging steps, a host sync each, away from the watch's probe steps 1, 51, 101, ...: at 50 the
    # restart after each sync was counted against the probe step after it)
    base = dict(output_dir=str(out / "trainer"), per_device_train_batch_size=args.batch, learning_rate=3e-4,
                warmup_steps=10, bf16=True, logging_steps=45, report_to=[], seed=0, disable_tqdm=True,
                dataloader_num_workers=0, save_only_model=False, use_cpu=not gpu, ddp_find_unused_parameters=False)
    if world > 1:
        base["ddp_backend"] = "gloo" if (args.cpu or args.share_device) else "nccl"
    TrainingArguments(**base).device  # sets up the process group (Accelerate), for the barrier below
    rank, world = rank_world()
    data, _ = train_val_split(stdlib_text())
    timed_cfg = WatchConfig(**({"probe_every": args.every, "shadow_every": args.every, "spectral_every": args.every,
                                "log_every": 4 * args.every} if args.every else {}))
    e = args.check_every
    check_cfg = WatchConfig(probe_every=e, shadow_every=e, spectral_every=e, log_every=2 * e, **DECIDING)

    def run(name, steps, watched, cfg=None, save=False, resume=None, sigma_step=0, run_dir=None, overwrite=True,
            blocks=0):
        """One Trainer run on every rank; writes OUT/<name>_rank<r>.json; returns this rank's record."""
        targs = dict(base, max_steps=steps, save_strategy="steps" if save else "no", save_steps=steps)
        timer = Timer(args.skip, steps, cfg or timed_cfg)
        cbs, cb, check = [timer], None, None
        in_blocks = Blocks(blocks, steps, timed_cfg) if blocks else None
        if in_blocks is not None:
            cbs.append(in_blocks)
        if watched:
            cb = InstabilityWatchTrainerCallback(cfg, run_dir=run_dir, overwrite=overwrite, alerts=False,
                                                 live_table=False)
            check = Check(cb, sigma_step)
            cbs = [cb, timer, check]
        n = (steps + 1) * args.batch * world
        trainer = Trainer(model=build(args.tiny), args=TrainingArguments(**targs),
                          train_dataset=Windows(data, args.block, n), callbacks=cbs)
        trainer.train(resume_from_checkpoint=resume)
        res = {"rate": timer.rate, "step_times": timer.steps.summary(watched),
               "blocks": block_cost(in_blocks.times.durations(), blocks, timed_cfg) if blocks else None,
               "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
               "data_parallel": trainer.args.world_size}
        if cb is not None:
            w = cb.watch
            res.update(alerts=[[a.step, a.layer, a.head, a.kind] for a in w.alerts],
                       switched=sorted([layer, head, s] for (layer, head), s in w.switched.items()),
                       steps=w.step_count, disabled=sorted(w.disabled), sigma=check.sigma,
                       sigma_ref=check.sigma_ref, restored=check.restored)
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(res, default=str))
        barrier()
        del trainer
        if gpu:
            torch.cuda.empty_cache()
        return res

    if rank == 0:  # what an earlier command left (its checkpoints must not be resumed); nothing else in OUT
        for sub in ("trainer", "run", "ckpt_run"):
            shutil.rmtree(out / sub, ignore_errors=True)
        for old in [*out.glob("*_rank*.json"), out / "results.json"]:
            old.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    barrier()
    rounds = []
    for r in range(args.rounds):
        row = {}
        for watched in ((False, True) if r % 2 == 0 else (True, False)):
            res = run(f"timed{r}_{'watched' if watched else 'unwatched'}", args.steps, watched, timed_cfg,
                      run_dir=str(out / "run"))
            kind = "watched" if watched else "unwatched"
            row[kind], row[kind + "_steps"] = res["rate"], res["step_times"]
        rounds.append(row)
    sigma_step = 1 + e * ((args.ckpt_step - 1) // e)
    run("ckpt", args.ckpt_step, True, check_cfg, save=True, sigma_step=sigma_step, run_dir=str(out / "ckpt_run"))
    ckpt = out / "trainer" / f"checkpoint-{args.ckpt_step}"
    # the checkpoint's run directory continued (overwrite=False: the callback finds the state to resume)
    run("resumed", args.ckpt_step + 2, True, check_cfg, resume=str(ckpt), run_dir=str(out / "ckpt_run"),
        overwrite=False)
    # one run in blocks, unwatched and watched in turn (after the checks: a failure here loses only this)
    in_blocks = run("blocks", args.block_steps * (1 + 2 * args.pairs), False, blocks=args.block_steps)["blocks"] \
        if args.pairs else None
    if rank != 0:
        return 0
    load = lambda name, i: json.loads((out / f"{name}_rank{i}.json").read_text())  # noqa: E731
    saved = plain(torch.load(ckpt / STATE_FILE, weights_only=False)["watch"])
    ckpt_ranks = [load("ckpt", i) for i in range(world)]
    resumed = [load("resumed", i) for i in range(world)]
    keys = ("alerts", "switched", "steps", "disabled")
    watched_runs = [[load(f"timed{r}_watched", i) for i in range(world)] for r in range(args.rounds)]
    watched_runs += [ckpt_ranks, resumed]
    got, ref = ckpt_ranks[0]["sigma"].get(str(sigma_step)), ckpt_ranks[0]["sigma_ref"]
    rel = max(abs(g - f) / f for gl, fl in zip(got, ref) for g, f in zip(gl, fl) if not math.isnan(g)) \
        if got and ref else None
    ratios = [row["watched"] / row["unwatched"] for row in rounds if row.get("watched") and row.get("unwatched")]
    result = {
        "device": device_name() if gpu else "cpu", "world_size": world, "share_device": args.share_device,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "command": " ".join(sys.argv), "rounds": rounds,
        "ratio_median": statistics.median(ratios) if ratios else None,
        "cost": step_cost(rounds), "blocks": in_blocks,
        "sigma_step": sigma_step, "sigma_max_rel_diff": rel,
        "ranks_agree": all({k: x[k] for k in keys} == {k: runs[0][k] for k in keys}
                           for runs in watched_runs for x in runs),
        "alerts": ckpt_ranks[0]["alerts"], "switched": ckpt_ranks[0]["switched"],
        "saved_state_step": saved["step"], "data_parallel": ckpt_ranks[0]["data_parallel"],
        # the checkpointed run's directory, continued by the resumed run: the steps its metrics.csv holds
        "ckpt_run_steps": sorted({int(r["step"]) for r in csv.DictReader(open(out / "ckpt_run" / "metrics.csv"))}),
        "resumed_state_equal": all(x["restored"] == saved for x in resumed),
        "resumed_alerts": resumed[0]["alerts"], "resumed_switched": resumed[0]["switched"],
    }
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    cost = result["cost"]
    fit, other, share = cost["fit_ratio"], cost["other_step_ratio"], cost["share"]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    fit_s = f"{fit['median']:.4f} [{fit['min']:.3f}-{fit['max']:.3f}]" if fit else "-"
    print(f"{'ranks':>5} {'fit ratio median [range]':<26} {'other steps':>11} {'share':>7} {'estimate':>8} "
          f"{'sigma rel':>9} {'alerts':>6} {'switched':>8} {'agree':>5} {'resume':>6}")
    print(f"{world:>5} {fit_s:<26} {fmt(other and other['median'], '.4f'):>11} "
          f"{fmt(share and 100 * share['median'], '+.2f') + '%':>7} {fmt(cost.get('estimate'), '.4f'):>8} "
          f"{fmt(rel, '.1e'):>9} {len(result['alerts']):>6} {len(result['switched']):>8} "
          f"{str(result['ranks_agree']):>5} {str(result['resumed_state_equal']):>6}")
    print("per round, watched/unwatched steps/s: " + ", ".join(
        f"{r['watched']:.2f}/{r['unwatched']:.2f}" for r in rounds if r.get("watched") and r.get("unwatched")))
    if rel is None:
        print(f"no sigma read back at step {sigma_step}, or no reference computed there", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main(ARGS)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
