"""The engine end to end: near-tie drift -> alert -> switch -> drift flattens; resume; fail-open."""
import json
import logging

import numpy as np
import pytest
import torch

from instability_watch import InstabilityWatch, WatchConfig, WatchError
from instability_watch.model.layer import AttentionLayer

from helpers import REPO, run_process
from nanogpt import GPT, GPTConfig
from watch_models import TiedAttention, train_tied

E2E = dict(probe_every=1, log_every=5, shadow_every=1, spectral_every=5, warmup_steps=5, sustain=3)


def _collect(watch):
    """Every read-back's metrics, in order (a listener)."""
    metrics = []
    watch.listeners.append(lambda r: metrics.extend(r.metrics))
    return metrics


def _train_tied(model, watch, steps, start=0, opt=None):
    opt = opt or torch.optim.SGD(model.parameters(), lr=1e-3)
    metrics = _collect(watch)
    train_tied(model, watch, start, start + steps, opt)
    return metrics, opt


def test_end_to_end_near_ties_alert_switch_and_drift_flattens():
    torch.manual_seed(0)
    model = TiedAttention()  # heads 0, 1: four near-tied maxima per row; heads 2, 3: one maximum
    watch = InstabilityWatch(model, WatchConfig(auto_switch=True, **E2E), layers=model.layers())
    metrics, _ = _train_tied(model, watch, 80)
    assert [m.step for m in metrics] == list(range(1, 81))

    freq = np.array([m["multi_max_freq"][0] for m in metrics])
    drift = np.array([m["delta_err_sum"][0] for m in metrics])
    # the affected heads: nearly every row has a repeated maximum; the others none. How many rows stay tied at
    # a given step depends on the trajectory, which depends on the CPU's BF16 matmuls (native AVX-512 BF16 or
    # emulated): with native BF16 one step of 80 had 63% of head 1's rows tied, every other step all of them
    assert (freq[:, :2] > 0.9).mean() > 0.95 and (freq[:, :2] > 0.5).all() and (freq[:, 2:] < 0.05).all()

    # one-signed drift trips an alert on each affected head, which is switched
    drift_alerts = [a for a in watch.alerts if a.kind == "delta_drift"]
    assert sorted(a.head for a in drift_alerts) == [0, 1]
    assert all(a.action == "switched to the stabilized kernel" for a in drift_alerts)
    assert set(watch.switched) == {(0, 0), (0, 1)}
    assert [(e.kind, e.head, e.reason) for e in watch.events] == [("switch", 0, "delta_drift"), ("switch", 1, "delta_drift")]
    # a switch is decided at the read-back that finds its alert: the event's step is that read-back's (a multiple of
    # log_every), its alert_step the alert's own; the head runs switched from the next step, not before
    alert_at = {a.head: a.step for a in drift_alerts}
    for e in watch.events:
        assert e.alert_step == alert_at[e.head] and e.step % 5 == 0 and 0 <= e.step - e.alert_step < 5
        assert watch.switched[(0, e.head)] == e.step
        assert f"from the next step (delta_drift alert at step {e.alert_step})" in e.sentence()
    switch_step = max(watch.switched.values())
    assert switch_step <= 30
    before = drift[:switch_step, :2]
    assert (before > 0).mean() > 0.9  # one-signed before

    # after the switch (it takes effect at the read-back step) the drift flattens
    after = drift[switch_step + watch.config.log_every:, :2]
    rate_before = np.abs(before.sum(axis=0)) / len(before)
    rate_after = np.abs(after.sum(axis=0)) / len(after)
    assert (rate_after < 0.1 * rate_before).all()
    cum = np.array([m["delta_cum"][0] for m in metrics])
    assert (np.abs(cum[-1, :2] - cum[switch_step + 5, :2]) < 0.1 * np.abs(cum[switch_step, :2])).all()
    stab = np.array([m["stabilized"][0] for m in metrics])
    assert (stab[-1] == [1, 1, 0, 0]).all() and (stab[0] == 0).all()
    for e in watch.events:  # the metrics' column: 0 through the deciding read-back's step, 1 from the next step
        assert (stab[:e.step, e.head] == 0).all() and (stab[e.step:, e.head] == 1).all()
    assert watch.observation.stabilized() == [[True, True, False, False]]
    # measured from PyTorch's own SDPA until the switch, from our stabilized kernel after it
    (cov,) = watch.coverage()
    assert cov.observed_calls == cov.shadow_calls == 80 and cov.unobserved_calls == {}
    assert cov.kernel_calls == 80 - min(watch.switched.values())  # our kernels from the step after the switch


