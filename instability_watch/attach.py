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

import itertools
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
from .probe import _VALUE_RESET, VALUE_FIELDS, Probe

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
    """The probes of all layers, read and reset together.

    Each layer's :class:`Probe` owns its two buffers, a ``(len(COUNT_FIELDS), H_l)``
    ``counts`` and a ``(len(VALUE_FIELDS), H_l)`` ``values``; :attr:`counts` and
    :attr:`values` are their concatenation in layer order (one ``cat`` per
    snapshot), and :meth:`zero_` resets all of them with two multi-tensor ops.
    Separate buffers rather than views into one flat buffer: under
    ``torch.compile`` with inductor on CUDA, a backward that adds into several
    views of one buffer (the shadow statistics) corrupted all but the first
    (seen with torch 2.11; aot_eager and CPU inductor were right).
    """

    def __init__(self, head_counts: Sequence[int], device: torch.device | str = "cpu") -> None:
        self.head_counts = list(head_counts)
        self.uniform = len(set(self.head_counts)) <= 1
        self._device = torch.device(device)
        self.probes: List[Probe] = [Probe(h, device) for h in self.head_counts]
        self._make_resets()

    @property
    def device(self) -> torch.device:
        return self.probes[0].device if self.probes else self._device

    @property
    def counts(self) -> torch.Tensor:
        """Every layer's ``counts``, flattened and concatenated in layer order (a copy)."""
        if not self.probes:
            return torch.zeros(0, dtype=torch.int64, device=self._device)
        return torch.cat([p.counts.reshape(-1) for p in self.probes])

    @property
    def values(self) -> torch.Tensor:
        """Every layer's ``values``, flattened and concatenated in layer order (a copy)."""
        if not self.probes:
            return torch.zeros(0, dtype=torch.float32, device=self._device)
        return torch.cat([p.values.reshape(-1) for p in self.probes])

    def _make_resets(self) -> None:
        reset = torch.tensor([_VALUE_RESET[f] for f in VALUE_FIELDS], dtype=torch.float32, device=self.device)
        self._value_resets = [reset[:, None].expand(len(VALUE_FIELDS), h).contiguous() for h in self.head_counts]

    def to(self, device: torch.device | str) -> "ProbeBank":
        """Move all buffers (keeping their contents and the :class:`Probe` objects)."""
        self._device = torch.device(device)
        for p in self.probes:
            p.to(device)
        self._make_resets()
        return self

    def zero_(self) -> None:
        if self.probes:
            torch._foreach_zero_([p.counts for p in self.probes])
            torch._foreach_copy_([p.values for p in self.probes], self._value_resets)

    def set_shadow(self, on: bool) -> None:
        for p in self.probes:
            p.shadow = on


# ----------------------------------------------------------------------------- routing


@dataclass
class Site:
    """One watched attention layer: its probe, its stabilize mask and call counts.

    ``watched_calls``, ``unwatched_calls`` and ``unwatched_reasons`` count eager
    calls only (a compiled model's calls run without Python bookkeeping; its
    probe still counts every row).
    """

    index: int
    layer: AttentionLayer
    attachment: "Attachment"
    stabilize: torch.Tensor
    watched_calls: int = 0
    unwatched_calls: int = 0
    unwatched_reasons: Dict[str, int] = field(default_factory=dict)
    router: Optional["_Router"] = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def num_heads(self) -> int:
        return self.layer.num_heads

    @property
    def probe(self) -> Probe:
        return self.attachment.bank.probes[self.index]


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *, enable_gqa=False):
    """An SDPA call's arguments in signature order, however they were passed."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


_UNCHECKED = object()
_CHECKED_MAX = 256  # call signatures remembered per layer (a model with ever-new shapes starts over)
# router.key -> router: traced code hands _follow_device a plain int (what Dynamo passes to
# an assume_constant_result function in every version), not the router itself
_ROUTERS: "weakref.WeakValueDictionary[int, _Router]" = weakref.WeakValueDictionary()
_router_keys = itertools.count()


class _Router(TorchFunctionMode):
    """Entered around one layer's forward: SDPA calls go to ``flash_attention``.

    A routed call reads only this object's own attributes (the flags, the
    layer's ``stabilize`` mask and probe, ``beta`` and ``eps``), which the
    attachment keeps current (:meth:`Attachment._sync`), and never the
    attachment or the model. So ``torch.compile`` traces a routed call into the
    kernels' op without reaching the model a second time (Dynamo refuses to
    track one module from two places), and flipping a head's mask, a tensor
    changed in place, never recompiles. The bookkeeping (call counts, warnings)
    happens in eager calls only; moving the probes to the device the model was
    moved to happens in eager code too, at trace time under ``torch.compile``.
    """

    def __init__(self, site: Site) -> None:
        super().__init__()
        self.site = site  # bookkeeping only: not read by traced calls
        self.key = next(_router_keys)
        _ROUTERS[self.key] = self
        self.num_heads = site.num_heads
        self.routing = True
        self.stabilize = site.stabilize
        self.probe: Optional[Probe] = None
        self.beta, self.eps = site.attachment.beta, site.attachment.eps
        self.on_error: Optional[Callable[[BaseException], None]] = None
        # eager calls: why a call signature cannot be served (None: it can), checked once per signature
        self.checked: Dict[tuple, Optional[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA and self.routing:
            out = self._route(args, kwargs) if kwargs else self._route(args, {})
            if out is not None:
                return out
        return func(*args, **kwargs) if kwargs else func(*args)

    def _route(self, args, kwargs):
        try:
            q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_args(*args, **kwargs)
        except TypeError:
            return None  # PyTorch's SDPA reports the bad call
        if torch.compiler.is_compiling():
            return self._route_traced(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        try:
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
                   attn_mask is None, dropout_p, scale, enable_gqa)
            reason = self.checked.get(key, _UNCHECKED)
        except (AttributeError, TypeError):  # not tensors, an unhashable scale: no caching
            key, reason = None, _UNCHECKED
        if reason is _UNCHECKED:
            reason = _unsupported(self.num_heads, q, k, v, attn_mask, dropout_p, scale, enable_gqa)
            if key is not None:
                if len(self.checked) >= _CHECKED_MAX:
                    self.checked.clear()
                self.checked[key] = reason
        if reason is None and self.stabilize.device != q.device:
            reason = _follow_device(self.key, q.device)
        if reason is not None:
            self.site.attachment._count_unwatched(self.site, reason)
            return None
        token = _ERROR_HANDLER.set(self.on_error)  # where a failure in this call's backward is reported
        try:
            out = flash_attention(
                q, k, v, causal=bool(is_causal), scale=scale, stabilize=self.stabilize, probe=self.probe,
                beta=self.beta, eps=self.eps,
            )
        except Exception as exc:  # fail open: this call goes to PyTorch
            if self.on_error is None:
                raise
            self.on_error(exc)
            return None
        finally:
            _ERROR_HANDLER.reset(token)
        self.site.watched_calls += 1
        return out

    def _route_traced(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        """A call traced by ``torch.compile``: no bookkeeping, the kernels' op goes into the graph."""
        if _unsupported(self.num_heads, q, k, v, attn_mask, dropout_p, scale, enable_gqa) is not None:
            return None
        # Run at trace time (before the mask and probe are read): the model may have been
        # moved since it was attached; the guards on the mask retrace after another move.
        if _follow_device(self.key, q.device) is not None:
            return None
        return flash_attention(
            q, k, v, causal=bool(is_causal), scale=scale, stabilize=self.stabilize, probe=self.probe,
            beta=self.beta, eps=self.eps,
        )


