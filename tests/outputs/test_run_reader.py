"""Reading a run directory back: the one rule for corruption (export.py's module docstring)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from instability_watch import WatchConfig
from instability_watch.outputs.rundir import EVENT_COLUMNS, METRIC_COLUMNS, RunDirError, load_run, stream_run

from watch_models import write_tied_run

STEPS, HEADS = 12, 4
CFG = WatchConfig(probe_every=1, log_every=4, shadow_every=1, spectral_every=4, warmup_steps=4, sustain=3)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A real 12-step run of TiedAttention (4 heads), written by RunWriter."""
    run_dir = tmp_path_factory.mktemp("reader") / "run"
    write_tied_run(run_dir, CFG, STEPS)
    return run_dir


@pytest.fixture
def run(real_run, tmp_path) -> Path:
    """A copy of the real run that a test may damage."""
    return Path(shutil.copytree(real_run, tmp_path / "run"))


def _lines(path: Path) -> list:
    return path.read_bytes().splitlines(keepends=True)


def _insert(path: Path, at: int, *lines: bytes) -> None:
    """Put ``lines`` so that the first of them is line ``at`` of the file (1-based)."""
    old = _lines(path)
    path.write_bytes(b"".join(old[: at - 1] + list(lines) + old[at - 1:]))


def _same_rows(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))


def test_a_clean_run_reads_whole_with_no_problems(real_run):
    run = load_run(real_run)
    assert run.problems == []
    assert len(run.metrics) == STEPS * HEADS
    assert list(run.metrics.columns) == list(METRIC_COLUMNS) and list(run.events.columns) == list(EVENT_COLUMNS)
    assert str(run.metrics["layer_name"].dtype) == "string"
    assert run.meta["layers"] == ["tied"] and run.meta["heads"] == [HEADS]


BAD_LINES = {
    "short row": b"5,0,tied,1,2.5,256,0\n",
    "long row": b"5,0,tied,1,2.5," + b",".join([b"1"] * 14) + b"\n",
    "trailing comma": b"5,0,tied,1,2.5," + b",".join([b"1"] * 13) + b",\n",
    "step not a number": b"five,0,tied,1,2.5," + b",".join([b"1"] * 13) + b"\n",
    "step outside int64": b"99999999999999999999,0,tied,1,2.5," + b",".join([b"1"] * 13) + b"\n",
    "head not a number": b"5,0,tied,x,2.5," + b",".join([b"1"] * 13) + b"\n",
    "metric not a number": b"5,0,tied,1,2.5,abc," + b",".join([b"1"] * 12) + b"\n",
    "empty step": b",0,tied,1,2.5," + b",".join([b"1"] * 13) + b"\n",
    "step with a fraction": b"5.5,0,tied,1,2.5," + b",".join([b"1"] * 13) + b"\n",
    "metric with an underscore": b"5,0,tied,1,2.5,1_0," + b",".join([b"1"] * 12) + b"\n",
    "not UTF-8": b"5,0,ti\xff\xfeed,1,2.5," + b",".join([b"1"] * 13) + b"\n",
    "blank line": b"\n",
    "unquoted comma in the name": b"5,0,ti,ed,1,2.5," + b",".join([b"1"] * 13) + b"\n",
    "open quote": b'5,0,"tied,1,2.5,' + b",".join([b"1"] * 13) + b"\n",
    "garbage": b"\x00\x00\x00\x00 not a row at all\n",
}


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_a_line_that_does_not_parse_is_skipped_and_counted(real_run, run, kind):
    """One bad line in the middle: skipped, named by its line number; every good row, also after it, kept."""
    _insert(run / "metrics.csv", 22, BAD_LINES[kind])
    read = load_run(run)
    assert read.problems == ["metrics.csv: 1 malformed line skipped (first at line 22)"]
    _same_rows(read.metrics, load_run(real_run).metrics)


def test_many_bad_lines_in_small_blocks(real_run, run):
    """Bad lines spread over many blocks: counted once, the first one named, every good row kept."""
    path = run / "metrics.csv"
    for at in (40, 30, 9, 3):  # from the end, so the line numbers hold
        _insert(path, at, BAD_LINES["short row"], BAD_LINES["not UTF-8"])
    for block_bytes in (1000, 1 << 20):
        read = load_run(run, block_bytes=block_bytes)
        assert read.problems == ["metrics.csv: 8 malformed lines skipped (first at line 3)"], block_bytes
        _same_rows(read.metrics, load_run(real_run).metrics)


