"""Reading a run directory back: :func:`load_run` (whole) and :func:`stream_run` (in bounded memory).

The rules (what is fatal, what is skipped and named in ``Run.problems``) are in
:mod:`instability_watch.outputs.rundir`'s docstring.
"""
from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from instability_watch.outputs.rundir.schema import (
    BAD_LINE,
    BLOCK_BYTES,
    EVENTS_FILE,
    EVENTS_TABLE,
    INT_COLUMNS,
    META_FILE,
    METRICS_FILE,
    METRICS_TABLE,
    NAN_TEXT,
    TEXT_COLUMNS,
    Run,
    RunDirError,
    Table,
    read_meta,
)
from instability_watch.outputs.rundir.screen import bad_lines

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


def _parse(data: bytes, table: Table) -> "pd.DataFrame":
    """The rows of ``data`` (whole lines) by pandas' C parser; raises one of ``BAD_LINE`` if any line does not parse."""
    import pandas as pd

    dtypes = table.dtypes
    # an empty float cell is NaN (pandas writes NaN so); an empty integer cell does not parse
    na = {c: NAN_TEXT + [""] for c, t in dtypes.items() if t == "float64"}
    with warnings.catch_warnings():  # a long row: pandas warns, and the count below catches it
        warnings.simplefilter("ignore", pd.errors.ParserWarning)
        frame = pd.read_csv(io.BytesIO(data), header=None, names=list(table.columns), index_col=False,
                            dtype=dtypes, na_values=na, keep_default_na=False, skip_blank_lines=False, engine="c",
                            encoding="utf-8")
    # pandas fills a short row's missing fields and drops a long row's extra ones: count the separators
    quoted = b'"' in data
    commas = data.count(b",")
    if quoted:
        commas -= sum(int(frame[c].str.count(",").sum()) for c in table.columns if c in TEXT_COLUMNS)
    if commas != (len(table.columns) - 1) * len(frame):
        raise ValueError("a line with the wrong number of fields")
    if (quoted or b"\r" in data) and data.count(b"\n") != len(frame):
        raise ValueError("a row that is not one line")
    return frame


class _Tally:
    """The lines of one file that were skipped, for :attr:`Run.problems`."""

    def __init__(self, name: str) -> None:
        self.name, self.skipped, self.first, self.torn = name, 0, 0, False

    def skip(self, line: int) -> None:
        self.first = self.first or line  # lines are met in file order
        self.skipped += 1

    def notes(self) -> List[str]:
        out = []
        if self.skipped:
            s = "s" if self.skipped != 1 else ""
            out.append(f"{self.name}: {self.skipped} malformed line{s} skipped (first at line {self.first})")
        if self.torn:
            out.append(f"{self.name}: last line has no newline (a torn write), skipped")
        return out


def _good_rows(block: bytes, table: Table, first_line: int, tally: _Tally) -> Tuple[List["pd.DataFrame"], int]:
    """The rows of the lines of ``block`` that parse, and the number of lines; the others are tallied.

    The block is parsed at once. Only if that fails are its lines screened for what certainly does not parse
    (:func:`~instability_watch.outputs.rundir.screen.bad_lines`, about a microsecond a line) and the rest parsed at once again; a line the screen
    cannot judge and the parser refuses is found by halving. So a damaged block costs two parses and one
    pass over its lines however many of them are bad, and every good line is kept.
    """
    try:
        frame = _parse(block, table)
        return [frame], len(frame)
    except BAD_LINE:
        pass
    lines = block.split(b"\n")[:-1]  # whole lines: the block ends with one
    lines = [line + b"\n" for line in lines]
    bad = set(bad_lines(lines, table))
    keep = [i for i in range(len(lines)) if i not in bad]
    parts: List["pd.DataFrame"] = []

    def visit(lo: int, hi: int) -> None:  # kept lines keep[lo:hi]
        if lo == hi:
            return
        try:
            parts.append(_parse(b"".join(lines[i] for i in keep[lo:hi]), table))
            return
        except BAD_LINE:
            pass
        if hi - lo == 1:
            bad.add(keep[lo])
            return
        mid = (lo + hi) // 2
        visit(lo, mid)
        visit(mid, hi)

    visit(0, len(keep))
    for i in sorted(bad):  # in file order: the first one is named
        tally.skip(first_line + i)
    return parts, len(lines)


