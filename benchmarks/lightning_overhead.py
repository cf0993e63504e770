"""The watch's cost inside Lightning, measured in one process: alternating fits of the same module.

examples/train_gpt2.py's ``GPTModule`` (the main job's model and recipe) is fitted
again and again in one process, in rounds that alternate ``Trainer.fit`` without
and with ``InstabilityWatchCallback`` at the ``WatchConfig`` defaults (order
swapped every round). With ``--compile`` the module is compiled once, so every
fit after the first reuses the same compiled graphs (the watched fits add the
probe step's graph once). Each fit's steps/s is taken between optimizer steps
``--skip`` and ``--steps`` (CUDA synchronised at both ends), which leaves out
Trainer start-up and compilation; the ratio per round is watched / unwatched.

Separate processes scatter by several percent on the lent H100 (the same command
gave 30.0 and 31.4 steps/s), more than the bar being measured, and so do fits
within one process. So each watched fit also attributes its own cost: CUDA events
at every step's start give each step's duration (host stalls included, as gaps);
the steps between probe steps run exactly the unwatched code, so the watch's cost
is what the probe and read-back steps take beyond the median of the other steps,
over the fit's time (``attributed``).

Run:  python benchmarks/lightning_overhead.py [--preset gpt2-small] [--rounds 3] [--steps 125] [--skip 25] [--compile]
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from instability_watch import InstabilityWatchCallback, WatchConfig

from _common import StepTimes, device_name, synced_clock, write_json
from byte_corpus import stdlib_text, train_val_split

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt2.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt2_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class Window(pl.Callback):
    """Steps/s between optimizer steps ``skip`` and ``stop`` (synchronised at both ends), and each step's
    duration in between (:class:`_common.StepTimes`, the cadence of ``config`` or the defaults)."""

    def __init__(self, skip: int, stop: int, config: WatchConfig = None) -> None:
        self.skip, self.stop = skip, stop
        self.t0 = None
        self.rate = None
        self.config = config
        self.steps = StepTimes(skip, stop, config or WatchConfig())
        self.modes_seen = 0  # torch-function modes found active at a step's start (the watch leaves none behind)
        self.gc_start = None
        self.gc_collections = None  # garbage collections per generation inside the timed window

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.mark(trainer.global_step + 1)
        if self.skip < trainer.global_step + 1 <= self.stop:
            self.modes_seen = max(self.modes_seen, torch._C._len_torch_function_stack())

    def other_step_ms(self) -> float:
        """Median duration of the steps that are neither probe nor read-back steps (of the watched
        fit's cadence, also in an unwatched fit, so both medians cover the same steps)."""
        return self.steps.summary(watched=False)["other_ms"]

    def attributed(self) -> dict:
        """The watch's share of the fit's time (probe and read-back steps beyond the median other step),
        and the extra milliseconds of a probe step (median) and of the read-back steps (each)."""
        if self.config is None or len(self.steps.marks) < 3:
            return {"share": float("nan")}
        s = self.steps.summary(watched=True)
        return {"share": s["share"], "base_ms": s["other_ms"], "probe_extra_ms": s["probe_extra_ms"],
                "read_back_extra_ms": s["read_back_extra_ms"]}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.skip:
            self.t0 = synced_clock()
            self.gc_start = [g["collections"] for g in gc.get_stats()]
        elif trainer.global_step == self.stop and self.t0 is not None:
            self.rate = (self.stop - self.skip) / (synced_clock() - self.t0)
            self.gc_collections = [g["collections"] - c for g, c in zip(gc.get_stats(), self.gc_start)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=125, help="optimizer steps per fit")
    ap.add_argument("--skip", type=int, default=25, help="steps of each fit left out of its timing")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    ex = _example()
    preset = ex.PRESETS[args.preset]
    gpu = torch.cuda.is_available()
    pl.seed_everything(0, verbose=False)
    train_bytes, _ = train_val_split(stdlib_text(preset.corpus_bytes))
    module = ex.GPTModule(preset, compile=args.compile)
    root = Path(tempfile.mkdtemp(prefix="lightning_overhead_"))
    results = {"plain": [], "watch": []}
    ratios, attributed, other = [], [], {"plain": [], "watch": []}
    modes, gcs = [], {"plain": [], "watch": []}
    for r in range(args.rounds):
        order = ("plain", "watch") if r % 2 == 0 else ("watch", "plain")
        rates = {}
        for kind in order:
            data = DataLoader(ex.ByteWindows(train_bytes, preset.block, args.steps * preset.batch, seed=r),
                              batch_size=preset.batch, drop_last=True)
            config = WatchConfig()
            window = Window(args.skip, args.steps, config if kind == "watch" else None)
            callbacks = [window]
            if kind == "watch":
                callbacks.append(InstabilityWatchCallback(config, run_dir=root / f"run{r}", alerts=False))
            trainer = pl.Trainer(
                accelerator="gpu" if gpu else "cpu", devices=1, precision="bf16-mixed", max_steps=args.steps,
                gradient_clip_val=1.0, logger=False, callbacks=callbacks, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                limit_val_batches=0, default_root_dir=str(root),
            )
            trainer.fit(module, data)
            rates[kind] = window.rate
            results[kind].append(window.rate)
            if gpu:
                other[kind].append(window.other_step_ms())
            modes.append(window.modes_seen)
            gcs[kind].append(window.gc_collections)
            if kind == "watch":
                attributed.append(window.attributed())
        ratios.append(rates["watch"] / rates["plain"])
        a = attributed[-1]
        print(f"round {r}: plain {rates['plain']:.2f} steps/s, watch {rates['watch']:.2f} steps/s, "
              f"ratio {ratios[-1]:.4f}; within the watched fit: {100 * a['share']:+.2f}% (step {a.get('base_ms', 0):.2f} "
              f"ms; probe step {a.get('probe_extra_ms') or 0:+.2f} ms; read-back {a.get('read_back_extra_ms')} ms)"
              + (f"; median other step plain {other['plain'][-1]:.2f} ms, watch {other['watch'][-1]:.2f} ms"
                 if gpu else "") + f"; gc plain {gcs['plain'][-1]} watch {gcs['watch'][-1]}",
              flush=True)
    out = {"preset": args.preset, "compile": args.compile, "steps": args.steps, "skip": args.skip,
           "device": device_name(), **results, "ratios": ratios,
           "ratio_median": statistics.median(ratios), "attributed": attributed,
           "other_step_ms": other, "torch_function_modes_seen": max(modes), "gc_collections": gcs}
    if args.compile:
        from torch._dynamo.utils import counters

        out["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
    if args.json:
        write_json(args.json, out)
    print(f"\n{'compile' if args.compile else 'eager'}: plain {statistics.median(results['plain']):.2f} steps/s, "
          f"watch {statistics.median(results['watch']):.2f} steps/s, ratio (median of {args.rounds} rounds) "
          f"{out['ratio_median']:.4f}, range {min(ratios):.4f}-{max(ratios):.4f}; attributed within the watched "
          f"fits {', '.join('%+.2f%%' % (100 * a['share']) for a in attributed)}"
          + (f"; dynamo {out['dynamo']}" if args.compile else ""))
    if gpu:
        ratio_other = [p / w for p, w in zip(other["plain"], other["watch"])]
        share = statistics.median(a["share"] for a in attributed)
        print(f"median other step: plain/watch per round {', '.join('%.4f' % r for r in ratio_other)} "
              f"(median {statistics.median(ratio_other):.4f}); torch-function modes active at a step start: "
              f"{max(modes)}; step-time estimate (median other-step ratio x (1 - attributed share)) "
              f"{statistics.median(ratio_other) * (1 - share):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
