"""Flash attention with FA2's precision model, in PyTorch: the CPU path and the test oracle.

A GPU FlashAttention-2 kernel (PyTorch's flash and cuDNN SDPA, and our Triton
kernels) rounds in exactly these places, and so does this emulation:

* ``S = scale * Q K^T`` in float32 from the low-precision ``Q, K``;
* ``P = exp(S - m)`` in float32, with ``m`` the running row maximum (online
  softmax over KV blocks); the normaliser ``l`` is summed from the float32 ``P``;
* ``P`` is rounded to the input dtype (round to nearest even) for ``P V``, which
  accumulates in float32;
* ``O = acc / l`` is rounded to the input dtype once; the log-sum-exp stays float32.

The computation runs in float32 with explicit casts where the GPU rounds: BF16
matmuls are ~10x slower than float32 on CPUs without native BF16, and the casts
make the emulation exact where it matters. Float64 inputs run the same
algorithm in float64 without any rounding (used to check that the stabilized
variant is exact in exact arithmetic).

Why this matters (paper: Qiu & Yao 2026): when a row holds several scores within
about 2^-9 of its maximum, their ``P`` lie just below 1 and round *up* to 1.0
together, so the numerator ``sum bf16(P) V`` is too large for the float32 ``l``
and ``O`` is biased in the direction of ``V``'s sign. The stabilized variant
(paper Alg. 3) shifts the softmax by more than the row maximum in that case, so
no ``P`` sits just below 1; the result is unchanged in exact arithmetic.

Our stabilized variant differs from the paper's per-block rule in two ways, both
documented in DESIGN.md:

1. The tie test counts scores within ``eps`` of the *running* row maximum,
   including the maximum of earlier blocks, so ties that straddle two KV blocks
   are caught too (with the per-block rule, two tied keys in different blocks,
   the common case at N=1024, are left biased), and the trigger no longer depends
   on the block size.
2. The extra shift ``d`` (``(beta-1)*rm`` for ``rm > 0``, ``-rm`` for ``rm < 0``)
   is capped, in log2 units (bits, the unit of the GPU's exp2): at or above
   ``max_shift`` bits it becomes ``max_shift - 1 + frac(d)`` bits. The cap keeps
   large logits (|S| up to 1e6, seen in real runs) from underflowing the whole
   row to ``l = 0`` (NaN); the fractional part keeps the shift varying from row
   to row so that it does not turn into a fixed offset, which the paper (App. C)
   shows re-introduces a bias.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from instability_watch.kernels.common import (
    DEFAULT_BETA,
    DEFAULT_EPS,
    LOG2E,
    compute_dtype,
    dropout_mask,
    dropout_scale,
    expand_kv,
    mask4,
    mask_bias,
    max_shift_for,
    reduce_to,
)
from instability_watch.probe.bank import Probe

DEFAULT_BLOCK_N = 64  # KV block of the emulation; results do not depend on it beyond rounding


def _round_p(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round P to the dtype the GPU feeds its matmul with (nothing to do for fp32/fp64)."""
    if dtype in (torch.bfloat16, torch.float16):
        return p.to(dtype).to(p.dtype)
    return p


def causal_mask(row_start: int, n_rows: int, col_start: int, n_cols: int, device) -> torch.Tensor:
    """True where key index > query index (top-left aligned, as PyTorch's ``is_causal``)."""
    rows = torch.arange(row_start, row_start + n_rows, device=device)[:, None]
    cols = torch.arange(col_start, col_start + n_cols, device=device)[None, :]
    return cols > rows  # (n_rows, n_cols)


def stabilized_shift(r: torch.Tensor, beta: float, max_shift: float) -> torch.Tensor:
    """The stabilized variant's extra shift ``d >= 0`` (nats) for row maxima ``r`` (nats): a tensor of ``r``'s shape and dtype.

    ``m = r + d`` is the paper's ``beta * r`` for ``r > 0`` and ``0`` for ``r < 0``
    (``beta > 1``), and ``d`` is 0 at ``r == 0``. Capped in bits: ``d2 = d * log2(e)``
    becomes ``min(d2, max_shift - 1 + frac(d2))``, i.e. ``max_shift - 1 + frac(d2)``
    from ``max_shift`` bits on (``max_shift`` an integer); see the module docstring.
    The Triton kernel computes the same in bits from ``r * scale * log2(e)``.
    """
    d2 = torch.where(r > 0, beta - 1.0, -1.0) * (r * LOG2E)
    d2 = torch.minimum(d2, (max_shift - 1.0) + torch.frac(d2))
    return torch.clamp_min(d2, 0.0) / LOG2E


