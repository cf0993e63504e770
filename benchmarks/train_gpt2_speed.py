"""Steps/s of examples/train_gpt2.py with and without the watch (and over 2 GPUs), one table.

    python benchmarks/train_gpt2_speed.py --steps 150                       # 1 GPU: watch vs none
    python benchmarks/train_gpt2_speed.py --steps 150 --compile --repeat 2  # also compiled; two pairs each
    python benchmarks/train_gpt2_speed.py --steps 150 --ddp                 # also 2-GPU DDP with the watch

Each variant runs the example in its own process (a fresh CUDA context, the
same seed and data), reads its summary_rank*.json, and the table gives
steps/s, tokens/s and the ratio to the unwatched run of the same pair (with
``--repeat``, the variants run as consecutive pairs: no watch, watch, no watch,
watch, ...). Under DDP it also checks that both ranks took the same decisions
(alerts and switched heads).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

from _common import write_json

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "train_gpt2.py")


def run(name, extra, steps, out_root, common):
    out = os.path.join(out_root, name)
    cmd = [sys.executable, EXAMPLE, "--preset", "gpt2-small", "--steps", str(steps), "--out", out,
           "--no-checkpoint", "--no-live-table", *common, *extra]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-5000:], sep="\n")
        return {"name": name, "error": proc.returncode}
    ranks = {}
    for path in sorted(glob.glob(os.path.join(out, "gpt2-small", "version_*", "summary_rank*.json"))):
        ranks[path.rsplit("rank", 1)[1].split(".")[0]] = json.load(open(path))
    s = ranks.get("0", {})
    return {"name": name, "summary": s, "ranks": ranks, "tail": proc.stdout[-1500:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--ddp", action="store_true", help="also run 2-GPU DDP with the watch")
    ap.add_argument("--lr", type=float, help="peak learning rate passed to the example")
    ap.add_argument("--compile", action="store_true", help="also the torch.compile variants")
    ap.add_argument("--only", help="comma-separated variant names to run")
    ap.add_argument("--repeat", type=int, default=1, help="run the variant list this many times (paired runs)")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    common = ["--lr", str(args.lr)] if args.lr else []
    root = tempfile.mkdtemp(prefix="gpt2_speed_")
    variants = [("1gpu_nowatch", ["--no-watch"]), ("1gpu_watch", []), ("1gpu_watch_nocsv", ["--no-csv"])]
    if args.compile:
        variants += [("1gpu_nowatch_compile", ["--no-watch", "--compile"]), ("1gpu_watch_compile", ["--compile"]),
                     ("1gpu_watch_nocsv_compile", ["--no-csv", "--compile"])]
    if args.ddp:
        variants.append(("2gpu_ddp_watch", ["--devices", "2", "--strategy", "ddp"]))
    if args.only:
        keep = set(args.only.split(","))
        variants = [v for v in variants if v[0] in keep]
    results = []
    for rep_i in range(args.repeat):
        for n, e in variants:
            r = run(f"{n}#{rep_i}" if args.repeat > 1 else n, e, args.steps, root, common)
            r["variant"], r["pair"] = n, rep_i
            results.append(r)

    def peer(r, name):
        return next((x["summary"]["speed"]["steps_per_s"] for x in results
                     if x["variant"] == name and x["pair"] == r["pair"] and "summary" in x
                     and x["summary"].get("speed")), None)

    print(f"\n{'variant':<20} {'steps/s':>8} {'tokens/s':>10} {'vs unwatched peer':>19}  alerts  switched  ranks agree")
    for r in results:
        if "error" in r:
            print(f"{r['name']:<20} failed (exit {r['error']})")
            continue
        s = r["summary"]
        sp = s["speed"]["steps_per_s"]
        devices = s["devices"]
        tok = sp * 16 * 1024 * devices
        agree = "-"
        if len(r["ranks"]) > 1:
            decisions = {k: (v.get("alerts"), v.get("switched")) for k, v in r["ranks"].items()}
            agree = "yes" if len(set(json.dumps(d) for d in decisions.values())) == 1 else "NO"
        ref = peer(r, "1gpu_nowatch_compile" if "compile" in r["variant"] else "1gpu_nowatch")
        print(f"{r['name']:<20} {sp:8.2f} {tok:10.0f} {sp * devices / ref if ref else float('nan'):19.3f}"
              f"  {len(s.get('alerts', [])):6d}  {len(s.get('switched', [])):8d}  {agree}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
