"""Where the time of a GPT-2-small training step goes: top GPU kernels per variant (torch.profiler).

Companion of ``watch_overhead.py``: same model and variants, one profiled step
each after warm-up. Run:  python benchmarks/step_profile.py [--batch 16] [--top 12]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from instability_watch import WatchConfig  # noqa: E402
from instability_watch.nanogpt import GPT, GPTConfig  # noqa: E402
from watch_overhead import VARIANTS, make_variant, train_step  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)).cuda()
    x = torch.randint(0, 256, (args.batch, 1025), device="cuda")
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    for name in VARIANTS:
        v = make_variant(base, name, WatchConfig(log_every=1000))

        def step():
            train_step(v, name, inp, tgt)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in events)
        print(f"\n== {name}: GPU kernel time {total / 1e3:.2f} ms per step")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
            print(f"  {e.self_device_time_total / 1e3:8.3f} ms  {e.count:5d}x  {e.key[:90]}")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
