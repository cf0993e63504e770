"""Sharded weights: what the watch needs to read ``W_Q`` whole under FSDP, and what it refuses.

* **FSDP2** (``fully_shard``): parameters are ``DTensor`` objects outside the forward.
  The locators' ``w_q()`` views work on them (DTensor redistributes where it must)
  and :func:`~instability_watch.probe.spectral.gram` gathers only the per-head Grams.
  Nothing to do here.
* **FSDP1** (``FullyShardedDataParallel``, what Lightning's ``FSDPStrategy`` wraps
  with): outside the forward a module's parameters are pieces of a flat shard (or
  not usable at all). With ``use_orig_params=True`` (Lightning's default) and a
  sharded strategy, :func:`whole_params` rebuilds the weights of the watched
  attention modules from each rank's pieces (each rank writes its pieces into a zero
  buffer of the whole weights; one all-reduce sums them; up to ``WHOLE_BYTES`` of
  weights at a time, so one all-reduce for GPT-2 small), on spectral steps only;
  ``W_Q`` is then read from those copies. Otherwise each layer's ``W_Q`` is
  read inside ``summon_full_params(unit, writeback=False)`` of the innermost FSDP
  unit that holds the layer: one unit (typically a whole transformer block,
  attention and MLP) gathered at a time, one collective per layer (on two H100s
  a spectral step of GPT-2 small cost +32–38 ms this way, against +9–10 ms under
  DDP). Every rank must take part, in the same order (they do: spectral steps are
  the same on every rank). ``qk_clip`` scales a layer's ``W_q``/``W_k`` inside the
  unit's full parameters, with ``writeback=True``, on every probe step.
* **DeepSpeed ZeRO-3** partitions parameters (``ds_id``) and needs DeepSpeed's own
  gather; not supported: :func:`zero3_parameters` finds them so the watch can say so.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn


def fsdp1_class():
    """FSDP1's ``FullyShardedDataParallel`` class (``None``: torch built without distributed)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return FullyShardedDataParallel


def fsdp1_units(roots: List[nn.Module]) -> List[nn.Module]:
    """The FSDP1 units under ``roots`` (each counted once), outermost first."""
    cls = fsdp1_class()
    if cls is None:
        return []
    seen, out = set(), []
    for root in roots:
        for m in root.modules():
            if isinstance(m, cls) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


def innermost_unit(module: nn.Module, units: List[nn.Module]) -> Optional[nn.Module]:
    """The innermost of ``units`` whose subtree holds ``module`` (``None``: none does)."""
    best, best_size = None, None
    for unit in units:
        members = list(unit.modules())
        if any(m is module for m in members) and (best_size is None or len(members) < best_size):
            best, best_size = unit, len(members)
    return best


@contextlib.contextmanager
def full_params(unit: Optional[nn.Module], writeback: bool = False) -> Iterator[None]:
    """``W`` whole inside: FSDP1's ``summon_full_params(unit, writeback=...)``; nothing for ``None``.

    With ``writeback=True`` (qk_clip) changes made inside go back to each rank's shard.
    """
    if unit is None:
        yield
        return
    cls = fsdp1_class()
    with cls.summon_full_params(unit, recurse=True, writeback=writeback):
        yield


def each_in_its_unit(modules: Sequence[nn.Module], roots: Sequence[nn.Module], fn: Callable[[int], None], *,
                     writeback: bool = False) -> Optional[Tuple[int, BaseException, bool]]:
    """Call ``fn(i)`` for each of ``modules``, inside the full parameters of the FSDP1 unit under ``roots`` that
    holds it (directly where none does).

    Every rank enters every unit's gather (a collective), in the same order, also after a failure here:
    a rank that skipped the later ones would leave the others waiting forever. So a failure does not stop
    the loop; the first one is returned as ``(index, exception, inside a unit)`` (``None``: none failed),
    and ``fn`` is not called again after it.
    """
    units = fsdp1_units(list(roots))
    failed: Optional[Tuple[int, BaseException, bool]] = None
    for i, module in enumerate(modules):
        unit = innermost_unit(module, units) if units else None
        with full_params(unit, writeback=writeback):
            if failed is None:
                try:
                    fn(i)
                except Exception as exc:  # noqa: BLE001
                    failed = (i, exc, unit is not None)
    return failed


class _Piece:
    """Where one original parameter's piece lies in this rank's FSDP1 flat shard."""

    __slots__ = ("param", "shape", "start", "numel", "in_shard", "group")

    def __init__(self, param, shape, info, group) -> None:
        self.param, self.shape, self.group = param, torch.Size(shape), group
        self.in_shard = bool(info.in_shard)
        self.start = info.intra_param_start_idx if self.in_shard else 0
        self.numel = info.numel_in_shard if self.in_shard else 0


