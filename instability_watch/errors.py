"""The package's own exception (a base module: it imports nothing of the package)."""


class WatchError(RuntimeError):
    """A failure inside the watch, raised only with ``WatchConfig(strict=True)``."""


def unknown_keywords(owner: str, given, allowed) -> None:
    """Raise ``TypeError`` for keyword arguments of ``owner`` not in ``allowed``: each named, the nearest allowed
    name suggested, and every allowed name listed (Python's own error names neither)."""
    import difflib

    allowed = list(allowed)
    unknown = [k for k in given if k not in allowed]
    if not unknown:
        return
    hints = []
    for k in unknown:
        near = difflib.get_close_matches(k, allowed, n=1)
        hints.append(f"{k!r} (did you mean {near[0]!r}?)" if near else repr(k))
    noun = "argument" if len(unknown) == 1 else "arguments"
    raise TypeError(f"{owner} got the unknown keyword {noun} {', '.join(hints)}; it takes {', '.join(allowed)}")