def test_switch_to_exact_delta_puts_the_layer_on_the_exact_delta(caplog):
    """``switch_to="exact_delta"``: an alerted head's layer runs our standard kernel with the backward's delta from
    a float32 O (the paper's control): no head stabilized, the alert says so, the gradients are those of
    ``flash_attention(..., high_precision_delta=True)`` (not of the ordinary delta), and a resumed watch keeps it."""
    from instability_watch import flash_attention
    from instability_watch.experimental import high_precision_delta_calls
    from watch_models import tied_batch, tied_loss

    cfg = WatchConfig(auto_switch=True, switch_to="exact_delta", **E2E)
    torch.manual_seed(0)
    model = TiedAttention()
    watch = InstabilityWatch(model, cfg, layers=model.layers())
    _train_tied(model, watch, 40)
    assert set(watch.switched) == {(0, 0), (0, 1)}
    drift_alerts = [a for a in watch.alerts if a.kind == "delta_drift"]
    assert drift_alerts and all(a.action == "switched to the exact delta" for a in drift_alerts)
    switches = [e for e in watch.events if e.kind == "switch"]  # the run directory's event sentences say so too
    assert switches and all("moved to our kernel with the exact delta" in e.sentence() for e in switches)
    (site,) = watch.observation.sites
    assert site.routed and site.high_precision_delta
    assert watch.observation.stabilized() == [[False] * 4]

    def grads(fn):
        model.zero_grad()
        tied_loss(fn(*tied_batch(99))).backward()
        return model.wq.grad.clone()

    def ours(hp):
        def fn(q_in, k_in, v_in):
            q, k, v = (torch.einsum("bhnd,hed->bhne", x, w).to(torch.bfloat16)
                       for x, w in ((q_in, model.wq), (k_in, model.wk), (v_in, model.wv)))
            return flash_attention(q, k, v, high_precision_delta=hp)
        return fn

    calls = high_precision_delta_calls()
    watched = grads(model)
    assert high_precision_delta_calls() == calls + 1
    exact, ordinary = grads(ours(True)), grads(ours(False))
    assert torch.equal(watched, exact)
    assert not torch.equal(exact, ordinary)  # the near-tied heads' delta is biased: the switch changed the gradient
    model.zero_grad()

    state = json.loads(json.dumps(watch.state_dict()))
    resumed_model = TiedAttention()
    resumed = InstabilityWatch(resumed_model, cfg, layers=resumed_model.layers())
    resumed.load_state_dict(state)
    (site,) = resumed.observation.sites
    assert site.high_precision_delta and resumed.observation.stabilized() == [[False] * 4]
    # the state's format is unchanged (events without their target), which comes back from its switch_to
    assert all("to" not in e for e in state["events"])
    assert all(e.to == "exact_delta" for e in resumed.events if e.kind == "switch") and resumed.events
    # restored into a watch that switches the other way: its switches run that way, and it says so once
    other_model = TiedAttention()
    other = InstabilityWatch(other_model, WatchConfig(auto_switch=True, **E2E), layers=other_model.layers())
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        other.load_state_dict(state)
    assert other.observation.stabilized() == [[True, True, False, False]]
    assert [r.getMessage() for r in caplog.records if "were switched to exact_delta" in r.getMessage()] == [
        "instability_watch: the state's 2 switched heads were switched to exact_delta; this watch's "
        "WatchConfig.switch_to is 'stabilized', so from now on they run that way"]
    with pytest.raises(ValueError, match="switch_to must be 'stabilized' or 'exact_delta', got 'exact'"):
        WatchConfig(switch_to="exact")


