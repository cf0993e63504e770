"""The statistics and shadow passes in PyTorch: the CPU path and the test oracle of the Triton kernels
(definitions: :mod:`instability_watch.kernels.stats`)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from instability_watch.kernels.common import (
    MASK_FLOOR,
    compute_dtype,
    dropout_bits,
    dropout_scale,
    dropout_threshold,
    mask4,
)
from instability_watch.probe.fields import COUNT_ROW as _C
from instability_watch.probe.fields import VALUE_ROW as _V

CHUNK_ELEMENTS = 1 << 22  # scores per chunk on the PyTorch path (16 MiB of float32)


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
    cdt = compute_dtype(q.dtype)
    kf = k.to(cdt)
    m4 = mask4(attn_mask, B, H, N, n_kv)
    acc = torch.zeros(4, H, dtype=torch.int64, device=q.device)  # rows, multi, masked, nonfinite
    top = torch.full((H,), float("-inf"), dtype=cdt, device=q.device)
    step = _chunk(B, H, n_kv, N)
    for i0 in range(0, N, step):
        i1 = min(N, i0 + step)
        s, _ = _scores(q[:, :, i0:i1].to(cdt), kf, _rows_mask(m4, i0, i1), i0, causal=causal, scale=scale)
        t1, t2, nan = row_top_two(s)
        top = accumulate_rows(t1, t2 >= t1 - eps, nan, None if o is None else o[:, :, i0:i1], acc, top)
    store_rows(acc, top, counts, values)


def heads_problem(q: Tensor, k: Tensor, num_heads: int) -> Optional[str]:
    """What in a call's heads or dtype the statistics cannot read (``None``: nothing), the head dim being dim 1
    of ``q`` and ``k`` (FlexAttention's (B, H, N, D) and varlen's (T, H, D) alike)."""
    if q.shape[1] != num_heads:
        return f"{q.shape[1]} query heads in the call, the layer has {num_heads}"
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        return f"key/value heads {k.shape[1]} do not divide query heads {q.shape[1]}"
    if not q.is_floating_point() or q.device.type not in ("cuda", "cpu"):
        return f"{q.dtype} on {q.device.type}"
    return None


def row_top_two(s: Tensor):
    """``(t1, t2, nan)`` per row of scores ``s`` (..., N_kv): the largest and second largest score (repeats
    counted; NaN read as -inf; ``t2`` -inf with one key) and whether the row holds a NaN."""
    nan = torch.isnan(s).any(dim=-1)
    s = s.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    if s.shape[-1] >= 2:
        t1, t2 = s.topk(2, dim=-1).values.unbind(-1)
    else:
        t1, t2 = s[..., 0], torch.full_like(s[..., 0], float("-inf"))
    return t1, t2, nan


def accumulate_rows(t1: Tensor, multi: Tensor, nan: Tensor, o_rows: Optional[Tensor], acc: Tensor, top: Tensor,
                    valid: Optional[Tensor] = None) -> Tensor:
    """Adds one block of rows ((B, H, n) each: row maximum, maximum repeated, a NaN score) into ``acc``
    (4, H: rows, multi, masked, nonfinite) by the statistics' definitions; returns the new running maximum.
    ``valid`` (broadcastable to (B, H, n)): the rows that exist (False: counted nowhere)."""
    masked = torch.isneginf(t1) & ~nan
    live = ~masked
    if valid is not None:
        masked = masked & valid
        live = live & valid
    bad = live & (nan | torch.isposinf(t1))
    if o_rows is not None:
        bad |= live & ~torch.isfinite(o_rows).all(dim=-1)
    multi = live & torch.isfinite(t1) & multi
    acc[0] += live.sum(dim=(0, 2))
    acc[1] += multi.sum(dim=(0, 2))
    acc[2] += masked.sum(dim=(0, 2))
    acc[3] += bad.sum(dim=(0, 2))
    # a row with a NaN score keeps its largest other score (t1 read with NaN as -inf), unless t1 itself is NaN
    return torch.maximum(top, torch.where(live & ~torch.isnan(t1), t1, float("-inf")).amax(dim=(0, 2)).to(top.dtype))


def store_rows(acc: Tensor, top: Tensor, counts: Tensor, values: Tensor) -> None:
    """Adds :func:`accumulate_rows`' sums and maximum into the probe's ``counts`` and ``values``."""
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
    cdt = compute_dtype(q.dtype)
    kf, vt = k.to(cdt), v.to(cdt).unsqueeze(2).transpose(-1, -2)  # vt: (B, H_kv, 1, D_v, N_kv)
    m4 = mask4(attn_mask, B, H, N, n_kv)
    n_rows = torch.zeros(H, dtype=torch.int64, device=q.device)
    n_pos = torch.zeros(H, dtype=torch.int64, device=q.device)
    e_sum = torch.zeros(H, dtype=cdt, device=q.device)
    e_abs = torch.zeros(H, dtype=cdt, device=q.device)
    step = _chunk(B, H, n_kv, N)
    for i0 in range(0, N, step):
        i1 = min(N, i0 + step)
        s, _ = _scores(q[:, :, i0:i1].to(cdt), kf, _rows_mask(m4, i0, i1), i0, causal=causal, scale=scale)
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
