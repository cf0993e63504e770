"""Observing unmodified models: training unchanged, every call covered, switches applied or reported."""
import logging
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from instability_watch import InstabilityWatch, WatchConfig
from instability_watch.errors import WatchError
from instability_watch.kernels import stats as st
from instability_watch.model.layer import AttentionLayer, find_attention_layers
from instability_watch.observe.mha import MHA_WEIGHTS
from instability_watch.probe.bank import Probe

from nanogpt import GPT, GPTConfig
from real_models import MODELS, hf_llama_gqa, train
from watch_models import NarrowValues

SDPA = F.scaled_dot_product_attention

CFG = dict(probe_every=2, shadow_every=4, spectral_every=4, log_every=10, warmup_steps=100)


def _train(name, steps, config=None):
    """``steps`` AdamW steps under CPU bf16 autocast from seed 0; the watch if ``config``."""
    return train(MODELS[name], steps, config)


@pytest.mark.parametrize("name", list(MODELS))
def test_watched_training_is_bitwise_identical_and_every_head_is_observed(name):
    spec = MODELS[name]
    plain, plain_losses, _, _ = _train(name, 20)
    rng_plain = torch.get_rng_state()
    model, losses, watch, metrics = _train(name, 20, WatchConfig(**CFG))
    rng_watched = torch.get_rng_state()
    watch.detach()

    # the same losses, weights and random numbers, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(rng_plain, rng_watched)

    # every layer and head has statistics on every probe step (1, 3, ..., 19)
    assert watch.head_counts == [spec.heads] * spec.layers
    assert [m.step for m in metrics] == list(range(1, 20, 2))
    for m in metrics:
        assert (m["rows"] > 0).all() and np.isfinite(m["max_score"]).all()
        assert np.isfinite(m["multi_max_freq"]).all()
    assert all(np.isfinite(m["sigma_wq"]).all() for m in metrics if (m.step - 1) % 4 == 0)

    # coverage: every call observed; calls with dropout get no shadow, and say so
    dropout = name in ("nanogpt-dropout", "hf-gpt2-default", "hf-bert-padding")
    for c in watch.coverage():
        assert c.observed_calls == 10 and c.unobserved_calls == {}
        assert c.kernel_calls == 0 and c.not_applied == {}
        if dropout:
            assert c.shadow_calls == 0 and c.shadow_skipped == {"dropout": 5}
        else:
            assert c.shadow_calls == 5 and c.shadow_skipped == {}
            assert all(np.isfinite(m["delta_err_sum"]).all() for m in metrics if (m.step - 1) % 4 == 0)
    # a padded BERT batch: the padded keys are masked, no row is fully masked
    if name == "hf-bert-padding":
        assert all((m["masked_rows"] == 0).all() for m in metrics)


def test_nothing_is_installed_between_probe_steps():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    watch = InstabilityWatch(model, WatchConfig(probe_every=3, shadow_every=0, log_every=3))
    modules = [b.attn for b in model.h]
    installed = []
    x = torch.randint(0, 256, (2, 16))
    for _ in range(6):
        installed.append(all("forward" in m.__dict__ for m in modules))
        model(x, x)[1].backward()
        watch.step()
    assert installed == [True, False, False, True, False, False]  # probe steps 1 and 4 only
    # and no mode is entered on the other steps: a counting mode sees no extra handler
    watch.detach()
    assert all("forward" not in m.__dict__ for m in modules)


def _ops_per_step(watched: bool, steps: int = 7):
    """The ATen ops each training step dispatches (forward, backward, the optimizer, ``watch.step``), in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = InstabilityWatch(model, WatchConfig(probe_every=3, shadow_every=3, spectral_every=3, log_every=300,
                                                warmup_steps=2)) if watched else None
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    per_step = []
    for _ in range(steps):
        with Ops() as mode:
            loss = model(x, x)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            if watch is not None:
                watch.step(loss)
        per_step.append(mode.ops)
    if watch is not None:
        watch.detach()
    return per_step


def test_steps_between_probe_steps_dispatch_exactly_the_unwatched_ops():
    """The hot path's promise, on the device's side: a step that is neither a probe, spectral nor read-back step
    runs the very ops of the unwatched model, no more (so whatever a GPU times there is not the watch's)."""
    plain, watched = _ops_per_step(False), _ops_per_step(True)
    for step in (2, 3, 5, 6):  # watch.step(s) arms step s + 1: steps 3 and 6 end by arming a probe step
        assert watched[step - 1] == plain[step - 1], f"step {step}"
    for step in (1, 4, 7):  # probe (and spectral, shadow) steps do the watch's work
        assert len(watched[step - 1]) > len(plain[step - 1]), f"step {step}"


def test_float32_qk_under_autocast_are_observed_as_bf16():
    """HF Llama hands float32 q, k to SDPA under autocast; the statistics are those of the BF16 inputs SDPA uses."""
    torch.manual_seed(0)
    model = hf_llama_gqa()
    seen = []

    class Capture(TorchFunctionMode):  # outside the watch's mode: sees the call as the model made it
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                seen.append((args[0].detach().clone(), args[1].detach().clone(), kwargs))
            return func(*args, **kwargs)

    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0))
    x = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), Capture():
        model(input_ids=x, use_cache=False)
    assert seen and all(q.dtype == torch.float32 and k.dtype == torch.float32 for q, k, _ in seen)
    for site, (q, k, kw) in zip(watch.observation.sites, seen):
        bf16, fp32 = Probe(4), Probe(4)
        for ref, cast in ((bf16, torch.bfloat16), (fp32, torch.float32)):
            st.stats_reference(q.to(cast), k.to(cast), None, None, ref.counts, ref.values,
                               causal=True, scale=kw["scale"], eps=1e-3)
        probe = watch.observation.bank.probes[site.index]
        assert torch.equal(probe.rows, bf16.rows) and torch.equal(probe.multi_max_rows, bf16.multi_max_rows)
        assert torch.equal(probe.max_score, bf16.max_score)
        assert not torch.equal(probe.max_score, fp32.max_score)  # the test can tell the two apart
    watch.detach()


