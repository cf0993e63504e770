"""Masks, dropout and D=256: our attention against PyTorch SDPA, checked then timed, in one process.

    PYTHONPATH=$PWD python benchmarks/masked_attention.py                     # GPU: every case, about 5 min on an H100
    PYTHONPATH=$PWD python benchmarks/masked_attention.py --cases pad20,window --rounds 5
    PYTHONPATH=$PWD python benchmarks/masked_attention.py --device cpu --quick --out /tmp/mab   # smoke test

Cases (full sizes; ``--quick`` shrinks every one to N <= 512):

* ``fully_masked`` (check only, B2 H4 N320 D128): a bool mask with fully masked query rows (a block of
  rows of batch 0, and the padded queries of batch 1 under a query-and-key padding mask), the same
  mask as an additive ``-inf`` float mask, and as HF's additive ``finfo(bf16).min`` mask. Records what
  SDPA (default backend and each of EFFICIENT / CUDNN / MATH) gives on the fully masked rows (NaN,
  zero, or a finite value) for the output and dq, whether its dk/dv stay finite, what ours gives, and
  whether the two agree exactly.
* ``pad20``: B8 H16 N2048 D128, non-causal, HF padding mask (bool (B,1,N,N), True where key < L_b;
  padded query rows still see the valid keys); lengths deterministic, mean padded fraction 0.2.
* ``window``: B2 H16 N4096 D128, bool (B,1,N,N), key j visible from row i iff i-1024 < j <= i.
* ``drop_gpt2``: B16 H12 N1024 D64 causal, dropout 0.1, against SDPA flash with dropout 0.1.
* ``drop_llama``: B4 H32 N4096 D128 causal, dropout 0.1, against SDPA flash.
* ``dropout_mean`` (check only, B2 H4 N256 D64 causal): the mean of O over 32 seeds converges to
  the no-dropout output like 1/sqrt(n).
* ``d256_causal``: B4 H8 N4096 D256 causal; ``d256``: B4 H8 N2048 D256 non-causal; against SDPA's
  default backend, and SDPA flash (and the others) where they accept D=256; ours plain and with every
  head stabilized (a switched layer's call).
* ``bias_grad`` (beyond the brief): B4 H16 N2048 D128 non-causal, an ALiBi float bias (1,H,N,N) that
  requires grad (the float-mask gradient of the contract), against SDPA with the same bias.

Correctness, before any timing, on the timed sizes:

* Masks and D=256: ours (bf16) and SDPA (bf16, every backend that runs) against a float64 reference
  of the same math (``softmax(scale*QK^T + mask) V`` from the bf16 inputs upcast, chunked over batch
  and heads), for O and dq, dk, dv (and d(mask) for ``bias_grad``) with a fixed random dO. Metric:
  max abs error (the relative Frobenius error is recorded too). Pass: ours <= 2 x SDPA-primary's
  error + 1e-6 on every metric (NaN never passes). Fully masked rows (every key -inf or False) are
  left out of the O/dq errors and checked separately: the contract says 0 there, and the JSON says
  what SDPA gives. The SDPA baseline for a mask with such rows runs on a "repaired" mask (the dead
  row sees key 0) with dO zeroed on those rows: the same math on every other row and on dk/dv, but
  finite even where SDPA itself gives NaN.
* Dropout: the keep mask of ``dropout_mask(dropout_seed(Generator.manual_seed(s)), ...)``; float64
  reference ``O = (softmax(S) * keep / (1 - p_eff)) V`` and its gradients by float64 autograd. The
  bound is 2 x (the error of SDPA-primary (flash) in bf16 *without* dropout against the float64
  no-dropout reference, same inputs) / (1 - p_eff). Why that scale: a flash kernel's error comes
  from where it rounds (P and dS to bf16 for the matmuls, O and the gradients once at the end), and
  dropout changes none of those places; it zeroes entries and multiplies the kept ones (and so their
  rounding errors) by 1/(1 - p_eff). A PyTorch bf16 implementation of the explicit formula would be
  a looser yardstick (it rounds S and the softmax to bf16 too). Statistics of the keep mask on the
  visible (causal) region: overall dropped fraction within 5 standard errors of p_eff, the largest
  per-(batch, head) deviation too, and independence (agreement rate p^2 + (1-p)^2 within 5 SE)
  between two heads, two batch entries, neighbouring rows, neighbouring keys and two seeds.
  Determinism: the same generator seed twice gives bitwise equal O, dq, dk, dv; a generator used
  twice (not reseeded) gives a different mask; ``generator=None`` follows ``torch.manual_seed``.

Timing (GPU): ``triton.testing.do_bench`` medians (it flushes L2 before every call), the forward on
inputs that do not require grad (an inference forward), and forward+backward as
``autograd.grad(fn(q, k, v), (q, k, v), dO)`` (plus the float mask for ``bias_grad``). All variants
of a case are compiled and run once first, the GPU is warmed up, then ``--rounds`` interleaved rounds
(the order rotates each round) time every variant back to back on the same tensors; the table shows
the median over rounds, the JSON every round and the per-round paired ratios. Ratio = SDPA ms / ours
ms (> 1: ours faster). On CPU the times are ``time.perf_counter`` medians of a few calls (only a
smoke test). A ``--budget`` (seconds, default 300) stops timing new cases once spent, so a run stays
under about 6 minutes; the JSON under ``--out`` is rewritten after every case.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import instability_watch.kernels as iw_kernels
from instability_watch import flash_attention

from _common import bench, sync, warm_gpu
from _common import header as common_header

try:
    import triton
except Exception:  # noqa: BLE001 -- a CPU smoke test does not need Triton
    triton = None

BF16 = torch.bfloat16
DROPOUT_P = 0.1
BOUND_FACTOR = 2.0
BOUND_FLOOR = 1e-6
METRICS = ("o", "dq", "dk", "dv", "dmask")
SHORT = {"MATH": "MATH", "FLASH_ATTENTION": "FLASH", "EFFICIENT_ATTENTION": "EFF", "CUDNN_ATTENTION": "CUDNN",
         "ERROR": "ERROR", "OVERRIDEABLE": "OVERRIDE"}

FULL = {
    "fully_masked": dict(B=2, H=4, N=320, D=128),
    "pad20": dict(B=8, H=16, N=2048, D=128),
    "window": dict(B=2, H=16, N=4096, D=128, W=1024),
    "drop_gpt2": dict(B=16, H=12, N=1024, D=64),
    "drop_llama": dict(B=4, H=32, N=4096, D=128),
    "dropout_mean": dict(B=2, H=4, N=256, D=64, seeds=32),
    "d256_causal": dict(B=4, H=8, N=4096, D=256),
    "d256": dict(B=4, H=8, N=2048, D=256),
    "bias_grad": dict(B=4, H=16, N=2048, D=128),
}
QUICK = {
    "fully_masked": dict(B=2, H=2, N=96, D=64),
    "pad20": dict(B=2, H=2, N=256, D=128),
    "window": dict(B=1, H=2, N=512, D=128, W=128),
    "drop_gpt2": dict(B=2, H=2, N=256, D=64),
    "drop_llama": dict(B=1, H=2, N=256, D=128),
    "dropout_mean": dict(B=1, H=2, N=64, D=64, seeds=32),
    "d256_causal": dict(B=1, H=2, N=256, D=256),
    "d256": dict(B=1, H=2, N=128, D=256),
    "bias_grad": dict(B=2, H=2, N=256, D=64),
}


# ---------------------------------------------------------------------------
# small helpers


def p_effective(p):
    return round(p * 65536) / 65536


def short_exc(exc, limit=400):
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:limit]


def fmt(x, spec=".2e"):
    return "-" if x is None else ("nan" if isinstance(x, float) and math.isnan(x) else format(x, spec))


def finite(x):
    return x is not None and isinstance(x, float) and math.isfinite(x)


def sanitize(obj):
    """JSON without NaN/Infinity literals (strings instead), tensors and enums as text."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ("nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf"))
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return sanitize(obj.item())
    return str(obj)


