"""The report's peak memory and wall time on a long run (issue 21, item 2).

Writes a synthetic run directory the size of a GPT-2-small run at the paper's
length (200,000 steps x 144 heads: about 3.5 GB of metrics.csv, in the exact
format of :class:`~instability_watch.outputs.rundir.RunWriter`), then runs
``instability-watch report`` on it end to end (summary and plots) in a child
process and measures its wall time and peak RSS (``ru_maxrss`` of the child).

The bar: peak RSS <= 1.5 GB and wall time <= 60 s on a 2-core machine.

Generating 3.5 GB row by row in Python would take minutes: the script formats a
few thousand steps' worth of rows (every layer and head, ``%.9g`` like the
writer), as templates of one step each, and writes the run by filling each
template with the step and its loss (``bytes.replace``). The values follow a
training run: the loss falls, sigma(W_Q) and the logits of a few heads grow,
``delta_cum`` drifts one way in a few heads and wanders in the others;
sigma(W_Q) is observed every ``--spectral-every`` steps and the delta statistics
every ``--shadow-every`` steps (``nan`` in between), as the watch writes them.

With ``--damage`` it measures a damaged file too (issue 44): a run of half the
steps with a bad line after every good one (a short row, a metric that is not a
number, bytes that are not UTF-8, garbage, in turn), as long as the clean run's
``metrics.csv``, against that clean run: the reader must not slow down with the
number of bad lines.

Usage::

    python benchmarks/report_memory.py                      # 200k x 144, then deletes the run
    python benchmarks/report_memory.py --steps 2000 --keep  # a small one, kept
    python benchmarks/report_memory.py --steps 6945 --damage --no-plots   # 1M lines, clean and half bad
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from instability_watch.engine.metrics import METRICS
from instability_watch.outputs.rundir import EVENT_COLUMNS, METRIC_COLUMNS

from _common import write_json

ROOT = Path(__file__).resolve().parents[1]

PROGRESS_POINTS = 400  # distinct stages of training the templates follow (the plots have <= 1000 points)


def _templates(layers: int, per_layer: int, points: int, rng: np.random.Generator) -> dict:
    """One step's rows per (stage, kind of step): b"@" stands for the step, b"#" for the loss.

    Kinds: 0 a plain step, 1 a shadow step (delta statistics), 2 a shadow step
    that also has sigma(W_Q).
    """
    heads = layers * per_layer
    names = [f"transformer.h.{i}.attn" for i in range(layers)]
    layer_of = np.repeat(np.arange(layers), per_layer)
    head_of = np.tile(np.arange(per_layer), layers)
    t = np.linspace(0.0, 1.0, points)[:, None]  # (points, 1): training progress
    # a few heads go bad: their logits and sigma(W_Q) grow, their delta sum drifts one way
    bad = np.zeros(heads)
    bad[rng.choice(heads, size=max(1, heads // 24), replace=False)] = 1.0
    scale = rng.uniform(0.8, 1.2, heads)  # (heads,)
    rows = 1024.0
    max_score = (8 + 6 * t) * scale + bad * 80 * t ** 3 + rng.normal(0, 0.3, (points, heads))  # (points, heads)
    sigma = (1 + 0.4 * t) * scale + bad * 4 * t ** 2 + rng.normal(0, 0.01, (points, heads))
    drift = np.cumsum(rng.normal(0, 0.05, (points, heads)), axis=0) + bad * 30 * t
    multi = rng.poisson(2 + 60 * bad * t, (points, heads)).astype(float)
    stabilized = (bad * (t > 0.6)).astype(float)
    fmt = "@,%d,%s,%d,#," + ",".join("%.9g" for _ in METRICS) + "\n"
    out = {}
    for p in range(points):
        for kind in range(3):
            shadow, spectral = kind >= 1, kind == 2
            nan = float("nan")
            lines = []
            for i in range(heads):
                err = rng.normal(0.002 * bad[i], 0.01) if shadow else nan
                values = {
                    "rows": rows, "multi_max_rows": multi[p, i], "multi_max_freq": multi[p, i] / rows,
                    "masked_rows": 0.0, "max_score": max_score[p, i], "nonfinite_rows": 0.0,
                    "shadow_rows": rows if shadow else nan, "delta_err_sum": err,
                    "delta_err_abs": abs(err) * 3 if shadow else nan,
                    "delta_err_pos_frac": rng.uniform(0.4, 0.6) if shadow else nan,
                    "delta_cum": drift[p, i], "sigma_wq": sigma[p, i] if spectral else nan,
                    "stabilized": stabilized[p, i],
                }
                lines.append(fmt % (layer_of[i], names[layer_of[i]], head_of[i], *(values[k] for k in METRICS)))
            out[p, kind] = "".join(lines).encode()
    return out


def write_run(run_dir: Path, *, steps: int, layers: int, per_layer: int, shadow_every: int,
              spectral_every: int, seed: int = 0) -> int:
    """Write the synthetic run directory; returns the size of metrics.csv in bytes."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    points = min(PROGRESS_POINTS, steps)
    templates = _templates(layers, per_layer, points, rng)
    names = [f"transformer.h.{i}.attn" for i in range(layers)]
    meta = {"format": 1, "layers": names, "heads": [per_layer] * layers,
            "config": {"probe_every": 1, "shadow_every": shadow_every, "spectral_every": spectral_every},
            "created": "2026-11-24T00:00:00+00:00", "resumed_at": []}
    (run_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    step_of = np.arange(1, steps + 1)
    loss = 3.0 + 7.5 * np.exp(-step_of / (steps / 8)) + rng.normal(0, 0.05, steps)
    with open(run_dir / "metrics.csv", "wb") as f:
        f.write((",".join(METRIC_COLUMNS) + "\n").encode())
        pending, size = [], 0
        for s, l in zip(step_of.tolist(), loss.tolist()):
            # steps 1, 1 + n, ... as the watch observes them (a sigma step also gets the shadow columns)
            kind = 2 if spectral_every and (s - 1) % spectral_every == 0 else (
                1 if shadow_every and (s - 1) % shadow_every == 0 else 0)
            block = templates[(s - 1) * points // steps, kind]
            block = block.replace(b"@", str(s).encode()).replace(b"#", (b"%.9g" % l))
            pending.append(block)
            size += len(block)
            if size > 64 << 20:
                f.write(b"".join(pending))
                pending, size = [], 0
        f.write(b"".join(pending))
    # a handful of alerts and switches, as the watch writes them
    events = [",".join(EVENT_COLUMNS)]
    for k, s in enumerate((steps // 5, steps // 3, steps // 2)):
        layer, head = k % layers, (3 * k) % per_layer
        events.append(f"{s},{layer},{names[layer]},{head},alert,logit_growth,{600 + k},532,reported,"
                      f"\"max logit {600 + k} over 532: consider QK-norm or a lower learning rate\"")
    layer, head = 1, 2
    events.append(f"{steps // 2},{layer},{names[layer]},{head},alert,delta_drift,13.5,13,"
                  "switched to the stabilized kernel,\"sum(delta_lp - delta_hp) keeps one sign\"")
    events.append(f"{steps // 2},{layer},{names[layer]},{head},switch,delta_drift,,,,"
                  f"{names[layer]} head {head} moved to the stabilized kernel (delta_drift)")
    (run_dir / "events.csv").write_text("\n".join(events) + "\n")
    return (run_dir / "metrics.csv").stat().st_size


def damage(run_dir: Path) -> int:
    """Put a bad line after every line of ``run_dir``'s metrics.csv (after the header); returns how many."""
    path = run_dir / "metrics.csv"
    tmp = path.with_name("metrics.csv.tmp")
    n = 0
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        dst.write(src.readline())
        for line in src:
            kind = n % 4
            if kind == 0:
                bad = line[: line.rstrip(b"\n").rfind(b",")] + b"\n"  # a short row
            elif kind == 1:
                fields = line.split(b",")
                bad = b",".join(fields[:5] + [b"abc"] + fields[6:])  # a metric that is not a number
            elif kind == 2:
                bad = line.replace(b".attn", b".at\xff\xfen", 1)  # bytes that are not UTF-8
            else:
                bad = b"\x00\x00 not a row at all\n"
            dst.write(line + bad)
            n += 1
    os.replace(tmp, path)
    return n


def measure_report(run_dir: Path, out_dir: Path, *, plots: bool = True) -> dict:
    """Run ``instability-watch report`` in a child process: its wall time, peak RSS and exit status."""
    cmd = [sys.executable, "-m", "instability_watch.cli", "report", str(run_dir), "--out", str(out_dir)]
    if not plots:
        cmd.append("--no-plots")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})
    wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux; the largest child so far
    return {"command": " ".join(cmd), "returncode": proc.returncode, "wall_s": round(wall, 2),
            "peak_rss_gib": round(peak_kib / 2**20, 3), "peak_rss_kib": peak_kib,
            "peak_is_this_child": peak_kib > before, "stdout": proc.stdout, "stderr": proc.stderr}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/instability_watch_report_memory"),
                        help="where to write the run directory (default /tmp/instability_watch_report_memory)")
    parser.add_argument("--steps", type=int, default=200_000, help="steps (default 200000)")
    parser.add_argument("--heads", type=int, default=144, help="heads in all, --layers layers of equal width "
                        "(default 144: GPT-2 small)")
    parser.add_argument("--layers", type=int, default=12, help="layers (default 12)")
    parser.add_argument("--shadow-every", type=int, default=2,
                        help="delta statistics every n steps (default 2: rows of ~125 bytes, a 3.6 GB "
                        "metrics.csv for 200k x 144, as large as the issue's 3.5 GB)")
    parser.add_argument("--spectral-every", type=int, default=50, help="sigma(W_Q) every n steps (default 50)")
    parser.add_argument("--reuse", action="store_true", help="measure the run already in --dir")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (default: delete it)")
    parser.add_argument("--no-plots", action="store_true", help="also measure the report without plots")
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument("--damage", action="store_true", help="also a damaged run of half the steps, a bad line "
                        "after every good one, as long as the clean run's metrics.csv")
    args = parser.parse_args(argv)
    if args.heads % args.layers:
        parser.error(f"--heads must be a multiple of --layers, got {args.heads} and {args.layers}")
    run_dir = args.dir / "run"
    result = {"steps": args.steps, "heads": args.heads, "layers": args.layers,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "date": time.strftime("%Y-%m-%d")}
    if not args.reuse:
        if run_dir.exists():
            shutil.rmtree(run_dir)
        t0 = time.perf_counter()
        write_run(run_dir, steps=args.steps, layers=args.layers, per_layer=args.heads // args.layers,
                  shadow_every=args.shadow_every, spectral_every=args.spectral_every)
        result["generate_s"] = round(time.perf_counter() - t0, 1)
    size = (run_dir / "metrics.csv").stat().st_size
    result["metrics_csv_gib"] = round(size / 2**30, 3)
    result["metrics_csv_bytes"] = size
    print(f"run: {run_dir} (metrics.csv {size / 1e9:.2f} GB, {args.steps} steps x {args.heads} heads)", flush=True)
    try:
        # without plots first: ru_maxrss of children is the largest of all so far
        runs = ([("report --no-plots", False)] if args.no_plots else []) + [("report", True)]
        for name, plots in runs:
            m = measure_report(run_dir, args.dir / "report", plots=plots)
            result[name] = {k: v for k, v in m.items() if k not in ("stdout", "stderr")}
            print(m["stdout"][-3000:], m["stderr"][-2000:], sep="\n")
            print(f"{name}: exit {m['returncode']}, wall {m['wall_s']:.1f} s, peak RSS {m['peak_rss_gib']:.2f} GiB"
                  f" ({m['peak_rss_gib'] * 2**30 / size:.2f}x the CSV)", flush=True)
        if args.damage:
            bad_dir = args.dir / "damaged"
            if bad_dir.exists():
                shutil.rmtree(bad_dir)
            write_run(bad_dir, steps=args.steps // 2, layers=args.layers, per_layer=args.heads // args.layers,
                      shadow_every=args.shadow_every, spectral_every=args.spectral_every)
            result["damaged_bad_lines"] = damage(bad_dir)
            bad_size = (bad_dir / "metrics.csv").stat().st_size
            result["damaged_metrics_csv_bytes"] = bad_size
            for name, plots in runs:
                m = measure_report(bad_dir, args.dir / "report_damaged", plots=plots)
                result[f"damaged {name}"] = {k: v for k, v in m.items() if k not in ("stdout", "stderr")}
                print(m["stdout"][-1500:], m["stderr"][-2000:], sep="\n")
                print(f"damaged {name}: exit {m['returncode']}, wall {m['wall_s']:.1f} s, peak RSS "
                      f"{m['peak_rss_gib']:.2f} GiB ({bad_size / 1e9:.2f} GB, {result['damaged_bad_lines']} bad lines)",
                      flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        write_json(args.json, result, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
