"""QK-clip on two ranks (gloo, CPU): DDP, FSDP2 and FSDP1 clip alike on every rank and as one process would.

One ``torch.distributed.run`` launch of ``tests/scripts/qk_clip_dist.py`` runs every case on 2 ranks; one plain
process runs the training cases unsharded on the same global batches (the ranks' halves as two micro-batches),
at the same time. Single-process numerics: test_qk_clip.py.
"""
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from helpers import REPO, child_env

SCRIPT = REPO / "tests" / "scripts" / "qk_clip_dist.py"
HAVE_LLAMA = importlib.util.find_spec("transformers") is not None
MODELS = ["nanogpt", "llama"] if HAVE_LLAMA else ["nanogpt"]  # what the launches run
TRAIN = [f"{mode}-{m}" for m in MODELS for mode in ("ddp", "fsdp2", "fsdp1")]
TAU_CASES = [f"{mode}-{m}" for m in MODELS for mode in ("tau2", "tau1")]
STEPS = {"ddp": 6, "fsdp2": 7, "fsdp1": 7}
PROBE_STEPS = {"ddp": [1, 2, 3, 4, 5, 6], "fsdp2": [1, 3, 5, 7], "fsdp1": [1, 3, 5, 7]}

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend")


def _cases(*cases):
    return [pytest.param(c, id=c, marks=[] if c.endswith("nanogpt") or HAVE_LLAMA
                         else [pytest.mark.skip(reason="needs transformers (HF Llama)")]) for c in cases]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("qk_clip_dist")
    env = child_env(out)
    commands = {
        "dist": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 str(SCRIPT), str(out), *TRAIN, *TAU_CASES],
        "single": [sys.executable, str(SCRIPT), str(out), *TRAIN],
    }
    procs = {}
    for name, cmd in commands.items():
        with open(out / f"{name}.log", "w") as log:  # files, not pipes: two processes write at once
            procs[name] = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=400)
        except subprocess.TimeoutExpired:
            codes[name] = "timeout"
        finally:  # the launcher and its workers (their own session): none outlives the launch
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    for name, code in codes.items():
        assert code == 0, f"{name}: {code}\n" + (out / f"{name}.log").read_text()[-6000:]
    return out


def _ranks(out, case):
    return [json.loads((out / f"{case}_rank{r}.json").read_text()) for r in (0, 1)]


def _metrics(run):
    return {m["step"]: m["max_score"] for m in run["metrics"]}


def _flat_heads(run):
    """(layer, head) of each entry of a flat per-head vector (the watch's order: layer by layer)."""
    return [(layer, h) for layer, n in enumerate(run["head_counts"]) for h in range(n)]


def _ranks_agree(r0, r1):
    """Both ranks: the same parameters after every step, the same statistics, clips, counts and state; the clips
    are exactly the heads whose largest logit over both ranks' batches is over tau, each by tau / that logit."""
    assert r0["world"] == r1["world"] == 2
    assert r0["disabled"] == r1["disabled"] == {} and r0["problems"] == r1["problems"] == []
    assert r0["hashes"] == r1["hashes"] and r0["initial_hash"] == r1["initial_hash"]
    assert r0["metrics"] == r1["metrics"]
    assert r0["clips"] == r1["clips"] and r0["clip_counts"] == r1["clip_counts"]
    assert json.dumps(r0["state"], sort_keys=True) == json.dumps(r1["state"], sort_keys=True)
    run, tau = r0, r0["tau"]
    counts = [[0] * n for n in run["head_counts"]]
    for step, layer, head, factor, max_logit, clip_tau, _ in run["clips"]:
        counts[layer][head] += 1
    assert run["clip_counts"] == counts == run["state"]["qk_clip"]["counts"]
    assert run["state"]["qk_clip"]["enabled"] == []  # "always": no head needs enabling
    metrics = _metrics(run)
    clips = {(c[0], c[1], c[2]): c for c in run["clips"]}
    heads = _flat_heads(run)
    local0, local1 = r0["local_max"], r1["local_max"]
    assert [s for s, _ in local0] == [s for s, _ in local1] and local0 and all(v is not None for _, v in local0)
    for (step, a), (_, b) in zip(local0, local1):
        for i, (layer, head) in enumerate(heads):
            top = max(a[i], b[i])  # what every rank must act on: the MAX over the ranks
            assert math.isclose(metrics[step][layer][head], top, rel_tol=1e-7), (step, layer, head)
            clip = clips.get((step, layer, head))
            assert (clip is not None) == (top > tau), (step, layer, head, top, tau)
            if clip is not None:
                _, _, _, factor, max_logit, clip_tau, _ = clip
                assert clip_tau == tau and math.isclose(max_logit, top, rel_tol=1e-7)
                assert 0 < factor < 1 and math.isclose(factor, tau / top, rel_tol=1e-6), (clip, top)
    assert {c[0] for c in run["clips"]} <= {s for s, _ in local0}  # clips on probe steps only


