"""Statistics of a FlexAttention call: the definitions of :mod:`instability_watch.kernels.stats`, on the call's own
scores.

A call of ``torch.nn.attention.flex_attention.flex_attention`` reaches the watch as PyTorch's ``flex_attention``
higher-order op, ``(q, k, v, score_mod, block_mask, scale, kernel_options, *other_buffers)``, eager or compiled.
Its scores are ``score_mod(scale * q.k, b, h, q_idx, kv_idx)``; a key is masked for a row where the block mask's
``mask_mod(b, h, q_idx, kv_idx)`` is False (as FlexAttention's own reference computes it). The statistics are
taken on those scores: a document of a packed batch (a document ``mask_mod``) is its own set of rows and keys, a
row never ties with, or sees, another document's keys, and a ``score_mod`` (soft-capping, ALiBi, relative biases)
is applied before the maximum is taken.

Two ways, the same definitions:

* **the op itself** (CUDA): one call with the op's row maximum (``OUTPUT_MAX``) gives ``t1``; a second one, whose
  score_mod keeps only the scores ``>= t1 - eps`` (at 0, the others at ``-inf``), gives through its log-sum-exp
  the number of keys tied at the maximum. Two FlexAttention forwards, compiled with the user's where the user's
  call is compiled, nothing of ``(N, N_kv)`` size in memory;
* **dense** (elsewhere: on the CPU the compiled op gives no log-sum-exp): the scores of a chunk of query rows,
  ``score_mod`` and ``mask_mod`` applied elementwise through ``torch.vmap``, as FlexAttention's reference does,
  then the SDPA statistics' reduction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from instability_watch.kernels.common import compute_dtype
from instability_watch.kernels.stats.reference import (CHUNK_ELEMENTS, accumulate_rows, heads_problem, row_top_two,
                                                       store_rows)
from instability_watch.probe.fields import COUNT_ROW as _C
from instability_watch.probe.fields import VALUE_ROW as _V

try:  # PyTorch >= 2.5
    from torch._higher_order_ops.flex_attention import flex_attention as FLEX_OP
except ImportError:  # pragma: no cover - an older PyTorch has no FlexAttention
    FLEX_OP = None
try:  # the op returns its row maximum (out, lse, max) where FlexAttention offers max_scores (PyTorch >= 2.9)
    import inspect

    from torch.nn.attention.flex_attention import AuxRequest

    OP_RETURNS_MAX = "max_scores" in inspect.signature(AuxRequest).parameters
except (ImportError, TypeError, ValueError):  # pragma: no cover
    OP_RETURNS_MAX = False

_LN2 = math.log(2.0)


@dataclass
class FlexCall:
    """One call of the ``flex_attention`` op, its arguments however they were passed."""

    q: Tensor
    k: Tensor
    v: Tensor
    score_mod: Callable
    block_mask: tuple  # BlockMask.as_tuple(): ..., its mask_mod last
    scale: float
    kernel_options: dict
    rest: tuple  # the op's other buffers (score_mod's, then mask_mod's), where the caller passed them

    @classmethod
    def parse(cls, args, kwargs) -> "FlexCall":
        """The call's arguments (``TypeError`` for a call the op itself would refuse)."""
        names = ("query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options")
        vals = list(args[:7]) + [kwargs[n] for n in names[len(args[:7]):] if n in kwargs]
        if len(vals) != 7:
            raise TypeError("flex_attention op: expected 7 leading arguments")
        rest = tuple(args[7:]) + tuple(kwargs[n] for n in ("score_mod_other_buffers", "mask_mod_other_buffers")
                                       if n in kwargs)
        return cls(*vals, rest=rest)

    @property
    def mask_mod(self) -> Callable:
        """The block mask's ``mask_mod(b, h, q_idx, kv_idx)`` (True: the key is seen)."""
        return self.block_mask[-1]

    def buffers(self) -> Tuple[tuple, tuple]:
        """``(score_mod's, mask_mod's)`` other buffers (empty where the functions close over their tensors)."""
        rest = self.rest
        return (tuple(rest[0]) if len(rest) > 0 else ()), (tuple(rest[1]) if len(rest) > 1 else ())

    def unobservable(self, num_heads: int) -> Optional[str]:
        """Why the statistics cannot read this call (``None`` if they can)."""
        q, k = self.q, self.k
        if not all(isinstance(t, Tensor) for t in (q, k, self.v)):
            return "inputs are not tensors"
        if q.dim() != 4 or k.dim() != 4:
            return f"inputs not 4-D (B, H, N, D): q {tuple(q.shape)}"
        why = heads_problem(q, k, num_heads)
        if why is not None:
            return why
        if k.shape[0] not in (1, q.shape[0]):
            return f"key batch {k.shape[0]} against query batch {q.shape[0]}"
        if not callable(self.score_mod) or not callable(self.mask_mod):
            return "score_mod or mask_mod is not callable"
        return None


