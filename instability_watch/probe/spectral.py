"""Per-head spectral norms of ``W_Q``, all layers and heads in one batched computation.

``sigma_max(W)`` for ``W`` of shape ``(D, d_in)`` (one head's query projection)
is the square root of the largest eigenvalue of the small Gram matrix
``G = W W^T`` (``D x D``, ``D`` = head dim). The power iteration runs on ``G``
and is accelerated by repeated squaring: ``k`` squarings of ``G`` give
``G^(2^k)``, the same as ``2^k`` power steps, in ``k`` batched ``D x D``
matmuls. The start vector is the previous call's top singular vector (warm
start), and the result is the Rayleigh quotient ``v^T G v`` of the final vector,
whose error is second order in the vector's.

Everything stays on the device: one call costs a ``(H, D, d_in)`` Gram
product per layer plus ``k`` small batched matmuls, and no host sync.

Sharded weights (FSDP2: ``W_Q`` a ``DTensor``): the Gram is computed where the
rows are, by DTensor's own rules (a rank holding whole heads computes their
Grams; a weight sharded along ``d_in``, as GPT-2's ``Conv1D``, gives partial
Grams that are summed), then gathered: ``H * D * D`` numbers per layer cross the
network instead of ``H * D * d_in``. Layouts DTensor cannot split that way (a
head cut between ranks) gather the weight itself. Either way every rank gets
the same Grams, hence the same sigma.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch, or built without distributed
    DTensor = None


def gram(w: torch.Tensor) -> torch.Tensor:
    """``W W^T`` per head of ``w`` (``(H, D, d_in)``), float32 ``(H, D, D)``; a ``DTensor`` gives the full Gram on every rank.

    A collective for a ``DTensor`` (every rank must call it, in the same order).
    """
    if DTensor is not None and isinstance(w, DTensor):
        wf = w.float()
        try:  # the Gram where the rows are: Shard(0) -> Shard(0), Shard(2) -> Partial, then gathered
            return (wf @ wf.transpose(1, 2)).full_tensor()
        except (RuntimeError, NotImplementedError, ValueError):  # e.g. heads split unevenly: gather W itself
            full = wf.full_tensor()
            return full @ full.transpose(1, 2)
    wf = w.float()
    return wf @ wf.transpose(1, 2)


class SpectralNorms:
    """Warm-started batched power iteration over groups of ``(H, D, d_in)`` weights.

    Args:
        squarings: repeated squarings of the Gram matrix per call (``2^k`` power
            steps). 10 gives an error below 1e-5 relative on random and trained
            weights; the warm start makes it a safety margin.
        power_steps: plain power steps after the squarings (polish the vector).

    Call it with the per-layer weights (tensors or FSDP2 ``DTensor`` objects); it
    returns one ``(H,)`` float32 tensor per layer on the weights' device.
    """

    def __init__(self, squarings: int = 10, power_steps: int = 2) -> None:
        if not isinstance(squarings, int) or isinstance(squarings, bool) or squarings < 0:
            raise ValueError(f"squarings must be an int >= 0, got {squarings!r}")
        if not isinstance(power_steps, int) or isinstance(power_steps, bool) or power_steps < 0:
            raise ValueError(f"power_steps must be an int >= 0, got {power_steps!r}")
        self.squarings = squarings
        self.power_steps = power_steps
        self.vectors: Optional[List[torch.Tensor]] = None  # per group, (N, D)

    @torch.no_grad()
    def __call__(self, weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return self.of_grams([gram(w) for w in weights])

    @torch.no_grad()
    def of_grams(self, grams: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """As calling it, from the per-layer Grams ``W W^T`` (``(H, D, D)`` float32, see :func:`gram`)."""
        grams = list(grams)
        if not grams:
            return []
        # One batched iteration per distinct (D, device); uniform models have one group.
        groups: dict = {}
        for i, g in enumerate(grams):
            groups.setdefault((g.shape[1], g.device), []).append(i)
        keys = sorted(groups, key=lambda k: groups[k][0])
        if self.vectors is None or len(self.vectors) != len(keys):
            self.vectors = [None] * len(keys)
        out: List[Optional[torch.Tensor]] = [None] * len(grams)
        for g, key in enumerate(keys):
            idx = groups[key]
            grams_g = torch.cat([grams[i] for i in idx])  # (N, D, D)
            sigma, v = top_singular_values_of_gram(grams_g, self.vectors[g], self.squarings, self.power_steps)
            self.vectors[g] = v
            start = 0
            for i in idx:
                h = grams[i].shape[0]
                out[i] = sigma[start:start + h]
                start += h
        return out  # type: ignore[return-value]

    def state_dict(self) -> dict:
        """The warm-start vectors (one ``(N, D)`` float32 per group of heads) as plain Python lists (``None`` before the first call)."""
        return {"vectors": None if self.vectors is None else [None if v is None else v.cpu().tolist() for v in self.vectors]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the warm-start vectors of :meth:`state_dict` (as float32 CPU tensors)."""
        vectors = state.get("vectors")
        self.vectors = None if vectors is None else [None if v is None else torch.tensor(v, dtype=torch.float32) for v in vectors]


