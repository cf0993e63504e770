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
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(1, str(EXAMPLES))

__all__ = [
    "DIVERGENCE_JUMP", "ExplosionDetector", "bench", "command", "device_name", "explosion_step", "header",
    "profile_calls", "sync",
    "warm_gpu", "write_json",
]

DIVERGENCE_JUMP = 0.2  # nats: the "divergence" mark of reproduce.py's summary (the explosion rule, smaller jump)


# ---------------------------------------------------------------------------
# timing


def bench(fn, warmup: float = 25, rep: float = 100) -> float:
    """Median milliseconds of ``fn()`` on the GPU (``triton.testing.do_bench``: L2 flushed before every call).

    ``warmup`` and ``rep`` are the milliseconds do_bench spends warming up and measuring.
    """
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def cuda_ms(fn, iters: int, grad: Optional[torch.Tensor] = None) -> float:
    """Milliseconds per call of ``fn`` on the GPU (CUDA events over ``iters`` calls after 3 warm-up calls); with
    ``grad``, each call's output is back-propagated with it (forward and backward timed together)."""
    def once():
        o = fn()
        if grad is not None:
            o.backward(grad)

    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
