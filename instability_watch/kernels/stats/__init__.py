"""Statistics of an attention call that someone else computes: the observer's passes.

The watch leaves the user's ``F.scaled_dot_product_attention`` call alone and,
on probe steps, runs these passes over the same inputs. Both write per-head sums
into a :class:`~instability_watch.Probe`'s two buffers (``counts`` int64,
``values`` float32, one column per query head) and never synchronise with the
host.

Definitions (the same for the PyTorch path below and the Triton kernels in
``triton_stats.py``; this module is the oracle the Triton tests compare with):

* Inputs are the call's ``q (B, H, N, D)``, ``k (B, H_kv, N_kv, D)`` and
  ``v (B, H_kv, N_kv, D_v)`` *in the dtype the call computes in* (the caller
  applies autocast's rule first), with ``H % H_kv == 0`` (query head ``h`` reads
  KV head ``h // (H // H_kv)``).
* ``S[i, j] = scale * (q_i . k_j)`` in float32 (float64 for float64 inputs),
  plus ``attn_mask[i, j]`` when the mask is additive (float).
* Key ``j`` is *masked* for row ``i`` when ``is_causal`` and ``j > i`` (top-left
  aligned, as SDPA), when a boolean mask is ``False`` there, or when an additive
  mask is ``-inf`` or at most :data:`MASK_FLOOR` there (``torch.finfo(dtype).min``
  is how many models write "masked"). A row whose every key is masked is a
  *masked row*: counted in ``masked_rows`` and in nothing else.
* Per row: ``t1`` the largest unmasked score, ``t2`` the second largest
  (counting repeats; ``-inf`` with one unmasked key). The row's maximum is
  *repeated* when ``t2 >= t1 - eps`` and ``t1`` is finite.

Statistics pass (:func:`attention_stats`), per query head:

=================  ==============================================================
``rows``           rows with at least one unmasked key (``tie_rows`` gets the same)
``multi_max_rows`` rows whose maximum is repeated (within ``eps``)
``masked_rows``    rows with every key masked
``nonfinite_rows`` rows (not masked) with a NaN or ``+inf`` score, or a NaN/Inf in
                   the call's output ``o``
``max_score``      the largest ``t1`` (a running maximum across calls)
=================  ==============================================================

Shadow pass (:func:`attention_shadow`), per query head, over rows that are not masked:
``delta_lp = rowsum(dO * O)`` with ``O`` the call's output (what the backward
uses); ``delta_hp = sum_j P[i, j] (dO_i . v_j) / sum_j P[i, j]`` with
``P = exp(S - t1)`` in float32, i.e. ``rowsum(dO * O_hp)`` for the output
``O_hp`` computed without rounding ``P``, which is never formed. It adds
``shadow_rows``, ``delta_err_sum = sum(delta_lp - delta_hp)``, ``delta_err_abs``
and ``delta_err_pos`` (rows with ``delta_lp > delta_hp``).

A call with dropout (``dropout_p > 0``, our kernels' calls only: the pass needs the
call's ``seed``) applies the same keep mask to ``P`` after the softmax:
``delta_hp = sum_j keep[i, j] P[i, j] (dO_i . v_j) / ((1 - p) sum_j P[i, j])``, the
mask regenerated from the seed (``reference.dropout_bits``; ``1 - p`` as
``reference.dropout_scale`` rounds it).

The PyTorch path works through the query rows in chunks, so its memory stays
bounded (about :data:`CHUNK_ELEMENTS` scores at a time) whatever ``N``.
"""
from __future__ import annotations

import importlib.util
from typing import Callable, Optional

import torch
from torch import Tensor

from instability_watch.kernels.stats.reference import shadow_reference, stats_reference

_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
# dtypes and head dims the Triton kernels take; anything else runs the PyTorch path
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


TRITON_MAX_HEAD_DIM = 256


def triton_serves(q: Tensor, k: Tensor, v: Optional[Tensor] = None) -> bool:
    """Whether the Triton kernels take these inputs (CUDA, their dtypes and head dims); else PyTorch's path."""
    if not (q.is_cuda and _TRITON_AVAILABLE and q.dtype in TRITON_DTYPES):
        return False
    dims = (q.shape[-1], k.shape[-1]) if v is None else (q.shape[-1], k.shape[-1], v.shape[-1])
    return max(dims) <= TRITON_MAX_HEAD_DIM


_TRITON_MODULE = None


def _triton():
    global _TRITON_MODULE
    if _TRITON_MODULE is None:
        from instability_watch.kernels.stats import (
            triton as triton_stats,  # on first use: CPU-only users never load Triton
        )

        _TRITON_MODULE = triton_stats
    return _TRITON_MODULE