def test_switched_layer_runs_on_our_kernels_in_the_autocast_dtype(monkeypatch):
    import instability_watch.observe.sdpa as observe_mod

    torch.manual_seed(0)
    model = hf_llama_gqa()
    dtypes = []
    real = observe_mod.flash_attention

    def spy(q, k, v, **kw):
        dtypes.append((q.dtype, k.dtype, v.dtype, kw["stabilize"].tolist()))
        return real(q, k, v, **kw)

    monkeypatch.setattr(observe_mod, "flash_attention", spy)
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=1, log_every=1))
    watch.switch(1, 2)
    x = torch.randint(0, 97, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    watch.step(loss)
    assert dtypes == [(torch.bfloat16,) * 3 + ([False, False, True, False],)]  # layer 1 only, never float32
    cov = watch.coverage()
    assert [c.kernel_calls for c in cov] == [0, 1] and all(c.not_applied == {} for c in cov)
    assert [c.observed_calls for c in cov] == [1, 1] and [c.shadow_calls for c in cov] == [1, 1]
    m = watch.last_metrics[-1]
    assert m["stabilized"][1].tolist() == [0, 0, 1, 0] and np.isfinite(m["delta_err_sum"]).all()
    assert [e.kind for e in watch.events] == ["switch"]
    watch.detach()


def test_switch_not_applied_is_reported_with_its_reason(caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(NarrowValues(), NarrowValues())
    layers = [AttentionLayer(m, 4, (lambda m=m: m.qk.weight[:32].view(4, 8, 32)), name=f"attn{i}")
              for i, m in enumerate(model)]
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, log_every=2), layers=layers)
    watch.switch(0, 1)
    x = torch.randn(2, 16, 32)
    reason = "head dims q 8, k 8, v 4 (supported: equal, at most 256)"
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            watch.step()
    events = [(e.kind, e.layer, e.head, e.reason) for e in watch.events]
    assert events == [("switch", 0, 1, "manual"), ("switch_not_applied", 0, 1, reason)]
    cov = watch.coverage()
    assert cov[0].not_applied == {reason: 2} and cov[0].kernel_calls == 0 and cov[1].not_applied == {}
    assert watch.last_metrics[-1]["stabilized"][0].tolist() == [0, 0, 0, 0]  # not applied: not stabilized
    assert sum("stay on PyTorch's attention although a head is switched" in r.getMessage() for r in caplog.records) == 1
    assert out is not None
    watch.detach()


def test_eager_attention_is_an_error_naming_the_reason():
    t = pytest.importorskip("transformers")
    cfg = t.LlamaConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64,
                        vocab_size=97, attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation='eager'.*attn_implementation='sdpa'"):
        InstabilityWatch(t.LlamaForCausalLM(cfg))


