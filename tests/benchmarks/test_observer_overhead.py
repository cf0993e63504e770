"""benchmarks/observer_overhead.py's toggled rounds (the watch's cost on one copy): a watch attached for one block of
steps and none for the next, on a tiny HF GPT-2 on the CPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import benchmark_module


def test_toggled_rounds_attach_a_watch_for_one_block_and_none_for_the_next(monkeypatch):
    pytest.importorskip("transformers")
    oo = benchmark_module("observer_overhead")
    model, vocab, batch, seq = oo.hf_gpt2(True)[:4]
    c = oo.Copy(model, "cpu")
    made = []
    real = oo.InstabilityWatch
    monkeypatch.setattr(oo, "InstabilityWatch", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    g = torch.Generator().manual_seed(0)

    def batches(n):
        ids = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]
        return [{"input_ids": i, "labels": i} for i in ids]

    out = oo.toggled("tiny", c, batches, "cpu", SimpleNamespace(toggle_rounds=3, block=2))
    # one watch per round, each for one block of 2 timed steps and the 2 untimed before them, then detached
    assert len(made) == 3
    assert [w.step_count for w in made] == [4, 4, 4]
    assert not any(w.attached for w in made) and c.watch is None
    assert len(out["ratios"]) == 3
    assert out["ratios"] == pytest.approx([u / w for u, w in zip(out["unwatched_ms"], out["watched_ms"])])
    assert "median_ratios" not in out  # (CUDA events only)
