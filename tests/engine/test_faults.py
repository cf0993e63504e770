"""The run directory under faults: a full disk while training, a failing close, torn lines on resume.

A full disk is simulated by :class:`Disk`, whose files write what fits and then
raise ``ENOSPC``, and (where a small tmpfs can be mounted) met for real.
"""
from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from instability_watch import InstabilityWatch, InstabilityWatchCallback, WatchConfig, load_run
from instability_watch.outputs.rundir import EVENT_COLUMNS, METRIC_COLUMNS, RunDirError, RunWriteError, RunWriter
from instability_watch.outputs.rundir import writer as writer_module
from instability_watch.outputs.rundir.writer import keep_through

from helpers import REPO
from lightning_models import TiedModule
from watch_models import TiedAttention, train_tied, write_tied_run

TESTS = (REPO / "tests")
CFG = dict(probe_every=1, log_every=5, shadow_every=1, spectral_every=5, warmup_steps=5, sustain=3, auto_switch=True)
NO_SPACE = os.strerror(errno.ENOSPC)
METRICS_HEADER = (",".join(METRIC_COLUMNS) + "\n").encode()
EVENTS_HEADER = (",".join(EVENT_COLUMNS) + "\n").encode()
FAILED = re.compile(r"writing failed at step (\d+) \(" + NO_SPACE + r"\); later steps are not recorded")


