"""What the benchmark scripts share: timing, GPU warm-up, the header of a result, JSON out, the explosion rule.

Every script runs as ``python benchmarks/<script>.py`` from the repository root;
Python puts the script's folder (``benchmarks/``) first on ``sys.path``, so the
scripts import this module as ``_common`` (no script importing another). Importing
it puts ``examples/`` on ``sys.path`` too: the example model and corpus
(``nanogpt``, ``byte_corpus``) are imported by name. ``instability_watch``
itself comes from the installed package (``pip install -e .``).
"""
from __future__ import annotations

import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(1, str(EXAMPLES))

__all__ = [
    "BWD_GRID", "SMALL_BWD_GRID", "SMALL_FWD_GRID", "DIVERGENCE_JUMP", "ExplosionDetector", "FWD_GRID", "StepTimes", "WIDE_GRID", "bench", "block_cost",
    "command", "device_name", "explosion_step", "header", "init_distributed", "keep", "kernel_resources",
    "print_kernel_resources", "profile_calls", "step_cost", "sweep_launch_configs", "sync", "warm_gpu", "write_json",
]

DIVERGENCE_JUMP = 0.2  # nats: the "divergence" mark of reproduce.py's summary (the explosion rule, smaller jump)


# ---------------------------------------------------------------------------
# launch-config sweeps: the grids tried (tile sizes, warps, pipeline stages[, register cap]) and a sweep of one
# kernel's table entry through any timed call (benchmarks/attention.py on dense calls, varlen_speed.py and
# flex_switch_speed.py on packed and masked ones)


FWD_GRID = [
    (bm, bn, w, st, maxnreg)
    for bm, bn in [(64, 64), (64, 128), (128, 32), (128, 64), (128, 128)]
    for w, st in [(4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4)]
    for maxnreg in (None, 128)
]
BWD_GRID = [
    (bm, bn, w, st)
    for bm, bn in [(32, 64), (32, 128), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128)]
    for w, st in [(4, 2), (4, 3), (8, 2), (8, 3)]
]
# a smaller backward grid for one device call (the packed and switched-flex sweeps: about 5 s of compiling each)
SMALL_BWD_GRID = [
    (bm, bn, w, st)
    for bm, bn in [(32, 128), (64, 64), (64, 128), (128, 64), (128, 128)]
    for w, st in [(4, 2), (8, 2), (8, 3)]
]
# and the forward's, likewise (no register cap: the cap only mattered at D <= 64)
SMALL_FWD_GRID = [
    (bm, bn, w, st, None)
    for bm, bn in [(64, 64), (64, 128), (128, 32), (128, 64), (128, 128)]
    for w, st in [(4, 3), (8, 2), (8, 3)]
]
# D = 256: the tiles above mostly exceed registers or shared memory; narrower ones, fewer stages
WIDE_GRID = [
    (bm, bn, w, st)
    for bm, bn in [(16, 32), (16, 64), (32, 32), (32, 64), (64, 32), (64, 64), (128, 32)]
    for w, st in [(4, 1), (4, 2), (8, 1), (8, 2)]
]


def keep(cfg, head_dim):
    """Drop configurations that cannot fit or that the H100 never favours."""
    bm, bn, w, st = cfg[:4]
    if head_dim >= 256:
        return len(cfg) == 4 or not cfg[4]
    if len(cfg) > 4 and cfg[4] and (head_dim > 64 or w == 8):
        return False  # the register cap only matters where 4 programs of 4 warps can share an SM
    if head_dim >= 128 and bm * bn >= 128 * 128 and st > 2:
        return False  # shared memory: two 128x128 tiles per stage
    if bm == 64 and bn == 64 and w == 8:
        return False  # too little work per warp
    return True


