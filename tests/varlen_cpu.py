"""A reference CPU kernel for PyTorch's ``torch_attn::_varlen_attn`` op, for tests: the CPU build has none
(varlen_attn raises NotImplementedError there). Importing this module registers it."""
import math

import torch

from instability_watch.kernels.stats.varlen import VARLEN_OP

NAMES = [a.name for a in VARLEN_OP.default._schema.arguments] if VARLEN_OP is not None else []


def visible(n_q, n_k, causal, window):
    """(n_q, n_k) bool: flash-attn's bottom-right aligned causal / window mask of one document."""
    a = torch.arange(n_q)[:, None] + (n_k - n_q)
    j = torch.arange(n_k)[None, :]
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        keep &= j >= a - left
    if right >= 0:
        keep &= j <= a + right
    return keep


def cpu_varlen(*args, **kwargs):
    """The op on the CPU, for these tests: attention per document in float32 (the op's outputs: out, lse, rng)."""
    got = dict(zip(NAMES, args))
    got.update(kwargs)
    q, k, v = got["query"], got["key"], got["value"]
    cu_q = got["cu_seq_q"].tolist()
    cu_k = (got.get("cu_seq_k") if got.get("cu_seq_k") is not None else got["cu_seq_q"]).tolist()
    window = tuple(got.get("window_size") or (-1, -1))
    causal = bool(got.get("is_causal", False))
    scale = got.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.zeros(q.shape[1], q.shape[0])
    for d in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[d], cu_q[d + 1]), slice(cu_k[d], cu_k[d + 1])
        s = torch.einsum("nhd,mhd->hnm", q[qs].float(), k[ks].float().repeat_interleave(g, 1)) * scale
        s = s.masked_fill(~visible(s.shape[1], s.shape[2], causal, window), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[qs] = torch.einsum("hnm,mhd->nhd", p, v[ks].float().repeat_interleave(g, 1)).to(q.dtype)
        lse[:, qs] = s.logsumexp(-1)
    return out, lse, torch.zeros(2, dtype=torch.int64)


if VARLEN_OP is not None:
    try:
        torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", cpu_varlen)
    except RuntimeError:  # already registered
        pass
