"""Issue 41's report on the paper-scale arms: one table per arm and one figure per signal, the arms side by side.

    python benchmarks/paper_scale_report.py BUNDLE [BUNDLE ...] --out FIGURES --markdown TABLE.md

A BUNDLE is a ``.tar.xz`` made by ``reproduce.py bundle`` or an unpacked directory; every run folder in it (one with
``config.json`` and ``train.csv``) is an arm, named after the folder (e.g. ``standard-switch``; a second run of the
same arm, given later, is ``standard-switch (2)``). A ``train.log`` beside a ``.tar.xz`` (or in the directory) adds
the step times the log shows. Every number comes from the files:

* device, steps, tokens, wall time, steps/s (``status.json``; for a run cut off before it stopped, its last
  snapshot, or, without one, steps/s and wall time from ``train.log``); final loss (mean of the last 100 losses of
  ``train.csv``); explosion and divergence steps (``reproduce.py``'s rule, recomputed: loss EMA 0.05 1 nat,
  resp. 0.2 nats, above its running minimum after the warm-up, or a non-finite loss);
* per head (``run/metrics.csv``, ``run/events.csv``): growth of sigma(W_Q), its onset (defined below), the
  peak max logit, the first alert of each kind and its lead on the onset, the heads switched or clipped.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pandas as pd

from instability_watch import load_run

from _common import DIVERGENCE_JUMP, explosion_step

EMA, JUMP, TOP, ONSET_FACTOR = 0.05, 1.0, 6, 2.0
ONSET = ("growth onset: the first probe step after the warm-up W at which the head's sigma(W_Q) exceeds "
         f"{ONSET_FACTOR:g}x its value at step W + 1 (the end of the LR warm-up); growth = sigma(W_Q) at the last "
         "metrics step / at step W + 1. A head that never exceeds it has no onset, and its alerts are false alarms "
         "(alerts on a head that never grew) in this arm. Lead = onset - alert step (negative: the alert came after).")
SIGNALS = [("sigma_wq", "σ(W_Q)"), ("max_score", "max logit"), ("multi_max_freq", "multi-max frequency"),
           ("delta_cum", "Σ(δ_lp − δ_hp), cumulative"), ("loss", f"loss (EMA {EMA})")]
COLOURS = ["tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown"]
STEP_LINE = re.compile(r"\] step (\d+) loss \S+ lr \S+ gnorm \S+ ([\d.]+) steps/s")
START_LINE = re.compile(r"\] (?:new run|resumed at step (\d+))")


def head(layer, h) -> str:
    return f"L{int(layer)}H{int(h)}"


@dataclass
class Arm:
    name: str
    cfg: dict
    status: dict
    train: pd.DataFrame
    metrics: pd.DataFrame
    events: pd.DataFrame
    log: Optional[str]
    explosion: Optional[int] = None
    divergence: Optional[int] = None
    final_loss: float = math.nan
    heads: Optional[pd.DataFrame] = None  # filled by analyse(): per head base, last, growth, peak, onset
    base_step: Optional[int] = None
    last_step: Optional[int] = None
    top: Tuple[str, ...] = ()
    run: str = ""  # the run's folder name, as train.log's lines give it (the name, unless a second run's)

    @property
    def tag(self) -> str:
        """How train.log marks this run's lines: ``[folder name]``."""
        return f"[{self.run or self.name}]"


# --------------------------------------------------------------------------- reading