def test_without_auto_switch_only_reports():
    torch.manual_seed(0)
    model = TiedAttention()
    watch = InstabilityWatch(model, WatchConfig(auto_switch=False, **E2E), layers=model.layers())
    metrics, _ = _train_tied(model, watch, 40)
    assert {a.head for a in watch.alerts if a.kind == "delta_drift"} == {0, 1}
    assert all(a.action == "reported" for a in watch.alerts)
    assert watch.switched == {} and watch.events == []
    drift = np.array([m["delta_err_sum"][0] for m in metrics])
    assert (drift[:, :2] > 0).mean() > 0.9


def test_state_dict_round_trip_resumes_identically():
    cfg = WatchConfig(auto_switch=True, **E2E)

    torch.manual_seed(0)
    ref = TiedAttention()
    ref_watch = InstabilityWatch(ref, cfg, layers=ref.layers())
    _train_tied(ref, ref_watch, 40)

    torch.manual_seed(0)
    first = TiedAttention()
    first_watch = InstabilityWatch(first, cfg, layers=first.layers())
    _, opt = _train_tied(first, first_watch, 17)  # 17: two steps not yet read back
    state = json.loads(json.dumps(first_watch.state_dict()))  # plain types only
    assert state["pending_steps"] == [16, 17]
    model_state = {k: v.clone() for k, v in first.state_dict().items()}
    opt_state = opt.state_dict()

    resumed = TiedAttention()
    resumed.load_state_dict(model_state)
    watch = InstabilityWatch(resumed, cfg, layers=resumed.layers())
    watch.load_state_dict(state)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=1e-3)
    opt2.load_state_dict(opt_state)
    _train_tied(resumed, watch, 23, start=17, opt=opt2)

    a, b = ref_watch.state_dict(), watch.state_dict()
    assert a["step"] == b["step"] == 40
    assert a["switched"] == b["switched"] and len(a["switched"]) == 2
    assert a["delta_cum"] == b["delta_cum"]
    assert a["detectors"] == b["detectors"]
    assert a["alerts"] == b["alerts"] and a["events"] == b["events"]
    assert watch.observation.stabilized() == ref_watch.observation.stabilized()

    with pytest.raises(ValueError, match="state was saved for layers"):
        other = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8))
        InstabilityWatch(other).load_state_dict(state)
    with pytest.raises(ValueError, match="not an InstabilityWatch state"):
        watch.load_state_dict({"step": 3})


def test_gradient_accumulation_counts_optimizer_steps():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=2, shadow_every=1, spectral_every=0))
    metrics = _collect(watch)
    x = torch.randint(0, 256, (3, 16))
    for _ in range(2):
        for _ in range(4):  # micro-batches
            model(x, x)[1].backward()
        watch.step()
    assert watch.step_count == 2
    assert [m.step for m in metrics] == [1, 2]
    for m in metrics:
        assert (m["rows"] == 4 * 3 * 16).all() and (m["shadow_rows"] == 4 * 3 * 16).all()


