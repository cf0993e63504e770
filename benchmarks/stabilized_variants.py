"""What the stabilized forward's tie test costs: production against lab variants of its loop, one process.

    python benchmarks/stabilized_variants.py                  # GPU: exactness checks, then the timing table
    python benchmarks/stabilized_variants.py --sass           # no GPU needed: SASS of the KV loop (sm_90a)

Each variant is the production kernel source (``instability_watch/kernels/triton_attention.py``)
with one textual change, written to a temporary module; the package itself is not touched.
Variants:

* ``production``: the paper's conditional rule, a set-and-add count per score (``FSET`` + ``FADD``);
* ``fma-compare``: the same count, the compare as one ``fma.sat`` per score on the FMA pipe
  (``sat(2^64 * (qk - pred(thr)))``); the same decisions for finite thresholds of magnitude >= 2^-41,
  not where a row holds an infinite score (the check below reports those);
* ``top2``: exact too: the block's largest and second largest score in one reduction (three
  ``FMNMX`` per score), no count; the tie test is "second largest >= max - eps";
* ``min-touch``: not a tie test: one more row reduction with one ``FMNMX`` per score (the row
  minimum), the cheapest per-score work a row-wise test can have; shows the floor of any test;
* ``unconditional``: no tie test at all: every row of a stabilized head takes the shift (not the
  paper's rule); shows what the shift itself costs.

The timing table gives each forward (every head stabilized, BF16, causal, CUDA-graph replay)
against the standard forward of the same round (median of the paired ratios, and their range).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "instability_watch/kernels/triton_attention.py"

COUNT = "                c_new += tl.sum(at_least(qk, tl.broadcast_to(thr[:, None], qk.shape), ASM), 1).to(tl.int32)\n"
TIE = '                    tie = (c_new > 1) & (r_new > float("-inf")) & stab_h\n'
FMA_COUNT = """                tb = thr.to(tl.int32, bitcast=True)
                pb = tl.where(thr > 0, tb - 1, tl.where(thr < 0, tb + 1, -1619001344))  # pred(thr); at 0: -2^-64
                nb = tl.maximum(tl.minimum(pb.to(tl.float32, bitcast=True) * -18446744073709551616.0, 3.0e38), -3.0e38)
                y = tl.inline_asm_elementwise(
                    "fma.rn.sat.f32 $0, $1, 0f5F800000, $2;", "=f,f,f",
                    [qk, tl.broadcast_to(nb[:, None], qk.shape)], dtype=tl.float32, is_pure=True, pack=1,
                )
                c_new += tl.sum(y, 1).to(tl.int32)
