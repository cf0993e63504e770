"""What dropout costs our kernels: Philox rounds, and where the random numbers are used.

GPT-2 small's attention (B16 H12 N1024 D64, causal, BF16, dropout 0.1) on our Triton
kernels, against SDPA flash with the same dropout, with Philox4x32's rounds varied: 10
(Random123's default, ours), 7 (FA2's), 1 (not random: what the rest costs). Each variant
runs in its own process (the rounds are a compile-time constant, patched into
``instability_watch.kernels.attention.triton`` before the first compile); only speed is
measured here (the tests check the numbers). For each it also counts, in the compiled
kernels, layout conversions (TTGIR ``convert_layout``: data moved between threads through
shared memory), local-memory traffic (PTX ``ld.local``/``st.local``: register spills) and
``mul.hi`` (Philox's multiplies).

    python benchmarks/dropout_rng.py --rounds 10,7,1 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import bench, header, warm_gpu, write_json

SHAPE = dict(B=16, H=12, N=1024, D=64)
P = 0.1


def child(variant: str) -> dict:
    """Time one variant in this process; its compile-time constants are patched in first."""
    import torch
    import triton.language as tl

    import instability_watch.kernels.triton_common as tc
    from instability_watch.kernels import dropout_seed, flash_attention

    tc.P_ROUNDS = tl.constexpr(int(variant))  # read by dropout_keep, defined before the kernels compile

    torch.manual_seed(0)
    B, H, N, D = SHAPE["B"], SHAPE["H"], SHAPE["N"], SHAPE["D"]
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    seed = dropout_seed(None, "cuda")
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flash = torch.nn.attention.SDPBackend.FLASH_ATTENTION

    def ours_fwd():
        with torch.no_grad():
            flash_attention(q, k, v, dropout_p=P, causal=True, seed=seed)

    def ours_fb():
        flash_attention(*leaves, dropout_p=P, causal=True, seed=seed).backward(do)

    def ours_fb_nodrop():
        flash_attention(*leaves, causal=True).backward(do)

    def sdpa_fwd():
        with torch.no_grad(), torch.nn.attention.sdpa_kernel(flash):
            sdpa(q, k, v, dropout_p=P, is_causal=True)

    def sdpa_fb():
        with torch.nn.attention.sdpa_kernel(flash):
            sdpa(*leaves, dropout_p=P, is_causal=True).backward(do)

    warm_gpu(1.0)
    res = {"variant": variant}
    for name, fn in (("ours_fwd", ours_fwd), ("sdpa_fwd", sdpa_fwd), ("ours_fb", ours_fb), ("sdpa_fb", sdpa_fb),
                     ("ours_fb_nodrop", ours_fb_nodrop)):
        fn()
        res[name] = min(bench(fn, rep=100) for _ in range(3))
    res["fwd_ratio"] = res["sdpa_fwd"] / res["ours_fwd"]
    res["fb_ratio"] = res["sdpa_fb"] / res["ours_fb"]
    res["kernels"] = kernel_facts(Path(os.environ["TRITON_CACHE_DIR"]))
    return res


def kernel_facts(cache: Path) -> dict:
    """Per compiled kernel of ours: TTGIR layout conversions and PTX local loads/stores."""
    out = {}
    for ttgir in cache.rglob("*.ttgir"):
        name = ttgir.stem
        if not name.startswith("_attn"):
            continue
        text = ttgir.read_text()
        ptx = ttgir.with_suffix(".ptx")
        ptx_text = ptx.read_text() if ptx.exists() else ""
        facts = {"convert_layout": text.count("convert_layout"), "local_alloc": text.count("local_alloc"),
                 "ld_local": len(re.findall(r"\bld\.local", ptx_text)), "st_local": len(re.findall(r"\bst\.local", ptx_text)),
                 "mul_hi": len(re.findall(r"mul\.hi\.u32|mad\.hi", ptx_text))}
        out.setdefault(name, []).append(facts)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", default="10,7,1", help="comma-separated Philox round counts, one process each")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child)))
        return 0
    rows = []
    for variant in args.rounds.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            proc = subprocess.run([sys.executable, __file__, "--child", variant], env=env, capture_output=True,
                                  text=True, timeout=300)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            rows.append({"variant": variant, "error": proc.stderr[-1500:]})
            print(f"{variant}: FAILED\n{proc.stderr[-1500:]}", flush=True)
            continue
        rows.append(json.loads(line[0][7:]))
        r = rows[-1]
        drop = {k: [(f["convert_layout"], f["ld_local"] + f["st_local"]) for f in v if f["mul_hi"]]
                for k, v in r["kernels"].items()}
        print(f"rounds {variant:>2}  fwd {r['ours_fwd']:.3f} vs flash {r['sdpa_fwd']:.3f} ({r['fwd_ratio']:.2f}x)  "
              f"fwd+bwd {r['ours_fb']:.3f} vs {r['sdpa_fb']:.3f} ({r['fb_ratio']:.2f}x)  ours without dropout "
              f"{r['ours_fb_nodrop']:.3f}  dropout kernels (layout conversions, local ld/st): {drop}", flush=True)
    if args.json:
        write_json(args.json, {**header(argv), "shape": SHAPE, "p": P, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