def test_cadence_of_shadow_and_spectral_steps():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    watch = InstabilityWatch(model, WatchConfig(probe_every=2, log_every=12, shadow_every=4, spectral_every=3))
    metrics = _collect(watch)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(12):
        model(x, x)[1].backward()
        watch.step()
    # probe steps 1, 3, 5, ...; shadow steps 1, 5, 9; spectral steps 1, 4, 7, 10 (recorded without statistics)
    assert [m.step for m in metrics] == [1, 3, 4, 5, 7, 9, 10, 11]
    rows = [int(np.nan_to_num(m["rows"][0, 0])) for m in metrics]
    shadow = [int(np.nan_to_num(m["shadow_rows"][0, 0])) for m in metrics]
    sigma = [bool(np.isfinite(m["sigma_wq"][0, 0])) for m in metrics]
    assert rows == [32, 32, 0, 32, 32, 32, 0, 32]
    assert shadow == [32, 0, 0, 32, 0, 32, 0, 0]
    assert sigma == [True, False, True, False, True, False, True, False]


def test_listeners_receive_metrics_and_a_failing_listener_is_dropped(caplog):
    torch.manual_seed(0)
    model = TiedAttention()
    seen = []

    def good(record):
        seen.append((len(record.metrics), len(record.alerts)))

    def bad(record):
        raise RuntimeError("disk full")

    watch = InstabilityWatch(model, WatchConfig(**E2E), layers=model.layers(), listeners=[bad, good])
    with caplog.at_level(logging.ERROR, logger="instability_watch"):
        _train_tied(model, watch, 20)
    assert len(seen) == 5 and sum(n for n, _ in seen) == 20  # read back at 1 (coverage), 5, 10, 15, 20
    assert watch.listeners[0] is good and bad not in watch.listeners
    errors = [r for r in caplog.records if "failed and is turned off" in r.getMessage()]
    assert len(errors) == 1 and "disk full" in errors[0].getMessage() and errors[0].exc_info


def test_a_listener_with_the_old_three_argument_signature_is_told_what_changed():
    torch.manual_seed(0)
    model = TiedAttention()
    seen = []

    def old(metrics, alerts, watch):  # listeners before 2026-11-27
        seen.append(len(metrics))

    watch = InstabilityWatch(model, WatchConfig(**E2E), layers=model.layers(), listeners=[old])
    _train_tied(model, watch, 5)
    assert seen == [] and old not in watch.listeners
    why = watch.disabled["listener old"]
    assert why.startswith("TypeError: a listener takes one argument, a ReadBack") and "(metrics, alerts, watch)" in why


def test_a_writer_opened_by_its_first_read_back_reports_failures_through_the_watch(tmp_path, monkeypatch):
    """A RunWriter passed as a bare listener opens at the first read-back; a meta.json it cannot update later is
    reported by the watch (the part turned off, training and the CSV files go on), not raised."""
    from instability_watch.outputs.rundir import RunWriter, load_run
    from instability_watch.outputs.rundir import writer as writer_module

    torch.manual_seed(0)
    model = TiedAttention()
    writer = RunWriter(tmp_path / "run")
    watch = InstabilityWatch(model, WatchConfig(**E2E), layers=model.layers(), listeners=[writer])
    _train_tied(model, watch, 1)  # the first read-back opens the directory
    assert writer.is_open

    def no_room(path, obj):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_module, "_write_json", no_room)
    _train_tied(model, watch, 9, start=1)
    watch.detach()
    writer.close()
    assert "run directory meta.json" in watch.disabled and writer in watch.listeners
    assert sorted(load_run(tmp_path / "run").metrics["step"].unique()) == list(range(1, 11))


# ---------------------------------------------------------------- fail-open / strict


def _nano():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))


def _steps(model, watch, n=4):
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(n):
        loss = model(x, x)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        watch.step(loss)
        losses.append(loss.item())
    return losses