class _ManualAttention(nn.Module):
    """Attention written out by hand (no SDPA call)."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x):  # (B, 2, N, 8)
        q = torch.einsum("bhnd,hed->bhne", x, self.wq)
        return torch.softmax(q @ x.transpose(-1, -2), dim=-1) @ x


def test_nothing_observable_is_an_error_after_the_first_probe_step_with_strict():
    torch.manual_seed(0)
    model = _ManualAttention()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, strict=True),
                             layers=[AttentionLayer(model, 2, lambda: model.wq)])
    watch.step()  # no forward yet: nothing to judge
    model(torch.randn(1, 2, 5, 8)).sum().backward()
    with pytest.raises(WatchError, match="observed no attention call.*no attention call the watch can see") as err:
        watch.step()
    assert isinstance(err.value, ValueError)  # as it was before strict decided it
    watch.detach()


def test_nothing_observable_without_strict_is_said_once_and_training_goes_on_watching_sigma(caplog):
    """No strict: one error naming the reasons; sigma(W_Q) is still read back at every later read-back where it is
    measured (spectral_growth); where it is not, the statistics are turned off."""
    for spectral_every in (1, 0):
        torch.manual_seed(0)
        model = _ManualAttention()
        read = []
        watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=2, spectral_every=spectral_every),
                                 layers=[AttentionLayer(model, 2, lambda: model.wq)],
                                 listeners=[lambda r: read.extend(r.metrics)])
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="instability_watch"):
            for _ in range(8):
                model(torch.randn(1, 2, 5, 8)).sum().backward()
                watch.step()
        said = [r.getMessage() for r in caplog.records if "observed no attention call" in r.getMessage()]
        assert len(said) == 1 and "training goes on" in said[0], said
        if spectral_every:
            assert "Only sigma(W_Q) is watched" in said[0] and watch.disabled == {}
            assert [m.step for m in read] == list(range(1, 9))
            assert all(np.isfinite(m["sigma_wq"]).all() for m in read)
        else:
            assert list(watch.disabled) == ["statistics"]
            assert "no attention call the watch can see" in watch.disabled["statistics"]
            # nothing is looked at after the first probe step: its one call is all the coverage counts
            unobserved = watch.coverage()[0].unobserved_calls
            assert list(unobserved.values()) == [1]
        watch.detach()


def test_eval_mode_calls_are_not_observed():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1))
    x = torch.randint(0, 256, (2, 16))
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    model(x, x)[1].backward()
    watch.step()
    assert watch.coverage()[0].observed_calls == 1
    assert (watch.last_metrics[0]["rows"] == 32).all()
    watch.detach()


def _encoder(seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 1))


def test_multihead_attention_in_pytorchs_transformer_encoder_is_observed_like_sdpa():
    """nn.TransformerEncoder (PyTorch's code: need_weights=False, a key padding mask): every call observed and
    shadowed, the first layer's statistics equal a float64 computation from its in_proj weights, training bitwise
    the unwatched model's, and F.scaled_dot_product_attention PyTorch's own again after each call."""
    model, plain = _encoder(), _encoder()
    (layer, _) = find_attention_layers(model)
    mha = model[0].layers[0].self_attn
    assert layer.num_heads == 4
    torch.testing.assert_close(layer.w_q().reshape(32, 32), mha.in_proj_weight[:32])
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=1, log_every=3, warmup_steps=0))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 5:] = True  # the second sequence has 5 tokens
    for step in range(3):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step))
        if step == 2:  # the last step's statistics, against the weights it ran with
            w, b = mha.in_proj_weight.detach().double(), mha.in_proj_bias.detach().double()
            q, k = ((x.double() @ w[i * 32:(i + 1) * 32].T + b[i * 32:(i + 1) * 32]).view(2, 8, 4, 8).transpose(1, 2)
                    for i in (0, 1))
            s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(pad[:, None, None, :], float("-inf"))
            expected = s.amax(dim=(0, 2, 3)).numpy()
        losses = []
        for m, opt in zip((model, plain), opts):
            loss = m[1](m[0](x, src_key_padding_mask=pad)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), step
        assert F.scaled_dot_product_attention is SDPA
        watch.step(losses[0])
    for c in watch.coverage():
        assert (c.observed_calls, c.unobserved_calls, c.shadow_calls, c.shadow_skipped) == (3, {}, 3, {}), c
    m = watch.last_metrics[-1]
    assert (m["rows"] == 16).all()
    np.testing.assert_allclose(m["max_score"][0], expected, rtol=1e-5)
    assert np.isfinite(m["delta_err_sum"]).all()
    watch.detach()


def test_a_user_replaced_sdpa_still_runs_inside_an_observed_multihead_call(monkeypatch):
    """Code that replaced torch.nn.functional.scaled_dot_product_attention (a wrapper of its own) keeps it: the
    observed nn.MultiheadAttention call runs the user's function, which reaches PyTorch's and is observed."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(args[0].shape)
        return SDPA(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", wrapper)
    model = _encoder()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1, warmup_steps=0))
    model(torch.randn(2, 8, 32)).sum().backward()
    watch.step()
    assert calls == [torch.Size([2, 4, 8, 8])] * 2  # both layers' calls went through the user's function
    assert [c.observed_calls for c in watch.coverage()] == [1, 1]
    watch.detach()
    assert F.scaled_dot_product_attention is wrapper


