"""Host (CPU) time of one attention forward+backward on tiny inputs: SDPA vs our path, piece by piece.

The inputs are so small (B1 H2 N16) that the device does next to nothing: what is
timed is the Python and dispatch work per call, which a training step pays once
per attention layer (and which shows when the step is host-bound, e.g. under
Lightning). Rows:

* ``sdpa``                      -- ``F.scaled_dot_product_attention`` (flash backend on CUDA)
* ``flash_attention``           -- our public entry point (validation, autograd Function, kernels)
* ``... probe+mask``            -- the same with a probe and a stabilize mask (what the watch passes)
* ``launcher fwd / bwd``        -- the backend alone (Triton launchers on CUDA; the reference on CPU)
* ``routed SDPA call``          -- an SDPA call inside a watched module whose forward is only that call
* ``nanoGPT attention module``  -- a whole ``CausalSelfAttention`` forward+backward: unwatched;
  watched (the routing mode then sees every op of the forward, not only SDPA); and watched
  with ``routing`` off (the mode's cost alone: every call goes on to PyTorch)

Each row is the best of ``--reps`` interleaved rounds of ``--calls`` calls (µs per
call). ``--stub`` replaces the backend by empty outputs (CPU: the reference
path's arithmetic is not host overhead); ``--profile`` prints cProfile's top
entries for a row (the main thread only: on CUDA, autograd runs the backward on
its own thread: add ``--main-thread-backward`` to run it on the calling thread).

Run:  python benchmarks/routed_overhead.py [--device cuda] [--stub] [--profile ROW]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from instability_watch import InstabilityWatch, Probe, WatchConfig, flash_attention  # noqa: E402
from instability_watch.attach import AttentionLayer  # noqa: E402
from instability_watch.kernels import ops  # noqa: E402
from instability_watch.kernels.layout import empty_like_layout  # noqa: E402
from instability_watch.nanogpt import CausalSelfAttention, GPTConfig  # noqa: E402

B, H, N = 1, 2, 16


class SdpaOnly(nn.Module):
    """A module whose forward is one SDPA call (what the routing adds to exactly that call)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(H, d, d))

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _stub_backend() -> None:
    def fwd(q, k, v, stabilize, counts, values, causal, scale, beta, eps, backend):
        return empty_like_layout(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    def bwd(q, k, v, o, lse, do, counts, values, causal, scale, shadow, backend):
        return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)

    ops._forward, ops._backward = fwd, bwd


def rows(device: str, d: int) -> dict:
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    q, k, v, do = (torch.randn(B, H, N, d, generator=g).to(device, dt) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    probe, mask = Probe(H, device), torch.zeros(H, dtype=torch.bool, device=device)
    cuda = device.startswith("cuda")

    def sdpa(q, k, v):
        if cuda:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fb(f):
        return lambda: f(qg, kg, vg).backward(do)

    out = {
        "sdpa fwd": lambda: sdpa(q, k, v),
        "sdpa fwd+bwd": fb(sdpa),
        "flash_attention fwd": lambda: flash_attention(q, k, v, causal=True),
        "flash_attention fwd+bwd": fb(lambda q, k, v: flash_attention(q, k, v, causal=True)),
        "flash_attention fwd+bwd, probe+mask": fb(
            lambda q, k, v: flash_attention(q, k, v, causal=True, stabilize=mask, probe=probe)),
    }
    backend = "triton" if cuda else "reference"
    o, lse = ops._forward(q, k, v, mask, probe.counts, probe.values, True, d ** -0.5, 2.0, 1e-3, backend)
    out["launcher fwd (probe+mask)"] = lambda: ops._forward(
        q, k, v, mask, probe.counts, probe.values, True, d ** -0.5, 2.0, 1e-3, backend)
    out["launcher bwd"] = lambda: ops._backward(
        q, k, v, o, lse, do, probe.counts, probe.values, True, d ** -0.5, False, backend)

    module = SdpaOnly(d).to(device)
    watch = InstabilityWatch(module, WatchConfig(log_every=10 ** 9, shadow_every=0, spectral_every=0),
                             layers=lambda m: [AttentionLayer(m, H, lambda: m.w, name="sdpa")])
    out["routed SDPA call fwd+bwd, probe"] = fb(module)

    cfg = GPTConfig(n_head=H, n_embd=H * d, block_size=N)
    torch.manual_seed(0)
    plain = CausalSelfAttention(cfg).to(device, dt)
    watched = CausalSelfAttention(cfg).to(device, dt)
    InstabilityWatch(watched, WatchConfig(log_every=10 ** 9, shadow_every=0, spectral_every=0))
    torch.manual_seed(0)
    mode_only = CausalSelfAttention(cfg).to(device, dt)
    InstabilityWatch(mode_only, WatchConfig(log_every=10 ** 9)).attachment.routing = False
    x = torch.randn(B, N, H * d, generator=g).to(device, dt).requires_grad_(True)
    dy = torch.randn(B, N, H * d, generator=g).to(device, dt)
    out["nanoGPT attention module fwd+bwd, unwatched"] = lambda: plain(x).backward(dy)
    out["nanoGPT attention module fwd+bwd, watched"] = lambda: watched(x).backward(dy)
    out["nanoGPT attention module fwd+bwd, routing off"] = lambda: mode_only(x).backward(dy)
    out["_watch"] = watch
    return out


def measure(fns: dict, calls: int, reps: int, device: str) -> dict:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for f in fns.values():
        for _ in range(50):
            f()
    sync()
    best = {name: float("inf") for name in fns}
    names = list(fns)
    for _ in range(reps):
        random.shuffle(names)
        for name in names:
            f = fns[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            sync()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--stub", action="store_true", help="empty backend outputs (host work of our path only)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: less noise)")
    ap.add_argument("--profile", metavar="ROW", help="cProfile this row after timing")
    ap.add_argument("--main-thread-backward", action="store_true",
                    help="run autograd's backward on the calling thread (so that --profile sees it)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.main_thread_backward:
        torch.autograd.set_multithreading_enabled(False)
    if args.stub:
        _stub_backend()
    fns = rows(args.device, args.head_dim)
    fns.pop("_watch")
    if args.stub:
        fns = {k: f for k, f in fns.items() if "launcher" not in k}
    best = measure(fns, args.calls, args.reps, args.device)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{name}, torch {torch.__version__}, B{B} H{H} N{N} D{args.head_dim} bf16"
          f"{', stub backend' if args.stub else ''}: best of {args.reps} x {args.calls} calls, us per call")
    for k, t in best.items():
        print(f"  {k:<46} {t:8.1f}")
    if args.profile:
        prof = cProfile.Profile()
        f = fns[args.profile]
        prof.enable()
        for _ in range(2000):
            f()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "stub": args.stub, "us": best}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
