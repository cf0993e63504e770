"""sigma(W_Q) under FSDP1: the watch's spectral read, from weights rebuilt in one all-reduce or per-unit gathers.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/fsdp1_sigma.py [--json out.json]

GPT-2 small (nanoGPT's GPT, 12 layers, E = 768, H = 12) wrapped by ``FullyShardedDataParallel`` per block
(``use_orig_params=True``, as Lightning's ``FSDPStrategy``), over every rank (gloo on CPU, NCCL on GPUs), an
``InstabilityWatch`` attached. Times ``watch.observation.grams()`` (what a spectral step reads; median of
``--reps``, the slowest rank, devices synchronised):

* ``whole_params``: the attention modules' weights rebuilt from every rank's flat-shard pieces, one all-reduce
  (what the watch does since 2026-11-27);
* ``unit gathers``: each block gathered with ``summon_full_params`` while its ``W_Q`` is read (the watch's way
  before, and its fallback).

The two paths' Grams are compared (relative 1e-6).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import instability_watch.observe.observation as observation
from instability_watch import InstabilityWatch, WatchConfig

from _common import device_name, init_distributed, sync, write_json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    rank, world, device = init_distributed()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from nanogpt import GPT, Block, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=1024, n_layer=args.layers, n_head=12, n_embd=768))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device, use_orig_params=True)
    watch = InstabilityWatch(model, WatchConfig())
    obs = watch.observation
    plan = observation.whole_plan

    def unit_gathers(*a, **k):
        return None  # no plan to rebuild the weights: the per-unit path

    def timed(path):
        observation.whole_plan = plan if path == "whole_params" else unit_gathers
        obs.grams()  # warm
        times = []
        for _ in range(args.reps):
            dist.barrier()
            sync(device)
            t = time.perf_counter()
            grams = obs.grams()
            sync(device)
            elapsed = torch.tensor([time.perf_counter() - t], device=device)  # NCCL takes CUDA tensors only
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
            times.append(1e3 * elapsed.item())
        return statistics.median(times), grams

    results = {"device": device_name(device), "world": world, "torch": torch.__version__, "layers": args.layers}
    ms_fast, g_fast = timed("whole_params")
    ms_units, g_units = timed("unit gathers")
    rel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(g_fast, g_units))
    results.update(whole_params_ms=ms_fast, unit_gathers_ms=ms_units, max_rel_diff=rel)
    watch.detach()
    if rank == 0:
        print(f"{results['device']}, {world} ranks, {args.layers} layers: grams() whole_params {ms_fast:.2f} ms, "
              f"unit gathers {ms_units:.2f} ms (median of {args.reps}, slowest rank); Grams max rel. diff {rel:.1e}")
        if args.json:
            write_json(args.json, results)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if rel < 1e-6 else 1


if __name__ == "__main__":
    code = main()
    # past the process group's end, out without the interpreter's teardown: on the CPU (gloo) a rank sometimes
    # aborted there ("terminate called without an active exception", SIGABRT) after its work was done and written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
