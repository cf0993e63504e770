"""Sharded weights: what the watch needs to read ``W_Q`` whole under FSDP, and what it refuses.

* **FSDP2** (``fully_shard``): parameters are ``DTensor`` objects outside the forward.
  The locators' ``w_q()`` views work on them (DTensor redistributes where it must)
  and :func:`~instability_watch.spectral.gram` gathers only the per-head Grams.
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
from typing import Iterator, List, Optional

import torch.nn as nn


def _fsdp1_class():
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return FullyShardedDataParallel


def fsdp1_units(roots: List[nn.Module]) -> List[nn.Module]:
    """The FSDP1 units under ``roots`` (each counted once), outermost first."""
    cls = _fsdp1_class()
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
    cls = _fsdp1_class()
    with cls.summon_full_params(unit, recurse=True, writeback=writeback):
        yield


def zero3_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters partitioned by DeepSpeed ZeRO-3 (they carry ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())
