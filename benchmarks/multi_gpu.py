"""Issue 26 in one command: the watch under Lightning DDP and FSDP on several devices, watched vs unwatched.

For each model and strategy, in the same processes (Lightning launches the other ranks at the first fit):

* ``--rounds`` rounds of two fits of ``--steps`` optimizer steps, unwatched and watched
  (``InstabilityWatchCallback`` at the ``WatchConfig`` defaults unless ``--every``; the order swapped
  every round); steps/s between steps ``--skip`` and ``--steps`` on rank 0 (devices synchronised);
* a watched fit to step ``--ckpt-step`` with a checkpoint there, its watch deciding (every ``--check-every``
  steps; an alert on any rise of a head's multi-max frequency, and the head switched: decisions for the ranks
  to agree on): σ(W_Q) per head of its last spectral step
  against σ computed in float64 from the whole weights at that step (``torch.linalg.matrix_norm`` of each
  head's rows; gathered first where sharded); then the checkpoint resumed: the watch's state at the
  resumed fit's start equals the one in the checkpoint, on every rank;
* with ``--pairs``, one fit of a warm-up block and ``--pairs`` pairs of a watched and an unwatched block of
  ``--block-steps`` steps (a watch attached and detached within the fit: :func:`_common.block_cost`), so both
  kinds of step are timed in one fit, alternating, under the same drift;
* every watched fit: each rank's alerts and switched heads, which must agree.

Models: ``gpt2-small`` (nanoGPT's GPT 12/12/768, context 1024, byte-level, as ``examples/train_gpt2.py
--preset gpt2-small``) and ``llama-1b`` (an HF Llama of 1.1B parameters with GQA, 32 query and 4 key/value
heads: TinyLlama's shape, built from its config); both read real text (the standard library's source,
byte-level). Strategies: ``ddp``; ``fsdp2`` (``ModelParallelStrategy``, ``fully_shard`` on every block
and the root); ``fsdp1`` (``FSDPStrategy`` wrapping every block; GPUs only). ``--tiny`` shrinks the models
for the CPU test. Rank 0 writes ``OUT/results.json`` after every case and prints a table. With one device a
failing case is recorded and the next one runs; with several the error goes to ``OUT/error_rank<r>.json``
and the command stops. An ``fsdp1`` case leaves GPU memory allocated in its processes (about the model and
its optimizer state; not found yet): keep it last (the default order), or give llama-1b's cases a command
each.

Run (from the repository root):
    python benchmarks/multi_gpu.py --devices 2 --models gpt2-small --out runs/multi_gpu
    python benchmarks/multi_gpu.py --devices 2 --models llama-1b --out runs/multi_gpu_llama
    python benchmarks/multi_gpu.py --accelerator cpu --devices 2 --tiny --strategies ddp,fsdp2 ...   # CPU, gloo
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from instability_watch import InstabilityWatch, InstabilityWatchCallback, WatchConfig

from _common import StepTimes, block_cost, device_name, step_cost, synced_clock
from byte_corpus import ByteWindows, stdlib_text, train_val_split

MODELS = ("gpt2-small", "llama-1b")
_RANK = [0]  # this process's rank, from the last fit
STRATEGIES = ("ddp", "fsdp2", "fsdp1")


_BUILT = {}

# the checkpointed fit's watch: alerts on any rise of a head's multi-max frequency over its first observations
# and switches the head, so the ranks have decisions to agree on (each rank alone would decide from its own
# batches; they agree only through the watch's reduction)
DECIDING = dict(warmup_steps=1, sustain=1, multi_max_factor=1.0, multi_max_min_rise=0.0, auto_switch=True)


def build(model: str, tiny: bool) -> torch.nn.Module:
    """A fresh copy of the model (float32, seeded: the same weights on every rank and in every fit)."""
    if (model, tiny) not in _BUILT:
        _BUILT[model, tiny] = _build(model, tiny)
    return copy.deepcopy(_BUILT[model, tiny])


def _build(model: str, tiny: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if model == "gpt2-small":
        from nanogpt import GPT, GPTConfig

        c = dict(n_layer=2, n_head=2, n_embd=32, block_size=64) if tiny else \
            dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)
        return GPT(GPTConfig(vocab_size=256, **c))
    from transformers import LlamaConfig, LlamaForCausalLM

    c = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2) if tiny else \
        dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4)
    cfg = LlamaConfig(vocab_size=256 if tiny else 32000, max_position_embeddings=2048, **c)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def blocks(net: torch.nn.Module):
    return list(net.h) if hasattr(net, "h") else list(net.model.layers)


class Net(pl.LightningModule):
    def __init__(self, model: str, tiny: bool, strategy: str) -> None:
        super().__init__()
        self.name, self.strategy_name = model, strategy
        self.net = build(model, tiny)

    def configure_model(self) -> None:
        if self.strategy_name == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for b in blocks(self.net):
                fully_shard(b, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.name == "gpt2-small":
            return self.net(x, y)[1]
        return self.net(input_ids=x, labels=x).loss  # HF shifts the labels itself

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)


class Timer(pl.Callback):
    """Steps/s between optimizer steps ``skip`` and ``stop`` (this rank's clock, devices synchronised), and
    each step's duration in between (:class:`_common.StepTimes`, the watch's cadence ``config``)."""

    def __init__(self, skip: int, stop: int, config: WatchConfig) -> None:
        self.skip, self.stop, self.t0, self.rate = skip, stop, None, None
        self.steps = StepTimes(skip, stop, config)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.mark(trainer.global_step + 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.skip:
            self.t0 = synced_clock()
        elif trainer.global_step == self.stop and self.t0 is not None:
            self.rate = (self.stop - self.skip) / (synced_clock() - self.t0)


class Blocks(pl.Callback):
    """One fit in blocks of ``size`` steps (:func:`_common.block_cost`): block 0 unwatched (warm-up), then a
    watched block (a fresh ``InstabilityWatch`` at ``config`` attached at its first step, stepped after every
    optimizer step, detached after its last) and an unwatched one in turn; each step's duration
    (:class:`_common.StepTimes`)."""

    def __init__(self, size: int, steps: int, config: WatchConfig) -> None:
        self.size, self.config = size, config
        self.times = StepTimes(0, steps, config)
        self.watch = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        s = trainer.global_step + 1
        if ((s - 1) // self.size) % 2 == 1 and (s - 1) % self.size == 0:
            self.watch = InstabilityWatch(pl_module, self.config)
            wrapper = getattr(trainer.strategy, "model", None)
            if isinstance(wrapper, torch.nn.Module) and wrapper is not pl_module:
                self.watch.sharding_roots = [wrapper]  # FSDPStrategy's units sit above the module
        self.times.mark(s)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.watch is None:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.watch.step(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        if trainer.global_step % self.size == 0:
            self.watch.detach()  # reads back what is pending first
            self.watch = None

    def on_train_end(self, trainer, pl_module):
        if self.watch is not None:
            self.watch.detach()
            self.watch = None


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def query_rows(net: torch.nn.Module):
    """Per layer, the query projection's rows per head, ``(H, head_dim, d_model)``, read from the model's
    own weights (gathered where FSDP2 shards them; FSDP1's are whole inside ``summon_full_params``)."""
    out = []
    for b in blocks(net):
        if hasattr(b, "attn"):  # nanoGPT: c_attn holds q, k, v one after the other
            w = _full(b.attn.c_attn.weight.detach())
            e, h = w.shape[1], b.attn.n_head
            out.append(w[:e].reshape(h, e // h, e))
        else:  # HF Llama
            w = _full(b.self_attn.q_proj.weight.detach())
            h = net.config.num_attention_heads
            out.append(w.reshape(h, w.shape[0] // h, w.shape[1]))
    return out


class Check(pl.Callback):
    """Put after the watch's callback. Collects every read-back's sigma; at step ``sigma_step`` computes the
    float64 reference from the whole weights; keeps the watch state a checkpoint holds (``saved``) and the
    one a resumed fit starts with (``restored``)."""

    def __init__(self, cb: InstabilityWatchCallback, sigma_step: int = 0) -> None:
        self.cb, self.sigma_step = cb, sigma_step
        self.sigma = {}            # step -> (L, H) sigma read back
        self.sigma_ref = None      # per layer, per head
        self.saved = self.restored = None

    def on_train_start(self, trainer, pl_module):
        w = self.cb.watch
        w.listeners.append(lambda record: self.sigma.update(
            {m.step: m["sigma_wq"].tolist() for m in record.metrics}))
        self.restored = _plain(w.state_dict())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.sigma_step:
            return
        strategy = trainer.strategy
        ctx = None
        if type(strategy).__name__ == "FSDPStrategy":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            ctx = FSDP.summon_full_params(strategy.model, writeback=False)
        with ctx if ctx is not None else torch.no_grad():
            # from the model's own projection weights, not the watch's locator: a wrong slicing of the
            # query rows per head would show here
            self.sigma_ref = [torch.linalg.matrix_norm(q.double(), ord=2).tolist() for q in query_rows(pl_module.net)]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        for key, state in checkpoint.get("callbacks", {}).items():
            if key.startswith("InstabilityWatchCallback"):
                self.saved = _plain(state["watch"])


def _plain(obj):
    """JSON's view of a state (tuples as lists, numbers as JSON writes them), to compare two states."""
    return json.loads(json.dumps(obj, default=str))


def decisions(cb: InstabilityWatchCallback) -> dict:
    w = cb.watch
    return {"alerts": [[a.step, a.layer, a.head, a.kind] for a in w.alerts],
            "switched": sorted([layer, head, s] for (layer, head), s in w.switched.items()),
            "steps": w.step_count, "disabled": sorted(w.disabled)}


def strategy_for(name: str, model: str, devices: int):
    if name == "ddp":
        return "ddp"
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # a data-parallel mesh of every device ("auto" would put them on the tensor-parallel dimension:
        # the same batches on every rank, and fully_shard over a mesh of one)
        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    from lightning.pytorch.strategies import FSDPStrategy

    if model == "gpt2-small":
        from nanogpt import Block as block
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as block
    return FSDPStrategy(auto_wrap_policy={block})


def run_case(args, model: str, strat: str, data, out: Path) -> dict:
    cfg = WatchConfig(**({"probe_every": args.every, "shadow_every": args.every, "spectral_every": args.every,
                          "log_every": 4 * args.every} if args.every else {}))
    loader = lambda n: DataLoader(ByteWindows(data, args.block, n * args.batch * args.devices, seed=1),  # noqa: E731
                                  batch_size=args.batch)

    e = args.check_every
    check_cfg = WatchConfig(probe_every=e, shadow_every=e, spectral_every=e, log_every=2 * e, **DECIDING)

    def fit(name, steps, watched, ckpt=None, resume=None, sigma_step=0, run_dir=None, config=None, blocks=0):
        """One fit; every rank writes OUT/<name>_rank<r>.json (then all wait), rank 0 gets the rates."""
        config = config or cfg
        module = Net(model, args.tiny, strat)
        cbs, cb, check = [Timer(args.skip, steps, config)], None, None
        if blocks:
            cbs.append(Blocks(blocks, steps, config))
        if watched:
            # run_dir None: a resumed fit continues the directory its checkpoint names
            cb = InstabilityWatchCallback(config, run_dir=run_dir, overwrite=run_dir is not None, alerts=False,
                                          live_table=False)
            check = Check(cb, sigma_step)
            cbs += [cb, check]
        if ckpt:
            cbs.append(ModelCheckpoint(dirpath=ckpt, every_n_train_steps=args.ckpt_step, save_top_k=-1))
        trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices,
                             strategy=strategy_for(strat, model, args.devices), precision="bf16-mixed", max_steps=steps,
                             callbacks=cbs, logger=False, enable_checkpointing=bool(ckpt),
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out))
        trainer.fit(module, loader(steps), ckpt_path=resume)
        # the sampler's number of replicas: each rank trains on its own share of the batches
        res = {"rate": cbs[0].rate, "step_times": cbs[0].steps.summary(watched),
               "blocks": block_cost(cbs[1].times.durations(), blocks, config) if blocks else None,
               "data_parallel": (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get(
                   "num_replicas", 1)}
        if cb is not None:
            res.update(decisions(cb), sigma=check.sigma, sigma_ref=check.sigma_ref, saved=check.saved,
                       restored=check.restored)
        _write(out / f"{name}_rank{trainer.global_rank}.json", res)
        trainer.strategy.barrier()
        _RANK[0] = trainer.global_rank
        # the next fit builds its own model and optimizer: free this one's (a trainer and its module refer
        # to each other, so only the collector frees them)
        del trainer, module, cb, check, cbs
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return res

    case = {"model": model, "strategy": strat, "rounds": []}
    for r in range(args.rounds):
        row = {}
        for watched in ((False, True) if r % 2 == 0 else (True, False)):
            res = fit(f"timed{r}_{'watched' if watched else 'unwatched'}", args.steps, watched,
                      run_dir=str(out / "run"))
            kind = "watched" if watched else "unwatched"
            row[kind], row[kind + "_steps"] = res["rate"], res["step_times"]
        case["rounds"].append(row)
    # the checkpointed fit; sigma at its last spectral step before the checkpoint
    every = check_cfg.spectral_every
    sigma_step = 1 + every * ((args.ckpt_step - 1) // every)
    ckpt_dir = out / "ckpt"
    if _rank() == 0:  # a checkpoint left by a command cut short must not be the one resumed
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    fit("ckpt", args.ckpt_step, True, ckpt=str(ckpt_dir), sigma_step=sigma_step, run_dir=str(out / "ckpt_run"),
        config=check_cfg)
    path = next(iter(sorted(ckpt_dir.glob(f"*step={args.ckpt_step}*"))), None)
    if path is None:
        raise RuntimeError(f"no checkpoint of step {args.ckpt_step} in {ckpt_dir}")
    fit("resumed", args.ckpt_step + 2, True, resume=str(path), config=check_cfg)
    if args.pairs:  # one fit in blocks, unwatched and watched in turn (after the checks: a failure here loses
        # only this measurement)
        try:
            res = fit("blocks", args.block_steps * (1 + 2 * args.pairs), False, blocks=args.block_steps)
            case["blocks"] = res["blocks"]
        except Exception as exc:  # noqa: BLE001 - e.g. a watch that cannot attach mid-fit: on every rank alike
            case["blocks"] = {"error": f"{type(exc).__name__}: {exc}"}
    rank = _rank()
    if rank == 0 and not args.keep_checkpoints:  # 13 GB for llama-1b with AdamW: the next cases need the disk
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if rank == 0:
        world = args.devices
        ranks = [json.loads((out / f"ckpt_rank{i}.json").read_text()) for i in range(world)]
        resumed = [json.loads((out / f"resumed_rank{i}.json").read_text()) for i in range(world)]
        timed = [[{k: v for k, v in json.loads((out / f"timed{r}_watched_rank{i}.json").read_text()).items()
                   if k in ("alerts", "switched", "steps", "disabled")} for i in range(world)]
                 for r in range(args.rounds)]
        got = ranks[0]["sigma"].get(str(sigma_step)) or ranks[0]["sigma"].get(sigma_step)
        ref = ranks[0]["sigma_ref"]
        rel = max(abs(g - f) / f for gl, fl in zip(got, ref) for g, f in zip(gl, fl) if not math.isnan(g)) \
            if got and ref else None
        ratios = [row["watched"] / row["unwatched"] for row in case["rounds"]
                  if row.get("watched") and row.get("unwatched")]
        case.update({
            "ratio_median": statistics.median(ratios) if ratios else None,
            "cost": step_cost(case["rounds"]),
            "sigma_step": sigma_step, "sigma_max_rel_diff": rel,
            "ranks_agree": all(t[i] == t[0] for t in timed for i in range(world))
            and all({k: x[k] for k in ("alerts", "switched")} == {k: run[0][k] for k in ("alerts", "switched")}
                    for run in (ranks, resumed) for x in run),
            "alerts": ranks[0]["alerts"], "switched": ranks[0]["switched"],
            "resumed_state_equal": all(x["restored"] == y["saved"] for x, y in zip(resumed, ranks)),
            "saved_state_steps": ranks[0]["saved"]["step"] if ranks[0]["saved"] else None,
            "data_parallel": ranks[0]["data_parallel"],
        })
    return case


def _rank() -> int:
    """This process's rank: the process group's once a fit set it up, else the last fit's."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return _RANK[0]


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def cost_line(cost: dict) -> str:
    """One row's timing columns (``step_cost``'s dict): fit ratio median [min-max], other-step ratio,
    share, estimate."""
    fit, other, share = cost.get("fit_ratio"), cost.get("other_step_ratio"), cost.get("share")
    fit_s = f"{fit['median']:.4f} [{fit['min']:.3f}-{fit['max']:.3f}]" if fit else "-"
    return (f"{fit_s:<26} {_fmt(other and other['median'], '.4f'):>11} "
            f"{_fmt(share and 100 * share['median'], '+.2f') + '%':>7} {_fmt(cost.get('estimate'), '.4f'):>8}")


def _write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=220, help="optimizer steps of each timed fit")
    ap.add_argument("--skip", type=int, default=20, help="steps of each timed fit left out of its timing")
    ap.add_argument("--ckpt-step", type=int, default=60, help="the checkpointed fit's length")
    ap.add_argument("--pairs", type=int, default=0,
                    help="also one fit of a warm-up block and this many pairs of watched and unwatched blocks")
    ap.add_argument("--block-steps", type=int, default=200,
                    help="steps per block of that fit (200: one read-back per watched block at the defaults)")
    ap.add_argument("--every", type=int, default=0,
                    help="probe/shadow/spectral cadence of the timed fits (0: WatchConfig's defaults)")
    ap.add_argument("--check-every", type=int, default=5,
                    help="the same cadence in the checkpointed fit, whose watch alerts on any rise and switches")
    ap.add_argument("--batch", type=int, default=0, help="sequences per device and step (0: 16 gpt2-small, 4 llama-1b)")
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="tiny models (the CPU test)")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep each case's checkpoint (default: deleted)")
    ap.add_argument("--out", default="runs/multi_gpu")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    strategies = args.strategies.split(",")
    for name, got, allowed in (("--models", models, MODELS), ("--strategies", strategies, STRATEGIES)):
        bad = [x for x in got if x not in allowed]
        if bad:
            ap.error(f"{name} takes a comma-separated subset of {allowed}, got {bad}")
    if args.accelerator == "cpu" and "fsdp1" in strategies:
        ap.error("--strategies fsdp1 needs GPUs (Lightning's FSDPStrategy refuses the CPU)")
    if not 0 < args.skip < args.steps:
        ap.error(f"--skip must be in (0, --steps = {args.steps}), got {args.skip}")
    if args.pairs < 0 or args.block_steps < 2:
        ap.error(f"--pairs must be >= 0 and --block-steps >= 2, got {args.pairs} and {args.block_steps}")
    data, _ = train_val_split(stdlib_text())
    out = Path(args.out)
    cases = []
    for model in models:
        batch = args.batch or (16 if model == "gpt2-small" else 4)
        for strat in strategies:
            a = argparse.Namespace(**{**vars(args), "batch": batch})
            t = time.perf_counter()
            try:
                case = run_case(a, model, strat, data, out / f"{model}-{strat}")
            except Exception as exc:
                case = {"model": model, "strategy": strat, "error": f"{type(exc).__name__}: {exc}"}
                if args.devices > 1:
                    # the other ranks may be waiting in this case's collectives: record the error where it
                    # happened and stop (going on to the next case would pair the ranks' collectives wrongly)
                    _write(out / f"error_rank{_rank()}.json", case)
                    raise
            case["seconds"] = round(time.perf_counter() - t, 1)
            cases.append(case)
            if _rank() == 0:  # after every case: a command cut short keeps what it measured
                _write(out / "results.json", {
                    "device": device_name() if args.accelerator == "gpu" else "cpu", "devices": args.devices,
                    "torch": torch.__version__, "lightning": pl.__version__, "command": " ".join(sys.argv),
                    "cases": cases})
    if _rank() == 0:
        print(f"{'model':<11} {'strategy':<8} {'fit ratio median [range]':<26} {'other steps':>11} "
              f"{'share':>7} {'estimate':>8} {'sigma rel':>9} {'ranks':>5} {'resume':>6}")
        for c in cases:
            if "error" in c:
                print(f"{c['model']:<11} {c['strategy']:<8} ERROR {c['error'][:200]}")
                continue
            print(f"{c['model']:<11} {c['strategy']:<8} {cost_line(c.get('cost') or {})} "
                  f"{_fmt(c.get('sigma_max_rel_diff'), '.1e'):>9} {str(c['ranks_agree']):>5} "
                  f"{str(c['resumed_state_equal']):>6}")
        print("fit ratio: watched/unwatched steps/s of whole fits; other steps: unwatched/watched median duration of "
              "the steps between probe and read-back steps; share: the probe and read-back steps' time beyond "
              "that, in the watched fits; estimate: other steps x (1 - share)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
