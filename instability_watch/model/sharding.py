"""Sharded weights: what the watch needs to read ``W_Q`` whole under FSDP, and what it refuses.

* **FSDP2** (``fully_shard``): parameters are ``DTensor`` objects outside the forward.
  The locators' ``w_q()`` views work on them (DTensor redistributes where it must)
  and :func:`~instability_watch.probe.spectral.gram` gathers only the per-head Grams.
  Nothing to do here.
* **FSDP1** (``FullyShardedDataParallel``, what Lightning's ``FSDPStrategy`` wraps
  with): outside the forward a module's parameters are pieces of a flat shard (or
  not usable at all), so each layer's ``W_Q`` is read inside
  ``summon_full_params(unit, writeback=False)`` of the innermost FSDP unit that
  holds the layer: one unit (typically one transformer block) gathered at a time,
  on spectral steps only. Every rank must take part, in the same order (they do:
  spectral steps are the same on every rank). ``qk_clip`` scales a layer's
  ``W_q``/``W_k`` the same way, with ``writeback=True``, on every probe step.
* **DeepSpeed ZeRO-3** partitions parameters (``ds_id``) and needs DeepSpeed's own
  gather; not supported: :func:`zero3_parameters` finds them so the watch can say so.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

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


def zero3_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters partitioned by DeepSpeed ZeRO-3 (they carry ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())
