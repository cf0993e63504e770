"""QK-clip: cap each head's largest attention logit by rescaling its ``W_q`` and ``W_k`` in place.

Kimi K2's QK-Clip (Moonshot AI, 2025), applied by the watch after the optimizer
step of each probe step (``WatchConfig(qk_clip=...)``). For query head ``h``
with largest logit ``S_h`` (measured by the probe in that step's forward,
``scale * q.k``) over ``tau``, the logit multiplier is ``gamma_h = tau / S_h``
(1 elsewhere), computed on the device; then:

* **Multi-head attention** (one key head per query head): ``W_q[h]`` and
  ``W_k[h]`` (and their biases) are each multiplied by ``sqrt(gamma_h)``.
* **Grouped keys** (GQA, multi-query; ``KV < H``): a key head serves several
  query heads, so scaling it would move heads that are not over ``tau``. The
  key head is never scaled; ``W_q[h]`` (and its bias) takes the whole
  ``gamma_h``. The head's logits ``(gamma q).k`` come back to ``tau`` all the
  same, and every other head stays bitwise unchanged.

Heads not clipped are multiplied by exactly 1.0 (bitwise unchanged): one
in-place multiply per projection weight and bias, no Python loop over heads,
no host sync.

A :class:`QKLayout` knows where one layer's query and key rows are. Built-in
layouts follow :mod:`~instability_watch.locate` (nanoGPT ``c_attn``, Hugging
Face GPT-2 ``Conv1D``, ``q_proj``/``k_proj``, BERT ``query``/``key``, GPT-NeoX
``query_key_value``, Phi-3 ``qkv_proj``, T5 ``q``/``k``, litgpt, timm); other
layers are described with ``AttentionLayer(w_q=..., w_k=...)`` (and ``b_q``,
``b_k`` for biases). Layers with QK-norm are refused (:func:`qk_norm_of`):
normalised queries and keys do not scale with ``W_q``/``W_k``.

Parameters are found at call time (``getattr`` on the module), so the layouts
work on parameters swapped by a wrapper. Sharded parameters: a ``DTensor``
(FSDP2) is scaled in its local shard, the multiplier sliced at the shard's
global offset; FSDP1 layers are scaled inside ``summon_full_params(writeback=True)``
of their unit (by the watch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

MODES = ("on_alert", "always")
# attribute names under which models keep a query/key normalisation (Qwen3, OLMo2, Gemma 3, timm, litgpt, ...)
QK_NORM_NAMES = ("q_norm", "k_norm", "norm_q", "norm_k", "q_layernorm", "k_layernorm", "query_layernorm",
                 "key_layernorm", "q_ln", "k_ln")

# (fq (H,), fk (KV,)) -> the multiplier along one dimension of one parameter, its full length
Multiplier = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Clip:
    """One head clipped at one step: its logits were multiplied by ``factor`` (= ``tau / max_logit``)."""

    step: int
    layer: int
    head: int
    factor: float
    max_logit: float
    tau: float
    layer_name: str = ""


def _rep(f: torch.Tensor, d: int) -> torch.Tensor:
    return f.repeat_interleave(d)


class QKLayout:
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


# ---------------------------------------------------------------------------- layouts


def _attr(module: nn.Module, *path: str) -> Callable[[], Optional[torch.Tensor]]:
    def get():
        obj = module
        for name in path:
            obj = getattr(obj, name, None)
            if obj is None:
                return None
        return obj
    return get


def _linear_pair(q: str, k: str) -> Callable[[nn.Module, int], Optional[QKLayout]]:
    """Separate query and key ``nn.Linear`` modules (Llama's q_proj/k_proj, BERT, T5)."""
    def build(module: nn.Module, n_head: int) -> Optional[QKLayout]:
        qm, km = getattr(module, q, None), getattr(module, k, None)
        if not isinstance(qm, nn.Linear) or not isinstance(km, nn.Linear) or qm.out_features % n_head:
            return None
        d = qm.out_features // n_head
        if km.out_features % d:
            return None
        kv = km.out_features // d
        fq = lambda fq, fk: _rep(fq, d)  # noqa: E731
        fk_ = lambda fq, fk: _rep(fk, d)  # noqa: E731
        return QKLayout(n_head, kv, d, [(_attr(module, q, "weight"), 0, fq), (_attr(module, q, "bias"), 0, fq),
                                         (_attr(module, k, "weight"), 0, fk_), (_attr(module, k, "bias"), 0, fk_)])
    return build


def _queries_first(fused: str, n_head: int, n_kv: int, d: int, module: nn.Module, dim: int = 0,
                   bias: bool = True) -> QKLayout:
    """A fused ``[Q (H D) | K (KV D) | V (KV D)]`` projection along ``dim``."""
    def mult(fq, fk):
        return torch.cat([_rep(fq, d), _rep(fk, d), torch.ones(n_kv * d, dtype=fq.dtype, device=fq.device)])
    targets = [(_attr(module, fused, "weight"), dim, mult)]
    if bias:
        targets.append((_attr(module, fused, "bias"), 0, mult))
    return QKLayout(n_head, n_kv, d, targets)


def _grouped(fused: str, n_head: int, n_kv: int, d: int, module: nn.Module) -> QKLayout:
    """A fused projection grouped per key head: ``(KV, H / KV + 2, D)`` rows (GPT-NeoX, litgpt's legacy ``attn``)."""
    per = n_head // n_kv

    def mult(fq, fk):
        ones = torch.ones(n_kv, 1, dtype=fq.dtype, device=fq.device)
        slots = torch.cat([fq.view(n_kv, per), fk.view(n_kv, 1), ones], dim=1)  # (KV, per + 2)
        return slots[..., None].expand(n_kv, per + 2, d).reshape(-1)
    return QKLayout(n_head, n_kv, d, [(_attr(module, fused, "weight"), 0, mult), (_attr(module, fused, "bias"), 0, mult)])


def _nanogpt(module: nn.Module, n_head: int) -> Optional[QKLayout]:
    e = module.c_attn.in_features
    return _queries_first("c_attn", n_head, n_head, e // n_head, module)


def _hf_gpt2(module: nn.Module, n_head: int) -> Optional[QKLayout]:
    c_attn = module.c_attn
    nf = c_attn.nf if isinstance(getattr(c_attn, "nf", None), int) else c_attn.weight.shape[1]
    if getattr(module, "is_cross_attention", False):  # q_attn (C, E); c_attn (C, 2E) = [K | V]
        e = nf // 2
        d = e // n_head
        q = lambda fq, fk: _rep(fq, d)  # noqa: E731
        kv = lambda fq, fk: torch.cat([_rep(fk, d), torch.ones(e, dtype=fk.dtype, device=fk.device)])  # noqa: E731
        return QKLayout(n_head, n_head, d, [
            (_attr(module, "q_attn", "weight"), 1, q), (_attr(module, "q_attn", "bias"), 0, q),
            (_attr(module, "c_attn", "weight"), 1, kv), (_attr(module, "c_attn", "bias"), 0, kv)])
    e = nf // 3  # Conv1D stores (in, out): the heads run along the columns
    return _queries_first("c_attn", n_head, n_head, e // n_head, module, dim=1)


def _gpt_neox(module: nn.Module, n_head: int) -> Optional[QKLayout]:
    from .locate import _int_attr, _kv_heads

    fused = module.query_key_value
    d = _int_attr(module, "head_size", "head_dim") or fused.in_features // n_head
    return _grouped("query_key_value", n_head, _kv_heads(fused.out_features, n_head, d), d, module)


def _phi3(module: nn.Module, n_head: int) -> Optional[QKLayout]:
    from .locate import _int_attr

    fused = module.qkv_proj
    d = _int_attr(module, "head_dim") or fused.in_features // n_head
    return _queries_first("qkv_proj", n_head, _int_attr(module, "num_key_value_heads"), d, module)


def _litgpt(module: nn.Module, n_head: int) -> Optional[QKLayout]:
    from .locate import _int_attr

    groups, d = _int_attr(module, "n_query_groups"), _int_attr(module, "head_size")
    rows = (n_head + 2 * groups) * d
    if isinstance(getattr(module, "qkv", None), nn.Linear) and module.qkv.out_features == rows:
        return _queries_first("qkv", n_head, groups, d, module)
    return _grouped("attn", n_head, groups, d, module)


def _timm(module: nn.Module, n_head: int) -> Optional[QKLayout]:
    fused = module.qkv
    d = fused.out_features // (3 * n_head)
    layout = _queries_first("qkv", n_head, n_head, d, module)
    if isinstance(getattr(module, "q_bias", None), torch.Tensor):  # BEiT-style: q_bias and v_bias, no k bias
        layout.targets.append((_attr(module, "q_bias"), 0, lambda fq, fk: _rep(fq, d)))
    return layout


BUILDERS = {
    "nanogpt": _nanogpt, "hf-gpt2": _hf_gpt2, "q_proj": _linear_pair("q_proj", "k_proj"),
    "query/key/value": _linear_pair("query", "key"), "gpt-neox": _gpt_neox, "phi-3": _phi3,
    "t5": _linear_pair("q", "k"), "litgpt": _litgpt, "timm": _timm,
}


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


def _user_layout(layer, model: nn.Module) -> QKLayout:
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
    return QKLayout(layer.num_heads, kv, wq.shape[1], views=views)


def build_layouts(layers, model: nn.Module) -> List[QKLayout]:
    """One :class:`QKLayout` per watched layer.

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
            out.append(_user_layout(layer, model))
            continue
        builder = BUILDERS.get(layer.layout)
        built = builder(layer.module, layer.num_heads) if builder is not None else None
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