class Disk:
    """A filesystem of ``capacity`` bytes for the run's CSV files (those named ``only``, else both).

    A write that does not fit writes what fits and returns the count, and the
    next one raises ``ENOSPC``, as ``write(2)`` does; with ``counted=False`` it
    raises at once, after writing what fit (a layer in between that loses the
    count). ``close_error``: closing that file raises (as a network filesystem
    reports a failed write-back). Installed as the writer module's ``open``.
    """

    def __init__(self, capacity: int = 1 << 40, *, only=None, counted: bool = True, close_error=None) -> None:
        self.capacity, self.only, self.counted, self.close_error = capacity, only, counted, close_error
        self.files = {}

    def used(self) -> int:
        return sum(os.path.getsize(f.path) for f in self.files.values())

    def open(self, path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        name = Path(path).name
        if "b" in mode and mode[0] in "wa" and name.endswith(".csv") and self.only in (None, name):
            f = _DiskFile(f, self, Path(path))
            self.files[name] = f
        return f


class _DiskFile:
    def __init__(self, f, disk: Disk, path: Path) -> None:
        self.f, self.disk, self.path = f, disk, path

    def write(self, data) -> int:
        free = self.disk.capacity - self.disk.used()
        if free <= 0:
            raise OSError(errno.ENOSPC, NO_SPACE)
        n = min(len(data), free)
        self.f.write(bytes(data[:n]))
        if n < len(data) and not self.disk.counted:
            raise OSError(errno.ENOSPC, NO_SPACE)
        return n

    def fileno(self) -> int:
        return self.f.fileno()

    @property
    def closed(self) -> bool:
        return self.f.closed

    def close(self) -> None:
        self.f.close()
        if self.disk.close_error == self.path.name:
            raise OSError(errno.EIO, os.strerror(errno.EIO))


def _plain_run(run_dir, steps, *, disk=None, monkeypatch=None, strict=False, close=True):
    """The plain loop of the README: returns (watch, writer); the disk (if any) is in place throughout."""
    if disk is not None:
        monkeypatch.setattr(writer_module, "open", disk.open, raising=False)
    return write_tied_run(run_dir, WatchConfig(**CFG, strict=strict), steps, close=close)


def _lines_through(data: bytes, last_step: int):
    """The header and the lines of ``data`` whose step is <= ``last_step``."""
    header, *rows = data.splitlines(keepends=True)
    return header + b"".join(r for r in rows if int(r.split(b",", 1)[0]) <= last_step)


def _errors(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same 30 steps on a disk with room: both CSVs' bytes (the tied heads alert and switch at step 27)."""
    d = tmp_path_factory.mktemp("reference")
    _plain_run(d, 30)
    metrics, events = (d / "metrics.csv").read_bytes(), (d / "events.csv").read_bytes()
    assert b"\n27,0,tied,0,alert," in events
    return metrics, events


def _capacity_to_mid_step(metrics: bytes, step: int) -> int:
    """Bytes of metrics.csv through ``step - 1`` and half of ``step``'s rows."""
    before, through = len(_lines_through(metrics, step - 1)), len(_lines_through(metrics, step))
    return before + (through - before) // 2


@pytest.mark.parametrize("only, counted, stop", [
    ("metrics.csv", True, 28),   # the write of steps 26-30 stops inside step 28: 26 and 27 (with its alerts) stay
    ("metrics.csv", False, 28),  # the same where the write raises without the count of what it wrote
    (None, True, 27),            # a disk shared by both files: the alerts of step 27 no longer fit, so 27 goes too
])
def test_full_disk_in_a_plain_loop_keeps_whole_steps_and_reports_once(reference, tmp_path, monkeypatch, caplog,
                                                                      only, counted, stop):
    ref_metrics, ref_events = reference
    capacity = _capacity_to_mid_step(ref_metrics, 28) + (len(EVENTS_HEADER) if only is None else 0)
    disk = Disk(capacity, only=only, counted=counted)
    watch, writer = _plain_run(tmp_path, 30, disk=disk, monkeypatch=monkeypatch)  # raises nothing

    assert watch.step_count == 30 and writer not in watch.listeners
    errors = _errors(caplog)
    assert len(errors) == 1, errors
    assert f"run directory {tmp_path}: writing failed at step {stop} ({NO_SPACE}); later steps are not recorded" \
        in errors[0]
    # only whole steps, byte for byte those of the run with room, and every alert of them
    assert (tmp_path / "metrics.csv").read_bytes() == _lines_through(ref_metrics, stop - 1)
    assert (tmp_path / "events.csv").read_bytes() == _lines_through(ref_events, stop - 1)
    assert all(f.closed for f in disk.files.values()) and len(disk.files) == (1 if only else 2)
    run = load_run(tmp_path)
    assert sorted(run.metrics["step"].unique()) == list(range(1, stop))
    assert (run.metrics.groupby("step").size() == 4).all()


def test_strict_raises_the_write_failure_once_and_closing_does_not_raise_again(reference, tmp_path, monkeypatch,
                                                                               caplog):
    ref_metrics, _ = reference
    monkeypatch.setattr(writer_module, "open", Disk(_capacity_to_mid_step(ref_metrics, 8), only="metrics.csv").open,
                        raising=False)
    torch.manual_seed(0)
    model = TiedAttention()
    writer = RunWriter(tmp_path)
    watch = InstabilityWatch(model, WatchConfig(**CFG, strict=True), layers=model.layers(), listeners=[writer])
    writer.open(watch)
    with pytest.raises(RunWriteError, match=FAILED.pattern) as info:
        train_tied(model, watch, 0, 30)
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert watch.step_count == 10 and writer not in watch.listeners  # the read-back of steps 6-10 failed
    watch.detach()
    writer.close()  # nothing new to report: no second exception
    assert not writer.is_open and _errors(caplog) == []
    assert (tmp_path / "metrics.csv").read_bytes() == _lines_through(ref_metrics, 7)


@pytest.mark.parametrize("strict", [False, True])
def test_a_failing_close_closes_both_files_and_is_reported_once(tmp_path, monkeypatch, caplog, strict):
    disk = Disk(close_error="metrics.csv")
    _, writer = _plain_run(tmp_path, 5, disk=disk, monkeypatch=monkeypatch, strict=strict, close=False)
    if strict:
        with pytest.raises(RunWriteError, match="closing metrics.csv failed"):
            writer.close()
        assert _errors(caplog) == []
    else:
        writer.close()
        errors = _errors(caplog)
        assert len(errors) == 1 and f"run directory {tmp_path}: closing metrics.csv failed" in errors[0]
    assert disk.files["metrics.csv"].closed and disk.files["events.csv"].closed
    writer.close()  # closing again does nothing
    assert len(load_run(tmp_path).metrics) == 5 * 4


def test_a_failing_close_after_a_reported_write_failure_is_not_reported_again(reference, tmp_path, monkeypatch,
                                                                             caplog):
    disk = Disk(_capacity_to_mid_step(reference[0], 8), only=None, close_error="metrics.csv")
    _plain_run(tmp_path, 10, disk=disk, monkeypatch=monkeypatch)
    errors = _errors(caplog)
    assert len(errors) == 1 and FAILED.search(errors[0])
    assert all(f.closed for f in disk.files.values())


def _trainer(tmp_path, **kw):
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), **kw)