def sweep_launch_configs(kernel: str, head_dim: int, timed, *, dtype: torch.dtype = torch.bfloat16,
                         grid: Optional[Sequence[tuple]] = None, top: int = 5, log=None) -> dict:
    """Time ``timed()`` (milliseconds) as the launch table stands, then with each configuration of ``grid`` in
    the table's entry of ``kernel`` at ``head_dim``'s tile (for ``"fwd"`` the plain and the watched forward's
    entries both: a call runs one of them); the table is restored afterwards. A configuration whose call fails
    (too much shared memory, say) is logged and skipped.

    ``grid`` None: :data:`FWD_GRID` (forward) or :data:`BWD_GRID`, less what :func:`keep` drops. Returns
    ``{"table": [entry, ms], "best": [[config, ms], ...]}``: the table's timing (``entry`` its config, for
    ``"fwd"`` a dict of both entries' configs) and the ``top`` fastest of the grid's, configurations as tuples
    ``(block_m, block_n, num_warps, num_stages, maxnreg)``. At a head-dim tile of 256 the backward runs the Gluon
    kernels or the split dK/dV passes, which this entry does not reach: a ``ValueError`` (sweep those with
    ``benchmarks/attention.py --shapes d256``, which passes overrides)."""
    from instability_watch.kernels import configs

    tile = configs.head_dim_tile(head_dim)
    cls = configs.FLOAT32 if dtype == torch.float32 else configs.TENSOR_CORES
    if (kernel, cls) not in configs.LAUNCH_TABLE or tile not in configs.LAUNCH_TABLE[(kernel, cls)]:
        raise ValueError(f"kernel {kernel!r} has no launch-table entry at head-dim tile {tile} for {dtype}")
    if tile >= 256:
        raise ValueError(f"head-dim tile {tile}: the calls there run the Gluon kernels or the split dK/dV passes, "
                         f"which the table's {kernel!r} entry does not reach; sweep with benchmarks/attention.py "
                         "--shapes d256")
    keys = [(kernel, cls)] + ([("fwd_watched", cls)] if kernel == "fwd" else [])
    saved = {key: configs.LAUNCH_TABLE[key][tile] for key in keys}
    if grid is None:
        grid = [c for c in (FWD_GRID if kernel == "fwd" else BWD_GRID) if keep(c, tile)]

    def as_tuple(cfg):
        return (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.maxnreg)

    entry = {k: list(as_tuple(c)) for (k, _), c in saved.items()} if len(keys) > 1 else list(as_tuple(saved[keys[0]]))
    own = [entry, float(timed())]  # the table as it stands (a failure here is the call's own: raised)
    if log:
        log(f"  {kernel} the table {entry}: {own[1]:.3f} ms")
    timings = []
    try:
        for cfg in map(configs.LaunchConfig.of, grid):
            for key in keys:
                configs.LAUNCH_TABLE[key][tile] = cfg
            try:
                ms = float(timed())
            except Exception as exc:  # noqa: BLE001 - a configuration that does not fit is skipped, said
                if log:
                    log(f"  {kernel} {as_tuple(cfg)}: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            if log:
                log(f"  {kernel} {as_tuple(cfg)}: {ms:.3f} ms")
            timings.append((ms, as_tuple(cfg)))
    finally:
        for key, cfg in saved.items():
            configs.LAUNCH_TABLE[key][tile] = cfg
    best = sorted(timings, key=lambda t: t[0])[:top]
    return {"table": own, "best": [[list(c), ms] for ms, c in best]}


def kernel_resources(*kernels) -> list:
    """Registers, spills, shared memory and warps of every variant of these Triton kernels compiled so far in
    this process, one dict each: ``kernel``, ``constexprs`` (name -> value, the variant's), ``regs``,
    ``spills``, ``shared``, ``num_warps``, ``num_stages``. (A spill in an attention loop costs more than any
    tile choice: this is what a slow variant is checked for first.) Empty under Triton's interpreter."""
    import re

    out = []
    for k in kernels:
        fn = k
        while fn is not None and not hasattr(fn, "device_caches"):
            fn = getattr(fn, "fn", None)
        if fn is None:
            continue
        params = list(fn.params)
        for caches in list(fn.device_caches.values()):
            for key, compiled in list(caches[0].items()):
                try:
                    compiled._init_handles()  # n_regs and n_spills are read when the binary is loaded
                except Exception:  # noqa: BLE001 - a variant that cannot load is reported without them
                    pass
                # the key opens with one (type, value) pair per parameter, in order (a None argument and an int
                # equal to 1 read as ('constexpr', ...) too): pair them with the parameters, keep the constexprs
                pairs = re.findall(r"\('([^']*)', ('[^']*'|[^)]*)\)", str(key))[:len(params)]
                values = {p.name: v for p, (_, v) in zip(params, pairs) if p.is_constexpr}
                meta = getattr(compiled, "metadata", None)
                out.append({
                    "kernel": getattr(fn, "__name__", str(fn)),
                    "constexprs": values if len(pairs) == len(params) else [v for _, v in pairs],
                    "regs": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
                    "shared": getattr(meta, "shared", None), "num_warps": getattr(meta, "num_warps", None),
                    "num_stages": getattr(meta, "num_stages", None),
                })
    return out


def print_kernel_resources(rows: list, keys: Sequence[str] = ("CAUSAL", "MASK_KIND", "WHOLE_TILES", "HEAD_DIM",
                                                              "BLOCK_M", "BLOCK_N", "EVEN_M", "EVEN_N",
                                                              "FUSED_DQ", "PART", "SHADOW", "HAS_STAB",
                                                              "HAS_PROBE", "ORDERED")) -> None:
    """One line per compiled variant (:func:`kernel_resources`), its main constexprs first."""
    for r in rows:
        c = r["constexprs"]
        shown = " ".join(f"{k}={c[k]}" for k in keys if isinstance(c, dict) and k in c) if isinstance(c, dict) \
            else str(c)[:120]
        print(f"resources {r['kernel']}: {shown} warps={r['num_warps']} stages={r['num_stages']} "
              f"regs={r['regs']} spills={r['spills']} shared={r['shared']}")


# ---------------------------------------------------------------------------
# timing


def bench(fn, warmup: float = 25, rep: float = 100) -> float:
    """Median milliseconds of ``fn()`` on the GPU (``triton.testing.do_bench``: L2 flushed before every call).

    ``warmup`` and ``rep`` are the milliseconds do_bench spends warming up and measuring.
    """
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _one_call(fn, grad: Optional[torch.Tensor]):
    """A call of ``fn``, its output back-propagated with ``grad`` where given."""
    def once():
        o = fn()
        if grad is not None:
            o.backward(grad)

    return once


def cuda_ms(fn, iters: int, grad: Optional[torch.Tensor] = None) -> float:
    """Milliseconds per call of ``fn`` on the GPU (CUDA events over ``iters`` calls after 3 warm-up calls); with
    ``grad``, each call's output is back-propagated with it (forward and backward timed together)."""
    return cuda_and_host_ms(fn, iters, grad)[0]


def cuda_and_host_ms(fn, iters: int, grad: Optional[torch.Tensor] = None) -> Tuple[float, float]:
    """:func:`cuda_ms`, and the host's milliseconds per call over the same calls (from the first call's start until
    the last call returned, before the final synchronize): a host time near the GPU time says the calls are bound
    by the host's launches, not by the kernels."""
    once = _one_call(fn, grad)
    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        once()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, host


_CYCLES_PER_MS: Optional[float] = None


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond on this device (measured once)."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS = 20_000_000 / start.elapsed_time(end)
    return _CYCLES_PER_MS


def cuda_ahead_ms(fn, iters: int, grad: Optional[torch.Tensor] = None) -> float:
    """Milliseconds per call of ``fn`` on the GPU with the host ahead: the GPU is held (``torch.cuda._sleep``) while
    the host launches all ``iters`` calls, so the time is the kernels' own, with no GPU idle waiting for a launch
    (what a call costs inside a model whose host runs ahead of its GPU). :func:`cuda_ms` times the calls as called:
    where the host's launches take longer than the kernels, that time is the host's."""
    once = _one_call(fn, grad)
    for _ in range(3):
        once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        once()
    host_ms = (time.perf_counter() - t0) * 1e3 / 3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(_sleep_cycles_per_ms() * (2 * host_ms * iters + 5)))
    start.record()
    for _ in range(iters):
        once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def profile_calls(fn, grad, folder: str, title: str, calls: int = 5) -> None:
    """Kernel table of ``calls`` forward + backward calls of ``fn`` (CUDA time, largest first) to
    ``folder/profile_<title>.txt`` (the title's characters other than letters, digits and ``_.-`` made ``_``); the
    busiest kernels and the GPU-busy time printed."""
    import os
    import re
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "profile_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", title) + ".txt")
    for _ in range(2):
        fn().backward(grad)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn().backward(grad)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / calls
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    gpu = sum(e.self_device_time_total for e in events) / 1e3 / calls
    with open(path, "w") as f:
        f.write(f"{title}: {calls} forward + backward calls, wall {wall:.3f} ms a call, GPU busy {gpu:.3f} ms\n")
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
    top = ", ".join(f"{e.key[:40]} {e.self_device_time_total / 1e3 / calls:.3f}" for e in events[:4])
    print(f"profile {title}: wall {wall:.3f} ms, GPU busy {gpu:.3f} ms a call; top: {top}")


