"""Reference CPU kernels for PyTorch's ``torch_attn::_varlen_attn`` op and its backward, for tests: the CPU build
has none (varlen_attn raises NotImplementedError there). Importing this module registers them."""
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


def attend(q, k, v, cu_q, cu_k, causal, window, scale):
    """Attention per document in float32 (differentiable): ``(out (T_q, H, D_v) float32, lse (H, T_q))``."""
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for d in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[d], cu_q[d + 1]), slice(cu_k[d], cu_k[d + 1])
        s = torch.einsum("nhd,mhd->hnm", q[qs].float(), k[ks].float().repeat_interleave(g, 1)) * scale
        s = s.masked_fill(~visible(s.shape[1], s.shape[2], causal, window), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        outs.append(torch.einsum("hnm,mhd->nhd", p, v[ks].float().repeat_interleave(g, 1)))
        lses.append(s.logsumexp(-1))
    tail = q.shape[0] - cu_q[-1]  # rows past the last document: 0
    outs.append(q.new_zeros((tail, q.shape[1], v.shape[-1]), dtype=torch.float32))
    lses.append(q.new_zeros((q.shape[1], tail), dtype=torch.float32))
    return torch.cat(outs), torch.cat(lses, dim=1)


def _args(args, kwargs):
    got = dict(zip(NAMES, args))
    got.update(kwargs)
    cu_q = got["cu_seq_q"].tolist()
    cu_k = (got.get("cu_seq_k") if got.get("cu_seq_k") is not None else got["cu_seq_q"]).tolist()
    return got, cu_q, cu_k, tuple(got.get("window_size") or (-1, -1)), bool(got.get("is_causal", False))


def cpu_varlen(*args, **kwargs):
    """The op's forward on the CPU: (out, lse, rng_state)."""
    got, cu_q, cu_k, window, causal = _args(args, kwargs)
    q = got["query"]
    out, lse = attend(q, got["key"], got["value"], cu_q, cu_k, causal, window, got.get("scale"))
    return out.to(q.dtype), lse, torch.zeros(2, dtype=torch.int64)


def cpu_varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                        rng_state, scale=None, window_size=None):
    """The op's backward on the CPU, per document in float32 (autograd does not run inside an op's kernel)."""
    scale = scale or 1.0 / math.sqrt(query.shape[-1])
    window = tuple(window_size or (-1, -1))
    g = query.shape[1] // key.shape[1]
    cu_q, cu_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    dq = torch.zeros(query.shape, dtype=torch.float32)
    dk = torch.zeros(key.shape, dtype=torch.float32)
    dv = torch.zeros(value.shape, dtype=torch.float32)
    for d in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[d], cu_q[d + 1]), slice(cu_k[d], cu_k[d + 1])
        q, do = query[qs].float(), grad_out[qs].float()
        k, v = key[ks].float().repeat_interleave(g, 1), value[ks].float().repeat_interleave(g, 1)
        s = torch.einsum("nhd,mhd->hnm", q, k) * scale
        s = s.masked_fill(~visible(s.shape[1], s.shape[2], bool(is_causal), window), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        dvh = torch.einsum("hnm,nhd->mhd", p, do)
        dp = torch.einsum("nhd,mhd->hnm", do, v)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        dq[qs] = torch.einsum("hnm,mhd->nhd", ds, k) * scale
        dkh = torch.einsum("hnm,nhd->mhd", ds, q) * scale
        dk[ks] = dkh.reshape(dkh.shape[0], -1, g, dkh.shape[-1]).sum(2)
        dv[ks] = dvh.reshape(dvh.shape[0], -1, g, dvh.shape[-1]).sum(2)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


if VARLEN_OP is not None:
    for name, fn in (("torch_attn::_varlen_attn", cpu_varlen), ("torch_attn::_varlen_attn_backward",
                                                                 cpu_varlen_backward)):
        try:
            torch.library.register_kernel(name, "cpu", fn)
        except RuntimeError:  # already registered
            pass