def fsdp1_pieces(roots: Sequence[nn.Module]) -> Dict[int, _Piece]:
    """``id(parameter) -> _Piece`` for the original parameters of the FSDP1 units under ``roots`` that keep them
    (``use_orig_params=True``) with a sharded strategy and no CPU offload; empty when there are none.

    Reads FSDP1's flat-parameter bookkeeping (``_shard_param_infos``, private to PyTorch): any surprise there
    gives an empty map, and the callers gather whole units instead.
    """
    out: Dict[int, _Piece] = {}
    try:
        for unit in fsdp1_units(list(roots)):
            handle = getattr(unit, "_handle", None)
            if handle is None:
                continue
            if not (handle._use_orig_params and handle.uses_sharded_strategy) or handle._offload_params:
                return {}
            flat = handle.flat_param
            params, infos, shapes = flat._params, flat._shard_param_infos, flat._shapes
            if params is None or not (len(params) == len(infos) == len(shapes)):
                return {}
            # a parameter flattened from a non-contiguous tensor (in its storage order), or under an FSDP
            # extension (tensor parallelism): its pieces do not lie in row-major order
            if getattr(handle, "_fsdp_extension", None) is not None or not all(flat._contiguities):
                return {}
            # a parameter tied within the unit is the same object wherever it appears: one piece
            for param, info, shape in zip(params, infos, shapes):
                out[id(param)] = _Piece(param, shape, info, unit.process_group)
    except (AttributeError, TypeError):  # another PyTorch's FSDP1 internals
        return {}
    return out


WHOLE_BYTES = 256 * 2 ** 20  # the most weights rebuilt at once (bytes), unless one module's alone is larger


def whole_plan(modules: Sequence[nn.Module], pieces: Dict[int, _Piece],
               budget: Optional[int] = None) -> Optional[List[List[Tuple[int, List[Tuple[str, _Piece]]]]]]:
    """How :func:`whole_params` rebuilds the weights (parameters of 2 or more dimensions) of ``modules``: groups of
    consecutive modules, each ``[(module index, [(name, piece), ...]), ...]``, a group's weights at most ``budget``
    bytes (default ``WHOLE_BYTES``; or one module's). ``None`` when a weight is not among ``pieces``, the pieces
    do not share one process group, dtype and device, or a parameter is not in its sharded state (inside a forward
    or a gather): the caller then gathers whole units. Every rank decides alike (the same model, the same FSDP
    state).
    """
    named_all = []
    for module in modules:
        named = list(module.named_parameters())
        if not named or any(id(p) not in pieces for _, p in named):
            return None
        named = [(n, pieces[id(p)]) for n, p in named if len(pieces[id(p)].shape) >= 2]  # weights, not biases
        if not named:
            return None
        named_all.append(named)
    chosen = [c for named in named_all for _, c in named]
    first = chosen[0]
    dtype, device = first.param.dtype, first.param.device
    if any(c.group is not first.group or c.param.dtype != dtype or c.param.device != device for c in chosen):
        return None
    # the sharded state: each parameter a flat view of its piece (or empty when the piece is elsewhere)
    if any(c.param.dim() != 1 or c.param.numel() != c.numel for c in chosen):
        return None
    size = first.param.element_size()
    budget = WHOLE_BYTES if budget is None else budget
    groups, current, used = [], [], 0
    for i, named in enumerate(named_all):
        nbytes = size * sum(c.shape.numel() for _, c in named)
        if current and used + nbytes > budget:
            groups.append(current)
            current, used = [], 0
        current.append((i, named))
        used += nbytes
    groups.append(current)
    return groups


def whole_params(group: List[Tuple[int, List[Tuple[str, _Piece]]]]) -> List[Dict[str, torch.Tensor]]:
    """One group of :func:`whole_plan`: each module's weights whole, ``{name: tensor}`` (names relative to the
    module), rebuilt with one all-reduce: each rank writes its pieces into a zero buffer of the whole weights and
    the sum is every rank's. A collective. The buffer is allocated before anything else: a rank that cannot
    allocate it fails before the all-reduce and the others wait there, as a rank that cannot gather a unit
    would leave them waiting in ``summon_full_params``.
    """
    import torch.distributed as dist

    chosen = [c for _, named in group for _, c in named]
    sizes = [c.shape.numel() for c in chosen]
    first = chosen[0]
    buf = torch.zeros(sum(sizes), dtype=first.param.dtype, device=first.param.device)
    offset = 0
    for c, size in zip(chosen, sizes):
        if c.in_shard:
            buf[offset + c.start: offset + c.start + c.numel] = c.param.detach()
        offset += size
    dist.all_reduce(buf, group=first.group)
    out, offset = [], 0
    for _, named in group:
        whole = {}
        for name, c in named:
            size = c.shape.numel()
            whole[name] = buf[offset: offset + size].view(c.shape)
            offset += size
        out.append(whole)
    return out


@contextlib.contextmanager
def with_params(module: nn.Module, params: Dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters named in ``params`` (dotted names relative to it) replaced by those tensors inside
    (attributes swapped, the parameters themselves untouched), restored after."""
    saved = []
    try:
        for name, tensor in params.items():
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            saved.append((owner, attr, owner._parameters[attr]))
            owner._parameters[attr] = tensor
        yield
    finally:
        for owner, attr, param in reversed(saved):
            owner._parameters[attr] = param


def zero3_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters partitioned by DeepSpeed ZeRO-3 (they carry ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())