def top_singular_values(
    w: torch.Tensor, v0: Optional[torch.Tensor] = None, squarings: int = 10, power_steps: int = 2
) -> tuple:
    """``(sigma_max, top left singular vector)`` of each ``w[i]`` (``(N, D, d_in)``, float32).

    ``v0`` (``(N, D)``) warm-starts the iteration; a fixed pseudo-random vector
    is used when it is missing or has the wrong shape.
    """
    return top_singular_values_of_gram(w @ w.transpose(1, 2), v0, squarings, power_steps)


def top_singular_values_of_gram(
    gram: torch.Tensor, v0: Optional[torch.Tensor] = None, squarings: int = 10, power_steps: int = 2
) -> tuple:
    """:func:`top_singular_values` from the Grams ``W W^T`` (``(N, D, D)``, float32, symmetric PSD)."""
    n, d, _ = gram.shape
    dev = gram.device
    if v0 is None or tuple(v0.shape) != (n, d):
        gen = torch.Generator(device="cpu").manual_seed(0)  # its own generator: never the global RNG's
        v = torch.randn(n, d, generator=gen)
        # from pinned memory the copy does not wait for the device (the first spectral read, or after a resume)
        v = v.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else v.to(dev)
    else:
        v = v0.to(device=dev, dtype=torch.float32)
    # Repeated squaring, normalised by the trace each time so nothing overflows.
    m = gram / gram.diagonal(dim1=1, dim2=2).sum(-1).clamp_min(torch.finfo(torch.float32).tiny)[:, None, None]
    for _ in range(squarings):
        m = m @ m
        m = m / m.diagonal(dim1=1, dim2=2).sum(-1).clamp_min(torch.finfo(torch.float32).tiny)[:, None, None]
    v = (m @ v[:, :, None]).squeeze(-1)
    # A start vector orthogonal to the top space leaves v ~ 0: fall back to G^(2^k)'s largest column.
    weak = v.norm(dim=1) < 1e-6 * m.diagonal(dim1=1, dim2=2).sum(-1).clamp_min(1e-30)
    if squarings > 0:
        cols = m.norm(dim=1).argmax(dim=1)
        v = torch.where(weak[:, None], m[torch.arange(n, device=dev), :, cols], v)
    v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-30)
    for _ in range(power_steps):
        v = (gram @ v[:, :, None]).squeeze(-1)
        v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-30)
    lam = (v[:, None, :] @ gram @ v[:, :, None]).reshape(n)
    sigma = lam.clamp_min(0).sqrt()
    # Non-finite weights (or a Gram matrix that overflows) give +inf, never NaN:
    # NaN means "not measured" downstream, +inf is an alert.
    sigma = torch.where(torch.isfinite(sigma), sigma, torch.full_like(sigma, float("inf")))
    v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    return sigma, v