def test_empty_float_cells_read_as_nan(real_run, run):
    """pandas writes NaN as an empty cell: a run filtered with pandas and written back reads as it was."""
    whole = load_run(real_run)
    whole.metrics.to_csv(run / "metrics.csv", index=False)  # NaN -> "", floats in pandas' repr
    assert b",," in (run / "metrics.csv").read_bytes()  # there are empty cells (steps without shadow, sigma)
    read = load_run(run)
    assert read.problems == []
    pd.testing.assert_frame_equal(read.metrics, whole.metrics, check_exact=False, rtol=1e-7)


def test_a_half_damaged_file_costs_a_few_parses_a_block_and_keeps_every_good_row(real_run, run, monkeypatch):
    """Every other line bad, of many kinds: each is skipped and the first named, every good row is kept, and
    each block is parsed a bounded number of times however many of its lines are bad (a screen of its lines,
    not a halving down to each bad line)."""
    from instability_watch.outputs.rundir import reader

    path = run / "metrics.csv"
    lines = _lines(path)
    kinds = [k for k in BAD_LINES if b'"' not in BAD_LINES[k] and k != "blank line"]
    damaged = [lines[0]]
    for i, line in enumerate(lines[1:]):
        damaged += [line, BAD_LINES[kinds[i % len(kinds)]]]
    path.write_bytes(b"".join(damaged))
    clean = load_run(real_run).metrics
    calls = []
    real_parse = reader._parse
    monkeypatch.setattr(reader, "_parse", lambda data, table: calls.append(table.name) or real_parse(data, table))
    read = load_run(run)
    assert read.problems == [f"metrics.csv: {len(lines) - 1} malformed lines skipped (first at line 3)"]
    _same_rows(read.metrics, clean)
    assert calls.count("metrics.csv") == 2  # the block as it is, then its good lines at once


def test_torn_last_line_and_the_incomplete_last_step_are_dropped(real_run, run):
    path = run / "metrics.csv"
    data = path.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: last + 25])  # killed while writing the last head of the last step
    read = load_run(run)
    assert read.problems == ["metrics.csv: last line has no newline (a torn write), skipped",
                             f"metrics.csv: last step {STEPS} incomplete (3 of {HEADS} heads), dropped"]
    full = load_run(real_run).metrics
    _same_rows(read.metrics, full[full["step"] < STEPS])

    path.write_bytes(data[:last])  # cut at a line's end: no torn line, the step is still incomplete
    assert load_run(run).problems == [f"metrics.csv: last step {STEPS} incomplete (3 of {HEADS} heads), dropped"]

    path.write_bytes(data[:-1])  # the whole last row but its newline: torn, so the step is incomplete
    assert len(load_run(run).problems) == 2


def test_the_head_count_comes_from_the_csv_and_from_meta_only_where_they_agree(run):
    path, meta_path = run / "metrics.csv", run / "meta.json"
    header, *rows = _lines(path)
    meta = json.loads(meta_path.read_text())

    path.write_bytes(header + b"".join(rows[:3]))  # one step, 3 of 4 heads: meta.json says 4
    read = load_run(run)
    assert read.problems == [f"metrics.csv: last step 1 incomplete (3 of {HEADS} heads), dropped"]
    assert read.metrics.empty

    meta["heads"] = [10**9]  # a wild claim: ignored, and never sized from
    meta_path.write_text(json.dumps(meta))
    path.write_bytes(header + b"".join(rows[:8]))  # two whole steps
    read = load_run(run)
    assert read.problems == ["meta.json: layers and heads ignored "
                             f"(they declare 1000000000 heads, metrics.csv has {HEADS})"]
    assert len(read.metrics) == 8 and "heads" not in read.meta and "layers" not in read.meta

    meta["heads"], meta["layers"] = [2], ["tied"]  # fewer heads than the CSV holds
    meta_path.write_text(json.dumps(meta))
    assert load_run(run).problems == ["meta.json: layers and heads ignored "
                                      "(metrics.csv has layer 0 head 2, which they do not declare)"]
    meta["heads"], meta["layers"] = [HEADS], ["other"]
    meta_path.write_text(json.dumps(meta))
    assert load_run(run).problems == ["meta.json: layers and heads ignored "
                                      "(layer 0 is 'tied' in metrics.csv, 'other' in meta.json)"]


