"""The watch on sharded models: FSDP2 (``fully_shard``) and FSDP1, 2 CPU processes with gloo.

All runs are one launch of ``tests/scripts/fsdp_watch.py`` (starting processes dominates on
CPU), in a subprocess with a clean environment: two processes run the one-process runs side by
side, each alone, then every 2-process run one after the other in one process group. The
2-process runs are compared with the same training in one process (the ranks'
halves of each global batch as two micro-batches: the same gradients bit for bit).
"""
import json
import math
import socket
import sys

import pytest

from helpers import REPO, child_env, run_process

SCRIPT = REPO / "tests" / "scripts" / "fsdp_watch.py"
EXACT = ("rows", "multi_max_rows", "masked_rows", "nonfinite_rows", "shadow_rows", "multi_max_freq",
         "stabilized", "nonfinite", "delta_err_pos_frac")
# float sums in another order: the loss and delta sums over ranks; sigma from Grams computed where the
# rows are (and, once a head is switched, the float32 gradients of our kernels' CPU path on half batches)
ROUNDED = ("loss", "delta_err_sum", "delta_err_abs", "delta_cum", "sigma_wq", "max_score")


def _port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(jobs, out):
    """Run ``[(mode, model), ...]`` in one launch; ``{(mode, model): [rank 0's result, rank 1's]}`` (one for single)."""
    env = child_env(out)
    proc = run_process([sys.executable, str(SCRIPT), str(out), str(_port()), *(f"{m}:{n}" for m, n in jobs)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {(mode, model): [json.loads((out / f"{mode}_{model}_rank{r}.json").read_text())
                            for r in range(1 if mode == "single" else 2)]
            for mode, model in jobs}


def _flat(x):
    if isinstance(x, list):
        for v in x:
            yield from _flat(v)
    else:
        yield x


def _close(a, b, rel):
    a, b = list(_flat(a)), list(_flat(b))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None or isinstance(x, str) or isinstance(y, str):
            assert x == y
        else:
            assert math.isclose(x, y, rel_tol=rel, abs_tol=1e-6), (x, y)


def _same_as_single(run, single):
    assert run["switched"] == single["switched"] and run["alerts"] == single["alerts"]
    assert [m["step"] for m in run["metrics"]] == list(range(1, 7))
    for m, s in zip(run["metrics"], single["metrics"]):
        for key in EXACT:  # counts, maxima and sigma: equal
            assert m[key] == s[key], (m["step"], key, m[key], s[key])
        for key in ROUNDED:
            _close(m[key], s[key], 1e-5)


def _sigma_is_the_whole_weights(run):
    """sigma(W_Q) per head on every step equals the float64 norm of the gathered weights within 1e-5 relative."""
    last = run["metrics"][-1]["sigma_wq"]
    for got, ref in zip(last, run["sigma_ref"]):
        for g, r in zip(got, ref):
            assert abs(g - r) <= 1e-5 * r, (g, r)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    jobs = [("single", "nanogpt"), ("single", "llama"),
            ("fsdp2", "nanogpt"), ("fsdp2", "llama"), ("fsdp2compiled", "nanogpt"), ("fsdp2compiled", "llama"),
            ("fsdp1", "nanogpt"), ("fsdp1", "llama"),
            ("fsdp1units", "nanogpt"), ("fsdp1layers", "nanogpt"), ("fsdp1fail", "nanogpt")]
    return _run(jobs, tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def single_runs(runs):
    return {model: ranks[0] for (mode, model), ranks in runs.items() if mode == "single"}


@pytest.fixture(scope="module")
def sharded_runs(runs):
    return {job: ranks for job, ranks in runs.items() if job[0] != "single"}


@pytest.mark.parametrize("model", ["nanogpt", "llama"])
def test_fsdp2_two_ranks_decide_alike_and_match_one_process(model, single_runs, sharded_runs):
    r0, r1 = sharded_runs["fsdp2", model]
    run = r0["run"]
    # every rank the same statistics, alerts, switches and state
    assert r0["run"] == r1["run"] and r0["final_state"] == r1["final_state"]
    assert run["disabled"] == {} and run["steps"] == 6
    assert run["switched"], "the multi-max detector switched no head: the comparison would be empty"
    _sigma_is_the_whole_weights(run)
    _same_as_single(run, single_runs[model]["run"])
    # the switched layer ran on our kernels under FSDP2; nothing unobserved
    assert any(c["kernel_calls"] > 0 for c in run["coverage"])
    assert all(c["unobserved_calls"] == {} and c["not_applied"] == {} for c in run["coverage"])
    # the checkpoint round trip: a fresh model, optimizer and watch resumed from the DCP checkpoint
    # after step 4 end in the state of the uninterrupted run
    assert r0["state_at_resume"] == r1["state_at_resume"]
    assert r0["resumed_state"] == r0["final_state"] and r1["resumed_state"] == r1["final_state"]
    assert r0["resumed_switched"] == run["switched"]


@pytest.mark.parametrize("model", ["nanogpt", "llama"])
def test_fsdp2_with_blocks_compiled_one_by_one_matches_one_process(model, single_runs, sharded_runs):
    """torchtitan's set-up: each block compiled on its own, then sharded per block. Both ranks decide alike, and
    every layer's statistics, switches and sigma are those of the same training in one process, uncompiled."""
    r0, r1 = sharded_runs["fsdp2compiled", model]
    run = r0["run"]
    assert r0["run"] == r1["run"] and r0["final_state"] == r1["final_state"]
    assert run["disabled"] == {} and run["steps"] == 6 and run["switched"]
    _same_as_single(run, single_runs[model]["run"])
    _sigma_is_the_whole_weights(run)
    # the switched layer ran on our kernels inside its compiled block; nothing unobserved
    assert any(c["kernel_calls"] > 0 for c in run["coverage"])
    assert all(c["unobserved_calls"] == {} and c["observed_calls"] == 12 for c in run["coverage"])


@pytest.mark.parametrize("model", ["nanogpt", "llama"])
def test_fsdp1_sigma_from_the_attention_weights_rebuilt_in_one_all_reduce(model, single_runs, sharded_runs):
    """use_orig_params=True (Lightning's default): every spectral step rebuilds the watched attention modules'
    weights from the ranks' flat-shard pieces with one all-reduce, and gathers no unit; sigma is the whole
    weights', and the run equals the one-process run."""
    r0, r1 = sharded_runs["fsdp1", model]
    run = r0["run"]
    assert r0["run"] == r1["run"] and run["disabled"] == {} and not run["problems"]
    assert r0["gathers"] == r1["gathers"] == {"whole_params": 6, "unit_gathers": 0}  # spectral every step
    _sigma_is_the_whole_weights(run)
    _same_as_single(run, single_runs[model]["run"])


def test_fsdp1_weights_larger_than_the_budget_are_rebuilt_layer_by_layer(single_runs, sharded_runs):
    """With room for one layer's weights at a time (sharding.WHOLE_BYTES = 1 byte), one all-reduce per layer and
    spectral step (2 x 6), the same result."""
    r0, r1 = sharded_runs["fsdp1layers", "nanogpt"]
    run = r0["run"]
    assert r0["run"] == r1["run"] and run["disabled"] == {} and not run["problems"]
    assert r0["gathers"] == r1["gathers"] == {"whole_params": 12, "unit_gathers": 0}
    _sigma_is_the_whole_weights(run)
    _same_as_single(run, single_runs["nanogpt"]["run"])


def test_fsdp1_without_the_original_parameters_gathers_each_unit(single_runs, sharded_runs):
    """use_orig_params=False: no pieces to rebuild from; each layer's block is gathered while its W_Q is read
    (2 layers x 6 spectral steps), with the same result."""
    r0, r1 = sharded_runs["fsdp1units", "nanogpt"]
    run = r0["run"]
    assert r0["run"] == r1["run"] and run["disabled"] == {}
    assert r0["gathers"] == r1["gathers"] == {"whole_params": 0, "unit_gathers": 12}
    _sigma_is_the_whole_weights(run)
    _same_as_single(run, single_runs["nanogpt"]["run"])


def test_fsdp1_a_rank_whose_w_q_read_fails_still_takes_part_in_the_gathers(sharded_runs):
    """Rank 1's W_Q read of layer 0 fails from step 3 on: no rank hangs or stops; rank 1 says so once; every
    rank gets sigma from rank 0 (the max-reduction), equal on both ranks; nothing is turned off."""
    r0, r1 = sharded_runs["fsdp1fail", "nanogpt"]
    a, b = r0["run"], r1["run"]
    assert a["steps"] == b["steps"] == 6 and a["disabled"] == b["disabled"] == {}
    # one all-reduce per layer: rank 1 joined layer 1's after layer 0's read failed (else both would hang)
    assert r0["gathers"] == r1["gathers"] == {"whole_params": 12, "unit_gathers": 0}
    assert "spectral-gather" in b["problems"] and "spectral-gather" not in a["problems"]
    assert a["metrics"] == b["metrics"]
    _sigma_is_the_whole_weights(a)