def load_arms(paths: List[str], tmp: Path) -> List[Arm]:
    arms: Dict[str, Arm] = {}
    for i, p in enumerate(map(Path, paths)):
        if not p.exists():
            raise SystemExit(f"error: no such bundle: {p}")
        log, root = (p.parent / "train.log", tmp / str(i)) if p.is_file() else (p / "train.log", p)
        if p.is_file():
            try:
                with tarfile.open(p) as tar:
                    tar.extractall(root, filter="data")
            except tarfile.TarError as exc:
                raise SystemExit(f"error: {p} is not a bundle (.tar.xz): {exc}")
        runs = [root] if (root / "config.json").exists() else sorted(
            c.parent for c in root.rglob("config.json") if (c.parent / "train.csv").exists())
        if not runs:
            raise SystemExit(f"error: {p} holds no run folder (one with config.json and train.csv)")
        for r in runs:
            # status.json is written at each printed log step ("stopped": null) and when the run stops; a run cut
            # off before the first (or by an older runner) has none: its wall time and speed then come from train.log
            missing = [f for f in ("config.json", "train.csv", "run/metrics.csv", "run/events.csv")
                       if not (r / f).exists()]
            if missing:
                raise SystemExit(f"error: {p}: run folder {r.name} lacks {', '.join(missing)}")
            # a second run of the same arm (a replicate) is named "NAME (2)", in the order given
            runs_before = sum(x.run == r.name for x in arms.values())
            name = f"{r.name} ({runs_before + 1})" if runs_before else r.name
            run = load_run(r / "run")
            arms[name] = Arm(name, json.loads((r / "config.json").read_text()),
                               json.loads((r / "status.json").read_text()) if (r / "status.json").exists()
                               else {},
                               pd.read_csv(r / "train.csv").drop_duplicates("step", keep="last").sort_values("step"),
                               run.metrics, run.events, log.read_text() if log.exists() else None, run=r.name)
    return list(arms.values())


# --------------------------------------------------------------------------- numbers


def analyse(a: Arm) -> Arm:
    warm = int(a.cfg["warmup"])
    pairs = list(zip(a.train["step"], a.train["loss"]))
    a.explosion = explosion_step(pairs, EMA, JUMP, warm)
    a.divergence = explosion_step(pairs, EMA, DIVERGENCE_JUMP, warm)
    finite = a.train["loss"][np.isfinite(a.train["loss"])]
    a.final_loss = float(finite.tail(100).mean()) if len(finite) else math.nan
    sig = a.metrics.pivot_table(index="step", columns=["layer", "head"], values="sigma_wq", aggfunc="last")
    after = sig[sig.index > warm].dropna(how="all")
    if after.empty:
        raise SystemExit(f"error: arm {a.name} has no sigma(W_Q) after its warm-up (step {warm})")
    a.base_step, a.last_step = int(after.index[0]), int(after.index[-1])
    base, last = after.iloc[0], after.ffill().iloc[-1]
    over = after.gt(ONSET_FACTOR * base)
    rows = []
    for col in after.columns:
        hits = over.index[over[col]]
        rows.append({"head": head(*col), "base": base[col], "last": last[col],
                     "growth": last[col] / base[col], "peak": after[col].max() / base[col],
                     "peak_step": int(after[col].idxmax()), "onset": int(hits[0]) if len(hits) else None})
    a.heads = pd.DataFrame(rows).set_index("head").sort_values("growth", ascending=False)
    a.heads["onset"] = a.heads["onset"].astype("Int64")
    a.top = tuple(a.heads.index[:TOP])
    return a


def first_alerts(a: Arm) -> pd.DataFrame:
    al = a.events[a.events["event"] == "alert"].sort_values("step")
    first = al.drop_duplicates(["layer", "head", "kind"], keep="first").copy()
    first["name"] = [head(l, h) for l, h in zip(first["layer"], first["head"])]
    first["onset"] = pd.array([a.heads.loc[n, "onset"] if n in a.heads.index else None for n in first["name"]],
                              dtype="Int64")
    first["lead"] = first["onset"] - first["step"].astype("Int64")
    return first


