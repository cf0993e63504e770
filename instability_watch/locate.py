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
GPT-NeoX / Pythia          a fused ``query_key_value`` ``nn.Linear`` whose rows are
                           grouped per key/value head: ``(KV, H / KV + 2, D)``, the
                           group's query heads, then its key and value (GPT-NeoX,
                           Pythia, Falcon, Persimmon: ``KV = H``; Falcon's GQA and
                           multi-query layouts too)
Phi-3                      a fused ``qkv_proj`` ``nn.Linear``, queries first:
                           ``[Q (H * D) | K (KV * D) | V (KV * D)]``; GQA included
T5                         ``q`` / ``k`` / ``v`` / ``o`` ``nn.Linear`` modules and
                           ``n_heads`` (T5, mT5: encoder and decoder self-attention,
                           cross-attention); SDPA is called with ``scale=1`` and the
                           relative position bias as an additive mask
litgpt                     ``CausalSelfAttention``: a fused ``qkv`` ``nn.Linear``,
                           queries first ``[Q (H * D) | K (G * D) | V (G * D)]``
                           with ``G = config.n_query_groups``; a legacy fused
                           ``attn`` grouped per query group like GPT-NeoX's
timm                       ``Attention`` (ViT, DeiT, EVA, Swin, ...): a fused ``qkv``
                           ``nn.Linear`` with ``num_heads``, rows ``(3, H, D)``
``nn.MultiheadAttention``  ``in_proj_weight[:E]`` (or ``q_proj_weight``); its
                           attention cannot be observed (see ``observe.py``)
=========================  ==========================================================

Attention computed without ``F.scaled_dot_product_attention`` cannot be
observed: Hugging Face models built with another ``attn_implementation`` (see
:func:`without_sdpa`), timm with fused attention turned off, litgpt with
attention logit softcapping.