def sync(device: Union[str, torch.device]) -> None:
    """Wait for the device's queued work (a no-op on CPU), so host clocks measure finished work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def synced_clock() -> float:
    """``time.perf_counter()`` after the current CUDA device's queued work finished (CPU: at once)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class StepTimes:
    """Each training step's duration, from a mark at every step's start: the watch's cost step by step.

    ``mark(step)`` at the start of optimizer step ``step`` (counting from 1, as the watch does) records a
    CUDA event on the current stream (host stalls show as gaps between events), or the host clock without
    CUDA; steps ``skip + 1`` to ``stop`` are marked. The steps between the watch's probe and read-back
    steps (``config``'s cadence) run exactly the unwatched code, so :meth:`summary` gives

    * ``other_ms``: the median duration of the steps that are neither probe, spectral nor read-back steps
      of ``config`` (the same steps in an unwatched fit, so the two medians compare like with like);
    * with ``watched``: ``share``, what the probe, spectral and read-back steps took beyond ``other_ms``
      over the time of all the steps; ``probe_extra_ms`` (median) and ``read_back_extra_ms`` (each).

    A watched fit's cost estimate is then ``other_ms(unwatched) / other_ms(watched) * (1 - share)``.
    """

    def __init__(self, skip: int, stop: int, config) -> None:
        from instability_watch.engine.cadence import Cadence

        self.skip, self.stop, self.cadence = skip, stop, Cadence(config)
        self.cuda = torch.cuda.is_available()
        self.marks = []  # (step about to run, CUDA event or perf_counter seconds)

    def mark(self, step: int) -> None:
        if not self.skip < step <= self.stop:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((step, ev))
        else:
            self.marks.append((step, time.perf_counter()))

    def durations(self) -> list:
        """``[(step, milliseconds)]`` for each marked step followed by a mark (waits for the device)."""
        if self.cuda:
            torch.cuda.synchronize()
            ms = lambda a, b: a.elapsed_time(b)  # noqa: E731
        else:
            ms = lambda a, b: 1e3 * (b - a)  # noqa: E731
        return [(s, ms(a, b)) for (s, a), (_, b) in zip(self.marks, self.marks[1:])]

    def summary(self, watched: bool) -> dict:
        steps = self.durations()
        c = self.cadence
        special = {s for s, _ in steps if c.recorded(s) or c.read_back(s)}
        other = [ms for s, ms in steps if s not in special]
        if not other:
            return {"other_ms": None, "steps": len(steps)}
        base = statistics.median(other)
        out = {"other_ms": base, "steps": len(steps), "other_steps": len(other)}
        if watched:
            probe = [ms - base for s, ms in steps if c.recorded(s)]
            out.update(
                share=sum(ms - base for s, ms in steps if s in special) / sum(ms for _, ms in steps),
                probe_extra_ms=statistics.median(probe) if probe else None,
                read_back_extra_ms=[round(ms - base, 3) for s, ms in steps if c.read_back(s) and not c.recorded(s)])
        return out


