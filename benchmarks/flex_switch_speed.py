"""A switched head's FlexAttention calls on our kernels against the same calls on compiled FlexAttention, on the GPU
(issue 43: switched flex calls at the speed of the call they replace).

One layer calls ``torch.compile(flex_attention)`` with a causal, sliding-window or packed-document block mask (BF16,
GQA as given). "flex" is the call unwatched; "switched" is the same layer with a watch attached and one head switched,
so the call runs as the watch runs it: the mask evaluated from ``mask_mod``, then our kernels (every other head
standard). For the causal mask, four references with no watch: our kernels called directly with the causal flag and
with the mask as a boolean mask, each with and without a stabilized head; and the switched call with the mask read on
every tile it does not see whole ("no causal tiles": the tiles that equal the causal mask read from it too, as before
2026-11-28), and with the pre-pass reading the mask byte by byte ("the pre-pass byte by byte", as before 2026-11-29;
now four keys a word). "switched, four loops": each kernel walks a boolean mask's tiles in four loops (the mask's
tiles before the whole run, the whole run, the causal tiles, the mask's tiles after), as before 2026-11-29, where the
forward and dK/dV now walk two (the whole run, then the other tiles); "the edge loop in dQ too": dQ walks two as well.
"switched, dK/dV masked loads": ``triton.EVEN_LOADS`` off (dK/dV loads its query rows with a mask even where every
query block is whole); "switched, dQ masked loads": ``triton.EVEN_DQ`` off (dQ loads its K/V rows with a mask
where every KV block is whole). "switched, causal tiles compared": ``triton.READ_CAUSAL_TILES`` empty (a boolean
mask's tiles equal to the causal mask taken by the causal compare, as before 2026-11-29); "switched, dQ reads its
causal tiles": dQ among the kernels that read them. "switched, the mask read per tile shape": ``masks.FLAGS_ONCE``
off (the forward, dQ and dK/dV each read the mask for their own tile's flags, as before the twenty-second session,
2026-11-29; now the forward reads it once for its 64 x 64 tiles' flags and hands them to the backward).
A variant named by a kernel and a launch config, "switched, dQ (128, 64, 8, 3)" say, runs that kernel with that config
in place of its entry for boolean masks. For every mask, one more reference with no watch: "ours direct, as
documents", our packed kernels over the mask's documents (every batch row the same; the sliding window as their
window; no mask and no pre-pass), what a switched call whose ``mask_mod`` were recognized could run instead (0.42×
FlexAttention on the sliding mask, 2026-11-29: not a route). Each variant is timed with CUDA events over ``--iters``
calls after a warm-up, forward and forward + backward, in ``--rounds`` interleaved rounds (alternating order): as
called, and with the host ahead (the GPU held while the host launches every call: the kernels' own time, as inside a
model whose host runs ahead); the host's own time per call beside them. The table gives medians and the ratio flex /
variant (> 1: ours faster).

Run:  python benchmarks/flex_switch_speed.py [--seq 4096] [--batch 4] [--heads 16] [--kv-heads 4]
                                            [--head-dim 128] [--window 1024] [--rounds 5] [--json out.json]
                                            [--only "VARIANT;VARIANT"]
                                            [--sweep dkdv --sweep dq ...]

``--sweep KERNEL`` (fwd, dkdv or dq; repeatable) then tries the launch-config grid of ``_common`` for that
kernel on each mask's switched call (fwd: the forward alone; dkdv, dq: forward + backward with the host ahead, the
kernels' own time), the table's own entry first, and prints the fastest five of each.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from _common import (SMALL_BWD_GRID, SMALL_FWD_GRID, cuda_ahead_ms, cuda_and_host_ms, cuda_ms, device_name, keep,
                     kernel_resources, print_kernel_resources, profile_calls, sweep_launch_configs, write_json)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--masks", default="causal,sliding,document")
    ap.add_argument("--edge-loop", metavar="KERNEL,KERNEL",
                    help="the kernels that walk a boolean mask's tiles in two loops in 'switched' and the sweeps "
                         "(triton.EDGE_LOOP; default: the library's), e.g. fwd,dq,dkdv")
    ap.add_argument("--only", metavar="NAME;NAME",
                    help="time only these variants (';' between names, as the table prints them), beside 'flex' "
                         "and 'switched', which always run")
    ap.add_argument("--json")
    ap.add_argument("--profile", metavar="DIR",
                    help="also profile 5 forward + backward calls of each variant (torch.profiler) and write each "
                         "one's kernel table to DIR: where the time goes, ours against FlexAttention's")
    ap.add_argument("--host-profile", metavar="DIR",
                    help="also profile the host side of 20 forward + backward calls of each variant (cProfile) and "
                         "write each one's busiest functions to DIR: where a call's launch time goes")
    ap.add_argument("--sweep", action="append", choices=["fwd", "dkdv", "dq"], default=[],
                    help="also sweep this kernel's launch configs on each mask's switched call (repeatable)")
    ap.add_argument("--sweep-grid", choices=["small", "full"], default="small",
                    help="the grid: small (15 configs, one device call) or full (_common.FWD_GRID, BWD_GRID)")
    ap.add_argument("--sweep-configs", metavar="BM,BN,W,ST;...",
                    help="sweep these launch configs only (block_m, block_n, warps, stages; ';' between them)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flex_switch_speed.py needs a CUDA GPU (FlexAttention trains on CUDA only)")
    from torch.nn.attention import flex_attention as fa

    import instability_watch.kernels.attention.masks as masks
    import instability_watch.kernels.attention.triton as ta
    from instability_watch import InstabilityWatch, WatchConfig
    from instability_watch.model.layer import AttentionLayer

    dev = "cuda"
    B, N, H, KV, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    lengths, n = [], 0
    while n < N:
        lengths.append(min(N - n, int(torch.randint(128, N // 2, (1,), generator=g))))
        n += lengths[-1]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(dev)
    w = args.window
    mask_mods = {
        "causal": lambda b, h, qi, kv: qi >= kv,
        "sliding": lambda b, h, qi, kv: (qi >= kv) & (qi - kv < w),
        "document": lambda b, h, qi, kv: (doc[qi] == doc[kv]) & (qi >= kv),
    }
    q = torch.randn(B, H, N, D, generator=g).to(dev, torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(B, KV, N, D, generator=g).to(dev, torch.bfloat16).requires_grad_(True) for _ in range(2))
    do = torch.randn(B, H, N, D, generator=g).to(dev, torch.bfloat16)

    class Layer(torch.nn.Module):
        """flex_attention compiled afresh for each mask (after ``torch._dynamo.reset()``): the graphs of both
        layers and three masks together would pass Dynamo's recompile limit (8), and FlexAttention would then run
        its unfused eager path (as the first run's document rows did)."""

        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1, device=dev))  # where the watch finds the model's device
            self.recompile()

        def recompile(self):
            self.flex = torch.compile(fa.flex_attention)

        def forward(self, a, b, c, block):
            return self.flex(a, b, c, block_mask=block, enable_gqa=KV < H)

    plain, switched = Layer(), Layer()
    watch = InstabilityWatch(switched, WatchConfig(probe_every=10 ** 9, shadow_every=0, spectral_every=0,
                                                   warmup_steps=10 ** 9),
                             layers=[AttentionLayer(switched, H, lambda: torch.zeros(H, D, D, device=dev),
                                                    name="flex")])
    watch.switch(0, 0)
    with torch.no_grad():  # step 1, the first probe step, done before timing: the timed calls are plain steps
        block = fa.create_block_mask(mask_mods["causal"], None, None, N, N, device=dev)
        watch.step(switched(q, k, v, block).float().mean())

    # References for the causal mask, no watch: our kernels called directly, with the causal flag (what a switched
    # call whose mask were recognized as causal could run), and with the mask as a boolean mask; each with and
    # without a stabilized head (a switched layer's call has one).
    from instability_watch.kernels import flash_attention
    from instability_watch.kernels.configs import LAUNCH_TABLE, TENSOR_CORES, LaunchConfig, has_launch_config

    if "causal" in args.masks.split(","):
        stab0 = torch.zeros(H, dtype=torch.bool, device=dev)
        stab0[0] = True
        tril = torch.ones(N, N, dtype=torch.bool, device=dev).tril()

    edge_default = ta.EDGE_LOOP if args.edge_loop is None else tuple(
        k.strip() for k in args.edge_loop.split(",") if k.strip())
    unknown = sorted(set(edge_default) - {"fwd", "dq", "dkdv"})
    if unknown:
        raise SystemExit(f"--edge-loop takes fwd, dq and dkdv; got {unknown}")

    even_default, even_dq_default, read_default = ta.EVEN_LOADS, ta.EVEN_DQ, ta.READ_CAUSAL_TILES

    def defaults():  # the kernels' module settings as the library has them (the variants change them)
        ta.GQA_EXPAND, ta.FUSED_BACKWARD, ta.TILE_ORDER = False, None, None
        masks.CAUSAL_TILES, masks.FLAG_WORDS, ta.EDGE_LOOP = True, True, edge_default
        masks.FLAGS_ONCE = True
        ta.EVEN_LOADS, ta.EVEN_DQ, ta.READ_CAUSAL_TILES = even_default, even_dq_default, read_default

    def direct_causal(stabilize=None, mask=None):
        defaults()
        return flash_attention(q, k, v, causal=mask is None, attn_mask=mask, stabilize=stabilize)

    from instability_watch.kernels.attention.ops import FlashAttention
    from instability_watch.kernels.common import DEFAULT_BETA, DEFAULT_EPS

    stab_first = torch.zeros(H, dtype=torch.bool, device=dev)
    stab_first[0] = True
    bounds = {"causal": torch.tensor([0, N], device=dev), "sliding": torch.tensor([0, N], device=dev),
              "document": torch.tensor([0] + lengths, device=dev).cumsum(0)}
    left = {"causal": -1, "sliding": w - 1, "document": -1}

    def direct_documents(mask):
        defaults()
        cu = bounds[mask]
        return FlashAttention.apply(q, k, v, None, None, stab_first, None, None, False, False, D ** -0.5,
                                    DEFAULT_BETA, DEFAULT_EPS, 0.0, "triton", False, cu, cu, left[mask], 0, False)[0]

    table, raw, sweeps = {}, {}, {}
    # a boolean mask's dK/dV launch-table entry (a variant runs the dense calls' config in its place)
    tile = ta.head_dim_tile(D)
    mask_dkdv = LAUNCH_TABLE.get(("dkdv_mask", TENSOR_CORES))
    mask_dkdv = mask_dkdv if mask_dkdv is not None and tile in mask_dkdv else None
    mask_dkdv_default = mask_dkdv[tile] if mask_dkdv is not None else None
    # and its dQ's (a variant runs the dense calls' dQ config in its place)
    mask_dq = LAUNCH_TABLE.get(("dq_mask", TENSOR_CORES))
    mask_dq = mask_dq if mask_dq is not None and tile in mask_dq else None
    mask_dq_default = mask_dq[tile] if mask_dq is not None else None
    # and its forward's (a variant runs the watched dense calls' forward config in its place)
    mask_fwd = LAUNCH_TABLE.get(("fwd_mask", TENSOR_CORES))
    mask_fwd = mask_fwd if mask_fwd is not None and tile in mask_fwd else None
    mask_fwd_default = mask_fwd[tile] if mask_fwd is not None else None
    for mask in args.masks.split(","):
        block = fa.create_block_mask(mask_mods[mask], None, None, N, N, device=dev)
        torch._dynamo.reset()
        plain.recompile()
        switched.recompile()
        def run_switched(expand: bool, fused=None, ordered=None, causal_tiles=True, dkdv=None, dq=None,
                         edge_loop=None, fwd=None, words=True, even=None, even_dq=None,
                         read=None, once=True):
            def call():  # (ordered, dkdv, dq None: the defaults; dkdv "as is": the table untouched, for the sweep)
                ta.GQA_EXPAND = expand  # read by this call's kernels (the variants set them each call)
                ta.FUSED_BACKWARD = fused
                ta.TILE_ORDER = ordered
                masks.CAUSAL_TILES = causal_tiles
                ta.EDGE_LOOP = edge_default if edge_loop is None else edge_loop
                masks.FLAG_WORDS = words
                masks.FLAGS_ONCE = once
                ta.EVEN_LOADS = even_default if even is None else even
                ta.EVEN_DQ = even_dq_default if even_dq is None else even_dq
                ta.READ_CAUSAL_TILES = read_default if read is None else read
                if mask_dkdv is not None and dkdv != "as is":
                    mask_dkdv[tile] = mask_dkdv_default if dkdv is None else LaunchConfig.of(dkdv)
                if mask_dq is not None and dkdv != "as is":
                    mask_dq[tile] = mask_dq_default if dq is None else LaunchConfig.of(dq)
                if mask_fwd is not None and dkdv != "as is":
                    mask_fwd[tile] = mask_fwd_default if fwd is None else LaunchConfig.of(fwd)
                return switched(q, k, v, block)
            return call

        variants = {"flex": lambda: plain(q, k, v, block), "switched": run_switched(False),
                    "switched, dK/dV per query head": run_switched(True),
                    "switched, fused backward": run_switched(False, True),
                    "switched, tiles in grid order": run_switched(False, None, False),
                    "switched, no causal tiles (the mask read)": run_switched(False, causal_tiles=False),
                    "switched, four loops": run_switched(False, edge_loop=()),
                    "switched, the edge loop in dQ too": run_switched(False, edge_loop=("fwd", "dq", "dkdv")),
                    "switched, the pre-pass byte by byte": run_switched(False, words=False),
                    "switched, dK/dV masked loads": run_switched(False, even=False),
                    "switched, dQ masked loads": run_switched(False, even_dq=False),
                    "switched, causal tiles compared": run_switched(False, read=()),
                    "switched, dQ reads its causal tiles": run_switched(False, read=("fwd", "dq", "dkdv")),
                    "switched, the mask read per tile shape": run_switched(False, once=False)}
        if mask_dkdv is not None:
            variants["switched, dK/dV (64, 128, 8, 3)"] = run_switched(False, dkdv=(64, 128, 8, 3))
        if mask_dq is not None:
            variants["switched, dQ (128, 64, 8, 3)"] = run_switched(False, dq=(128, 64, 8, 3))
        if mask_fwd is not None:
            variants["switched, forward (128, 128, 8, 2)"] = run_switched(False, fwd=(128, 128, 8, 2))
        # what a switched call whose mask were recognized could run: our kernels over documents (every batch row the
        # same), their window compared by position, no mask read and no pre-pass; head 0 stabilized as when switched
        variants["ours direct, as documents, head 0 stabilized"] = lambda m=mask: direct_documents(m)
        if mask == "causal":
            variants["ours direct, causal flag"] = direct_causal
            variants["ours direct, causal flag, head 0 stabilized"] = lambda: direct_causal(stab0)
            variants["ours direct, the causal mask as a mask"] = lambda: direct_causal(mask=tril)
            variants["ours direct, the mask, head 0 stabilized"] = lambda: direct_causal(stab0, tril)
        if args.only:
            wanted = {"flex", "switched", *(n.strip() for n in args.only.split(";"))}
            unknown = sorted(wanted - set(variants))
            if unknown and mask == args.masks.split(",")[0]:
                print(f"--only: no variant {unknown} on the {mask} mask; its variants: {sorted(variants)}")
            variants = {name: fn for name, fn in variants.items() if name in wanted}
        results = {name: {"fwd": [], "fwd+bwd": [], "host fwd+bwd": [], "ahead fwd+bwd": []} for name in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                with torch.no_grad():
                    results[name]["fwd"].append(cuda_ms(variants[name], args.iters))
                gpu, host = cuda_and_host_ms(variants[name], args.iters, do)
                results[name]["fwd+bwd"].append(gpu)
                results[name]["host fwd+bwd"].append(host)
                results[name]["ahead fwd+bwd"].append(cuda_ahead_ms(variants[name], args.iters, do))
        raw[mask] = results
        if args.profile:
            for name, fn in variants.items():
                profile_calls(fn, do, args.profile, f"{mask} {name}")
        if args.host_profile:
            for name, fn in variants.items():
                host_profile(fn, do, args.host_profile, f"{mask} {name}")
        table[mask] = {name: {kind: statistics.median(ms) for kind, ms in by.items()} for name, by in results.items()}
        for kernel in args.sweep:
            print(f"sweep: {mask} {kernel}", flush=True)
            # the kernels' own time (the host ahead): as called, a switched call times its host. The forward
            # alone, as in training (grad on: the call saves what its backward reads), or forward + backward.
            def timed(fn=run_switched(False, dkdv="as is"), grad=None if kernel == "fwd" else do):
                return cuda_ahead_ms(fn, args.iters, grad)
            grid = None if args.sweep_grid == "full" else [
                c for c in (SMALL_FWD_GRID if kernel == "fwd" else SMALL_BWD_GRID) if keep(c, ta.head_dim_tile(D))]
            if args.sweep_configs:
                grid = [tuple(int(x) for x in c.split(",")) for c in args.sweep_configs.split(";") if c.strip()]
            # a boolean mask's forward, dK/dV and dQ take their own entries where the table has them
            key = f"{kernel}_mask" if has_launch_config(f"{kernel}_mask", ta.head_dim_tile(D), torch.bfloat16) \
                else kernel
            sweeps.setdefault(mask, {})[kernel] = sweep_launch_configs(key, D, timed, grid=grid, log=print)
    resources = kernel_resources(ta.attn_fwd, ta.attn_bwd_dq, ta.attn_bwd_dkdv)
    print_kernel_resources(resources)
    (cov,) = watch.coverage()
    watch.detach()
    if args.json:
        write_json(args.json, {"device": device_name(dev), "torch": torch.__version__, "documents": lengths,
                               "shape": [B, H, KV, N, D], "window": w, "rounds": raw, "median_ms": table,
                               "not_applied": cov.not_applied, "sweeps": sweeps, "resources": resources})
    print(f"B {B}, N {N}, H {H}/{KV}, D {D}, window {w}, {len(lengths)} documents, {device_name(dev)}")
    if cov.not_applied:
        print(f"NOT APPLIED (the switched rows below are FlexAttention's): {cov.not_applied}")
    print(f"{'mask':<10} {'variant':<45} {'fwd ms':>8} {'fwd+bwd ms':>11} {'host f+b':>9} {'ahead f+b':>10} "
          f"{'flex/ours fwd':>14} {'flex/ours f+b':>14} {'ahead':>6}")
    for mask, by in table.items():
        base = by["flex"]
        for name, t in by.items():
            print(f"{mask:<10} {name:<45} {t['fwd']:8.3f} {t['fwd+bwd']:11.3f} {t['host fwd+bwd']:9.3f} "
                  f"{t['ahead fwd+bwd']:10.3f} {base['fwd'] / t['fwd']:14.3f} {base['fwd+bwd'] / t['fwd+bwd']:14.3f} "
                  f"{base['ahead fwd+bwd'] / t['ahead fwd+bwd']:6.3f}")
    for mask, by in sweeps.items():
        for kernel, sw in by.items():
            kind = "fwd" if kernel == "fwd" else "ahead fwd+bwd"
            ref = table[mask]["flex"][kind]
            own = f"{sw['table'][1]:.3f} ms" if sw["table"] else "failed"
            label = "fwd, host ahead; flex's fwd as called" if kernel == "fwd" else kind
            print(f"sweep {mask} {kernel} ({label}; flex {ref:.3f} ms): the table's {own}; fastest "
                  + ", ".join(f"{tuple(c[:4])} {ms:.3f} ms ({ref / ms:.2f}x)" for c, ms in sw["best"]))
    return 0


def host_profile(fn, grad, folder: str, title: str, calls: int = 20) -> None:
    """cProfile of ``calls`` forward + backward calls of ``fn`` (after a synchronize; the calls' own launches, no
    synchronize among them) to ``folder/host_<title>.txt``: the functions by own time and by cumulative time."""
    import cProfile
    import io
    import os
    import pstats
    import re

    os.makedirs(folder, exist_ok=True)
    for _ in range(3):
        fn().backward(grad)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn().backward(grad)
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    out.write(f"{title}: {calls} forward + backward calls\n")
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", title)
    with open(os.path.join(folder, f"host_{name}.txt"), "w") as f:
        f.write(out.getvalue())


if __name__ == "__main__":
    raise SystemExit(main())