def backend_name(b):
    return "default" if b is None else b.name


def short_backend(b):
    return "default" if b is None else SHORT.get(b.name, b.name)


def choice_name(idx):
    for b in SDPBackend.__members__.values():
        if int(b.value) == int(idx):
            return b.name
    return f"unknown({idx})"


def classify(t):
    """What a set of values is: 'none' (empty), 'nan', 'inf', 'zero' or 'finite nonzero' (worst first)."""
    if t.numel() == 0:
        return "none"
    if torch.isnan(t).any():
        return "nan" if torch.isnan(t).all() else "some nan"
    if torch.isinf(t).any():
        return "inf"
    return "zero" if bool((t == 0).all()) else "finite nonzero"


def nan_equal(a, b):
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all()) if a.shape == b.shape else False


def free(dev):
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def caught_warnings(sink):
    """Collect warnings (SDPA explains a refused backend through them) instead of printing them."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        yield
    sink.extend(str(x.message).replace("\n", " ")[:300] for x in w)


# ---------------------------------------------------------------------------
# the calls under test


def ours_call(causal, dropout_p=0.0, stabilize=None, generator_fn=None):
    """fn(q, k, v, mask) -> O through flash_attention; keyword arguments only where used."""

    def fn(q, k, v, m):
        kw = {}
        if m is not None:
            kw["attn_mask"] = m
        if dropout_p:
            kw["dropout_p"] = dropout_p
            if generator_fn is not None:
                kw["generator"] = generator_fn()
        if stabilize is not None:
            kw["stabilize"] = stabilize
        return flash_attention(q, k, v, causal=causal, **kw)

    return fn


def sdpa_call(backend, causal, dropout_p=0.0):
    """fn(q, k, v, mask) -> O through F.scaled_dot_product_attention; backend None = PyTorch's choice."""

    def fn(q, k, v, m):
        ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
        with ctx:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout_p, is_causal=causal)

    return fn


def fwd_bwd(fn, q, k, v, do, m=None, mask_grad=False):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    mm = m.detach().requires_grad_(True) if mask_grad else m
    o = fn(*leaves, mm)
    grads = torch.autograd.grad(o, leaves + ([mm] if mask_grad else []), do)
    out = dict(o=o.detach(), dq=grads[0], dk=grads[1], dv=grads[2])
    if mask_grad:
        out["dmask"] = grads[3]
    return out


def make_inputs(dev, B, H, N, D, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, device=dev, dtype=BF16, generator=g) for _ in range(4))


def generator(dev, seed):
    return torch.Generator(device=dev).manual_seed(seed)


# ---------------------------------------------------------------------------
# masks


def padding_lengths(B, N, mean_frac=0.2, spread=0.15):
    """Deterministic valid lengths: padded fractions evenly spaced over mean +- spread (mean exactly mean_frac)."""
    fracs = [mean_frac] if B == 1 else [mean_frac - spread + 2 * spread * i / (B - 1) for i in range(B)]
    return [N - int(round(f * N)) for f in fracs]


def padding_mask(lengths, N, dev):
    L = torch.tensor(lengths, device=dev)
    keys = torch.arange(N, device=dev)[None, :] < L[:, None]  # (B, N_kv)
    return keys[:, None, None, :].expand(len(lengths), 1, N, N).contiguous()


def window_mask(B, N, W, dev):
    i = torch.arange(N, device=dev)[:, None]
    j = torch.arange(N, device=dev)[None, :]
    return ((j <= i) & (j > i - W))[None, None].expand(B, 1, N, N).contiguous()


def alibi_bias(H, N, dev):
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device=dev)
    dist = (torch.arange(N, device=dev)[None, :] - torch.arange(N, device=dev)[:, None]).abs().float()
    return (-slopes[:, None, None] * dist)[None].to(BF16)  # (1, H, N, N)


def dead_rows(mask):
    """Rows with no visible key: all False (bool) or all -inf (float); shape mask.shape[:-1]."""
    if mask is None:
        return None
    return ~mask.any(-1) if mask.dtype == torch.bool else torch.isneginf(mask).all(-1)


def repair(mask, do):
    """(mask, dO) with every dead row seeing key 0 and its dO zeroed: the same math elsewhere, finite in SDPA."""
    dead = dead_rows(mask)
    if dead is None or not bool(dead.any()):
        return mask, do, 0
    rep = mask.clone()
    if mask.dtype == torch.bool:
        rep[..., 0] |= dead
    else:
        rep[..., 0] = torch.where(dead, torch.zeros((), dtype=mask.dtype, device=mask.device), rep[..., 0])
    while dead.dim() < 3:
        dead = dead.unsqueeze(0)
    return rep, do.masked_fill(dead.unsqueeze(-1), 0), int(dead.sum())


# ---------------------------------------------------------------------------
# float64 reference, chunked


class Acc:
    def __init__(self):
        self.max, self.nan, self.d2, self.r2 = 0.0, False, 0.0, 0.0

    def add(self, diff, ref):
        if diff.numel() == 0:
            return
        if torch.isnan(diff).any():
            self.nan = True
            diff = torch.nan_to_num(diff, nan=0.0)
        self.max = max(self.max, diff.abs().max().item())
        self.d2 += diff.pow(2).sum().item()
        self.r2 += ref.pow(2).sum().item()

    def result(self):
        if self.nan:
            return {"max_abs": float("nan"), "rel_fro": float("nan")}
        return {"max_abs": self.max, "rel_fro": math.sqrt(self.d2) / max(math.sqrt(self.r2), 1e-300)}


