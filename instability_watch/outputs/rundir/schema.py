"""The run directory's schema: its files, their columns and types, how a text field and a number are written,
and its errors. The writer (:mod:`.writer`) and the reader (:mod:`.reader`) both follow it."""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from instability_watch.engine.metrics import METRICS

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

FORMAT_VERSION = 1
META_FILE = "meta.json"
METRICS_FILE = "metrics.csv"
EVENTS_FILE = "events.csv"
RUN_DIR_NAME = "instability_watch"  # the run directory's name under a trainer's output or log directory

METRIC_COLUMNS = ("step", "layer", "layer_name", "head", "loss") + METRICS
EVENT_COLUMNS = ("step", "layer", "layer_name", "head", "event", "kind", "value", "threshold", "action", "message")


class RunDirError(ValueError):
    """A run directory that is missing, not a run directory, or malformed."""


class RunWriteError(OSError):
    """Writing the run directory failed (e.g. the disk is full); the message says from which step on.

    ``errno`` is the failed call's (``errno.ENOSPC`` for a full disk).
    """

    def __init__(self, message: str, cause: Optional[OSError] = None) -> None:
        super().__init__(message)
        self.errno = cause.errno if cause is not None else None


def csv_text(value: str) -> str:
    """Quote a text field when it needs it (RFC 4180); a line break becomes a space (one row, one line)."""
    value = value.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
    if any(c in value for c in ',"'):
        return '"' + value.replace('"', '""') + '"'
    return value


def num(x: float) -> str:
    """A number as the run CSVs write it (``%.9g``)."""
    return "%.9g" % float(x)


def csv_line(fields: Sequence[str]) -> str:
    """One CSV line of already-quoted fields."""
    return ",".join(fields) + "\n"


def row_step(line: bytes, n_fields: int) -> Optional[int]:
    """The step of one whole CSV row (``n_fields`` fields, integer step, layer and head, a final newline), else None."""
    if not line.endswith(b"\n"):
        return None  # a torn last line
    try:
        text = line[:-1].decode("utf-8")
        fields = next(csv.reader([text], strict=True)) if '"' in text else text.split(",")
        if len(fields) != n_fields:
            return None
        step, _, _ = int(fields[0]), int(fields[1]), int(fields[3])  # every run CSV starts step, layer, name, head
    except (UnicodeDecodeError, csv.Error, StopIteration, ValueError):
        return None
    return step



def read_meta(d: Path) -> dict:
    """``meta.json`` of run directory ``d`` (``{}`` if there is none); ``RunDirError`` if it is not a JSON object."""
    path = d / META_FILE
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise RunDirError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    return meta



@dataclass
class Run:
    """A loaded run directory.

    Attributes:
        run_dir: where it was read from.
        meta: ``meta.json`` (layers, heads, config, created, resumed_at), less
            the fields that were of the wrong type or disagreed with the CSV.
        metrics: one row per (step, layer, head); columns :data:`METRIC_COLUMNS`.
        events: one row per alert or switch; columns :data:`EVENT_COLUMNS`.
        problems: what the reader skipped, dropped or ignored, one line each
            (see the module docstring); empty for a clean run.
    """

    run_dir: Path
    meta: dict
    metrics: "pd.DataFrame"
    events: "pd.DataFrame"
    problems: List[str] = field(default_factory=list)

    @property
    def steps(self) -> "pd.DataFrame":
        """One row per step: ``step`` and ``loss``."""
        return self.metrics.groupby("step", as_index=False)["loss"].first()



BLOCK_BYTES = 16 << 20
"""CSV bytes parsed at a time: what bounds the reader's memory, whatever the size of the file.
(Larger blocks parse no faster: each one is a fresh allocation the kernel must map.)"""

INT_COLUMNS = ("step", "layer", "head")
TEXT_COLUMNS = ("layer_name", "event", "kind", "action", "message")
NAN_TEXT = ["nan", "NaN"]  # how "%.9g" (and numpy) write a value that was not observed
BAD_LINE = (ValueError, OverflowError, TypeError)  # what pandas raises for a line that does not parse


@dataclass(frozen=True)
class Table:
    """One run CSV: its columns and their types, and the key whose repeats the later row wins."""

    name: str
    columns: Tuple[str, ...]
    key: Tuple[str, ...]

    @property
    def dtypes(self) -> Dict[str, object]:
        """Each column's pandas dtype (int64, object for text, float64)."""
        return {c: "int64" if c in INT_COLUMNS else object if c in TEXT_COLUMNS else "float64"
                for c in self.columns}

    def typed(self, frame: "pd.DataFrame") -> "pd.DataFrame":
        """``frame`` with its text columns as pandas strings (as :func:`load_run` returns them)."""
        return frame.astype({c: "string" for c in self.columns if c in TEXT_COLUMNS})

    def empty(self) -> "pd.DataFrame":
        """A frame with the table's columns and no rows."""
        import pandas as pd

        return self.typed(pd.DataFrame({c: pd.Series(dtype=t) for c, t in self.dtypes.items()}))


METRICS_TABLE = Table(METRICS_FILE, METRIC_COLUMNS, INT_COLUMNS)
EVENTS_TABLE = Table(EVENTS_FILE, EVENT_COLUMNS, ("step", "layer", "head", "event", "kind"))

