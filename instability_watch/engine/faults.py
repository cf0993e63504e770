"""Failures inside the watch: each part that fails is turned off and reported once; training goes on.

:class:`Faults` is the one place that decides what a failure does: with
``strict`` it re-raises, otherwise it records the part in :attr:`Faults.disabled`,
logs it once (with the rank and, for a bug, the traceback) and calls the hook the
engine registered for that part (e.g. "routing" sends every call back to
PyTorch's SDPA). Bad values that are not failures (a NaN drift on finite rows, a
meta-device model) are :meth:`Faults.problem`: a warning once, or
:class:`~instability_watch.errors.WatchError` with ``strict``.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List

from instability_watch.errors import WatchError
from instability_watch.ranks import log_rank_zero, rank

log = logging.getLogger("instability_watch")


class Faults:
    """Which parts of the watch are off, and why (``{part: "ExcType: message"}`` in :attr:`disabled`)."""

    def __init__(self, strict: bool) -> None:
        self.strict = bool(strict)
        self.disabled: Dict[str, str] = {}
        self._reported: set = set()
        self._hooks: Dict[str, Callable[[BaseException], None]] = {}

    @property
    def reported(self) -> List[str]:
        """The keys of the problems and notes reported so far (each is reported once)."""
        return sorted(self._reported)

    def __contains__(self, part: str) -> bool:
        return part in self.disabled

    def on_disable(self, part: str, hook: Callable[[BaseException], None]) -> None:
        """Call ``hook(exc)`` when ``part`` is turned off (once, before it is logged)."""
        self._hooks[part] = hook

    def fail(self, part: str, exc: BaseException) -> None:
        """``part`` failed: re-raise ``exc`` with ``strict``; else turn it off and report it once.

        ``part`` names what failed (``"statistics"``, ``"routing"``, ``"shadow"``,
        ``"run directory"``, ``"listener NAME"``, ...). Training goes on without it.
        """
        if self.strict:
            raise exc
        if part in self.disabled:
            return
        self.disabled[part] = f"{type(exc).__name__}: {exc}"
        hook = self._hooks.get(part)
        if hook is not None:
            hook(exc)
        # A failure is reported by the process it happened in (once), with the rank.
        log.error(
            "instability_watch (rank %d): %s failed and is turned off; training goes on. %s",
            rank(), part, self.disabled[part],
            exc_info=None if isinstance(exc, OSError) else exc,  # a full disk needs no traceback; a bug does
        )

    def turn_off(self, part: str, message: str) -> None:
        """``part`` cannot work on this run (no failure inside the watch: e.g. nothing it can observe): raise
        :class:`WatchError` with ``strict``; else turn it off, as :meth:`fail` does, and say why once on rank 0
        (every rank meets the same condition)."""
        if self.strict:
            raise WatchError(message)
        if part in self.disabled:
            return
        self.disabled[part] = message
        hook = self._hooks.get(part)
        if hook is not None:
            hook(WatchError(message))
        log_rank_zero(logging.ERROR, "%s. The watch's %s is turned off; training goes on.", message, part)

    def problem(self, key: str, message: str) -> None:
        """A bad value inside the watch: :class:`WatchError` with ``strict``, else a warning (once per ``key``)."""
        if self.strict:
            raise WatchError(message)
        self.once(key, logging.WARNING, "instability_watch: %s (ignored; reported once)", message)

    def once(self, key: str, level: int, msg: str, *args) -> bool:
        """Log ``msg`` on rank 0 the first time ``key`` is met; whether it was logged now."""
        if key in self._reported:
            return False
        self._reported.add(key)
        log_rank_zero(level, msg, *args)
        return True