def test_raising_locator_does_not_stop_training(caplog):
    def locator(model):
        raise KeyError("no such module")

    model = _nano()
    with caplog.at_level(logging.ERROR, logger="instability_watch"):
        watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=2), layers=locator)
        losses = _steps(model, watch)
    assert not watch.active and "attach" in watch.disabled
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert sum("attach failed" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(KeyError):
        InstabilityWatch(_nano(), WatchConfig(strict=True), layers=locator)


def test_raising_w_q_turns_off_spectral_only():
    model = _nano()
    layers = [AttentionLayer(b.attn, 2, lambda: (_ for _ in ()).throw(RuntimeError("sharded"))) for b in model.h]
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=2, spectral_every=1), layers=layers)
    _steps(model, watch, 4)
    assert set(watch.disabled) == {"spectral"}
    assert watch.step_count == 4
    assert all((m["rows"] == 32).all() and np.isnan(m["sigma_wq"]).all() for m in watch.last_metrics)

    model = _nano()
    layers = [AttentionLayer(b.attn, 2, lambda: (_ for _ in ()).throw(RuntimeError("sharded"))) for b in model.h]
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=2, spectral_every=1, strict=True), layers=layers)
    with pytest.raises(RuntimeError, match="sharded"):
        _steps(model, watch, 1)


def _nan_into_delta(watch):
    """A forward hook that writes NaN into the first layer's shadow delta sum (a broken metric)."""
    probe_values = lambda: watch.observation.bank.probes[0].values  # noqa: E731

    def hook(module, args, out):
        probe_values()[1].fill_(float("nan"))

    return watch.observation.sites[0].layer.module.register_forward_hook(hook)


def test_nan_metric_is_reported_not_fatal(caplog):
    model = _nano()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=2, shadow_every=1))
    _nan_into_delta(watch)
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        losses = _steps(model, watch, 4)
    assert all(np.isfinite(losses)) and watch.step_count == 4
    assert sum("non-finite delta_err_sum" in r.getMessage() for r in caplog.records) == 1
    m = watch.last_metrics[-1]
    assert np.isnan(m["delta_err_sum"][0]).all() and np.isfinite(m["delta_err_sum"][1]).all()
    # layer 0's sums were never measured (each one broken): its running sum stays empty, layer 1's is kept
    assert np.isnan(m["delta_cum"][0]).all() and np.isfinite(m["delta_cum"][1]).all()

    model = _nano()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=2, shadow_every=1, strict=True))
    _nan_into_delta(watch)
    with pytest.raises(WatchError, match="non-finite delta_err_sum"):
        _steps(model, watch, 2)


def test_kernel_failure_falls_back_to_pytorch_sdpa(monkeypatch, caplog):
    import instability_watch.observe.sdpa as observe_mod

    def broken(*args, **kwargs):
        raise RuntimeError("kernel launch failed")

    model = _nano()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = model(x, x)[1]
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1))
    watch.switch(0, 1)
    monkeypatch.setattr(observe_mod, "flash_attention", broken)
    with caplog.at_level(logging.ERROR, logger="instability_watch"):
        out = model(x, x)[1]
        out.backward()
        watch.step(out)
    assert torch.equal(out, ref)  # PyTorch's SDPA served the call
    assert "routing" in watch.disabled and not watch.observation.routing
    assert "statistics" not in watch.disabled and watch.coverage()[0].observed_calls == 1  # still observed
    assert [e.kind for e in watch.events] == ["switch", "switch_not_applied"]
    assert "kernel failed" in watch.events[1].reason
    assert sum("routing failed" in r.getMessage() for r in caplog.records) == 1
    watch.detach()

    model = _nano()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1, strict=True))
    watch.switch(0, 0)
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        model(x, x)
    watch.detach()


def test_statistics_failure_leaves_the_users_output(monkeypatch, caplog):
    import instability_watch.observe.sdpa as observe_mod

    def broken(*args, **kwargs):
        raise RuntimeError("stats kernel failed")

    model = _nano()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = model(x, x)[1]
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1))
    monkeypatch.setattr(observe_mod, "attention_stats", broken)
    with caplog.at_level(logging.ERROR, logger="instability_watch"):
        with torch.no_grad():
            out = model(x, x)[1]
        watch.step()
    assert torch.equal(out, ref)
    assert set(watch.disabled) == {"statistics"}
    assert all("forward" not in b.attn.__dict__ for b in model.h)  # nothing armed any more
    watch.detach()


