"""Reproduce BF16 flash-attention training failures at reduced scale, and time the watch's warnings.

A GPT-2-style model (``nanogpt``) trained byte-level on the
Python standard library's source (no download), BF16 autocast, AdamW (0.9,
beta2), linear warm-up then cosine decay, gradient clipping. Same seed, same
data order in every run: batch ``s`` is drawn from a generator seeded with ``(seed, s)``.

Arms (what the attention computes):

* ``standard``: PyTorch's SDPA at its default backend (cuDNN or flash on a GPU;
  the same precision model as FA2: P rounded to BF16 for P V);
* ``control``: our standard kernel, with the backward's delta = rowsum(dO * O)
  taking O in float32 (the paper's Claim 1 control; ``experimental.high_precision_delta``:
  on the GPU a pre-pass of our dQ kernel, P unrounded, checked at start against PyTorch's
  float32 attention, which it falls back to if they disagree);
* ``kernel``: our standard kernel with the ordinary delta (the control's pair: only delta differs);
* ``stabilized``: every head on our stabilized kernel (the paper's fix) from step 1.

Watch modes: ``off`` (no watch; the control and stabilized arms call our kernel
directly), ``observe`` (the watch with ``auto_switch=False``; the control and kernel
arms' layers are routed onto our kernel, the stabilized arm's heads switched), ``switch``
(``auto_switch=True``), ``switch_exact`` (``auto_switch=True, switch_to="exact_delta"``: an alerted head's layer
onto the exact delta), ``clip_alert`` and ``clip_always`` (observe, with
``qk_clip="on_alert"`` / ``"always"`` at ``--qk-clip-tau``).

Subcommands::

    # one run; running it again with the same --out resumes from its checkpoint
    python benchmarks/reproduce.py train --out runs/repro/a --arm standard --watch observe --lr 3e-3
    # several runs side by side (one process each, one GPU), then the summary
    python benchmarks/reproduce.py launch --root runs/repro --runs standard:observe,control:observe --lr 3e-3
    # per run: explosion step, first alert of each kind, lead time, head signatures
    python benchmarks/reproduce.py summarize runs/repro
    # one run on every GPU of the machine (DDP; each rank takes its share of every step's batch, so the data
    # order does not depend on the number of processes); --preset paper: the paper's run (PRESETS)
    torchrun --standalone --nproc_per_node 8 benchmarks/reproduce.py train --preset paper --out runs/paper/a
    # the same in commands of at most 10 minutes, each resuming the last (issue 27's lease)
    bash benchmarks/paper_scale.sh observe

``train`` stops at ``--steps``, at ``--time-limit`` seconds or when a file
``STOP`` appears in ``--out`` (checkpointing first, so the next command goes on), or ``--after-explosion`` steps after the
loss explodes. An explosion is the first step whose loss is not finite, or
whose smoothed loss (EMA, ``--ema``) exceeds its running minimum after the
warm-up by ``--jump`` nats (default 1). The summary also marks a
"divergence", the same rule with 0.2 nats, for losses that creep up instead.

Under ``torchrun`` rank 0 writes everything (``train.csv``, the watch's run
directory, checkpoints); at the end of each command every rank writes
``ranks/rank<r>.json`` (its alerts and switched heads, all of the run's: a
resumed rank starts from the checkpoint's watch state) so that their agreement
can be checked; ``status.json`` and those files are also written at each printed
log step (``"stopped": null`` while running), so a run cut off by the loss of its
machine keeps them. ``--micro-batch`` splits each rank's share into micro-batches
(gradient accumulation). A resumed run checks that the corpus has the size it
had.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from instability_watch import InstabilityWatch, WatchConfig, flash_attention
from instability_watch.callbacks.common import open_on_rank_zero
from instability_watch.experimental import high_precision_delta_calls
from instability_watch.outputs.rundir import RunWriter, load_run

from _common import DIVERGENCE_JUMP, ExplosionDetector, device_name, explosion_step
from byte_corpus import CORPORA, corpus_text, site_packages_files, train_val_split
from nanogpt import GPT, GPTConfig

ARMS = ("standard", "control", "kernel", "stabilized")
WATCH_MODES = ("off", "observe", "switch", "switch_exact", "clip_alert", "clip_always")
QK_CLIP = {"clip_alert": "on_alert", "clip_always": "always"}
CHECKPOINT = "checkpoint.pt"
TRAIN_CSV = "train.csv"
TRAIN_COLUMNS = ("step", "loss", "lr", "grad_norm")


@dataclass
class RunConfig:
    """Everything that defines a run (the same in every arm of a comparison)."""

    arm: str = "standard"
    watch: str = "observe"
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block: int = 512
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 500
    decay_steps: int = 20000
    min_lr: float = 1e-5
    beta2: float = 0.95
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    pos_embedding: bool = True
    corpus: str = "stdlib"          # or "site-packages" (byte_corpus)
    corpus_bytes: int = 0           # 0: all of it
    compile: bool = False           # torch.compile the model (around the watch's wrapped layers)
    watch_warmup: int = 300
    log_every: int = 10
    probe_every: int = 2
    shadow_every: int = 2
    spectral_every: int = 10
    qk_clip_tau: float = 100.0
    eps: float = 1e-3  # the tie threshold of the stabilized shift and of the multi-max count (WatchConfig.eps)

    def __post_init__(self) -> None:
        if self.arm not in ARMS:
            raise ValueError(f"arm must be one of {ARMS}, got {self.arm!r}")
        if self.watch not in WATCH_MODES:
            raise ValueError(f"watch must be one of {WATCH_MODES}, got {self.watch!r}")
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {CORPORA}, got {self.corpus!r}")


# Fields added after runs were saved: a saved config without them had these values.
_OLD_DEFAULTS = {"corpus": "stdlib", "compile": False, "eps": 1e-3}

# The paper's run (ucker/why-low-precision-training-fails, train.py, as issue 27 gives it): nanoGPT's GPT-2
# small with no bias and no dropout, 512 x 1024 = 524,288 tokens per step, AdamW (0.9, 0.95) without weight
# decay, clip 1.0, 2000 warm-up steps to 1e-3 then cosine to 1e-5 over 600K steps, BF16 autocast and
# torch.compile. What differs: byte-level text (vocabulary 256, not GPT-2's 50304 BPE tokens) from the
# installed packages' sources and docs instead of OpenWebText. The watch probes every 10th step.
PRESETS = {
    "paper": dict(n_layer=12, n_head=12, n_embd=768, block=1024, batch=512, lr=1e-3, warmup=2000,
                  decay_steps=600_000, min_lr=1e-5, beta2=0.95, weight_decay=0.0, clip=1.0,
                  corpus="site-packages", compile=True, watch_warmup=500, log_every=50, probe_every=10,
                  shadow_every=10, spectral_every=10, steps=8000, micro_batch=64, ckpt_every=240,
                  print_every=100),
}


def lr_at(cfg: RunConfig, step: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, cosine to ``min_lr`` at ``decay_steps``."""
    if step <= cfg.warmup:
        return cfg.lr * step / max(1, cfg.warmup)
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.decay_steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def batch_at(data: torch.Tensor, cfg: RunConfig, step: int, rank: int = 0, world: int = 1):
    """Batch ``step`` (the same in every run, whatever the number of processes): ``(x, y)`` of shape
    (batch / world, block) on data's device, rank ``rank``'s share of the step's ``batch`` sequences."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    offsets = torch.randint(0, len(data) - cfg.block - 1, (cfg.batch,), generator=g)
    share = cfg.batch // world
    offsets = offsets[rank * share: (rank + 1) * share].to(data.device)
    idx = offsets[:, None] + torch.arange(cfg.block + 1, device=data.device)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def use_kernel_directly(model: GPT, stabilize: bool, control: bool = False, eps: float = 1e-3) -> None:
    """Unwatched runs: every attention layer calls ``flash_attention`` itself (no watch, no routing);
    ``control``: with the backward's delta from a float32 O; ``eps``: the stabilized shift's tie threshold."""
    for block in model.h:
        attn = block.attn
        dev = attn.c_attn.weight.device
        flags = torch.ones(attn.n_head, dtype=torch.bool, device=dev) if stabilize else None

        def forward(x: torch.Tensor, attn=attn, flags=flags) -> torch.Tensor:
            B, T, C = x.shape
            q, k, v = (t.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2)
                       for t in attn.c_attn(x).split(attn.n_embd, dim=2))
            y = flash_attention(q, k, v, causal=True, stabilize=flags, high_precision_delta=control, eps=eps)
            return attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

        attn.forward = forward


def control_preflight(device: str) -> str:
    """The control's delta on this GPU: our dQ kernel's pre-pass (``"kernel"``) if its gradients match
    those of ``O`` recomputed by PyTorch in float32 on a small call, else ``"pytorch"`` (that path is then
    taken for the whole run, through ``INSTABILITY_WATCH_HP_DELTA``)."""
    if os.environ.get("INSTABILITY_WATCH_HP_DELTA") == "pytorch":
        return "pytorch (asked for by INSTABILITY_WATCH_HP_DELTA)"
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 300, 64, generator=g).to(device, torch.bfloat16) for _ in range(4))
    grads = {}
    try:
        for path in ("pytorch", "kernel"):
            os.environ["INSTABILITY_WATCH_HP_DELTA"] = path
            qq = q.clone().requires_grad_(True)
            flash_attention(qq, k, v, causal=True, high_precision_delta=True).backward(do)
            grads[path] = qq.grad.float()
        err = (grads["kernel"] - grads["pytorch"]).abs().max().item()
        ok = err <= 2 ** -7 * grads["pytorch"].abs().max().item()
        why = f"max |dQ difference| {err:.3g}"
    except Exception as exc:  # noqa: BLE001 - the run goes on with PyTorch's float32 O
        ok, why = False, f"{type(exc).__name__}: {exc}"
    path = "kernel" if ok else "pytorch"
    os.environ["INSTABILITY_WATCH_HP_DELTA"] = path
    return f"{path} ({why})"


# ---------------------------------------------------------------------------
# train


def _distributed(backend: str = "") -> Tuple[int, int, int]:
    """``(rank, gpu, world)``: started by ``torchrun`` (``WORLD_SIZE`` > 1) the process group is set up here
    (``backend``, or NCCL on GPUs and gloo on CPU), local rank ``r`` on GPU ``r`` (modulo the GPUs there are:
    gloo can run several ranks on one GPU, to test the distributed path); otherwise ``(0, 0, 1)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 0, 1
    gpu = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        gpu %= torch.cuda.device_count()
        torch.cuda.set_device(gpu)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    return dist.get_rank(), gpu, world


