"""Find a model's attention layers and the query projection ``W_Q`` of each head.

Layers are recognised by shape, not by name (first match wins):

=========================  ==========================================================
nanoGPT                    a fused ``c_attn`` ``nn.Linear`` (``3 * n_embd`` outputs)
                           and an ``n_head`` attribute; ``W_Q`` = first third of
                           ``c_attn.weight``
Hugging Face GPT-2         ``GPT2Attention``: ``c_attn`` ``Conv1D`` (weight stored
                           transposed, ``(in, 3 * out)``); ``q_attn`` for
                           cross-attention
Llama and kin              a ``q_proj`` ``nn.Linear`` with ``k_proj`` beside it
                           (Llama, Mistral, Qwen, Gemma, ...), heads from
                           ``num_heads`` or ``config.num_attention_heads``; GQA included
BERT and kin               ``query`` / ``key`` / ``value`` ``nn.Linear`` modules
                           (BERT, RoBERTa, ViT, ...), heads from
                           ``num_attention_heads`` (or the config's)
``nn.MultiheadAttention``  ``in_proj_weight[:E]`` (or ``q_proj_weight``); its
                           attention cannot be observed (see ``observe.py``)
=========================  ==========================================================

Anything else: pass ``layers=`` a list of :class:`AttentionLayer` (or a
function of the model returning one), naming the module, its number of query
heads and how to read ``W_Q`` per head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn


@dataclass
class AttentionLayer:
    """How to watch one attention layer.

    Args:
        module: the module whose ``forward`` calls ``F.scaled_dot_product_attention``.
        num_heads: its number of query heads ``H``.
        w_q: a function of no arguments returning the query projection per head,
            a tensor ``(H, head_dim, d_in)`` (a view of the live weight: it is
            called on every spectral step).
        name: a label for reports; defaults to the module's qualified name.

    Example::

        layer = AttentionLayer(block.attn, 8, lambda: block.attn.wq.weight.view(8, 64, 512))
    """

    module: nn.Module
    num_heads: int
    w_q: Callable[[], torch.Tensor]
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"AttentionLayer.module must be an nn.Module, got {type(self.module).__name__}")
        if not isinstance(self.num_heads, int) or isinstance(self.num_heads, bool) or self.num_heads < 1:
            raise ValueError(f"AttentionLayer.num_heads must be a positive int, got {self.num_heads!r}")
        if not callable(self.w_q):
            raise TypeError(f"AttentionLayer.w_q must be callable (returning (H, head_dim, d_in)), got {type(self.w_q).__name__}")


Layers = Union[Sequence[AttentionLayer], Callable[[nn.Module], Sequence[AttentionLayer]]]
Located = Optional[Tuple[int, Callable[[], torch.Tensor]]]


def _heads_view(weight_rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(H * D, d_in)`` -> ``(H, D, d_in)``."""
    out, d_in = weight_rows.shape
    return weight_rows.view(num_heads, out // num_heads, d_in)


def _int_attr(module: nn.Module, *names: str) -> Optional[int]:
    """The first of ``names`` that is an int on the module, else on its ``config``."""
    for owner in (module, getattr(module, "config", None)):
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _nanogpt(module: nn.Module) -> Located:
    c_attn = getattr(module, "c_attn", None)
    n_head = getattr(module, "n_head", None)
    if not isinstance(c_attn, nn.Linear) or not isinstance(n_head, int):
        return None
    e = c_attn.in_features
    if c_attn.out_features != 3 * e or e % n_head:
        return None
    return n_head, lambda: _heads_view(c_attn.weight[:e], n_head)


def _hf_gpt2(module: nn.Module) -> Located:
    c_attn = getattr(module, "c_attn", None)
    n_head = getattr(module, "num_heads", None)
    if c_attn is None or type(c_attn).__name__ != "Conv1D" or not isinstance(n_head, int):
        return None
    if getattr(module, "is_cross_attention", False):
        q_attn = module.q_attn
        return n_head, lambda: _heads_view(q_attn.weight.t(), n_head)
    e = c_attn.weight.shape[0]  # Conv1D stores (in, out)
    return n_head, lambda: _heads_view(c_attn.weight[:, :e].t(), n_head)


def _q_proj(module: nn.Module) -> Located:
    q_proj = getattr(module, "q_proj", None)
    if not isinstance(q_proj, nn.Linear) or not isinstance(getattr(module, "k_proj", None), nn.Linear):
        return None
    n_head = _int_attr(module, "num_heads", "num_attention_heads")
    if n_head is None or q_proj.out_features % n_head:
        return None
    return n_head, lambda: _heads_view(q_proj.weight, n_head)


def _query_key_value(module: nn.Module) -> Located:
    query = getattr(module, "query", None)
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in ("query", "key", "value")):
        return None
    n_head = _int_attr(module, "num_attention_heads", "num_heads")
    if n_head is None or query.out_features % n_head:
        return None
    return n_head, lambda: _heads_view(query.weight, n_head)


def _mha(module: nn.Module) -> Located:
    if not isinstance(module, nn.MultiheadAttention):
        return None
    n_head, e = module.num_heads, module.embed_dim
    if module._qkv_same_embed_dim:
        return n_head, lambda: _heads_view(module.in_proj_weight[:e], n_head)
    return n_head, lambda: _heads_view(module.q_proj_weight, n_head)


LOCATORS = (
    ("nanogpt", _nanogpt), ("hf-gpt2", _hf_gpt2), ("q_proj", _q_proj), ("query/key/value", _query_key_value),
    ("mha", _mha),
)


def find_attention_layers(model: nn.Module) -> List[AttentionLayer]:
    """The attention layers of ``model`` that a built-in locator recognises, in module order."""
    found: List[AttentionLayer] = []
    for name, module in model.named_modules():
        for _, locate in LOCATORS:
            hit = locate(module)
            if hit is not None:
                n_head, w_q = hit
                found.append(AttentionLayer(module, n_head, w_q, name or type(module).__name__))
                break
    return found


NOT_FOUND = (
    "no attention layers found in the model: the built-in locators know nanoGPT (c_attn + n_head), "
    "Hugging Face GPT-2 (GPT2Attention), Llama-style q_proj/k_proj modules, BERT-style query/key/value "
    "modules and nn.MultiheadAttention; describe other models with "
    "layers=[AttentionLayer(module, num_heads, w_q), ...]"
)


def resolve_layers(model: nn.Module, layers: Optional[Layers]) -> List[AttentionLayer]:
    """``layers`` as a checked list with names filled in (``None``: the built-in locators).

    Raises:
        TypeError: an entry is not an :class:`AttentionLayer`.
        ValueError: nothing found, or a module listed twice.
    """
    if layers is None:
        found = find_attention_layers(model)
    elif callable(layers):
        found = list(layers(model))
    else:
        found = list(layers)
    seen = set()
    for i, layer in enumerate(found):
        if not isinstance(layer, AttentionLayer):
            raise TypeError(f"layers[{i}] must be an instability_watch.AttentionLayer, got {type(layer).__name__}")
        if not layer.name:
            layer.name = next((n for n, m in model.named_modules() if m is layer.module), f"layer{i}")
        if id(layer.module) in seen:
            raise ValueError(f"layer {layer.name!r} is listed twice")
        seen.add(id(layer.module))
    if not found:
        raise ValueError(NOT_FOUND)
    return found


def attention_implementation(module: nn.Module) -> Optional[str]:
    """The attention implementation a Hugging Face module was built with (``config._attn_implementation``).

    ``None`` for modules without a Hugging Face config (nanoGPT, user code).
    """
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return impl if isinstance(impl, str) else None
