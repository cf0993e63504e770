"""Which process this is under ``torch.distributed``, and logging from rank 0 only (a base module)."""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("instability_watch")


def distributed() -> bool:
    """``torch.distributed`` is initialised with more than one rank (the one test of "are we distributed")."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def world_size() -> int:
    """The number of ranks (1 without ``torch.distributed``)."""
    return torch.distributed.get_world_size() if distributed() else 1


def rank() -> int:
    """This process's rank (``torch.distributed`` if initialised, else the launcher's environment, else 0)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def log_rank_zero(level: int, msg: str, *args, exc_info=None) -> None:
    """Log through the ``instability_watch`` logger on rank 0 only."""
    if rank() == 0:
        log.log(level, msg, *args, exc_info=exc_info)


def broadcast_from_rank_zero(obj):
    """Rank 0's ``obj`` on every rank under ``torch.distributed`` (``obj`` itself without it)."""
    if not distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
