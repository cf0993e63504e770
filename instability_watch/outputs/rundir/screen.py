"""Screening the lines of a damaged block of a run CSV: which lines certainly do not parse as rows.

:func:`bad_lines` is what the reader (:mod:`instability_watch.outputs.rundir.reader`) runs on a block that
failed to parse at once, so that a damaged block costs one pass over its lines and one more parse, however
many of its lines are bad.
"""
from __future__ import annotations

import io
from typing import List

import numpy as np

from instability_watch.outputs.rundir.schema import NAN_TEXT, TEXT_COLUMNS, Table


def bad_lines(lines: List[bytes], table: Table) -> List[int]:
    """The indices of ``lines`` that certainly do not parse as rows of ``table``: empty, not UTF-8, the wrong
    number of fields (one count of commas a line), then, among the rest, values of the wrong kind: an integer
    column that is not an integer within int64, a float column that is neither a number nor empty, ``nan`` or
    ``NaN`` (:func:`bad_values`, one parse). Lines with a quote or a carriage return are not judged here
    (the parser is)."""
    want = len(table.columns) - 1
    bad, plain = [], []
    for n, line in enumerate(lines):
        if b'"' in line or b"\r" in line:
            continue
        if len(line) <= 1 or line.count(b",") != want:
            bad.append(n)
            continue
        if not line.isascii():
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                bad.append(n)
                continue
        plain.append(n)
    if plain:
        bad += [plain[i] for i in bad_values(b"".join(lines[n] for n in plain), table)]
    return bad


def bad_values(data: bytes, table: Table) -> List[int]:
    """The rows of ``data`` (whole lines of the right number of fields, UTF-8, no quotes) whose numbers do not
    parse as ``table``'s types: one parse that lets pandas infer each column's type, then a look at the few
    columns that came back as text."""
    import pandas as pd

    floats = [c for c, t in table.dtypes.items() if t == "float64"]
    frame = pd.read_csv(io.BytesIO(data), header=None, names=list(table.columns), index_col=False,
                        dtype={c: object for c in table.columns if c in TEXT_COLUMNS},
                        na_values={c: NAN_TEXT + [""] for c in floats}, keep_default_na=False, engine="c",
                        encoding="utf-8")
    ok = np.ones(len(frame), dtype=bool)
    for c in table.columns:
        col = frame[c]
        if c in TEXT_COLUMNS or (c in floats and col.dtype.kind == "f"):
            continue
        if col.dtype.kind in "iu":  # integers: within int64
            ok &= (col.to_numpy() <= np.iinfo(np.int64).max) if col.dtype.kind == "u" else True
            continue
        text = col.dtype == object
        num = pd.to_numeric(col.where(~col.map(lambda x: isinstance(x, str) and "_" in x), "x") if text else col,
                            errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        if c in floats:  # a number, or NaN where the cell was empty, nan or NaN (pandas made those NaN already)
            ok &= ~np.isnan(num) | col.map(lambda x: not isinstance(x, str)).to_numpy(dtype=bool)
        else:  # an int64 as pandas reads one: 5, +5, 5.0, 1e3
            ok &= np.isfinite(num) & (num == np.floor(num)) & (np.abs(num) <= 2.0 ** 63)
    return np.flatnonzero(~ok).tolist()