def step_cost(rounds: Sequence[dict]) -> dict:
    """The watch's cost over rounds of a watched and an unwatched fit, each round a dict with ``watched`` and
    ``unwatched`` steps/s and ``watched_steps`` / ``unwatched_steps`` (:meth:`StepTimes.summary`): the
    whole-fit ratio and the step-time estimate, each as the median with its range."""
    def spread(xs):
        xs = [x for x in xs if x is not None]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None

    fit = [r["watched"] / r["unwatched"] for r in rounds if r.get("watched") and r.get("unwatched")]
    other, share = [], []
    for r in rounds:
        w, u = r.get("watched_steps") or {}, r.get("unwatched_steps") or {}
        if w.get("other_ms") and u.get("other_ms"):
            other.append(u["other_ms"] / w["other_ms"])
        if w.get("share") is not None:
            share.append(w["share"])
    out = {"fit_ratio": spread(fit), "other_step_ratio": spread(other), "share": spread(share)}
    if other and share:
        out["estimate"] = statistics.median(other) * (1 - statistics.median(share))
    return out


def block_cost(steps: Sequence[Tuple[int, float]], size: int, config) -> dict:
    """The watch's cost from one fit run in blocks of ``size`` steps: block 0 unwatched (a warm-up, left out),
    then watched and unwatched blocks in turn (blocks 1, 3, ... watched: a watch attached at the block's first
    step, detached after its last), so the two kinds of step share one process, one fit and its drift.

    ``steps``: ``[(step, ms)]`` (:meth:`StepTimes.durations`, steps counted from 1). Within a block, position
    ``p`` (1..size) is the watch's own step ``p``, so its cadence (``config``) says which are probe, spectral
    and read-back steps. The first step of each block is left out (the attach); the probe a watch makes there
    is counted at the median probe cost. Per pair of a watched block and the unwatched block after it:
    ``other_ratio``, the unwatched/watched median duration of the other steps (the same positions in both),
    ``share``, the watched block's probe and read-back steps beyond its median other step over its time, and
    ``estimate`` = other_ratio x (1 - share). Medians over the pairs, with their ranges.
    """
    from instability_watch.engine.cadence import Cadence

    c = Cadence(config)
    blocks: dict = {}
    for s, ms in steps:
        b, pos = (s - 1) // size, (s - 1) % size + 1
        if b > 0 and pos > 1:
            blocks.setdefault(b, {})[pos] = ms
    special = lambda pos: c.recorded(pos) or c.read_back(pos)  # noqa: E731
    pairs = []
    for w in sorted(b for b in blocks if b % 2 == 1):
        u = w + 1
        if u not in blocks:
            continue
        common = [p for p in blocks[w] if p in blocks[u] and not special(p)]
        if not common:
            continue
        w_other = statistics.median(blocks[w][p] for p in common)
        u_other = statistics.median(blocks[u][p] for p in common)
        probes = [ms - w_other for p, ms in blocks[w].items() if c.recorded(p)]
        probe = statistics.median(probes) if probes else 0.0
        first = probe if c.recorded(1) else 0.0  # the attach step's probe, at the median probe cost
        extra = sum(ms - w_other for p, ms in blocks[w].items() if special(p)) + first
        total = sum(blocks[w].values()) + w_other + first
        share = extra / total
        pairs.append({"watched_block": w, "other_ratio": u_other / w_other, "share": share,
                      "estimate": u_other / w_other * (1 - share), "watched_other_ms": w_other,
                      "unwatched_other_ms": u_other, "probe_extra_ms": probe, "other_steps": len(common)})

    def spread(key):
        xs = [p[key] for p in pairs]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None

    return {"size": size, "pairs": pairs, "other_ratio": spread("other_ratio"), "share": spread("share"),
            "estimate": spread("estimate")}


