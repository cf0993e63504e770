"""Cost of the watch on a GPT-2-small training step (the DESIGN's <= 3% bar).

One process, three variants of the same model (12 layers, 12 heads, 768 dims,
context 1024, byte-level vocabulary padded to 50304 like nanoGPT, BF16 autocast,
fused AdamW), timed in interleaved rounds:

* ``sdpa-flash``  -- plain PyTorch, SDPA restricted to the flash backend;
* ``ours``        -- attention routed through our Triton kernels, no statistics
                     (``attach(model, probes=False)``);
* ``watch``       -- ``InstabilityWatch(model)`` at its defaults (probes every
                     step, shadow delta and sigma(W_Q) every 10 steps, one read-back
                     every 10 steps).

With ``--compile`` each variant's model is ``torch.compile``d (inductor) after the
watch attached, and the warm-up covers both compiled graphs (shadow step or not).

Run:  python benchmarks/watch_overhead.py [--batch 16] [--steps 30] [--rounds 3] [--compile] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from instability_watch import InstabilityWatch, WatchConfig  # noqa: E402
from instability_watch.attach import attach  # noqa: E402
from instability_watch.nanogpt import GPT, GPTConfig  # noqa: E402


VARIANTS = ("sdpa-flash", "ours", "watch")


def make_variant(base, name: str, config: WatchConfig | None = None, compile: bool = False) -> dict:
    """A copy of ``base`` with its optimizer, set up as variant ``name`` (see the module docstring)."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    watch = None
    if name == "ours":
        attach(model, probes=False)
    elif name == "watch":
        watch = InstabilityWatch(model, config or WatchConfig())
    fwd = torch.compile(model) if compile else model
    return dict(model=model, fwd=fwd, opt=opt, watch=watch, times=[], alerts=0)


def train_step(v: dict, name: str, inp, tgt) -> list:
    """One BF16 training step of variant ``v``; returns the watch's alerts (if any)."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if name == "sdpa-flash":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                loss = v["fwd"](inp, tgt)[1]
        else:
            loss = v["fwd"](inp, tgt)[1]
    loss.backward()
    v["opt"].step()
    v["opt"].zero_grad(set_to_none=True)
    return v["watch"].step(loss) if v["watch"] is not None else []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30, help="timed steps per round (a multiple of 10)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile each variant (after attaching)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = "cuda"
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50304, block_size=args.seq, n_layer=12, n_head=12, n_embd=768)
    base = GPT(cfg).to(dev)
    x = torch.randint(0, 256, (args.batch, args.seq + 1), device=dev)
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    variants = {name: make_variant(base, name, compile=args.compile) for name in VARIANTS}

    def step(v, name):
        v["alerts"] += len(train_step(v, name, inp, tgt))

    for name, v in variants.items():
        for _ in range(args.warmup):
            step(v, name)
    torch.cuda.synchronize()
    for _ in range(args.rounds):
        for name, v in variants.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(v, name)
            torch.cuda.synchronize()
            v["times"].append((time.perf_counter() - t0) / args.steps)

    res = {name: statistics.median(v["times"]) for name, v in variants.items()}
    tokens = args.batch * args.seq
    rows = [
        (name, 1e3 * t, 1.0 / t, tokens / t / 1e3, min(variants[name]["times"]) * 1e3, max(variants[name]["times"]) * 1e3)
        for name, t in res.items()
    ]
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": vars(args),
        "ms_per_step": {n: 1e3 * t for n, t in res.items()},
        "rounds_ms": {n: [1e3 * t for t in v["times"]] for n, v in variants.items()},
        "watch_overhead_vs_ours": res["watch"] / res["ours"] - 1,
        "ours_vs_sdpa_flash": res["ours"] / res["sdpa-flash"] - 1,
        "watch_vs_sdpa_flash": res["watch"] / res["sdpa-flash"] - 1,
        "watch_alerts": variants["watch"]["alerts"],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"GPT-2 small step, B{args.batch} N{args.seq}, {out['device']}{', compiled' if args.compile else ''}, "
          f"median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'variant':<12}{'ms/step':>10}{'steps/s':>10}{'ktok/s':>10}{'min ms':>10}{'max ms':>10}")
    for name, ms, sps, kt, lo, hi in rows:
        print(f"{name:<12}{ms:>10.2f}{sps:>10.2f}{kt:>10.1f}{lo:>10.2f}{hi:>10.2f}")
    print(f"watch vs ours: {100 * out['watch_overhead_vs_ours']:+.2f}%   ours vs sdpa-flash: "
          f"{100 * out['ours_vs_sdpa_flash']:+.2f}%   watch vs sdpa-flash: {100 * out['watch_vs_sdpa_flash']:+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
