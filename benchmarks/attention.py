"""Attention speed: our Triton kernels against PyTorch's SDPA (flash and cuDNN), in one process.

    python benchmarks/attention.py                 # the table of benchmarks/RESULTS.md
    python benchmarks/attention.py --sweep fwd     # try the launch-config grid of one kernel
    python benchmarks/attention.py --sweep dkdv --shapes gpt2 --dropout 0.1   # ... of calls with dropout
    python benchmarks/attention.py --shapes gpt2 --json out.json

For each shape (GPT-2: B16 H12 N1024 D64 causal; Llama: B4 H32 N4096 D128
causal) it times forward and backward separately (``triton.testing.do_bench``,
median, BF16 random inputs) of: ours standard, ours with every head
stabilized, ours with a probe (the way the watch calls it: a stabilize mask
plus a probe), ours on a shadow step (probe in shadow mode: the backward also
computes delta_hp), PyTorch SDPA flash, PyTorch SDPA cuDNN. TFLOP/s count
4*B*H*N^2*D (halved for causal) for the forward and 2.5x that for the backward.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from instability_watch import Probe, flash_attention
from instability_watch.kernels.attention import triton as ta

from _common import BWD_GRID, FWD_GRID, WIDE_GRID, bench, header, keep, warm_gpu, write_json

SHAPES = {
    "gpt2": dict(B=16, H=12, N=1024, D=64, causal=True),
    "llama": dict(B=4, H=32, N=4096, D=128, causal=True),
    "d256": dict(B=4, H=8, N=4096, D=256, causal=True),  # Gemma's head dim (the sweeps; not in the table)
}


def flops(shape, backward=False):
    f = 4 * shape["B"] * shape["H"] * shape["N"] ** 2 * shape["D"]
    if shape["causal"]:
        f //= 2
    return f * (2.5 if backward else 1.0)


def inputs(shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, H, N, D = shape["B"], shape["H"], shape["N"], shape["D"]
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    return q, k, v, do


def variants(shape):
    H = shape["H"]
    causal = shape["causal"]
    all_heads = torch.ones(H, dtype=torch.bool, device="cuda")
    no_heads = torch.zeros(H, dtype=torch.bool, device="cuda")
    probe = Probe(H, "cuda")
    shadow_probe = Probe(H, "cuda")
    shadow_probe.shadow = True

    def sdpa(backend):
        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return fn

    return {
        "ours": lambda q, k, v: flash_attention(q, k, v, causal=causal),
        "ours stabilized": lambda q, k, v: flash_attention(q, k, v, causal=causal, stabilize=all_heads),
        "ours + probe": lambda q, k, v: flash_attention(q, k, v, causal=causal, stabilize=no_heads, probe=probe),
        "ours shadow step": lambda q, k, v: flash_attention(q, k, v, causal=causal, stabilize=no_heads, probe=shadow_probe),
        "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    }


def time_variant(fn, q, k, v, do, graph=True):
    """Forward and backward milliseconds.

    With ``graph`` the calls are captured in a CUDA graph and replayed, so host-side launch
    overhead (Python for us, C++ for PyTorch) drops out and the numbers are GPU time. Autograd
    runs a backward on its forward's stream, so the backward is timed as (forward + backward)
    captured together, minus the forward. Without ``graph``: eager calls, as a training loop
    makes them (the backward alone, through ``autograd.grad`` on a kept graph).
    """
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    if graph:
        fwd = triton.testing.do_bench_cudagraph(lambda: fn(q, k, v), rep=100)
        both = triton.testing.do_bench_cudagraph(
            lambda: torch.autograd.grad(fn(qq, kk, vv), (qq, kk, vv), do), rep=100
        )
        return fwd, both - fwd
    fwd = bench(lambda: fn(q, k, v))
    o = fn(qq, kk, vv)
    bwd = bench(lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True))
    return fwd, bwd


def run_table(shape_names, rounds=3, graph=True):
    """Median over ``rounds`` interleaved rounds: every variant sees the same clock and thermal state."""
    warm_gpu()
    results = {}
    for name in shape_names:
        shape = SHAPES[name]
        q, k, v, do = inputs(shape)
        times = {}
        for _ in range(rounds):
            for vname, fn in variants(shape).items():
                try:
                    times.setdefault(vname, []).append(time_variant(fn, q, k, v, do, graph=graph))
                except Exception as exc:  # a peer unavailable on this GPU/torch: say so, keep going
                    print(f"  {name} {vname}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        rows = {}
        base = times.get("ours")
        for vname, ts in times.items():
            fwd = sorted(t[0] for t in ts)[len(ts) // 2]
            bwd = sorted(t[1] for t in ts)[len(ts) // 2]
            rows[vname] = dict(
                fwd_ms=fwd, bwd_ms=bwd,
                fwd_tflops=flops(shape) / fwd * 1e-9, bwd_tflops=flops(shape, True) / bwd * 1e-9,
                fwd_spread=(max(t[0] for t in ts) - min(t[0] for t in ts)) / fwd,
                bwd_spread=(max(t[1] for t in ts) - min(t[1] for t in ts)) / bwd,
            )
            if base is not None and len(base) == len(ts) and vname != "ours":
                # the variant against "ours" of the same round (both timed back to back)
                rows[vname]["fwd_vs_ours_per_round"] = [t[0] / b[0] for t, b in zip(ts, base)]
                rows[vname]["bwd_vs_ours_per_round"] = [t[1] / b[1] for t, b in zip(ts, base)]
        results[name] = rows
    return results


def print_table(results):
    lines = []
    for name, rows in results.items():
        s = SHAPES[name]
        lines.append(f"\n{name}: B{s['B']} H{s['H']} N{s['N']} D{s['D']} {'causal' if s['causal'] else ''}")
        lines.append(f"  {'variant':<18}{'fwd ms':>8}{'fwd TF/s':>10}{'bwd ms':>8}{'bwd TF/s':>10}{'spread':>14}")
        for vname, r in rows.items():
            lines.append(
                f"  {vname:<18}{r['fwd_ms']:>8.3f}{r['fwd_tflops']:>10.1f}{r['bwd_ms']:>8.3f}{r['bwd_tflops']:>10.1f}"
                f"{100 * r['fwd_spread']:>6.1f}%/{100 * r['bwd_spread']:.1f}%"
            )
        base = rows.get("ours")
        if base:
            for peer in ("sdpa flash", "sdpa cudnn"):
                if peer in rows:
                    p = rows[peer]
                    lines.append(
                        f"  ours / {peer:<11} fwd {p['fwd_ms'] / base['fwd_ms']:.2f}x  bwd {p['bwd_ms'] / base['bwd_ms']:.2f}x"
                    )
            for var in ("ours stabilized", "ours + probe", "ours shadow step"):
                if var in rows:
                    r = rows[var]
                    line = (
                        f"  {var:<18} costs fwd {100 * (r['fwd_ms'] / base['fwd_ms'] - 1):+.1f}%  "
                        f"bwd {100 * (r['bwd_ms'] / base['bwd_ms'] - 1):+.1f}% vs ours"
                    )
                    paired = r.get("fwd_vs_ours_per_round")
                    if paired and len(paired) > 1:
                        p = sorted(100 * (x - 1) for x in paired)
                        line += f"  (fwd per round: median {p[len(p) // 2]:+.1f}%, {p[0]:+.1f}% to {p[-1]:+.1f}%)"
                    lines.append(line)
    print("\n".join(lines))


# ---------------------------------------------------------------------------
# Launch-config sweeps


def sweep(kind, shape_names, variant="standard", dropout_p=0.0):
    out = {}
    for name in shape_names:
        shape = SHAPES[name]
        q, k, v, do = inputs(shape)
        scale = shape["D"] ** -0.5
        head_dim = ta.head_dim_tile(shape["D"])
        stab = torch.ones(shape["H"], dtype=torch.bool, device="cuda") if variant != "standard" else None
        probe = Probe(shape["H"], "cuda") if variant == "probe" else None
        counts, values = (probe.counts, probe.values) if probe is not None else (None, None)
        drop = dict(dropout_p=dropout_p, seed=torch.tensor([1, 2], dtype=torch.int64, device="cuda")) if dropout_p else {}
        o, lse2 = ta.attention_forward_lse2(q, k, v, causal=shape["causal"], scale=scale, stabilize=stab, beta=2.0, eps=1e-3,
                                       counts=counts, values=values, **drop)
        if head_dim >= 256:
            grid = [c + (None,) for c in WIDE_GRID] if kind == "fwd" else WIDE_GRID
        else:
            grid = FWD_GRID if kind == "fwd" else BWD_GRID
        timings = []
        for cfg in (c for c in grid if keep(c, head_dim)):
            if kind == "fwd":
                fn = lambda: ta.attention_forward_lse2(  # noqa: E731
                    q, k, v, causal=shape["causal"], scale=scale, stabilize=stab, beta=2.0, eps=1e-3,
                    counts=counts, values=values, config=cfg, **drop,
                )
                fl = flops(shape)
            else:
                key = {"dkdv": "config_dkdv", "dq": "config_dq", "fused": "config_fused"}[kind]
                fn = lambda: ta.attention_backward_lse2(  # noqa: E731
                    q, k, v, o, lse2, do, causal=shape["causal"], scale=scale, counts=None, values=None,
                    shadow=False, fused=kind == "fused", **{key: cfg}, **drop,
                )
                fl = flops(shape, True)
            try:
                fn()
                ms = bench(fn, warmup=10, rep=40)
            except Exception as exc:
                print(f"  {name} {kind} {cfg}: {type(exc).__name__}", file=sys.stderr)
                continue
            timings.append((ms, cfg))
            print(f"  {name} {kind} {cfg}: {ms:.3f} ms {fl / ms * 1e-9:.1f} TF/s", file=sys.stderr)
        timings.sort()
        out[name] = [(cfg, ms) for ms, cfg in timings[:5]]
        print(f"{name} {kind} best: " + ", ".join(f"{cfg} {ms:.3f}ms" for cfg, ms in out[name]))
        if kind == "fused":  # the yardstick: the two-kernel backward at its tables' configs
            ms = bench(lambda: ta.attention_backward_lse2(q, k, v, o, lse2, do, causal=shape["causal"], scale=scale,
                                                     counts=None, values=None, shadow=False, fused=False, **drop),
                       warmup=10, rep=40)
            out[name + " two-kernel"] = ms
            print(f"{name} two-kernel backward (tables): {ms:.3f}ms")
    return out


def kernel_resources():
    """Registers, spills and shared memory of every compiled forward variant, in compile order."""
    fn = ta.attn_fwd
    while not hasattr(fn, "device_caches"):
        fn = fn.fn
    out = []
    for entry in fn.device_caches.values():
        for kernel in entry[0].values():
            out.append(f"regs={kernel.n_regs} spills={kernel.n_spills} shared={kernel.metadata.shared}")
    return out


def host_overhead(calls=300):
    """Host time per call on tiny inputs: what each path costs the CPU, kernels aside."""
    import time

    q, k, v, do = (torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qq = q.clone().requires_grad_(True)
    probe = Probe(2, "cuda")
    mask = torch.zeros(2, dtype=torch.bool, device="cuda")

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_fb():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qq, k, v, is_causal=True).backward(do)

    paths = {
        "flash_attention fwd": lambda: flash_attention(q, k, v, causal=True),
        "flash_attention fwd, mask+probe": lambda: flash_attention(q, k, v, causal=True, stabilize=mask, probe=probe),
        "launcher fwd": lambda: ta.attention_forward_lse2(
            q, k, v, causal=True, scale=0.125, stabilize=None, beta=2.0, eps=1e-3, counts=None, values=None
        ),
        "sdpa flash fwd": sdpa,
        "flash_attention fwd+bwd": lambda: flash_attention(qq, k, v, causal=True).backward(do),
        "sdpa flash fwd+bwd": sdpa_fb,
    }
    out = {}
    for name, fn in paths.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        print(f"host {name:<34} {out[name]:7.1f} us/call")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="gpt2,llama", help="comma-separated: " + ",".join(SHAPES))
    ap.add_argument("--sweep", choices=["fwd", "dkdv", "dq", "fused"], action="append",
                    help="sweep one kernel's launch configs (fused: the one-kernel backward; dkdv, dq: the two-kernel one)")
    ap.add_argument("--sweep-variant", default="standard", choices=["standard", "stabilized", "probe"])
    ap.add_argument("--dropout", type=float, default=0.0, help="sweep calls with this attention dropout")
    ap.add_argument("--eager", action="store_true", help="time eager calls (host overhead included) instead of CUDA graphs")
    ap.add_argument("--host", action="store_true", help="measure host (CPU) time per call")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant (median shown)")
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [s for s in args.shapes.split(",") if s]
    for n in names:
        if n not in SHAPES:
            ap.error(f"--shapes: unknown shape {n!r}; known: {', '.join(SHAPES)}")
    result = header(argv)
    print(json.dumps(result))
    if args.sweep or args.host:
        warm_gpu()
        if args.host:
            result["host_us"] = host_overhead()
        if args.sweep:
            result["sweeps"] = {kind: sweep(kind, names, args.sweep_variant, args.dropout) for kind in args.sweep}
    else:
        result["timing"] = "eager do_bench" if args.eager else "CUDA graph replay (do_bench_cudagraph)"
        print(f"timing: {result['timing']}")
        result["table"] = run_table(names, rounds=args.rounds, graph=not args.eager)
        print_table(result["table"])
        result["forward_kernels"] = kernel_resources()
        print("compiled forward variants: " + "; ".join(result["forward_kernels"]))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
