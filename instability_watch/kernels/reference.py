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

from ..probe import Probe

DEFAULT_BETA = 2.0  # the authors' choice; the paper recommends beta in [2, 8]
DEFAULT_EPS = 1e-3  # the paper's tolerance for "the same maximum"
# beta's upper bound. The shift beyond the row maximum is capped at _MAX_SHIFT bits (below), so a
# beta above ~2^10 changes nothing but rows whose maximum is within 0.03 nats of zero; bounding it
# keeps (beta - 1) * rowmax finite in float32 for every finite score.
MAX_BETA = 1024.0
# scores, scale, eps and the shift are float32 in every kernel: a larger number cannot be represented
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
DEFAULT_BLOCK_N = 64  # KV block of the emulation; results do not depend on it beyond rounding

# Cap on the extra softmax shift of the stabilized variant, in bits (log2 units), per
# P dtype. BF16 shares float32's exponent range: 46 bits (~32 nats) leave ~80 bits of
# headroom before exp2() underflows. FP16's smallest normal is 2^-14, so a large
# shift would flush the whole row's P to zero there; 3 bits keep P's maximum >= 1/8.
_MAX_SHIFT = {torch.bfloat16: 46.0, torch.float16: 3.0, torch.float32: 46.0, torch.float64: 46.0}
LOG2E = 1.4426950408889634


def max_shift_for(dtype: torch.dtype) -> float:
    """The cap, in bits (log2 units), on the stabilized variant's extra softmax shift for inputs of ``dtype``."""
    return _MAX_SHIFT[dtype]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _round_p(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round P to the dtype the GPU feeds its matmul with (nothing to do for fp32/fp64)."""
    if dtype in (torch.bfloat16, torch.float16):
        return p.to(dtype).to(p.dtype)
    return p


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H_kv, N, D) -> (B, H_kv * group, N, D): query head h reads KV head h // group."""
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _causal_mask(row_start: int, n_rows: int, col_start: int, n_cols: int, device) -> torch.Tensor:
    """True where key index > query index (top-left aligned, as PyTorch's ``is_causal``)."""
    rows = torch.arange(row_start, row_start + n_rows, device=device)[:, None]
    cols = torch.arange(col_start, col_start + n_cols, device=device)[None, :]
    return cols > rows  # (n_rows, n_cols)


def stabilized_shift(r: torch.Tensor, beta: float, max_shift: float) -> torch.Tensor:
    """The stabilized variant's extra shift ``d >= 0`` (nats) for a row maximum ``r`` (nats).

    ``m = r + d`` is the paper's ``beta * r`` for ``r > 0`` and ``0`` for ``r < 0``
    (``beta > 1``), and ``d`` is 0 at ``r == 0``. Capped in bits: ``d2 = d * log2(e)``
    becomes ``min(d2, max_shift - 1 + frac(d2))``, i.e. ``max_shift - 1 + frac(d2)``
    from ``max_shift`` bits on (``max_shift`` an integer); see the module docstring.
    The Triton kernel computes the same in bits from ``r * scale * log2(e)``.
    """
    d2 = torch.where(r > 0, beta - 1.0, -1.0) * (r * LOG2E)
    d2 = torch.minimum(d2, (max_shift - 1.0) + torch.frac(d2))
    return torch.clamp_min(d2, 0.0) / LOG2E


@torch.no_grad()
def attention_forward(
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

    Returns:
        ``(o, lse)``: o (B, H, N, D) in q's dtype; lse (B, H, N) in float32
        (float64 for float64 inputs), natural log.
    """
    B, H, N, D = q.shape
    n_kv = k.shape[2]
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = _compute_dtype(q.dtype)
    max_shift = max_shift_for(q.dtype)
    dev = q.device

    qf = q.to(cdt)  # (B, H, N, D)
    kf = _expand_kv(k, group).to(cdt)  # (B, H, N_kv, D)
    vf = _expand_kv(v, group).to(cdt)  # (B, H, N_kv, D)
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
            s = s.masked_fill(_causal_mask(i0, N - i0, j0, j1 - j0, dev), float("-inf"))
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

        # -- update l and acc (online softmax)
        alpha = torch.exp(m_old - m_new)  # 0 on the first block (m_old = -inf)
        p = torch.exp(s - m_new[..., None])  # float32 P
        l[:, :, i0:] = alpha * l[:, :, i0:] + p.sum(dim=-1)
        pv = _round_p(p, q.dtype) @ vf[:, :, j0:j1]  # P rounded, float32 accumulator
        acc[:, :, i0:] = alpha[..., None] * acc[:, :, i0:] + pv
        m[:, :, i0:] = m_new
        r[:, :, i0:] = r_new
        c[:, :, i0:] = c_new

    o = (acc / l[..., None]).to(q.dtype)  # the one rounding of O
    lse = m + torch.log(l)

    if probe is not None:
        probe.rows.add_(B * N)
        probe.multi_max_rows.add_((c > 1).sum(dim=(0, 2)))
        probe.tie_rows.add_(B * N)
        torch.maximum(probe.max_score, s_max.amax(dim=0).to(torch.float32), out=probe.max_score)
        bad = ~torch.isfinite(o).all(dim=-1) | ~torch.isfinite(lse)  # (B, H, N)
        probe.nonfinite_rows.add_(bad.sum(dim=(0, 2)))
    return o, lse


@torch.no_grad()
def attention_backward(
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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA2's backward with its precision model. Unchanged by stabilization: it uses the LSE.

    ``delta = rowsum(dO * O)``, ``P = exp(S - lse)`` (float32), ``dV += bf16(P)^T dO``,
    ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dQ += bf16(dS) K * scale``,
    ``dK += bf16(dS)^T Q * scale``; gradients rounded to the input dtype once.

    With ``shadow_probe``, also ``delta_hp = rowsum(P * dP)``, which equals
    ``rowsum(dO * O_hp)`` with ``O_hp = P V`` the output without any rounding of
    P (never materialised), and the statistics of ``delta - delta_hp`` go into
    the probe.

    ``delta`` (B, H, N), if given, replaces ``rowsum(dO * O)`` (the paper's
    control computes it from a high-precision ``O``; see
    :func:`~instability_watch.kernels.high_precision_delta`).

    Returns:
        ``(dq, dk, dv)`` in the dtypes and shapes of ``q, k, v`` (GQA heads summed).
    """
    B, H, N, D = q.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    group = H // h_kv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = _compute_dtype(q.dtype)
    dev = q.device

    qf = q.to(cdt)
    kf = _expand_kv(k, group).to(cdt)
    vf = _expand_kv(v, group).to(cdt)
    dof = do.to(cdt)
    lse = lse.to(cdt)
    if delta is None:
        delta = (dof * o.to(cdt)).sum(dim=-1)  # (B, H, N): delta_lp, what the backward uses
    else:
        delta = delta.to(cdt)
    delta_hp = torch.zeros_like(delta) if shadow_probe is not None else None

    dq = torch.zeros((B, H, N, D), dtype=cdt, device=dev)
    dk = torch.zeros((B, H, n_kv, D), dtype=cdt, device=dev)
    dv = torch.zeros((B, H, n_kv, D), dtype=cdt, device=dev)

    for j0 in range(0, n_kv, block_n):
        j1 = min(j0 + block_n, n_kv)
        i0 = j0 if causal else 0
        if i0 >= N:
            break
        q_i, do_i = qf[:, :, i0:], dof[:, :, i0:]
        k_j, v_j = kf[:, :, j0:j1], vf[:, :, j0:j1]
        s = (q_i @ k_j.transpose(-1, -2)) * scale  # (B, H, n, bn)
        if causal:
            s = s.masked_fill(_causal_mask(i0, N - i0, j0, j1 - j0, dev), float("-inf"))
        p = torch.exp(s - lse[:, :, i0:, None])  # normalised probabilities, float32
        dv[:, :, j0:j1] += _round_p(p, q.dtype).transpose(-1, -2) @ do_i
        dp = do_i @ v_j.transpose(-1, -2)  # (B, H, n, bn)
        if delta_hp is not None:
            delta_hp[:, :, i0:] += (p * dp).sum(dim=-1)
        ds = _round_p(p * (dp - delta[:, :, i0:, None]), q.dtype)
        dq[:, :, i0:] += (ds @ k_j) * scale
        dk[:, :, j0:j1] += (ds.transpose(-1, -2) @ q_i) * scale

    if group > 1:  # GQA: the KV head's gradient is the sum over the heads that read it
        dk = dk.view(B, h_kv, group, n_kv, D).sum(dim=2)
        dv = dv.view(B, h_kv, group, n_kv, D).sum(dim=2)

    if shadow_probe is not None:
        err = (delta - delta_hp).to(torch.float32)  # (B, H, N)
        shadow_probe.shadow_rows.add_(B * N)
        shadow_probe.delta_err_sum.add_(err.sum(dim=(0, 2)))
        shadow_probe.delta_err_abs.add_(err.abs().sum(dim=(0, 2)))
        shadow_probe.delta_err_pos.add_((err > 0).sum(dim=(0, 2)))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
