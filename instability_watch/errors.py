"""The package's own exception, and the check of keyword arguments (a base module: it imports nothing of the
package)."""
import functools
import inspect


class WatchError(RuntimeError):
    """A failure inside the watch, raised only with ``WatchConfig(strict=True)``."""


class NothingObservedError(WatchError, ValueError):
    """With ``strict``: no attention call of the model could be observed on the first probe step (a
    :class:`ValueError` too, as it was before ``strict`` decided it)."""


def unknown_keywords(owner: str, given, allowed, config_fields=()) -> None:
    """Raise ``TypeError`` for keyword arguments of ``owner`` not in ``allowed``: each named, the nearest allowed
    name suggested (or, for a ``WatchConfig`` field in ``config_fields``, where it belongs), and every allowed name
    listed (Python's own error names neither)."""
    import difflib

    allowed = list(allowed)
    unknown = [k for k in given if k not in allowed]
    if not unknown:
        return
    hints = []
    for k in unknown:
        if k in config_fields:
            hints.append(f"{k!r} (a WatchConfig field: pass config=WatchConfig({k}={given[k]!r}))")
            continue
        near = difflib.get_close_matches(k, allowed, n=1)
        hints.append(f"{k!r} (did you mean {near[0]!r}?)" if near else repr(k))
    noun = "argument" if len(unknown) == 1 else "arguments"
    raise TypeError(f"{owner} got the unknown keyword {noun} {', '.join(hints)}; it takes {', '.join(allowed)}")


def checking_keywords(init, config_fields=None):
    """``init`` (a class's ``__init__``) with a misspelt keyword named first, under the instance's class name, with
    the nearest real one (Python's own error names neither, and for an inherited ``__init__`` names the base
    class); ``functools.wraps`` keeps the signature for ``inspect`` (IDEs, jsonargparse and LightningCLI).
    ``config_fields``: a function giving ``WatchConfig``'s field names, for a class that takes a ``config``: such a
    keyword given to the class itself is pointed to ``config=WatchConfig(...)``."""
    params = [p for p in inspect.signature(init).parameters if p != "self"]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        unknown_keywords(type(self).__name__, kwargs, params, config_fields() if config_fields else ())
        init(self, *args, **kwargs)

    return __init__
