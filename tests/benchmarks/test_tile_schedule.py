"""benchmarks/tile_schedule.py: the tiles' work over packed documents and the scheduler model's makespan."""
from __future__ import annotations

import pytest

from helpers import benchmark_module


@pytest.fixture(scope="module")
def ts():
    return benchmark_module("tile_schedule")


def test_spans_are_the_tiles_each_loop_visits_causal_within_documents(ts):
    # documents of 6 and 10 tokens, tiles of 4 (rows or keys) and 2 (the other side)
    # query tiles: rows 0-3 (doc 0) see keys 0-3; rows 4-7 (docs 0, 1) keys 0-7; 8-11 keys 6-11; 12-15 keys 6-15
    assert ts.spans([6, 10], 4, 2, rows=True) == [2, 4, 3, 5]
    # key tiles: keys 0-3 are seen by rows 0-5; keys 4-7 (docs 0, 1) by rows 4-15; 8-11 by 8-15; 12-15 by 12-15
    assert ts.spans([6, 10], 4, 2, rows=False) == [3, 6, 4, 2]


def test_makespan_over_the_mean_load(ts):
    assert ts.makespan([1, 1, 1, 1], 2) == 1.0
    assert ts.makespan([1, 1, 1, 3], 2) == pytest.approx(4 / 3)  # 3 starts last, on a slot that ran a 1
    assert ts.makespan([3, 1, 1, 1], 2) == 1.0  # the widest first: no tail


def test_the_benchmark_documents_tail_and_the_order_by_work(ts, capsys):
    assert ts.main(["--slots", "132"]) == 0
    rows = {ln[:22].strip(): ln[22:].split() for ln in capsys.readouterr().out.splitlines()[2:]}
    assert rows["dK/dV per KV head"][0] == "512" and float(rows["dK/dV per KV head"][1]) > 1.25
    assert all(float(r[2]) <= 1.05 for r in rows.values())  # by work: within 5% of the mean load