def to4d(mask):
    return None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _ref_chunk(q, k, v, do, b, h0, h1, *, scale, causal, mask4, mask_grad, keep, keep_scale):
    with torch.enable_grad():
        qc, kc, vc = (t[b:b + 1, h0:h1].double().requires_grad_(True) for t in (q, k, v))
        s = (qc @ kc.transpose(-1, -2)) * scale
        N, Nk = s.shape[-2:]
        ml = None
        if mask4 is not None:
            mb = mask4[b:b + 1] if mask4.shape[0] > 1 else mask4[0:1]
            mh = mb[:, h0:h1] if mask4.shape[1] > 1 else mb
            if mh.dtype == torch.bool:
                s = s.masked_fill(~mh, float("-inf"))
            else:
                ml = mh.double()
                if mask_grad:
                    ml.requires_grad_(True)
                s = s + ml
        if causal:
            s = s.masked_fill(~torch.ones(N, Nk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
        dead = torch.isneginf(s).all(-1, keepdim=True)
        s = torch.where(dead, torch.zeros((), dtype=s.dtype, device=s.device), s)
        p = torch.softmax(s, dim=-1)
        p = torch.where(dead, torch.zeros((), dtype=p.dtype, device=p.device), p)
        if keep is not None:
            p = p * keep[b:b + 1, h0:h1] * keep_scale
        o = p @ vc
        o.backward(do[b:b + 1, h0:h1].double())
    dmask = ml.grad if (mask_grad and ml is not None) else None
    return o.detach(), qc.grad, kc.grad, vc.grad, dead.squeeze(-1), dmask


def compare(q, k, v, do, cands, *, scale, causal=False, mask=None, mask_grad=False, keep=None, keep_scale=1.0,
            max_elems=32 * 2**20):
    """Errors of every candidate {name: {o, dq, dk, dv[, dmask]}} against the float64 reference."""
    B, H, N, D = q.shape
    Nk = k.shape[2]
    if k.shape[1] != H:
        raise ValueError("the reference here has no grouped-query attention")
    mask4 = to4d(mask)
    hc = max(1, min(H, max_elems // (N * Nk)))
    accs = {c: {m: Acc() for m in METRICS if m in t} for c, t in cands.items()}
    dead_max = {c: {"o": 0.0, "dq": 0.0} for c in cands}
    dm_ref = torch.zeros(mask4.shape, dtype=torch.float64, device=q.device) if mask_grad else None
    n_dead = 0
    for b in range(B):
        for h0 in range(0, H, hc):
            h1 = min(H, h0 + hc)
            o, dq, dk, dv, dead, dmc = _ref_chunk(q, k, v, do, b, h0, h1, scale=scale, causal=causal, mask4=mask4,
                                                  mask_grad=mask_grad, keep=keep, keep_scale=keep_scale)
            nd = int(dead.sum())
            n_dead += nd
            for c, t in cands.items():
                for m, ref in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
                    if m not in t:
                        continue
                    x = t[m][b:b + 1, h0:h1].double()
                    diff = x - ref
                    if m in ("o", "dq") and nd:
                        dr = dead.unsqueeze(-1).expand_as(x)
                        vals = x[dr]
                        cur = dead_max[c][m]
                        dead_max[c][m] = float("nan") if (math.isnan(cur) or torch.isnan(vals).any()) else max(
                            cur, vals.abs().max().item())
                        diff = diff.masked_fill(dr, 0.0)
                    accs[c][m].add(diff, ref)
            if mask_grad and dmc is not None:
                bi = slice(b, b + 1) if mask4.shape[0] > 1 else slice(0, 1)
                hs = slice(h0, h1) if mask4.shape[1] > 1 else slice(0, 1)
                dm_ref[bi, hs] += dmc
            del o, dq, dk, dv, dmc
    out = {}
    for c, t in cands.items():
        if mask_grad and "dmask" in t:
            x = t["dmask"].reshape(mask4.shape).double()
            accs[c]["dmask"].add(x - dm_ref, dm_ref)
        out[c] = {m: a.result() for m, a in accs[c].items()}
        if n_dead:
            out[c]["dead_rows_max_abs"] = dead_max[c]
    out["_dead_rows"] = n_dead
    return out


def judge(errs, name, base, base_scale=1.0):
    """ours <= 2 x baseline + floor on every metric both have; returns (ok or None, text, details)."""
    if name not in errs:
        return False, "no result", {}
    if base not in errs:
        return None, "no baseline", {}
    details, failed = {}, []
    for m in METRICS:
        if m not in errs[name]:
            continue
        e = errs[name][m]["max_abs"]
        b = errs[base].get(m, {}).get("max_abs")
        if not finite(b):
            details[m] = {"ours": e, "baseline": b, "bound": None, "ok": None}
            continue
        bound = BOUND_FACTOR * b * base_scale + BOUND_FLOOR
        ok = finite(e) and e <= bound
        details[m] = {"ours": e, "baseline": b, "bound": bound, "ok": ok}
        if not ok:
            failed.append(f"{m} {fmt(e, '.1e')}>{fmt(bound, '.1e')}")
    unknown = [m for m, d in details.items() if d["ok"] is None]
    if failed:
        return False, "FAIL " + ", ".join(failed), details
    if unknown:
        return None, "PASS? no baseline for " + ",".join(unknown), details
    return True, "PASS", details


# ---------------------------------------------------------------------------
# the run: timers, rows, JSON


class Run:
    def __init__(self, args, dev, out_dir):
        self.args, self.dev, self.out_dir = args, dev, out_dir
        self.t0 = time.time()
        self.rows = []
        self.results = {}
        self.gpu_warm = False

    def elapsed(self):
        return time.time() - self.t0

    def can_time(self):
        if self.args.no_timing:
            return False, "--no-timing"
        if self.elapsed() > self.args.budget:
            return False, f"time budget ({self.args.budget:.0f} s) spent"
        return True, ""

    def max_elems(self):
        return 32 * 2**20 if self.dev.type == "cuda" else 2 * 2**20

    def time_fn(self, fn):
        if self.dev.type == "cuda":
            return bench(fn, warmup=self.args.warmup, rep=self.args.rep)
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts)[1]

    def warm_gpu(self, seconds):
        if self.dev.type != "cuda":
            return
        with torch.cuda.device(self.dev):
            warm_gpu(seconds)

    def add_row(self, case, variant, direction, ours_ms=None, sdpa_ms=None, correctness="-"):
        ratio = sdpa_ms / ours_ms if (ours_ms and sdpa_ms) else None
        self.rows.append(dict(case=case, variant=variant, dir=direction, ours_ms=ours_ms, sdpa_ms=sdpa_ms,
                              ratio=ratio, correctness=correctness))

    def save(self):
        self.results["rows"] = self.rows
        self.results["elapsed_s"] = self.elapsed()
        path = self.out_dir / "masked_attention.json"
        path.write_text(json.dumps(sanitize(self.results), indent=1))
        return path


def time_variants(run, variants, q, k, v, do):
    """{name: (fn, mask, mask_grad)} -> {name: {fwd: {...}, fwd+bwd: {...}} or {error}}, rounds interleaved."""
    ok, why = run.can_time()
    if not ok:
        return {"skipped": why}
    prepared, out = {}, {}
    for name, (fn, m, mg) in variants.items():
        try:
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            mm = m.detach().requires_grad_(True) if mg else m
            inputs = leaves + ([mm] if mg else [])
            fwd = (lambda fn=fn, m=m: fn(q, k, v, m))
            both = (lambda fn=fn, leaves=leaves, mm=mm, inputs=inputs: torch.autograd.grad(fn(*leaves, mm), inputs, do))
            w = []
            with caught_warnings(w):
                fwd()
                both()
                sync(run.dev)
            prepared[name] = {"fwd": fwd, "fwd+bwd": both}
            out[name] = {"fwd": [], "fwd+bwd": []}
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": short_exc(exc)}
            free(run.dev)
    run.warm_gpu(0.5 if run.gpu_warm else 1.5)
    run.gpu_warm = True
    names = list(prepared)
    for r in range(run.args.rounds):
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        for name in order:
            for d, f in prepared[name].items():
                try:
                    out[name][d].append(run.time_fn(f))
                except Exception as exc:  # noqa: BLE001
                    out[name]["error"] = short_exc(exc)
    summary = {}
    for name, rec in out.items():
        if "fwd" not in rec:
            summary[name] = rec
            continue
        summary[name] = {}
        for d in ("fwd", "fwd+bwd"):
            ts = rec[d]
            if not ts:
                continue
            med = sorted(ts)[len(ts) // 2]
            summary[name][d] = {"median_ms": med, "rounds_ms": ts, "spread": (max(ts) - min(ts)) / med}
        if "error" in rec:
            summary[name]["error"] = rec["error"]
    return summary


def timing_rows(run, case, timing, pairs):
    """pairs: [(variant label, ours name, sdpa name, correctness text)] -> table rows; paired ratios into JSON."""
    ratios = {}
    for label, on, sn, corr in pairs:
        for d in ("fwd", "fwd+bwd"):
            if "skipped" in timing:
                run.add_row(case, label, d, correctness=f"{corr} [not timed: {timing['skipped']}]")
                continue
            o = timing.get(on, {}).get(d)
            s = timing.get(sn, {}).get(d)
            note = corr
            for n in (on, sn):
                if "error" in timing.get(n, {}):
                    note = f"{corr}; {n} timing ERR" if corr != "-" else f"{n} timing ERR"
            run.add_row(case, label, d, o and o["median_ms"], s and s["median_ms"], note)
            if o and s and len(o["rounds_ms"]) == len(s["rounds_ms"]):
                per = sorted(b / a for a, b in zip(o["rounds_ms"], s["rounds_ms"]))
                ratios[f"{label} {d}"] = {"ratio_median_of_rounds": s["median_ms"] / o["median_ms"],
                                          "paired_per_round": per}
    return ratios


def sdpa_probe(run, q, k, v, do, mask, causal, dropout_p, backends, mask_grad=False):
    """Which backend SDPA picks for this call, and which backends run it (fwd+bwd)."""
    info = {"backends": {}}
    try:
        info["choice_no_grad"] = choice_name(torch._fused_sdp_choice(q, k, v, mask, dropout_p, causal))
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        mm = mask.detach().requires_grad_(True) if mask_grad else mask
        info["choice_grad"] = choice_name(torch._fused_sdp_choice(*leaves, mm, dropout_p, causal))
    except Exception as exc:  # noqa: BLE001
        info["choice_error"] = short_exc(exc)
    default_o = None
    works = []
    for b in [None] + list(backends):
        w = []
        try:
            with caught_warnings(w):
                r = fwd_bwd(sdpa_call(b, causal, dropout_p), q, k, v, do, mask, mask_grad)
                sync(run.dev)
            rec = {"works": True}
            if b is None:
                default_o = r["o"]
            else:
                works.append(b)
                if not dropout_p and default_o is not None:
                    rec["fwd_bitwise_equal_to_default"] = bool(torch.equal(r["o"], default_o))
            info["backends"][backend_name(b)] = rec
            del r
        except Exception as exc:  # noqa: BLE001
            info["backends"][backend_name(b)] = {"works": False, "error": short_exc(exc), "warnings": w[:4]}
        free(run.dev)
    matches = [n for n, r in info["backends"].items() if r.get("fwd_bitwise_equal_to_default")]
    if matches:
        info["default_output_matches"] = matches
    return info, works


def default_label(info):
    c = info.get("choice_grad") or info.get("choice_no_grad")
    c0 = info.get("choice_no_grad")
    if c is None:
        return "default"
    label = SHORT.get(c, c)
    if c0 and c0 != c:
        label = f"{SHORT.get(c0, c0)}/{label}"
    return f"default[{label}]"


def is_default_choice(info, b):
    """Whether PyTorch's default picks backend b for this call, with and without grad."""
    return info.get("choice_no_grad") == b.name and info.get("choice_grad") == b.name


def gpu_backends(run, kind):
    if run.dev.type != "cuda":
        return [SDPBackend.MATH]  # CPU: flash-only backends skipped
    if kind == "mask":
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


# ---------------------------------------------------------------------------
# cases


def case_attention(run, case, sh, *, causal, mask, mask_grad=False, kind="mask", primary=None, stab=True,
                   context=None, seed=0):
    """A mask or a head dim, no dropout: SDPA probe, float64 check, timing, rows.

    context: None, or the causal flag of the no-mask comparison (ours vs SDPA without the mask).
    primary: the SDPA backend of the main rows (None = PyTorch's default choice).
    """
    dev = run.dev
    B, H, N, D = sh["B"], sh["H"], sh["N"], sh["D"]
    res = {"shape": dict(sh, causal=causal), "mask": None if mask is None else
           {"shape": list(mask.shape), "dtype": str(mask.dtype), "requires_grad": mask_grad}}
    q, k, v, do = make_inputs(dev, B, H, N, D, seed)
    scale = D ** -0.5
    backends = gpu_backends(run, kind)
    stab_t = torch.ones(H, dtype=torch.bool, device=dev)
    info, works = sdpa_probe(run, q, k, v, do, mask, causal, 0.0, backends, mask_grad)
    res["sdpa"] = info
    if primary is not None and primary not in works:
        res["primary_unavailable"] = primary.name
        primary = None
    plabel = default_label(info) if primary is None else SHORT[primary.name]
    pname = f"sdpa_{backend_name(primary)}"

    # correctness
    cands, errors = {}, {}
    ours = {"ours": ours_call(causal)}
    if stab:
        ours["ours_stab"] = ours_call(causal, stabilize=stab_t)
    for n, fn in ours.items():
        try:
            cands[n] = fwd_bwd(fn, q, k, v, do, mask, mask_grad)
        except Exception as exc:  # noqa: BLE001
            errors[n] = short_exc(exc)
    mrep, dorep, ndead = repair(mask, do)
    res["dead_rows_repaired_for_sdpa"] = ndead
    for b in [None] + works:
        n = f"sdpa_{backend_name(b)}"
        try:
            with caught_warnings([]):
                cands[n] = fwd_bwd(sdpa_call(b, causal), q, k, v, dorep, mrep, mask_grad)
        except Exception as exc:  # noqa: BLE001
            errors[n] = short_exc(exc)
    sync(dev)
    verdicts = {}
    try:
        errs = compare(q, k, v, do, cands, scale=scale, causal=causal, mask=mask, mask_grad=mask_grad,
                       max_elems=run.max_elems())
        res["errors_vs_float64"] = errs
        for n in ours:
            verdicts[n] = judge(errs, n, pname)
            res.setdefault("verdict", {})[n] = {"ok": verdicts[n][0], "text": verdicts[n][1], "detail": verdicts[n][2]}
    except Exception as exc:  # noqa: BLE001
        res["compare_error"] = short_exc(exc)
        res["compare_traceback"] = traceback.format_exc()[-2000:]
    res["call_errors"] = errors
    del cands
    free(dev)

    def corr(n):
        if n in errors:
            return "ERR " + errors[n][:60]
        return verdicts[n][1] if n in verdicts else "ERR compare"

    # timing
    variants = {"ours": (ours_call(causal), mask, mask_grad)}
    if stab:
        variants["ours_stab"] = (ours_call(causal, stabilize=stab_t), mask, mask_grad)
    if context is not None:
        variants["ours_nomask"] = (ours_call(context), None, False)
        variants["sdpa_nomask"] = (sdpa_call(None, context), None, False)
    variants["sdpa_default"] = (sdpa_call(None, causal), mask, mask_grad)
    for b in works:
        variants[f"sdpa_{b.name}"] = (sdpa_call(b, causal), mask, mask_grad)
    timing = time_variants(run, variants, q, k, v, do)
    res["timing_ms"] = timing
    pairs = [("ours vs " + plabel, "ours", pname, corr("ours"))]
    if stab:
        pairs.append(("stabilized vs " + plabel, "ours_stab", pname, corr("ours_stab")))
    if context is not None:
        pairs.append(("no mask, both" + (" causal" if context else ""), "ours_nomask", "sdpa_nomask", "-"))
    for b in works:
        if b != primary and b != SDPBackend.MATH and not is_default_choice(info, b):
            pairs.append((f"ours vs {SHORT[b.name]}", "ours", f"sdpa_{b.name}", "-"))
    res["ratios"] = timing_rows(run, case, timing, pairs)
    return res


def build_keep(seed_t, B, H, N, Nk, p, dev):
    """The keep mask of ``dropout_mask``; in row chunks where one call would not fit in GPU memory.

    ``dropout_mask`` computes Philox in int64 PyTorch ops over the whole (B, H, N, N_kv): about 5 int64
    copies of it at once (some 60 GB at B4 H32 N4096). Where that does not fit, the same numbers come
    from ``reference.dropout_bits`` (what ``dropout_mask`` calls) over blocks of rows, and the top-left
    256 x 256 block is checked against ``dropout_mask`` itself.
    """
    info = {"source": "dropout_mask"}
    if dev.type == "cuda":
        free_b = torch.cuda.mem_get_info(dev)[0]
        need = B * H * N * Nk * 8 * 5
        ref = getattr(iw_kernels, "reference", None)
        bits, thr = getattr(ref, "dropout_bits", None), getattr(ref, "dropout_threshold", None)
        if need > 0.6 * free_b and bits is not None and thr is not None:
            keep = torch.empty(B, H, N, Nk, dtype=torch.bool, device=dev)
            rows_per = max(1, int(0.1 * free_b) // (B * H * Nk * 8 * 5))
            cols = torch.arange(Nk, device=dev)
            for r0 in range(0, N, rows_per):
                rows = torch.arange(r0, min(N, r0 + rows_per), device=dev)
                keep[:, :, r0:r0 + len(rows)] = bits(seed_t, B, H, rows, cols) >= thr(p)
            n = min(256, N, Nk)
            small = iw_kernels.dropout_mask(seed_t, B, H, n, n, p, device=dev)
            info = {"source": f"reference.dropout_bits in blocks of {rows_per} rows (dropout_mask would need "
                              f"~{need / 2**30:.0f} GiB, {free_b / 2**30:.0f} GiB free)",
                    "top_left_matches_dropout_mask": bool(torch.equal(small, keep[:, :, :n, :n]))}
            return keep, info
    return iw_kernels.dropout_mask(seed_t, B, H, N, Nk, p, device=dev), info


def dropout_keep_stats(keep, p, causal, keep2=None):
    """Dropped fraction and independence of a keep mask on the visible region, as z-scores."""
    B, H, N, Nk = keep.shape
    dev = keep.device
    vis = torch.ones(N, Nk, dtype=torch.bool, device=dev)
    if causal:
        vis = vis.tril()
    n_vis = int(vis.sum())
    dropped_bh = ((~keep) & vis).sum(dim=(-1, -2)).double()  # (B, H)
    frac = dropped_bh.sum().item() / (B * H * n_vis)
    se = math.sqrt(p * (1 - p) / (B * H * n_vis))
    per_bh_z = ((dropped_bh / n_vis - p) / math.sqrt(p * (1 - p) / n_vis)).abs().max().item()
    agree_p = p * p + (1 - p) * (1 - p)

    def agreement(a, b, region):
        n = int(region.sum())
        eq = ((a == b) & region).sum().item() / n
        return {"rate": eq, "expected": agree_p, "z": (eq - agree_p) / math.sqrt(agree_p * (1 - agree_p) / n)}

    ind = {}
    if H > 1:
        ind["head0_vs_head1"] = agreement(keep[0, 0], keep[0, 1], vis)
    if B > 1:
        ind["batch0_vs_batch1"] = agreement(keep[0, 0], keep[1, 0], vis)
    ind["row_i_vs_row_i+1"] = agreement(keep[0, 0, 1:], keep[0, 0, :-1], vis[:-1])
    ind["key_j_vs_key_j+1"] = agreement(keep[0, 0, :, 1:], keep[0, 0, :, :-1], vis[:, 1:])
    if keep2 is not None:
        ind["seed_vs_seed+1"] = agreement(keep[0, 0], keep2[0, 0], vis)
    zmax = max([abs((frac - p) / se), per_bh_z] + [abs(r["z"]) for r in ind.values()])
    return {"p_eff": p, "dropped_fraction": frac, "standard_error": se, "z": (frac - p) / se,
            "max_abs_z_per_batch_head": per_bh_z, "independence": ind, "visible_per_head": n_vis,
            "max_abs_z": zmax, "ok": zmax < 5.0}


def case_dropout(run, case, sh, seed=0):
    dev = run.dev
    B, H, N, D = sh["B"], sh["H"], sh["N"], sh["D"]
    p = DROPOUT_P
    pe = p_effective(p)
    causal = True
    res = {"shape": dict(sh, causal=causal, dropout_p=p, p_eff=pe)}
    q, k, v, do = make_inputs(dev, B, H, N, D, seed)
    scale = D ** -0.5
    stab_t = torch.ones(H, dtype=torch.bool, device=dev)
    backends = gpu_backends(run, "dropout")
    info, works = sdpa_probe(run, q, k, v, do, None, causal, p, backends)
    res["sdpa"] = info
    primary = SDPBackend.FLASH_ATTENTION if SDPBackend.FLASH_ATTENTION in works and dev.type == "cuda" else None
    plabel = SHORT[primary.name] if primary is not None else default_label(info)
    pname = f"sdpa_{backend_name(primary)}"

    # correctness against the float64 reference with the keep mask of the same seed
    s0 = 1234 + seed
    cands, errors = {}, {}
    ours = {"ours": ours_call(causal, p, generator_fn=lambda: generator(dev, s0)),
            "ours_stab": ours_call(causal, p, stabilize=stab_t, generator_fn=lambda: generator(dev, s0))}
    for n, fn in ours.items():
        try:
            cands[n] = fwd_bwd(fn, q, k, v, do)
        except Exception as exc:  # noqa: BLE001
            errors[n] = short_exc(exc)
    keep = None
    verdicts = {}
    try:
        seed_t = iw_kernels.dropout_seed(generator(dev, s0), dev)
        free(dev)
        keep, res["keep_mask"] = build_keep(seed_t, B, H, N, N, p, dev)
        res["seed"] = seed_t.tolist()
        keep2 = None
        if keep.numel() <= 300 * 2**20:
            keep2 = iw_kernels.dropout_mask(iw_kernels.dropout_seed(generator(dev, s0 + 1), dev), B, H, N, N, p,
                                            device=dev)
        res["keep_stats"] = dropout_keep_stats(keep, pe, causal, keep2)
        del keep2
        errs = compare(q, k, v, do, cands, scale=scale, causal=causal, keep=keep, keep_scale=1.0 / (1.0 - pe),
                       max_elems=run.max_elems())
        del keep
        keep = None
        free(dev)
        # the bf16 yardstick: SDPA-primary without dropout against the no-dropout float64 reference
        base = {}
        try:
            with caught_warnings([]):
                base[pname] = fwd_bwd(sdpa_call(primary, causal), q, k, v, do)
        except Exception as exc:  # noqa: BLE001
            errors[pname + " (no dropout)"] = short_exc(exc)
        base_errs = compare(q, k, v, do, base, scale=scale, causal=causal, max_elems=run.max_elems())
        del base
        errs[pname + "_no_dropout"] = base_errs.get(pname, {})
        res["errors_vs_float64"] = errs
        for n in ours:
            verdicts[n] = judge(errs, n, pname + "_no_dropout", base_scale=1.0 / (1.0 - pe))
            res.setdefault("verdict", {})[n] = {"ok": verdicts[n][0], "text": verdicts[n][1], "detail": verdicts[n][2]}
    except Exception as exc:  # noqa: BLE001
        res["compare_error"] = short_exc(exc)
        res["compare_traceback"] = traceback.format_exc()[-2000:]
    del keep
    free(dev)

    # determinism and the generator
    det = {}
    try:
        fn = ours["ours"]
        if "ours" in cands:
            again = fwd_bwd(fn, q, k, v, do)
            # dQ of a dropout call comes from the fused backward (atomics, FA2's way): equal up to
            # float32 summation order; bitwise under torch.use_deterministic_algorithms
            det["same_seed_bitwise"] = {m: bool(torch.equal(cands["ours"][m], again[m])) for m in ("o", "dk", "dv")}
            ref_dq = cands["ours"]["dq"]
            det["same_seed_dq_close"] = bool((again["dq"] - ref_dq).abs().max() <= 2 ** -7 * ref_dq.abs().max())
            del again
            torch.use_deterministic_algorithms(True, warn_only=True)
            try:
                a, b = fwd_bwd(fn, q, k, v, do), fwd_bwd(fn, q, k, v, do)
            finally:
                torch.use_deterministic_algorithms(False)
            det["deterministic_mode_bitwise"] = all(bool(torch.equal(a[m], b[m])) for m in ("o", "dq", "dk", "dv"))
            del a, b
            plain = ours_call(causal)
            a, b = fwd_bwd(plain, q, k, v, do), fwd_bwd(plain, q, k, v, do)
            det["control_no_dropout_bitwise"] = {m: bool(torch.equal(a[m], b[m])) for m in ("o", "dq", "dk", "dv")}
            del a, b
        g = generator(dev, s0)
        used_twice = ours_call(causal, p, generator_fn=lambda: g)
        o1, o2 = used_twice(q, k, v, None), used_twice(q, k, v, None)
        det["generator_advances"] = not bool(torch.equal(o1, o2))
        other = ours_call(causal, p, generator_fn=lambda: generator(dev, s0 + 1))(q, k, v, None)
        det["other_seed_differs"] = not bool(torch.equal(cands["ours"]["o"], other)) if "ours" in cands else None
        dflt = ours_call(causal, p)
        torch.manual_seed(99)
        a = dflt(q, k, v, None)
        torch.manual_seed(99)
        b = dflt(q, k, v, None)
        det["default_generator_follows_manual_seed"] = bool(torch.equal(a, b))
        del o1, o2, other, a, b
        det["ok"] = (all(det.get("same_seed_bitwise", {"x": False}).values()) and det.get("same_seed_dq_close")
                     and det.get("deterministic_mode_bitwise") and det["generator_advances"]
                     and det["other_seed_differs"] is not False and det["default_generator_follows_manual_seed"])
    except Exception as exc:  # noqa: BLE001
        det["error"] = short_exc(exc)
        det["ok"] = False
    res["determinism"] = det
    res["call_errors"] = errors
    del cands
    free(dev)

    def corr(n):
        if n in errors:
            return "ERR " + errors[n][:60]
        if n not in verdicts:
            return "ERR " + res.get("compare_error", "compare")[:60]
        text = verdicts[n][1]
        ks = res.get("keep_stats", {})
        if n == "ours":
            if not ks.get("ok", False):
                text += f"; keep-stats FAIL (max|z| {ks.get('max_abs_z', float('nan')):.1f})"
            if not det.get("ok"):
                bad = [k for k, val in det.items() if val is False and k != "ok"]
                bad += [f"same-seed {m}" for m, val in det.get("same_seed_bitwise", {}).items() if not val]
                ctrl = [m for m, val in det.get("control_no_dropout_bitwise", {}).items() if not val]
                text += "; determinism FAIL " + ",".join(bad) + (f" (no-dropout also differs: {','.join(ctrl)})"
                                                                   if ctrl else "")
                if "error" in det:
                    text += " " + det["error"][:60]
        return text

    variants = {
        "ours": (ours_call(causal, p), None, False),
        "ours_stab": (ours_call(causal, p, stabilize=stab_t), None, False),
        "ours_nodrop": (ours_call(causal), None, False),
        "sdpa_nodrop": (sdpa_call(None, causal), None, False),
        "sdpa_default": (sdpa_call(None, causal, p), None, False),
    }
    for b in works:
        variants[f"sdpa_{b.name}"] = (sdpa_call(b, causal, p), None, False)
    timing = time_variants(run, variants, q, k, v, do)
    res["timing_ms"] = timing
    pairs = [(f"p={p} vs {plabel}", "ours", pname, corr("ours")),
             (f"p={p} stabilized vs {plabel}", "ours_stab", pname, corr("ours_stab")),
             ("no dropout, both", "ours_nodrop", "sdpa_nodrop", "-")]
    for b in works:
        if b != primary and not (primary is None and is_default_choice(info, b)):
            pairs.append((f"p={p} vs {SHORT[b.name]}", "ours", f"sdpa_{b.name}", "-"))
    res["ratios"] = timing_rows(run, case, timing, pairs)
    return res


def case_dropout_mean(run, case, sh, seed=5):
    """E[O] over dropout masks is the no-dropout output: the error of the n-seed mean shrinks like 1/sqrt(n)."""
    dev = run.dev
    B, H, N, D, n_seeds = sh["B"], sh["H"], sh["N"], sh["D"], sh["seeds"]
    p = DROPOUT_P
    q, k, v, _ = make_inputs(dev, B, H, N, D, seed)
    scale = D ** -0.5
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=dev).tril(), float("-inf"))
    ref = torch.softmax(s, -1) @ v.double()
    fn = ours_call(True, p, generator_fn=None)
    total = torch.zeros_like(ref)
    total2 = torch.zeros_like(ref)
    checkpoints = [n for n in (2, 8, 32, n_seeds) if n <= n_seeds]
    measured = {}
    for i in range(n_seeds):
        o = flash_attention(q, k, v, causal=True, dropout_p=p, generator=generator(dev, 5000 + i)).double()
        total += o
        total2 += o * o
        n = i + 1
        if n in checkpoints:
            measured[n] = (total / n - ref).pow(2).mean().sqrt().item()
    var = ((total2 - total * total / n_seeds) / (n_seeds - 1)).clamp_min(0).mean().item()
    rows = {}
    ok = True
    for n, rms in measured.items():
        pred = math.sqrt(var / n)
        ratio = rms / pred if pred > 0 else float("nan")
        rows[str(n)] = {"rms_error": rms, "predicted_sigma_over_sqrt_n": pred, "ratio": ratio}
        ok = ok and finite(ratio) and 0.7 <= ratio <= 1.4
    shrink = measured[checkpoints[0]] / measured[checkpoints[-1]]
    ideal = math.sqrt(checkpoints[-1] / checkpoints[0])
    ok = ok and 0.6 * ideal <= shrink <= 1.6 * ideal
    del fn
    res = {"shape": dict(sh, causal=True, dropout_p=p), "per_n": rows, "shrink_first_to_last": shrink,
           "ideal_shrink": ideal, "mean_per_element_variance": var, "ok": ok,
           "criterion": "rms(mean_n - O_nodrop_float64) / sqrt(var/n) in [0.7, 1.4] for each n, and the "
                        "shrink from the first to the last n within 0.6x..1.6x of sqrt(ratio of n)"}
    text = ("PASS" if ok else "FAIL") + f" rms x{shrink:.2f} from n={checkpoints[0]} to {checkpoints[-1]} " \
                                        f"(ideal {ideal:.1f})"
    run.add_row(case, f"mean of O over {n_seeds} seeds", "check", correctness=text)
    return res


def case_fully_masked(run, case, sh, seed=3):
    dev = run.dev
    B, H, N, D = sh["B"], sh["H"], sh["N"], sh["D"]
    q, k, v, do = make_inputs(dev, B, H, N, D, seed)
    scale = D ** -0.5
    i = torch.arange(N, device=dev)[:, None]
    j = torch.arange(N, device=dev)[None, :]
    rows0 = max(1, N // 9)  # batch 0: rows [0, rows0) see nothing, later rows all but the last keys
    m0 = (i >= rows0) & (j < N - N // 16)
    L = int(0.7 * N)  # batch 1: query-and-key padding mask, padded queries see nothing
    m1 = (i < L) & (j < L)
    bool_mask = torch.stack([m0, m1] + [m1] * (B - 2))[:, None]  # (B, 1, N, N)
    pattern_dead = ~bool_mask.any(-1)  # (B, 1, N)
    neg_inf = torch.zeros(bool_mask.shape, dtype=BF16, device=dev).masked_fill(~bool_mask, float("-inf"))
    fmin = torch.zeros(bool_mask.shape, dtype=BF16, device=dev).masked_fill(~bool_mask, torch.finfo(BF16).min)
    kinds = {"bool": bool_mask, "additive -inf": neg_inf, "additive finfo.min": fmin}
    backends = [None] + ([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
                         if dev.type == "cuda" else [SDPBackend.MATH])
    res = {"shape": sh, "fully_masked_rows": int(pattern_dead.sum()), "kinds": {}}
    dead_sel = pattern_dead.expand(B, H, N)

    def describe(r):
        d = {"o_rows": classify(r["o"][dead_sel]), "dq_rows": classify(r["dq"][dead_sel]),
             "dk_finite": bool(torch.isfinite(r["dk"]).all()), "dv_finite": bool(torch.isfinite(r["dv"]).all())}
        return d

    for kname, mask in kinds.items():
        rec = {"sdpa": {}}
        outs = {}
        for b in backends:
            try:
                with caught_warnings([]):
                    r = fwd_bwd(sdpa_call(b, False), q, k, v, do, mask)
                rec["sdpa"][backend_name(b)] = describe(r)
                if b is None:
                    outs["sdpa_default_raw"] = r
            except Exception as exc:  # noqa: BLE001
                rec["sdpa"][backend_name(b)] = {"error": short_exc(exc)}
        try:
            rec["sdpa_choice"] = choice_name(torch._fused_sdp_choice(q, k, v, mask, 0.0, False))
        except Exception as exc:  # noqa: BLE001
            rec["sdpa_choice"] = short_exc(exc)
        cands = {}
        try:
            cands["ours"] = fwd_bwd(ours_call(False), q, k, v, do, mask)
            cands["ours_stab"] = fwd_bwd(ours_call(False, stabilize=torch.ones(H, dtype=torch.bool, device=dev)),
                                         q, k, v, do, mask)
            rec["ours"] = describe(cands["ours"])
        except Exception as exc:  # noqa: BLE001
            rec["ours"] = {"error": short_exc(exc)}
        if "ours" in cands and "sdpa_default_raw" in outs:
            sd = outs["sdpa_default_raw"]
            rec["ours_equals_sdpa_default_on_masked_rows"] = {
                m: nan_equal(cands["ours"][m][dead_sel], sd[m][dead_sel]) for m in ("o", "dq")}
        mrep, dorep, ndead = repair(mask, do)
        rec["dead_rows_repaired_for_sdpa"] = ndead
        try:
            with caught_warnings([]):
                cands["sdpa_default"] = fwd_bwd(sdpa_call(None, False), q, k, v, dorep, mrep)
        except Exception as exc:  # noqa: BLE001
            rec["baseline_error"] = short_exc(exc)
        ok, text = False, "ERR"
        try:
            errs = compare(q, k, v, do, cands, scale=scale, mask=mask, max_elems=run.max_elems())
            rec["errors_vs_float64"] = errs
            ok, text, detail = judge(errs, "ours", "sdpa_default")
            rec["verdict"] = {"ok": ok, "text": text, "detail": detail}
            stab_ok, stab_text, _ = judge(errs, "ours_stab", "sdpa_default")
            rec["verdict_stabilized"] = {"ok": stab_ok, "text": stab_text}
        except Exception as exc:  # noqa: BLE001
            rec["compare_error"] = short_exc(exc)
            text = "ERR " + short_exc(exc, 60)
        # the contract: a fully masked row (all False / all -inf) gives O = 0 and dq = 0; dk, dv finite
        if "ours" in cands and kname != "additive finfo.min":
            c = rec["ours"]
            contract = c["o_rows"] == "zero" and c["dq_rows"] == "zero" and c["dk_finite"] and c["dv_finite"]
            rec["contract_zero_rows_ok"] = contract
            if not contract:
                ok, text = False, text + f"; rows o={c['o_rows']} dq={c['dq_rows']} (contract: zero)"
        sd = rec["sdpa"].get("default", {})
        if kname == "additive finfo.min" and "ours" in cands and "sdpa_default_raw" in outs:
            diff = (cands["ours"]["o"][dead_sel].double() - outs["sdpa_default_raw"]["o"][dead_sel].double()).abs()
            rec["masked_rows_ours_minus_sdpa_max_abs"] = diff.max().item() if diff.numel() else 0.0
            text = ("masked rows (uniform over keys): ours-sdpa max|diff| "
                    + fmt(rec["masked_rows_ours_minus_sdpa_max_abs"]) + " | " + text)
        elif "o_rows" in sd and "ours" in cands:
            eq = rec.get("ours_equals_sdpa_default_on_masked_rows", {})
            same = all(eq.values()) if eq else False
            text = f"masked rows: ours {rec['ours']['o_rows']}, sdpa[{SHORT.get(rec['sdpa_choice'], '?')}] " \
                   f"{sd['o_rows']}{'' if sd.get('dk_finite', True) else ' (dk NaN)'} " \
                   f"-> {'same' if same else 'DIFFER'} | " + text
        rec["ok"] = ok
        res["kinds"][kname] = rec
        run.add_row(case, kname, "check", correctness=text)
        del cands, outs
        free(dev)
    return res


# ---------------------------------------------------------------------------


def run_case(run, name, sh):
    dev = run.dev
    if name == "fully_masked":
        return case_fully_masked(run, name, sh)
    if name == "pad20":
        lengths = padding_lengths(sh["B"], sh["N"])
        mask = padding_mask(lengths, sh["N"], dev)
        res = case_attention(run, name, sh, causal=False, mask=mask, context=False, seed=10)
        res["lengths"] = lengths
        res["mean_padded_fraction"] = 1 - sum(lengths) / (len(lengths) * sh["N"])
        return res
    if name == "window":
        mask = window_mask(sh["B"], sh["N"], sh["W"], dev)
        return case_attention(run, name, sh, causal=False, mask=mask, context=True, seed=11)
    if name in ("drop_gpt2", "drop_llama"):
        return case_dropout(run, name, sh, seed=12 if name == "drop_gpt2" else 13)
    if name == "dropout_mean":
        return case_dropout_mean(run, name, sh)
    if name in ("d256_causal", "d256"):
        return case_attention(run, name, sh, causal=name == "d256_causal", mask=None, kind="d256", stab=True,
                              context=None, seed=14)
    if name == "bias_grad":
        mask = alibi_bias(sh["H"], sh["N"], dev)
        return case_attention(run, name, sh, causal=False, mask=mask, mask_grad=True, context=False, seed=15)
    raise ValueError(name)


def header(args, argv, dev):
    h = common_header(argv, dev)
    h.update({
        "script": "benchmarks/masked_attention.py",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cuda": torch.version.cuda,
        "device_type": dev.type,
        "quick": args.quick,
        "timing": ("triton.testing.do_bench median (L2 flushed per call), warmup %g ms, rep %g ms, %d interleaved "
                   "rounds, median of rounds" % (args.warmup, args.rep, args.rounds)) if dev.type == "cuda"
        else "time.perf_counter median of 3 calls (CPU smoke test)",
        "bound": f"ours max-abs error <= {BOUND_FACTOR} x SDPA-primary's + {BOUND_FLOOR}",
    })
    try:
        h["ours_backend"] = iw_kernels.resolve_backend(torch.empty(1, 1, 1, 64, dtype=BF16, device=dev), "auto")
    except Exception as exc:  # noqa: BLE001
        h["ours_backend"] = short_exc(exc)
    try:
        h["git_head"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                       cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    except Exception:  # noqa: BLE001
        h["git_head"] = None
    if dev.type == "cuda":
        prop = torch.cuda.get_device_properties(dev)
        h["multiprocessors"] = prop.multi_processor_count
        h["l2_bytes"] = getattr(prop, "L2_cache_size", None)
        h["cudnn"] = torch.backends.cudnn.version()
        h["nvidia_smi_start"] = nvidia_smi()
    else:
        h["device"] = platform.processor() or platform.machine()
    return h


def nvidia_smi():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,"
                            "temperature.gpu,power.draw,memory.used", "--format=csv"],
                           capture_output=True, text=True, timeout=15)
        return r.stdout.strip() or r.stderr.strip()
    except Exception as exc:  # noqa: BLE001
        return short_exc(exc)


def format_table(run):
    h = run.results.get("header", {})
    lines = [f"{h.get('device')} | torch {h.get('torch')} | triton {h.get('triton')} | ours: {h.get('ours_backend')}"
             f" | ratio = SDPA ms / ours ms (>1: ours faster) | {run.args.rounds} rounds"]
    w = max([len(f"{r['case']} {r['variant']}") for r in run.rows] + [14])
    lines.append(f"{'case':<{w}}  {'dir':<7}{'ours ms':>9}{'SDPA ms':>9}{'ratio':>7}  correctness")
    for r in run.rows:
        label = f"{r['case']} {r['variant']}"
        o = fmt(r["ours_ms"], ".3f")
        s = fmt(r["sdpa_ms"], ".3f")
        ratio = fmt(r["ratio"], ".2f")
        corr = r["correctness"] if len(r["correctness"]) <= 130 else r["correctness"][:127] + "..."
        lines.append(f"{label:<{w}}  {r['dir']:<7}{o:>9}{s:>9}{ratio:>7}  {corr}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (N <= 512): a smoke test")
    ap.add_argument("--out", default=os.environ.get("OUT") or "./masked_attention_out",
                    help="directory for masked_attention.json and table.txt "
                         "(default: $OUT, else ./masked_attention_out)")
    ap.add_argument("--cases", default=",".join(FULL), help="comma-separated, from: " + ",".join(FULL))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median shown)")
    ap.add_argument("--warmup", type=float, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=float, default=80, help="do_bench measuring time, ms")
    ap.add_argument("--budget", type=float, default=300,
                    help="seconds after which no new case is timed (and 45 s later none is started)")
    ap.add_argument("--no-timing", action="store_true", help="correctness only")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device (use --device cpu --quick for a smoke test)")
    if dev.type == "cuda" and triton is None:
        ap.error("timing on CUDA needs triton")
    names = [c for c in args.cases.split(",") if c]
    for n in names:
        if n not in FULL:
            ap.error(f"--cases: unknown case {n!r}; known: {', '.join(FULL)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = QUICK if args.quick else FULL
    run = Run(args, dev, out_dir)
    run.results["header"] = header(args, argv, dev)
    run.results["cases"] = {}
    print(json.dumps({k: run.results["header"][k] for k in ("device", "torch", "triton", "date")}), file=sys.stderr)
    for name in names:
        t = time.time()
        if run.elapsed() > args.budget + 45:
            run.results["cases"][name] = {"skipped": f"past the time budget ({args.budget:.0f} s + 45 s)"}
            run.add_row(name, "", "-", correctness="SKIPPED: time budget")
            continue
        print(f"[{run.elapsed():6.1f}s] {name} {shapes[name]}", file=sys.stderr, flush=True)
        try:
            res = run_case(run, name, shapes[name])
        except Exception as exc:  # noqa: BLE001
            res = {"error": short_exc(exc), "traceback": traceback.format_exc()[-3000:]}
            run.add_row(name, "", "-", correctness="ERR " + short_exc(exc, 100))
            print(res["traceback"], file=sys.stderr)
        res["seconds"] = time.time() - t
        run.results["cases"][name] = res
        free(dev)
        run.save()
    if dev.type == "cuda":
        run.results["header"]["nvidia_smi_end"] = nvidia_smi()
    path = run.save()
    table = format_table(run)
    (out_dir / "table.txt").write_text(table + "\n")
    print(f"details: {path} ({run.elapsed():.0f} s)")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
