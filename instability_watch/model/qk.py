"""Where one layer's query and key projections are, and how to scale them per head in place (for QK-clip).

A :class:`QKProjections` scales the parameters of one layer so that query head ``h``'s
logits are multiplied by ``gamma[h]`` (see :mod:`~instability_watch.act.qkclip` for
the rule: ``sqrt(gamma)`` on ``W_q`` and ``W_k``, or all of it on ``W_q`` when key
heads are shared). The built-in layouts are in :mod:`~instability_watch.model.families`;
:func:`user_projections` builds one from ``AttentionLayer(w_q=..., w_k=...)``. Layers with
QK-norm are refused (:func:`qk_norm_of`): normalised queries and keys do not scale
with ``W_q``/``W_k``.

Parameters are found at call time (``getattr`` on the module), so the layouts work
on parameters swapped by a wrapper. Sharded parameters: a ``DTensor`` (FSDP2) is
scaled in its local shard, the multiplier sliced at the shard's global offset.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

# attribute names under which models keep a query/key normalisation (Qwen3, OLMo2, Gemma 3, timm, litgpt, ...)
QK_NORM_NAMES = ("q_norm", "k_norm", "norm_q", "norm_k", "q_layernorm", "k_layernorm", "query_layernorm",
                 "key_layernorm", "q_ln", "k_ln")

# (fq (H,), fk (KV,)) -> the multiplier along one dimension of one parameter, its full length
Multiplier = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class QKProjections:
    """Where one layer's query and key projections are, and how to scale them per head.

    Args:
        num_heads, num_kv, head_dim: query heads ``H``, key heads ``KV`` (``H % KV == 0``), head size ``D``.
        targets: ``(param_getter, dim, multiplier)``: the parameter (found when called), the dimension
            its rows or columns run along, and the multiplier of that dimension given ``(fq, fk)``.
        views: ``(view_getter, which)``: tensors whose first dimension is the heads (``which`` is
            ``"q"`` or ``"k"``), views of live parameters (user-described layers).
    """

    def __init__(self, num_heads: int, num_kv: int, head_dim: int,
                 targets: Sequence[Tuple[Callable[[], Optional[torch.Tensor]], int, Multiplier]] = (),
                 views: Sequence[Tuple[Callable[[], Optional[torch.Tensor]], str]] = ()) -> None:
        if num_kv < 1 or num_heads % num_kv:
            raise ValueError(f"the key heads ({num_kv}) must divide the query heads ({num_heads})")
        self.num_heads, self.num_kv, self.head_dim = num_heads, num_kv, head_dim
        self.targets = list(targets)
        self.views = list(views)

    @property
    def grouped(self) -> bool:
        """Key heads shared by several query heads: only ``W_q`` is scaled."""
        return self.num_kv < self.num_heads

    def factors(self, gamma: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(fq, fk)`` from the per-query-head logit multipliers ``gamma`` (float ``(H,)``, on the device), by
        the module docstring's rule: ``fq`` is ``(H,)``, ``fk`` is ``(KV,)``, both of ``gamma``'s dtype and device."""
        if self.grouped:
            return gamma, torch.ones(self.num_kv, dtype=gamma.dtype, device=gamma.device)
        root = gamma.sqrt()
        return root, root

    @torch.no_grad()
    def apply(self, gamma: torch.Tensor) -> None:
        """Scale the layer's parameters in place so head ``h``'s logits are multiplied by ``gamma[h]``
        (``gamma``: ``(H,)``, any float dtype, on the parameters' device; the parameters keep their dtype)."""
        fq, fk = self.factors(gamma.float())
        for get, dim, multiplier in self.targets:
            p = get()
            if p is not None:
                _scale(p, dim, multiplier(fq, fk))
        for get, which in self.views:
            v = get()
            if v is not None:
                f = fq if which == "q" else fk
                v.mul_(f.to(v.device, v.dtype).view(-1, *([1] * (v.dim() - 1))))

    def parameters(self) -> List[torch.Tensor]:
        """The tensors it scales (parameters or views of them, any shape and dtype; for checks)."""
        out = [get() for get, _, _ in self.targets] + [get() for get, _ in self.views]
        return [t for t in out if t is not None]


def _scale(p: torch.Tensor, dim: int, vec: torch.Tensor) -> None:
    """``p *= vec`` along ``dim``, in place; a ``DTensor`` in its local shard."""
    local = p
    if _is_dtensor(p):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = p._local_tensor
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        vec = vec[offset[dim]: offset[dim] + local.shape[dim]]
    if vec.numel() != local.shape[dim]:
        raise ValueError(f"qk_clip: a multiplier of {vec.numel()} entries for a dimension of {local.shape[dim]}")
    shape = [1] * local.dim()
    shape[dim] = -1
    local.mul_(vec.to(local.device, local.dtype).view(shape))


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def qk_norm_of(module: nn.Module) -> Optional[str]:
    """The name of a query/key normalisation the module applies (``None``: none; ``nn.Identity`` is none)."""
    for name in QK_NORM_NAMES:
        m = getattr(module, name, None)
        if isinstance(m, nn.Module) and not isinstance(m, nn.Identity):
            return name
    return None


def _storage_ptrs(model: nn.Module) -> set:
    out = set()
    for p in model.parameters():
        t = p._local_tensor if _is_dtensor(p) else p
        try:
            out.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # pragma: no cover - a tensor without storage
            pass
    return out


def user_projections(layer, model: nn.Module) -> QKProjections:
    """A layout from ``AttentionLayer(w_q, w_k, b_q, b_k)``: views whose first dimension is the heads."""
    wq, wk = layer.w_q(), layer.w_k()
    name = layer.name

    def shape(t) -> tuple:
        return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__

    if not isinstance(wq, torch.Tensor) or wq.dim() != 3 or wq.shape[0] != layer.num_heads:
        raise ValueError(f"qk_clip: layer {name!r}: w_q() must return a ({layer.num_heads}, head_dim, d_in) view of "
                         f"the live weight, got {shape(wq)}")
    d, d_in = wq.shape[1], wq.shape[2]
    if not isinstance(wk, torch.Tensor) or wk.dim() != 3 or tuple(wk.shape[1:]) != (d, d_in):
        raise ValueError(f"qk_clip: layer {name!r}: w_k() must return a (kv_heads, {d}, {d_in}) view of the live key "
                         f"weight (head_dim and d_in as w_q's), got {shape(wk)}")
    kv = wk.shape[0]
    if layer.num_heads % kv:
        raise ValueError(f"qk_clip: layer {name!r}: w_k() has {kv} key heads, which does not divide the "
                         f"{layer.num_heads} query heads")
    views = [(layer.w_q, "q"), (layer.w_k, "k")]
    for what, get, heads in (("b_q", layer.b_q, layer.num_heads), ("b_k", layer.b_k, kv)):
        if get is None:
            continue
        b = get()
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (heads, d):
            raise ValueError(f"qk_clip: layer {name!r}: {what}() must return a ({heads}, {d}) view of the live bias, "
                             f"got {shape(b)}")
        views.append((get, what[-1]))
    ptrs = _storage_ptrs(model)
    for get, which in views:
        t = get()
        if t.device.type != "meta" and t.untyped_storage().data_ptr() not in ptrs:
            raise ValueError(f"qk_clip: layer {name!r}: the tensor of its {which} projection is not a view of a "
                             "parameter of the model (a copy?): scaling it would change nothing. Return a view, "
                             "e.g. module.wq.weight.view(H, D, d_in)")
    return QKProjections(layer.num_heads, kv, wq.shape[1], views=views)


