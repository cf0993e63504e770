"""QK-clip (WatchConfig(qk_clip=...)): the clip's numerics, its rule for shared keys, events, state and resume.

Layouts of the model families: test_qk_clip_layouts.py; two ranks (DDP, FSDP): test_qk_clip_dist.py.
"""
from __future__ import annotations

import io
import json
import logging
import os

import numpy as np
import pandas as pd
import pytest
import torch
from rich.console import Console

from instability_watch import InstabilityWatch, WatchConfig
from instability_watch.outputs.console import ConsoleReporter
from instability_watch.outputs.rundir import RunWriter, load_run

from helpers import REPO
from nanogpt import GPT, GPTConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
E, H = 64, 4


def driven_gpt(device: str, layers: int = 1, boost: float = 6.0, seed: int = 0) -> GPT:
    """The package's GPT with its query and key rows scaled up: large logits from the first step."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=97, block_size=64, n_layer=layers, n_head=H, n_embd=E))
    with torch.no_grad():
        for block in model.h:
            w = block.attn.c_attn.weight
            w[: 2 * E].mul_(boost)
            w[:E].view(H, E // H, E)[1].mul_(0.2)  # head 1 stays small: below tau, never clipped
    return model.to(device).train()


def batch(device: str, seed: int = 1, n: int = 48) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (2, n), generator=g).to(device)


def probe_step(model, watch, x, device: str, opt=None) -> None:
    """One training step, the watch's step closing it (with bf16 autocast on a GPU, as users train)."""
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        _, loss = model(x, x)
    loss.backward()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)
    watch.step(loss.detach())


def config(**kw) -> WatchConfig:
    base = dict(probe_every=1, shadow_every=0, spectral_every=0, log_every=1, warmup_steps=0)
    base.update(kw)
    return WatchConfig(**base)


