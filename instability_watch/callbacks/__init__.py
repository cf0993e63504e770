"""Framework adapters over :class:`~instability_watch.InstabilityWatch`.

``from instability_watch.callbacks import InstabilityWatchCallback`` (imports Lightning);
``from instability_watch.callbacks import InstabilityWatchTrainerCallback`` (Hugging Face
``transformers.Trainer``; imports transformers).
"""


def __getattr__(name):
    if name == "InstabilityWatchCallback":
        from .lightning import InstabilityWatchCallback

        return InstabilityWatchCallback
    if name == "InstabilityWatchTrainerCallback":
        from .hf import InstabilityWatchTrainerCallback

        return InstabilityWatchTrainerCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["InstabilityWatchCallback", "InstabilityWatchTrainerCallback"]