@pytest.mark.parametrize("field, value, note", [
    ("resumed_at", 5, "meta.json: resumed_at ignored (expected a list of steps, got 5)"),
    ("resumed_at", [3, "x"], "meta.json: resumed_at ignored (expected a list of steps, got [3, 'x'])"),
    ("config", "fast", "meta.json: config ignored (expected an object, got 'fast')"),
    ("heads", "four", "meta.json: layers and heads ignored "
                      "(expected a list of layer names and a list of as many head counts)"),
    ("heads", [True], "meta.json: layers and heads ignored "
                      "(expected a list of layer names and a list of as many head counts)"),
    ("layers", None, "meta.json: layers and heads ignored "
                     "(expected a list of layer names and a list of as many head counts)"),
    ("format", "one", "meta.json: format ignored (expected a version number, got 'one')"),
])
def test_a_meta_field_of_the_wrong_type_is_ignored_with_a_note(real_run, run, field, value, note):
    meta = json.loads((run / "meta.json").read_text())
    meta[field] = value
    (run / "meta.json").write_text(json.dumps(meta))
    read = load_run(run)
    assert read.problems == [note]
    assert field not in read.meta
    _same_rows(read.metrics, load_run(real_run).metrics)


def test_events_file_empty_missing_or_of_another_header(real_run, run):
    events = run / "events.csv"
    events.write_bytes(b"")
    read = load_run(run)
    assert read.problems == ["events.csv: empty file (no header); read as no events"]
    assert read.events.empty and list(read.events.columns) == list(EVENT_COLUMNS)
    _same_rows(read.metrics, load_run(real_run).metrics)
    events.unlink()
    read = load_run(run)
    assert read.problems == [] and read.events.empty and list(read.events.columns) == list(EVENT_COLUMNS)
    events.write_text("a,b\n1,2\n")
    read = load_run(run)
    assert len(read.problems) == 1 and read.problems[0].startswith("events.csv: unexpected header")
    assert read.problems[0].endswith("; events ignored") and read.events.empty


def test_bad_event_lines_are_skipped_like_metrics_lines(real_run, run):
    header = (",".join(EVENT_COLUMNS) + "\n").encode()
    good = [b'27,0,tied,0,alert,delta_drift,13.5,13,switched,"a message, with a comma"\n',
            b"27,0,tied,0,switch,delta_drift,,,,tied head 0 moved\n"]
    (run / "events.csv").write_bytes(header + good[0] + b"27,0,tied,0,alert\n" + good[1] + b"28,0,ti")
    read = load_run(run)
    assert read.problems == ["events.csv: 1 malformed line skipped (first at line 3)",
                             "events.csv: last line has no newline (a torn write), skipped"]
    assert list(read.events["event"]) == ["alert", "switch"]
    assert read.events["message"].iloc[0] == "a message, with a comma" and pd.isna(read.events["value"].iloc[1])


@pytest.mark.parametrize("block_bytes", [700, 1 << 20])
def test_rows_written_again_by_a_resumed_run_the_later_one_wins(real_run, run, block_bytes):
    """A resumed run whose file was not cut back: steps 7..10 appear twice; the second copy wins."""
    path = run / "metrics.csv"
    header, *rows = _lines(path)
    again = []
    for r in rows[6 * HEADS: 10 * HEADS]:  # steps 7..10, written again with another loss
        fields = r.split(b",")
        fields[4] = b"123.5"
        again.append(b",".join(fields))
    path.write_bytes(header + b"".join(rows) + b"".join(again))
    sinks = []

    class Sink(list):
        def __init__(self):
            super().__init__()
            sinks.append(self)

        def add(self, frame):
            self.append(frame)

    streamed = stream_run(run, Sink, block_bytes=block_bytes)
    assert len(sinks) == 2  # rows come again: the file is read a second time
    read = load_run(run, block_bytes=block_bytes)
    assert read.problems == [f"metrics.csv: {4 * HEADS} rows written again by a resumed run "
                             "(the file was not cut back); the later ones kept"]
    assert streamed.problems == read.problems
    _same_rows(pd.concat(streamed.sink, ignore_index=True).astype({"layer_name": "string"}), read.metrics)
    m = read.metrics
    assert sorted(m["step"]) == sorted(list(range(1, STEPS + 1)) * HEADS)
    assert (m.loc[m["step"].between(7, 10), "loss"] == 123.5).all()
    assert (m.loc[~m["step"].between(7, 10), "loss"] != 123.5).all()
    full = load_run(real_run).metrics
    cols = [c for c in METRIC_COLUMNS if c != "loss"]
    _same_rows(m.sort_values(["step", "head"])[cols], full.sort_values(["step", "head"])[cols])