def init_distributed() -> Tuple[int, int, torch.device]:
    """A process group for a script launched by ``torchrun`` (NCCL on GPUs, gloo on CPU): ``(rank, world size,
    this rank's device)``, the CUDA device made current."""
    import os

    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def warm_gpu(seconds: float = 1.0) -> None:
    """Bring the clocks up before the first measurement (an idle H100 sits at a few hundred MHz).

    Multiplies two 8192 x 8192 BF16 matrices on the current CUDA device for ``seconds``.
    """
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


# ---------------------------------------------------------------------------
# what a result says about where it was measured


def device_name(device: Union[str, torch.device, None] = None) -> str:
    """The GPU's name for a CUDA device (the current one if ``None`` and CUDA is up), else "cpu"."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def command(argv: Optional[Sequence[str]] = None) -> str:
    """The command line that produced a result: ``python <script> <args>`` (``argv``: the args a ``main(argv)`` got)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", sys.argv[0], *args])


def header(argv: Optional[Sequence[str]] = None, device: Union[str, torch.device, None] = None) -> dict:
    """The first keys of every result: device, date, python, torch, triton (``None`` if absent) and command."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_name(device),
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "command": command(argv),
    }


def write_json(path: Union[str, Path], obj, indent: int = 1) -> Path:
    """Write ``obj`` as JSON (objects JSON cannot hold as their ``str``) and return the path."""
    path = Path(path)
    path.write_text(json.dumps(obj, indent=indent, default=str) + "\n")
    return path


# ---------------------------------------------------------------------------
# the explosion rule (reproduce.py's runs and their comparisons)


class ExplosionDetector:
    """A run explodes at the first step where the EMA of its loss rises ``jump`` nats above the
    lowest EMA seen so far, or where the loss is not finite. Fed one loss at a time; steps up to
    ``start`` only feed the EMA (the first steps' fast descent and the warm-up set no minimum)."""

    def __init__(self, ema: float, jump: float, start: int = 0) -> None:
        self.alpha, self.jump, self.start = ema, jump, start
        self.value: Optional[float] = None
        self.low = math.inf
        self.step: Optional[int] = None

    def update(self, step: int, loss: float) -> Optional[int]:
        """Feed the loss of ``step``; returns the explosion step once there is one, else ``None``."""
        if self.step is None:
            if not math.isfinite(loss):
                self.step = step
            else:
                self.value = loss if self.value is None else (1 - self.alpha) * self.value + self.alpha * loss
                if step > self.start:
                    if self.value > self.low + self.jump:
                        self.step = step
                    self.low = min(self.low, self.value)
        return self.step

    def state_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "step": self.step}

    def load_state_dict(self, s: dict) -> None:
        self.value, self.low, self.step = s["value"], s["low"], s["step"]


def explosion_step(losses: Iterable[Tuple[int, float]], ema: float = 0.05, jump: float = 1.0,
                   start: int = 0) -> Optional[int]:
    """The explosion step of a loss series ``[(step, loss), ...]``, ``None`` if none (:class:`ExplosionDetector`)."""
    det = ExplosionDetector(ema, jump, start)
    for step, loss in losses:
        if det.update(int(step), float(loss)) is not None:
            return det.step
    return None