@pytest.mark.parametrize("strict", [False, True])
def test_lightning_on_a_full_disk(tmp_path, monkeypatch, caplog, strict):
    """Without strict, fit completes and the failure is logged once; with strict, fit raises it, once."""
    disk = Disk(len(METRICS_HEADER) + len(EVENTS_HEADER) + 1500)  # steps 1 and part of 2-5: fails at 2..5
    monkeypatch.setattr(writer_module, "open", disk.open, raising=False)
    model = TiedModule()
    cb = InstabilityWatchCallback({**CFG, "strict": strict}, layers=model.watch_layers(), run_dir=tmp_path / "run",
                                  alerts=False)
    trainer = _trainer(tmp_path, callbacks=[cb], max_steps=12)
    if strict:
        with pytest.raises(RunWriteError, match=FAILED.pattern) as info:
            trainer.fit(model)
        message = str(info.value)
        assert _errors(caplog) == []
    else:
        trainer.fit(model)  # the teardown closes the files and raises nothing
        assert trainer.global_step == 12 and cb.watch.step_count == 12
        errors = _errors(caplog)
        assert len(errors) == 1, errors
        message = errors[0]
    stop = int(FAILED.search(message).group(1))
    assert 2 <= stop <= 5 and str(tmp_path / "run") in message
    assert all(f.closed for f in disk.files.values()) and len(disk.files) == 2
    run = load_run(tmp_path / "run")
    assert sorted(run.metrics["step"].unique()) == list(range(1, stop))
    assert (run.metrics.groupby("step").size() == 4).all()
    for name in ("metrics.csv", "events.csv"):
        assert (tmp_path / "run" / name).read_bytes().endswith(b"\n")


def test_keep_through_skips_lines_that_do_not_parse_and_keeps_the_good_rows_after_them(reference, tmp_path):
    ref_metrics, ref_events = reference
    header, *rows = ref_metrics.splitlines(keepends=True)  # 4 rows per step
    torn = rows[12][:30]  # a row of step 4 cut short, then appended to (a full disk, then a resume)
    bad = [torn + rows[13], b"not,a,row\n", b"5,0,tied\n"]
    data = header + b"".join(rows[:12]) + bad[0] + bad[1] + b"".join(rows[14:28]) + bad[2] + b"".join(rows[28:])
    path = tmp_path / "metrics.csv"
    path.write_bytes(data + rows[40][:25])  # and a torn last line
    assert keep_through(path, 9, METRIC_COLUMNS) == (9 * 4 - 2, 4)
    assert path.read_bytes() == header + b"".join(rows[:12] + rows[14:36])

    events = tmp_path / "events.csv"
    events.write_bytes(ref_events[:-10])  # the last alert torn
    assert keep_through(events, 30, EVENT_COLUMNS) == (ref_events.count(b"\n") - 2, 1)
    with pytest.raises(RunDirError, match="unexpected header"):
        keep_through(events, 30, METRIC_COLUMNS)
    for content in (b"", METRICS_HEADER[:7]):  # an empty file, a torn header: the header, no rows
        path.write_bytes(content)
        assert keep_through(path, 9, METRIC_COLUMNS) == (0, 0)
        assert path.read_bytes() == METRICS_HEADER
    assert not (tmp_path / "metrics.csv.tmp").exists()


def _resume(run_dir, state, start, stop):
    torch.manual_seed(0)
    model = TiedAttention()
    model.load_state_dict(state["model"])
    writer = RunWriter(run_dir)
    watch = InstabilityWatch(model, WatchConfig(**CFG), layers=model.layers(), listeners=[writer])
    watch.load_state_dict(state["watch"])
    writer.open(watch, resume_step=watch.flushed_through)
    train_tied(model, watch, start, stop)
    watch.detach()
    writer.close()
    return watch


def _checkpointed_run(run_dir, steps):
    """A run of ``steps`` steps; returns its checkpoint (model and watch state) at the last step."""
    torch.manual_seed(0)
    model = TiedAttention()
    writer = RunWriter(run_dir)
    watch = InstabilityWatch(model, WatchConfig(**CFG), layers=model.layers(), listeners=[writer])
    writer.open(watch)
    train_tied(model, watch, 0, steps)
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "watch": json.loads(json.dumps(watch.state_dict()))}
    watch.detach()
    writer.close()
    return state


def test_resume_reports_skipped_lines_once_and_keeps_every_good_row(tmp_path, caplog):
    state = _checkpointed_run(tmp_path, 10)
    path = tmp_path / "metrics.csv"
    header, *rows = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(header + b"".join(rows[:8]) + b"3,0,ti" + b"".join(rows[8:]) + rows[0][:20])
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        _resume(tmp_path, state, 10, 15)
    warnings = [r.getMessage() for r in caplog.records if "do not parse" in r.getMessage()]
    assert len(warnings) == 1 and "skipped 2 lines of metrics.csv" in warnings[0]
    run = load_run(tmp_path)
    # the row the torn line swallowed (step 3, head 0) is gone; every other row is there, once
    assert len(run.metrics) == 15 * 4 - 1
    assert not ((run.metrics["step"] == 3) & (run.metrics["head"] == 0)).any()


