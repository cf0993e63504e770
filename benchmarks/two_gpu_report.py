"""Issue 45's tables from what the multi-GPU drivers wrote: markdown for benchmarks/RESULTS.md.

    python benchmarks/two_gpu_report.py DIR [DIR ...] [--markdown FILE]

Each DIR is searched for ``*results.json`` files (``multi_gpu.py``'s: a list of cases; ``hf_trainer_multi_gpu.py``'s:
one run) and for ``summary_rank*.json`` (``examples/train_gpt2.py``'s, one per rank and run). Prints the tables:
the Lightning cases, the Hugging Face Trainer, the fits in blocks (``--pairs``), the example. Every number comes
from those files.

Timing columns (``_common.step_cost``; ``_common.block_cost`` for a fit in blocks, watched and unwatched
in turn): the whole fits' ratio watched/unwatched steps/s, median [min-max] over the rounds; "other steps":
the unwatched/watched ratio of the median duration of the steps between probe and read-back steps (the same
steps in both fits); "share": the time the probe and read-back steps took beyond that median, as a share of
the watched fit's time; "estimate": other steps x (1 - share).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _range(s) -> str:
    if not s:
        return "-"
    return f"{s['median']:.4f} [{s['min']:.3f}–{s['max']:.3f}]"


def _timing(cost: dict, rounds: list) -> list:
    share = cost.get("share")
    probe = [r["watched_steps"].get("probe_extra_ms") for r in rounds if r.get("watched_steps")]
    probe = [p for p in probe if p is not None]
    read_back = [x for r in rounds if r.get("watched_steps")
                 for x in r["watched_steps"].get("read_back_extra_ms") or []]
    unwatched = [r["unwatched"] for r in rounds if r.get("unwatched")]
    other_ms = [r["unwatched_steps"]["other_ms"] for r in rounds
                if (r.get("unwatched_steps") or {}).get("other_ms")]
    return [
        _f(statistics.median(unwatched) if unwatched else None, ".2f"),
        _f(statistics.median(other_ms) if other_ms else None, ".1f"),
        f"{_range(cost.get('fit_ratio'))} ({(cost.get('fit_ratio') or {}).get('n', 0)})",
        _range(cost.get("other_step_ratio")),
        _f(share and 100 * share["median"], "+.2f") + ("%" if share else ""),
        _f(statistics.median(probe) if probe else None, "+.1f"),
        ", ".join(f"{x:+.1f}" for x in read_back[:5]) or "-",
        _f(cost.get("estimate"), ".4f"),
    ]


TIMING_HEAD = ["unwatched steps/s (median)", "other step, ms", "fit ratio median [range] (rounds)",
               "other steps unwatched/watched", "probe + read-back share", "probe step extra ms (median)",
               "read-back extra ms", "estimate"]


def _table(head: list, rows: list) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def lightning_rows(results: list) -> list:
    rows = []
    for res in results:
        for c in res["cases"]:
            if "error" in c:
                rows.append([c["model"], c["strategy"], f"error: {c['error'][:120]}"] + [""] * (len(TIMING_HEAD) + 4))
                continue
            rows.append([c["model"], c["strategy"], *_timing(c.get("cost") or {}, c["rounds"]),
                         _f(c.get("sigma_max_rel_diff"), ".1e"), c.get("ranks_agree"), c.get("resumed_state_equal"),
                         f"{len(c.get('alerts') or [])} / {len(c.get('switched') or [])}", c.get("seconds")])
    return rows


def hf_rows(results: list) -> list:
    return [[r["world_size"], *_timing(r.get("cost") or {}, r["rounds"]), _f(r.get("sigma_max_rel_diff"), ".1e"),
             r.get("ranks_agree"), r.get("resumed_state_equal"), f"{len(r['alerts'])} / {len(r['switched'])}"]
            for r in results]


def example_rows(summaries: dict) -> list:
    rows = []
    for run, ranks in sorted(summaries.items()):
        s0 = ranks[min(ranks)]
        speed = s0.get("speed") or {}
        same = all({k: s.get(k) for k in ("alerts", "switched", "steps")} ==
                   {k: s0.get(k) for k in ("alerts", "switched", "steps")} for s in ranks.values())
        rows.append([s0.get("strategy"), s0.get("devices"), len(ranks), s0.get("steps"),
                     _f(speed.get("steps_per_s"), ".2f"), _f(s0.get("final_loss"), ".3f"), s0.get("data_parallel"),
                     f"{len(s0.get('alerts') or [])} / {len(s0.get('switched') or [])}", same])
    return rows


def block_rows(lightning: list, hf: list) -> list:
    rows = []
    runs = [(f"{c['model']} (Lightning)", c["strategy"], c.get("blocks")) for r in lightning for c in r["cases"]]
    runs += [("Llama 85M (HF Trainer)", "ddp", r.get("blocks")) for r in hf]
    for name, strategy, b in runs:
        if b and "error" in b:
            rows.append([name, strategy, "-", 0, f"error: {b['error'][:120]}", "-", "-"])
            continue
        if not b or not b.get("pairs"):
            continue
        share = b["share"]
        rows.append([name, strategy, b["size"], len(b["pairs"]), _range(b["other_ratio"]),
                     f"{100 * share['median']:+.2f}% [{100 * share['min']:+.2f}–{100 * share['max']:+.2f}]",
                     _range(b["estimate"])])
    return rows


def collect(dirs) -> tuple:
    lightning, hf, examples = [], [], {}
    for d in dirs:
        d = Path(d)
        for f in sorted(d.rglob("*results.json")) if d.is_dir() else [d]:
            r = json.loads(f.read_text())
            (lightning if "cases" in r else hf).append(r)
        for f in sorted(d.rglob("summary_rank*.json")) if d.is_dir() else []:
            s = json.loads(f.read_text())
            examples.setdefault(str(f.parent), {})[int(f.stem.rsplit("rank", 1)[1])] = s
    return lightning, hf, examples


def report(dirs) -> str:
    lightning, hf, examples = collect(dirs)
    parts = []
    if lightning:
        dev = lightning[0].get("device")
        head = f"Lightning (`benchmarks/multi_gpu.py`), {lightning[0].get('devices')} devices, {dev}:\n\n"
        parts.append(head + _table(
            ["model", "strategy", *TIMING_HEAD, "σ max rel. diff", "ranks agree", "resumed state equal",
             "alerts / switched (checkpointed fit)", "seconds"], lightning_rows(lightning)))
    if hf:
        head = f"Hugging Face Trainer (`benchmarks/hf_trainer_multi_gpu.py`), {hf[0].get('device')}:\n\n"
        parts.append(head + _table(
            ["ranks", *TIMING_HEAD, "σ max rel. diff", "ranks agree", "resumed state equal",
             "alerts / switched (deciding run)"], hf_rows(hf)))
    blocks = block_rows(lightning, hf)
    if blocks:
        parts.append("One fit in blocks, watched and unwatched in turn (`--pairs`):\n\n" + _table(
            ["model", "strategy", "block steps", "pairs", "other steps unwatched/watched, median [range]",
             "probe + read-back share", "estimate, median [range]"], blocks))
    if examples:
        parts.append("`examples/train_gpt2.py --preset gpt2-small` (watched):\n\n" + _table(
            ["strategy", "devices", "ranks' summaries", "steps", "steps/s", "final loss", "data parallel",
             "alerts / switched", "ranks agree"], example_rows(examples)))
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="folders (or results.json files) the drivers wrote")
    ap.add_argument("--markdown", help="also write the tables to this file")
    args = ap.parse_args(argv)
    missing = [d for d in args.dirs if not Path(d).exists()]
    if missing:
        ap.error(f"no such folder or file: {', '.join(missing)}")
    text = report(args.dirs)
    if args.markdown:
        Path(args.markdown).write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