@pytest.mark.parametrize("device", DEVICES)
def test_clip_leaves_each_affected_head_at_tau_and_other_heads_bitwise_untouched(device):
    model = driven_gpt(device)
    x = batch(device)
    watch = InstabilityWatch(model, config(qk_clip="always", qk_clip_tau=1e9))
    probe_step(model, watch, x, device)  # no clip: measure
    first = watch.last_metrics[-1]["max_score"][0].copy()
    assert first[1] < first.max() / 3
    tau = float(first[1] + np.delete(first, 1).min()) / 2  # between head 1 (small) and the others
    watch.detach()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    watch = InstabilityWatch(model, config(qk_clip="always", qk_clip_tau=tau))
    probe_step(model, watch, x, device)  # no optimizer: only the clip changes weights
    s = watch.last_metrics[-1]["max_score"][0]
    np.testing.assert_array_equal(s, first)  # measured before the clip, on the same weights
    over = s > tau
    assert over.sum() == H - 1 and not over[1]
    clips = {(c.layer, c.head): c for c in watch.last_clips}
    assert set(clips) == {(0, h) for h in range(H) if over[h]}
    for (_, h), c in clips.items():
        assert c.max_logit == pytest.approx(s[h], rel=1e-6) and c.factor == pytest.approx(tau / s[h], rel=1e-6)
    probe_step(model, watch, x, device)
    after = watch.last_metrics[-1]["max_score"][0]
    # bf16 q and k on the GPU: each rounds to 2^-8 relative
    np.testing.assert_allclose(after[over], tau, rtol=1e-5 if device == "cpu" else 2e-2)
    assert after[1] == s[1]  # head 1's weights are untouched, so is its logit (same input)
    w, w0 = model.h[0].attn.c_attn.weight, before["h.0.attn.c_attn.weight"]
    q, k = (t[: 2 * E].view(2, H, E // H, E) for t in (w, w0))
    assert torch.equal(q[:, 1], k[:, 1])  # W_q and W_k of head 1 bitwise unchanged
    assert not torch.equal(q[0, 0], k[0, 0]) and not torch.equal(q[1, 0], k[1, 0])  # head 0: both scaled
    torch.testing.assert_close(q[:, 0], k[:, 0] * (tau / s[0]) ** 0.5, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        if name != "h.0.attn.c_attn.weight":
            assert torch.equal(p, before[name]), name
    assert torch.equal(w[2 * E:], w0[2 * E:])  # the value rows
    watch.detach()


def llama_gqa(device: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(device).train()
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight.mul_(8.0)
        attn.k_proj.weight.mul_(8.0)
        attn.q_proj.weight.view(4, 16, 64)[0].mul_(0.1)  # query head 0 (sharing key head 0 with head 1) stays low
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_shared_keys_are_never_scaled_the_query_head_takes_the_whole_factor(device):
    model = llama_gqa(device)
    attn = model.model.layers[0].self_attn
    x = batch(device, n=32)

    def step(watch):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        watch.step(loss.detach())

    probe = InstabilityWatch(model, config())
    step(probe)
    s = probe.last_metrics[-1]["max_score"][0].copy()
    probe.detach()
    tau = float(s[0]) * 1.5
    assert (s[1:] > tau).all() and s[0] < tau
    q0, k0 = attn.q_proj.weight.detach().clone(), attn.k_proj.weight.detach().clone()
    watch = InstabilityWatch(model, config(qk_clip="always", qk_clip_tau=tau))
    step(watch)
    assert {(c.layer, c.head) for c in watch.last_clips} == {(0, 1), (0, 2), (0, 3)}
    assert torch.equal(attn.k_proj.weight, k0)  # the keys: untouched
    q, qb = attn.q_proj.weight.view(4, 16, 64), q0.view(4, 16, 64)
    assert torch.equal(q[0], qb[0])  # head 0 shares key head 0 with head 1: its logits stay as they were
    for h in (1, 2, 3):
        torch.testing.assert_close(q[h], qb[h] * (tau / s[h]), rtol=1e-6, atol=0)
    step(watch)
    after = watch.last_metrics[-1]["max_score"][0]
    np.testing.assert_allclose(after[1:], tau, rtol=1e-5 if device == "cpu" else 2e-2)
    assert after[0] == s[0]
    watch.detach()


def test_on_alert_clips_only_heads_that_raised_logit_growth_from_the_next_probe_step():
    model = driven_gpt("cpu", layers=2)
    x = batch("cpu")
    # logit_growth against a baseline of the first 2 steps, logit_min 0: the boosted heads trip it once their
    # logits double; tau below every head, so a clip shows exactly where on_alert lets it act
    cfg = config(qk_clip="on_alert", qk_clip_tau=0.5, warmup_steps=2, sustain=1, logit_factor=1.5, logit_min=0.0,
                 detectors=("logit_growth",))
    watch = InstabilityWatch(model, cfg)
    probe_step(model, watch, x, "cpu")
    probe_step(model, watch, x, "cpu")
    assert watch.last_clips == [] and watch.clip_enabled == {}
    with torch.no_grad():  # the first layer's head 2 grows (as a training run's would)
        model.h[0].attn.c_attn.weight[:E].view(H, E // H, E)[2].mul_(2.0)
    probe_step(model, watch, x, "cpu")  # step 3: the alert
    alerts = [(a.layer, a.head, a.kind) for a in watch.alerts]
    assert (0, 2, "logit_growth") in alerts
    assert watch.last_clips == []  # enabled from the next probe step on
    assert (0, 2) in watch.clip_enabled
    ev = [e for e in watch.events if e.kind == "qk_clip_on"]
    # decided at the read-back of step 3 (every probe step here), which found the alert of step 3
    assert [(e.step, e.alert_step, e.layer, e.head) for e in ev] == [
        (3, 3, l, h) for (l, h, k) in alerts if k == "logit_growth"]
    assert watch.alerts[0].action.startswith("QK-clip on")
    probe_step(model, watch, x, "cpu")
    assert {(c.layer, c.head) for c in watch.last_clips} == set(watch.clip_enabled)
    assert watch.clip_counts.sum() == len(watch.clip_enabled)
    watch.detach()


def run_clipped(steps, state=None, stop=None, run_dir=None):
    """Train the driven model with AdamW; resume from ``state`` = (model, opt, watch states, step)."""
    model = driven_gpt("cpu", layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = config(qk_clip="on_alert", qk_clip_tau=2.0, probe_every=2, log_every=4, warmup_steps=4, sustain=1,
                 logit_factor=1.2, logit_min=0.0, detectors=("logit_growth",))
    writer = RunWriter(run_dir, overwrite=state is None) if run_dir is not None else None
    watch = InstabilityWatch(model, cfg, listeners=[writer] if writer else [])
    start = 0
    if state is not None:
        m, o, w, start = state
        model.load_state_dict(m)
        opt.load_state_dict(o)
        watch.load_state_dict(w)
    if writer:
        writer.open(watch, resume_step=start if state is not None else None)
    for s in range(start + 1, (stop or steps) + 1):
        probe_step(model, watch, batch("cpu", seed=s), "cpu", opt)
    watch.flush()
    out = (model.state_dict(), opt.state_dict(), watch.state_dict(), watch.step_count)
    watch.detach()
    if writer:
        writer.close()
    return out


def test_clip_state_survives_state_dict_and_a_resume(tmp_path):
    full = run_clipped(24, run_dir=tmp_path / "a")
    assert full[2]["qk_clip"]["enabled"] and np.sum(full[2]["qk_clip"]["counts"]) > 0
    # stopped at a read-back step: an extra read-back would act on an alert earlier than the uninterrupted run
    half = run_clipped(24, stop=12, run_dir=tmp_path / "b")
    state = json.loads(json.dumps(half[2]))  # plain Python types
    assert state["qk_clip"] == half[2]["qk_clip"]
    resumed = run_clipped(24, state=(half[0], half[1], state, 12), run_dir=tmp_path / "b")
    assert json.dumps(resumed[2], sort_keys=True) == json.dumps(full[2], sort_keys=True)
    for name, p in full[0].items():
        assert torch.equal(p, resumed[0][name]), name
    ea, eb = (load_run(tmp_path / d).events for d in ("a", "b"))
    clip_a, clip_b = (e[e["event"] == "qk_clip"].reset_index(drop=True) for e in (ea, eb))
    assert len(clip_a) == int(np.sum(full[2]["qk_clip"]["counts"])) > 0
    pd.testing.assert_frame_equal(clip_a, clip_b)


def test_a_state_without_qk_clip_loads_and_a_bad_one_is_refused():
    model = driven_gpt("cpu")
    watch = InstabilityWatch(model, config(qk_clip="on_alert"))
    state = watch.state_dict()
    old = dict(state)
    del old["qk_clip"]  # saved before qk_clip existed
    watch.load_state_dict(old)
    assert watch.clip_enabled == {} and watch.clip_counts.sum() == 0
    bad = dict(state, qk_clip={"enabled": [[0, 7, 3]], "counts": []})
    with pytest.raises(ValueError, match="qk_clip.enabled.*head 7"):
        watch.load_state_dict(bad)
    watch.detach()


def test_events_csv_console_and_report_show_the_clips(tmp_path):
    model = driven_gpt("cpu", layers=2)
    out = io.StringIO()
    now = {"t": 0.0}
    reporter = ConsoleReporter(Console(file=out, width=200), clip_every_s=60, clock=lambda: now["t"])
    writer = RunWriter(tmp_path / "run")
    watch = InstabilityWatch(model, config(qk_clip="always", qk_clip_tau=0.05), listeners=[writer, reporter])
    writer.open(watch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    total = 0
    for s, t in zip(range(1, 6), (0.0, 10.0, 20.0, 100.0, 110.0)):
        now["t"] = t
        probe_step(model, watch, batch("cpu", seed=s), "cpu", opt)
        total += len(watch.last_clips)
        assert watch.last_clips, s  # tau 0.05: some head is over it at every step
    watch.detach()
    reporter.close()
    writer.close()
    lines = [ln for ln in out.getvalue().splitlines() if "QK-clip" in ln]
    # steps 1..5, one read-back each: the first at once, steps 2-3 held (< 60 s), step 4 after 100 s with
    # steps 2-4, step 5 held until close
    assert len(lines) == 3, out.getvalue()
    assert "step 1:" in lines[0] and "steps 2-4:" in lines[1] and "step 5:" in lines[2], lines
    assert sum(int(ln.split(": ")[2].split(" clips")[0]) for ln in lines) == total
    ev = load_run(tmp_path / "run").events
    clips = ev[ev["event"] == "qk_clip"]
    assert len(clips) == total == int(watch.clip_counts.sum()) > 0
    assert ((clips["value"] > 0) & (clips["value"] < 1)).all() and (clips["threshold"] == 0.05).all()
    from instability_watch.outputs import report

    summary = report.head_summary(load_run(tmp_path / "run"))
    by = summary.set_index(["layer", "head"])
    for (layer, head), n in clips.groupby(["layer", "head"]).size().items():
        assert by.loc[(layer, head), "qk_clips"] == n
        assert by.loc[(layer, head), "first_qk_clip"] == clips[(clips["layer"] == layer)
                                                               & (clips["head"] == head)]["step"].min()
    text = report.SummaryView(report.digest_run(tmp_path / "run")).header().plain
    assert f"QK-clip: {total} clips" in text


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="qk_clip must be None.*'on_alert'.*'always'.*got 'yes'"):
        WatchConfig(qk_clip="yes")
    with pytest.raises(ValueError, match="qk_clip_tau must be a finite number > 0"):
        WatchConfig(qk_clip="always", qk_clip_tau=0)
    with pytest.raises(ValueError, match="logit_growth.*not in detectors"):
        WatchConfig(qk_clip="on_alert", detectors=("multi_max",))
    WatchConfig(qk_clip="always", detectors=("multi_max",))  # always needs no alert


def test_a_failing_clip_is_reported_once_and_training_goes_on(caplog):
    model = driven_gpt("cpu")
    watch = InstabilityWatch(model, config(qk_clip="always", qk_clip_tau=1.0))

    def broken(gamma):
        raise RuntimeError("no luck")

    watch.clipper.projections[0].apply = broken
    x = batch("cpu")
    with caplog.at_level(logging.ERROR, logger="instability_watch"):
        for _ in range(3):
            probe_step(model, watch, x, "cpu")
    assert "qk_clip" in watch.disabled
    assert sum("qk_clip failed" in r.getMessage() for r in caplog.records) == 1
    assert watch.last_metrics[-1]["max_score"][0].max() > 1.0  # statistics go on
    watch.detach()
    strict = InstabilityWatch(model, config(qk_clip="always", qk_clip_tau=1.0, strict=True))
    strict.clipper.projections[0].apply = broken
    with pytest.raises(RuntimeError, match="no luck"):
        probe_step(model, strict, x, "cpu")
    strict.detach()


def test_user_described_layers_are_checked_when_the_watch_attaches():
    from instability_watch import AttentionLayer

    class MQA(torch.nn.Module):  # 8 query heads on one key head, separate projections
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = (torch.nn.Linear(64, n) for n in (64, 8, 8))

        def forward(self, x):
            B, T, _ = x.shape
            q = self.wq(x).view(B, T, 8, 8).transpose(1, 2)
            k, v = (p(x).view(B, T, 1, 8).transpose(1, 2) for p in (self.wk, self.wv))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    m = MQA()
    w_q = lambda: m.wq.weight.view(8, 8, 64)  # noqa: E731
    cfg = WatchConfig(qk_clip="always")
    flat_k = AttentionLayer(m, 8, w_q, w_k=lambda: m.wk.weight)  # (8, 64): forgot the view
    with pytest.raises(ValueError, match=r"w_k\(\) must return a \(kv_heads, 8, 64\) view.*got \(8, 64\)"):
        InstabilityWatch(m, cfg, layers=[flat_k])
    flat_b = AttentionLayer(m, 8, w_q, w_k=lambda: m.wk.weight.view(1, 8, 64), b_q=lambda: m.wq.bias)
    with pytest.raises(ValueError, match=r"b_q\(\) must return a \(8, 8\) view.*got \(64,\)"):
        InstabilityWatch(m, cfg, layers=[flat_b])
    ok = AttentionLayer(m, 8, w_q, w_k=lambda: m.wk.weight.view(1, 8, 64), b_q=lambda: m.wq.bias.view(8, 8),
                        b_k=lambda: m.wk.bias.view(1, 8))
    watch = InstabilityWatch(m, cfg, layers=[ok])
    assert watch.clipper.projections[0].grouped
    watch.detach()


def test_lightning_callback_clips_after_the_optimizer_step_under_bf16_mixed(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from instability_watch import InstabilityWatchCallback

    from lightning_models import TinyGPT

    torch.manual_seed(0)
    module = TinyGPT()
    with torch.no_grad():
        for block in module.model.h:
            block.attn.c_attn.weight[:64].mul_(8.0)  # large logits from the start
    cb = InstabilityWatchCallback({"qk_clip": "always", "qk_clip_tau": 1.0, "probe_every": 2, "log_every": 4,
                                   "shadow_every": 0, "spectral_every": 0, "warmup_steps": 2},
                                  run_dir=tmp_path / "run", alerts=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         max_steps=12, precision="bf16-mixed", callbacks=[cb])
    trainer.fit(module)
    ev = load_run(tmp_path / "run").events
    clips = ev[ev["event"] == "qk_clip"]
    assert len(clips) > 0 and set(clips["step"]) <= {1, 3, 5, 7, 9, 11}  # probe steps only
    m = load_run(tmp_path / "run").metrics
    # measured on the step after a clip, the clipped heads start from tau (bf16 q and k), then grow with training
    first = clips[clips["step"] == 1]
    nxt = m[m["step"] == 3].set_index(["layer", "head"])["max_score"]
    assert (first["value"] < 0.5).any()  # some head measured at more than twice tau on step 1
    for _, c in first.iterrows():
        assert nxt.loc[(c["layer"], c["head"])] < 1.0 * 1.5, (c["layer"], c["head"])
