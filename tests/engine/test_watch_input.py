"""Bad input to the watch and the kernels: a clear error, or a correct result (issue 21, items 4 and 6)."""
import logging

import numpy as np
import pytest
import torch

from instability_watch import InstabilityWatch, WatchConfig
from instability_watch.engine.cadence import Cadence
from instability_watch.kernels import flash_attention

from nanogpt import GPT, GPTConfig

EVERY = dict(probe_every=1, shadow_every=1, spectral_every=1, log_every=2, warmup_steps=0)


def _model(device=None):
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))


def _watched(strict=False, **config):
    model = _model()
    watch = InstabilityWatch(model, WatchConfig(**{**EVERY, **config}, strict=strict))
    metrics = []
    watch.listeners.append(lambda r: metrics.extend(r.metrics))
    return model, watch, metrics


def _forward(model):
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(x, x)[1]
    loss.backward()
    return loss


@pytest.mark.parametrize("bad, kind", [
    ("abc", TypeError),
    (torch.tensor([]), ValueError),
    (torch.tensor(1.0, device="meta"), ValueError),
    (torch.tensor(True), TypeError),
    ([1.0], TypeError),
])
def test_a_bad_loss_is_reported_once_and_statistics_go_on(bad, kind, caplog):
    model, watch, metrics = _watched()
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        for _ in range(2):
            _forward(model)
            watch.step(bad)
        loss = _forward(model)
        watch.step(loss)
        _forward(model)
        watch.step(2.5)
    assert watch.disabled == {}
    assert [m.step for m in metrics] == [1, 2, 3, 4]
    assert np.isnan(metrics[0].loss) and np.isnan(metrics[1].loss)
    assert metrics[2].loss == pytest.approx(loss.item()) and metrics[3].loss == 2.5
    assert all((m["rows"] > 0).all() for m in metrics)  # statistics were never turned off
    said = [r.getMessage() for r in caplog.records if "step(loss)" in r.getMessage()]
    assert len(said) == 1 and "left out" in said[0]


@pytest.mark.parametrize("bad, kind", [
    ("abc", TypeError),
    (torch.zeros(0), ValueError),
    (torch.tensor(1.0, device="meta"), ValueError),
])
def test_a_bad_loss_raises_at_the_call_with_strict(bad, kind):
    model, watch, _ = _watched(strict=True)
    _forward(model)
    with pytest.raises(kind, match="loss"):
        watch.step(bad)
    assert watch.step_count == 0  # nothing was counted


@pytest.mark.parametrize("strict", [False, True])
def test_a_loss_of_several_elements_always_raises(strict):
    model, watch, _ = _watched(strict=strict)
    _forward(model)
    with pytest.raises(ValueError, match=r"one element.*shape \(4,\).*loss.mean\(\)"):
        watch.step(torch.ones(4))
    assert watch.step_count == 0


def test_numpy_and_integer_losses_are_recorded():
    model, watch, metrics = _watched()
    for loss in (np.float32(1.5), 3):
        _forward(model)
        watch.step(loss)
    assert [m.loss for m in metrics] == [1.5, 3.0]


def _train(model, watch, steps, *, calls_per_step=1, micro_batches=1, skip=()):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for s in range(steps):
        for _ in range(micro_batches):
            _forward(model)
        if s not in skip:  # a skipped update (a GradScaler overflow) leaves the weights alone
            opt.step()
        opt.zero_grad()
        for _ in range(calls_per_step):
            watch.step()


def _step_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "once per optimizer step" in r.getMessage()]


def test_step_twice_per_optimizer_step_warns_once(caplog):
    model, watch, _ = _watched(log_every=50)
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        _train(model, watch, 20, calls_per_step=2)
    said = _step_warnings(caplog)
    assert len(said) == 1 and "step() was called 8 times while the optimizer updated the model 4 times" in said[0]


@pytest.mark.parametrize("how", [dict(), dict(micro_batches=3), dict(skip=(3, 11))])
def test_step_once_per_optimizer_step_does_not_warn(how, caplog):
    model, watch, _ = _watched(log_every=50)
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        _train(model, watch, 20, **how)
    assert _step_warnings(caplog) == []


