"""The package's own exception, and the check of keyword arguments (a base module: it imports nothing of the
package)."""
import functools
import inspect


class WatchError(RuntimeError):
    """A failure inside the watch, raised only with ``WatchConfig(strict=True)``."""


class NothingObservedError(WatchError, ValueError):
    """With ``strict``: no attention call of the model could be observed on the first probe step (a
    :class:`ValueError` too, as it was before ``strict`` decided it)."""


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


def checking_keywords(init):
    """``init`` (a class's ``__init__``) with a misspelt keyword named first, under the instance's class name, with
    the nearest real one (Python's own error names neither, and for an inherited ``__init__`` names the base
    class); ``functools.wraps`` keeps the signature for ``inspect`` (IDEs, jsonargparse and LightningCLI)."""
    params = [p for p in inspect.signature(init).parameters if p != "self"]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        unknown_keywords(type(self).__name__, kwargs, params)
        init(self, *args, **kwargs)

    return __init__
