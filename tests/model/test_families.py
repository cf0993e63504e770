"""Model families beyond GPT-2/Llama/BERT: every layer found, W_Q per head right, every call observed.

Each family is built from its library's config (``family_models.py``) and:

* its attention layers are all found, with ``W_Q`` per head equal to the rows the
  module itself projects its queries with (read off the ``q`` of its own SDPA call
  at the first position, where RoPE is the identity);
* it trains 5 steps under CPU bf16 autocast with the watch probing every step,
  and every call is observed (0 unobserved).
"""
import contextlib

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from instability_watch import InstabilityWatch, WatchConfig
from instability_watch.model.layer import AttentionLayer, find_attention_layers

from family_models import FAMILIES, need
from real_models import train

STEPS = 5
CFG = dict(probe_every=1, shadow_every=1, spectral_every=1, log_every=STEPS, warmup_steps=100)


class _QueryTap(TorchFunctionMode):
    """Records the ``q`` of each SDPA call, by the attention module running it."""

    def __init__(self):
        super().__init__()
        self.active = None
        self.queries = {}  # module -> q (B, H, N, D)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.active is not None:
            self.queries[self.active] = (args[0] if args else kwargs["query"]).detach()
        return func(*args, **kwargs)


@contextlib.contextmanager
def _tapped(modules):
    """Inside: each module's input hidden states and its SDPA call's ``q``."""
    tap, inputs, handles = _QueryTap(), {}, []

    def before(module, args, kwargs):
        inputs[module] = (args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))).detach()
        tap.active = module

    def after(module, args, kwargs, out):
        tap.active = None

    for m in modules:
        handles.append(m.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(m.register_forward_hook(after, with_kwargs=True))
    try:
        with tap:
            yield inputs, tap.queries
    finally:
        for h in handles:
            h.remove()


def _zero_biases(module: nn.Module) -> None:
    """The projections' biases to zero, so the queries are ``x @ W_Q.T`` alone."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.zero_()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_layer_found_and_w_q_is_the_modules_own_query_projection(name):
    spec = FAMILIES[name]
    torch.manual_seed(0)
    model = spec.build()
    layers = find_attention_layers(model)
    expected = [m for m in model.modules() if type(m).__name__ == spec.attention]
    assert [layer.module for layer in layers] == expected and len(expected) == spec.layers
    assert [layer.num_heads for layer in layers] == [spec.heads] * spec.layers

    for layer in layers:
        _zero_biases(layer.module)
    model.train()
    with _tapped([layer.module for layer in layers]) as (inputs, queries):
        spec.loss(model, spec.batch(torch.Generator().manual_seed(1)))
    for layer in layers:
        w_q = layer.w_q()  # (H, D, d_in)
        x, q = inputs[layer.module], queries[layer.module]  # (B, N, d_in), (B, H, N, D)
        assert w_q.shape == (spec.heads, q.shape[-1], x.shape[-1]), layer.name
        ours = torch.einsum("bi,hdi->bhd", x[:, 0], w_q)  # (B, H, D)
        torch.testing.assert_close(ours, q[:, :, 0], rtol=1e-5, atol=1e-5, msg=lambda m: f"{layer.name}: {m}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_trains_under_bf16_autocast_with_every_call_observed(name):
    spec = FAMILIES[name]
    _, _, watch, metrics = train(spec, STEPS, WatchConfig(**CFG))
    watch.flush()

    assert watch.head_counts == [spec.heads] * spec.layers
    assert [m.step for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert (m["rows"] > 0).all() and np.isfinite(m["max_score"]).all()
        assert np.isfinite(m["sigma_wq"]).all() and (m["sigma_wq"] > 0).all()
    for c in watch.coverage():
        assert c.observed_calls == STEPS and c.unobserved_calls == {}, c
        if spec.dropout:  # the output of a call with dropout is not P V: no shadow, and it says so
            assert c.shadow_calls == 0 and c.shadow_skipped == {"dropout": STEPS}, c
        else:
            assert c.shadow_calls == STEPS and c.shadow_skipped == {}, c
    watch.detach()


# ----------------------------------------------------------------------------- attention without SDPA


def test_gemma2_cannot_use_sdpa_and_the_error_says_so():
    t = need("transformers")
    cfg = t.Gemma2Config(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         hidden_size=32, intermediate_size=64, vocab_size=97)
    with pytest.raises(ValueError, match=r"attn_implementation='eager'.*Gemma2ForCausalLM cannot be built with "
                                         r"attn_implementation='sdpa'"):
        InstabilityWatch(t.Gemma2ForCausalLM(cfg))


def test_eager_t5_is_an_error_naming_attn_implementation():
    t = need("transformers")
    cfg = t.T5Config(num_layers=1, num_heads=2, d_model=32, d_kv=16, d_ff=64, vocab_size=97,
                     attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation='eager'.*build it with attn_implementation='sdpa'"):
        InstabilityWatch(t.T5ForConditionalGeneration(cfg))


def test_timm_without_fused_attention_is_an_error_saying_how_to_turn_it_on():
    need("timm")
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=4, num_classes=5)
    model.blocks[0].attn.fused_attn = False  # what TIMM_FUSED_ATTN=0 builds
    with pytest.raises(ValueError, match="fused_attn=False.*set_fused_attn"):
        InstabilityWatch(model)


def test_litgpt_with_softcapping_is_an_error():
    need("litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT

    cfg = Config(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=97, padded_vocab_size=97,
                 intermediate_size=64, attention_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attention_logit_softcapping=50.0.*cannot be watched"):
        InstabilityWatch(GPT(cfg))


# ----------------------------------------------------------------------------- nothing found


class MyAttention(nn.Module):
    """Attention a locator does not know: separate wq/wkv projections."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.wq, self.wkv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)

    def forward(self, x):
        B, N, C = x.shape
        q = self.wq(x).view(B, N, self.heads, -1).transpose(1, 2)  # (B, H, N, D)
        k, v = self.wkv(x).view(B, N, 2, self.heads, -1).permute(2, 0, 3, 1, 4)  # 2 x (B, H, N, D)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)


def test_nothing_found_names_what_looks_like_attention_and_how_to_describe_it():
    model = nn.Sequential(MyAttention(), nn.Linear(32, 32), MyAttention())
    with pytest.raises(ValueError) as err:
        InstabilityWatch(model)
    msg = str(err.value)
    assert msg.startswith("no attention layers found in the model (modules that look like attention: "
                          "MyAttention (2, e.g. '0'))")
    assert "layers=[AttentionLayer(" in msg and "type(m).__name__ == 'MyAttention'" in msg
    with pytest.raises(ValueError, match=r"no module's class name contains 'Attention' or 'Attn'"):
        InstabilityWatch(nn.Linear(3, 3))

    # described as the message says, it is watched
    layers = [AttentionLayer(m, m.heads, lambda m=m: m.wq.weight.view(m.heads, -1, 32))
              for m in model.modules() if type(m).__name__ == "MyAttention"]
    watch = InstabilityWatch(model, WatchConfig(**CFG), layers=layers)
    model(torch.randn(2, 17, 32)).sum().backward()
    watch.step()
    watch.flush()
    assert [c.observed_calls for c in watch.coverage()] == [1, 1]
    watch.detach()
