"""benchmarks/hf_trainer_multi_gpu.py (issue 26's Hugging Face driver) on CPU: 2 processes (torchrun, gloo).

One launch: a timed round (unwatched, watched), a checkpointed run whose watch alerts and switches heads,
and its resumption, in the same two processes.
"""
import json
import sys

from helpers import REPO, child_env, run_process

SCRIPT = REPO / "benchmarks" / "hf_trainer_multi_gpu.py"


def _env(tmp_path):
    return child_env(tmp_path)


def test_hf_trainer_driver_on_two_cpu_processes(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--cpu", "--tiny", "--rounds", "1", "--steps", "6", "--skip", "2", "--ckpt-step", "6",
           "--check-every", "1", "--block", "32", "--batch", "2", "--pairs", "1", "--block-steps", "3",
           "--out", str(out)]
    proc = run_process(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads((out / "results.json").read_text())
    assert r["world_size"] == 2 and len(r["rounds"]) == 1 and r["ratio_median"] > 0
    assert r["data_parallel"] == 2
    # each step between the marks timed (steps 3-5 of 6; at the defaults none is a probe or read-back step)
    w, u = r["rounds"][0]["watched_steps"], r["rounds"][0]["unwatched_steps"]
    assert w["steps"] == u["steps"] == 3 and w["other_steps"] == u["other_steps"] == 3
    assert w["share"] == 0 and r["cost"]["estimate"] > 0 and r["cost"]["fit_ratio"]["n"] == 1
    # the run in blocks of 3: warm-up (steps 1-3), watched (4-6), unwatched (7-9), compared on position 2
    (pair,) = r["blocks"]["pairs"]
    assert pair["watched_block"] == 1 and pair["other_steps"] == 1 and pair["other_ratio"] > 0
    # sigma of step 6 (spectral every step) read back vs float64 of the whole W_Q at that step
    assert r["sigma_step"] == 6 and r["sigma_max_rel_diff"] < 1e-5
    # the checkpointed run's watch decided something (alerts, switched heads), and both ranks decided the same
    assert r["alerts"] and r["switched"] and r["ranks_agree"]
    ranks = [json.loads((out / f"ckpt_rank{i}.json").read_text()) for i in (0, 1)]
    assert ranks[0]["alerts"] == ranks[1]["alerts"] and ranks[0]["switched"] == ranks[1]["switched"]
    assert all(x["steps"] == 6 for x in ranks)
    # the resumed run started from the checkpoint's watch state, on both ranks, with its switched heads
    assert r["saved_state_step"] == 6 and r["resumed_state_equal"]
    resumed = [json.loads((out / f"resumed_rank{i}.json").read_text()) for i in (0, 1)]
    for x in resumed:
        assert x["restored"]["step"] == 6 and x["restored"]["heads"] == [4, 4] and x["steps"] == 8
        assert [s[:2] for s in x["restored"]["switched"]] == [s[:2] for s in r["switched"]]
    # the resumed run continued the checkpointed run's directory: steps 1-6, then 7 and 8
    assert r["ckpt_run_steps"] == list(range(1, 9))
    assert "agree" in proc.stdout


def test_hf_trainer_driver_refuses_bad_arguments(tmp_path):
    for args, says in ((["--skip", "10", "--steps", "5"], "--skip must be in (0, --steps = 5), got 10"),
                       (["--batch", "0"], "--batch must be a positive integer, got 0"),
                       (["--cpu", "--share-device"], "--share-device is for a GPU")):
        proc = run_process([sys.executable, str(SCRIPT), *args], env=_env(tmp_path), capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 2 and says in proc.stderr, (args, proc.stderr[-500:])


def test_two_gpu_report_refuses_a_missing_folder(tmp_path):
    proc = run_process([sys.executable, str(REPO / "benchmarks" / "two_gpu_report.py"), str(tmp_path / "nope")],
                       env=_env(tmp_path), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "no such folder or file" in proc.stderr and "nope" in proc.stderr