# Fail-open inside a compiled graph. An eager caller runs the passes inside its own try/except; a graph
# torch.compile made runs the ops with nothing of that around them, so the op itself hands a failure to
# ``COMPILED_FAILURE(group, exc)`` (set by the observers: it reports the failure to the watch of that group and
# turns its statistics off, or raises with ``strict``) and leaves this call's statistics out. ``group`` 0, or a
# handler that returns False (no watch of that group): the failure propagates.
COMPILED_FAILURE: Optional[Callable[[int, BaseException], bool]] = None


def _failing_open(group: int, run: Callable[[], None]) -> None:
    if not group:
        run()
        return
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported to the group's watch, or re-raised
        handler = COMPILED_FAILURE
        if handler is None or not handler(group, exc):
            raise


def _stats_impl(
    q: Tensor, k: Tensor, attn_mask: Optional[Tensor], o: Optional[Tensor], counts: Tensor, values: Tensor,
    causal: bool, scale: float, eps: float, group: int = 0,
) -> None:
    if triton_serves(q, k):
        _failing_open(group, lambda: _triton().attention_stats(q, k, attn_mask, o, counts, values, causal=causal,
                                                               scale=scale, eps=eps))
    else:
        _failing_open(group, lambda: stats_reference(q, k, attn_mask, o, counts, values, causal=causal,
                                                     scale=scale, eps=eps))


def _shadow_impl(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, attn_mask: Optional[Tensor],
    counts: Tensor, values: Tensor, causal: bool, scale: float, dropout_p: float, seed: Optional[Tensor],
    group: int = 0,
) -> None:
    if triton_serves(q, k, v):
        _failing_open(group, lambda: _triton().attention_shadow(q, k, v, o, do, attn_mask, counts, values,
                                                                causal=causal, scale=scale, dropout_p=dropout_p,
                                                                seed=seed))
    else:
        _failing_open(group, lambda: shadow_reference(q, k, v, o, do, attn_mask, counts, values, causal=causal,
                                                      scale=scale, dropout_p=dropout_p, seed=seed))


# As torch.library ops, so that torch.compile traces an observed call without a graph break.
stats_op = torch.library.custom_op("instability_watch::attention_stats", _stats_impl, mutates_args=("counts", "values"))
shadow_op = torch.library.custom_op("instability_watch::attention_shadow", _shadow_impl, mutates_args=("counts", "values"))


@stats_op.register_fake
def _(q, k, attn_mask, o, counts, values, causal, scale, eps, group=0):
    return None


@shadow_op.register_fake
def _(q, k, v, o, do, attn_mask, counts, values, causal, scale, dropout_p, seed, group=0):
    return None


def attention_stats(
    q: Tensor, k: Tensor, attn_mask: Optional[Tensor], o: Optional[Tensor], counts: Tensor, values: Tensor,
    *, causal: bool, scale: float, eps: float, group: int = 0,
) -> None:
    """The statistics pass (module docstring): Triton on CUDA, PyTorch elsewhere. Inputs assumed checked.

    Shapes and dtypes as :func:`stats_reference`'s; adds into ``counts`` and ``values``, no host sync.
    ``group``: the watch whose :data:`COMPILED_FAILURE` handler takes a failure in a compiled graph (0: none;
    eager calls raise, their caller handles it).
    """
    if torch.compiler.is_compiling():
        stats_op(q, k, attn_mask, o, counts, values, bool(causal), float(scale), float(eps), int(group))
    else:  # eager calls skip the op dispatcher
        _stats_impl(q, k, attn_mask, o, counts, values, bool(causal), float(scale), float(eps))


def attention_shadow(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, attn_mask: Optional[Tensor],
    counts: Tensor, values: Tensor, *, causal: bool, scale: float, dropout_p: float = 0.0,
    seed: Optional[Tensor] = None, group: int = 0,
) -> None:
    """The shadow pass (module docstring): Triton on CUDA, PyTorch elsewhere. Inputs assumed checked.

    Shapes and dtypes as :func:`shadow_reference`'s; adds into ``counts`` and ``values``, no host sync.

    ``dropout_p > 0`` needs the call's ``seed`` (int64 ``(2,)``, :func:`~instability_watch.kernels.dropout_seed`).
    ``group`` as :func:`attention_stats`'s.
    """
    if dropout_p and seed is None:
        raise ValueError("attention_shadow: dropout_p > 0 needs the call's seed, got seed=None")
    if torch.compiler.is_compiling():
        shadow_op(q, k, v, o, do, attn_mask, counts, values, bool(causal), float(scale), float(dropout_p), seed,
                  int(group))
    else:
        _shadow_impl(q, k, v, o, do, attn_mask, counts, values, bool(causal), float(scale), float(dropout_p), seed)