def test_a_resumed_run_cut_mid_step_keeps_the_earlier_copy_of_that_step(real_run, run):
    """The repeated rows end in an incomplete step: it is dropped, so the first copy of that step stands."""
    path = run / "metrics.csv"
    header, *rows = _lines(path)
    again = rows[6 * HEADS: 8 * HEADS + 2]  # steps 7, 8 and half of step 9, written again
    path.write_bytes(header + b"".join(rows) + b"".join(again))
    read = load_run(run, block_bytes=900)
    assert read.problems == ["metrics.csv: last step 9 incomplete (2 of 4 heads), dropped",
                             f"metrics.csv: {2 * HEADS} rows written again by a resumed run "
                             "(the file was not cut back); the later ones kept"]
    _same_rows(read.metrics.sort_values(["step", "head"]), load_run(real_run).metrics.sort_values(["step", "head"]))


def test_streaming_in_small_blocks_reads_what_load_run_reads(real_run, run):
    """Quoted names, bad lines, a torn end: the rows and problems do not depend on the block size."""
    path = run / "metrics.csv"
    header, *rows = _lines(path)
    quoted = [r.replace(b",tied,", b',"ti,""e""d",') for r in rows]
    bad = BAD_LINES["open quote"]
    path.write_bytes(header + b"".join(quoted[:13]) + bad + b"".join(quoted[13:]) + b"13,0,")
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "layers": ['ti,"e"d']}))
    whole = load_run(run)
    assert whole.problems == ["metrics.csv: 1 malformed line skipped (first at line 15)",
                              "metrics.csv: last line has no newline (a torn write), skipped"]
    assert (whole.metrics["layer_name"] == 'ti,"e"d').all() and len(whole.metrics) == STEPS * HEADS
    for block_bytes in (500, 1500, 4000):
        read = load_run(run, block_bytes=block_bytes)
        assert read.problems == whole.problems, block_bytes
        _same_rows(read.metrics, whole.metrics)


def test_a_line_longer_than_a_block_is_skipped(real_run, run):
    path = run / "metrics.csv"
    _insert(path, 10, b"1" * 5000 + b"\n")
    read = load_run(run, block_bytes=1000)
    assert read.problems == ["metrics.csv: 1 malformed line skipped (first at line 10)"]
    _same_rows(read.metrics, load_run(real_run).metrics)


@pytest.mark.parametrize("case", ["missing", "file", "no metrics", "empty metrics", "wrong header",
                                  "meta a list", "meta not JSON"])
def test_what_is_fatal(tmp_path, real_run, case):
    """A RunDirError whose one-line message names the path."""
    d = tmp_path / "run"
    if case == "missing":
        named = d
    elif case == "file":
        d.write_text("x")
        named = d
    else:
        shutil.copytree(real_run, d)
        named = {"no metrics": d, "empty metrics": d / "metrics.csv", "wrong header": d / "metrics.csv",
                 "meta a list": d / "meta.json", "meta not JSON": d / "meta.json"}[case]
        if case == "no metrics":
            (d / "metrics.csv").unlink()
        elif case == "empty metrics":
            (d / "metrics.csv").write_bytes(b"")
        elif case == "wrong header":
            (d / "metrics.csv").write_text("step,layer,something\n1,0,2\n")
        elif case == "meta a list":
            (d / "meta.json").write_text("[1, 2, 3]")
        else:
            (d / "meta.json").write_text("{not json")
    with pytest.raises(RunDirError) as exc:
        load_run(d)
    message = str(exc.value)
    assert len(message.splitlines()) == 1 and message.startswith(f"{named}: ")