def _open_table(path: Path, table: Table) -> Tuple[Optional[io.BufferedReader], str]:
    """Open a run CSV past its header: ``(file, "")``, or ``(None, why)``: unreadable, empty, another header."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        return None, f"not readable ({exc.strerror or type(exc).__name__})"
    first = f.readline(1 << 16)
    if not first:
        f.close()
        return None, "empty file (no header)"
    fields = first.rstrip(b"\r\n").decode("utf-8", "replace").strip().split(",")
    if fields != list(table.columns):
        f.close()
        return None, f"unexpected header {fields[:6]}...; expected columns {list(table.columns)[:6]}..."
    return f, ""


def _rows(f: io.BufferedReader, table: Table, tally: _Tally, block_bytes: int) -> Iterator["pd.DataFrame"]:
    """The good rows after the header, a block of whole lines at a time, in file order."""
    line, carry, skipping = 2, b"", False  # the header is line 1
    while True:
        chunk = f.read(block_bytes)
        if not chunk:
            break
        if skipping:  # inside a line longer than a block, which no writer writes: skipped
            nl = chunk.find(b"\n")
            if nl < 0:
                continue
            chunk, skipping, line = chunk[nl + 1:], False, line + 1
        data = carry + chunk if carry else chunk
        cut = data.rfind(b"\n") + 1
        carry = data[cut:]
        if cut:
            frames, n_lines = _good_rows(data[:cut], table, line, tally)
            line += n_lines
            yield from (frame for frame in frames if len(frame))
        if len(carry) > block_bytes:
            tally.skip(line)
            carry, skipping = b"", True
    tally.torn = bool(carry)


def _key_le(s: np.ndarray, l: np.ndarray, h: np.ndarray, key: Tuple[int, int, int]) -> np.ndarray:
    """Which rows have ``(step, layer, head) <= key``."""
    k0, k1, k2 = key
    return (s < k0) | ((s == k0) & ((l < k1) | ((l == k1) & (h <= k2))))


class HeadIndex:
    """Dense indices of the (layer, head) pairs met so far, in the order met.

    Sized by what the file holds, never by what meta.json claims: a new pair
    gets the next index. ``layers`` and ``heads`` list the pairs by index.
    """

    def __init__(self) -> None:
        import pandas as pd

        self._codes = pd.Index(np.empty(0, dtype=np.int64))
        self._odd: Dict[Tuple[int, int], int] = {}  # pairs outside the packed range: codes -1, -2, ...
        self.layers = np.empty(0, dtype=np.int64)
        self.heads = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._codes)

    def __call__(self, layer: np.ndarray, head: np.ndarray) -> np.ndarray:
        """The index of each row's (layer, head); pairs not met before are added."""
        import pandas as pd

        packed = (layer >= 0) & (layer < 1 << 31) & (head >= 0) & (head < 1 << 32)
        code = (layer << 32) | head
        if not packed.all():
            odd = list(zip(layer[~packed].tolist(), head[~packed].tolist()))
            for pair in odd:
                self._odd.setdefault(pair, -1 - len(self._odd))
            code[~packed] = [self._odd[pair] for pair in odd]
        index = self._codes.get_indexer(code)
        new = index < 0
        if new.any():
            fresh, first = np.unique(code[new], return_index=True)
            order = np.argsort(first)
            rows = np.flatnonzero(new)[first[order]]
            self._codes = self._codes.append(pd.Index(fresh[order]))
            self.layers = np.concatenate([self.layers, layer[rows]])
            self.heads = np.concatenate([self.heads, head[rows]])
            index = self._codes.get_indexer(code)
        return index