def test_engine_argument_errors():
    with pytest.raises(TypeError, match="config must be an instability_watch.WatchConfig, a dict of its fields or "
                                        "None, got list"):
        InstabilityWatch(_nano(), config=[("log_every", 1)])
    watch = InstabilityWatch(_nano(), config={"log_every": 1, "probe_every": 1})  # a dict, as the callbacks take it
    assert watch.config == WatchConfig(log_every=1, probe_every=1)
    watch.detach()
    with pytest.raises(TypeError, match="did you mean 'probe_every'"):
        InstabilityWatch(_nano(), config={"probe_evry": 1})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        InstabilityWatch("model")
    watch = InstabilityWatch(_nano())
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\), got 5"):
        watch.switch(5, 0)
    with pytest.raises(ValueError, match=r"head must be in \[0, 2\)"):
        watch.switch(0, 7)


# ---------------------------------------------------------------- review findings


def test_deepcopy_and_pickle_of_a_watched_model():
    import copy
    import io

    model = _nano()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.randint(0, 256, (2, 16))
    twin(x, x)[1].backward()  # the copy runs its own forward on its own weights, unobserved
    model(x, x)[1].backward()
    watch.step()
    assert [c.observed_calls for c in watch.coverage()] == [1, 1]
    buf = io.BytesIO()
    torch.save(model, buf)  # picklable while attached, and loads back as a model that runs unwatched
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded(x, x)[1].backward()
    assert [c.observed_calls for c in watch.coverage()] == [1, 1]
    assert all(getattr(m, "_instability_watch_observer", None) is None for m in loaded.modules())
    with pytest.raises(ValueError, match="already watched"):
        InstabilityWatch(model, WatchConfig(strict=True))
    watch.detach()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_backward_failure_falls_back_to_pytorch(monkeypatch, caplog):
    import torch.nn.functional as F

    import instability_watch.kernels.attention.ops as ops

    def broken(*args, **kwargs):
        raise RuntimeError("backward kernel failed")

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 16, requires_grad=True) for _ in range(3))

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = Attn()
    watch = InstabilityWatch(model, WatchConfig(), layers=[AttentionLayer(model, 2, lambda: torch.zeros(2, 4, 4))])
    watch.switch(0, 0)  # the layer runs on our kernels
    monkeypatch.setattr(ops, "_backward", broken)
    with caplog.at_level(logging.ERROR, logger="instability_watch"):
        model(q, k, v).sum().backward()
    ref = [torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), t)[0] for t in (q, k, v)]
    for t, r in zip((q, k, v), ref):
        torch.testing.assert_close(t.grad, r)
    assert "routing" in watch.disabled
    watch.detach()
    strict = InstabilityWatch(model, WatchConfig(strict=True), layers=[AttentionLayer(model, 2, lambda: torch.zeros(2, 4, 4))])
    strict.switch(0, 0)
    with pytest.raises(RuntimeError, match="backward kernel failed"):
        model(q, k, v).sum().backward()
    strict.detach()


def test_detach_reads_back_pending_steps():
    torch.manual_seed(0)
    model = TiedAttention()
    seen = []
    watch = InstabilityWatch(model, WatchConfig(**E2E), layers=model.layers(),
                             listeners=[lambda r: seen.extend(x.step for x in r.metrics)])
    _train_tied(model, watch, 7)
    watch.detach()
    assert seen == list(range(1, 8))


def test_nonfinite_weights_alert():
    model = _nano()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=2, spectral_every=1))
    with torch.no_grad():
        model.h[1].attn.c_attn.weight[3, 0] = float("inf")
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        with torch.no_grad():
            model(x, x)
        watch.step()
    kinds = {(a.layer, a.kind) for a in watch.alerts}
    assert (1, "nonfinite") in kinds


