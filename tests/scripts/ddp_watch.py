"""Two CPU processes (gloo) run the watch on different data; each rank writes its decisions as JSON.

Usage: python ddp_watch.py OUT_DIR PORT CASE [CASE ...]

CASE is ``NAME`` or ``NAME:FAIL_RANK:FAIL_STEP`` (the watch's statistics fail on that rank from that step on);
the cases run one after the other in the same two processes and process group (one launch: starting processes
dominates on CPU), each writing ``OUT_DIR/NAME/rank<r>.json``.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def run(rank, out_dir, fail_rank, fail_step):
    from instability_watch import InstabilityWatch, WatchConfig

    from watch_models import TiedAttention, tied_batch, tied_loss

    torch.manual_seed(0)
    model = TiedAttention()
    cfg = WatchConfig(probe_every=1, log_every=5, shadow_every=1, spectral_every=5, warmup_steps=5, sustain=3, auto_switch=True)
    watch = InstabilityWatch(model, cfg, layers=model.layers())
    if rank == fail_rank:
        original = watch.ring.next_row

        def next_row(device):  # recording a step's row fails on this rank from fail_step on
            if watch.step_count >= fail_step:
                raise RuntimeError("injected failure")
            return original(device)

        watch.ring.next_row = next_row
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for i in range(40):
        o = model(*tied_batch(2 * i + rank))  # each rank its own data
        loss = tied_loss(o)
        loss.backward()
        for p in model.parameters():  # what DDP does to gradients
            dist.all_reduce(p.grad)
            p.grad /= 2
        opt.step()
        opt.zero_grad()
        watch.step(loss)
    watch.detach()
    result = {
        "switched": sorted([l, h, s] for (l, h), s in watch.switched.items()),
        "alerts": [[a.step, a.layer, a.head, a.kind] for a in watch.alerts],
        "disabled": sorted(watch.disabled),
        "steps": watch.step_count,
        "last_loss": watch.last_metrics[-1].loss if watch.last_metrics else None,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_all(rank, out_dir, port, cases):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for case in cases:
        name, *fail = case.split(":")
        fail_rank, fail_step = map(int, fail) if fail else (-1, 0)
        run(rank, os.path.join(out_dir, name), fail_rank, fail_step)
        dist.barrier()
    dist.destroy_process_group()
    # Every result is written and the group is gone: leave without the interpreter's teardown, where a
    # gloo thread still joinable has once (1 run in ~50) ended a rank in std::terminate after all the
    # work was done ("terminate called without an active exception"). os._exit skips only that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    out_dir, port, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    for case in cases:
        os.makedirs(os.path.join(out_dir, case.split(":")[0]), exist_ok=True)
    mp.spawn(run_all, args=(out_dir, port, cases), nprocs=2, join=True)
