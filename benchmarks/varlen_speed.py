"""Our kernels over packed documents (``flash_attention_varlen``) against PyTorch's ``varlen_attn`` (flash) on the
same packed call, forward and forward + backward, on the GPU (issue 43's bar: >= 1.0x).

Documents of random lengths (seeded) fill ``--tokens`` tokens; causal; BF16; GQA as given. Each variant is
timed with CUDA events over ``--iters`` calls after a warm-up, in ``--rounds`` interleaved rounds; the table gives
the median per variant and the ratio varlen_attn / ours (> 1: ours faster). "ours" reuses the documents'
ranges kept from the call before (the same boundary tensor, as the layers of one step pass it); "ours, documents
found afresh" finds them in every call (a step's first layer, or a model of one attention layer).

Run:  python benchmarks/varlen_speed.py [--tokens 16384] [--heads 16] [--kv-heads 4] [--head-dim 128]
                                       [--rounds 5] [--json out.json] [--sweep dkdv --sweep dq ...]

``--sweep KERNEL`` (fwd, dkdv or dq; repeatable) then tries the launch-config grid of ``_common`` for that
kernel on this packed call (fwd: the forward alone; dkdv, dq: forward + backward; dkdv both with one program per
KV head and per query head), the table's own entry first, and prints the fastest five of each.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from _common import (SMALL_BWD_GRID, cuda_ms, device_name, keep, kernel_resources, print_kernel_resources,
                     profile_calls, sweep_launch_configs, write_json)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--min-doc", type=int, default=128)
    ap.add_argument("--max-doc", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--profile", metavar="DIR",
                    help="also profile 5 forward + backward calls of each variant (torch.profiler) into DIR")
    ap.add_argument("--sweep", action="append", choices=["fwd", "dkdv", "dq"], default=[],
                    help="also sweep this kernel's launch configs on the packed call (repeatable)")
    ap.add_argument("--sweep-grid", choices=["small", "full"], default="small",
                    help="the backward's grid: small (15 configs, one device call) or full (_common.BWD_GRID)")
    ap.add_argument("--sweep-configs", metavar="BM,BN,W,ST;...",
                    help="sweep these launch configs only (block_m, block_n, warps, stages; ';' between them)")
    ap.add_argument("--variants", metavar="NAME,...",
                    help="time these variants only (varlen_attn and ours always; default: all of them)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("varlen_speed.py needs a CUDA GPU (varlen_attn has no CPU kernel)")
    from torch.nn.attention.varlen import varlen_attn

    from instability_watch import flash_attention_varlen

    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    lengths, n = [], 0
    while n < args.tokens:
        lengths.append(min(args.tokens - n, int(torch.randint(args.min_doc, args.max_doc, (1,), generator=g))))
        n += lengths[-1]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)
    max_len = max(lengths)
    T, H, KV, D = args.tokens, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(T, H, D, generator=g).to(dev, torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(T, KV, D, generator=g).to(dev, torch.bfloat16).requires_grad_(True) for _ in range(2))
    do = torch.randn(T, H, D, generator=g).to(dev, torch.bfloat16)
    stab = torch.ones(H, dtype=torch.bool, device=dev)
    import inspect

    if "enable_gqa" in inspect.signature(varlen_attn).parameters:  # torch >= 2.12

        def theirs():
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), enable_gqa=KV < H)
    else:  # torch 2.11: no GQA (keys and values repeated per query head, as a caller must)

        def theirs():
            return varlen_attn(q, k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1), cu, cu, max_len,
                               max_len, window_size=(-1, 0))
    import instability_watch.kernels.attention.triton as ta
    from instability_watch.kernels.configs import has_launch_config

    from instability_watch.kernels.attention.ops import KEEP_DOCUMENTS, forget_documents

    def ours(expand: bool = False, fused=None, ordered=None, afresh: bool = False, **kw):
        def call():
            ta.GQA_EXPAND = expand  # read by this call's kernels (the variants set them each call)
            ta.FUSED_BACKWARD = fused
            ta.TILE_ORDER = ordered  # None: the default
            if afresh:  # the documents' ranges found again in this call, as a step's first layer finds them
                forget_documents()
            token = KEEP_DOCUMENTS.set(True)  # as a watch's routed calls keep them
            try:
                return flash_attention_varlen(q, k, v, cu, causal=True, **kw)
            finally:
                KEEP_DOCUMENTS.reset(token)
        return call

    variants = {
        "varlen_attn": theirs,
        "ours": ours(),  # the documents kept from the call before, as a step's later layers find them
        "ours, documents found afresh": ours(afresh=True),
        "ours, every head stabilized": ours(stabilize=stab),
        "ours, dK/dV per query head": ours(expand=True),  # GQA_EXPAND: off by default until measured
        "ours, fused backward": ours(fused=True),  # FUSED_BACKWARD: dropout calls only by default
        "ours, fused, per query head": ours(expand=True, fused=True),
        "ours, tiles in grid order": ours(ordered=False),  # TILE_ORDER off (its default orders packed calls' tiles)
        "ours, grid order, per query head": ours(expand=True, ordered=False),
    }

    if args.variants:
        wanted = {"varlen_attn", "ours", *(v.strip() for v in args.variants.split(","))}
        unknown = wanted - set(variants)
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; the variants are {list(variants)}")
        variants = {name: fn for name, fn in variants.items() if name in wanted}
    results = {name: {"fwd": [], "fwd+bwd": []} for name in variants}
    for r in range(args.rounds):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            for kind in ("fwd", "fwd+bwd"):
                if kind == "fwd":
                    with torch.no_grad():
                        results[name][kind].append(cuda_ms(variants[name], args.iters))
                else:
                    results[name][kind].append(cuda_ms(variants[name], args.iters, do))
    table = {name: {kind: statistics.median(ms) for kind, ms in by.items()} for name, by in results.items()}
    if args.profile:
        for name, fn in variants.items():
            profile_calls(fn, do, args.profile, name)
    sweeps = {}
    for kernel in args.sweep:
        for expand in ((False, True) if kernel == "dkdv" and KV < H else (False,)):
            name = kernel + (", dK/dV per query head" if expand else "")
            print(f"sweep: {name}", flush=True)
            if kernel == "fwd":
                def timed(fn=ours()):
                    with torch.no_grad():
                        return cuda_ms(fn, args.iters)
            else:
                def timed(fn=ours(expand=expand)):
                    return cuda_ms(fn, args.iters, do)
            grid = None if kernel == "fwd" or args.sweep_grid == "full" else [
                c for c in SMALL_BWD_GRID if keep(c, ta.head_dim_tile(D))]
            if args.sweep_configs:
                grid = [tuple(int(x) for x in c.split(",")) for c in args.sweep_configs.split(";") if c.strip()]
            # packed calls' dK/dV takes its own entry where the table has one
            key = "dkdv_docs" if kernel == "dkdv" and has_launch_config("dkdv_docs", ta.head_dim_tile(D),
                                                                          torch.bfloat16) else kernel
            sweeps[name] = sweep_launch_configs(key, D, timed, grid=grid, log=print)
        ta.GQA_EXPAND, ta.FUSED_BACKWARD, ta.TILE_ORDER = False, None, None
    resources = kernel_resources(ta.attn_fwd, ta.attn_bwd_dq, ta.attn_bwd_dkdv)
    if args.json:
        write_json(args.json, {"device": device_name(dev), "torch": torch.__version__, "documents": lengths,
                               "shape": [T, H, KV, D], "rounds": results, "median_ms": table, "sweeps": sweeps,
                               "resources": resources})
    print_kernel_resources(resources)
    print(f"{len(lengths)} documents, {T} tokens, H {H}/{KV}, D {D}, {device_name(dev)}")
    print(f"{'variant':<30} {'fwd ms':>8} {'fwd+bwd ms':>11} {'ratio fwd':>10} {'ratio f+b':>10}")
    base = table["varlen_attn"]
    for name, t in table.items():
        print(f"{name:<30} {t['fwd']:8.3f} {t['fwd+bwd']:11.3f} {base['fwd'] / t['fwd']:10.3f} "
              f"{base['fwd+bwd'] / t['fwd+bwd']:10.3f}")
    what = {"fwd": "fwd", "dkdv": "fwd+bwd", "dq": "fwd+bwd"}
    for name, sw in sweeps.items():
        ref = base[what[name.split(",")[0]]]
        own = f"{sw['table'][1]:.3f} ms" if sw["table"] else "failed"
        print(f"sweep {name} ({what[name.split(',')[0]]}; varlen_attn {ref:.3f} ms): the table's {own}; fastest "
              + ", ".join(f"{tuple(c[:4])} {ms:.3f} ms ({ref / ms:.2f}x)" for c, ms in sw["best"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