@pytest.mark.parametrize("events", ["empty", "missing"])
def test_resume_with_events_file_empty_or_missing(tmp_path, events):
    state = _checkpointed_run(tmp_path, 10)
    if events == "empty":
        (tmp_path / "events.csv").write_bytes(b"")
    else:
        (tmp_path / "events.csv").unlink()
    watch = _resume(tmp_path, state, 10, 30)
    run = load_run(tmp_path)
    assert sorted(run.metrics["step"].unique()) == list(range(1, 31))
    assert list(run.events.columns) == list(EVENT_COLUMNS)
    assert len(run.events) == len(watch.alerts) + len(watch.events) > 0  # the alerts and switches of step 27


def test_resume_writes_again_the_restored_events_that_the_cut_removed(tmp_path):
    """An event after the resume step (a switch not applied, noted at call time) is in the checkpoint and was
    written by the run that died; the cut removes it from the file, so the resumed run writes it again, once."""
    state = _checkpointed_run(tmp_path, 10)  # flushed through step 10
    late = {"step": 11, "layer": 0, "head": 1, "kind": "switch_not_applied", "reason": "an attention mask",
            "layer_name": "tied"}
    state["watch"]["events"].append(late)
    with open(tmp_path / "events.csv", "ab") as f:
        f.write(b"11,0,tied,1,switch_not_applied,an attention mask,,,,written by the run that died\n")
    _resume(tmp_path, state, 10, 15)
    events = load_run(tmp_path).events
    late_rows = events[events["event"] == "switch_not_applied"]
    assert [(int(r.step), int(r.head), r.kind) for r in late_rows.itertuples()] == [(11, 1, "an attention mask")]


_TMPFS_SCRIPT = r"""
import json, logging, shutil, sys, torch
from instability_watch import InstabilityWatch, WatchConfig
from instability_watch.outputs.rundir import RunWriter
from watch_models import TiedAttention, train_tied

mnt, out = sys.argv[1], sys.argv[2]
messages = []
class Keep(logging.Handler):
    def emit(self, record):
        messages.append((record.levelname, record.getMessage()))
logging.getLogger("instability_watch").addHandler(Keep())
torch.manual_seed(0)
model = TiedAttention()
writer = RunWriter(mnt + "/run")
watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=5, warmup_steps=5), layers=model.layers(),
                         listeners=[writer])
writer.open(watch)
files = (writer._metrics_f, writer._events_f)
raised = None
try:
    train_tied(model, watch, 0, 40)
    watch.detach()
    writer.close()
except BaseException as exc:
    raised = repr(exc)
shutil.copytree(mnt + "/run", out, dirs_exist_ok=True)
print(json.dumps({"raised": raised, "messages": messages, "closed": [f.closed for f in files]}))
"""


def _unshare_mount():
    """The command prefix that runs a command in a private mount namespace with a 16 KiB tmpfs, or a skip reason."""
    if shutil.which("unshare") is None:
        return None, "no unshare(1): a small tmpfs cannot be mounted without root"
    cmd = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=16k tmpfs "$0" && exec "$@"']
    with tempfile.TemporaryDirectory() as probe:
        r = subprocess.run(cmd + [probe, "true"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return None, f"cannot mount a small tmpfs without root (unshare -rm mount: {r.stderr.strip()[:200]})"
    return cmd, None


def test_a_real_full_tmpfs(tmp_path):
    """The plain loop on a 16 KiB tmpfs (in a private mount namespace): it fills up around step 25 of 40."""
    cmd, why = _unshare_mount()
    if cmd is None:
        pytest.skip(why)
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent), str(TESTS.parent / "examples")]))
    r = subprocess.run(cmd + [str(mnt), sys.executable, "-c", _TMPFS_SCRIPT, str(mnt), str(out)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(TESTS))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["raised"] is None and result["closed"] == [True, True]
    failed = [m for level, m in result["messages"] if level == "ERROR" and FAILED.search(m)]
    assert len(failed) == 1, result["messages"]
    # meta.json's coverage rewrite may meet the full disk first: reported once, the CSV files go on
    others = [m for level, m in result["messages"] if level == "ERROR" and m not in failed]
    assert len(others) <= 1 and all("updating meta.json failed (" + NO_SPACE in m for m in others), others
    stop = int(FAILED.search(failed[0]).group(1))
    assert 5 < stop < 40
    for name in ("metrics.csv", "events.csv"):
        assert (out / name).read_bytes().endswith(b"\n")
    run = load_run(out)
    assert sorted(run.metrics["step"].unique()) == list(range(1, stop))
    assert (run.metrics.groupby("step").size() == 4).all()
