"""The stabilized shift's tie threshold ``eps`` against BF16's rounding window near 1.

    python benchmarks/tie_window.py [--device cpu|cuda] [--draws 4] [--seq 256] [--gaps 1e-3,2e-3,4e-3]
                                    [--eps 1e-3,2e-3,4e-3] [--json out.json]

A score within ``2^-9`` (in the scaled scores' natural units) of its row's maximum has ``P̄ = exp(S - max) >=
1 - 2^-9``, which BF16 rounds to exactly 1: near-maxima closer than that round up together, the paper's bias. The
stabilized kernel shifts a row only where the maximum repeats, i.e. where two scores lie within ``eps`` (the
paper's 1e-3). Inputs: ``mechanism.near_tie_inputs`` with 4 near-maxima per row whose gaps to the maximum are
uniform in ``[0, gap]``. For each gap, the standard kernel and the stabilized one at each ``eps``: the mean signed
error of O against float64 in the negative-V dims, and the shadow drift ``Σ(δ_lp − δ_hp)`` per draw (positive: the
bias that makes σ(W_Q) grow). On the CPU the kernels are the reference (FA2's precision model in PyTorch); on CUDA
the Triton kernels.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from instability_watch.mechanism import measure_bias, near_tie_inputs

from _common import device_name, write_json


def _floats(text: str, name: str):
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"tie_window.py: {name} takes comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"tie_window.py: {name} takes positive numbers, got {text!r}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--gaps", default="1e-3,2e-3,4e-3")
    ap.add_argument("--eps", default="1e-3,2e-3,4e-3")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    gaps, epss = _floats(args.gaps, "--gaps"), _floats(args.eps, "--eps")
    kernels = [("standard", dict(stabilize=False))] + [(f"stabilized, eps {e:g}", dict(stabilize=True, eps=e))
                                                       for e in epss]
    print(f"device: {device_name(args.device)}  torch {torch.__version__}  draws {args.draws}  seq {args.seq}")
    print(f"{'gaps up to':>10}  {'kernel':<24}{'O bias (1e-5)':>14}{'Σ(δ_lp − δ_hp)':>16}{'draws > 0':>11}")
    table = []
    for gap in gaps:
        for name, kw in kernels:
            runs = []
            for d in range(args.draws):
                inp = near_tie_inputs(batch=2, heads=4, seq=args.seq, n_ties=4, tie_gap=gap, device=args.device,
                                      generator=torch.Generator().manual_seed(d))
                runs.append(measure_bias(inp, **kw))
            row = {"gap": gap, "kernel": name, "o_bias": statistics.mean(r["o_bias"] for r in runs),
                   "delta_err_sum": statistics.mean(r["delta_err_sum"] for r in runs),
                   "draws_positive": sum(r["delta_err_sum"] > 0 for r in runs), "draws": args.draws}
            table.append(row)
            print(f"{gap:>10g}  {name:<24}{row['o_bias'] * 1e5:>+14.2f}{row['delta_err_sum']:>+16.3f}"
                  f"{row['draws_positive']:>8}/{args.draws}")
    if args.json:
        write_json(args.json, {"device": device_name(args.device), "torch": torch.__version__, "seq": args.seq,
                               "rows": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
