"""Find a model's attention layers and route their SDPA calls through our kernels.

Nothing in the model's code changes. For each attention layer the watch wraps
the module's ``forward`` (an instance attribute, removed again on
:meth:`Attachment.detach`) so that it runs inside a ``TorchFunctionMode``. The
mode catches ``F.scaled_dot_product_attention`` calls made while that layer
runs and sends them to :func:`~instability_watch.flash_attention` with the
layer's :class:`~instability_watch.Probe` and per-head ``stabilize`` mask.
Calls the kernels cannot serve (an explicit ``attn_mask``, dropout, an
unsupported head dim or dtype) go to PyTorch's SDPA unchanged; they are counted
as unwatched and reported once per layer and reason.

Layers are recognised by shape, not by name (first match wins):

=========================  ==========================================================
nanoGPT                    a fused ``c_attn`` ``nn.Linear`` (``3 * n_embd`` outputs)
                           and an ``n_head`` attribute; ``W_Q`` = first third of
                           ``c_attn.weight``
Hugging Face GPT-2         ``GPT2Attention``: ``c_attn`` ``Conv1D`` (weight stored
                           transposed, ``(in, 3 * out)``); ``q_attn`` for
                           cross-attention
Llama and kin              a ``q_proj`` ``nn.Linear`` with ``k_proj`` beside it
                           (Llama, Mistral, Qwen, ...), heads from ``num_heads``
                           or ``config.num_attention_heads``; GQA included
``nn.MultiheadAttention``  ``in_proj_weight[:E]`` (or ``q_proj_weight``); only its
                           ``need_weights=False`` calls reach SDPA
=========================  ==========================================================

Anything else: pass ``layers=`` a list of :class:`AttentionLayer` (or a
function of the model returning one), naming the module, its number of query
heads and how to read ``W_Q`` per head.
"""
from __future__ import annotations

import logging
import math
import types
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .kernels import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, flash_attention
from .kernels.ops import ERROR_HANDLER as _ERROR_HANDLER
from .probe import COUNT_FIELDS, VALUE_FIELDS, Probe

log = logging.getLogger("instability_watch")

_SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


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


# ----------------------------------------------------------------------------- locators