class _Facts:
    """What the first pass over metrics.csv learns, besides the rows."""

    def __init__(self) -> None:
        self.rows = 0  # good rows
        self.heads = HeadIndex()
        self.names: Dict[int, str] = {}  # layer -> the first name met
        self.steps = (0, -1)  # the smallest and the largest step
        self.tail = (0, 0)  # (first row, step) of the last step's rows


class _MetricsPass:
    """One pass over the good rows of metrics.csv, applying the row rule (see the module docstring).

    The rows of one run come in increasing (step, layer, head). A row whose key
    is not above the previous row's starts a *segment*: rows written again by a
    resumed run whose file was not cut back. The first pass sends rows to the
    sink as they come, holding back the last step's rows (they may be
    incomplete) until a later step shows they are not the last. If it meets a
    segment it drops its sink and only learns which keys come again; a second
    pass, with that ``plan``, sends the rows that win.
    """

    def __init__(self, sink, plan: Optional[Tuple[int, "pd.DataFrame"]] = None) -> None:
        self.sink = sink
        self.plan = plan  # (the first row dropped as incomplete, the last segment of each repeated key)
        self.facts = _Facts()
        self.held: List["pd.DataFrame"] = []  # the last step's rows so far (first pass)
        self.repeats: List["pd.DataFrame"] = []  # keys of a later segment that an earlier one may hold
        self.repeated = 0  # rows dropped because a later segment has their key (second pass)
        self._last: Optional[Tuple[int, int, int]] = None  # the key of the previous row
        self._above: Optional[Tuple[int, int, int]] = None  # the largest key before the current segment
        self._segment = 0

    @property
    def clean(self) -> bool:
        """No segment met: every row was sent or held."""
        return self._segment == 0

    def add(self, frame: "pd.DataFrame") -> None:
        s, l, h = (frame[c].to_numpy() for c in INT_COLUMNS)
        n, first_row = len(s), self.facts.rows
        prev = [np.empty_like(s), np.empty_like(l), np.empty_like(h)]
        for p, x, last in zip(prev, (s, l, h), self._last or (0, 0, 0)):
            p[1:], p[0] = x[:-1], last
        starts = ~((s > prev[0]) | ((s == prev[0]) & ((l > prev[1]) | ((l == prev[1]) & (h > prev[2])))))
        if self._last is None:
            starts[0] = False
        segment = self._segment + np.cumsum(starts)
        if self.plan is None:
            self._learn(frame, s, l, h, starts, segment)
        else:
            self._send_planned(frame, s, l, h, first_row, segment)
        self._last = (int(s[-1]), int(l[-1]), int(h[-1]))
        self._segment = int(segment[-1])
        self.facts.rows += n

    def _learn(self, frame, s, l, h, starts, segment) -> None:
        import pandas as pd

        facts, n = self.facts, len(s)
        facts.heads(l, h)
        for layer in pd.unique(l).tolist():
            if layer not in facts.names:
                facts.names[layer] = str(frame["layer_name"].iat[int(np.argmax(l == layer))])
        lo, hi = int(s.min()), int(s.max())
        facts.steps = (lo, hi) if not facts.rows else (min(facts.steps[0], lo), max(facts.steps[1], hi))
        # the last step's rows: the longest run at the end with the last row's step and no segment start inside
        at = np.flatnonzero(starts)
        other = np.flatnonzero(s != s[-1])
        begin = max(int(other[-1]) + 1 if len(other) else 0, int(at[-1]) if len(at) else 0)
        goes_on = begin == 0 and not starts[0] and facts.rows > 0 and facts.tail[1] == s[-1]
        if not goes_on:
            facts.tail = (facts.rows + begin, int(s[-1]))
        if self.clean and not len(at):
            if goes_on:
                self.held.append(frame)
            else:
                for part in self.held + [frame.iloc[:begin]]:
                    if len(part):
                        self.sink.add(part)
                self.held = [frame.iloc[begin:]]
            return
        self.sink, self.held = None, []  # rows come again: the second pass sends them
        # the rows of a later segment whose key an earlier segment may hold (usually a few steps' worth)
        edges = [0] + at.tolist() + [n]
        for a, b in zip(edges[:-1], edges[1:]):
            if a == b:
                continue
            if starts[a]:  # the segment before ended at the previous row
                before = self._last if a == 0 else (int(s[a - 1]), int(l[a - 1]), int(h[a - 1]))
                self._above = before if self._above is None else max(self._above, before)
            if self._above is None:
                continue
            mine = a + np.flatnonzero(_key_le(s[a:b], l[a:b], h[a:b], self._above))
            if len(mine):
                self.repeats.append(_frame(step=s[mine], layer=l[mine], head=h[mine], segment=segment[mine],
                                             row=facts.rows + mine))

    def plan_for(self, drop_from: int) -> Tuple[int, "pd.DataFrame"]:
        """The second pass's plan: rows from ``drop_from`` on are dropped (they neither win nor lose)."""
        import pandas as pd

        keys = pd.concat(self.repeats, ignore_index=True) if self.repeats else _frame(
            step=np.empty(0, np.int64), layer=np.empty(0, np.int64), head=np.empty(0, np.int64),
            segment=np.empty(0, np.int64), row=np.empty(0, np.int64))
        keys = keys[keys["row"] < drop_from]
        last = keys.groupby(list(INT_COLUMNS), as_index=False)["segment"].max()
        return drop_from, last.rename(columns={"segment": "last"})

    def _send_planned(self, frame, s, l, h, first_row, segment) -> None:
        drop_from, last = self.plan
        keep = np.arange(first_row, first_row + len(s)) < drop_from
        if len(last):
            near = (s >= last["step"].min()) & (s <= last["step"].max()) & keep
            if near.any():
                rows = np.flatnonzero(near)
                found = _frame(step=s[rows], layer=l[rows], head=h[rows]).merge(
                    last, how="left", on=list(INT_COLUMNS))["last"].to_numpy()
                beaten = found > segment[rows]  # NaN (no repeat) compares False
                keep[rows[beaten]] = False
                self.repeated += int(beaten.sum())
        if keep.all():
            self.sink.add(frame)
        elif keep.any():
            self.sink.add(frame[keep])


