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
from typing import Optional

import torch
from torch import Tensor

from instability_watch.kernels.reference import (
    MASK_FLOOR,  # an additive mask at or below this counts as masked
    dropout_bits,
    dropout_scale,
    dropout_threshold,
)
from instability_watch.kernels.reference import mask4 as _mask4
from instability_watch.probe.fields import COUNT_FIELDS, VALUE_FIELDS

CHUNK_ELEMENTS = 1 << 22  # scores per chunk on the PyTorch path (16 MiB of float32)

_C = {name: i for i, name in enumerate(COUNT_FIELDS)}
_V = {name: i for i, name in enumerate(VALUE_FIELDS)}
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
# dtypes and head dims the Triton kernels take; anything else runs the PyTorch path
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TRITON_MAX_HEAD_DIM = 256


def _scores(q_rows: Tensor, k: Tensor, mask_rows: Optional[Tensor], i0: int, *, causal: bool, scale: float):
    """Scores of query rows ``i0 .. i0 + n`` and which keys they may see.

    ``q_rows`` (B, H, n, D) and ``k`` (B, H_kv, N_kv, D) already in the compute
    dtype. Returns ``s`` (B, H, n, N_kv) with masked keys at ``-inf`` and NaN
    kept, and ``masked`` (B, H, n, N_kv) bool.
    """
    B, H, n, D = q_rows.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    g = H // h_kv
    # (B, H_kv, G, n, D) @ (B, H_kv, 1, D, N_kv): query head h = kv * G + g reads KV head kv; no copy of K
    s = q_rows.view(B, h_kv, g, n, D) @ k.unsqueeze(2).transpose(-1, -2)
    s = s.view(B, H, n, n_kv) * scale
    masked = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=s.device)
    if causal:
        rows = torch.arange(i0, i0 + n, device=s.device)[:, None]
        masked = masked | (torch.arange(n_kv, device=s.device)[None, :] > rows)
    if mask_rows is not None:
        if mask_rows.dtype == torch.bool:
            masked = masked | ~mask_rows
        else:
            bias = mask_rows.to(s.dtype)
            masked = masked | (bias <= MASK_FLOOR)  # -inf included
            s = s + bias
    s = s.masked_fill(masked, float("-inf"))
    return s, masked.expand(s.shape)


def _rows_mask(attn_mask4: Optional[Tensor], i0: int, i1: int) -> Optional[Tensor]:
    return None if attn_mask4 is None else attn_mask4[:, :, i0:i1]


