"""Statistics of a variable-length (packed) attention call: ``torch.nn.attention.varlen.varlen_attn``.

The call reaches the watch as PyTorch's ``torch_attn::_varlen_attn`` op: ``q (T_q, H, D)``, ``k, v (T_k, H_kv,
D)``, the documents' boundaries ``cu_seq_q``/``cu_seq_k`` (int32 ``(n + 1,)``), ``is_causal``, ``scale`` and
(PyTorch >= 2.11) ``window_size``. Document ``d`` holds query rows ``cu_seq_q[d] .. cu_seq_q[d + 1]`` and keys
``cu_seq_k[d] .. cu_seq_k[d + 1]``; a row sees only its own document's keys. Within a document, causal and window
masks are bottom-right aligned, as flash-attn's: row ``i`` (local index) sits at key position
``a = i + len_k - len_q``; ``window_size = (left, right)`` keeps keys ``a - left .. a + right`` (``-1``: no bound),
causal is ``right = 0``. Rows past ``cu_seq_q[-1]`` belong to no document and count nowhere.

The statistics and the shadow pass are those of :mod:`instability_watch.kernels.stats` on these scores,
computed document by document without a host sync: the document of every row and key is found on the device
(:func:`documents`); the statistics kernel takes them as a document mask (CUDA), the PyTorch path forms the
scores in chunks of query rows against all keys, masked by document.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from instability_watch.kernels.common import compute_dtype, documents
from instability_watch.kernels.stats.reference import (CHUNK_ELEMENTS, accumulate_rows, heads_problem, row_top_two,
                                                       store_rows)
from instability_watch.probe.fields import COUNT_ROW as _C
from instability_watch.probe.fields import VALUE_ROW as _V

try:  # PyTorch >= 2.10 registers the op when the module is imported
    import torch.nn.attention.varlen  # noqa: F401

    VARLEN_OP = torch.ops.torch_attn._varlen_attn
    # the op's argument names, read once here: a compiled call parses its arguments at trace time, and Dynamo
    # cannot iterate over a schema's arguments (fullgraph=True, as torchtitan compiles its blocks, would fail)
    _VARLEN_ARGS: Tuple[str, ...] = tuple(a.name for a in VARLEN_OP.default._schema.arguments)
except (ImportError, AttributeError, RuntimeError):  # pragma: no cover - an older PyTorch
    VARLEN_OP = None
    _VARLEN_ARGS = ()


@dataclass
class VarlenCall:
    """One call of the ``_varlen_attn`` op, its arguments by name (however they were passed)."""

    q: Tensor
    k: Tensor
    v: Tensor
    cu_seq_q: Tensor
    cu_seq_k: Optional[Tensor]
    is_causal: bool
    scale: Optional[float]
    window: Tuple[int, int]
    paged: bool  # seqused_k or block_table given (decoding from a cache)

    @classmethod
    def parse(cls, args, kwargs) -> "VarlenCall":
        """The call's arguments, by the op's schema (``TypeError`` for a call the op would refuse)."""
        names = _VARLEN_ARGS
        if len(args) > len(names):
            raise TypeError("_varlen_attn: too many arguments")
        got = dict(zip(names, args))
        got.update(kwargs)
        for need in ("query", "key", "value", "cu_seq_q"):
            if need not in got:
                raise TypeError(f"_varlen_attn: missing {need}")
        causal = bool(got.get("is_causal", False))
        window = got.get("window_size")
        window = (-1, 0 if causal else -1) if window is None else (int(window[0]), int(window[1]))
        if causal:
            window = (window[0], 0)
        return cls(got["query"], got["key"], got["value"], got["cu_seq_q"], got.get("cu_seq_k"), causal,
                   got.get("scale"), window, got.get("seqused_k") is not None or got.get("block_table") is not None)

    def unobservable(self, num_heads: int) -> Optional[str]:
        """Why the statistics cannot read this call (``None`` if they can)."""
        q, k = self.q, self.k
        if not all(isinstance(t, Tensor) for t in (q, k, self.v, self.cu_seq_q)):
            return "inputs are not tensors"
        if self.paged:
            return "keys from a paged cache (seqused_k or block_table)"
        if q.dim() != 3 or k.dim() != 3:
            return f"inputs not 3-D (T, H, D): q {tuple(q.shape)}"
        why = heads_problem(q, k, num_heads)
        if why is not None:
            return why
        cu_k = self.cu_seq_k if self.cu_seq_k is not None else self.cu_seq_q
        if self.cu_seq_q.dim() != 1 or cu_k.shape != self.cu_seq_q.shape:
            return "cu_seq_q and cu_seq_k are not two vectors of the same length"
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale)):
            return f"scale {self.scale!r}"
        return None


def _document_scores(q: Tensor, kf: Tensor, docs, window, i0: int, i1: int, scale: float, cdt) -> Tensor:
    """Scores of query rows ``i0 .. i1`` against every key, (H, n, T_k) in ``cdt``: a key of another document, or
    outside the window, at ``-inf``. ``kf``: the keys as (H_kv, 1, T_k, D) in ``cdt``."""
    doc_q, pos_q, doc_k, pos_k = docs
    n, H, D = i1 - i0, q.shape[1], q.shape[2]
    h_kv, t_k = kf.shape[0], kf.shape[2]
    qc = q[i0:i1].to(cdt).permute(1, 0, 2).reshape(h_kv, H // h_kv, n, D)
    s = (qc @ kf.transpose(-1, -2)).reshape(H, n, t_k) * scale
    keep = doc_q[i0:i1, None] == doc_k[None, :]
    a = pos_q[i0:i1, None]
    left, right = window
    if left >= 0:
        keep &= pos_k[None, :] >= a - left
    if right >= 0:
        keep &= pos_k[None, :] <= a + right
    return torch.where(keep, s, float("-inf"))


@torch.no_grad()
def varlen_stats(call: VarlenCall, o: Optional[Tensor], counts: Tensor, values: Tensor, *, eps: float,
                 triton: Optional[bool] = None) -> None:
    """The statistics pass over one varlen call (module docstring); adds into ``counts`` and ``values``.

    ``o``: the call's output ``(T_q, H, D_v)`` (rows with NaN/Inf count as non-finite) or None. ``triton``:
    the statistics kernel with its document mask (default where it can: CUDA, its dtypes and head dims),
    else PyTorch in chunks of rows.
    """
    from instability_watch.kernels.stats import triton_serves

    if triton is None:
        triton = triton_serves(call.q, call.k)
    with torch.autocast(call.q.device.type, enabled=False):
        if triton:
            _varlen_stats_triton(call, o, counts, values, float(eps))
        else:
            _varlen_stats(call, o, counts, values, float(eps))


@torch.no_grad()
def varlen_shadow(call: VarlenCall, o: Tensor, do: Tensor, counts: Tensor, values: Tensor, *,
                  triton: Optional[bool] = None) -> None:
    """The shadow pass over one varlen call: ``delta_lp = rowsum(dO * O)`` from the call's output against
    ``delta_hp = sum_j P_ij (dO_i . v_j) / sum_j P_ij`` on the same documents (``P`` unrounded), over the rows
    that see a key; adds ``shadow_rows``, ``delta_err_*`` into ``counts`` and ``values``. ``o``, ``do``:
    ``(T_q, H, D_v)``."""
    from instability_watch.kernels.stats import triton_serves

    if triton is None:
        triton = triton_serves(call.q, call.k, call.v)
    scale = float(call.scale) if call.scale is not None else 1.0 / math.sqrt(call.q.shape[-1])
    with torch.autocast(call.q.device.type, enabled=False):
        if triton:
            from instability_watch.kernels.stats.triton import attention_shadow_documents

            attention_shadow_documents(call.q, call.k, call.v, o, do, _document_vector(call),
                                       call.cu_seq_q.numel() - 1, call.window, counts, values, scale=scale)
        else:
            cu_k = call.cu_seq_k if call.cu_seq_k is not None else call.cu_seq_q
            docs = documents(call.cu_seq_q, cu_k, call.q.shape[0], call.k.shape[0])
            _varlen_shadow(call, o, do, docs, counts, values, scale)


def _document_vector(call: VarlenCall) -> Tensor:
    """The statistics kernel's document vector ``[doc_q, pos_q, doc_k, pos_k, cu_seq_k]`` (int64): kept with the
    batch's documents where the watch keeps them for the step (``KEEP_DOCUMENTS``: the layers of a step pass the
    same boundaries), else found on the device."""
    from instability_watch.kernels.attention.ops import KEEP_DOCUMENTS, kept_documents

    t_q, t_k = call.q.shape[0], call.k.shape[0]
    cu_k = call.cu_seq_k if call.cu_seq_k is not None else call.cu_seq_q
    if not torch.compiler.is_compiling() and KEEP_DOCUMENTS.get():  # (Dynamo cannot trace the get)
        return kept_documents(call.cu_seq_q, cu_k, t_q, t_k, call.window).stats_vector()
    return torch.cat([*documents(call.cu_seq_q, cu_k, t_q, t_k), cu_k.long()])


def _varlen_shadow(call: VarlenCall, o: Tensor, do: Tensor, docs, counts: Tensor, values: Tensor,
                   scale: float) -> None:
    q, k, v = call.q, call.k, call.v
    t_q, H, D = q.shape
    t_k, h_kv, d_v = k.shape[0], k.shape[1], v.shape[2]
    g = H // h_kv
    cdt = compute_dtype(q.dtype)
    doc_q = docs[0]
    n_docs = call.cu_seq_q.numel() - 1
    kf = k.to(cdt).permute(1, 0, 2).unsqueeze(1)  # (H_kv, 1, T_k, D)
    vt = v.to(cdt).permute(1, 2, 0).unsqueeze(1)  # (H_kv, 1, D_v, T_k)
    n_rows = torch.zeros(H, dtype=torch.int64, device=q.device)
    n_pos = torch.zeros(H, dtype=torch.int64, device=q.device)
    e_sum = torch.zeros(H, dtype=cdt, device=q.device)
    e_abs = torch.zeros(H, dtype=cdt, device=q.device)
    step = max(1, min(t_q, CHUNK_ELEMENTS // max(1, H * t_k)))
    for i0 in range(0, t_q, step):
        i1 = min(t_q, i0 + step)
        n = i1 - i0
        s = _document_scores(q, kf, docs, call.window, i0, i1, scale, cdt)
        t1 = s.amax(dim=-1)
        live = ~torch.isneginf(t1) & (doc_q[i0:i1] < n_docs)
        p = torch.exp(s - torch.where(torch.isneginf(t1), 0.0, t1)[..., None])
        do_c = do[i0:i1].to(cdt).permute(1, 0, 2)  # (H, n, D_v)
        dp = (do_c.reshape(h_kv, g, n, d_v) @ vt).reshape(H, n, t_k)
        delta_hp = (p * dp).sum(dim=-1) / p.sum(dim=-1)
        delta_lp = (do_c * o[i0:i1].to(cdt).permute(1, 0, 2)).sum(dim=-1)
        err = torch.where(live, delta_lp - delta_hp, 0.0)
        n_rows += live.sum(dim=1)
        n_pos += (err > 0).sum(dim=1)
        e_sum += err.sum(dim=1)
        e_abs += err.abs().sum(dim=1)
    counts[_C["shadow_rows"]] += n_rows
    counts[_C["delta_err_pos"]] += n_pos
    values[_V["delta_err_sum"]] += e_sum.to(values.dtype)
    values[_V["delta_err_abs"]] += e_abs.to(values.dtype)


def _varlen_stats_triton(call: VarlenCall, o: Optional[Tensor], counts: Tensor, values: Tensor, eps: float) -> None:
    from instability_watch.kernels.stats.triton import attention_stats_documents

    scale = float(call.scale) if call.scale is not None else 1.0 / math.sqrt(call.q.shape[-1])
    attention_stats_documents(call.q, call.k, o, _document_vector(call), call.cu_seq_q.numel() - 1, call.window,
                              counts, values, scale=scale, eps=eps)


def _varlen_stats(call: VarlenCall, o: Optional[Tensor], counts: Tensor, values: Tensor, eps: float) -> None:
    q, k = call.q, call.k
    t_q, H, D = q.shape
    t_k = k.shape[0]
    cdt = compute_dtype(q.dtype)
    scale = float(call.scale) if call.scale is not None else 1.0 / math.sqrt(D)
    cu_k = call.cu_seq_k if call.cu_seq_k is not None else call.cu_seq_q
    n_docs = call.cu_seq_q.numel() - 1
    docs = documents(call.cu_seq_q, cu_k, t_q, t_k)
    doc_q = docs[0]
    kf = k.to(cdt).permute(1, 0, 2).unsqueeze(1)  # (H_kv, 1, T_k, D)
    acc = torch.zeros(4, H, dtype=torch.int64, device=q.device)
    top = torch.full((H,), float("-inf"), dtype=cdt, device=q.device)
    step = max(1, min(t_q, CHUNK_ELEMENTS // max(1, H * t_k)))
    for i0 in range(0, t_q, step):
        i1 = min(t_q, i0 + step)
        n = i1 - i0
        s = _document_scores(q, kf, docs, call.window, i0, i1, scale, cdt)
        t1, t2, nan = row_top_two(s)
        o_rows = None if o is None else o[i0:i1].permute(1, 0, 2).unsqueeze(0)
        valid = (doc_q[i0:i1] < n_docs).view(1, 1, n)
        top = accumulate_rows(t1.unsqueeze(0), (t2 >= t1 - eps).unsqueeze(0), nan.unsqueeze(0), o_rows, acc, top,
                              valid=valid)
    store_rows(acc, top, counts, values)