def _frame(**columns) -> "pd.DataFrame":
    import pandas as pd

    return pd.DataFrame(columns)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63


def _oneline(name: str) -> str:
    """A layer name as the writer puts it in a CSV row (a line break becomes a space)."""
    return name.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


def _layers_heads_why(layers, heads, facts: _Facts) -> str:
    """Why meta.json's ``layers`` and ``heads`` cannot be used for this metrics.csv ("" if they can)."""
    if not (isinstance(layers, list) and isinstance(heads, list) and len(layers) == len(heads)
            and all(isinstance(x, str) for x in layers) and all(_is_count(x) for x in heads)):
        return "expected a list of layer names and a list of as many head counts"
    if not facts.rows:
        return ""
    L, H = facts.heads.layers, facts.heads.heads  # the CSV's pairs: a few hundred, whatever meta.json says
    outside = (L < 0) | (L >= len(layers))
    inside = np.flatnonzero(~outside)
    if len(inside):
        counts = np.array([heads[layer] for layer in L[inside].tolist()], dtype=np.int64)
        outside[inside] = (H[inside] < 0) | (H[inside] >= counts)
    if outside.any():
        i = int(np.argmax(outside))
        return f"{METRICS_FILE} has layer {L[i]} head {H[i]}, which they do not declare"
    for layer, name in sorted(facts.names.items()):
        if _oneline(layers[layer]) != name:
            return f"layer {layer} is {_short(name)} in {METRICS_FILE}, {_short(layers[layer])} in {META_FILE}"
    total = sum(heads)
    if total != len(facts.heads) and facts.steps[0] != facts.steps[1]:
        return f"they declare {total} heads, {METRICS_FILE} has {len(facts.heads)}"
    return ""