def actions(a: Arm) -> Tuple[pd.DataFrame, pd.DataFrame]:
    """Switches (one row each; not the stabilized arm's at step 0) and QK-clips (each head's first, and a count)."""
    ev = a.events
    sw = ev[(ev["event"] == "switch") & (ev["kind"] != "stabilized arm")].sort_values("step").copy()
    sw["name"] = [head(l, h) for l, h in zip(sw["layer"], sw["head"])]
    # the alert that called for it: the head's last alert of that kind at or before the switch's step (run
    # directories written since 2026-11-28 date a switch at its deciding read-back, earlier ones at the alert)
    al = ev[ev["event"] == "alert"]

    def alert_step(layer, h, kind, step) -> int:
        before = al[(al["layer"] == layer) & (al["head"] == h) & (al["kind"] == kind) & (al["step"] <= step)]
        return int(before["step"].max()) if len(before) else int(step)

    sw["alert"] = [alert_step(*row) for row in zip(sw["layer"], sw["head"], sw["kind"], sw["step"])]
    on = a.metrics[a.metrics["stabilized"] > 0].groupby(["layer", "head"])["step"].min()  # first probe on it
    sw["on"] = pd.array([on.get((l, h)) for l, h in zip(sw["layer"], sw["head"])], dtype="Int64")
    clip = ev[ev["event"] == "qk_clip"].copy()
    clip["name"] = [head(l, h) for l, h in zip(clip["layer"], clip["head"])]
    clips = clip.groupby("name").agg(first=("step", "min"), rows=("step", "size")).sort_values("first")
    return sw, clips


def peak_logit(a: Arm, until: float = math.inf) -> str:
    m = a.metrics[np.isfinite(a.metrics["max_score"]) & (a.metrics["step"] < until)]
    r = m.loc[m["max_score"].idxmax()]
    return f"{r['max_score']:.3g} ({head(r['layer'], r['head'])}, step {int(r['step']):,})"


def last_progress(a: Arm) -> Optional[Tuple[int, float]]:
    """``(steps since the start, cumulative steps/s)`` of the log's last progress line of this arm, if any."""
    last, start = None, 0
    for line in (a.log or "").splitlines():
        if a.tag not in line:
            continue
        if m := START_LINE.search(line):
            start = int(m.group(1) or 0)
        elif m := STEP_LINE.search(line):
            last = (int(m.group(1)) - start, float(m.group(2)))
    return last


def step_times(a: Arm) -> Optional[dict]:
    """100-step intervals from the log's cumulative steps/s (elapsed = (step - start) / rate, per command)."""
    if not a.log:
        return None
    pts, start, limit_after = [], 0, None
    for line in a.log.splitlines():
        if a.tag in line and START_LINE.search(line):
            m = START_LINE.search(line)
            start = int(m.group(1) or 0)
            pts.append((start, 0.0, 0.0, True))
        elif (m := STEP_LINE.search(line)) and a.tag in line:
            s, r = int(m.group(1)), float(m.group(2))
            # the rate is printed with 2 decimals: elapsed is known to (s - start) * 0.005 / r^2
            pts.append((s, (s - start) / r, (s - start) * 0.005 / r ** 2, False))
        elif "recompile_limit" in line and limit_after is None and pts:
            limit_after = pts[-1][0]
    iv = [(p[0], q[0], q[1] - p[1], p[2] + q[2], p[3]) for p, q in zip(pts, pts[1:]) if not q[3]]
    if not iv:
        return None
    df = pd.DataFrame(iv, columns=["from", "to", "seconds", "err", "first"])
    steady = df[~df["first"]]
    split = limit_after if limit_after is not None else math.inf
    med = {"before": float(steady[steady["from"] < split]["seconds"].median()),
           "after": float(steady[steady["from"] >= split]["seconds"].median())}
    df["excess"] = df["seconds"] - [med["before" if f < split else "after"] for f in df["from"]]
    return {"intervals": df, "median": med, "limit_after": limit_after, "err": float(steady["err"].max())}


# --------------------------------------------------------------------------- Markdown


def fmt(x, spec="{:,}") -> str:
    return "–" if x is None or pd.isna(x) else spec.format(x)


