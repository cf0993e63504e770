"""Framework adapters over :class:`~instability_watch.InstabilityWatch`.

``from instability_watch.callbacks import InstabilityWatchCallback`` (imports Lightning).
"""


def __getattr__(name):
    if name == "InstabilityWatchCallback":
        from .lightning import InstabilityWatchCallback

        return InstabilityWatchCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["InstabilityWatchCallback"]