def _checked_meta(meta: dict, facts: _Facts) -> Tuple[dict, int, List[str]]:
    """meta.json less the fields of the wrong type or at odds with metrics.csv, the run's head count, and notes.

    The head count is that of the CSV; meta.json's only when its layers and
    heads agree with the CSV: they declare the same heads, or the CSV holds a
    single step (which may be incomplete). Nothing is ever sized from meta.json.
    """
    meta, notes = dict(meta), []

    def drop(names: Sequence[str], why: str) -> None:
        for name in names:
            meta.pop(name, None)
        notes.append(f"{META_FILE}: {' and '.join(names)} ignored ({why})")

    expected = len(facts.heads)
    if "layers" in meta or "heads" in meta:
        why = _layers_heads_why(meta.get("layers"), meta.get("heads"), facts)
        if why:
            drop(("layers", "heads"), why)
        elif facts.rows:
            expected = sum(meta["heads"])
    checks = (("resumed_at", lambda v: isinstance(v, list) and all(_is_count(x) for x in v), "a list of steps"),
              ("config", lambda v: isinstance(v, dict), "an object"),
              ("created", lambda v: isinstance(v, str), "a date"),
              ("format", _is_count, "a version number"))
    for name, ok, what in checks:
        if name in meta and not ok(meta[name]):
            drop((name,), f"expected {what}, got {_short(meta[name])}")
    return meta, expected, notes


def _read_metrics(path: Path, make_sink: Callable[[], object], meta: dict,
                  block_bytes: int) -> Tuple[object, dict, List[str]]:
    """Send metrics.csv's rows to a sink by the row rule; returns the sink, the checked meta, and notes."""
    f, why = _open_table(path, METRICS_TABLE)
    if f is None:
        raise RunDirError(f"{path}: {why}")
    tally = _Tally(METRICS_FILE)
    first = _MetricsPass(make_sink())
    with f:
        for frame in _rows(f, METRICS_TABLE, tally, block_bytes):
            first.add(frame)
    facts = first.facts
    meta, expected, notes = _checked_meta(meta, facts)
    notes += tally.notes()
    tail_row, tail_step = facts.tail
    drop_from = facts.rows
    if facts.rows and facts.rows - tail_row < expected:
        drop_from = tail_row
        notes.append(f"{METRICS_FILE}: last step {tail_step} incomplete "
                     f"({facts.rows - tail_row} of {expected} heads), dropped")
    if first.clean:
        if drop_from == facts.rows:
            for part in first.held:
                first.sink.add(part)
        return first.sink, meta, notes
    second = _MetricsPass(make_sink(), plan=first.plan_for(drop_from))
    f, why = _open_table(path, METRICS_TABLE)
    if f is None:  # changed under us
        raise RunDirError(f"{path}: {why}")
    with f:
        for frame in _rows(f, METRICS_TABLE, _Tally(METRICS_FILE), block_bytes):
            second.add(frame)
    if second.repeated:
        s = "s" if second.repeated != 1 else ""
        notes.append(f"{METRICS_FILE}: {second.repeated} row{s} written again by a resumed run "
                     "(the file was not cut back); the later ones kept")
    return second.sink, meta, notes


