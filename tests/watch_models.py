"""Small models for the watch tests."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from instability_watch.mechanism import near_tie_inputs
from instability_watch.model.layer import AttentionLayer


class TiedAttention(nn.Module):
    """Attention with learnable per-head Q/K/V maps, fed inputs whose rows hold near-tied maxima.

    Not a model the built-in locators know: it is watched through an
    :class:`AttentionLayer` description. Its objective ``0.5 * |O|^2`` gives an
    upstream gradient ``dO = O``, negative where ``V`` is (the situation of the
    paper's Sec. 3.3.2), so the rounding bias of near-tied rows gives a
    one-signed ``sum(delta_lp - delta_hp)``.
    """

    def __init__(self, heads: int = 4, head_dim: int = 32) -> None:
        super().__init__()
        eye = torch.eye(head_dim).repeat(heads, 1, 1)
        self.wq = nn.Parameter(eye.clone())
        self.wk = nn.Parameter(eye.clone())
        self.wv = nn.Parameter(eye.clone())

    def forward(self, q_in, k_in, v_in):
        q = torch.einsum("bhnd,hed->bhne", q_in, self.wq).to(torch.bfloat16)
        k = torch.einsum("bhnd,hed->bhne", k_in, self.wk).to(torch.bfloat16)
        v = torch.einsum("bhnd,hed->bhne", v_in, self.wv).to(torch.bfloat16)
        return F.scaled_dot_product_attention(q, k, v)

    def layers(self):
        return [AttentionLayer(self, self.wq.shape[0], lambda: self.wq, name="tied")]


def tied_batch(step: int, *, tied_heads: int = 2, free_heads: int = 2, seq: int = 128, head_dim: int = 32):
    """Fresh inputs for ``step``: the first ``tied_heads`` heads have 4 near-tied maxima per row, the rest one."""
    g = torch.Generator().manual_seed(1000 + step)
    kw = dict(batch=2, seq=seq, head_dim=head_dim, dtype=torch.float32, generator=g)
    a = near_tie_inputs(heads=tied_heads, n_ties=4, **kw)
    b = near_tie_inputs(heads=free_heads, n_ties=1, **kw)
    return tuple(torch.cat([x, y], dim=1) for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v)))


def tied_loss(o: torch.Tensor) -> torch.Tensor:
    """``0.5 * |O|^2`` per sample: its upstream gradient is ``dO = O``."""
    return 0.5 * o.float().pow(2).sum() / o.shape[0]


def train_tied(model: TiedAttention, watch, start: int, stop: int, opt=None):
    """SGD steps ``start..stop-1`` on ``tied_batch(step)``, closing each with ``watch.step(loss)``; returns ``opt``."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=1e-3)
    for i in range(start, stop):
        loss = tied_loss(model(*tied_batch(i)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        watch.step(loss)
    return opt


def write_tied_run(run_dir, config, steps: int, *, listeners=(), close: bool = True):
    """A real run directory: ``steps`` of :func:`train_tied` from seed 0, written by ``RunWriter`` (the
    README's plain loop); returns ``(watch, writer)``, the watch detached."""
    from instability_watch import InstabilityWatch
    from instability_watch.outputs.rundir import RunWriter

    torch.manual_seed(0)
    model = TiedAttention()
    writer = RunWriter(run_dir)
    watch = InstabilityWatch(model, config, layers=model.layers(), listeners=[writer, *listeners])
    writer.open(watch)
    train_tied(model, watch, 0, steps)
    watch.detach()
    if close:
        writer.close()
    return watch, writer


class NarrowValues(nn.Module):
    """Attention whose values are narrower than its queries and keys (as MLA-style layers): our kernels refuse it
    (a switch there is not applied, and must say so)."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qk = nn.Linear(d, 2 * d)
        self.v = nn.Linear(d, d // 2)
        self.out = nn.Linear(d // 2, d)

    def forward(self, x):
        B, N, d = x.shape
        q, k = self.qk(x).view(B, N, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        v = self.v(x).view(B, N, self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, N, -1))