"""
MIN_TOUCH = "                c_new += (tl.min(qk, 1) >= thr).to(tl.int32)  # not a tie count\n"
UNCOND_TIE = '                    tie = (r_new > float("-inf")) & stab_h  # every row shifts\n'
MAX_LINE = "        r_new = tl.maximum(r_i, tl.max(qk, 1))\n"
C_DONE = "                c_i = c_new\n"
STANDARD_SHIFT = """r_new = tl.maximum(r_i, tl.max(qk, 1))
INDENTm_std = tl.where(r_new > float("-inf"), r_new, 0.0) * qk_scale
INDENTm_new = tl.where(r_new == r_i, m_i, m_std)
"""
TOP2_HEAD = """        if TRACK_TIES:
            if track:  # the block's largest and second largest score in one reduction (pairs first)
                qe, qo = tl.split(tl.reshape(qk, (qk.shape[0], qk.shape[1] // 2, 2)))
                q_lo = tl.minimum(qe, qo, propagate_nan=tl.PropagateNan.ALL)
                rm, rm2 = tl.reduce((tl.maximum(qe, qo), q_lo), 1, _top2)
                r_new = tl.maximum(r_i, rm)
                m_std = tl.where(r_new > float("-inf"), r_new, 0.0) * qk_scale
                m_new = tl.where(r_new == r_i, m_i, m_std)
                thr = r_new - eps_raw
                c_new = tl.where(r_i >= thr, c_i, 0) + (rm >= thr).to(tl.int32) + (rm2 >= thr).to(tl.int32)
                c_new = tl.minimum(c_new, 2)  # saturating: only "more than one" matters
"""
FWD_INNER = "\n\n@triton.jit\ndef _fwd_inner("
TOP2_FN = """

@triton.jit
def _top2(a1, a2, b1, b2):
    # (largest, second largest) of two pairs; NaN dropped (the min propagates it, the max drops it)
    return tl.maximum(a1, b1), tl.maximum(tl.maximum(a2, b2), tl.minimum(a1, b1, propagate_nan=tl.PropagateNan.ALL))
""" + FWD_INNER


def top2(src):
    """One branch per block: tracked programs take (max, second max), the others the plain max."""
    a = src.index(MAX_LINE)
    b = src.index(C_DONE) + len(C_DONE)
    body = src[a:b]
    stabilized = body[body.index("                if HAS_STAB:\n"):body.index(C_DONE)]
    new = (TOP2_HEAD + stabilized + C_DONE
           + "            else:\n                " + STANDARD_SHIFT.replace("INDENT", " " * 16)
           + "        else:\n            " + STANDARD_SHIFT.replace("INDENT", " " * 12))
    return (src[:a] + new + src[b:]).replace(FWD_INNER, TOP2_FN, 1)


VARIANTS = {
    "production": [],
    "fma-compare": [(COUNT, FMA_COUNT)],
    "top2": top2,
    "min-touch": [(COUNT, MIN_TOUCH)],
    "unconditional": [(COUNT, ""), (TIE, UNCOND_TIE)],
}
EXACT = ("fma-compare", "top2")  # checked against production's outputs, LSE and counters, bit for bit
SHAPES = {"gpt2": (16, 12, 1024, 64), "llama": (4, 32, 4096, 128)}


def load_variants(names):
    src = SRC.read_text()
    # the module's relative imports, made absolute: the variants share the package's other modules
    src = re.sub(r"^from \.\.(\w+) import", r"from instability_watch.\1 import", src, flags=re.M)
    src = re.sub(r"^from \.(\w+) import", r"from instability_watch.kernels.\1 import", src, flags=re.M)
    tmp = Path(tempfile.mkdtemp(prefix="stab_variants_"))
    mods = {}
    for name in names:
        edits = VARIANTS[name]
        text = edits(src) if callable(edits) else src
        for old, new in ([] if callable(edits) else edits):
            if text.count(old) != 1:
                raise RuntimeError(f"variant {name!r}: the production source changed; edit not applicable: {old.strip()[:60]!r}")
            text = text.replace(old, new)
        path = tmp / f"variant_{name.replace('-', '_')}.py"
        path.write_text(text)  # Triton reads a kernel's source from its file
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods


# ---------------------------------------------------------------------------
# SASS of the KV loop, compiled for sm_90a on any machine (Triton ships ptxas and nvdisasm)


def sass_table(mods):
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from instability_watch.kernels.configs import launch_config

    bindir = Path(triton.__file__).parent / "backends/nvidia/bin"
    ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE2": "*fp32", "Stab": "*u8", "Counts": "*i64", "Values": "*fp32"}
    rows = []
    for head_dim in (64, 128):
        # the watched forward's launch table (the one a stabilize mask selects), for every variant
        cfg = launch_config("fwd", head_dim, torch.bfloat16, watched=True)
        bm, bn = cfg.block_m, cfg.block_n
        for name, mod in [("standard", mods["production"])] + list(mods.items()):
            fn = mod._attn_fwd
            sig, attrs = {}, {}
            for i, (arg, p) in enumerate(zip(fn.arg_names, fn.params)):
                if p.is_constexpr:
                    sig[arg] = "constexpr"
                elif arg in ptr:
                    sig[arg], attrs[(i,)] = ptr[arg], [["tt.divisibility", 16]]
                elif arg in ("qk_scale", "sm_scale", "eps_raw", "beta", "max_shift2"):
                    sig[arg] = "fp32"
                else:
                    sig[arg] = "i32"
                    if arg.startswith("stride"):
                        attrs[(i,)] = [["tt.divisibility", 16]]
            const = dict(CAUSAL=True, HAS_STAB=name != "standard", HAS_PROBE=False, MASK_KIND=0, DROPOUT=False,
                         HEAD_DIM=head_dim, BLOCK_M=bm,
                         BLOCK_N=bn, EVEN_M=True, EVEN_N=True, EVEN_D=True, DOT_PRECISION="tf32", ASM=True, WARP_STATS=False)
            opts = cfg.options()
            kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                sass = subprocess.run([str(bindir / "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
            ops = loop_ops(sass)
            rows.append((head_dim, name, sum(ops.values()), ops))
    print(f"SASS of the unmasked KV loop, per thread and block (triton {triton.__version__}, sm_90a, causal, BF16,"
          " the watched forward's launch table)")
    print(f"  {'D':>4} {'variant':<14}{'instr':>6}{'FMNMX':>7}{'FSET':>6}{'FADD':>6}{'FFMA':>6}{'SHFL':>6}{'LDL/STL':>8}")
    for head_dim, name, total, ops in rows:
        print(f"  {head_dim:>4} {name:<14}{total:>6}{ops['FMNMX']:>7}{ops['FSET']:>6}{ops['FADD']:>6}{ops['FFMA']:>6}"
              f"{ops['SHFL']:>6}{ops['LDL'] + ops['STL']:>8}")
    return [dict(head_dim=h, variant=n, instructions=t, ops=dict(o)) for h, n, t, o in rows]


def loop_ops(sass):
    """Opcode counts of the first loop (the first backward branch's range): the unmasked KV loop."""
    addr, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = re.match(r"^\s*\.(L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            a = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = a
            pending = []
            addr.append((a, m.group(2)))
    for a, text in addr:
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text)
        if m and labels.get(m.group(1), a + 1) < a:
            start = labels[m.group(1)]
            ops = collections.Counter()
            for b, t in addr:
                if start <= b <= a:
                    ops[re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]] += 1
            return ops
    raise RuntimeError("no loop found in the SASS")


# ---------------------------------------------------------------------------
# GPU: exactness, then timing


def check_exact(mods):
    import torch
    from instability_watch import Probe
    from instability_watch.mechanism import near_tie_inputs

    def run(mod, q, k, v, stab, causal):
        probe = Probe(q.shape[1], "cuda")
        o, lse2 = mod.attention_forward_lse2(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, stabilize=stab, beta=2.0,
                                        eps=1e-3, counts=probe.counts, values=probe.values)
        return o.nan_to_num(1234.5), lse2.nan_to_num(1234.5), probe.counts, probe.values

    checked, failures = 0, []
    for B, H, N, D in ((2, 4, 1000, 64), (1, 4, 777, 128)):
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        qi, ki = (torch.randint(-2, 3, (B, H, N, D), device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        qn = q.clone()
        qn[0, 0, 5] = float("nan")
        qn[0, 1, 7, 3] = float("inf")
        qn[-1, 2, 9, 1] = float("-inf")
        t = near_tie_inputs(batch=2, heads=H, seq=N, head_dim=D, device="cuda")
        cases = {"random": (q, k, v), "integer (exact ties)": (qi, ki, v), "nan/inf rows": (qn, k, v), "near-tie": (t.q, t.k, t.v)}
        for stab in (torch.ones(H, dtype=torch.bool, device="cuda"), torch.arange(H, device="cuda") % 2 == 0):
            for case, (a, b, c) in cases.items():
                for causal in (True, False):
                    ref = run(mods["production"], a, b, c, stab, causal)
                    for name in (n for n in EXACT if n in mods):
                        got = run(mods[name], a, b, c, stab, causal)
                        checked += 1
                        if not all(torch.equal(x, y) for x, y in zip(ref, got)):
                            failures.append(f"{name}: {case}, N={N} D={D}, causal={causal}")
    print(f"exactness: {checked} comparisons with production (outputs, LSE, probe counters), {len(failures)} differ")
    for f in failures:
        print("  differs:", f)
    return dict(checked=checked, failures=failures)


def time_table(mods, rounds):
    import torch
    import triton

    from _common import warm_gpu  # benchmarks/ is this script's folder: first on sys.path

    warm_gpu()
    out = {}
    for shape, (B, H, N, D) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        every = torch.ones(H, dtype=torch.bool, device="cuda")

        def fwd(mod, stab):
            return lambda: mod.attention_forward_lse2(q, k, v, causal=True, scale=D ** -0.5, stabilize=stab, beta=2.0,
                                                 eps=1e-3, counts=None, values=None)

        fns = {"standard": fwd(mods["production"], None), **{n: fwd(m, every) for n, m in mods.items()}}
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, fn in fns.items():
                times[n].append(triton.testing.do_bench_cudagraph(fn, rep=100))
        rows = {}
        for n, ts in times.items():
            paired = sorted(100 * (t / s - 1) for t, s in zip(ts, times["standard"]))
            rows[n] = dict(ms=sorted(ts)[len(ts) // 2], ms_rounds=ts, vs_standard_pct=paired)
        out[shape] = rows
        print(f"\n{shape}: B{B} H{H} N{N} D{D} causal, forward, every head stabilized, {rounds} interleaved rounds")
        for n, r in rows.items():
            p = r["vs_standard_pct"]
            print(f"  {n:<14}{r['ms']:8.4f} ms   vs standard: median {p[len(p) // 2]:+5.1f}%  ({p[0]:+.1f}% .. {p[-1]:+.1f}%)")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sass", action="store_true", help="print the KV loop's SASS statistics instead (no GPU needed)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    if "production" not in names:
        names.insert(0, "production")
    import triton

    header = dict(date=datetime.date.today().isoformat(), triton=triton.__version__,
                  command="python benchmarks/stabilized_variants.py " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.sass:
        os.environ.pop("TRITON_INTERPRET", None)
        result = dict(header, device="none: compiled for sm_90a, no GPU", sass=sass_table(load_variants(names)))
    else:
        import torch

        if not torch.cuda.is_available():
            print("benchmarks/stabilized_variants.py needs a CUDA GPU (or --sass)", file=sys.stderr)
            return 2
        mods = load_variants(names)
        result = dict(header, device=torch.cuda.get_device_name(), torch=torch.__version__)
        result["exactness"] = check_exact(mods)
        result["timing"] = time_table(mods, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
