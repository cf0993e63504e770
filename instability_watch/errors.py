"""The package's own exception (a base module: it imports nothing of the package)."""


class WatchError(RuntimeError):
    """A failure inside the watch, raised only with ``WatchConfig(strict=True)``."""
