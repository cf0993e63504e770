"""One run directory, one writer: a second run into a directory another process is writing is refused (whatever
the options); an earlier writer of the same process still open there is closed and records nothing more."""
import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from instability_watch import InstabilityWatch, RunWriter, WatchConfig
from instability_watch.outputs.rundir import load_run
from instability_watch.outputs.rundir.writer import WRITER_MARK, _process_start

from nanogpt import GPT, GPTConfig

EVERY = dict(probe_every=1, shadow_every=0, spectral_every=1, log_every=2, warmup_steps=0)


def _watch(writer):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    return model, InstabilityWatch(model, WatchConfig(**EVERY), listeners=[writer])


def _train(model, watch, steps):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x = torch.randint(0, 32, (2, 8))
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        watch.step()


@pytest.fixture
def other_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_directory_another_process_writes_is_refused_until_that_process_ends(tmp_path, other_process):
    run = tmp_path / "run"
    run.mkdir()
    (run / WRITER_MARK).write_text(json.dumps({"host": socket.gethostname(), "pid": other_process.pid,
                                               "since": "2026-11-28T10:00:00+00:00",
                                               "start": _process_start(other_process.pid)}))
    for options in ({}, {"overwrite": True}):
        writer = RunWriter(run, **options)
        _, watch = _watch(writer)
        why = writer.conflict()
        assert why is not None and f"process {other_process.pid} on this host" in why and "mix their rows" in why
        assert writer.conflict(resuming=True) == why  # resuming does not make two writers one
        with pytest.raises(FileExistsError, match=f"being written by another run \\(process {other_process.pid}"):
            writer.open(watch)
        watch.detach(read_back=False)
    assert not (run / "metrics.csv").exists()  # nothing of the refused runs was written

    other_process.kill()  # a killed run leaves its mark: it no longer counts, a zombie not yet reaped included
    if _process_start(os.getpid()):  # (where there is /proc)
        for _ in range(100):
            if _process_start(other_process.pid) is None:
                break
            time.sleep(0.05)
        assert RunWriter(run).conflict() is None
    other_process.wait()
    writer = RunWriter(run)
    model, watch = _watch(writer)
    assert writer.conflict() is None
    writer.open(watch)
    mark = json.loads((run / WRITER_MARK).read_text())
    assert mark["pid"] == os.getpid() and mark["host"] == socket.gethostname()
    _train(model, watch, 4)
    watch.detach()
    writer.close()
    assert not (run / WRITER_MARK).exists()
    assert sorted(load_run(run).metrics["step"].unique()) == [1, 2, 3, 4]


def test_a_mark_from_another_host_or_unreadable_is_not_a_writer(tmp_path, other_process):
    run = tmp_path / "run"
    run.mkdir()
    here = socket.gethostname()
    for text in (json.dumps({"host": here + "-elsewhere", "pid": other_process.pid}), "{not json"):
        (run / WRITER_MARK).write_text(text)
        assert RunWriter(run).conflict() is None


def test_an_earlier_writer_of_this_process_still_open_there_is_closed_and_records_nothing_more(tmp_path, caplog):
    run = tmp_path / "run"
    first = RunWriter(run)
    model1, watch1 = _watch(first)
    first.open(watch1)
    _train(model1, watch1, 2)  # steps 1-2 read back into the first run

    second = RunWriter(run, overwrite=True)  # e.g. a notebook cell run again without closing the first watch
    model2, watch2 = _watch(second)
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        second.open(watch2)
    assert "still open in an earlier writer of this process" in caplog.text
    assert not first.is_open and second.is_open
    _train(model1, watch1, 2)  # the first watch reads back again: nothing of it reaches the files
    _train(model2, watch2, 6)
    watch1.detach()
    watch2.detach()
    first.close()
    assert (run / WRITER_MARK).exists()  # the first writer's close leaves the second's mark
    second.close()
    assert not (run / WRITER_MARK).exists()
    metrics = load_run(run).metrics
    assert sorted(metrics["step"].unique()) == [1, 2, 3, 4, 5, 6]
    assert len(metrics) == 6 * 2  # one row per head and step: no row of the first run among them


def test_a_refused_second_writer_leaves_the_first_one_writing(tmp_path):
    run = tmp_path / "run"
    first = RunWriter(run)
    model1, watch1 = _watch(first)
    first.open(watch1)
    _train(model1, watch1, 2)
    second = RunWriter(run)  # no overwrite: the directory holds a run
    _, watch2 = _watch(second)
    with pytest.raises(FileExistsError, match="already holds a run"):
        second.open(watch2)
    assert first.is_open
    _train(model1, watch1, 2)
    watch1.detach()
    first.close()
    watch2.detach(read_back=False)
    assert sorted(load_run(run).metrics["step"].unique()) == [1, 2, 3, 4]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="process start times come from /proc")
def test_a_mark_whose_process_id_is_now_another_process_is_not_a_writer(tmp_path, other_process):
    """A crashed run's process id taken by another process since (its start time differs): not a writer."""
    run = tmp_path / "run"
    run.mkdir()
    start = _process_start(other_process.pid)
    mark = {"host": socket.gethostname(), "pid": other_process.pid}
    (run / WRITER_MARK).write_text(json.dumps({**mark, "start": str(int(start) - 1)}))
    assert RunWriter(run).conflict() is None
    (run / WRITER_MARK).write_text(json.dumps({**mark, "start": start}))
    assert "being written by another run" in RunWriter(run).conflict()
