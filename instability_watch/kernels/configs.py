"""The kernels' launch configurations: one table, one lookup.

Every Triton kernel launch takes its tile sizes and launch options from
:func:`launch_config`: ``(kernel, head-dim tile, dtype, watched, override) ->``
:class:`LaunchConfig`. A fixed table rather than ``triton.autotune``: tuning at run
time would run the probe's atomics several times and stall the first training step.
The values were measured on an H100; the comments say where each came from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from instability_watch.kernels.launch import INTERPRET

# The kernels pad the head dim D to one of these tiles (a power of two of at least 16).
HEAD_DIM_TILES = (16, 32, 64, 128, 256)
KERNELS = ("fwd", "fwd_mask", "dkdv", "dkdv_docs", "dkdv_mask", "dk", "dv", "dq", "dq_mask", "fused", "stats", "shadow")


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch options of one kernel launch.

    ``block_m`` query rows and ``block_n`` keys per tile (both >= 16: ``tl.dot``'s
    minimum), Triton's ``num_warps`` and ``num_stages``, and ``maxnreg`` (a cap on
    registers per thread, or None for none; ignored in Triton's interpreter).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: Optional[int] = None

    @classmethod
    def of(cls, value: Union["LaunchConfig", Sequence[int]]) -> "LaunchConfig":
        """``value`` itself, or a tuple ``(block_m, block_n, num_warps, num_stages[, maxnreg])`` as a LaunchConfig."""
        if isinstance(value, LaunchConfig):
            return value
        return cls(*value)

    def options(self) -> Dict[str, int]:
        """The launch options for ``fn[grid](..., **options)``: num_warps, num_stages, and maxnreg if set."""
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg and not INTERPRET:
            options["maxnreg"] = self.maxnreg
        return options


def _every_tile(config: LaunchConfig) -> Dict[int, LaunchConfig]:
    return dict.fromkeys(HEAD_DIM_TILES, config)


_C = LaunchConfig
TENSOR_CORES = "bf16/fp16"  # inputs that tl.dot takes on tensor cores
FLOAT32 = "float32"  # exact float32 products ("ieee"), no tensor cores

# Launch configurations per (kernel, inputs) and head-dim tile.
#
# Attention (attention/triton*.py): chosen with `python benchmarks/attention.py --sweep` on an
# H100 (see benchmarks/RESULTS.md). The forward's maxnreg caps registers: at D <= 64 the plain
# loop needs 128 and the tie-tracking loop ~150, which would drop an SM from 4 resident
# programs to 3. The forward with a stabilize mask or a probe (what the watch runs, "watched")
# has its own entries: at D = 128 it is fastest with larger tiles than the plain forward.
# D = 256: (128, 64, 8, 2) since a lab run of 2026-11-24 (H100; benchmarks/RESULTS.md, "D = 256, 8th session"):
# 0.62 ms against 0.80 for the (64, 32, 4, 2) an earlier sweep had picked (B4 H8 N4096 causal).
_FWD = {16: _C(64, 64, 4, 3, maxnreg=128), 32: _C(64, 64, 4, 3, maxnreg=128), 64: _C(64, 64, 4, 3, maxnreg=128),
        128: _C(128, 64, 8, 3), 256: _C(128, 64, 8, 2)}
LAUNCH_TABLE: Dict[Tuple[str, str], Dict[int, LaunchConfig]] = {
    ("fwd", TENSOR_CORES): _FWD,
    ("fwd_watched", TENSOR_CORES): {**_FWD, 128: _C(128, 128, 8, 2)},
    # The forward of a call with a boolean mask, watched or not (switched flex calls): `benchmarks/flex_switch_speed.py
    # --sweep fwd` on an H200 (2026-11-29, the kernels' two loops; the forward alone, host ahead): (128, 64, 8, 3)
    # the fastest on causal, sliding and document masks, 0.696, 0.419, 0.391 ms against 0.753, 0.446, 0.442 for the
    # watched forward's (128, 128, 8, 2).
    ("fwd_mask", TENSOR_CORES): {128: _C(128, 64, 8, 3)},
    # D = 256 backward: `benchmarks/attention.py --shapes d256 --sweep dkdv --sweep dq` (H100, 2026-11-24):
    # dK/dV (64, 64, 8, 2) and dQ (64, 64, 4, 2) were the fastest of 28 each.
    ("dkdv", TENSOR_CORES): {16: _C(64, 64, 4, 3), 32: _C(64, 64, 4, 3), 64: _C(64, 64, 4, 3), 128: _C(64, 128, 8, 3),
                             256: _C(64, 64, 8, 2)},
    # dK/dV over a packed call's documents (MASK_DOCS; other tiles take "dkdv"): `benchmarks/varlen_speed.py
    # --sweep dkdv` on an H200 (2026-11-28, 10 documents in 16,384 tokens, H 16/4, causal): (32, 128, 8, 3) the
    # fastest in two sweeps, 2.310 ms a forward + backward against 2.452 for the dense calls' (64, 128, 8, 3).
    ("dkdv_docs", TENSOR_CORES): {128: _C(32, 128, 8, 3)},
    # dK/dV of a call with a boolean mask (switched flex calls): `benchmarks/flex_switch_speed.py --sweep dkdv` on an
    # H200 (2026-11-28, the kernels' own time): (64, 128, 8, 2) 1.807 ms sliding, 1.708 documents a forward +
    # backward against 1.890, 1.759 for the dense calls' (64, 128, 8, 3).
    ("dkdv_mask", TENSOR_CORES): {128: _C(64, 128, 8, 2)},
    # The dK/dV kernel in two passes (dK, then dV; by default the backward splits wherever both have
    # an entry): at D = 256 its two (BLOCK_N, 256) float32 accumulators fill the registers, so the
    # fused pass is stuck at 64 keys per program; alone, each pass fits 128 (the same lab run,
    # benchmarks/RESULTS.md).
    ("dk", TENSOR_CORES): {256: _C(32, 128, 8, 2)},
    ("dv", TENSOR_CORES): {256: _C(64, 128, 8, 2)},
    # dQ of a call with a boolean mask: `benchmarks/flex_switch_speed.py --sweep dq` on an H200 (2026-11-29, the
    # kernels' own time): (64, 64, 4, 2) the fastest on causal, sliding and document masks (1.809 ms sliding, 1.686
    # documents a forward + backward against 1.865, 1.742 for the dense calls' (128, 64, 8, 3)).
    ("dq_mask", TENSOR_CORES): {128: _C(64, 64, 4, 2)},
    ("dq", TENSOR_CORES): {16: _C(64, 64, 4, 3), 32: _C(64, 64, 4, 3), 64: _C(64, 64, 4, 3), 128: _C(128, 64, 8, 3),
                           256: _C(64, 64, 4, 2)},
    # The fused backward (one kernel, dQ by atomics; by default only for calls with dropout at
    # D <= 128): `benchmarks/attention.py --sweep fused` (H100, 2026-11-24), the fastest of 28 each
    # at GPT-2 small with dropout 0.1 (D = 64), Llama (D = 128) and D = 256 without dropout.
    ("fused", TENSOR_CORES): {16: _C(64, 64, 4, 2), 32: _C(64, 64, 4, 2), 64: _C(64, 64, 4, 2), 128: _C(64, 128, 8, 2),
                              256: _C(32, 32, 4, 2)},
    # float32 inputs: tiles twice the bytes, and tl.dot without tensor cores ("ieee"); the
    # tables above would ask for more shared memory than an SM has at D = 128.
    ("fwd", FLOAT32): _every_tile(_C(64, 32, 4, 2)),
    ("fwd_watched", FLOAT32): _every_tile(_C(64, 32, 4, 2)),
    ("dkdv", FLOAT32): _every_tile(_C(32, 64, 4, 2)),
    ("dq", FLOAT32): _every_tile(_C(64, 32, 4, 2)),
    ("fused", FLOAT32): _every_tile(_C(32, 64, 4, 2)),
    # The observer's passes (triton_stats.py), per head-dim tile (shadow: the larger of D's and
    # D_v's; statistics: D's). Picked from a small sweep on one H100, 2026-11-24 (torch 2.11,
    # triton 3.6; bf16, causal; triton.testing.do_bench per call against PyTorch's flash forward
    # on the same inputs):
    #   GPT-2  B16 H12 N1024 D64:         flash 135 us, statistics  79 us, shadow 136 us
    #   Llama  B4 H32/4 N2048 D128 (GQA): flash 479 us, statistics 204 us, shadow 492 us
    #   Gemma  B4 H8/4 N2048 D256:        flash 286 us, statistics 127 us, shadow 318 us
    # To be tuned further on the GPU (other shapes, fp16, masks; float32 not measured).
    # - statistics: no P V and no exponentials; the per-lane top two are two (BLOCK_M, BLOCK_N)
    #   float32 tiles (32 registers each at 64 x 64 with 4 warps). 64 x 64 with 4 warps beat
    #   128 x 64 with 8 (+40% time) and 128 x 128 at every head dim tried.
    # - shadow: the forward's work (two dots per block, one exp per score) with Q and dO in
    #   registers; narrow KV blocks (32) were fastest at every head dim tried.
    ("stats", TENSOR_CORES): {16: _C(64, 64, 4, 3), 32: _C(64, 64, 4, 3), 64: _C(64, 64, 4, 3), 128: _C(64, 64, 4, 3),
                              256: _C(64, 64, 4, 2)},
    ("shadow", TENSOR_CORES): {16: _C(64, 32, 4, 3), 32: _C(64, 32, 4, 3), 64: _C(64, 32, 4, 3),
                               128: _C(128, 32, 8, 3), 256: _C(128, 32, 8, 2)},
    # float32 inputs: twice the bytes per tile and no tensor cores ("ieee" dots); not tuned
    ("stats", FLOAT32): {**_every_tile(_C(64, 32, 4, 2)), 256: _C(32, 32, 4, 2)},
    ("shadow", FLOAT32): {**_every_tile(_C(64, 32, 4, 2)), 256: _C(32, 32, 4, 2)},
}
# Triton's interpreter runs one program at a time on CPU: small tiles, odd sizes covered.
INTERPRETER_CONFIG = LaunchConfig(16, 16, 4, 1)


def head_dim_tile(d: int) -> int:
    """The head-dim tile a head dim ``d`` (1 to 256) is padded to: a power of two, at least 16."""
    return max(16, 1 << (d - 1).bit_length())


def has_launch_config(kernel: str, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the table has an entry for ``kernel`` at this head-dim tile and dtype (the split
    backward's ``"dk"``/``"dv"`` passes exist only where they were measured faster)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    table = LAUNCH_TABLE.get((kernel, FLOAT32 if dtype == torch.float32 else TENSOR_CORES), {})
    return head_dim in table


def launch_config(
    kernel: str, head_dim: int, dtype: torch.dtype, *, watched: bool = False,
    override: Union[None, LaunchConfig, Sequence[int]] = None,
) -> LaunchConfig:
    """The launch configuration of one kernel launch.

    Args:
        kernel: one of :data:`KERNELS`: ``"fwd"`` (with a boolean mask ``"fwd_mask"``, watched or not, where the
            table has it), ``"dkdv"`` (or its passes ``"dk"``, ``"dv"``; over a packed
            call's documents ``"dkdv_docs"``, with a boolean mask ``"dkdv_mask"``, where the table has them),
            ``"dq"`` (with a boolean mask ``"dq_mask"``, where the table has it),
            ``"fused"`` (attention),
            ``"stats"``, ``"shadow"`` (the observer's passes).
        head_dim: the head-dim tile (:func:`head_dim_tile`), one of :data:`HEAD_DIM_TILES`.
        dtype: the inputs' dtype (bfloat16, float16 or float32).
        watched: a forward with a stabilize mask or a probe (its own entries).
        override: a LaunchConfig or a tuple ``(block_m, block_n, num_warps, num_stages[, maxnreg])``
            taken as it is (the benchmarks' sweeps); None: the table's entry.

    In Triton's interpreter (CPU) every launch takes :data:`INTERPRETER_CONFIG`.
    """
    if override is not None:
        return LaunchConfig.of(override)
    if INTERPRET:
        return INTERPRETER_CONFIG
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "fwd" and watched:
        kernel = "fwd_watched"
    return LAUNCH_TABLE[(kernel, FLOAT32 if dtype == torch.float32 else TENSOR_CORES)][head_dim]
