"""benchmarks/multi_gpu.py (issue 26's driver) on CPU: 2 processes (gloo), tiny models, DDP and FSDP2.

One launch in a subprocess with a clean environment (Lightning's DDP re-launches the script for rank 1).
"""
import json
import sys

from helpers import REPO, child_env, run_process


def test_multi_gpu_driver_on_two_cpu_processes(tmp_path):
    env = child_env(tmp_path)
    out = tmp_path / "out"
    proc = run_process([sys.executable, str(REPO / "benchmarks" / "multi_gpu.py"), "--accelerator", "cpu",
                           "--devices", "2", "--tiny", "--strategies", "ddp,fsdp2", "--rounds", "1", "--steps", "8",
                           "--skip", "2", "--ckpt-step", "6", "--every", "2", "--check-every", "1", "--block", "32",
                           "--batch", "2", "--pairs", "1", "--block-steps", "4",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((out / "results.json").read_text())
    cases = {(c["model"], c["strategy"]): c for c in result["cases"]}
    assert set(cases) == {(m, s) for m in ("gpt2-small", "llama-1b") for s in ("ddp", "fsdp2")}
    for key, c in cases.items():
        assert "error" not in c, (key, c.get("error"))
        assert c["ratio_median"] > 0 and len(c["rounds"]) == 1
        # each step timed between the marks: steps 3..7 of 8; probe steps (every 2) are the odd ones
        w, u = c["rounds"][0]["watched_steps"], c["rounds"][0]["unwatched_steps"]
        assert w["steps"] == u["steps"] == 5 and w["other_steps"] == u["other_steps"] == 2, key
        assert w["other_ms"] > 0 and u["other_ms"] > 0 and -1 < w["share"] < 1 and "share" not in u, key
        assert c["cost"]["estimate"] > 0 and c["cost"]["fit_ratio"]["n"] == 1, key
        # the fit in blocks: warm-up (steps 1-4), watched (5-8: the watch's probes at its steps 1 and 3), unwatched
        # (9-12); one pair, compared on position 2 (positions 3 and 4 are a probe and the fit's unmarked end)
        (pair,) = c["blocks"]["pairs"]
        assert pair["watched_block"] == 1 and pair["other_steps"] == 1 and pair["other_ratio"] > 0, key
        assert -1 < pair["share"] < 1 and c["blocks"]["estimate"]["n"] == 1, key
        # sigma of step 6 (spectral every step) read back vs float64 SVD of the whole W_Q at that step
        assert c["sigma_step"] == 6 and c["sigma_max_rel_diff"] < 1e-5, key
        # the checkpointed fit's watch decided (alerts, switched heads), the same on both ranks
        assert c["alerts"] and c["switched"], key
        assert c["ranks_agree"] and c["resumed_state_equal"] and c["saved_state_steps"] == 6, key
        assert c["data_parallel"] == 2, key  # each rank its own batches (FSDP2's mesh over both ranks)
    # the checkpoint's watch state is a real one: both ranks restored step 6, with per-head state
    for r in (0, 1):
        restored = json.loads((out / "llama-1b-fsdp2" / f"resumed_rank{r}.json").read_text())["restored"]
        assert restored["step"] == 6 and restored["heads"] == [4, 4]
    assert "gpt2-small  ddp" in proc.stdout
    # issue 45's tables read this output: one row per case, every timing column filled
    rep = run_process([sys.executable, str(REPO / "benchmarks" / "two_gpu_report.py"), str(out)], env=env,
                      capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr[-2000:]
    rows = [line for line in rep.stdout.splitlines() if line.startswith(("| gpt2-small |", "| llama-1b |"))]
    assert len(rows) == 4 and all("] (1) |" in r and "True | True" in r for r in rows), rep.stdout
    assert "One fit in blocks" in rep.stdout and "| gpt2-small (Lightning) | ddp | 4 | 1 |" in rep.stdout, rep.stdout
