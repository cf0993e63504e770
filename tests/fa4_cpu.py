"""A CPU stand-in for flash-attn 4 (``flash_attn.cute``), for tests: FA4 runs on NVIDIA GPUs only and is not a
dependency. :func:`install` puts modules named ``flash_attn``, ``flash_attn.cute`` and ``flash_attn.cute.interface``
into ``sys.modules``; their ``flash_attn_func`` and ``flash_attn_varlen_func`` apply two autograd functions,
``FlashAttnFunc`` and ``FlashAttnVarlenFunc``, whose ``forward`` takes FA4's arguments by FA4's names and order
(4.0.0b36) and returns ``(out, lse)`` as FA4 does (``lse`` None unless asked for or an input requires grad; -inf
for a row without keys). The attention itself is float32 math per document (causal and windows bottom-right
aligned and read as FA4 reads them, GQA, softcap); the features the watch refuses by name only need to be
accepted.
The real package is exercised on the GPU (tests/observe/test_flash_attn_gpu.py)."""
import importlib.machinery
import math
import sys
import types

import torch



def _visible(n_q, n_k, causal, window):
    """(n_q, n_k) bool, as FA4 reads ``causal`` and ``window_size``: bottom-right aligned; a side is unbounded when
    None or when both are negative; ``causal`` sets the right side to 0; any other negative side is a bound."""
    left, right = (None if w is None else int(w) for w in (window if window is not None else (None, None)))
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    a = torch.arange(n_q)[:, None] + (n_k - n_q)
    j = torch.arange(n_k)[None, :]
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    if left is not None:
        keep &= j >= a - left
    if right is not None:
        keep &= j <= a + right
    return keep


def _attend(q, k, v, cu_q, cu_k, causal, window, scale, softcap):
    """(out (T_q, H, D_v) float32, lse (H, T_q) float32; -inf for a row without keys) per document;
    differentiable."""
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for d in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[d]), int(cu_q[d + 1])), slice(int(cu_k[d]), int(cu_k[d + 1]))
        s = torch.einsum("nhd,mhd->hnm", q[qs].float(), k[ks].float().repeat_interleave(g, 1)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~_visible(s.shape[1], s.shape[2], causal, window), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        outs.append(torch.einsum("hnm,mhd->nhd", p, v[ks].float().repeat_interleave(g, 1)))
        lses.append(s.logsumexp(-1))
    return torch.cat(outs), torch.cat(lses, dim=1)


def _run(ctx, q, k, v, cu_q, cu_k, causal, window, scale, softcap, return_lse):
    """FA4's forward: ``out`` in ``q``'s dtype; ``lse`` when asked for or when an input requires grad, else None."""
    ctx.save_for_backward(q, k, v)
    ctx.args = (cu_q, cu_k, causal, window, scale, softcap)
    with torch.no_grad():
        out, lse = _attend(q, k, v, cu_q, cu_k, causal, window, scale, softcap)
    keep_lse = return_lse or any(t.requires_grad for t in (q, k, v))
    return out.to(q.dtype), lse if keep_lse else None


def _grads(ctx, dout):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        out, _ = _attend(qq, kk, vv, *ctx.args)
        dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), dout.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
        b, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
        flat = [t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v)]
        ctx.batch = (b, s_q)
        out, lse = _run(ctx, *flat, list(range(0, (b + 1) * s_q, s_q)), list(range(0, (b + 1) * s_k, s_k)),
                        causal, window_size, softmax_scale, softcap, return_lse)
        return (out.view(b, s_q, *out.shape[1:]),
                None if lse is None else lse.view(lse.shape[0], b, s_q).permute(1, 0, 2).contiguous())

    @staticmethod
    def backward(ctx, dout, dlse):
        b, s_q = ctx.batch
        dq, dk, dv = _grads(ctx, dout.reshape(b * s_q, *dout.shape[2:]))
        return (dq.view(b, -1, *dq.shape[1:]), dk.view(b, -1, *dk.shape[1:]), dv.view(b, -1, *dv.shape[1:]),
                *((None,) * 20))


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, gather_kv_indices=None, page_table=None,
                softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
                num_splits=1, pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None,
                mask_mod=None, block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
        return _run(ctx, q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), causal, window_size, softmax_scale,
                    softcap, return_lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_grads(ctx, dout), *((None,) * 30))


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                    gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    return FlashAttnFunc.apply(q, k, v, qv, gather_kv_indices, softmax_scale, causal, window_size, learnable_sink,
                               softcap, num_splits, pack_gqa, deterministic, score_mod, score_mod_bwd, mask_mod,
                               aux_tensors, aux_scalars, block_sparse_tensors, block_sparse_tensors_bwd, return_lse,
                               gather_bwd_recompute_p, gather_bwd_token_chunk)


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                           gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    # FA4's order here differs from its function's: the autograd function takes seqused_* before max_seqlen_*
    return FlashAttnVarlenFunc.apply(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                     max_seqlen_k, min_seqlen_k, gather_kv_indices, page_table, softmax_scale,
                                     causal, window_size, learnable_sink, softcap, num_splits, pack_gqa,
                                     deterministic, score_mod, score_mod_bwd, mask_mod, block_sparse_tensors,
                                     aux_tensors, aux_scalars, return_lse, scheduler_metadata, seqlen_k_per_split,
                                     disable_scheduler_metadata, gather_bwd_recompute_p, gather_bwd_token_chunk)


def install(monkeypatch):
    """The stand-in as ``flash_attn.cute`` for one test (``monkeypatch`` removes it afterwards)."""
    interface = types.ModuleType("flash_attn.cute.interface")
    for name in ("FlashAttnFunc", "FlashAttnVarlenFunc", "flash_attn_func", "flash_attn_varlen_func"):
        setattr(interface, name, globals()[name])
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    cute.flash_attn_func, cute.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    package = types.ModuleType("flash_attn")
    package.cute = cute
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute), ("flash_attn.cute.interface", interface)):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name != "flash_attn.cute.interface")
        monkeypatch.setitem(sys.modules, name, module)
    return cute
