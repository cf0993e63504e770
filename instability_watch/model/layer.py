"""Find a model's attention layers and the query projection ``W_Q`` of each head.

Layers are recognised by shape, not by name (first match wins; :mod:`~instability_watch.model.families`):

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
torchtitan                 ``GQAttention``: ``qkv_linear.wqkv`` grouped per key/value
                           head like GPT-NeoX's, or ``qkv_linear.wq``; its inner
                           attention (SDPA, FlexAttention, varlen) is observed and switched
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
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from instability_watch.errors import checking_keywords
from instability_watch.model.families import FAMILIES


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
        family: the built-in family whose locator found the layer (set by the locators; how
            ``qk_clip`` finds its key projection; :mod:`~instability_watch.model.families`). Leave it empty.

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
    family: str = ""

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
        if self.name is None:  # as the default: the module's qualified name, filled in when the watch attaches
            self.name = ""
        for name in ("name", "family"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"AttentionLayer.{name} must be a str, got {type(getattr(self, name)).__name__}")


AttentionLayer.__init__ = checking_keywords(AttentionLayer.__init__)


Layers = Union[Sequence[AttentionLayer], Callable[[nn.Module], Sequence[AttentionLayer]]]


# the child a wrapper holds its module as: FSDP1, activation checkpointing, torch.compile (``OptimizedModule``)
_WRAPPED = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def find_attention_layers(model: nn.Module) -> List[AttentionLayer]:
    """The attention layers of ``model`` that a built-in locator recognises, in module order."""
    found: List[AttentionLayer] = []
    for name, module in model.named_modules():
        if any(child in module._modules for child in _WRAPPED):
            # FSDP1's, activation checkpointing's and torch.compile's wrappers hand attribute reads on to the
            # module they wrap, so a wrapped attention module would be found twice: it is found as itself, one
            # level down
            continue
        for family in FAMILIES:
            hit = family.locate(module)
            if hit is not None:
                n_head, w_q = hit
                found.append(AttentionLayer(module, n_head, w_q, name or type(module).__name__,
                                            family=family.name))
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
        "qkv_proj, T5, litgpt's CausalSelfAttention, timm's Attention, torchtitan's GQAttention and "
        "nn.MultiheadAttention. Describe "
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
        found = layers(model)
        if isinstance(found, AttentionLayer) or not isinstance(found, Iterable):
            raise TypeError(f"layers, a function, must return a list of AttentionLayer, returned "
                            f"{type(found).__name__}")
        found = list(found)
    elif isinstance(layers, AttentionLayer) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be None, a list of AttentionLayer or a function of the model returning one, "
                        f"got {type(layers).__name__}")
    else:
        found = list(layers)
    seen = set()
    for i, layer in enumerate(found):
        if not isinstance(layer, AttentionLayer):
            raise TypeError(f"layers[{i}] must be an instability_watch.AttentionLayer, got {type(layer).__name__}")
        if not layer.name:
            layer.name = next((n for n, m in model.named_modules() if m is layer.module), f"layer{i}")
            layer.name = layer.name or type(layer.module).__name__  # the model itself: its qualified name is ""
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
    # observed: SDPA, the flex op, flash-attn 4's functions (observe.flash_attn), which HF imports from flash_attn.cute
    if impl is not None and impl not in ("sdpa", "flex_attention", "flash_attention_4"):
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