def _micro_batches(cfg: RunConfig, world: int, micro_batch: int) -> Tuple[int, int]:
    """``(micro, accumulate)``: sequences per forward on each rank, forwards per step on each rank
    (``micro_batch`` 0: all of the rank's sequences at once)."""
    if cfg.batch % world:
        raise SystemExit(f"error: --batch ({cfg.batch} sequences per step, all ranks) must be a multiple of the "
                         f"number of processes ({world})")
    per_rank = cfg.batch // world
    micro = min(micro_batch, per_rank) or per_rank
    if micro < 1 or per_rank % micro:
        raise SystemExit(f"error: --micro-batch must divide the sequences per rank and step ({cfg.batch} / {world} "
                         f"= {per_rank}), got {micro_batch}")
    return micro, per_rank // micro


def train(args) -> int:
    out = Path(args.out)
    rank, local_rank, world = _distributed(args.dist_backend)
    lead = rank == 0
    cfg = RunConfig(**{f.name: getattr(args, f.name) for f in fields(RunConfig)})
    micro, accumulate = _micro_batches(cfg, world, args.micro_batch)
    ckpt_path = out / CHECKPOINT
    resume = ckpt_path.exists()
    if resume:
        saved = {**_OLD_DEFAULTS, **json.loads((out / "config.json").read_text())}
        if saved != asdict(cfg):
            diff = {k: (saved.get(k), v) for k, v in asdict(cfg).items() if saved.get(k) != v}
            raise SystemExit(f"error: {out} holds a run with another configuration (saved, given): {diff}")
    _barrier(world)  # every rank has looked before rank 0 writes
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        (out / "STOP").unlink(missing_ok=True)  # a stop asked of an earlier command is done
        if not resume:  # a new run (an earlier attempt that never checkpointed leaves nothing behind)
            (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
            (out / TRAIN_CSV).unlink(missing_ok=True)
            shutil.rmtree(out / "ranks", ignore_errors=True)

    device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab_size=256, block_size=cfg.block, n_layer=cfg.n_layer, n_head=cfg.n_head,
                          n_embd=cfg.n_embd, pos_embedding=cfg.pos_embedding)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.beta2),
                            weight_decay=cfg.weight_decay, fused=device.startswith("cuda"))
    t_corpus = time.perf_counter()
    text = corpus_text(cfg.corpus, cfg.corpus_bytes or None)
    corpus = {"name": cfg.corpus, "bytes": len(text), "seconds": round(time.perf_counter() - t_corpus, 1)}
    if cfg.corpus == "site-packages":
        corpus["files_found"] = len(site_packages_files())
    data, _ = train_val_split(text)
    del text
    data = data.to(device)

    control_delta = control_preflight(device) if cfg.arm == "control" and device.startswith("cuda") else None
    if lead and control_delta:
        print(f"[{out.name}] the control's delta from a float32 O: {control_delta}", flush=True)
    watch = writer = None
    if cfg.watch == "off":
        if cfg.arm != "standard":
            use_kernel_directly(model, stabilize=cfg.arm == "stabilized", control=cfg.arm == "control", eps=cfg.eps)
    else:
        wcfg = WatchConfig(log_every=cfg.log_every, probe_every=cfg.probe_every, shadow_every=cfg.shadow_every,
                           spectral_every=cfg.spectral_every, warmup_steps=cfg.watch_warmup,
                           auto_switch=cfg.watch in ("switch", "switch_exact"), qk_clip=QK_CLIP.get(cfg.watch),
                           switch_to="exact_delta" if cfg.watch == "switch_exact" else "stabilized",
                           qk_clip_tau=cfg.qk_clip_tau, eps=cfg.eps)
        writer = RunWriter(out / "run", overwrite=not resume) if lead else None
        watch = InstabilityWatch(model, wcfg, listeners=[writer] if writer else [])
        if cfg.arm in ("control", "kernel"):  # our standard kernel everywhere, observed like any other call
            for layer in range(len(watch.head_counts)):  # the control's delta is an argument of the compiled op
                watch.observation.route(layer, high_precision_delta=cfg.arm == "control")
    exploded = ExplosionDetector(args.ema, args.jump, cfg.warmup)
    step = 0
    if resume:
        state = torch.load(ckpt_path, map_location=device, weights_only=False)
        if state.get("corpus_bytes", corpus["bytes"]) != corpus["bytes"]:
            raise SystemExit(f"error: {out} was trained on a corpus of {state['corpus_bytes']} bytes, this "
                             f"machine's {cfg.corpus} corpus has {corpus['bytes']}: not the same data")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        exploded.load_state_dict(state["explosion"])
        if watch is not None:
            watch.load_state_dict(state["watch"])
        del state
        done = ("explosion" if exploded.step is not None and step >= exploded.step + args.after_explosion
                else "steps" if step >= args.steps else None)
        if done:  # leave the finished run (its status, CSV and checkpoint) as it is
            if lead:
                print(f"[{out.name}] already stopped at step {step} ({done}; --steps {args.steps}, --after-explosion "
                      f"{args.after_explosion}): nothing to do", flush=True)
            _leave(world)
            return 0
        if lead:
            _truncate_csv(out / TRAIN_CSV, step)
    if watch is not None:
        open_on_rank_zero(writer, watch, resume_step=step if resume else None,
                          extra_meta={"reproduce": asdict(cfg), "world_size": world, "corpus": corpus})
        if cfg.arm == "stabilized" and not resume:
            for layer, n in enumerate(watch.head_counts):
                for head in range(n):
                    watch.switch(layer, head, reason="stabilized arm")
    # The watch wraps the attention layers of `model` itself; compiling and DDP go around it (nanoGPT's order).
    net = torch.compile(model) if cfg.compile else model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(net, device_ids=[local_rank] if device.startswith("cuda") else None)
    if lead:
        print(f"[{out.name}] {'resumed at step ' + str(step) if resume else 'new run'}: {asdict(cfg)}; "
              f"{world} process(es), {accumulate} x {micro} sequences per rank and step; corpus {corpus}", flush=True)

    csv = None
    if lead:
        csv_new = not (out / TRAIN_CSV).exists()
        csv = open(out / TRAIN_CSV, "a")
        if csv_new:
            csv.write(",".join(TRAIN_COLUMNS) + "\n")
    hist = torch.zeros(cfg.log_every, 2, device=device)  # per step: loss, grad norm (read back once per log step)
    hist_lr: List[float] = []
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16)
    t0 = time.perf_counter()
    t_last = t0
    start_step = step
    t_warm, warm_step = None, step
    reason = "steps"

    def save() -> None:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                 "explosion": exploded.state_dict(), "corpus_bytes": corpus["bytes"],
                 "watch": watch.state_dict() if watch is not None else None}
        if lead:
            torch.save(state, out / (CHECKPOINT + ".tmp"))
            os.replace(out / (CHECKPOINT + ".tmp"), ckpt_path)
        _barrier(world)

    def snapshot(stopped: Optional[str], t_now: float) -> dict:
        """``status.json`` (rank 0) and each rank's decisions (``ranks/``) as of now; ``stopped`` None: still
        running (written at each printed log step, so that a run cut off by its machine's loss keeps them)."""
        elapsed = t_now - t0
        status = {"step": step, "stopped": stopped, "explosion_step": exploded.step,
                  "control_delta": control_delta, "high_precision_delta_calls": high_precision_delta_calls(),
                  "seconds": round(elapsed, 1), "steps_per_s": round((step - start_step) / max(elapsed, 1e-9), 3),
                  # after the first log step (compiling and the first probe done)
                  "steps_per_s_warm": (round((step - warm_step) / (t_now - t_warm), 3)
                                       if t_warm is not None and step > warm_step else None),
                  "max_memory_gib": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                                     if device.startswith("cuda") else None),
                  "tokens_per_step": cfg.batch * cfg.block, "processes": world, "micro_batch": micro,
                  "accumulate": accumulate, "corpus": corpus,
                  "alerts": len(watch.alerts) if watch else None,
                  "switched": len(watch.switched) if watch else None, "device": device_name(device)}
        if watch is not None and world > 1:  # what each rank decided, to check that they agree
            (out / "ranks").mkdir(exist_ok=True)
            _write_json(out / "ranks" / f"rank{rank}.json", {
                "step": step, "alerts": [[a.step, a.layer, a.head, a.kind] for a in watch.alerts],
                "switched": sorted([layer, head, s] for (layer, head), s in watch.switched.items())})
        if lead:
            _write_json(out / "status.json", status)
        return status

    net.train()
    try:
        while step < args.steps:
            step += 1
            lr = lr_at(cfg, step)
            for group in opt.param_groups:
                group["lr"] = lr
            xs, ys = batch_at(data, cfg, step, rank, world)
            step_loss = torch.zeros((), device=device)
            for i in range(accumulate):
                x, y = xs[i * micro: (i + 1) * micro], ys[i * micro: (i + 1) * micro]
                # DDP all-reduces the gradients in the step's last backward only
                no_sync = net.no_sync() if world > 1 and i < accumulate - 1 else contextlib.nullcontext()
                with no_sync, autocast:
                    _, loss = net(x, y)
                    loss = loss / accumulate
                loss.backward()
                step_loss += loss.detach()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if watch is not None:
                watch.step(step_loss)
            i = len(hist_lr)  # steps since the last read-back (a resumed run may start mid-period)
            hist[i, 0] = step_loss
            hist[i, 1] = gnorm
            hist_lr.append(lr)
            if i == cfg.log_every - 1 or step == args.steps:
                now = time.perf_counter()
                # a file STOP in --out (rank 0's) stops the run like its time limit: a lease's last call decides
                stop_time = bool(args.time_limit and now - t0 > args.time_limit) or (lead and (out / "STOP").exists())
                ckpt_due = bool(args.ckpt_every and now - t_last > args.ckpt_every)
                if world > 1:  # the mean loss over ranks; every rank takes rank 0's clock's decisions
                    flags = torch.tensor([stop_time, ckpt_due], dtype=torch.float64, device=device)
                    dist.broadcast(flags, 0)
                    stop_time, ckpt_due = bool(flags[0]), bool(flags[1])
                    dist.all_reduce(hist)
                    hist[:, 0] /= world
                    hist[:, 1] /= world  # the same on every rank (clipped after DDP's all-reduce)
                rows = hist[: i + 1].tolist()  # the one host sync of this script per log step
                base = step - i
                for j, ((lv, gv), lrv) in enumerate(zip(rows, hist_lr)):
                    if csv is not None:
                        csv.write(f"{base + j},{lv:.6g},{lrv:.6g},{gv:.6g}\n")
                    exploded.update(base + j, lv)
                if csv is not None:
                    csv.flush()
                hist_lr.clear()
                if t_warm is None:  # the first log step: compiled, one probe step done
                    t_warm, warm_step = time.perf_counter(), step
                    if cfg.arm == "control" and high_precision_delta_calls() == 0:  # every rank alike
                        raise SystemExit(f"error: the control arm's backward took no delta from a float32 O in "
                                         f"{step} steps: this run would not be the control")
                if step % args.print_every < cfg.log_every:  # every rank alike: each writes its own decisions
                    snapshot(None, now)
                    if lead:
                        rate = (step - start_step) / (now - t0)
                        print(f"[{out.name}] step {step} loss {rows[-1][0]:.4f} lr {lr:.2e} "
                              f"gnorm {rows[-1][1]:.3g} {rate:.2f} steps/s", flush=True)
                if exploded.step is not None and step >= exploded.step + args.after_explosion:
                    reason = "exploded"
                    break
                if stop_time:
                    reason = "time"
                    break
                if ckpt_due:
                    if watch is not None:
                        watch.flush()
                    save()
                    t_last = now
    except BaseException:
        if csv is not None:
            csv.close()
        if watch is not None:
            if world > 1:  # a read-back is a collective the other ranks may never enter: drop it
                watch.detach(read_back=False)
            else:  # keep the observed steps in the run directory
                watch.flush()
        raise
    if csv is not None:
        csv.close()
    if watch is not None:
        watch.flush()
    t_end = time.perf_counter()
    save()
    status = snapshot(reason, t_end)  # before detaching: the ranks' decisions are read from the watch
    if watch is not None:
        watch.detach()
        if writer is not None:
            writer.close()
    if lead:
        print(f"[{out.name}] stopped ({reason}) at step {step}: {status}", flush=True)
    _leave(world)
    return 0


