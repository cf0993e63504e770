"""The model families the watch knows: for each, how to find its attention layers and where ``W_Q``/``W_K`` are.

One :class:`Family` per family, in :data:`FAMILIES` (first match wins, by shape, not name):
``locate(module)`` returns ``(num_heads, w_q)`` for a module of the family (``None``
otherwise), ``qk(module, num_heads)`` the :class:`~instability_watch.model.qk.QKProjections`
that QK-clip scales (``None`` where the family has none). :func:`qk_projections` builds
those for a list of watched layers. The module docstring of
:mod:`~instability_watch.model.layer` lists the families and what each recognises.

Adding a family: write its ``_locate_*`` (and ``_qk_*``) below and add a ``Family``
to :data:`FAMILIES`; :func:`~instability_watch.model.layer.find_attention_layers`
and QK-clip pick it up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn

from instability_watch.model.qk import QKProjections, qk_norm_of, user_projections

Located = Optional[Tuple[int, Callable[[], torch.Tensor]]]


# ---------------------------------------------------------------------------- shared helpers


def _heads_view(weight_rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(H * D, d_in)`` -> ``(H, D, d_in)``."""
    out, d_in = weight_rows.shape
    return weight_rows.view(num_heads, out // num_heads, d_in)


def _queries_first(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """The query rows of a fused ``[Q | K | V]`` weight: ``(H * D + ..., d_in)`` -> ``(H, D, d_in)``."""
    return _heads_view(weight[:num_heads * head_dim], num_heads)


def _grouped_queries(weight: torch.Tensor, num_heads: int, num_kv: int, head_dim: int) -> torch.Tensor:
    """The query rows of a weight grouped per key/value head, ``(KV * (H / KV + 2) * D, d_in)`` -> ``(H, D, d_in)``.

    Each group holds its ``H / KV`` query heads, then its key head, then its value head.
    """
    per_kv, d_in = num_heads // num_kv, weight.shape[1]
    groups = weight.view(num_kv, per_kv + 2, head_dim, d_in)  # (KV, H / KV + 2, D, d_in)
    return groups[:, :per_kv].reshape(num_heads, head_dim, d_in)  # (H, D, d_in); a copy when KV < H


def kv_heads(rows: int, num_heads: int, head_dim: int) -> Optional[int]:
    """``KV`` such that ``rows == (H + 2 * KV) * D`` and ``KV`` divides ``H``, else ``None``."""
    if head_dim < 1 or rows % head_dim or (rows // head_dim - num_heads) % 2:
        return None
    num_kv = (rows // head_dim - num_heads) // 2
    return num_kv if num_kv >= 1 and num_heads % num_kv == 0 else None


def int_attr(module: nn.Module, *names: str) -> Optional[int]:
    """The first of ``names`` that is an int on the module, else on its ``config``."""
    for owner in (module, getattr(module, "config", None)):
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _locate_nanogpt(module: nn.Module) -> Located:
    c_attn = getattr(module, "c_attn", None)
    n_head = getattr(module, "n_head", None)
    if not isinstance(c_attn, nn.Linear) or not isinstance(n_head, int):
        return None
    e = c_attn.in_features
    if c_attn.out_features != 3 * e or e % n_head:
        return None
    return n_head, lambda: _heads_view(c_attn.weight[:e], n_head)


def _locate_hf_gpt2(module: nn.Module) -> Located:
    c_attn = getattr(module, "c_attn", None)
    n_head = getattr(module, "num_heads", None)
    if c_attn is None or type(c_attn).__name__ != "Conv1D" or not isinstance(n_head, int):
        return None
    if getattr(module, "is_cross_attention", False):
        q_attn = module.q_attn
        return n_head, lambda: _heads_view(q_attn.weight.t(), n_head)
    # Conv1D stores (in, out); its out size from the attribute, not the weight's shape, which is a
    # piece of a flat shard under FSDP1 outside the forward
    e = c_attn.nf // 3 if isinstance(getattr(c_attn, "nf", None), int) else c_attn.weight.shape[1] // 3
    return n_head, lambda: _heads_view(c_attn.weight[:, :e].t(), n_head)


def _separate_linears(module: nn.Module, names: Tuple[str, ...], head_attrs: Tuple[str, ...]) -> Located:
    """A query projection that is its own ``nn.Linear`` beside the key (and value) ones.

    ``names[0]`` is the query module; every name must be an ``nn.Linear`` on ``module``. The head
    count is the first integer attribute of ``head_attrs``; it must divide the query's out features.
    """
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
        return None
    query = getattr(module, names[0])
    n_head = int_attr(module, *head_attrs)
    if n_head is None or query.out_features % n_head:
        return None
    return n_head, lambda: _heads_view(query.weight, n_head)


def _locate_q_proj(module: nn.Module) -> Located:
    """Llama-style ``q_proj`` / ``k_proj`` modules (Llama, Mistral, Qwen, Gemma, ...)."""
    return _separate_linears(module, ("q_proj", "k_proj"), ("num_heads", "num_attention_heads"))


def _locate_query_key_value(module: nn.Module) -> Located:
    """BERT-style ``query`` / ``key`` / ``value`` modules."""
    return _separate_linears(module, ("query", "key", "value"), ("num_attention_heads", "num_heads"))


def _locate_gpt_neox(module: nn.Module) -> Located:
    """``query_key_value`` grouped per key/value head (GPT-NeoX, Pythia, Falcon, Persimmon)."""
    fused = getattr(module, "query_key_value", None)
    n_head = int_attr(module, "num_heads", "num_attention_heads")
    if not isinstance(fused, nn.Linear) or n_head is None:
        return None
    head_dim = int_attr(module, "head_size", "head_dim") or fused.in_features // n_head
    n_kv = kv_heads(fused.out_features, n_head, head_dim)
    if n_kv is None:
        return None
    return n_head, lambda: _grouped_queries(fused.weight, n_head, n_kv, head_dim)


def _locate_phi3(module: nn.Module) -> Located:
    """``qkv_proj``, queries first, with ``num_key_value_heads`` (Phi-3; GQA included)."""
    fused = getattr(module, "qkv_proj", None)
    n_head = int_attr(module, "num_heads", "num_attention_heads")
    n_kv = int_attr(module, "num_key_value_heads")
    if not isinstance(fused, nn.Linear) or n_head is None or n_kv is None:
        return None
    head_dim = int_attr(module, "head_dim") or fused.in_features // n_head
    if n_kv < 1 or n_head % n_kv or fused.out_features != (n_head + 2 * n_kv) * head_dim:
        return None
    return n_head, lambda: _queries_first(fused.weight, n_head, head_dim)


def _locate_t5(module: nn.Module) -> Located:
    """``q`` / ``k`` / ``v`` / ``o`` with ``n_heads`` (T5, mT5; self- and cross-attention alike)."""
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in ("q", "k", "v", "o")):
        return None
    q = module.q
    n_head = int_attr(module, "n_heads", "num_heads")
    if n_head is None or q.out_features % n_head:
        return None
    return n_head, lambda: _heads_view(q.weight, n_head)


def _locate_litgpt(module: nn.Module) -> Located:
    """litgpt's ``CausalSelfAttention``: ``qkv`` queries first; a legacy ``attn`` grouped per query group."""
    n_head, groups = int_attr(module, "n_head"), int_attr(module, "n_query_groups")
    head_size = int_attr(module, "head_size")
    if n_head is None or groups is None or head_size is None or groups < 1 or n_head % groups:
        return None
    rows = (n_head + 2 * groups) * head_size
    fused = getattr(module, "qkv", None)
    if isinstance(fused, nn.Linear) and fused.out_features == rows:
        return n_head, lambda: _queries_first(fused.weight, n_head, head_size)
    legacy = getattr(module, "attn", None)
    if isinstance(legacy, nn.Linear) and legacy.out_features == rows:
        return n_head, lambda: _grouped_queries(legacy.weight, n_head, groups, head_size)
    return None


def _locate_timm(module: nn.Module) -> Located:
    """A fused ``qkv`` with ``num_heads``, rows ``(3, H, D)`` (timm's ``Attention`` and kin)."""
    fused = getattr(module, "qkv", None)
    n_head = getattr(module, "num_heads", None)
    if not isinstance(fused, nn.Linear) or not isinstance(n_head, int) or n_head < 1:
        return None
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int):
        head_dim = fused.out_features // (3 * n_head)
    if fused.out_features != 3 * n_head * head_dim:
        return None
    return n_head, lambda: _queries_first(fused.weight, n_head, head_dim)


def _locate_torchtitan(module: nn.Module) -> Located:
    """torchtitan's ``GQAttention``: ``qkv_linear`` holding ``wq`` (separate) or ``wqkv`` (fused, grouped per
    key/value head: its query heads, then its key head and value head), with ``n_heads``/``n_kv_heads``/``head_dim``."""
    qkv = getattr(module, "qkv_linear", None)
    n_head, n_kv, head_dim = (int_attr(module, n) for n in ("n_heads", "n_kv_heads", "head_dim"))
    if qkv is None or n_head is None or n_kv is None or head_dim is None or n_kv < 1 or n_head % n_kv:
        return None
    fused, query = getattr(qkv, "wqkv", None), getattr(qkv, "wq", None)
    if isinstance(fused, nn.Linear) and fused.out_features == (n_head + 2 * n_kv) * head_dim:
        return n_head, lambda: _grouped_queries(fused.weight, n_head, n_kv, head_dim)
    if isinstance(query, nn.Linear) and query.out_features == n_head * head_dim:
        return n_head, lambda: _heads_view(query.weight, n_head)
    return None


def _locate_mha(module: nn.Module) -> Located:
    if not isinstance(module, nn.MultiheadAttention):
        return None
    n_head, e = module.num_heads, module.embed_dim
    if module._qkv_same_embed_dim:
        return n_head, lambda: _heads_view(module.in_proj_weight[:e], n_head)
    return n_head, lambda: _heads_view(module.q_proj_weight, n_head)



# ---------------------------------------------------------------------------- where W_q and W_k are (QK-clip)


def _rep(f: torch.Tensor, d: int) -> torch.Tensor:
    return f.repeat_interleave(d)


def _attr(module: nn.Module, *path: str) -> Callable[[], Optional[torch.Tensor]]:
    def get():
        obj = module
        for name in path:
            obj = getattr(obj, name, None)
            if obj is None:
                return None
        return obj
    return get


def _qk_linear_pair(q: str, k: str) -> Callable[[nn.Module, int], Optional[QKProjections]]:
    """Separate query and key ``nn.Linear`` modules (Llama's q_proj/k_proj, BERT, T5)."""
    def build(module: nn.Module, n_head: int) -> Optional[QKProjections]:
        qm, km = getattr(module, q, None), getattr(module, k, None)
        if not isinstance(qm, nn.Linear) or not isinstance(km, nn.Linear) or qm.out_features % n_head:
            return None
        d = qm.out_features // n_head
        if km.out_features % d:
            return None
        kv = km.out_features // d
        fq = lambda fq, fk: _rep(fq, d)  # noqa: E731
        fk_ = lambda fq, fk: _rep(fk, d)  # noqa: E731
        return QKProjections(n_head, kv, d, [(_attr(module, q, "weight"), 0, fq), (_attr(module, q, "bias"), 0, fq),
                                         (_attr(module, k, "weight"), 0, fk_), (_attr(module, k, "bias"), 0, fk_)])
    return build


def _qk_queries_first(fused: str, n_head: int, n_kv: int, d: int, module: nn.Module, dim: int = 0,
                   bias: bool = True) -> QKProjections:
    """A fused ``[Q (H D) | K (KV D) | V (KV D)]`` projection along ``dim``."""
    def mult(fq, fk):
        return torch.cat([_rep(fq, d), _rep(fk, d), torch.ones(n_kv * d, dtype=fq.dtype, device=fq.device)])
    targets = [(_attr(module, fused, "weight"), dim, mult)]
    if bias:
        targets.append((_attr(module, fused, "bias"), 0, mult))
    return QKProjections(n_head, n_kv, d, targets)


def _qk_grouped(fused: str, n_head: int, n_kv: int, d: int, module: nn.Module) -> QKProjections:
    """A fused projection grouped per key head: ``(KV, H / KV + 2, D)`` rows (GPT-NeoX, litgpt's legacy ``attn``)."""
    per = n_head // n_kv

    def mult(fq, fk):
        ones = torch.ones(n_kv, 1, dtype=fq.dtype, device=fq.device)
        slots = torch.cat([fq.view(n_kv, per), fk.view(n_kv, 1), ones], dim=1)  # (KV, per + 2)
        return slots[..., None].expand(n_kv, per + 2, d).reshape(-1)
    return QKProjections(n_head, n_kv, d, [(_attr(module, fused, "weight"), 0, mult), (_attr(module, fused, "bias"), 0, mult)])


def _qk_nanogpt(module: nn.Module, n_head: int) -> Optional[QKProjections]:
    e = module.c_attn.in_features
    return _qk_queries_first("c_attn", n_head, n_head, e // n_head, module)


def _qk_hf_gpt2(module: nn.Module, n_head: int) -> Optional[QKProjections]:
    c_attn = module.c_attn
    nf = c_attn.nf if isinstance(getattr(c_attn, "nf", None), int) else c_attn.weight.shape[1]
    if getattr(module, "is_cross_attention", False):  # q_attn (C, E); c_attn (C, 2E) = [K | V]
        e = nf // 2
        d = e // n_head
        q = lambda fq, fk: _rep(fq, d)  # noqa: E731
        kv = lambda fq, fk: torch.cat([_rep(fk, d), torch.ones(e, dtype=fk.dtype, device=fk.device)])  # noqa: E731
        return QKProjections(n_head, n_head, d, [
            (_attr(module, "q_attn", "weight"), 1, q), (_attr(module, "q_attn", "bias"), 0, q),
            (_attr(module, "c_attn", "weight"), 1, kv), (_attr(module, "c_attn", "bias"), 0, kv)])
    e = nf // 3  # Conv1D stores (in, out): the heads run along the columns
    return _qk_queries_first("c_attn", n_head, n_head, e // n_head, module, dim=1)


def _qk_gpt_neox(module: nn.Module, n_head: int) -> Optional[QKProjections]:
    fused = module.query_key_value
    d = int_attr(module, "head_size", "head_dim") or fused.in_features // n_head
    return _qk_grouped("query_key_value", n_head, kv_heads(fused.out_features, n_head, d), d, module)


def _qk_phi3(module: nn.Module, n_head: int) -> Optional[QKProjections]:
    fused = module.qkv_proj
    d = int_attr(module, "head_dim") or fused.in_features // n_head
    return _qk_queries_first("qkv_proj", n_head, int_attr(module, "num_key_value_heads"), d, module)


def _qk_litgpt(module: nn.Module, n_head: int) -> Optional[QKProjections]:
    groups, d = int_attr(module, "n_query_groups"), int_attr(module, "head_size")
    rows = (n_head + 2 * groups) * d
    if isinstance(getattr(module, "qkv", None), nn.Linear) and module.qkv.out_features == rows:
        return _qk_queries_first("qkv", n_head, groups, d, module)
    return _qk_grouped("attn", n_head, groups, d, module)


def _qk_timm(module: nn.Module, n_head: int) -> Optional[QKProjections]:
    fused = module.qkv
    d = fused.out_features // (3 * n_head)
    projections = _qk_queries_first("qkv", n_head, n_head, d, module)
    if isinstance(getattr(module, "q_bias", None), torch.Tensor):  # BEiT-style: q_bias and v_bias, no k bias
        projections.targets.append((_attr(module, "q_bias"), 0, lambda fq, fk: _rep(fq, d)))
    return projections



@dataclass(frozen=True)
class Family:
    """One model family: its name (``AttentionLayer.family``), its locator and where its W_q and W_k are."""

    name: str
    locate: Callable[[nn.Module], Located]
    qk: Optional[Callable[[nn.Module, int], Optional[QKProjections]]] = None


FAMILIES = (
    Family("nanogpt", _locate_nanogpt, _qk_nanogpt),
    Family("hf-gpt2", _locate_hf_gpt2, _qk_hf_gpt2),
    Family("q_proj", _locate_q_proj, _qk_linear_pair("q_proj", "k_proj")),
    Family("query/key/value", _locate_query_key_value, _qk_linear_pair("query", "key")),
    Family("gpt-neox", _locate_gpt_neox, _qk_gpt_neox),
    Family("phi-3", _locate_phi3, _qk_phi3),
    Family("t5", _locate_t5, _qk_linear_pair("q", "k")),
    Family("litgpt", _locate_litgpt, _qk_litgpt),
    Family("timm", _locate_timm, _qk_timm),
    Family("torchtitan", _locate_torchtitan),  # no QK projections yet: QK-clip refuses it, by name
    Family("mha", _locate_mha),  # nn.MultiheadAttention: no QK projections (its calls: observe/mha.py)
)
_BY_NAME = {f.name: f for f in FAMILIES}


def qk_projections(layers, model: nn.Module) -> List[QKProjections]:
    """One :class:`QKProjections` per watched layer.

    Raises:
        ValueError: a layer with QK-norm, or one whose query/key projections are unknown
            (a user-described layer without ``w_k``; ``nn.MultiheadAttention``), naming each.
    """
    out, normed, unknown = [], [], []
    for layer in layers:
        norm = qk_norm_of(layer.module)
        if norm is not None:
            normed.append(f"{layer.name} ({norm})")
            continue
        if layer.w_k is not None:
            out.append(user_projections(layer, model))
            continue
        family = _BY_NAME.get(layer.family)
        built = family.qk(layer.module, layer.num_heads) if family is not None and family.qk is not None else None
        if built is None:
            unknown.append(f"{layer.name} ({type(layer.module).__name__})")
        else:
            out.append(built)
    if normed:
        raise ValueError(
            "qk_clip cannot act on layers with QK-norm: their queries and keys are normalised, so scaling W_q and "
            f"W_k does not change the logits. Layers: {', '.join(normed[:4])}{' ...' if len(normed) > 4 else ''}. "
            "QK-norm already bounds the logits; leave qk_clip off (None) for this model")
    if unknown:
        raise ValueError(
            "qk_clip needs to know where each layer's key projection is; it does not for: "
            f"{', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}. Describe these layers with "
            "AttentionLayer(module, num_heads, w_q=..., w_k=...) (w_k returning a (kv_heads, head_dim, d_in) view "
            "of the live key weight; b_q/b_k for biases), or leave qk_clip off")
    return out