def _several_not_all(run):
    per_head = [c for layer in run["clip_counts"] for c in layer]
    assert sum(1 for c in per_head if c > 0) >= 2, run["clip_counts"]
    assert any(c == 0 for layer in run["clip_counts"] for c in layer), run["clip_counts"]


def _same_as_single(out, case, run):
    """The whole weights within 1e-5 relative of the one-process run's; the same clips, factors within 1e-5."""
    single = json.loads((out / f"{case}_single.json").read_text())
    assert single["world"] == 1 and single["disabled"] == {} and single["steps"] == run["steps"]
    wd = torch.load(out / f"{case}_dist_weights.pt")
    ws = torch.load(out / f"{case}_single_weights.pt")
    assert sorted(wd["final"]) == sorted(ws["final"])
    for name, ref in ws["initial"].items():
        assert torch.equal(wd["initial"][name], ref), name  # the same model to start from
    for name, ref in ws["final"].items():
        got = wd["final"][name]
        assert got.shape == ref.shape, name
        err = (got.double() - ref.double()).abs().max().item()
        assert err <= 1e-5 * ref.abs().max().item(), (name, err)
    tau = run["tau"]
    a = {(c[0], c[1], c[2]): c[3] for c in run["clips"]}
    b = {(c[0], c[1], c[2]): c[3] for c in single["clips"]}
    assert len(a.keys() & b.keys()) >= 4
    ma, mb = _metrics(run), _metrics(single)
    for key in a.keys() | b.keys():
        step, layer, head = key
        if key in a and key in b:
            assert math.isclose(a[key], b[key], rel_tol=1e-5), (key, a[key], b[key])
        else:  # one run clipped, the other not: only for a logit within rounding of tau in both
            for m in (ma, mb):
                assert math.isclose(m[step][layer][head], tau, rel_tol=1e-5), (key, ma[step][layer][head],
                                                                                mb[step][layer][head])
    assert sorted(ma) == sorted(mb)
    for step in ma:  # the largest logits (None: a step recorded without the probe)
        for x, y in zip(sum(ma[step], []), sum(mb[step], [])):
            assert (x is None and y is None) or math.isclose(x, y, rel_tol=1e-5), (step, x, y)


@pytest.mark.parametrize("case", _cases("ddp-nanogpt", "ddp-llama"))
def test_ddp_ranks_on_different_data_clip_alike(out, case):
    r0, r1 = _ranks(out, case)
    _ranks_agree(r0, r1)
    assert r0["steps"] == STEPS["ddp"] and [s for s, _ in r0["local_max"]] == PROBE_STEPS["ddp"]
    # after every step (clip included) the parameters are bitwise the same on both ranks, and they moved
    assert len(set(r0["hashes"] + [r0["initial_hash"]])) == STEPS["ddp"] + 1
    _several_not_all(r0)
    # the ranks' own largest logits differ; on each rank some clip came from the other rank's logit
    heads = _flat_heads(r0)
    tau = r0["tau"]
    from_other = set()
    for (step, a), (_, b) in zip(r0["local_max"], r1["local_max"]):
        for i in range(len(heads)):
            if max(a[i], b[i]) > tau and a[i] != b[i]:
                from_other.add(0 if b[i] > a[i] else 1)
    assert from_other == {0, 1}
    _same_as_single(out, case, r0)


@pytest.mark.parametrize("case", _cases("fsdp2-nanogpt", "fsdp2-llama", "fsdp1-nanogpt", "fsdp1-llama"))
def test_sharded_ranks_clip_alike_and_match_one_process(out, case):
    mode = case.split("-")[0]
    r0, r1 = _ranks(out, case)
    _ranks_agree(r0, r1)
    assert r0["steps"] == STEPS[mode] and [s for s, _ in r0["local_max"]] == PROBE_STEPS[mode]
    assert {c[0] for c in r0["clips"]} == set(PROBE_STEPS[mode])  # a clip at every probe step
    _several_not_all(r0)
    _same_as_single(out, case, r0)