def _write_json(path: Path, obj) -> None:
    """``obj`` as JSON at ``path``, whole or not at all (written beside it, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _leave(world: int) -> None:
    """Every rank done, then each rank's process ends here (``os._exit``): everything is written and closed.

    Not left to the interpreter's teardown: freeing DDP's reducer drops the last reference to a gloo process
    group, whose destructor joins gloo's worker threads while holding the GIL, and a worker that is still
    freeing the barrier's work needs the GIL to drop a tensor: a deadlock (seen on CPU, about 1 launch in 10;
    the stack: ``~Reducer -> ~ProcessGroupGloo -> thread::join`` against ``~AsyncBarrierWork -> decref ->
    gil_scoped_acquire``). A barrier first does not close the race."""
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _truncate_csv(path: Path, step: int) -> None:
    """Drop the rows after ``step`` (written after the checkpoint a resumed run starts from)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = lines[:1] + [ln for ln in lines[1:] if ln.strip() and ln.split(",", 1)[0].isdigit()
                        and int(ln.split(",", 1)[0]) <= step and ln.endswith("\n")]
    path.write_text("".join(keep))


# ---------------------------------------------------------------------------
# launch


def launch(args, passthrough: List[str]) -> int:
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    procs = []
    for spec in args.runs.split(","):
        arm, _, mode = spec.partition(":")
        name = f"{arm}-{mode}" + (f"-{args.tag}" if args.tag else "")
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "train", "--out", str(out), "--arm", arm, "--watch", mode, *passthrough]
        log = open(out / "log.txt", "a")
        procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        print(f"started {name}: {' '.join(cmd[2:])}", flush=True)
    failed = []
    for name, p, log in procs:
        rc = p.wait()
        log.close()
        if rc:
            failed.append(name)
            print(f"{name} exited {rc}; last lines of its log:\n" + "".join(open(root / name / "log.txt").readlines()[-15:]))
    summarize_root(root, ema=args.ema, jump=args.jump)
    return 1 if failed else 0