def _safe_shift(m: torch.Tensor) -> torch.Tensor:
    """A shift that is finite where a row has seen no score yet (``-inf``): its P is then exp(-inf) = 0."""
    return torch.where(torch.isneginf(m), 0.0, m)


@torch.no_grad()
def attention_forward_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    stabilize: Optional[torch.Tensor] = None,
    beta: float = DEFAULT_BETA,
    eps: float = DEFAULT_EPS,
    block_n: int = DEFAULT_BLOCK_N,
    probe: Optional[Probe] = None,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FA2-precision attention forward. Inputs are assumed validated.

    Args:
        q: (B, H, N, D); k, v: (B, H_kv, N_kv, D), H divisible by H_kv.
        causal: top-left aligned causal mask (PyTorch's ``is_causal``).
        scale: softmax scale, default ``1/sqrt(D)``.
        stabilize: bool (H,) mask of heads that use the stabilized shift, or None.
        beta, eps: the stabilized variant's parameters.
        block_n: KV block size of the online softmax.
        probe: statistics to accumulate into, or None.
        attn_mask: boolean (True = attend) or additive mask broadcastable to
            (B, H, N, N_kv), as SDPA's; added to the scaled scores (see :func:`mask_bias`).
        dropout_p, seed: dropout after the softmax (see :func:`dropout_mask`); ``l``
            is summed before it, kept entries are scaled by :func:`dropout_scale` at the end.

    Returns:
        ``(o, lse)``: o (B, H, N, D) in q's dtype; lse (B, H, N) in float32
        (float64 for float64 inputs), natural log; with an additive mask (2, B, H, N):
        the shift ``m`` and ``log(l)`` apart. A row that sees no key (every key
        masked) has o = 0 and lse = +inf (its backward is 0), as SDPA.
    """
    B, H, N, D = q.shape
    n_kv = k.shape[2]
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = compute_dtype(q.dtype)
    max_shift = max_shift_for(q.dtype)
    dev = q.device
    mask = mask4(attn_mask, B, H, N, n_kv)
    keep = dropout_mask(seed, B, H, N, n_kv, dropout_p, device=dev) if dropout_p else None

    qf = q.to(cdt)  # (B, H, N, D)
    kf = expand_kv(k, group).to(cdt)  # (B, H, N_kv, D)
    vf = expand_kv(v, group).to(cdt)  # (B, H, N_kv, D)
    stab = (
        torch.zeros(H, dtype=torch.bool, device=dev)
        if stabilize is None
        else stabilize.to(device=dev, dtype=torch.bool)
    )
    stab = stab[None, :, None]  # (1, H, 1) against (B, H, rows)

    # Running state per query row.
    m = torch.full((B, H, N), float("-inf"), dtype=cdt, device=dev)  # softmax shift in use
    r = torch.full((B, H, N), float("-inf"), dtype=cdt, device=dev)  # raw running row maximum
    c = torch.zeros((B, H, N), dtype=torch.int64, device=dev)  # scores within eps of r
    l = torch.zeros((B, H, N), dtype=cdt, device=dev)
    acc = torch.zeros((B, H, N, D), dtype=cdt, device=dev)
    s_max = torch.full((B, H), float("-inf"), dtype=cdt, device=dev)

    for j0 in range(0, n_kv, block_n):
        j1 = min(j0 + block_n, n_kv)
        # Causal, top-left: row i sees keys <= i, so rows < j0 see nothing of this block.
        i0 = j0 if causal else 0
        if i0 >= N:
            break
        # -- scores of this block, float32 from the low-precision Q, K
        s = (qf[:, :, i0:] @ kf[:, :, j0:j1].transpose(-1, -2)) * scale  # (B, H, n, bn)
        if causal:
            s = s.masked_fill(causal_mask(i0, N - i0, j0, j1 - j0, dev), float("-inf"))
        if mask is not None:
            s = s + mask_bias(mask[:, :, i0:, j0:j1], cdt)
        rm = s.amax(dim=-1)  # (B, H, n)
        s_max = torch.maximum(s_max, rm.amax(dim=-1))

        # -- tie test against the running maximum (earlier blocks included):
        #    c counts the scores within eps of it; the old ones still count if the
        #    maximum moved by at most eps.
        r_old, m_old = r[:, :, i0:], m[:, :, i0:]
        r_new = torch.maximum(r_old, rm)
        c_new = (s >= (r_new - eps)[..., None]).sum(dim=-1)
        c_new += torch.where(r_old >= r_new - eps, c[:, :, i0:], 0)
        tie = (c_new > 1) & torch.isfinite(r_new)

        # -- new shift: the row maximum, moved up by d where the fix applies
        d = torch.where(tie & stab, stabilized_shift(r_new, beta, max_shift), 0.0)
        m_new = torch.maximum(m_old, r_new + d)

        # -- update l and acc (online softmax); rows that have seen nothing keep l = acc = 0
        alpha = torch.exp(m_old - _safe_shift(m_new))  # 0 on the first block (m_old = -inf)
        p = torch.exp(s - _safe_shift(m_new)[..., None])  # float32 P
        l[:, :, i0:] = alpha * l[:, :, i0:] + p.sum(dim=-1)
        if keep is not None:  # dropout after the softmax: l is the softmax's own normaliser
            p = p * keep[:, :, i0:, j0:j1]
        pv = _round_p(p, q.dtype) @ vf[:, :, j0:j1]  # P rounded, float32 accumulator
        acc[:, :, i0:] = alpha[..., None] * acc[:, :, i0:] + pv
        m[:, :, i0:] = m_new
        r[:, :, i0:] = r_new
        c[:, :, i0:] = c_new

    seen = l > 0  # False: every key of the row masked
    o = acc / torch.where(seen, l, 1.0)[..., None]
    if keep is not None:
        o = o * dropout_scale(dropout_p)
    o = o.to(q.dtype)  # the one rounding of O
    if mask is not None and not mask.is_floating_point():
        lse = torch.where(seen, m + torch.log(l), float("inf"))
    elif mask is not None:
        # an additive mask: the shift and log(l) apart, (2, B, H, N), so that the backward's
        # P = exp(s - m - log(l)) stays exact where m is huge (a row of MASK_FLOOR entries)
        lse = torch.stack([torch.where(seen, m, 0.0), torch.where(seen, torch.log(l), float("inf"))])
    else:
        lse = m + torch.log(l)

    if probe is not None:
        live = ~torch.isneginf(r)  # rows that see a key
        n_live = live.sum(dim=(0, 2))
        probe.rows.add_(n_live)
        probe.multi_max_rows.add_((live & (c > 1)).sum(dim=(0, 2)))
        probe.tie_rows.add_(n_live)
        probe.masked_rows.add_(B * N - n_live)
        torch.maximum(probe.max_score, s_max.amax(dim=0).to(torch.float32), out=probe.max_score)
        bad = live & (~torch.isfinite(o).all(dim=-1) | ~torch.isfinite(m + torch.log(l)))  # (B, H, N)
        probe.nonfinite_rows.add_(bad.sum(dim=(0, 2)))
    return o, lse


@torch.no_grad()
def attention_backward_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    block_n: int = DEFAULT_BLOCK_N,
    shadow_probe: Optional[Probe] = None,
    delta: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
    mask_grad: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """FA2's backward with its precision model. Unchanged by stabilization: it uses the LSE.

    ``lse`` is :func:`attention_forward_lse`'s, in natural-log units ((B, H, N), or (2, B, H, N)
    with an additive mask); q, do (B, H, N, D), k, v (B, H_kv, N_kv, D), o (B, H, N, D).

    ``delta = rowsum(dO * O)``, ``P = exp(S - lse)`` (float32), ``Z`` the dropout
    keep mask scaled by ``1/(1 - p)`` (all ones without dropout),
    ``dV += bf16(P * Z)^T dO``, ``dP = (dO V^T) * Z``, ``dS = P * (dP - delta)``,
    ``dQ += bf16(dS) K * scale``, ``dK += bf16(dS)^T Q * scale``; gradients rounded
    to the input dtype once. An additive ``attn_mask``'s gradient is ``dS`` (float32,
    summed over its broadcast dimensions), returned if ``mask_grad``.

    With ``shadow_probe``, also ``delta_hp = rowsum(P * dP)``, which equals
    ``rowsum(dO * O_hp)`` with ``O_hp = (P * Z) V`` the output without any rounding of
    P (never materialised), and the statistics of ``delta - delta_hp`` go into
    the probe.

    ``delta`` (B, H, N), if given, replaces ``rowsum(dO * O)`` (the paper's
    control computes it from a high-precision ``O``; see
    :func:`~instability_watch.experimental.high_precision_delta`).

    Returns:
        ``(dq, dk, dv, dmask)`` in the dtypes and shapes of ``q, k, v`` (GQA heads
        summed) and of ``attn_mask`` (``None`` unless ``mask_grad``).
    """
    B, H, N, D = q.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    group = H // h_kv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = compute_dtype(q.dtype)
    dev = q.device
    mask = mask4(attn_mask, B, H, N, n_kv)
    keep = dropout_mask(seed, B, H, N, n_kv, dropout_p, device=dev) if dropout_p else None
    inv_keep = dropout_scale(dropout_p) if dropout_p else 1.0

    qf = q.to(cdt)
    kf = expand_kv(k, group).to(cdt)
    vf = expand_kv(v, group).to(cdt)
    dof = do.to(cdt)
    lse = lse.to(cdt)
    additive = mask is not None and mask.is_floating_point()
    if additive:
        shift, log_l = lse[0], lse[1]
    if delta is None:
        delta = (dof * o.to(cdt)).sum(dim=-1)  # (B, H, N): delta_lp, what the backward uses
    else:
        delta = delta.to(cdt)
    delta_hp = torch.zeros_like(delta) if shadow_probe is not None else None

    dq = torch.zeros((B, H, N, D), dtype=cdt, device=dev)
    dk = torch.zeros((B, H, n_kv, D), dtype=cdt, device=dev)
    dv = torch.zeros((B, H, n_kv, D), dtype=cdt, device=dev)
    dmask = torch.zeros((B, H, N, n_kv), dtype=cdt, device=dev) if mask_grad else None

    for j0 in range(0, n_kv, block_n):
        j1 = min(j0 + block_n, n_kv)
        i0 = j0 if causal else 0
        if i0 >= N:
            break
        q_i, do_i = qf[:, :, i0:], dof[:, :, i0:]
        k_j, v_j = kf[:, :, j0:j1], vf[:, :, j0:j1]
        s = (q_i @ k_j.transpose(-1, -2)) * scale  # (B, H, n, bn)
        if causal:
            s = s.masked_fill(causal_mask(i0, N - i0, j0, j1 - j0, dev), float("-inf"))
        if mask is not None:
            s = s + mask_bias(mask[:, :, i0:, j0:j1], cdt)
        if additive:
            p = torch.exp((s - shift[:, :, i0:, None]) - log_l[:, :, i0:, None])
        else:
            p = torch.exp(s - lse[:, :, i0:, None])  # normalised probabilities, float32; 0 in masked rows
        dp = do_i @ v_j.transpose(-1, -2)  # (B, H, n, bn)
        if keep is not None:
            z = keep[:, :, i0:, j0:j1]
            dv[:, :, j0:j1] += _round_p(p * z, q.dtype).transpose(-1, -2) @ do_i
            dp = torch.where(z, dp * inv_keep, 0.0)
        else:
            dv[:, :, j0:j1] += _round_p(p, q.dtype).transpose(-1, -2) @ do_i
        if delta_hp is not None:
            delta_hp[:, :, i0:] += (p * dp).sum(dim=-1)
        ds_full = p * (dp - delta[:, :, i0:, None])
        if dmask is not None:
            dmask[:, :, i0:, j0:j1] = ds_full
        ds = _round_p(ds_full, q.dtype)
        dq[:, :, i0:] += (ds @ k_j) * scale
        dk[:, :, j0:j1] += (ds.transpose(-1, -2) @ q_i) * scale

    if keep is not None:
        dv = dv * inv_keep
    if group > 1:  # GQA: the KV head's gradient is the sum over the heads that read it
        dk = dk.view(B, h_kv, group, n_kv, D).sum(dim=2)
        dv = dv.view(B, h_kv, group, n_kv, D).sum(dim=2)

    if shadow_probe is not None:
        live = torch.isfinite(log_l if additive else lse)  # rows that see a key
        err = torch.where(live, delta - delta_hp, 0.0).to(torch.float32)  # (B, H, N)
        shadow_probe.shadow_rows.add_(live.sum(dim=(0, 2)))
        shadow_probe.delta_err_sum.add_(err.sum(dim=(0, 2)))
        shadow_probe.delta_err_abs.add_(err.abs().sum(dim=(0, 2)))
        shadow_probe.delta_err_pos.add_((err > 0).sum(dim=(0, 2)))
    if dmask is not None:
        dmask = reduce_to(dmask, attn_mask.shape).to(attn_mask.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask
