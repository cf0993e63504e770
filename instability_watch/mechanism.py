"""Inputs that trigger the paper's rounding mechanism, and the measurements of its bias.

Used by the demo (``instability-watch demo``), the tests and the benchmarks, so
that all of them look at the same thing: rows of attention scores with several
near-equal maxima, values ``V`` that are mostly negative in half of the feature
dims, and upstream gradients ``dO`` that are negative in those dims too (the
situation of the paper's Sec. 3.3.2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from instability_watch.kernels import flash_attention
from instability_watch.kernels.attention.reference import attention_forward_lse
from instability_watch.probe.bank import Probe


@dataclass
class NearTieInputs:
    """Q, K, V, dO (B, H, N, D) and the mask of the 'negative-V' feature dims."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    neg_dims: torch.Tensor  # bool (D,)


def near_tie_inputs(
    *,
    batch: int = 2,
    heads: int = 4,
    seq: int = 256,
    head_dim: int = 64,
    n_ties: int = 4,
    tie_gap: float = 1e-3,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    generator: Optional[torch.Generator] = None,
) -> NearTieInputs:
    """Random inputs whose score rows hold ``n_ties`` maxima within ``tie_gap`` of each other.

    Returns q, k, v, dO of shape (batch, heads, seq, head_dim) in ``dtype`` on ``device``, and
    the bool (head_dim,) mask of the negative-V dims (:class:`NearTieInputs`).

    Construction (per batch and head): a random unit direction ``u`` in dims
    ``1..D-1``; queries ``q = 4u + noise``, with ``q[0] = 1``; ``n_ties`` keys at
    random positions equal to ``8u`` except for ``k[0]``, a small offset in
    ``[-tie_gap/scale, 0]`` (exactly representable at that size), so their scores
    are the same up to ``tie_gap`` and sit clearly above the other keys (noise
    of std 0.3). With ``n_ties=1`` the rows have a single maximum: the no-tie
    control. ``V`` is ``-0.75 + 0.15 noise`` in the first half of the dims and noise
    in the rest; ``dO`` is ``-0.5 + 0.1 noise`` in the first half and noise elsewhere.
    The scale is the default ``1/sqrt(D)``.
    """
    if n_ties < 1 or n_ties > seq:
        raise ValueError(f"n_ties must be in [1, seq={seq}], got {n_ties}")
    g = generator
    f32 = dict(dtype=torch.float32)
    B, H, N, D = batch, heads, seq, head_dim
    scale = 1.0 / math.sqrt(D)

    u = torch.randn(B, H, 1, D - 1, generator=g, **f32)
    u = u / u.norm(dim=-1, keepdim=True)
    q = torch.zeros(B, H, N, D, **f32)
    q[..., 1:] = 4.0 * u + 0.5 * torch.randn(B, H, N, D - 1, generator=g, **f32)
    q[..., 0] = 1.0

    k = torch.zeros(B, H, N, D, **f32)
    k[..., 1:] = 0.3 * torch.randn(B, H, N, D - 1, generator=g, **f32)
    # Tied keys: random distinct positions per (b, h), often in different KV blocks.
    pos = torch.rand(B, H, N, generator=g).argsort(dim=-1)[..., :n_ties]  # (B, H, n_ties)
    offsets = -tie_gap / scale * torch.rand(B, H, n_ties, generator=g)
    offsets[..., 0] = 0.0  # one key holds the exact maximum
    tied = torch.zeros(B, H, n_ties, D, **f32)
    tied[..., 1:] = 8.0 * u
    tied[..., 0] = offsets
    k.scatter_(2, pos[..., None].expand(B, H, n_ties, D), tied)

    v = torch.randn(B, H, N, D, generator=g, **f32)
    dO = torch.randn(B, H, N, D, generator=g, **f32)
    neg = torch.zeros(D, dtype=torch.bool)
    neg[: D // 2] = True
    # Centred inside a binade: around -1.0, RNE of O itself is biased (the grid
    # is twice as fine below 1 as above), which would mask the effect measured.
    v[..., neg] = -0.75 + 0.15 * v[..., neg]
    dO[..., neg] = -0.5 + 0.1 * dO[..., neg]
    to = dict(dtype=dtype, device=device)
    return NearTieInputs(q.to(**to), k.to(**to), v.to(**to), dO.to(**to), neg.to(device))


def exact_attention(q, k, v, *, causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """Attention in float64 (no rounding anywhere): the oracle of every error measurement.

    q (B, H, N, D), k, v (B, H_kv, N_kv, D) of any float dtype; returns O (B, H, N, D) float64.
    """
    o, _ = attention_forward_lse(
        q.double(), k.double(), v.double(), causal=causal, scale=scale, block_n=1 << 30
    )
    return o


def measure_bias(
    inputs: NearTieInputs, *, stabilize: bool, causal: bool = False, **kwargs
) -> Dict[str, float]:
    """Signed error of O against float64 in the negative-V dims, and the shadow delta drift.

    Runs forward and backward through :func:`flash_attention` with a probe in
    shadow mode, on ``inputs`` (tensors (B, H, N, D), see :func:`near_tie_inputs`). Returns
    plain floats:

    * ``o_bias``: mean of ``O - O_exact`` over the negative-V dims (the paper's
      bias: negative when near-ties round ``P`` up to 1);
    * ``o_max_err``: max ``|O - O_exact|``;
    * ``delta_err_sum``: sum over rows of ``delta_lp - delta_hp`` (per call, all heads);
    * ``delta_pos_frac``: fraction of rows with ``delta_lp > delta_hp``;
    * ``multi_max_frac``: fraction of rows where the tie test fired, among the rows
      it was counted over (``tie_rows``: all of them on the reference path; the
      Triton kernel samples the query tiles of unstabilized heads).
    """
    q = inputs.q.detach().clone().requires_grad_(True)
    H = q.shape[1]
    probe = Probe(H, device=q.device)
    probe.shadow = True
    o = flash_attention(q, inputs.k, inputs.v, causal=causal, stabilize=stabilize, probe=probe, **kwargs)
    o.backward(inputs.do)
    ref = exact_attention(inputs.q, inputs.k, inputs.v, causal=causal)
    err = o.detach().double() - ref
    tie_rows = probe.tie_rows.sum().item()
    return {
        "o_bias": err[..., inputs.neg_dims].mean().item(),
        "o_max_err": err.abs().max().item(),
        "delta_err_sum": probe.delta_err_sum.double().sum().item(),
        "delta_pos_frac": probe.delta_err_pos.sum().item() / max(probe.shadow_rows.sum().item(), 1),
        "multi_max_frac": probe.multi_max_rows.sum().item() / max(tie_rows, 1),
    }