# ---------------------------------------------------------------------------
# summarize


def summarize_run(run_dir: Path, ema: float, jump: float) -> Dict:
    import pandas as pd

    cfg = json.loads((run_dir / "config.json").read_text())
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
    train = pd.read_csv(run_dir / TRAIN_CSV).drop_duplicates("step", keep="last").sort_values("step")
    boom = explosion_step(zip(train["step"], train["loss"]), ema, jump, cfg["warmup"])
    # A milder mark for slow divergences (the loss creeping up rather than exploding).
    drift_up = explosion_step(zip(train["step"], train["loss"]), ema, DIVERGENCE_JUMP, cfg["warmup"])
    finite = train[train["loss"].map(math.isfinite)]
    tail = finite["loss"].tail(100)
    row = {
        "run": run_dir.name, "arm": cfg["arm"], "watch": cfg["watch"], "lr": cfg["lr"],
        "steps": int(train["step"].max()) if len(train) else 0,
        "min_loss": round(float(finite["loss"].min()), 4) if len(finite) else None,
        "last_loss": round(float(tail.mean()), 4) if len(tail) else None,
        "explosion": boom, "divergence": drift_up, "steps_per_s": status.get("steps_per_s"),
    }
    run_path = run_dir / "run"
    if (run_path / "metrics.csv").exists():
        from instability_watch.outputs.report import head_summary

        run = load_run(run_path)
        ev = run.events
        alerts = ev[ev["event"] == "alert"]
        first = alerts.groupby("kind")["step"].min().to_dict()
        row["first_alert"] = {k: int(v) for k, v in sorted(first.items(), key=lambda kv: kv[1])}
        for name, at in (("lead", boom), ("lead_divergence", drift_up)):
            if at is not None:
                row[name] = {k: at - int(v) for k, v in first.items()}
        clips = ev[ev["event"] == "qk_clip"]
        row["qk_clips"] = int(len(clips))
        row["qk_clip_heads"] = int(len(clips[["layer", "head"]].drop_duplicates())) if len(clips) else 0
        row["first_qk_clip"] = int(clips["step"].min()) if len(clips) else None
        sw = ev[(ev["event"] == "switch") & (ev["kind"] != "stabilized arm")]
        row["switched"] = int(len(sw))
        row["first_switch"] = int(sw["step"].min()) if len(sw) else None
        heads = head_summary(run)
        m = run.metrics
        # Signatures: the head whose sigma(W_Q) grew most, and the peak multi-max / logit / drift heads.
        g = heads.dropna(subset=["sigma_growth"]).sort_values("sigma_growth", ascending=False)
        if len(g):
            h = g.iloc[0]
            med = float(heads["sigma_growth"].median())
            row["sigma_top"] = f"L{int(h['layer'])}H{int(h['head'])} x{h['sigma_growth']:.2f} (median x{med:.2f})"
        early = m[m["step"] <= max(1, row["steps"] // 10)]
        late = m[m["step"] > row["steps"] - max(1, row["steps"] // 10)]
        row["multi_max_early_late"] = [round(float(early["multi_max_freq"].mean()), 5),
                                       round(float(late["multi_max_freq"].mean()), 5)]
        row["max_logit_peak"] = float(m["max_score"].replace([math.inf], float("nan")).max())
        d = heads.dropna(subset=["final_delta_cum"])
        if len(d):
            pos = int((d["final_delta_cum"] > 0).sum())
            top = d.iloc[d["final_delta_cum"].abs().argmax()]
            row["delta_cum"] = (f"{pos}/{len(d)} heads > 0; largest L{int(top['layer'])}H{int(top['head'])} "
                                f"{top['final_delta_cum']:.3g}")
    return row


def summarize_root(root: Path, ema: float = 0.05, jump: float = 1.0) -> List[Dict]:
    rows = []
    for d in sorted(p for p in Path(root).iterdir() if (p / "config.json").exists() and (p / TRAIN_CSV).exists()):
        try:
            rows.append(summarize_run(d, ema, jump))
        except Exception as exc:  # one broken run must not hide the others
            rows.append({"run": d.name, "error": f"{type(exc).__name__}: {exc}"})
    (Path(root) / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
    _plot_losses(Path(root), ema)
    for r in rows:
        print(json.dumps(r, default=str))
    return rows


def _plot_losses(root: Path, ema: float) -> None:
    """``loss.png`` in ``root``: the smoothed loss of every run against step."""
    try:
        import pandas as pd
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for d in sorted(p for p in root.iterdir() if (p / TRAIN_CSV).exists()):
        t = pd.read_csv(d / TRAIN_CSV).drop_duplicates("step", keep="last").sort_values("step")
        ax.plot(t["step"], t["loss"].ewm(alpha=ema).mean(), label=d.name, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (EMA {ema})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "loss.png", dpi=110)


# ---------------------------------------------------------------------------
# bundle


def bundle(root: Path, dest: Path, every: int) -> Path:
    """A ``.tar.xz`` of a launch root small enough to carry: everything but checkpoints, the
    per-head metrics.csv kept every ``every`` steps (alert and switch steps are in events.csv;
    a THINNED.txt beside it says so), and each watched run's report plots (drawn from the full metrics)."""
    import tarfile
    import tempfile

    import pandas as pd

    from instability_watch.outputs.report import write_plots

    root = Path(root)
    with tempfile.TemporaryDirectory() as tmp:
        for d in sorted(p for p in root.iterdir() if p.is_dir()):
            if (d / "run" / "metrics.csv").exists():
                try:
                    write_plots(load_run(d / "run"), Path(tmp) / d.name / "plots")
                except Exception as exc:  # plots are a convenience: keep the data
                    print(f"{d.name}: no plots ({type(exc).__name__}: {exc})")
        with tarfile.open(dest, "w:xz") as tar:
            for f in sorted(root.rglob("*")):
                rel = f.relative_to(root)
                if not f.is_file() or f.name.startswith(CHECKPOINT):
                    continue
                if f.name == "events.csv" and every > 1:
                    ev = pd.read_csv(f)
                    clip = ev["event"] == "qk_clip"
                    first = ~ev[clip].duplicated(["layer", "head"])  # each head's first clip is kept
                    keep = ~clip | ((ev["step"] - 1) % every == 0)
                    keep[first[first].index] = True
                    if (~keep).any():
                        thin = Path(tmp) / "thin_events.csv"
                        ev[keep].to_csv(thin, index=False)
                        tar.add(thin, arcname=str(rel))
                        note = Path(tmp) / "THINNED_EVENTS.txt"
                        note.write_text(f"events.csv keeps every alert and switch, each head's first qk_clip, and the "
                                        f"qk_clip rows of steps 1, 1 + {every}, ... ({int(clip.sum())} clips in all)\n")
                        tar.add(note, arcname=str(rel.parent / "THINNED_EVENTS.txt"))
                        continue
                    tar.add(f, arcname=str(rel))
                elif f.name == "metrics.csv" and every > 1:
                    m = pd.read_csv(f)
                    m = m[(m["step"] - 1) % every == 0]
                    thin = Path(tmp) / "thin.csv"
                    m.to_csv(thin, index=False, float_format="%.6g", na_rep="nan")
                    tar.add(thin, arcname=str(rel))  # same name: load_run and the report read it
                    note = Path(tmp) / "THINNED.txt"
                    note.write_text(f"metrics.csv keeps steps 1, 1 + {every}, ... of the run's (every row of events.csv)\n")
                    tar.add(note, arcname=str(rel.parent / "THINNED.txt"))
                else:
                    tar.add(f, arcname=str(rel))
            for f in sorted(Path(tmp).rglob("*.png")):
                tar.add(f, arcname=str(f.relative_to(tmp)))
    return dest


# ---------------------------------------------------------------------------


def _add_run_args(ap: argparse.ArgumentParser, with_arm: bool) -> None:
    d = RunConfig()
    for f in fields(RunConfig):
        if f.name in ("arm", "watch") and not with_arm:
            continue
        default = getattr(d, f.name)
        if isinstance(default, bool):
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=lambda s: s.lower() in ("1", "true", "yes"),
                            default=default, metavar="BOOL")
        elif f.name in ("arm", "watch", "corpus"):
            choices = {"arm": ARMS, "watch": WATCH_MODES, "corpus": CORPORA}[f.name]
            ap.add_argument(f"--{f.name}", choices=choices, default=default)
        else:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    ap.add_argument("--steps", type=int, default=20000, help="stop after this step")
    ap.add_argument("--time-limit", type=float, default=0, help="seconds; checkpoint and stop (0: none)")
    ap.add_argument("--ckpt-every", type=float, default=120, help="seconds between checkpoints (0: at the end only)")
    ap.add_argument("--after-explosion", type=int, default=300, help="steps to go on after an explosion")
    ap.add_argument("--print-every", type=int, default=500)
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="sequences per forward on each process (gradient accumulation; 0: the process's whole share)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="defaults for a named setup; options given explicitly override them (paper: issue 27's run)")
    ap.add_argument("--dist-backend", default="", help="under torchrun: the process group's backend "
                    "(default nccl on GPUs, gloo on CPU; gloo lets several ranks share one GPU)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="one run (resumes from --out's checkpoint)")
    t.add_argument("--out", required=True)
    _add_run_args(t, with_arm=True)
    t.add_argument("--ema", type=float, default=0.05)
    t.add_argument("--jump", type=float, default=1.0)
    la = sub.add_parser("launch", help="several runs side by side, then summarize (other options go to train)")
    la.add_argument("--root", required=True)
    la.add_argument("--runs", required=True, help="comma-separated ARM:WATCH, e.g. standard:observe,control:observe")
    la.add_argument("--tag", default="", help="suffix of the run directories' names")
    la.add_argument("--preset", choices=sorted(PRESETS), default=None, help="passed on to train")
    la.add_argument("--ema", type=float, default=0.05)
    la.add_argument("--jump", type=float, default=1.0)
    s = sub.add_parser("summarize", help="the table of a launch root")
    s.add_argument("root")
    s.add_argument("--ema", type=float, default=0.05)
    s.add_argument("--jump", type=float, default=1.0)
    b = sub.add_parser("bundle", help="a .tar.xz of a launch root without checkpoints, metrics thinned")
    b.add_argument("root")
    b.add_argument("dest")
    b.add_argument("--every", type=int, default=10, help="keep the metrics of steps 1, 1 + every, ...")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default=None)
    preset, _ = pre.parse_known_args(argv)
    if preset.preset:
        t.set_defaults(**PRESETS[preset.preset])
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "bundle":
        if rest:
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
        print(bundle(Path(args.root), Path(args.dest), args.every))
        return 0
    if args.cmd == "train":
        if rest:
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
        return train(args)
    if args.cmd == "launch":
        for spec in args.runs.split(","):
            arm, _, mode = spec.partition(":")
            if arm not in ARMS or mode not in WATCH_MODES:
                ap.error(f"--runs entries must be ARM:WATCH with ARM in {ARMS} and WATCH in {WATCH_MODES}, got {spec!r}")
        rest += ["--preset", args.preset] if args.preset else []
        return launch(args, rest + ["--ema", str(args.ema), "--jump", str(args.jump)])
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    summarize_root(Path(args.root), args.ema, args.jump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