Anything else: pass ``layers=`` a list of :class:`AttentionLayer` (or a
function of the model returning one), naming the module, its number of query
heads and how to read ``W_Q`` per head.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

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
        w_k: for ``WatchConfig(qk_clip=...)`` only: a function returning the key
            projection per key head, ``(KV, head_dim, d_in)``, a view of the live
            weight (as ``w_q``'s result must then be); ``KV`` divides ``num_heads``.
        b_q, b_k: with ``w_k``, functions returning the query and key biases per
            head, ``(H, head_dim)`` and ``(KV, head_dim)`` views (``None``: no bias).
        layout: which built-in locator found the layer (set by the locators; how
            ``qk_clip`` finds its key projection). Leave it empty.

    Example::

        layer = AttentionLayer(block.attn, 8, lambda: block.attn.wq.weight.view(8, 64, 512))
        # with qk_clip, say where the keys are too:
        layer = AttentionLayer(block.attn, 8, lambda: block.attn.wq.weight.view(8, 64, 512),
                               w_k=lambda: block.attn.wk.weight.view(2, 64, 512))
    """

    module: nn.Module
    num_heads: int
    w_q: Callable[[], torch.Tensor]
    name: str = ""
    w_k: Optional[Callable[[], torch.Tensor]] = None
    b_q: Optional[Callable[[], torch.Tensor]] = None
    b_k: Optional[Callable[[], torch.Tensor]] = None
    layout: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"AttentionLayer.module must be an nn.Module, got {type(self.module).__name__}")
        if not isinstance(self.num_heads, int) or isinstance(self.num_heads, bool) or self.num_heads < 1:
            raise ValueError(f"AttentionLayer.num_heads must be a positive int, got {self.num_heads!r}")
        if not callable(self.w_q):
            raise TypeError(f"AttentionLayer.w_q must be callable (returning (H, head_dim, d_in)), got {type(self.w_q).__name__}")
        for name in ("w_k", "b_q", "b_k"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"AttentionLayer.{name} must be callable or None, got {type(value).__name__}")
        if self.w_k is None and (self.b_q is not None or self.b_k is not None):
            raise ValueError("AttentionLayer.b_q/b_k are used with w_k (for qk_clip): give w_k too")


Layers = Union[Sequence[AttentionLayer], Callable[[nn.Module], Sequence[AttentionLayer]]]
Located = Optional[Tuple[int, Callable[[], torch.Tensor]]]


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


def _kv_heads(rows: int, num_heads: int, head_dim: int) -> Optional[int]:
    """``KV`` such that ``rows == (H + 2 * KV) * D`` and ``KV`` divides ``H``, else ``None``."""
    if head_dim < 1 or rows % head_dim or (rows // head_dim - num_heads) % 2:
        return None
    num_kv = (rows // head_dim - num_heads) // 2
    return num_kv if num_kv >= 1 and num_heads % num_kv == 0 else None


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
    n_head = _int_attr(module, *head_attrs)
    if n_head is None or query.out_features % n_head:
        return None
    return n_head, lambda: _heads_view(query.weight, n_head)


def _q_proj(module: nn.Module) -> Located:
    """Llama-style ``q_proj`` / ``k_proj`` modules (Llama, Mistral, Qwen, Gemma, ...)."""
    return _separate_linears(module, ("q_proj", "k_proj"), ("num_heads", "num_attention_heads"))


def _query_key_value(module: nn.Module) -> Located:
    """BERT-style ``query`` / ``key`` / ``value`` modules."""
    return _separate_linears(module, ("query", "key", "value"), ("num_attention_heads", "num_heads"))


def _gpt_neox(module: nn.Module) -> Located:
    """``query_key_value`` grouped per key/value head (GPT-NeoX, Pythia, Falcon, Persimmon)."""
    fused = getattr(module, "query_key_value", None)
    n_head = _int_attr(module, "num_heads", "num_attention_heads")
    if not isinstance(fused, nn.Linear) or n_head is None:
        return None
    head_dim = _int_attr(module, "head_size", "head_dim") or fused.in_features // n_head
    n_kv = _kv_heads(fused.out_features, n_head, head_dim)
    if n_kv is None:
        return None
    return n_head, lambda: _grouped_queries(fused.weight, n_head, n_kv, head_dim)


def _phi3(module: nn.Module) -> Located:
    """``qkv_proj``, queries first, with ``num_key_value_heads`` (Phi-3; GQA included)."""
    fused = getattr(module, "qkv_proj", None)
    n_head = _int_attr(module, "num_heads", "num_attention_heads")
    n_kv = _int_attr(module, "num_key_value_heads")
    if not isinstance(fused, nn.Linear) or n_head is None or n_kv is None:
        return None
    head_dim = _int_attr(module, "head_dim") or fused.in_features // n_head
    if n_kv < 1 or n_head % n_kv or fused.out_features != (n_head + 2 * n_kv) * head_dim:
        return None
    return n_head, lambda: _queries_first(fused.weight, n_head, head_dim)


def _t5(module: nn.Module) -> Located:
    """``q`` / ``k`` / ``v`` / ``o`` with ``n_heads`` (T5, mT5; self- and cross-attention alike)."""
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in ("q", "k", "v", "o")):
        return None
    q = module.q
    n_head = _int_attr(module, "n_heads", "num_heads")
    if n_head is None or q.out_features % n_head:
        return None
    return n_head, lambda: _heads_view(q.weight, n_head)


def _litgpt(module: nn.Module) -> Located:
    """litgpt's ``CausalSelfAttention``: ``qkv`` queries first; a legacy ``attn`` grouped per query group."""
    n_head, groups = _int_attr(module, "n_head"), _int_attr(module, "n_query_groups")
    head_size = _int_attr(module, "head_size")
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


def _timm(module: nn.Module) -> Located:
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


def _mha(module: nn.Module) -> Located:
    if not isinstance(module, nn.MultiheadAttention):
        return None
    n_head, e = module.num_heads, module.embed_dim
    if module._qkv_same_embed_dim:
        return n_head, lambda: _heads_view(module.in_proj_weight[:e], n_head)
    return n_head, lambda: _heads_view(module.q_proj_weight, n_head)


LOCATORS = (
    ("nanogpt", _nanogpt), ("hf-gpt2", _hf_gpt2), ("q_proj", _q_proj), ("query/key/value", _query_key_value),
    ("gpt-neox", _gpt_neox), ("phi-3", _phi3), ("t5", _t5), ("litgpt", _litgpt), ("timm", _timm), ("mha", _mha),
)


def find_attention_layers(model: nn.Module) -> List[AttentionLayer]:
    """The attention layers of ``model`` that a built-in locator recognises, in module order."""
    found: List[AttentionLayer] = []
    for name, module in model.named_modules():
        for kind, locate in LOCATORS:
            hit = locate(module)
            if hit is not None:
                n_head, w_q = hit
                found.append(AttentionLayer(module, n_head, w_q, name or type(module).__name__, layout=kind))
                break
    return found


_ATTENTION_LIKE = re.compile("attention|attn", re.IGNORECASE)


def not_found_message(model: nn.Module) -> str:
    """Why no layer was found: the modules seen that look like attention, and how to describe them."""
    seen: Dict[str, List[str]] = {}  # class name -> qualified names
    for name, module in model.named_modules():
        cls = type(module).__name__
        if _ATTENTION_LIKE.search(cls):
            seen.setdefault(cls, []).append(name or "(the model)")
    if seen:
        saw = "modules that look like attention: " + ", ".join(
            f"{cls} ({len(names)}, e.g. {names[0]!r})" for cls, names in list(seen.items())[:6])
    else:
        saw = "no module's class name contains 'Attention' or 'Attn'"
    example = next(iter(seen), "MyAttention")
    return (
        f"no attention layers found in the model ({saw}). The built-in locators know nanoGPT, Hugging Face "
        "GPT-2, Llama-style q_proj/k_proj, BERT-style query/key/value, GPT-NeoX/Pythia query_key_value, Phi-3 "
        "qkv_proj, T5, litgpt's CausalSelfAttention, timm's Attention and nn.MultiheadAttention. Describe "
        "other layers with layers=[AttentionLayer(module, num_heads, w_q), ...]: the module whose forward calls "
        "F.scaled_dot_product_attention, its number of query heads, and a function returning its query "
        "projection per head, a (num_heads, head_dim, d_in) view of the weight; e.g. for a fused qkv Linear "
        "with the queries first (your module's own attribute names in place of qkv, n_heads, dim): "
        f"layers=[AttentionLayer(m, m.n_heads, lambda m=m: m.qkv.weight[:m.dim].view(m.n_heads, -1, m.dim)) "
        f"for m in model.modules() if type(m).__name__ == {example!r}]"
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
        raise ValueError(not_found_message(model))
    return found


def attention_implementation(module: nn.Module) -> Optional[str]:
    """The attention implementation a Hugging Face module was built with (``config._attn_implementation``).

    ``None`` for modules without a Hugging Face config (nanoGPT, user code).
    """
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def without_sdpa(module: nn.Module, model: Optional[nn.Module] = None) -> Optional[Tuple[str, str]]:
    """Why ``module`` computes attention without ``F.scaled_dot_product_attention``, and what to do about it.

    Args:
        module: a watched layer.
        model: the model it is in (to tell whether a Hugging Face architecture supports SDPA at all).

    Returns:
        ``(setting, remedy)``, e.g. ``("attn_implementation='eager'", "build it with attn_implementation=...")``;
        ``None`` where nothing says so (its calls are then observed, and a forward without any is counted).
    """
    impl = attention_implementation(module)
    if impl is not None and impl != "sdpa":
        setting = f"attn_implementation={impl!r}"
        # the outermost Hugging Face model: its class says whether the architecture supports SDPA
        hf_model = next((m for m in (model.modules() if model is not None else ())
                         if isinstance(getattr(type(m), "_supports_sdpa", None), bool)), None)
        if hf_model is not None and not type(hf_model)._supports_sdpa:
            version = getattr(sys.modules.get("transformers"), "__version__", "?")
            return setting, (f"{type(hf_model).__name__} cannot be built with attn_implementation='sdpa' "
                             f"(transformers {version} does not support it for this architecture), so its attention "
                             "cannot be watched")
        return setting, ("build it with attn_implementation='sdpa' (e.g. AutoModel.from_config(config, "
                         "attn_implementation='sdpa'))")
    if getattr(module, "fused_attn", None) is False:  # timm: TIMM_FUSED_ATTN=0 or set_fused_attn(False)
        return "timm's fused_attn=False", (
            "turn timm's fused attention on before building the model: timm.layers.set_fused_attn(True, "
            "experimental=True) or TIMM_FUSED_ATTN=2 (Swin and a few others use it only when 'experimental')")
    softcap = getattr(getattr(module, "config", None), "attention_logit_softcapping", None)
    if softcap is not None:  # litgpt computes softcapped attention by hand
        return f"attention_logit_softcapping={softcap!r}", (
            "litgpt computes softcapped attention by hand, so this model's attention cannot be watched")
    return None
