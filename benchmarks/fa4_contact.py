"""What of flash-attn 4 (``flash_attn.cute``) runs on this GPU: forward and backward per feature, against float64.

    python benchmarks/fa4_contact.py [--json out.json]      (after benchmarks/fa4_contact.sh has installed FA4)

For each case (head dim 64 and 128; causal or not; a sliding window; soft-capping; GQA; packed documents through
``flash_attn_varlen_func``), BF16 inputs ``(batch, seq, heads, dim)`` as FA4 takes them: FA4's forward and
backward, and the same in float64 (and SDPA's BF16, PyTorch's own error, where SDPA can express the case). A case
either runs (the largest errors of O, dQ, dK, dV against float64, and FA4's over SDPA's) or fails (the error, in
one line). Prints a table; ``--json`` keeps every number. This is what the watch's FA4 entry point is planned on.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import traceback

import torch
import torch.nn.functional as F


def reference(q, k, v, do, causal, window, softcap, docs):
    """float64 attention and its gradients; ``(B, N, H, D)`` layout; bottom-right causal alignment (N_q = N_k)."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    b, n, h, d = q.shape
    hk = k.shape[2]
    kk, vv = (t.repeat_interleave(h // hk, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            allowed &= j >= i - left
        if right is not None and right >= 0:
            allowed &= j <= i + right
    if docs is not None:
        doc = torch.zeros(n, dtype=torch.long)
        for start in docs[1:-1]:
            doc[start:] += 1
        allowed &= doc[:, None] == doc[None, :]
    s = s.masked_fill(~allowed.to(s.device), float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)
    o.backward(do.double())
    return o.detach(), q.grad, k.grad, v.grad


def case(fa4, name, d, causal=False, window=None, softcap=0.0, gqa=1, varlen=False, b=2, n=512, h=8):
    torch.manual_seed(0)
    dev = "cuda"
    bb = 1 if varlen else b
    q = torch.randn(bb, n, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(bb, n, h // gqa, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(bb, n, h // gqa, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(bb, n, h, d, device=dev, dtype=torch.bfloat16)
    docs = [0, 100, 250, 400, n] if varlen else None
    row = {"case": name, "d": d}
    try:
        kw = dict(causal=causal, softcap=softcap)
        if window is not None:
            kw["window_size"] = window
        if varlen:
            cu = torch.tensor(docs, device=dev, dtype=torch.int32)
            out = fa4.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
        else:
            out = fa4.flash_attn_func(q, k, v, **kw)
        o = out[0] if isinstance(out, tuple) else out
        row["returns"] = type(out).__name__ + (f"[{len(out)}]" if isinstance(out, tuple) else "")
        o = o.reshape(bb, n, h, d)
        o.backward(do)
        got = [o.detach(), q.grad, k.grad, v.grad]
        ref = reference(q, k, v, do, causal, window, softcap, docs)
        row["err"] = [(g.double() - r).abs().max().item() for g, r in zip(got, ref)]
        # PyTorch's own BF16 error, where SDPA says the same thing (no window, no softcap, no documents)
        if window is None and not softcap and not varlen:
            qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
            os_ = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa > 1)
            os_.backward(do.transpose(1, 2))
            sd = [os_.detach().transpose(1, 2), qs.grad.transpose(1, 2), ks.grad.transpose(1, 2),
                  vs.grad.transpose(1, 2)]
            row["sdpa_err"] = [(g.double() - r).abs().max().item() for g, r in zip(sd, ref)]
        row["ok"] = True
    except Exception as exc:  # noqa: BLE001 - a feature this GPU or this FA4 does not run: recorded
        row["ok"] = False
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        row["trace"] = traceback.format_exc()[-1500:]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--dims", default="64,128", help="head dims, in this order (e.g. 128,64)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fa4_contact.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import flash_attn.cute as fa4

    info = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
            "torch": torch.__version__, "fa4": getattr(__import__("flash_attn"), "__version__", "?")}
    print(json.dumps(info), flush=True)
    print(f"{'case':<30} {'D':>4} {'ok':>3}  {'err O, dQ, dK, dV (FA4)':<36} {'FA4 / SDPA (max over the four)':>30}")
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        for name, kw in (("dense", {}), ("causal", dict(causal=True)), ("causal GQA 4:1", dict(causal=True, gqa=4)),
                         ("sliding window (128, 0)", dict(causal=True, window=(128, 0))),
                         ("softcap 30", dict(causal=True, softcap=30.0)),
                         ("varlen 4 documents, causal", dict(causal=True, varlen=True))):
            r = case(fa4, name, d, **kw)
            rows.append(r)
            if not r["ok"]:
                print(f"{r['case']:<30} {r['d']:>4} {'no':>3}  {r['error']}", flush=True)
            else:
                err = ", ".join(f"{e:.1e}" for e in r["err"])
                ratio = max(a / b for a, b in zip(r["err"], r["sdpa_err"])) if "sdpa_err" in r else None
                print(f"{r['case']:<30} {r['d']:>4} {'yes':>3}  {err:<36} {('%.2f' % ratio) if ratio else '-':>30}",
                      flush=True)
            if args.json:  # after every case: a run cut short keeps the cases done
                with open(args.json, "w") as f:
                    json.dump({**info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