def _scaled_rows(name, init, factors):
    """The query/key rows of one attention layer: the expected whole weight after the clips ``factors``
    (head -> the factors of its clips, in order). MHA: W_q and W_k rows times sqrt of each; GQA: W_q rows times
    each, the keys never."""
    if name == "nanogpt":
        w = init["h.0.attn.c_attn.weight"].clone()
        q, k = w[:32].view(4, 8, 32), w[32:64].view(4, 8, 32)
        for h, fs in factors.items():
            for f in fs:
                r = torch.tensor(f, dtype=torch.float32).sqrt()
                q[h] *= r
                k[h] *= r
        return {"h.0.attn.c_attn.weight": w}
    wq = init["model.layers.0.self_attn.q_proj.weight"].clone()
    q = wq.view(4, 8, 32)
    for h, fs in factors.items():
        for f in fs:
            q[h] *= torch.tensor(f, dtype=torch.float32)
    return {"model.layers.0.self_attn.q_proj.weight": wq}


@pytest.mark.parametrize("case", _cases("tau2-nanogpt", "tau1-nanogpt", "tau2-llama", "tau1-llama"))
def test_a_clipped_heads_largest_logit_comes_back_to_tau(out, case):
    """lr 0 (only the clip changes weights), one layer, the same batch every step: after step 1's clip the
    clipped heads' largest logit of step 2 (over both ranks) is tau; each rank's own logit is scaled by the
    factor; the other heads, and every weight that is not a clipped head's query (MHA: and key) row, are
    bitwise unchanged. Sharded: the heads' rows lie in different ranks' shards."""
    name = case.split("-")[1]
    r0, r1 = _ranks(out, case)
    _ranks_agree(r0, r1)
    tau = r0["tau"]
    m = _metrics(r0)
    assert sorted(m) == [1, 2, 3]
    s1, s2, s3 = m[1][0], m[2][0], m[3][0]
    first = {c[2]: c[3] for c in r0["clips"] if c[0] == 1}
    assert set(first) == {h for h in range(4) if s1[h] > tau} and 2 <= len(first) < 4
    assert min(s1[h] for h in first) > 1.3 * tau  # clipped by far: not a rounding matter
    for h in range(4):
        if h in first:
            assert math.isclose(s2[h], tau, rel_tol=1e-4), (h, s2[h])
            assert s3[h] <= tau * (1 + 1e-4)
        else:
            assert s2[h] == s1[h] == s3[h]  # untouched: the same logit, bit for bit
    later = [c for c in r0["clips"] if c[0] > 1]
    assert all(c[2] in first and c[3] > 1 - 1e-4 for c in later), later  # at most rounding-level reclips
    for run in (r0, r1):  # each rank's own largest logit: scaled by the factor (or untouched)
        (st1, a1), (st2, a2) = run["local_max"][:2]
        assert (st1, st2) == (1, 2)
        for h in range(4):
            if h in first:
                assert math.isclose(a2[h], a1[h] * first[h], rel_tol=1e-5), (h, a1[h], a2[h], first[h])
            else:
                assert a2[h] == a1[h]
    assert r0["hashes"][0] != r0["initial_hash"]  # lr 0: the clip alone changed the weights
    w = torch.load(out / f"{case}_dist_weights.pt")
    factors = {}
    for c in r0["clips"]:
        factors.setdefault(c[2], []).append(c[3])
    expected = _scaled_rows(name, w["initial"], factors)
    for pname, ref in w["initial"].items():
        got = w["final"][pname]
        if pname in expected:
            torch.testing.assert_close(got, expected[pname], rtol=1e-6, atol=0)
            assert not torch.equal(got, ref)
        else:  # the keys of GQA, the value rows, every other weight
            assert torch.equal(got, ref), pname
    if name == "nanogpt":  # the damped head's query and key rows and the value rows: bitwise unchanged
        g, i = w["final"]["h.0.attn.c_attn.weight"], w["initial"]["h.0.attn.c_attn.weight"]
        assert torch.equal(g[:32].view(4, 8, 32)[1], i[:32].view(4, 8, 32)[1])
        assert torch.equal(g[32:64].view(4, 8, 32)[1], i[32:64].view(4, 8, 32)[1])
        assert torch.equal(g[64:], i[64:])
    else:
        key = "model.layers.0.self_attn.k_proj.weight"
        assert torch.equal(w["final"][key], w["initial"][key])
