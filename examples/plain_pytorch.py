"""The watch engine in a hand-written PyTorch training loop: no Lightning.

    python examples/plain_pytorch.py              # CPU or GPU, about 30 s on 2 CPU cores
    python examples/plain_pytorch.py --steps 500 --auto-switch

What the Lightning callback does, written out: attach ``InstabilityWatch`` to
an unmodified nanoGPT-style model, call ``watch.step(loss)`` once per
optimizer step, print alert panels and the worst-heads table with
``ConsoleReporter``, write the run directory with ``RunWriter``, keep
``watch.state_dict()`` in the checkpoint, and ``detach()`` at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
from rich.console import Console

from instability_watch import InstabilityWatch, WatchConfig
from instability_watch.cli import report_command
from instability_watch.outputs.console import ConsoleReporter
from instability_watch.outputs.rundir import RunWriter

from byte_corpus import ByteWindows, stdlib_text, train_val_split
from nanogpt import GPT, GPTConfig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--auto-switch", action="store_true", help="switch alerted heads to the stabilized kernel")
    ap.add_argument("--run-dir", default=os.path.join("runs", "plain-pytorch"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if min(args.steps, args.batch, args.accumulate) < 1:
        ap.error(f"--steps, --batch and --accumulate must be >= 1, got {args.steps}, {args.batch}, {args.accumulate}")
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=128)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    train_bytes, _ = train_val_split(stdlib_text(2_000_000))
    data = torch.utils.data.DataLoader(
        ByteWindows(train_bytes, 128, args.steps * args.accumulate * args.batch, seed=args.seed),
        batch_size=args.batch, drop_last=True)

    console = Console()
    reporter = ConsoleReporter(console, live_table=True, top=6)
    writer = RunWriter(args.run_dir, overwrite=True)
    config = WatchConfig(probe_every=5, shadow_every=5, spectral_every=10, log_every=10, warmup_steps=min(50, args.steps),
                         auto_switch=args.auto_switch)
    watch = InstabilityWatch(model, config, listeners=[reporter, writer])
    writer.open(watch)

    autocast = torch.autocast(device, dtype=torch.bfloat16)
    model.train()
    try:
        for i, (x, y) in enumerate(data):                       # (B, T) bytes, next bytes
            with autocast:
                _, loss = model(x.to(device), y.to(device))
            (loss / args.accumulate).backward()                 # the probes add up over micro-batches
            if (i + 1) % args.accumulate:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            watch.step(loss.detach())                           # once per optimizer step, no host sync
            if watch.step_count % 50 == 0:
                console.print(f"step {watch.step_count}: loss {loss.item():.3f}")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "watch": watch.state_dict()},
                   os.path.join(args.run_dir, "checkpoint.pt"))
    finally:
        with contextlib.suppress(Exception):
            watch.detach()                                      # reads back the last steps, restores the model
        reporter.close()
        writer.close()
    console.print(f"alerts: {len(watch.alerts)}, heads switched: {len(watch.switched)}")
    console.print(f"postmortem: {report_command(args.run_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
