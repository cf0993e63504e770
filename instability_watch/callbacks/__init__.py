"""Framework adapters over :class:`~instability_watch.InstabilityWatch`.

``from instability_watch.callbacks import InstabilityWatchCallback`` (imports Lightning);
``from instability_watch.callbacks import InstabilityWatchTrainerCallback`` (Hugging Face
``transformers.Trainer``; imports transformers).
"""


import importlib

_LAZY = {"InstabilityWatchCallback": ".lightning", "InstabilityWatchTrainerCallback": ".hf"}  # imported on first use


def __getattr__(name):
    """The lazily imported names (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["InstabilityWatchCallback", "InstabilityWatchTrainerCallback"]