def _chunk(B: int, H: int, n_kv: int, N: int) -> int:
    return max(1, min(N, CHUNK_ELEMENTS // max(1, B * H * n_kv)))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.no_grad()
def stats_reference(
    q: Tensor, k: Tensor, attn_mask: Optional[Tensor], o: Optional[Tensor], counts: Tensor, values: Tensor,
    *, causal: bool, scale: float, eps: float,
) -> None:
    """The statistics pass in PyTorch (see the module docstring); adds into ``counts`` and ``values``.

    q: (B, H, N, D), k: (B, H_kv, N_kv, D), bfloat16/float16/float32/float64, ``H % H_kv == 0``;
    attn_mask: None, bool (True = attend) or float (additive), broadcastable to (B, H, N, N_kv);
    counts: int64 (len(COUNT_FIELDS), H), values: float32 (len(VALUE_FIELDS), H) (the probe's buffers).
    o: None, or the call's output (B, H, N, D_v): rows holding NaN/Inf count as non-finite.
    """
    with torch.autocast(q.device.type, enabled=False):  # a caller's autocast would round S to BF16
        _stats_reference(q, k, attn_mask, o, counts, values, causal=causal, scale=scale, eps=eps)


def _stats_reference(q, k, attn_mask, o, counts, values, *, causal, scale, eps) -> None:
    B, H, N, _ = q.shape
    n_kv = k.shape[2]
    cdt = _compute_dtype(q.dtype)
    kf = k.to(cdt)
    mask4 = _mask4(attn_mask, B, H, N, n_kv)
    acc = torch.zeros(4, H, dtype=torch.int64, device=q.device)  # rows, multi, masked, nonfinite
    top = torch.full((H,), float("-inf"), dtype=cdt, device=q.device)
    step = _chunk(B, H, n_kv, N)
    for i0 in range(0, N, step):
        i1 = min(N, i0 + step)
        s, _ = _scores(q[:, :, i0:i1].to(cdt), kf, _rows_mask(mask4, i0, i1), i0, causal=causal, scale=scale)
        nan = torch.isnan(s).any(dim=-1)  # (B, H, n)
        s = s.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        if n_kv >= 2:
            t1, t2 = s.topk(2, dim=-1).values.unbind(-1)
        else:
            t1, t2 = s[..., 0], torch.full_like(s[..., 0], float("-inf"))
        masked = torch.isneginf(t1) & ~nan
        live = ~masked
        bad = live & (nan | torch.isposinf(t1))
        if o is not None:
            bad |= live & ~torch.isfinite(o[:, :, i0:i1]).all(dim=-1)
        multi = live & torch.isfinite(t1) & (t2 >= t1 - eps)
        acc[0] += live.sum(dim=(0, 2))
        acc[1] += multi.sum(dim=(0, 2))
        acc[2] += masked.sum(dim=(0, 2))
        acc[3] += bad.sum(dim=(0, 2))
        top = torch.maximum(top, torch.where(live, t1, float("-inf")).amax(dim=(0, 2)))
    counts[_C["rows"]] += acc[0]
    counts[_C["tie_rows"]] += acc[0]
    counts[_C["multi_max_rows"]] += acc[1]
    counts[_C["masked_rows"]] += acc[2]
    counts[_C["nonfinite_rows"]] += acc[3]
    mx = values[_V["max_score"]]
    torch.maximum(mx, top.to(mx.dtype), out=mx)


@torch.no_grad()
def shadow_reference(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, attn_mask: Optional[Tensor],
    counts: Tensor, values: Tensor, *, causal: bool, scale: float, dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> None:
    """The shadow pass in PyTorch (see the module docstring); adds into ``counts`` and ``values``.

    q: (B, H, N, D), k: (B, H_kv, N_kv, D), bfloat16/float16/float32/float64, ``H % H_kv == 0``;
    attn_mask: None, bool (True = attend) or float (additive), broadcastable to (B, H, N, N_kv);
    counts: int64 (len(COUNT_FIELDS), H), values: float32 (len(VALUE_FIELDS), H) (the probe's buffers).
    v: (B, H_kv, N_kv, D_v); o, do: (B, H, N, D_v), the call's output and its gradient;
    seed: the call's dropout seed (int64 (2,)) when ``dropout_p > 0``.
    """
    with torch.autocast(q.device.type, enabled=False):
        _shadow_reference(q, k, v, o, do, attn_mask, counts, values, causal=causal, scale=scale,
                          dropout_p=dropout_p, seed=seed)


def _shadow_reference(q, k, v, o, do, attn_mask, counts, values, *, causal, scale, dropout_p=0.0, seed=None) -> None:
    B, H, N, _ = q.shape
    h_kv, n_kv, d_v = v.shape[1], v.shape[2], v.shape[3]
    g = H // h_kv
    cdt = _compute_dtype(q.dtype)
    kf, vt = k.to(cdt), v.to(cdt).unsqueeze(2).transpose(-1, -2)  # vt: (B, H_kv, 1, D_v, N_kv)
    mask4 = _mask4(attn_mask, B, H, N, n_kv)
    n_rows = torch.zeros(H, dtype=torch.int64, device=q.device)
    n_pos = torch.zeros(H, dtype=torch.int64, device=q.device)
    e_sum = torch.zeros(H, dtype=cdt, device=q.device)
    e_abs = torch.zeros(H, dtype=cdt, device=q.device)
    step = _chunk(B, H, n_kv, N)
    for i0 in range(0, N, step):
        i1 = min(N, i0 + step)
        s, _ = _scores(q[:, :, i0:i1].to(cdt), kf, _rows_mask(mask4, i0, i1), i0, causal=causal, scale=scale)
        n = i1 - i0
        t1 = s.amax(dim=-1)
        live = ~torch.isneginf(t1)
        p = torch.exp(s - torch.where(live, t1, 0.0)[..., None])  # masked keys: exp(-inf) = 0
        do_c = do[:, :, i0:i1].to(cdt)
        dp = (do_c.reshape(B, h_kv, g, n, d_v) @ vt).view(B, H, n, n_kv)  # dO_i . v_j
        if dropout_p:  # the call's keep mask on P, after the softmax
            rows, cols = torch.arange(i0, i1, device=q.device), torch.arange(n_kv, device=q.device)
            keep = dropout_bits(seed, B, H, rows, cols) >= dropout_threshold(dropout_p)
            delta_hp = (torch.where(keep, p * dp, 0.0)).sum(dim=-1) * dropout_scale(dropout_p) / p.sum(dim=-1)
        else:
            delta_hp = (p * dp).sum(dim=-1) / p.sum(dim=-1)
        delta_lp = (do_c * o[:, :, i0:i1].to(cdt)).sum(dim=-1)
        err = torch.where(live, delta_lp - delta_hp, 0.0)
        n_rows += live.sum(dim=(0, 2))
        n_pos += (err > 0).sum(dim=(0, 2))
        e_sum += err.sum(dim=(0, 2))
        e_abs += err.abs().sum(dim=(0, 2))
    counts[_C["shadow_rows"]] += n_rows
    counts[_C["delta_err_pos"]] += n_pos
    values[_V["delta_err_sum"]] += e_sum.to(values.dtype)
    values[_V["delta_err_abs"]] += e_abs.to(values.dtype)


# ----------------------------------------------------------------------------- dispatch


def _use_triton(q: Tensor, k: Tensor, v: Optional[Tensor] = None) -> bool:
    if not (q.is_cuda and _TRITON_AVAILABLE and q.dtype in TRITON_DTYPES):
        return False
    dims = (q.shape[-1], k.shape[-1]) if v is None else (q.shape[-1], k.shape[-1], v.shape[-1])
    return max(dims) <= TRITON_MAX_HEAD_DIM


_TRITON_MODULE = None


def _triton():
    global _TRITON_MODULE
    if _TRITON_MODULE is None:
        from instability_watch.kernels import triton_stats  # imported on first use: CPU-only users never load Triton

        _TRITON_MODULE = triton_stats
    return _TRITON_MODULE


def _stats_impl(
    q: Tensor, k: Tensor, attn_mask: Optional[Tensor], o: Optional[Tensor], counts: Tensor, values: Tensor,
    causal: bool, scale: float, eps: float,
) -> None:
    if _use_triton(q, k):
        _triton().attention_stats(q, k, attn_mask, o, counts, values, causal=causal, scale=scale, eps=eps)
    else:
        stats_reference(q, k, attn_mask, o, counts, values, causal=causal, scale=scale, eps=eps)


def _shadow_impl(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, attn_mask: Optional[Tensor],
    counts: Tensor, values: Tensor, causal: bool, scale: float, dropout_p: float, seed: Optional[Tensor],
) -> None:
    if _use_triton(q, k, v):
        _triton().attention_shadow(q, k, v, o, do, attn_mask, counts, values, causal=causal, scale=scale,
                                   dropout_p=dropout_p, seed=seed)
    else:
        shadow_reference(q, k, v, o, do, attn_mask, counts, values, causal=causal, scale=scale,
                         dropout_p=dropout_p, seed=seed)


# As torch.library ops, so that torch.compile traces an observed call without a graph break.
stats_op = torch.library.custom_op("instability_watch::attention_stats", _stats_impl, mutates_args=("counts", "values"))
shadow_op = torch.library.custom_op("instability_watch::attention_shadow", _shadow_impl, mutates_args=("counts", "values"))


@stats_op.register_fake
def _(q, k, attn_mask, o, counts, values, causal, scale, eps):
    return None


@shadow_op.register_fake
def _(q, k, v, o, do, attn_mask, counts, values, causal, scale, dropout_p, seed):
    return None


def attention_stats(
    q: Tensor, k: Tensor, attn_mask: Optional[Tensor], o: Optional[Tensor], counts: Tensor, values: Tensor,
    *, causal: bool, scale: float, eps: float,
) -> None:
    """The statistics pass (module docstring): Triton on CUDA, PyTorch elsewhere. Inputs assumed checked.

    Shapes and dtypes as :func:`stats_reference`'s; adds into ``counts`` and ``values``, no host sync.
    """
    run = stats_op if torch.compiler.is_compiling() else _stats_impl  # eager calls skip the op dispatcher
    run(q, k, attn_mask, o, counts, values, bool(causal), float(scale), float(eps))


def attention_shadow(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, attn_mask: Optional[Tensor],
    counts: Tensor, values: Tensor, *, causal: bool, scale: float, dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> None:
    """The shadow pass (module docstring): Triton on CUDA, PyTorch elsewhere. Inputs assumed checked.

    Shapes and dtypes as :func:`shadow_reference`'s; adds into ``counts`` and ``values``, no host sync.

    ``dropout_p > 0`` needs the call's ``seed`` (int64 ``(2,)``, :func:`~instability_watch.kernels.dropout_seed`).
    """
    if dropout_p and seed is None:
        raise ValueError("attention_shadow: dropout_p > 0 needs the call's seed, got seed=None")
    run = shadow_op if torch.compiler.is_compiling() else _shadow_impl
    run(q, k, v, o, do, attn_mask, counts, values, bool(causal), float(scale), float(dropout_p), seed)