def _read_events(path: Path, block_bytes: int) -> Tuple["pd.DataFrame", List[str]]:
    """events.csv's rows by the row rule (a missing file, or an empty one, holds none), and notes."""
    import pandas as pd

    if not path.exists():
        return EVENTS_TABLE.empty(), []
    f, why = _open_table(path, EVENTS_TABLE)
    if f is None:
        what = "read as no events" if why.startswith("empty") else "events ignored"
        return EVENTS_TABLE.empty(), [f"{EVENTS_FILE}: {why}; {what}"]
    tally = _Tally(EVENTS_FILE)
    with f:
        frames = list(_rows(f, EVENTS_TABLE, tally, block_bytes))
    events = pd.concat(frames, ignore_index=True) if frames else EVENTS_TABLE.empty()
    events = events.drop_duplicates(subset=list(EVENTS_TABLE.key), keep="last").reset_index(drop=True)
    return EVENTS_TABLE.typed(events), tally.notes()


def _run_dir(run_dir: str | os.PathLike) -> Path:
    d = Path(run_dir)
    if not d.exists():
        raise RunDirError(f"{d}: no such directory")
    if not d.is_dir():
        raise RunDirError(f"{d}: not a directory")
    if not (d / METRICS_FILE).exists():
        raise RunDirError(f"{d}: not an instability_watch run directory (no {METRICS_FILE})")
    return d


class StreamedRun(NamedTuple):
    """What :func:`stream_run` returns: a :class:`Run` whose metrics went to ``sink``."""

    run_dir: Path
    meta: dict
    sink: object
    events: "pd.DataFrame"
    problems: List[str]


def stream_run(run_dir: str | os.PathLike, make_sink: Callable[[], object], *,
               block_bytes: int = BLOCK_BYTES) -> StreamedRun:
    """Read a run directory in bounded memory: metrics.csv's rows go to a sink, a block at a time.

    The rows are those :func:`load_run` returns, in the same order, in pieces
    (DataFrames with the columns :data:`METRIC_COLUMNS`, ``layer_name`` as
    Python strings). The reader holds at most about ``block_bytes`` of CSV at a
    time, plus one step's rows.

    Args:
        run_dir: the run directory.
        make_sink: called with no arguments, returns an object with an
            ``add(frame)`` method. It is called a second time (and the first
            sink dropped) when metrics.csv holds rows written again by a
            resumed run that was not cut back; the file is then read twice.
        block_bytes: CSV bytes parsed at a time.

    Raises:
        RunDirError: as :func:`load_run`.
    """
    d = _run_dir(run_dir)
    meta = read_meta(d)
    sink, meta, problems = _read_metrics(d / METRICS_FILE, make_sink, meta, block_bytes)
    events, notes = _read_events(d / EVENTS_FILE, block_bytes)
    return StreamedRun(run_dir=d, meta=meta, sink=sink, events=events, problems=problems + notes)


class _Collect:
    """A sink that keeps every piece (for :func:`load_run`)."""

    def __init__(self) -> None:
        self.parts: List["pd.DataFrame"] = []

    def add(self, frame: "pd.DataFrame") -> None:
        self.parts.append(frame)


def load_run(run_dir: str | os.PathLike, *, block_bytes: int = BLOCK_BYTES) -> Run:
    """Read a run directory written by :class:`RunWriter` (also one of a killed run), whole.

    Lines that do not parse, a torn last line and an incomplete last step are
    left out and listed in :attr:`Run.problems` (the rule is in the module
    docstring). For a long run, :func:`stream_run` reads in bounded memory.

    Raises:
        RunDirError: the directory is missing or holds no ``metrics.csv``,
            metrics.csv is empty or has another header, or meta.json is not a
            JSON object; the message names the path.
    """
    import pandas as pd

    read = stream_run(run_dir, _Collect, block_bytes=block_bytes)
    parts = read.sink.parts
    metrics = pd.concat(parts, ignore_index=True) if parts else METRICS_TABLE.empty()
    return Run(run_dir=read.run_dir, meta=read.meta, metrics=METRICS_TABLE.typed(metrics), events=read.events,
               problems=read.problems)