def test_frozen_weights_make_no_claim(caplog):
    model, watch, _ = _watched(log_every=50)
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        for _ in range(10):  # no optimizer at all: the check has nothing to compare with
            _forward(model)
            watch.step()
            watch.step()
    assert _step_warnings(caplog) == []


def test_a_model_built_on_meta_is_watched_once_materialized(caplog):
    """Deferred initialisation: attach on meta, materialize, train; nothing fails or is turned off."""
    model = _model("meta")
    watch = InstabilityWatch(model, WatchConfig(**EVERY))
    metrics = []
    watch.listeners.append(lambda r: metrics.extend(r.metrics))
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        x = torch.zeros(2, 16, dtype=torch.long, device="meta")
        model(x, x)[1]
        watch.step()
        watch.step()
    assert watch.disabled == {}
    assert any("meta device" in r.getMessage() for r in caplog.records)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for _ in range(2):
        loss = _forward(model)
        watch.step(loss)
    watch.detach()
    assert watch.disabled == {}
    assert [m.step for m in metrics] == [3, 4]
    assert all((m["rows"] == 2 * 16).all() for m in metrics)
    assert np.isfinite(metrics[0]["max_score"]).all()


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 16, 16, generator=g) for _ in range(3)]


@pytest.mark.parametrize("kw, match", [
    (dict(scale=1e300), r"scale must be None or a number in \(0, 3.403e\+38\].*got 1e\+300"),
    (dict(scale=float("nan")), "scale must be"),
    (dict(beta=1e308), r"beta must be a number in \(1, 1024\].*got 1e\+308"),
    (dict(beta=float("inf")), "beta must be"),
    (dict(eps=1e308), r"eps must be a number in \[0, 3.403e\+38\]"),
])
def test_numbers_beyond_float32_are_clear_errors(kw, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, stabilize=True, **kw)


def test_the_largest_allowed_beta_and_eps_give_finite_output():
    q, k, v = _qkv()
    for kw in (dict(beta=1024.0), dict(eps=3e38), dict(scale=1e-30)):
        out = flash_attention(q * 30, k, v, stabilize=True, **kw)
        assert torch.isfinite(out).all(), kw


@pytest.mark.parametrize("kw, match", [
    (dict(beta=1e308), r"WatchConfig.beta must be in \(1, 1024\]"),
    (dict(eps=1e300), "WatchConfig.eps must be at most"),
])
def test_config_numbers_beyond_float32_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        WatchConfig(**kw)


def test_loading_a_bad_state_changes_nothing_and_names_the_key():
    """All or nothing: a state that fails a check leaves the watch exactly as it was (issue 21, item 3)."""
    model, watch, _ = _watched()
    for _ in range(3):
        _forward(model)
        watch.step()
    watch.switch(0, 1)
    good = watch.state_dict()
    before = (watch.step_count, dict(watch.switched), watch.observation.stabilized(), watch.flushed_through)

    missing = {k: v for k, v in good.items() if k != "flushed_through"}
    with pytest.raises(ValueError, match="missing key 'flushed_through'"):
        watch.load_state_dict(missing)
    bad = {**good, "step": 99, "switched": [[0, 0, 2], [0, 7, 2]]}  # a valid step, then a head that does not exist
    with pytest.raises(ValueError, match="'switched'"):
        watch.load_state_dict(bad)
    assert (watch.step_count, dict(watch.switched), watch.observation.stabilized(), watch.flushed_through) == before

    fresh_model, fresh, _ = _watched()
    fresh.load_state_dict(good)
    assert fresh.step_count == 3 and set(fresh.switched) == {(0, 1)}
    assert fresh.observation.stabilized() == watch.observation.stabilized()