def _heads_view(weight_rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(H * D, d_in)`` -> ``(H, D, d_in)``."""
    out, d_in = weight_rows.shape
    return weight_rows.view(num_heads, out // num_heads, d_in)


def _nanogpt(module: nn.Module) -> Optional[Tuple[int, Callable[[], torch.Tensor]]]:
    c_attn = getattr(module, "c_attn", None)
    n_head = getattr(module, "n_head", None)
    if not isinstance(c_attn, nn.Linear) or not isinstance(n_head, int):
        return None
    e = c_attn.in_features
    if c_attn.out_features != 3 * e or e % n_head:
        return None
    return n_head, lambda: _heads_view(c_attn.weight[:e], n_head)


def _hf_gpt2(module: nn.Module) -> Optional[Tuple[int, Callable[[], torch.Tensor]]]:
    c_attn = getattr(module, "c_attn", None)
    n_head = getattr(module, "num_heads", None)
    if c_attn is None or type(c_attn).__name__ != "Conv1D" or not isinstance(n_head, int):
        return None
    if getattr(module, "is_cross_attention", False):
        q_attn = module.q_attn
        return n_head, lambda: _heads_view(q_attn.weight.t(), n_head)
    e = c_attn.weight.shape[0]  # Conv1D stores (in, out)
    return n_head, lambda: _heads_view(c_attn.weight[:, :e].t(), n_head)


def _q_proj(module: nn.Module) -> Optional[Tuple[int, Callable[[], torch.Tensor]]]:
    q_proj = getattr(module, "q_proj", None)
    if not isinstance(q_proj, nn.Linear) or not isinstance(getattr(module, "k_proj", None), nn.Linear):
        return None
    n_head = getattr(module, "num_heads", None)
    if not isinstance(n_head, int):
        n_head = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if not isinstance(n_head, int) or q_proj.out_features % n_head:
        return None
    return n_head, lambda: _heads_view(q_proj.weight, n_head)


def _mha(module: nn.Module) -> Optional[Tuple[int, Callable[[], torch.Tensor]]]:
    if not isinstance(module, nn.MultiheadAttention):
        return None
    n_head, e = module.num_heads, module.embed_dim
    if module._qkv_same_embed_dim:
        return n_head, lambda: _heads_view(module.in_proj_weight[:e], n_head)
    return n_head, lambda: _heads_view(module.q_proj_weight, n_head)


_LOCATORS = (("nanogpt", _nanogpt), ("hf-gpt2", _hf_gpt2), ("q_proj", _q_proj), ("mha", _mha))


def find_attention_layers(model: nn.Module) -> List[AttentionLayer]:
    """The attention layers of ``model`` that a built-in locator recognises, in module order."""
    found: List[AttentionLayer] = []
    for name, module in model.named_modules():
        for _, locate in _LOCATORS:
            hit = locate(module)
            if hit is not None:
                n_head, w_q = hit
                found.append(AttentionLayer(module, n_head, w_q, name or type(module).__name__))
                break
    return found


# ----------------------------------------------------------------------------- probes


class ProbeBank:
    """The probes of all layers as views into two flat device buffers.

    Layer ``l`` owns a contiguous ``(len(COUNT_FIELDS), H_l)`` block of
    ``counts`` and a ``(len(VALUE_FIELDS), H_l)`` block of ``values``, so one
    copy snapshots every layer and one fill resets them.
    """

    def __init__(self, head_counts: Sequence[int], device: torch.device | str = "cpu") -> None:
        self.head_counts = list(head_counts)
        self.uniform = len(set(self.head_counts)) <= 1
        nc, nv = len(COUNT_FIELDS), len(VALUE_FIELDS)
        total = sum(self.head_counts)
        self.counts = torch.zeros(nc * total, dtype=torch.int64, device=device)
        self.values = torch.zeros(nv * total, dtype=torch.float32, device=device)
        self._reset_values = torch.tensor(
            [float("-inf") if f == "max_score" else 0.0 for f in VALUE_FIELDS], dtype=torch.float32
        )
        self.probes: List[Probe] = []
        self._make_views()
        self.zero_()

    @property
    def device(self) -> torch.device:
        return self.counts.device

    def _make_views(self) -> None:
        nc, nv = len(COUNT_FIELDS), len(VALUE_FIELDS)
        old = self.probes
        self.probes = []
        oc = ov = 0
        for i, h in enumerate(self.head_counts):
            p = Probe.from_buffers(self.counts[oc:oc + nc * h].view(nc, h), self.values[ov:ov + nv * h].view(nv, h))
            if old:
                p.shadow = old[i].shadow
            self.probes.append(p)
            oc += nc * h
            ov += nv * h
        self._value_reset = torch.cat(
            [self._reset_values.to(self.device)[:, None].expand(nv, h).reshape(-1) for h in self.head_counts]
        ) if self.head_counts else self.values.clone()

    def to(self, device: torch.device | str) -> "ProbeBank":
        """Move all buffers (keeping their contents); probes are rebuilt as views."""
        self.counts = self.counts.to(device)
        self.values = self.values.to(device)
        self._make_views()
        return self

    def zero_(self) -> None:
        self.counts.zero_()
        self.values.copy_(self._value_reset)

    def set_shadow(self, on: bool) -> None:
        for p in self.probes:
            p.shadow = on


# ----------------------------------------------------------------------------- routing


@dataclass
class Site:
    """One watched attention layer: its probe, its stabilize mask and call counts."""

    index: int
    layer: AttentionLayer
    attachment: "Attachment"
    stabilize: torch.Tensor
    watched_calls: int = 0
    unwatched_calls: int = 0
    unwatched_reasons: Dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def num_heads(self) -> int:
        return self.layer.num_heads

    @property
    def probe(self) -> Probe:
        return self.attachment.bank.probes[self.index]


class _Router(TorchFunctionMode):
    """Entered around one layer's forward: SDPA calls go to ``flash_attention``."""

    def __init__(self, site: Site) -> None:
        super().__init__()
        self.site = site

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA and self.site.attachment.routing:
            out = self.site.attachment._route(self.site, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


# module -> (router, the forward it had before): the wrapper looks its router up
# here, so a deepcopy of a watched model (an EMA or eval copy) runs unrouted on
# its own weights instead of through the original's, and pickling works.
_ROUTED: "weakref.WeakKeyDictionary[nn.Module, Tuple[_Router, Optional[Callable]]]" = weakref.WeakKeyDictionary()


def _routed_forward(self: nn.Module, *args, **kwargs):
    entry = _ROUTED.get(self)
    if entry is None:  # a copy of a watched module
        return type(self).forward(self, *args, **kwargs)
    router, own = entry
    with router:
        if own is not None:
            return own(*args, **kwargs)
        return type(self).forward(self, *args, **kwargs)


def _unsupported(site: Site, q, k, v, attn_mask, dropout_p, scale, enable_gqa) -> Optional[str]:
    """Why the kernels cannot serve this SDPA call (None if they can)."""
    if attn_mask is not None:
        return "attn_mask"
    if dropout_p:
        return "dropout"
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "not 4-D (B, H, N, D)"
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape != k.shape:
        return f"head dims q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}"
    if q.shape[1] != site.num_heads:
        return f"{q.shape[1]} query heads, the layer was described with {site.num_heads}"
    if k.shape[1] != q.shape[1] and (not enable_gqa or q.shape[1] % k.shape[1]):
        return "key/value heads differ from query heads without enable_gqa"
    if k.shape[0] != q.shape[0] or q.shape[2] < 1 or k.shape[2] < 1:
        return "shape"
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        return f"scale {scale!r}"
    return None


class Attachment:
    """The watched layers of one model; created by :func:`attach`, undone by :meth:`detach`.

    Attributes:
        sites: one :class:`Site` per layer, in module order.
        bank: the layers' probes (:class:`ProbeBank`).
        routing: while ``False`` every SDPA call goes to PyTorch (the watch's
            fail-open switch).
        on_error: called with the exception if routing a call fails; the call
            then goes to PyTorch's SDPA. Set by the engine; default re-raises.
    """

    def __init__(
        self, model: nn.Module, layers: Sequence[AttentionLayer], *, beta: float, eps: float, probes: bool = True
    ) -> None:
        self.model = model
        self.probes = bool(probes)
        self.beta, self.eps = float(beta), float(eps)
        self.routing = True
        self.on_error: Optional[Callable[[BaseException], None]] = None
        self._reported: set = set()
        device = _param_device(model)
        self.bank = ProbeBank([layer.num_heads for layer in layers], device)
        self.sites: List[Site] = []
        seen = set()
        for i, layer in enumerate(layers):
            if id(layer.module) in seen:
                raise ValueError(f"layer {layer.name or i!r} is listed twice")
            seen.add(id(layer.module))
            mask = torch.zeros(layer.num_heads, dtype=torch.bool, device=device)
            self.sites.append(Site(i, layer, self, mask))
        self.attached = True
        try:
            for site in self.sites:
                self._wrap(site)
        except Exception:
            self.detach()
            raise
        for site in self.sites:
            if isinstance(site.layer.module, nn.MultiheadAttention):
                _log_rank_zero(
                    logging.WARNING,
                    "instability_watch: layer %s is an nn.MultiheadAttention: its attention cannot be routed "
                    "(F.multi_head_attention_forward hides its SDPA call), only sigma(W_Q) is watched",
                    site.name,
                )

    # -- install / remove --------------------------------------------------------------

    def _wrap(self, site: Site) -> None:
        module = site.layer.module
        if module in _ROUTED:
            raise ValueError(f"layer {site.name!r} is already watched by another attachment; detach that one first")
        own = module.__dict__.get("forward")  # an instance-level forward the user set, if any
        _ROUTED[module] = (_Router(site), own)
        module.forward = types.MethodType(_routed_forward, module)

    def detach(self) -> None:
        """Restore every module's ``forward`` exactly as it was."""
        if not self.attached:
            return
        for site in self.sites:
            module = site.layer.module
            entry = _ROUTED.pop(module, None)
            if entry is None:
                continue
            own = entry[1]
            if own is not None:
                module.forward = own
            else:
                module.__dict__.pop("forward", None)
        self.attached = False

    # -- the routed call ---------------------------------------------------------------

    def _route(self, site: Site, args, kwargs):
        bound = dict(zip(_SDPA_ARGS, args))
        bound.update(kwargs)
        q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
        attn_mask = bound.get("attn_mask")
        dropout_p = bound.get("dropout_p", 0.0)
        is_causal = bool(bound.get("is_causal", False))
        scale = bound.get("scale")
        enable_gqa = bool(bound.get("enable_gqa", False))
        reason = _unsupported(site, q, k, v, attn_mask, dropout_p, scale, enable_gqa)
        if reason is not None:
            self._count_unwatched(site, reason)
            return None
        if site.stabilize.device != q.device:
            if _param_device(self.model) != q.device:
                self._count_unwatched(site, f"layer on {q.device}, apart from the model's other layers")
                return None
            self._relocate(q.device)  # the model was moved after attaching
        compiling = torch.compiler.is_compiling()
        token = None if compiling else _ERROR_HANDLER.set(self.on_error)
        try:
            out = flash_attention(
                q, k, v, causal=is_causal, scale=scale, stabilize=site.stabilize,
                probe=site.probe if self.probes else None, beta=self.beta, eps=self.eps,
            )
        except Exception as exc:  # fail open: this call goes to PyTorch
            if self.on_error is None:
                raise
            self.on_error(exc)
            return None
        finally:
            if token is not None:
                _ERROR_HANDLER.reset(token)
        if not compiling:
            site.watched_calls += 1
        return out

    def _count_unwatched(self, site: Site, reason: str) -> None:
        if torch.compiler.is_compiling():
            return
        site.unwatched_calls += 1
        site.unwatched_reasons[reason] = site.unwatched_reasons.get(reason, 0) + 1
        key = (site.index, reason)
        if key not in self._reported:
            self._reported.add(key)
            _log_rank_zero(
                logging.WARNING,
                "instability_watch: layer %s: SDPA calls with %s go to PyTorch unchanged and are not watched",
                site.name, reason,
            )

    def _relocate(self, device: torch.device) -> None:
        """Move probes and masks to the device the layer runs on (once, e.g. after ``model.to``)."""
        self.bank.to(device)
        for site in self.sites:
            site.stabilize = site.stabilize.to(device)

    # -- introspection -----------------------------------------------------------------

    @property
    def head_counts(self) -> List[int]:
        return [s.num_heads for s in self.sites]

    def stabilized(self) -> List[List[bool]]:
        """Per layer, which heads run the stabilized kernel (a host sync; not for the hot path)."""
        return [s.stabilize.tolist() for s in self.sites]

    def set_stabilized(self, layer: int, head: int, on: bool = True) -> None:
        site = self.sites[layer]
        if not 0 <= head < site.num_heads:
            raise ValueError(f"head must be in [0, {site.num_heads}) for layer {site.name}, got {head}")
        site.stabilize[head:head + 1].fill_(bool(on))  # a kernel, not a host-to-device copy

    def w_q(self) -> List[torch.Tensor]:
        """``W_Q`` per layer, each ``(H, head_dim, d_in)``, detached."""
        out = []
        for site in self.sites:
            w = site.layer.w_q()
            if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.shape[0] != site.num_heads:
                got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                raise ValueError(
                    f"w_q() of layer {site.name} must return a tensor (H={site.num_heads}, head_dim, d_in), got {got}"
                )
            out.append(w.detach())
        return out


def _param_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    import os

    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def _log_rank_zero(level: int, msg: str, *args, exc_info=None) -> None:
    if _rank() == 0:
        log.log(level, msg, *args, exc_info=exc_info)


def attach(
    model: nn.Module,
    layers: Optional[Layers] = None,
    *,
    beta: float = 2.0,
    eps: float = 1e-3,
    probes: bool = True,
) -> Attachment:
    """Route ``model``'s attention through the kernels.

    Args:
        model: any ``nn.Module``; its code is not changed.
        layers: the layers to watch: ``None`` finds them with the built-in
            locators; or a list of :class:`AttentionLayer`; or a function of the
            model returning that list.
        beta, eps: the stabilized kernel's shift factor and tie tolerance.
        probes: ``False`` routes attention through the kernels without any
            statistics (the kernels alone, e.g. to use the stabilized kernel
            on chosen heads via :meth:`Attachment.set_stabilized`).

    Raises:
        ValueError: if no attention layer is found or one is listed twice.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if layers is None:
        found = find_attention_layers(model)
    elif callable(layers):
        found = list(layers(model))
    else:
        found = list(layers)
    for i, layer in enumerate(found):
        if not isinstance(layer, AttentionLayer):
            raise TypeError(f"layers[{i}] must be an instability_watch.AttentionLayer, got {type(layer).__name__}")
        if not layer.name:
            layer.name = next((n for n, m in model.named_modules() if m is layer.module), f"layer{i}")
    if not found:
        raise ValueError(
            "no attention layers found in the model: the built-in locators know nanoGPT (c_attn + n_head), "
            "Hugging Face GPT-2 (GPT2Attention), Llama-style q_proj/k_proj modules and nn.MultiheadAttention; "
            "describe other models with layers=[AttentionLayer(module, num_heads, w_q), ...]"
        )
    return Attachment(model, found, beta=beta, eps=eps, probes=probes)
