"""sigma(W_Q) under FSDP2: gather the weights, or gather the per-head Grams (what the watch does)?

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/sharded_sigma.py [--json out.json]

A GPT-2-small-sized model's query weights (12 layers, E = 768, H = 12; the fused
nanoGPT ``c_attn`` (3E, E) and a Llama-style ``q_proj`` (E, E)), sharded with
``fully_shard`` (``Shard(0)``) over every rank (gloo on CPU, NCCL on GPUs). Times,
per spectral step for all 12 layers (median of ``--reps``, the slowest rank):

* ``gather W``: ``full_tensor()`` of each layer's ``(H, D, d_in)`` view, then the Grams;
* ``gather Grams`` (``spectral.gram``): the Grams computed where the rows are and
  gathered (``H * D * D`` numbers per layer).

Both are checked against the unsharded Grams (relative 1e-5).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from instability_watch.probe.spectral import gram

from _common import device_name, init_distributed, sync, write_json

L, E, H = 12, 768, 12
D = E // H


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    args = ap.parse_args()
    rank, world, device = init_distributed()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    results = {"device": device_name(device), "world": world, "torch": torch.__version__}
    for layout, rows in (("fused c_attn (3E, E)", 3 * E), ("q_proj (E, E)", E)):
        torch.manual_seed(0)
        layers = nn.ModuleList(nn.Linear(E, rows, bias=False) for _ in range(L)).to(device)
        full = [lin.weight.detach().clone()[:E].view(H, D, E) for lin in layers]
        expect = [w.double() @ w.double().transpose(1, 2) for w in full]
        for lin in layers:
            fully_shard(lin, mesh=mesh)
        views = [lambda lin=lin: lin.weight[:E].view(H, D, E) for lin in layers]

        def gather_w():
            out = []
            for v in views:
                w = v().detach().full_tensor().float()
                out.append(w @ w.transpose(1, 2))
            return out

        def gather_grams():
            return [gram(v().detach()) for v in views]

        row = {}
        for name, fn in (("gather W", gather_w), ("gather Grams", gather_grams)):
            got = fn()
            err = max(((g.double() - e).abs().max() / e.abs().max()).item() for g, e in zip(got, expect))
            times = []
            for _ in range(args.reps):
                dist.barrier()
                sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                times.append(time.perf_counter() - t0)
            ms = torch.tensor(statistics.median(times) * 1e3, dtype=torch.float64, device=device)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            row[name] = {"ms": round(ms.item(), 3), "max_rel_err": err}
        results[layout] = row
    if rank == 0:
        print(json.dumps(results, indent=1))
        print(f"{'layout':<22}{'gather W ms':>14}{'gather Grams ms':>18}")
        for layout in ("fused c_attn (3E, E)", "q_proj (E, E)"):
            r = results[layout]
            print(f"{layout:<22}{r['gather W']['ms']:>14.2f}{r['gather Grams']['ms']:>18.2f}")
        if args.json:
            write_json(args.json, results)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
