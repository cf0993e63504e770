"""D = 256 forward in Gluon: checks against the Triton forward and float64, times against SDPA.

    PYTHONPATH=$PWD python benchmarks/d256_gluon_fwd_lab.py --out DIR    # GPU (Hopper): check, time, profile
    python benchmarks/d256_gluon_fwd_lab.py --compile-only               # any machine: sm_90 registers, spills

The D = 256 bar (fwd+bwd at least cuDNN's on the same call) was missed by the forward (0.63 ms
against cuDNN's 0.49 at B4 H8 N4096 causal) as much as by the backward. The Gluon forward
(``instability_watch/kernels/gluon_attention.py``) keeps Q in shared memory, K and V double-buffered
by TMA, P in registers as wgmma's A operand, and issues S_j = Q K_j^T before O += P_{j-1} V_{j-1},
running the softmax of S_j while the tensor cores work (FA3's order inside a warpgroup). This lab
checks it, plain and with stabilized heads (keys in equal pairs, so rows tie), against the Triton
forward (bit for bit) and float64, times it next to the Triton forward and SDPA's cuDNN and flash
kernels, times the backward's variants (all Triton; Triton dQ + Gluon dK/dV; Gluon dQ + dK/dV) and
fwd+bwd, measures the host time of a small call, and profiles one fwd+bwd of ours and of cuDNN
kernel by kernel. benchmarks/RESULTS.md records it (its earlier rounds also timed forward variants
since removed: no overlap, 128-key blocks).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import triton

SHAPES = {"causal": dict(B=4, H=8, N=4096, causal=True), "full": dict(B=4, H=8, N=2048, causal=False)}
D = 256


def compile_only():
    """Compile the forward (plain and with stabilized heads, causal or not) for sm_90 without a GPU; print registers, spills, shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from instability_watch.kernels.attention import gluon as ga

    fn = ga._build_fwd_kernel()
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    ok = True
    for has_stab in (False, True):
        for causal in (True, False):
            def desc(rows):
                return f"tensordesc<bf16[{rows}, {D}],{gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)!r}>"

            bm, bn = ga.FWD_BLOCK_M, ga.BLOCK
            sig = dict(q_desc=desc(bm), k_desc=desc(bn), v_desc=desc(bn), o_desc=desc(bm), LSE2="*fp32", Stab="*u8")
            sig.update({n: "i32" for n in "q_rb q_rh q_ch k_rb k_rh k_ch v_rb v_rh v_ch o_rb o_rh o_ch H N".split()})
            sig.update(qk_scale="fp32", eps_raw="fp32", beta="fp32", max_shift2="fp32")
            const = dict(CAUSAL=causal, HAS_STAB=has_stab, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, num_warps=ga.NUM_WARPS)
            sig.update({c: "constexpr" for c in const})
            try:
                k = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=ga.NUM_WARPS))
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
                regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
                rec = dict(has_stab=has_stab, causal=causal, smem=k.metadata.shared,
                           regs=int(regs.group(1)) if regs else None, stack=int(stack.group(1)) if stack else None)
            except Exception as exc:  # report and go on
                ok = False
                rec = dict(has_stab=has_stab, causal=causal, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
            print(rec, flush=True)
    return 0 if ok else 1


def reference64(q, k, v, causal, scale):
    """O and LSE (natural log) in float64, one (batch, head) at a time."""
    import torch

    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def gpu_main(args):  # noqa: C901 (one script)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from instability_watch import flash_attention
    from instability_watch.kernels.attention.triton import attention_backward_lse2, attention_forward_lse2

    LOG2E = 1.0 / math.log(2.0)

    def bench(fn):
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    VARIANTS = ("plain", "stab")  # "stab": every other head stabilized (beta 2, eps 1e-3)

    def stab_mask(H, every=2):
        return (torch.arange(H, device="cuda") % every == 0)

    def fwd(q, k, v, causal, variant, gluon):
        stab = stab_mask(q.shape[1]) if variant == "stab" else None
        return attention_forward_lse2(q, k, v, causal=causal, scale=1 / math.sqrt(D), stabilize=stab, beta=2.0,
                                      eps=1e-3, counts=None, values=None, gluon=gluon)

    def gluon_fwd(q, k, v, causal, variant):
        return fwd(q, k, v, causal, variant, True)

    def triton_fwd(q, k, v, causal, variant="plain"):
        return fwd(q, k, v, causal, variant, False)

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, checks=[],
               shapes={})
    # -- correctness: small and odd shapes, both layouts (contiguous; HF's (B, N, H, D) transposed)
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [(1, 2, 128, True), (2, 3, 256, False), (2, 2, 384, True), (1, 4, 1024, True), (3, 1, 640, False)]
    for (B, H, N, causal) in cases:
        for layout in ("bhnd", "bnhd"):
            shp = (B, H, N, D) if layout == "bhnd" else (B, N, H, D)
            q, k, v = (torch.randn(shp, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            n_dim = 2 if layout == "bhnd" else 1  # ties: the keys in equal pairs
            k.narrow(n_dim, 1, N - 1)[(slice(None),) * n_dim + (slice(None, None, 2),)] = \
                k.narrow(n_dim, 0, N - 1)[(slice(None),) * n_dim + (slice(None, None, 2),)]
            if layout == "bnhd":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            o64, lse64 = reference64(q, k, v, causal, 1 / math.sqrt(D))
            o_pt = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            err_pt = (o_pt.double() - o64).abs().max().item()
            for variant in VARIANTS:
                rec = dict(shape=(B, H, N), causal=causal, layout=layout, variant=variant)
                try:
                    o_t, l_t = triton_fwd(q, k, v, causal, variant)
                    o_g, l_g = gluon_fwd(q, k, v, causal, variant)
                    torch.cuda.synchronize()
                    rec.update(
                        o_vs_triton=(o_g.float() - o_t.float()).abs().max().item(),
                        o_equal_frac=(o_g == o_t).float().mean().item(),
                        lse_vs_triton=(l_g - l_t).abs().max().item(),
                        o_err64=(o_g.double() - o64).abs().max().item(), pytorch_err64=err_pt,
                        lse_err64=(l_g.double() / LOG2E - lse64).abs().max().item(),
                        o_stride_ok=o_g.stride() == o_t.stride())
                    # both variants: the Triton forward's O and LSE bit for bit; the plain one also within
                    # twice PyTorch's error (a stabilized head's shift rounds P differently, by design)
                    rec["ok"] = (rec["o_equal_frac"] == 1.0 and rec["lse_vs_triton"] == 0.0
                                 and rec["lse_err64"] < 1e-3
                                 and (variant == "stab" or rec["o_err64"] <= 2 * err_pt + 1e-6))
                except Exception as exc:
                    rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:800]}")
                print(rec, flush=True)
                res["checks"].append(rec)
    # -- the backward (Gluon dQ + dK/dV, the default) against the Triton kernels and float64
    res["bwd_checks"] = []
    for (B, H, N, causal) in cases:
        for layout in ("bhnd", "bnhd"):
            shp = (B, H, N, D) if layout == "bhnd" else (B, N, H, D)
            q, k, v, do = (torch.randn(shp, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            if layout == "bnhd":
                q, k, v, do = (t.transpose(1, 2) for t in (q, k, v, do))
            rec = dict(shape=(B, H, N), causal=causal, layout=layout)
            try:
                kw = dict(causal=causal, scale=1 / math.sqrt(D), counts=None, values=None, shadow=False)
                o, lse = triton_fwd(q, k, v, causal)
                got = attention_backward_lse2(q, k, v, o, lse, do, **kw)[:3]
                tri = attention_backward_lse2(q, k, v, o, lse, do, gluon=False, **kw)[:3]
                leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
                ref = torch.autograd.grad(reference64(*leaves, causal, 1 / math.sqrt(D))[0], leaves, do.double())
                leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                pt = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=causal), leaves, do)
                for n, a, b, r, e in zip("qkv", got, tri, ref, pt):
                    rec[f"d{n}_vs_triton"] = (a.float() - b.float()).abs().max().item()
                    rec[f"d{n}_err64"] = (a.double() - r).abs().max().item()
                    rec[f"d{n}_pytorch_err64"] = (e.double() - r).abs().max().item()
                    rec[f"d{n}_stride_ok"] = a.stride() == b.stride()
                rec["ok"] = all(rec[f"d{n}_err64"] <= 2 * rec[f"d{n}_pytorch_err64"] + 1e-6 for n in "qkv")
            except Exception as exc:
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:800]}")
            print(rec, flush=True)
            res["bwd_checks"].append(rec)
    # -- host time of one fwd+bwd (a small call: the GPU waits on the host), fast launch path on and off
    import time

    from instability_watch.kernels.launch import Launcher

    res["host_us"] = {}
    q, k, v, do = (torch.randn(1, 2, 256, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))

    def host_fb(fn):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        return lambda: torch.autograd.grad(fn(*leaves), leaves, do)

    host_calls = {
        "ours": host_fb(lambda a, b, c: flash_attention(a, b, c, causal=True)),
        "cudnn": host_fb(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)),
    }
    fast = Launcher.enabled
    for label in ("ours", "ours_slow_launch", "cudnn"):
        fn = host_calls[label.split("_")[0]]
        Launcher.enabled = fast and label != "ours_slow_launch"
        try:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            res["host_us"][label] = (time.perf_counter() - t0) / 200 * 1e6
        finally:
            Launcher.enabled = fast
    print("host time per fwd+bwd (us, B1 H2 N256 causal):", res["host_us"], flush=True)
    # -- timing at the bar's shapes; large-shape correctness on two heads against float64
    for name, sh in SHAPES.items():
        B, H, N, causal = sh["B"], sh["H"], sh["N"], sh["causal"]
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        rec = dict(shape=sh, ms={})
        o_t, l_t = triton_fwd(q, k, v, causal)
        o64, _ = reference64(q[:1, :2], k[:1, :2], v[:1, :2], causal, 1 / math.sqrt(D))
        rec["pytorch_err64"] = (F.scaled_dot_product_attention(q[:1, :2], k[:1, :2], v[:1, :2], is_causal=causal)
                                .double() - o64).abs().max().item()
        calls = {"triton": lambda: triton_fwd(q, k, v, causal)}
        calls["triton_stab"] = lambda: triton_fwd(q, k, v, causal, "stab")
        for variant in VARIANTS:
            key = f"gluon_{variant}"
            try:
                o_t, l_t = triton_fwd(q, k, v, causal, variant)
                o_g, l_g = gluon_fwd(q, k, v, causal, variant)
                torch.cuda.synchronize()
                rec[key] = dict(o_vs_triton=(o_g.float() - o_t.float()).abs().max().item(),
                                o_equal_frac=(o_g == o_t).float().mean().item(),
                                lse_vs_triton=(l_g - l_t).abs().max().item(),
                                o_err64=(o_g[:1, :2].double() - o64).abs().max().item())
                calls[key] = (lambda var: (lambda: gluon_fwd(q, k, v, causal, var)))(variant)
            except Exception as exc:
                rec[key] = dict(error=f"{type(exc).__name__}: {str(exc)[:800]}")
            print(name, key, rec[key], flush=True)
        for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def sd(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            calls[label] = sd
        for _ in range(args.rounds):
            for key, fn in calls.items():
                rec["ms"].setdefault(key, []).append(bench(fn))

        # fwd+bwd through the package (default: Gluon forward + dK/dV) and with the Gluon forward off
        def fb(fn):
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            return lambda: torch.autograd.grad(fn(*leaves), leaves, do)

        def ours(a, b, c):
            return flash_attention(a, b, c, causal=causal)

        every_head = torch.ones(H, dtype=torch.bool, device="cuda")

        def ours_stab(a, b, c):  # a switched layer's call: every head stabilized
            return flash_attention(a, b, c, causal=causal, stabilize=every_head)

        def cudnn(a, b, c):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(a, b, c, is_causal=causal)

        import instability_watch.kernels.attention.triton as ta

        real_fwd = ta.attention_forward_lse2

        def no_gluon_fwd(*a, **kw):
            kw["gluon"] = False
            return real_fwd(*a, **kw)

        for _ in range(args.rounds):
            rec["ms"].setdefault("fwdbwd_ours", []).append(bench(fb(ours)))
            rec["ms"].setdefault("fwdbwd_ours_stab", []).append(bench(fb(ours_stab)))
            ta.attention_forward_lse2 = no_gluon_fwd
            try:
                rec["ms"].setdefault("fwdbwd_ours_triton_fwd", []).append(bench(fb(ours)))
            finally:
                ta.attention_forward_lse2 = real_fwd
            rec["ms"].setdefault("fwdbwd_cudnn", []).append(bench(fb(cudnn)))
        # the backward alone: the launcher called directly, and through autograd (graph kept)
        o_p, lse_p = attention_forward_lse2(q, k, v, causal=causal, scale=1 / math.sqrt(D), stabilize=None,
                                            beta=1.0, eps=0.0, counts=None, values=None)
        direct = lambda: attention_backward_lse2(q, k, v, o_p, lse_p, do, causal=causal, scale=1 / math.sqrt(D),  # noqa: E731
                                                 counts=None, values=None, shadow=False)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        o_graph = ours(*leaves)
        via_autograd = lambda: torch.autograd.grad(o_graph, leaves, do, retain_graph=True)  # noqa: E731
        bwd_kw = dict(causal=causal, scale=1 / math.sqrt(D), counts=None, values=None, shadow=False)
        from instability_watch.kernels.configs import launch_config

        dq_cfg = launch_config("dq", 256, torch.bfloat16)
        bwd_variants = {
            "bwd_triton": lambda: attention_backward_lse2(q, k, v, o_p, lse_p, do, gluon=False, **bwd_kw),
            "bwd_triton_dq_gluon_dkdv": lambda: attention_backward_lse2(q, k, v, o_p, lse_p, do, config_dq=dq_cfg,
                                                                        **bwd_kw),
        }
        got = direct()
        for key, fn in bwd_variants.items():
            other = fn()
            rec[f"{key}_diff"] = [(a.float() - b.float()).abs().max().item() for a, b in zip(got[:3], other[:3])]
        for _ in range(args.rounds):
            rec["ms"].setdefault("bwd_direct", []).append(bench(direct))
            rec["ms"].setdefault("bwd_autograd", []).append(bench(via_autograd))
            for key, fn in bwd_variants.items():
                rec["ms"].setdefault(key, []).append(bench(fn))
        # kernel by kernel, one fwd+bwd each (CUDA times from the profiler, microseconds)
        prof_out = {}
        for label, fn in (("ours", fb(ours)), ("cudnn", fb(cudnn)), ("bwd_direct", direct),
                          ("bwd_autograd", via_autograd)):
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            rows = []
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if t:
                    rows.append((ev.key[:90], round(t / 5, 1), ev.count // 5))
            rows.sort(key=lambda r: -r[1])
            prof_out[label] = rows[:12]
            print(name, label, "profile (us per fwd+bwd):", flush=True)
            for r in rows[:12]:
                print("   ", r, flush=True)
        rec["profile"] = prof_out
        res["shapes"][name] = rec
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gluon_fwd_lab.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    print()
    print(f"{res['device']} | torch {res['torch']} | triton {res['triton']} | ms, min of {args.rounds} medians")
    bad = [c for c in res["checks"] + res["bwd_checks"] if not c.get("ok")]
    n_checks = len(res["checks"]) + len(res["bwd_checks"])
    print(f"checks: {n_checks - len(bad)}/{n_checks} ok" + (f"; FAILED: {bad}" if bad else ""))
    print("host time per fwd+bwd, us (B1 H2 N256 causal):",
          ", ".join(f"{k} {v:.0f}" for k, v in res["host_us"].items()))
    for name, rec in res["shapes"].items():
        ms = {k: min(v) for k, v in rec["ms"].items()}
        cu = ms.get("cudnn", float("nan"))
        print(f"== {name} {rec['shape']}: forward vs cuDNN {cu:.3f}")
        for key in ("triton", "triton_stab", *(k for k in ms if k.startswith("gluon")), "flash"):
            if key in ms:
                print(f"   {key:24s} {ms[key]:.3f}  ratio {cu / ms[key]:.3f}")
        c = ms["fwdbwd_cudnn"]
        for key in ("fwdbwd_ours", "fwdbwd_ours_stab", "fwdbwd_ours_triton_fwd"):
            print(f"   {key:24s} {ms[key]:.3f} vs cuDNN {c:.3f}  ratio {c / ms[key]:.3f}")
        print(f"   backward alone: direct {ms['bwd_direct']:.3f}, through autograd {ms['bwd_autograd']:.3f}, "
              f"all Triton {ms['bwd_triton']:.3f}, Triton dQ + Gluon dK/dV {ms['bwd_triton_dq_gluon_dkdv']:.3f}")
        print(f"   max |default - Triton| dq, dk, dv: {rec['bwd_triton_diff']}")
    return 0 if not bad else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90, print registers (no GPU)")
    args = ap.parse_args(argv)
    if args.compile_only:
        return compile_only()
    return gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