def test_device_memory_is_bounded_whatever_log_every():
    """log_every=10**6 preallocates no 10**6-row ring: the ring holds RING_ROWS_MAX rows and reads back when full."""
    from instability_watch.engine.ring import RING_ROWS_MAX

    model, watch, metrics = _watched(log_every=10**6)
    _forward(model)  # the first probe step observes a call (the coverage check passes)
    for _ in range(RING_ROWS_MAX + 3):
        watch.step(1.0)  # then no forward is needed: the rows fill (zero statistics), the ring must not overflow
    assert watch.ring.tensor(watch.observation.bank.device).shape[0] == RING_ROWS_MAX
    # step 1 is read back at once (the coverage check), then a full ring: steps 2 .. RING_ROWS_MAX + 1
    assert [m.step for m in metrics] == list(range(1, RING_ROWS_MAX + 2))
    watch.flush()
    assert [m.step for m in metrics] == list(range(1, RING_ROWS_MAX + 4))  # nothing lost, nothing twice
    with pytest.raises(Exception):  # frozen: a changed setting cannot reach step()
        watch.config.log_every = 0


@pytest.mark.parametrize("kw, kind, match", [
    (dict(probe_evry=10), TypeError, r"WatchConfig got the unknown keyword argument 'probe_evry' \(did you mean "
                                     r"'probe_every'\?\); it takes probe_every, shadow_every, .*, sync_distributed$"),
    (dict(probe_every="50"), TypeError, r"WatchConfig.probe_every must be an int >= 1, got '50'"),
    (dict(probe_every=0), ValueError, r"WatchConfig.probe_every must be an int >= 1, got 0"),
    (dict(logit_min="500"), TypeError, r"WatchConfig.logit_min must be a finite number >= 0.0, got '500'"),
    (dict(logit_min=float("inf")), ValueError, r"WatchConfig.logit_min must be a finite number >= 0.0, got inf"),
])
def test_a_misspelt_field_is_named_with_the_nearest_one_and_a_wrong_kind_of_value_is_a_type_error(kw, kind, match):
    with pytest.raises(kind, match=match):
        WatchConfig(**kw)


def test_a_misspelt_callback_argument_names_the_callback_and_what_it_takes():
    from instability_watch import InstabilityWatchCallback

    with pytest.raises(TypeError, match=r"^InstabilityWatchCallback got the unknown keyword argument 'run_directory' "
                                        r"\(did you mean 'run_dir'\?\); it takes config, layers, run_dir, "):
        InstabilityWatchCallback(run_directory="x")
    cb = InstabilityWatchCallback(WatchConfig(), run_dir="x", top=3)  # right names still build it
    assert cb.top == 3


def test_step_after_detach_says_so_once(caplog):
    model, watch, _ = _watched()
    _forward(model)
    watch.step()
    watch.detach()
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        assert watch.step() == [] and watch.step() == []
    said = [r.getMessage() for r in caplog.records if "after detach()" in r.getMessage()]
    assert said == ["instability_watch: step() after detach() (at step 1): nothing is observed from here on; "
                    "create a new InstabilityWatch to watch again"]


def test_the_config_and_the_callbacks_keep_their_signatures_for_lightning_cli():
    """The misspelt-name check must not hide the fields: inspect (IDEs, help()) and jsonargparse (LightningCLI)
    read them; with a __new__ doing that check both saw (*args, **kwargs)."""
    import inspect

    from jsonargparse import ArgumentParser

    from instability_watch import InstabilityWatchCallback

    assert list(inspect.signature(WatchConfig).parameters)[:3] == ["probe_every", "shadow_every", "spectral_every"]
    assert list(inspect.signature(InstabilityWatchCallback).parameters)[:3] == ["config", "layers", "run_dir"]
    parser = ArgumentParser()
    parser.add_class_arguments(WatchConfig, "watch")
    config = parser.instantiate_classes(parser.parse_args(["--watch.probe_every=10", "--watch.shadow_every=10"]))
    assert config.watch == WatchConfig(probe_every=10, shadow_every=10)


@pytest.mark.parametrize("kwargs, kind, match", [
    (dict(listeners=print), TypeError, "listeners must be a list of callables.*got builtin_function_or_method"),
    (dict(listeners=[1]), TypeError, r"listeners\[0\] must be callable.*got int"),
    (dict(layers=5), TypeError, "layers must be None, a list of AttentionLayer or a function.*got int"),
    (dict(layers=lambda m: 5), TypeError, "layers, a function, must return a list of AttentionLayer, returned int"),
    (dict(check_step_calls="no"), TypeError, "check_step_calls must be a bool, got str"),
])
def test_bad_watch_arguments_name_the_argument_what_it_takes_and_what_was_given(kwargs, kind, match):
    with pytest.raises(kind, match=match):
        InstabilityWatch(_model(), WatchConfig(**EVERY), **kwargs)