def test_a_switched_multihead_attention_layer_runs_on_our_kernels():
    model = _encoder()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1, warmup_steps=0))
    watch.switch(1, 2)
    x = torch.randn(2, 8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).pow(2).mean()
    loss.backward()
    watch.step(loss)
    cov = watch.coverage()
    assert cov[1].kernel_calls == 1 and cov[1].not_applied == {} and cov[0].kernel_calls == 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    watch.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unwatched = model(x).pow(2).mean()
    torch.testing.assert_close(loss, unwatched, rtol=2e-2, atol=1e-3)


def test_multihead_attention_with_its_weights_is_located_and_said_once(caplog):
    """need_weights=True (the module's default) computes the attention without SDPA: sigma(W_Q) tracked, the reason
    said once with what to do, training goes on."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x)[0]  # need_weights left at True

    wrapped = Wrap()
    watch = InstabilityWatch(wrapped, WatchConfig(probe_every=1, spectral_every=1, log_every=1))
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        for _ in range(2):
            wrapped(torch.randn(2, 5, 16)).sum().backward()
            watch.step()
    said = [r.getMessage() for r in caplog.records if "only sigma(W_Q) is tracked" in r.getMessage()]
    assert len(said) == 1 and "need_weights=False" in said[0]
    # one reason per call (not also "no attention call the watch can see")
    assert watch.coverage()[0].unobserved_calls == {MHA_WEIGHTS: 2}
    assert np.isfinite(watch.last_metrics[-1]["sigma_wq"]).all() and watch.disabled == {}
    watch.detach()
    # with sigma(W_Q) off nothing at all would be watched: an error naming the reason, as for any such model
    for off in (dict(spectral_every=0), dict(spectral_every=1, detectors=("multi_max", "logit_growth"))):
        watch = InstabilityWatch(wrapped, WatchConfig(probe_every=1, log_every=1, strict=True, **off))
        wrapped(torch.randn(2, 5, 16)).sum().backward()
        with pytest.raises(WatchError, match="observed no attention call on the first probe step: nn.Multihead"):
            watch.step()
        watch.detach()


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3, 2, 16, 16) * 0.3)

    def forward(self, x):  # x (B, H=2, N, 16)
        q, k, v = (torch.einsum("bhnd,hed->bhne", x, w) for w in self.qkv)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_user_described_layer():
    torch.manual_seed(0)
    model = _Custom()
    x = torch.randn(2, 2, 8, 16)
    ref = model(x)
    watch = InstabilityWatch(
        model, WatchConfig(probe_every=1, log_every=1, spectral_every=1),
        layers=lambda m: [AttentionLayer(m, 2, lambda: m.qkv[0], name="custom")],
    )
    out = model(x)
    out.sum().backward()
    watch.step()
    assert torch.equal(out, ref)
    m = watch.last_metrics[0]
    assert watch.layer_names == ["custom"] and (m["rows"] == 16).all()
    expected = torch.linalg.matrix_norm(model.qkv[0].detach(), ord=2)
    torch.testing.assert_close(torch.tensor(m["sigma_wq"][0], dtype=torch.float32), expected, rtol=1e-4, atol=0)
    watch.detach()


def test_attach_errors_name_the_problem():
    with pytest.raises(ValueError, match="no attention layers found"):
        InstabilityWatch(nn.Linear(3, 3))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
    layer = find_attention_layers(model)[0]
    with pytest.raises(ValueError, match="listed twice"):
        InstabilityWatch(model, layers=[layer, layer])
    with pytest.raises(TypeError, match=r"layers\[0\] must be an instability_watch.AttentionLayer"):
        InstabilityWatch(model, layers=["h.0.attn"])
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        AttentionLayer(model.h[0].attn, 0, lambda: None)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        InstabilityWatch("gpt")
    watch = InstabilityWatch(model, layers=[AttentionLayer(model.h[0].attn, 4, lambda: torch.zeros(3, 3))])
    with pytest.raises(ValueError, match=r"w_q\(\) of layer h.0.attn must return a tensor \(H=4"):
        watch.observation.w_q()
    with pytest.raises(ValueError, match="already watched"):
        InstabilityWatch(model)
    watch.detach()
    InstabilityWatch(model).detach()  # free again after detach


def test_a_described_layer_the_model_never_calls_is_named_once(caplog):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    stray = nn.Linear(32, 32)
    layers = find_attention_layers(model) + [AttentionLayer(stray, 2, lambda: stray.weight.view(2, 16, 32),
                                                            name="stray")]
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1), layers=layers)
    x = torch.randint(0, 256, (2, 16))
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        for _ in range(3):
            model(x, x)[1].backward()
            watch.step()
    said = [r.getMessage() for r in caplog.records if "made no attention call" in r.getMessage()]
    assert len(said) == 1 and "'stray'" in said[0] and "h.0.attn" not in said[0], said
    assert watch.disabled == {}
    watch.detach()