def test_statistics_failure_keeps_switched_heads_stabilized(monkeypatch):
    import instability_watch.observe.sdpa as observe_mod

    model = _nano()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1))
    watch.switch(0, 1)
    monkeypatch.setattr(watch.ring, "next_row", lambda device: (_ for _ in ()).throw(RuntimeError("boom")))
    _steps(model, watch, 2)
    assert set(watch.disabled) == {"statistics"} and watch.observation.routing
    calls = []
    real = observe_mod.flash_attention
    monkeypatch.setattr(observe_mod, "flash_attention", lambda *a, **kw: calls.append(kw["stabilize"].tolist()) or real(*a, **kw))
    _steps(model, watch, 1)
    assert calls == [[False, True]]  # still on our (stabilized) kernel
    assert "forward" not in model.h[1].attn.__dict__  # the unswitched layer is left alone


def test_load_state_after_failed_attach_is_a_no_op():
    watch = InstabilityWatch(_nano(), layers=lambda m: 1 / 0)
    watch.load_state_dict({"version": 1})
    assert watch.step() == []


def test_ddp_two_ranks_decide_the_same_and_a_failing_rank_does_not_hang(tmp_path):
    import os
    import socket
    import sys

    script = str(REPO / "tests" / "scripts" / "ddp_watch.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # both cases in one launch, the failing one last
    proc = run_process([sys.executable, script, str(tmp_path), str(port), "ok", "fail:1:12"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case in ("ok", "fail"):
        r0, r1 = (json.loads((tmp_path / case / f"rank{r}.json").read_text()) for r in (0, 1))
        assert r0["steps"] == r1["steps"] == 40
        if case == "ok":
            assert r0["switched"] == r1["switched"] and len(r0["switched"]) == 2
            assert r0["alerts"] == r1["alerts"] and r0["last_loss"] == r1["last_loss"]
            assert r0["disabled"] == r1["disabled"] == []
        else:  # rank 1 failed at step 12: both turn statistics off at the step-15 read-back, nobody hangs
            assert r0["disabled"] == r1["disabled"] == ["statistics"]


def test_a_head_no_shadow_pass_measured_has_no_running_drift_sum_not_a_sum_of_zero():
    """Calls with dropout get no shadow pass: their heads' ``delta_cum`` is empty (it was 0.0, which read as "no
    drift"); the state keeps it as None (plain, JSON-safe) and a resumed watch still reads the head as unmeasured,
    while a measured sum of exactly 0 stays 0."""
    torch.manual_seed(0)
    dropped = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1))
    cfg = WatchConfig(probe_every=1, shadow_every=1, log_every=2)
    watch = InstabilityWatch(dropped, cfg)
    _steps(dropped, watch, 4)
    assert all(np.isnan(m["delta_cum"]).all() for m in watch.last_metrics)
    state = watch.state_dict()
    assert state["delta_cum"] == [[None, None], [None, None]]
    json.dumps(state, allow_nan=False)  # plain, finite
    watch.detach()
    again = InstabilityWatch(dropped, cfg)
    again.load_state_dict(state)
    assert np.isnan(again.builder.delta_cum).all()
    again.detach()

    model = _nano()  # no dropout; output projections zeroed: dO = 0, so each measured drift is exactly 0
    for module in model.modules():
        if type(module).__name__ == "CausalSelfAttention":
            torch.nn.init.zeros_(module.c_proj.weight)
    measured = InstabilityWatch(model, cfg)
    _steps(model, measured, 1)  # (read back at once: the first probe step; later steps have c_proj trained)
    assert (measured.last_metrics[-1]["delta_cum"] == 0.0).all()
    state = measured.state_dict()
    assert state["delta_cum"] == [[0.0, 0.0], [0.0, 0.0]]
    measured.detach()
    resumed = InstabilityWatch(_nano(), cfg)
    resumed.load_state_dict(state)
    assert (resumed.builder.delta_cum == 0.0).all()
    resumed.detach()