def test_bad_attention_layer_fields_and_switch_arguments_are_named():
    from instability_watch import AttentionLayer

    model = _model()
    attn = model.h[0].attn
    assert AttentionLayer(attn, 2, lambda: attn.c_attn.weight[:32].view(2, 16, 32), name=None).name == ""
    with pytest.raises(TypeError, match="AttentionLayer.name must be a str, got int"):
        AttentionLayer(attn, 2, lambda: attn.c_attn.weight[:32].view(2, 16, 32), name=3)
    with pytest.raises(TypeError, match="AttentionLayer got the unknown keyword argument 'num_kv_heads'"):
        AttentionLayer(attn, 2, lambda: attn.c_attn.weight[:32].view(2, 16, 32), num_kv_heads=1)
    watch = InstabilityWatch(model, WatchConfig(**EVERY))
    with pytest.raises(TypeError, match="layer must be an int .the index in the CSV's `layer` column.*got str '0'"):
        watch.switch("0", 1)
    with pytest.raises(TypeError, match="layer must be an int .*got float 0.5"):
        watch.switch(0.5, 0)
    with pytest.raises(TypeError, match="head must be an int, got bool True"):
        watch.switch(0, True)
    watch.switch(np.int64(0), 1)  # a NumPy integer is an int
    assert watch.switched == {(0, 1): 0}
    watch.detach(read_back=False)


def test_a_blank_run_dir_is_named_as_given():
    from instability_watch.callbacks.hf import InstabilityWatchTrainerCallback

    with pytest.raises(ValueError, match="run_dir must be None or a non-empty path, got '  '"):
        InstabilityWatchTrainerCallback(WatchConfig(**EVERY), run_dir="  ")


def test_probe_every_alone_is_enough_the_shadow_follows_it():
    import dataclasses

    for n in (3, 20, 40, 50):
        assert WatchConfig(probe_every=n).shadow_period == n
        assert WatchConfig(probe_every=n).to_dict()["shadow_every"] == n  # meta.json records the period in force
    assert WatchConfig().shadow_period == 50 and WatchConfig(probe_every=20, shadow_every=0).shadow_period == 0
    # replace() keeps following probe_every where shadow_every was not given, and keeps a given one
    moved = dataclasses.replace(WatchConfig(), probe_every=20)
    assert moved.shadow_period == 20 and Cadence(moved).shadow(21) and not Cadence(moved).shadow(11)
    assert dataclasses.replace(WatchConfig(probe_every=10, shadow_every=0), probe_every=5).shadow_period == 0
    with pytest.raises(ValueError, match=r"shadow_every must be 0 or a multiple of probe_every \(20\).*got 50"):
        WatchConfig(probe_every=20, shadow_every=50)


def test_a_watchconfig_field_given_to_the_watch_or_a_callback_points_to_watchconfig():
    from instability_watch import InstabilityWatchCallback
    from instability_watch.callbacks.hf import InstabilityWatchTrainerCallback

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))
    with pytest.raises(TypeError, match=r"InstabilityWatch got the unknown keyword argument 'probe_every' \(a "
                                        r"WatchConfig field: pass config=WatchConfig\(probe_every=5\)\)"):
        InstabilityWatch(model, probe_every=5)
    with pytest.raises(TypeError, match=r"'auto_switch' \(a WatchConfig field: pass config=WatchConfig\(auto_switch="
                                        r"True\)\), 'live_tabel' \(did you mean 'live_table'\?\)"):
        InstabilityWatchCallback(auto_switch=True, live_tabel=True)
    with pytest.raises(TypeError, match=r"InstabilityWatchTrainerCallback got .*'eps' \(a WatchConfig field"):
        InstabilityWatchTrainerCallback(eps=2e-3)
    assert InstabilityWatch(model, WatchConfig(probe_every=5)).config.probe_every == 5
