"""`instability-watch report`: a postmortem of one run directory.

Reads a run directory written by :class:`~instability_watch.outputs.rundir.RunWriter`
(also one left by a killed run) and shows, per attention head, what the watch
saw and did:

* a summary table (:func:`head_summary`, rendered by :class:`SummaryView`):
  the step of the first alert of every kind, the number of alerts, the step at
  which the head was switched to the stabilized kernel, the peak multi-max
  frequency and peak attention logit, the final ``sum(delta_lp - delta_hp)``
  and the growth of sigma(W_Q). Heads that raised alerts come first (earliest
  alert first), then the heads with the largest accumulated delta drift. What
  the reader skipped or ignored (a torn last line, an incomplete last step,
  see :mod:`instability_watch.outputs.rundir`) is listed once under the header;
* one PNG per metric (:func:`write_plots`), the metric against the step above
  the loss: the heads most extreme in *that* metric in colour and labelled,
  heads that alerted or switched too, all others thin and gray; every alert (a
  vertical line, one colour per kind) and switch (dashed) marked. The figures
  correspond to those of the paper (Qiu & Yao, *Why Low-Precision Transformer
  Training Fails*):

  ================  ==========================================================
  ``sigma_wq.png``  spectral norm sigma(W_Q) per head: paper Fig. 3 / Fig. 11
  ``multi_max.png`` frequency of rows whose maximum repeats: paper Fig. 13
  ``delta_cum.png`` cumulative ``sum(delta_lp - delta_hp)`` over the shadow
                    steps: paper Fig. 5a
  ``max_score.png`` the largest attention logit per head
  ``loss.png``      the training loss alone, with the same marks
  ================  ==========================================================

The report reads metrics.csv a block at a time (:func:`digest_run`) and keeps
only what it shows: per head, the summary's values and at most
:data:`PLOT_POINTS` points per metric (a bucket of steps becomes one point:
its largest value, or for the running sum its last); per step, the loss. Its
memory does not grow with the number of steps times heads: a 200,000-step
GPT-2-small run (a 3.6 GB metrics.csv) is reported in 0.6 GB and 30 s on two
CPU cores (``benchmarks/report_memory.py``).

Metrics are sparse by design (sigma(W_Q) only every ``spectral_every`` steps,
the delta statistics only on shadow steps): ``NaN`` means "not observed" and
such points are left out of every plot and summary value.

Example::

    from instability_watch.outputs import report

    digest = report.digest_run("runs/exp1")     # or report.digest(load_run("runs/exp1"))
    print(report.head_summary(digest).head())
    report.write_plots(digest, "runs/exp1/report")
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from rich.console import Console

from instability_watch.outputs.report.digest import (
    METRIC_PLOTS,
    PLOT_POINTS,
    Digester,
    RunDigest,
    as_digest,
    digest,
    digest_run,
)
from instability_watch.outputs.report.plots import (
    GRAY,
    INSTALL_PLOTS,
    have_matplotlib,
    highlighted_heads,
    metric_figure,
    write_plots,
)
from instability_watch.outputs.report.summary import SUMMARY_COLUMNS, SummaryView, head_summary

__all__ = ["GRAY", "INSTALL_PLOTS", "METRIC_PLOTS", "PLOT_POINTS", "SUMMARY_COLUMNS", "Digester", "RunDigest", "SummaryView",
           "as_digest", "digest", "digest_run", "head_summary", "highlighted_heads", "main", "metric_figure", "write_plots"]


def main(run_dir: str | os.PathLike, *, out_dir: str | os.PathLike | None = None, top: int = 20,
         plots: bool = True, console: Optional[Console] = None) -> int:
    """Print a run's summary and write its plots (the ``instability-watch report`` command).

    Reads the run with :func:`digest_run`: memory stays bounded however long the run.

    Args:
        run_dir: the run directory.
        out_dir: where the PNGs go (default ``RUN_DIR/report/``).
        top: rows of the summary table; each plot colours the ``min(top, 6)``
            heads most extreme in its metric.
        plots: write the PNGs. Without matplotlib installed they are skipped
            with a one-line note.
        console: where to print (default: a new ``rich.console.Console()``).

    Returns:
        The exit status, 0.

    Raises:
        RunDirError: ``run_dir`` is missing or not a readable run directory.
        OSError: the output directory cannot be written.
    """
    console = console or Console()
    d = digest_run(run_dir)
    summary = head_summary(d)
    console.print(SummaryView(d, summary, top=top))
    if not plots:
        return 0
    if not have_matplotlib():
        console.print(f"plots skipped: matplotlib is not installed; {INSTALL_PLOTS}", markup=False, highlight=False)
        return 0
    out = Path(out_dir) if out_dir is not None else d.run_dir / "report"
    written = write_plots(d, out, top=max(1, min(top, 6)), summary=summary)
    console.print(f"wrote {len(written)} plots:", markup=False, highlight=False)
    for path in written:
        console.print(f"  {path}", markup=False, highlight=False, soft_wrap=True)
    return 0
