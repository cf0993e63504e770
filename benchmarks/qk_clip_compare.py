"""The QK-clip comparison of issue 24 from ``reproduce.py`` launch roots: the table and two plots per learning rate.

For each run: its divergence step (EMA(0.05) loss 0.2 nats above its post-warm-up
minimum), and its EMA loss and mean loss (100 steps around it) at the step
``3 x`` the reference run's divergence step (the unclipped run: ``--reference``,
the first arm found of ``off`` then ``observe``); its clips and peak max logit.
Plots: ``loss_lrLR.png`` (EMA loss per run) and ``max_logit_lrLR.png`` (the
largest logit over all heads per recorded step, from metrics.csv).

Run:  python benchmarks/qk_clip_compare.py ROOT [ROOT ...] --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from _common import DIVERGENCE_JUMP, explosion_step, write_json

EMA = 0.05


def runs(roots):
    for root in roots:
        for d in sorted(Path(root).iterdir()):
            if (d / "config.json").exists() and (d / "train.csv").exists():
                yield d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by_lr = {}
    for d in runs(args.roots):
        cfg = json.loads((d / "config.json").read_text())
        t = pd.read_csv(d / "train.csv").drop_duplicates("step", keep="last").sort_values("step")
        t["ema"] = t["loss"].ewm(alpha=EMA).mean()
        div = explosion_step(zip(t["step"], t["loss"]), EMA, DIVERGENCE_JUMP, cfg["warmup"])
        row = {"watch": cfg["watch"], "lr": cfg["lr"], "steps": int(t["step"].max()), "divergence": div, "train": t}
        ev_path, m_path = d / "run" / "events.csv", d / "run" / "metrics.csv"
        if m_path.exists():
            m = pd.read_csv(m_path, usecols=["step", "max_score"])
            row["max_logit"] = m.groupby("step")["max_score"].max()
            row["peak_logit"] = float(row["max_logit"].max())
        if ev_path.exists():
            ev = pd.read_csv(ev_path, low_memory=False)
            note = d / "run" / "THINNED_EVENTS.txt"
            clips = ev[ev["event"] == "qk_clip"]
            row["clips"] = (int(note.read_text().split("(")[-1].split(" clips")[0]) if note.exists() else len(clips))
            row["first_clip"] = int(clips["step"].min()) if len(clips) else None
            row["clip_heads"] = int(len(clips[["layer", "head"]].drop_duplicates()))
        by_lr.setdefault(cfg["lr"], []).append(row)

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    table = []
    for lr, rows in sorted(by_lr.items(), reverse=True):
        ref = next((r for w in ("off", "observe") for r in rows if r["watch"] == w and r["divergence"]), None)
        at = 3 * ref["divergence"] if ref else None
        for r in rows:
            t = r["train"]
            line = {k: r.get(k) for k in ("lr", "watch", "steps", "divergence", "clips", "clip_heads", "first_clip",
                                          "peak_logit")}
            line["reference"] = f"{ref['watch']} (divergence {ref['divergence']})" if ref else None
            if at is not None and r["steps"] >= at:
                line["at_step"] = at
                line["ema_loss_at"] = round(float(t.loc[t["step"] <= at, "ema"].iloc[-1]), 4)
                near = t[(t["step"] > at - 50) & (t["step"] <= at + 50)]["loss"]
                line["mean_loss_at"] = round(float(near.mean()), 4)
            line["last100_loss"] = round(float(t["loss"].tail(100).mean()), 4)
            line["diverged_before_3x"] = (r["divergence"] is not None and at is not None and r["divergence"] <= at)
            table.append(line)
        for kind in ("loss", "max_logit"):
            fig = Figure(figsize=(8, 4.5))
            FigureCanvasAgg(fig)
            ax = fig.add_subplot()
            for r in rows:
                if kind == "loss":
                    ax.plot(r["train"]["step"], r["train"]["ema"], lw=1, label=r["watch"])
                elif "max_logit" in r:
                    ax.plot(r["max_logit"].index, r["max_logit"].values, lw=1, label=r["watch"])
            if kind == "max_logit":
                ax.set_yscale("log")
            if at is not None:
                ax.axvline(at, color="0.4", ls=":", lw=1, label=f"3 x divergence of {ref['watch']}")
            ax.set_xlabel("step")
            ax.set_ylabel("loss (EMA 0.05)" if kind == "loss" else "largest logit, all heads")
            ax.set_title(f"GPT-2 small, lr {lr:g}")
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / f"{kind}_lr{lr:g}.png", dpi=100)
    write_json(out / "table.json", table)
    cols = ["lr", "watch", "steps", "divergence", "at_step", "ema_loss_at", "mean_loss_at", "last100_loss", "clips",
            "clip_heads", "first_clip", "peak_logit", "diverged_before_3x"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for line in table:
        print("| " + " | ".join("" if line.get(c) is None else (f"{line[c]:.4g}" if isinstance(line.get(c), float)
                                                                    else str(line[c])) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
