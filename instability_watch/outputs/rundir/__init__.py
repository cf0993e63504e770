"""The run directory: per-step diagnostics that survive a crash, and loading them back.

A run directory holds three files::

    meta.json     what was watched (layers, heads, config), written at open
    metrics.csv   long format: one row per (step, layer, head), columns METRIC_COLUMNS
    events.csv    one row per alert, switch or QK-clip, columns EVENT_COLUMNS

:class:`RunWriter` is a listener of :class:`~instability_watch.InstabilityWatch`:
after every read-back it appends the steps just read and the new events, one
unbuffered write per file (fsynced with ``fsync=True``). A run that is killed
keeps every step read back before the kill; what is lost is at most the steps
since the last read-back (``WatchConfig.log_every``) and, at worst, one partly
written last line, which :func:`load_run` skips. A write that fails (a full
disk) is cut back: both files keep exactly the whole steps before it; the
failure is reported once ("writing failed at step N ...; later steps are not
recorded"), nothing more is written, training goes on (unless ``strict``).

Resuming from a checkpoint reopens the same directory with ``resume_step``:
rows after that step (written after the checkpoint by the run that died) are
cut, so the resumed run writes every later step exactly once. Lines that do not
parse are dropped then (their count in one warning); every whole row through
that step is kept, also those after a bad line.

Reading a run back (:func:`load_run`, :func:`stream_run`, and so the report)
follows one rule:

* Fatal, a :class:`RunDirError` whose one-line message names the path: the
  directory is missing, is not a directory, or holds no metrics.csv;
  metrics.csv is empty or its header is not :data:`METRIC_COLUMNS`; meta.json
  exists but is not a JSON object.
* Skipped, never silently: a line that does not parse (the wrong number of
  fields; step, layer or head not an integer within int64; a metric that is
  not a number, ``nan`` or ``inf`` (an empty metric cell is NaN, as pandas writes
  it); bytes that are not UTF-8; a row spread over two lines); a last line without its newline (a torn write); the last step of
  metrics.csv when it has fewer rows than the run has heads, as a run killed
  mid-write leaves it (the heads are the (layer, head) pairs metrics.csv holds;
  meta.json's count only where it agrees with them). Every good row is kept,
  also those after a bad line. Each kind is one line of :attr:`Run.problems`
  (``"metrics.csv: 3 malformed lines skipped (first at line 1042)"``), which
  the report prints under its header.
* Treated as missing, with a note: an empty events.csv (no events), an
  events.csv with another header, a meta.json field of the wrong type or whose
  layers and heads disagree with metrics.csv. Nothing is sized from meta.json.
* A (step, layer, head) written twice (a resumed run whose file was not cut
  back): the later row wins.

Example::

    writer = RunWriter("runs/exp1")
    watch = InstabilityWatch(model, listeners=[writer])
    writer.open(watch)
    ...                                     # train; watch.step(loss) each step
    watch.detach(); writer.close()
    run = load_run("runs/exp1")             # run.metrics, run.events: DataFrames
"""
from instability_watch.outputs.rundir.reader import HeadIndex, StreamedRun, load_run, stream_run
from instability_watch.outputs.rundir.schema import (
                                                     BLOCK_BYTES,
                                                     EVENT_COLUMNS,
                                                     EVENTS_FILE,
                                                     FORMAT_VERSION,
                                                     META_FILE,
                                                     METRIC_COLUMNS,
                                                     METRICS_FILE,
                                                     RUN_DIR_NAME,
                                                     Run,
                                                     RunDirError,
                                                     RunWriteError,
)
from instability_watch.outputs.rundir.writer import RunWriter

__all__ = [
    "BLOCK_BYTES", "EVENT_COLUMNS", "EVENTS_FILE", "FORMAT_VERSION", "HeadIndex", "META_FILE", "METRIC_COLUMNS",
    "METRICS_FILE", "RUN_DIR_NAME", "Run", "RunDirError", "RunWriteError", "RunWriter", "StreamedRun", "load_run",
    "stream_run",
]