def onset_str(a: Arm, onset) -> str:
    """An onset, marked † when it comes at or after the explosion (the head grew with the blow-up)."""
    if pd.isna(onset):
        return "none"
    return f"{int(onset):,}" + ("†" if a.explosion is not None and onset >= a.explosion else "")


def table(header: List[str], rows: List[List[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows]) + "\n"


def markdown(arms: List[Arm]) -> str:
    out = ["Arms (`status.json`, `train.csv`; explosion / divergence: loss EMA 0.05 1 / 0.2 nats above its running "
           "minimum after the warm-up, recomputed):\n"]
    rows, cut = [], []
    for a in arms:
        st = a.status
        tokens = int(st.get("tokens_per_step") or a.cfg["batch"] * a.cfg["block"])
        steps = int(a.train["step"].max())
        if st:  # "stopped" None: the run's last snapshot while running (it was cut off after it)
            mark = "‡" if "stopped" in st and st["stopped"] is None else ""
            if mark:
                cut.append(a.name)
            device = f"{st.get('processes', '?')}× {st.get('device', '?')}"
            wall = fmt(st.get("seconds"), "{:,} s") + (f" to step {int(st['step']):,}‡" if mark else "")
            speed = f"{fmt(st.get('steps_per_s'), '{}')} ({fmt(st.get('steps_per_s_warm'), '{}')} warm){mark}"
        else:  # cut off: what train.log shows (its last progress line: steps since the start / cumulative rate)
            cut.append(a.name)
            last = last_progress(a)  # since the last command's start (a resumed run: that command's)
            device = "? (cut off‡)"
            wall = "–" if last is None else f"{last[0]:,} steps in {last[0] / last[1]:,.1f} s‡"
            speed = "–" if last is None else f"{last[1]}‡"
        rows.append([a.name, device, f"{steps:,}", f"{steps * tokens / 1e9:.2f}B", wall, speed,
                     fmt(st.get("max_memory_gib"), "{} GiB"), f"{a.final_loss:.4f}", fmt(a.explosion),
                     fmt(a.divergence), peak_logit(a),
                     peak_logit(a, a.explosion) if a.explosion is not None else "–"])
    out.append(table(["arm", "device", "steps", "tokens", "wall time", "steps/s", "GPU memory", "final loss",
                      "explosion", "divergence", "peak max logit", "before the explosion"], rows))
    if cut:
        out.append(f"\n‡ {', '.join(cut)}: cut off before it stopped (the machine was lost); steps from `train.csv`; "
                   "wall time and steps/s from the last `status.json` written while it ran, or, where there is none, "
                   "from `train.log`'s last progress line (since its last command's start, compiling included; the "
                   "device is then not in the bundle).\n")
    out.append(common_steps_markdown(arms))
    for a in arms:
        out.append(arm_markdown(a))
    return "\n".join(out)


COMMON_STEPS = (3001, 4001, 4171, 4491, 5741)
WATCHED_HEADS = ((1, 4), (1, 5), (1, 11))  # the first heads that grew in the first arm


def common_steps_markdown(arms: List[Arm]) -> str:
    """The arms side by side at the same probe steps: sigma(W_Q) growth over step W + 1 (the largest, its head, the
    median; the first heads that grew in arm 1) and the largest logit up to that step. Steps an arm did not reach:
    left out of its rows."""
    rows = []
    for a in arms:
        sig = a.metrics.pivot_table(index="step", columns=["layer", "head"], values="sigma_wq", aggfunc="last")
        base = sig.loc[a.base_step]
        for s in COMMON_STEPS:
            if s not in sig.index:
                continue
            g = sig.loc[s] / base
            top = g.idxmax()
            upto = a.metrics[(a.metrics["step"] <= s) & np.isfinite(a.metrics["max_score"])]["max_score"].max()
            rows.append([a.name, f"{s:,}", f"×{g.max():.2f} ({head(*top)})", f"×{g.median():.2f}",
                         *(f"×{g[h]:.2f}" if h in g.index else "–" for h in WATCHED_HEADS), f"{upto:.3g}"])
    if not rows:
        return ""
    return ("\nThe arms at the same probe steps (σ(W_Q) over its value at the end of the warm-up; largest logit of "
            "any head up to the step):\n\n"
            + table(["arm", "step", "largest growth", "median growth", *(f"{head(*h)}" for h in WATCHED_HEADS),
                     "largest logit so far"], rows))


def arm_markdown(a: Arm) -> str:
    out = [f"\n#### {a.name}\n\n"]
    fa, (sw, clips) = first_alerts(a), actions(a)
    sw_at = sw.drop_duplicates("name").set_index("name")["step"]
    boom = a.explosion if a.explosion is not None else math.inf
    onset_def = ONSET.replace("W + 1", str(a.base_step)).replace(" W ", f" {a.cfg['warmup']} ")
    out.append(f"Heads whose σ(W_Q) grew most (of {len(a.heads)}; median growth ×{a.heads['growth'].median():.2f}; "
               f"last metrics step {a.last_step:,}). {onset_def} † marks an onset at or after the explosion.\n\n")
    rows = []
    for n in a.top:
        h = a.heads.loc[n]
        alerts = ", ".join(f"{k} {s:,} ({fmt(l, '{:+,}')})" for k, s, l in
                           fa[fa["name"] == n][["kind", "step", "lead"]].itertuples(index=False)) or "none"
        rows.append([n, f"{h['base']:.3g}", f"{h['last']:.3g}", f"×{h['growth']:.1f}", f"×{h['peak']:.1f} "
                     f"({int(h['peak_step']):,})", onset_str(a, h["onset"]), fmt(sw_at.get(n)), alerts])
    out.append(table(["head", f"σ at {a.base_step:,}", f"σ at {a.last_step:,}", "growth", "peak (step)", "onset",
                      "switched at", "first alert of each kind (lead on onset)"], rows))
    grown = a.heads[a.heads["onset"].notna()]["onset"].sort_values()
    early = grown[grown < boom]
    out.append(f"\nHeads with an onset: {len(grown)} of {len(a.heads)}; before the explosion: {len(early)}"
               + (f" ({', '.join(f'{n} {int(o):,}' for n, o in early.items())})" if len(early) else "")
               + (f"; at or after it: {len(grown) - len(early)}" if a.explosion is not None else "") + ".\n")
    out.append(f"\nFirst alert of each kind per head ({len(fa)} rows for {int((a.events['event'] == 'alert').sum())} "
               f"alerts), its lead on the head's onset, and its lead on the explosion:\n\n")
    rows = [[r.name, r.kind, f"{r.step:,}", r.action, onset_str(a, r.onset),
             "never grew" if pd.isna(r.lead) else f"{r.lead:+,}",
             fmt(None if a.explosion is None else a.explosion - int(r.step), "{:+,}")] for r in fa.itertuples()]
    out.append(table(["head", "kind", "step", "action", "onset", "lead on onset", "lead on explosion"], rows))

    def heads_alerts(d: pd.DataFrame) -> str:
        return "; ".join(f"{n} ({', '.join(f'{k} {s:,}' for k, s in g[['kind', 'step']].itertuples(index=False))})"
                         for n, g in d.groupby("name", sort=False)) or "none"

    out.append(f"\nFalse alarms (alerts on heads that never grew): {heads_alerts(fa[fa['onset'].isna()])}.\n")
    if a.explosion is not None:
        late = fa[fa["onset"].notna() & (fa["onset"] >= a.explosion)]
        out.append(f"\nAlerts on heads whose onset came only at or after the explosion: {heads_alerts(late)}.\n")
    if len(sw):
        exact = a.events["action"].astype(str).str.contains("exact delta").any()
        target = "the exact δ (the head's layer on our kernel, δ from a float32 O)" if exact else \
            "the stabilized kernel"
        out.append(f"\nSwitched to {target} ({len(sw)}; alert step, kind, first probe step on it): "
                   + ", ".join(f"{r.name} {r.alert:,} ({r.kind}, {fmt(r.on)})" for r in sw.itertuples()) + ".\n")
    else:
        out.append("\nSwitched: none.\n")
    if n := int(((a.events["event"] == "switch") & (a.events["kind"] == "stabilized arm")).sum()):
        out.append(f"\nOn the stabilized kernel from step 0 (the stabilized arm): {n} heads.\n")
    out.append("\nQK-clipped (first clip per head): " + (", ".join(f"{n} {int(r['first']):,}" for n, r in
                                                             clips.iterrows()) if len(clips) else "none") + ".\n")
    times = step_times(a)
    if times:
        out.append(timing_markdown(a, times, sw))
    return "".join(out)


def timing_markdown(a: Arm, t: dict, sw: pd.DataFrame) -> str:
    df, med, every = t["intervals"], t["median"], int(a.cfg.get("log_every", 50))
    first, n = df[df["first"]].iloc[0], int(df["to"].iloc[-1] - df["from"].iloc[-1])
    s = [f"\nStep times (`train.log`: elapsed = steps / the cumulative steps/s it prints with 2 decimals, so each "
         f"interval is known to ±{t['err']:.1f} s): first {int(first['to'])} steps {first['seconds']:.1f} s "
         f"(compiling); median {n}-step interval {med['before']:.1f} s ({n / med['before']:.2f} steps/s)"]
    if t["limit_after"] is not None:
        s.append(f" until the log's `recompile_limit` warning (after step {t['limit_after']:,}), {med['after']:.1f} s "
                 f"({n / med['after']:.2f} steps/s) from there on")
    s.append(".\n")
    slow = df[~df["first"] & (df["seconds"] > 1.5 * df["from"].map(
        lambda f: med["before" if t["limit_after"] is None or f < t["limit_after"] else "after"]))]
    if len(slow):
        s.append("\nSlow intervals: " + "; ".join(f"{int(r['from']):,}–{int(r['to']):,} {r['seconds']:.1f} s "
                                                f"(+{r['excess']:.1f} s)" for _, r in slow.iterrows()) + ".\n")
    if len(sw):
        rows = []
        for r in sw.itertuples():  # an alert's switch takes effect after its read-back (every log_every steps)
            applied = -(-int(r.alert) // every) * every
            iv = df[(df["from"] <= applied) & (applied < df["to"])]
            rows.append([r.name, f"{r.alert:,}", f"{applied:,}"] + (
                [f"{int(iv['from'].iloc[0]):,}–{int(iv['to'].iloc[0]):,}", f"{iv['seconds'].iloc[0]:.1f}",
                 f"{iv['excess'].iloc[0]:+.1f}"] if len(iv) else ["–", "–", "–"]))
        s.append(f"\nSwitches and the interval in which each took effect (after the read-back of step ⌈alert/"
                 f"{every}⌉·{every}); excess over the median interval of its stretch:\n\n")
        s.append(table(["head", "alert", "applied after", "interval", "seconds", "excess"], rows))
    return "".join(s)


# --------------------------------------------------------------------------- figures


def series(a: Arm, key: str) -> pd.DataFrame:
    if key == "loss":
        t = a.train.set_index("step")["loss"]
        return pd.DataFrame({"raw": t, "ema": t.ewm(alpha=EMA, adjust=False).mean()})
    p = a.metrics.pivot_table(index="step", columns=["layer", "head"], values=key, aggfunc="last")
    p.columns = [head(*c) for c in p.columns]
    return p.replace([np.inf, -np.inf], np.nan)


# what each arm of issue 41 is, for the figures' panel titles (other runs: their name alone)
ARM_NOTES = {
    "standard-observe": "cuDNN, no remedy",
    "control-observe": "exact δ in every layer",
    "kernel-observe": "our kernel, rounded δ",
    "stabilized-observe": "stabilized shift everywhere",
    "standard-switch": "alerted heads → stabilized",
    "standard-switch_exact": "alerted layers → exact δ",
    "standard-clip_alert": "alerted heads QK-clipped",
}


def figures(arms: List[Arm], out: Path) -> List[Path]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label in SIGNALS:
        data = [series(a, key) for a in arms]
        vals = np.concatenate([d.to_numpy().ravel() for d in data])
        vals = vals[np.isfinite(vals)]
        pos, mag = vals[vals > 0], np.abs(vals[vals != 0])
        # log y where the values span two decades or more; symlog where signed values span three
        log = len(pos) >= 0.99 * len(vals) > 0 and pos.max() / pos.min() >= 100
        symlog = not log and len(mag) and mag.max() / np.median(mag) >= 1000
        cols = min(len(arms), 3)  # rows of at most three arms: readable where the figure is shown narrow
        rows = math.ceil(len(arms) / cols)
        fig = Figure(figsize=(max(10.0, 1.0 + 4.5 * cols), 0.4 + 3.8 * rows), dpi=100)
        FigureCanvasAgg(fig)
        grid = fig.subplots(rows, cols, sharey=True, sharex=True, squeeze=False)
        axes = grid.ravel()[: len(arms)]
        for ax in grid.ravel()[len(arms):]:
            ax.set_visible(False)
        for ax, a, d in zip(axes, arms, data):
            colour = dict(zip(a.top, COLOURS))
            if key == "loss":
                ax.plot(d.index, d["raw"], color="0.75", lw=0.4, label="loss")
                ax.plot(d.index, d["ema"], color="k", lw=1.2, label=f"EMA {EMA}")
            else:
                for n in d.columns:
                    if n not in colour:
                        ax.plot(d.index, d[n], color="0.6", lw=0.4, alpha=0.5)
                for n in a.top:
                    ax.plot(d.index, d[n], color=colour[n], lw=1.4,
                            label=f"{n} ×{a.heads.loc[n, 'growth']:.0f}")
            sw, clips = actions(a)
            tr = ax.get_xaxis_transform()
            if len(sw):
                ax.scatter(sw["step"], np.full(len(sw), 0.03), marker="|", s=120, transform=tr, zorder=3,
                           c=[colour.get(n, "k") for n in sw["name"]], label="switch")
            if len(clips):
                ax.scatter(clips["first"], np.full(len(clips), 0.97), marker="v", s=25, transform=tr, c="tab:cyan",
                           zorder=3, label="first QK-clip")
            if a.explosion is not None:
                ax.axvline(a.explosion, color="red", ls="--", lw=1, label=f"explosion {a.explosion:,}")
            note = ARM_NOTES.get(a.run or a.name)
            ax.set_title(f"{a.name}: {note}" if note else a.name, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper left", ncol=2 if key != "loss" else 1)
        if log:
            axes[0].set_yscale("log", nonpositive="mask")
        elif symlog:
            axes[0].set_yscale("symlog", linthresh=10.0 ** math.ceil(math.log10(np.median(mag))), linscale=0.5)
        for row in grid:
            row[0].set_ylabel(label)
        note = "" if key == "loss" else f" (colour: the {TOP} heads whose σ(W_Q) grew most; gray: the others)"
        fig.suptitle(f"{label}{note}" + ("; y: symlog, linear near 0" if symlog else ""), fontsize=10)
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path)
        paths.append(path)
    return paths


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, epilog=ONSET,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+", metavar="BUNDLE", help=".tar.xz bundle or unpacked directory, one per arm "
                    "(or several arms in one); a train.log beside it adds step times")
    ap.add_argument("--out", required=True, help="folder for the figures (one PNG per signal)")
    ap.add_argument("--markdown", help="write the tables to this Markdown file too")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        arms = [analyse(a) for a in load_arms(args.bundles, Path(tmp))]
    text = markdown(arms)
    print(text)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    for p in figures(arms, Path(args.out)):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
