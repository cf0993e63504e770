"""Rank helpers: which process this is, and logging from rank 0 only."""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("instability_watch")


def rank() -> int:
    """This process's rank (``torch.distributed`` if initialised, else the launcher's environment, else 0)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def log_rank_zero(level: int, msg: str, *args, exc_info=None) -> None:
    """Log through the ``instability_watch`` logger on rank 0 only."""
    if rank() == 0:
        log.log(level, msg, *args, exc_info=exc_info)