@torch._dynamo.assume_constant_result
def _follow_device(key: int, device: torch.device) -> Optional[str]:
    """Bring the watch to ``device`` if the model was moved there; else why this call cannot be watched.

    Eager code: called directly by eager calls, and run by Dynamo at trace time
    (``assume_constant_result``) for compiled ones. ``key``: the router's.
    """
    router = _ROUTERS[key]
    if router.stabilize.device == device:
        return None
    attachment = router.site.attachment
    if _param_device(attachment.model) != device:
        return f"layer on {device}, apart from the model's other layers"
    attachment._relocate(device)  # the model was moved after attaching
    return None


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


def _unsupported(num_heads: int, q, k, v, attn_mask, dropout_p, scale, enable_gqa) -> Optional[str]:
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
    if q.shape[1] != num_heads:
        return f"{q.shape[1]} query heads, the layer was described with {num_heads}"
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
        probes: while ``False`` routed calls collect no statistics.
        on_error: called with the exception if routing a call fails; the call
            then goes to PyTorch's SDPA. Set by the engine; default re-raises.
    """

    def __init__(
        self, model: nn.Module, layers: Sequence[AttentionLayer], *, beta: float, eps: float, probes: bool = True
    ) -> None:
        self.model = model
        self._probes = bool(probes)
        self.beta, self.eps = float(beta), float(eps)
        self._routing = True
        self._on_error: Optional[Callable[[BaseException], None]] = None
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

    # -- the state routed calls read (kept on the routers) ------------------------------

    @property
    def routing(self) -> bool:
        return self._routing

    @routing.setter
    def routing(self, on: bool) -> None:
        self._routing = bool(on)
        self._sync()

    @property
    def probes(self) -> bool:
        return self._probes

    @probes.setter
    def probes(self, on: bool) -> None:
        self._probes = bool(on)
        self._sync()

    @property
    def on_error(self) -> Optional[Callable[[BaseException], None]]:
        return self._on_error

    @on_error.setter
    def on_error(self, handler: Optional[Callable[[BaseException], None]]) -> None:
        self._on_error = handler
        self._sync()

    def _sync(self) -> None:
        """Copy what routed calls read onto each layer's router."""
        for site in self.sites:
            router = site.router
            if router is None:
                continue
            router.routing = self._routing
            router.stabilize = site.stabilize
            router.probe = self.bank.probes[site.index] if self._probes else None
            router.beta, router.eps = self.beta, self.eps
            router.on_error = self._on_error

    # -- install / remove --------------------------------------------------------------

    def _wrap(self, site: Site) -> None:
        module = site.layer.module
        if module in _ROUTED:
            raise ValueError(f"layer {site.name!r} is already watched by another attachment; detach that one first")
        own = module.__dict__.get("forward")  # an instance-level forward the user set, if any
        site.router = _Router(site)
        self._sync()
        _ROUTED[module] = (site.router, own)
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

    def _count_unwatched(self, site: Site, reason: str) -> None:
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
        self._sync()

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