def _bhqkv(fn: Callable, with_score: bool, n_buffers: int) -> Callable:
    """``fn(score?, b, h, q_idx, kv_idx, *buffers)`` made to take index vectors and return the full grid."""
    lead = 1 if with_score else 0
    # innermost first: kv, then q, h, b; a score argument is mapped along with each
    for axis in (3, 2, 1, 0):
        dims = [0] * lead + [None, None, None, None] + [None] * n_buffers
        dims[lead + axis] = 0
        fn = torch.vmap(fn, in_dims=tuple(dims), out_dims=0)
    return fn


def _block_parts(call: FlexCall, n_kv: int) -> Tuple[Tensor, Optional[Tensor], int, int]:
    """The block mask's own blocks, ``(partial, full, Q_BLOCK, KV_BLOCK)``: boolean ``(B_m, H_m, n_q_blocks,
    n_kv_blocks)``, a block where ``mask_mod`` decides (listed in ``kv_indices``), and one seen whole without it
    (``full_kv_indices``; None where the mask has none). A block in neither is not seen at all, whatever
    ``mask_mod`` says: a BlockMask built from blocks (``BlockMask.from_kv_blocks``) may say more than its
    ``mask_mod``. The tuple is ``(*seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    ..., Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod)`` (its middle differs between PyTorch versions)."""
    t = call.block_mask
    i = next(j for j, x in enumerate(t) if isinstance(x, Tensor))
    q_block, kv_block = int(t[-3]), int(t[-2])
    n_kv_blocks = -(-n_kv // kv_block)

    def listed(num: Optional[Tensor], idx: Optional[Tensor]) -> Optional[Tensor]:
        if not isinstance(num, Tensor) or not isinstance(idx, Tensor):
            return None
        width = max(n_kv_blocks, idx.shape[-1])
        valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        at = torch.where(valid, idx.long(), width)  # the entries past the count: a dump column, cut below
        out = torch.zeros(*idx.shape[:-1], width + 1, dtype=torch.bool, device=idx.device)
        return out.scatter_(-1, at, True)[..., :n_kv_blocks]

    return listed(t[i], t[i + 1]), listed(t[i + 2], t[i + 3]), q_block, kv_block


def _with_blocks(keep: Tensor, parts, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``keep`` (mask_mod's, for rows ``q_idx`` and keys ``kv_idx``) as FlexAttention applies it: in the listed
    blocks only, and every key of a full block."""
    partial, full, q_block, kv_block = parts
    qb, kb = q_idx // q_block, kv_idx // kv_block

    def at(blocks: Tensor) -> Tensor:
        return blocks.index_select(2, qb).index_select(3, kb)

    keep = keep & at(partial)
    return keep | at(full) if full is not None else keep


def _dense(call: FlexCall, o: Optional[Tensor], counts: Tensor, values: Tensor, eps: float) -> None:
    q, k = call.q, call.k
    B, H, N, D = q.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    g = H // h_kv
    cdt = compute_dtype(q.dtype)
    kf = k.to(cdt).expand(B, *k.shape[1:])
    s_buf, m_buf = call.buffers()
    score_fn = _bhqkv(call.score_mod, True, len(s_buf))
    mask_fn = _bhqkv(call.mask_mod, False, len(m_buf))
    dev = q.device
    b_idx, h_idx, kv_idx = (torch.arange(n, device=dev) for n in (B, H, n_kv))
    parts = _block_parts(call, n_kv)
    acc = torch.zeros(4, H, dtype=torch.int64, device=dev)
    top = torch.full((H,), float("-inf"), dtype=cdt, device=dev)
    step = max(1, min(N, CHUNK_ELEMENTS // max(1, B * H * n_kv)))
    for i0 in range(0, N, step):
        i1 = min(N, i0 + step)
        n = i1 - i0
        s = (q[:, :, i0:i1].to(cdt).reshape(B, h_kv, g, n, D) @ kf.unsqueeze(2).transpose(-1, -2))
        s = s.reshape(B, H, n, n_kv) * call.scale
        q_idx = torch.arange(i0, i1, device=dev)
        s = score_fn(s, b_idx, h_idx, q_idx, kv_idx, *s_buf).to(cdt)
        keep = _with_blocks(mask_fn(b_idx, h_idx, q_idx, kv_idx, *m_buf).to(torch.bool), parts, q_idx, kv_idx)
        s = torch.where(keep, s, float("-inf"))
        t1, t2, nan = row_top_two(s)
        top = accumulate_rows(t1, t2 >= t1 - eps, nan, None if o is None else o[:, :, i0:i1], acc, top)
    store_rows(acc, top, counts, values)


def _through_the_op(call: FlexCall, o: Optional[Tensor], counts: Tensor, values: Tensor, eps: float) -> None:
    q, k, v = call.q, call.k, call.v
    H = q.shape[1]
    user = call.score_mod
    opts = dict(call.kernel_options or {})
    opts.update(OUTPUT_LOGSUMEXP=True, OUTPUT_MAX=True)
    _, _, m2 = FLEX_OP(q, k, v, user, call.block_mask, call.scale, opts, *call.rest)
    t1 = m2.float() * _LN2  # the op's row maximum is in log2 units; -inf for a row without keys
    thr = torch.where(torch.isfinite(t1), t1 - eps, float("inf"))

    def tied(score, b, h, q_idx, kv_idx, *buffers):
        return torch.where(user(score, b, h, q_idx, kv_idx, *buffers) >= thr[b, h, q_idx], 0.0, float("-inf"))

    opts2 = dict(opts)
    opts2["OUTPUT_MAX"] = False
    _, lse2, _ = FLEX_OP(q, k, v, tied, call.block_mask, call.scale, opts2, *call.rest)
    multi = lse2.float() > 1.0 - 1e-3  # log2 of the number of keys tied at the maximum: >= 1 for two or more
    acc = torch.zeros(4, H, dtype=torch.int64, device=q.device)
    top = torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)
    top = accumulate_rows(t1, multi, torch.isnan(t1), o, acc, top)
    store_rows(acc, top, counts, values)


@torch.no_grad()
def flex_shadow_forward(call: FlexCall) -> Tuple[Tensor, Tensor]:
    """``(o_hp, live)`` for the shadow pass: the call again in float32 (FlexAttention's own op, ``P`` never
    rounded: ``O_hp``), and the rows that see a key (B, H, N)."""
    opts = dict(call.kernel_options or {})
    opts.update(OUTPUT_LOGSUMEXP=True, OUTPUT_MAX=False)
    q, k, v = (t.to(compute_dtype(call.q.dtype)) for t in (call.q, call.k, call.v))
    with torch.autocast(q.device.type, enabled=False):
        o_hp, lse, _ = FLEX_OP(q, k, v, call.score_mod, call.block_mask, call.scale, opts, *call.rest)
    return o_hp, ~torch.isneginf(lse)


@torch.no_grad()
def flex_shadow(o: Tensor, o_hp: Tensor, live: Tensor, do: Tensor, counts: Tensor, values: Tensor) -> None:
    """The shadow pass of a FlexAttention call: ``delta_lp = rowsum(dO * O)`` from the call's output,
    ``delta_hp = rowsum(dO * O_hp)``, their differences over the rows that see a key added into
    ``counts`` and ``values`` (the definitions of :mod:`instability_watch.kernels.stats`)."""
    cdt = o_hp.dtype
    dof = do.to(cdt)
    err = torch.where(live, (dof * o.to(cdt)).sum(dim=-1) - (dof * o_hp).sum(dim=-1), 0.0)
    counts[_C["shadow_rows"]] += live.sum(dim=(0, 2))
    counts[_C["delta_err_pos"]] += (err > 0).sum(dim=(0, 2))
    values[_V["delta_err_sum"]] += err.sum(dim=(0, 2)).to(values.dtype)
    values[_V["delta_err_abs"]] += err.abs().sum(dim=(0, 2)).to(values.dtype)


@torch.no_grad()
def flex_stats(call: FlexCall, o: Optional[Tensor], counts: Tensor, values: Tensor, *, eps: float,
               through_op: Optional[bool] = None) -> None:
    """The statistics pass over one FlexAttention call (module docstring); adds into ``counts`` and ``values``.

    ``o``: the call's output (rows with NaN/Inf count as non-finite) or None. ``through_op``: take the statistics
    with two FlexAttention calls (default on CUDA) or densely (default elsewhere).
    """
    if through_op is None:
        through_op = call.q.is_cuda and OP_RETURNS_MAX
    with torch.autocast(call.q.device.type, enabled=False):
        (_through_the_op if through_op else _dense)(call, o, counts, values, float(eps))


# ----------------------------------------------------------------------------- switching a call onto our kernels
# A switched layer's FlexAttention call runs on :func:`~instability_watch.kernels.flash_attention` when its scores
# are the plain scaled ``q.k`` (its ``score_mod`` returns the score it is given) and the mask is whatever its
# ``mask_mod`` says: causal, sliding-window, document (packed) masks and their combinations, taken as a boolean
# mask evaluated from the ``mask_mod`` on the call's device (no host sync, so compiled calls stay in one graph).


def returns_score(score_mod: Callable) -> bool:
    """Whether ``score_mod`` gives back the very score it is given (FlexAttention's default, or a function such
    as Hugging Face's whose every modification is switched off): called once on a scalar with index 0; a
    function whose result is a new tensor (soft-capping, a bias, ALiBi) is not. Traceable by Dynamo, which
    guards on what the function read (a closure's ``softcap is not None``)."""
    score = torch.zeros(())
    try:
        return score_mod(score, 0, 0, 0, 0) is score
    except Exception:  # noqa: BLE001 - a score_mod that needs tensor indices is not the identity
        return False


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def switch_refusal(call: FlexCall) -> Optional[str]:
    """Why this FlexAttention call cannot run on our kernels (``None`` if it can)."""
    if not returns_score(call.score_mod):
        return (f"FlexAttention score_mod {_name(call.score_mod)!r} changes the scores (our kernels take the plain "
                f"scaled q.k): calls with it stay on FlexAttention")
    if (call.kernel_options or {}).get("OUTPUT_MAX", False):
        return "FlexAttention calls that ask for max_scores stay on FlexAttention"
    if not isinstance(call.scale, (int, float)) or isinstance(call.scale, bool):
        return f"FlexAttention scale {call.scale!r} is not a number"
    return None


def keep_mask(call: FlexCall) -> Tensor:
    """The call's mask as a boolean ``(B_m, H_m, N, N_kv)`` (True: seen), from its ``mask_mod`` over the block
    mask's own batch and head extent (1 where the block mask was made for every batch entry or head), within
    the block mask's own blocks (:func:`_block_parts`)."""
    q, k = call.q, call.k
    blocks = next(t for t in call.block_mask if isinstance(t, Tensor))  # kv_num_blocks (B_m, H_m, blocks)
    b_m, h_m = int(blocks.shape[0]), int(blocks.shape[1])
    _, m_buf = call.buffers()
    dev = q.device
    fn = _bhqkv(call.mask_mod, False, len(m_buf))
    b, h, q_idx, kv_idx = (torch.arange(n, device=dev) for n in (b_m, h_m, q.shape[2], k.shape[2]))
    keep = fn(b, h, q_idx, kv_idx, *m_buf).to(torch.bool)
    return _with_blocks(keep, _block_parts(call, k.shape[2]), q_idx, kv_idx)


# The statistics and shadow passes of the calls a switch could serve (``score_mod`` leaving the scores as they are,
# as Hugging Face's): SDPA's passes (Triton on CUDA, each query tile over the span of keys its rows see) over the
# call's inputs with its mask evaluated from ``mask_mod`` (:func:`keep_mask`, ``B_m·H_m·N·N_kv`` bytes, held for the
# backward on shadow steps), where the other way takes two more FlexAttention forwards and one in float32 (the call
# again, for O_hp): the same definitions, so the same numbers up to the order of sums. A failure in SDPA's passes'
# kernels fails open; FlexAttention's passes (and the evaluation of mask_mod) are traced into the user's graph and
# raise. Calls whose kept mask would take more than VIA_MASK_MAX_BYTES (uncompiled, its evaluation makes temporaries
# of several times that), and every call with VIA_MASK off, take FlexAttention's passes.
VIA_MASK = True
VIA_MASK_MAX_BYTES = 1 << 26  # 64 MiB a layer: one 8,192 x 8,192 mask


def mask_inputs(call: FlexCall) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor, float]]:
    """``(q, k, v, keep, scale)`` for SDPA's passes over this call (:data:`VIA_MASK`; the inputs in the dtype the
    call computes in, detached), or None: FlexAttention's passes (:data:`VIA_MASK` off, a ``score_mod`` that
    changes the scores, or a mask over :data:`VIA_MASK_MAX_BYTES`)."""
    if not VIA_MASK or switch_refusal(call) is not None:
        return None
    blocks = next(t for t in call.block_mask if isinstance(t, Tensor))  # kv_num_blocks (B_m, H_m, blocks)
    if blocks.shape[0] * blocks.shape[1] * call.q.shape[2] * call.k.shape[2] > VIA_MASK_MAX_BYTES:
        return None
    device = call.q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else call.q.dtype
    with torch.no_grad():
        q, k, v = (t.detach().to(dtype) for t in (call.q, call.k, call.v))
        return q, k, v, keep_mask(call), float(call.scale)


def op_outputs(call: FlexCall, o: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(out, lse, max_scores)`` as the ``flex_attention`` op returns them, from our output and natural-log
    ``lse`` (+inf for a row without keys): the op's log-sum-exp is in log2 units (natural with the FLASH
    backend) and ``-inf`` for such a row; no row maximum (the call did not ask for one)."""
    opts = call.kernel_options or {}
    if opts.get("OUTPUT_LOGSUMEXP", True):
        unit = 1.0 if opts.get("BACKEND") == "FLASH" else 1.0 / _LN2
        lse = torch.where(torch.isinf(lse), float("-inf"), lse * unit)
    else:
        lse = lse.new_empty(0)
    return o, lse, lse.new_empty(0)
