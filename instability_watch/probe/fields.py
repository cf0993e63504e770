"""The rows of a probe: the one table of what the kernels and the observer count per head.

``COUNT_FIELDS`` are the rows of ``Probe.counts`` (int64, ``(len(COUNT_FIELDS), H)``), ``VALUE_FIELDS`` those of
``Probe.values`` (float32). :data:`COUNT_ROW` and :data:`VALUE_ROW` give each name's row: every kernel and pass
that writes a probe takes its row numbers from here.
"""
from __future__ import annotations

# Integer counters: rows of ``Probe.counts`` (int64, shape (len(COUNT_FIELDS), H)).
COUNT_FIELDS = (
    "rows", "multi_max_rows", "tie_rows", "nonfinite_rows", "shadow_rows", "delta_err_pos", "masked_rows",
    # the observer's call counts (the same value in every head's column; see observe/)
    "observed_calls", "shadow_calls", "unobserved_calls", "shadow_skipped_calls", "kernel_calls", "fallback_calls",
)
# The rows of COUNT_FIELDS that count calls, not attention rows.
CALL_FIELDS = COUNT_FIELDS[7:]
# Real-valued statistics: rows of ``Probe.values`` (float32, shape (len(VALUE_FIELDS), H)).
VALUE_FIELDS = ("max_score", "delta_err_sum", "delta_err_abs")
# The value each statistic is reset to.
VALUE_RESET = {"max_score": float("-inf"), "delta_err_sum": 0.0, "delta_err_abs": 0.0}
COUNT_ROW = {name: i for i, name in enumerate(COUNT_FIELDS)}
VALUE_ROW = {name: i for i, name in enumerate(VALUE_FIELDS)}
