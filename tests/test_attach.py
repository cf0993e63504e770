"""Attaching to unmodified models: nanoGPT, HF GPT-2 and Llama (GQA), user descriptions."""
import logging
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from instability_watch import InstabilityWatch, WatchConfig
from instability_watch.attach import AttentionLayer, attach, find_attention_layers
from instability_watch.nanogpt import GPT, GPTConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _nanogpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=32, vocab_size=97, attn_pdrop=0.0,
        resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
    )
    return transformers.GPT2LMHeadModel(cfg)


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
        intermediate_size=256, vocab_size=97, max_position_embeddings=32, attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg)


def _loss(model, x):
    if isinstance(model, GPT):
        return model(x, x)[1]
    return model(input_ids=x, labels=x).loss


def _train(model, steps, watch=None, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 97, (2, 32), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if watch is not None:
            watch.step(loss)
    return losses


MODELS = {"nanogpt": (_nanogpt, 4), "hf-gpt2": (_hf_gpt2, 4), "hf-llama-gqa": (_hf_llama, 4)}


@pytest.mark.parametrize("name", list(MODELS))
def test_watched_training_matches_unwatched_and_detach_restores(name):
    make, heads = MODELS[name]
    plain = make()
    ref_losses = _train(plain, 3)

    model = make()
    x = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = _loss(model, x)
    watch = InstabilityWatch(model, WatchConfig(log_every=3, shadow_every=1, spectral_every=1, warmup_steps=1))
    assert len(watch.layer_names) == 2 and watch.head_counts == [heads, heads]
    losses = _train(model, 3, watch)

    # Same seed, same data: the losses agree to BF16 rounding.
    for a, b in zip(losses, ref_losses):
        assert a == pytest.approx(b, rel=2e-2)
    # Every step, layer and head has metrics.
    assert [m.step for m in watch.last_metrics] == [1, 2, 3]
    for m in watch.last_metrics:
        assert (m["rows"] == 2 * 32).all()
        assert (m["tie_rows"] == 2 * 32).all()
        assert (m["shadow_rows"] == 2 * 32).all()
        assert torch.isfinite(torch.tensor(m["max_score"])).all()
        assert torch.isfinite(torch.tensor(m["delta_err_sum"])).all()
        assert (m["sigma_wq"] > 0).all()
    assert all(s.watched_calls == 3 and s.unwatched_calls == 0 for s in watch.attachment.sites)

    # Detaching restores the original modules: no instance forward left, SDPA goes to PyTorch.
    watch.detach()
    for site in watch.attachment.sites:
        assert "forward" not in site.layer.module.__dict__
    calls = [s.watched_calls for s in watch.attachment.sites]
    with torch.no_grad():
        _loss(model, x)
    assert [s.watched_calls for s in watch.attachment.sites] == calls
    # and the model computes exactly what an unwatched copy with the same weights computes
    twin = make()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(_loss(model, x), _loss(twin, x))
    assert before.isfinite()


def test_hf_gpt2_w_q_is_the_transposed_conv1d_slice():
    model = _hf_gpt2()
    layers = find_attention_layers(model)
    attn = model.transformer.h[1].attn
    w = layers[1].w_q()
    e = attn.embed_dim
    x = torch.randn(3, e)
    # Conv1D computes x @ weight + bias; the first e outputs are the queries
    q_ref = (x @ attn.c_attn.weight[:, :e]).view(3, 4, e // 4)
    q = torch.einsum("nc,hdc->nhd", x, w)
    torch.testing.assert_close(q, q_ref)


def test_llama_w_q_and_gqa_routing():
    model = _hf_llama()
    layers = find_attention_layers(model)
    assert [tuple(l.w_q().shape) for l in layers] == [(4, 32, 128)] * 2
    torch.testing.assert_close(layers[0].w_q().reshape(128, 128), model.model.layers[0].self_attn.q_proj.weight)


def test_nanogpt_w_q_is_first_third_of_c_attn():
    model = _nanogpt()
    (l0, _) = find_attention_layers(model)
    c_attn = model.h[0].attn.c_attn
    torch.testing.assert_close(l0.w_q().reshape(64, 64), c_attn.weight[:64])


def test_unwatched_calls_are_counted_and_reported_once(caplog):
    model = _nanogpt()
    att = attach(model)
    site = att.sites[0]
    module = model.h[0].attn
    q = torch.randn(1, 4, 8, 16)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    with caplog.at_level(logging.WARNING, logger="instability_watch"):
        for _ in range(3):
            with site_mode(module):
                out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            with site_mode(module):
                F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    assert site.unwatched_calls == 6
    assert site.unwatched_reasons == {"attn_mask": 3, "dropout": 3}
    msgs = [r.getMessage() for r in caplog.records if "not watched" in r.getMessage()]
    assert len(msgs) == 2 and "attn_mask" in msgs[0] and "dropout" in msgs[1]
    att.detach()


class site_mode:
    """Run code inside a watched module's routing mode (what its wrapped forward does)."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        from instability_watch.attach import _ROUTED

        self.router = _ROUTED[self.module][0]
        self.router.__enter__()

    def __exit__(self, *exc):
        self.router.__exit__(*exc)


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
        model, WatchConfig(log_every=1, spectral_every=1),
        layers=lambda m: [AttentionLayer(m, 2, lambda: m.qkv[0], name="custom")],
    )
    out = model(x)
    out.sum().backward()
    watch.step()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    m = watch.last_metrics[0]
    assert watch.layer_names == ["custom"]
    assert (m["rows"] == 16).all()
    expected = torch.linalg.matrix_norm(model.qkv[0].detach(), ord=2)
    torch.testing.assert_close(torch.tensor(m["sigma_wq"][0], dtype=torch.float32), expected, rtol=1e-4, atol=0)


def test_attach_errors_name_the_problem():
    with pytest.raises(ValueError, match="no attention layers found"):
        attach(nn.Linear(3, 3))
    model = _nanogpt()
    layer = find_attention_layers(model)[0]
    with pytest.raises(ValueError, match="listed twice"):
        attach(model, [layer, layer])
    with pytest.raises(TypeError, match=r"layers\[0\] must be an instability_watch.AttentionLayer"):
        attach(model, ["h.0.attn"])
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        AttentionLayer(model.h[0].attn, 0, lambda: None)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        attach("gpt")
    bad = attach(model, [AttentionLayer(model.h[0].attn, 4, lambda: torch.zeros(3, 3))])
    with pytest.raises(ValueError, match=r"w_q\(\) of layer h.0.attn must return a tensor \(H=4"):
        bad.w_q()
    bad.detach()


def test_multihead_attention_w_q_located():
    mha = nn.MultiheadAttention(64, 4)
    (layer,) = find_attention_layers(nn.Sequential(mha))
    assert layer.num_heads == 4
    torch.testing.assert_close(layer.w_q().reshape(64, 64), mha.in_proj_weight[:64])


def test_compiled_model_routes_through_the_kernels_without_graph_break():
    model = _nanogpt()
    watch = InstabilityWatch(model, WatchConfig(log_every=2, shadow_every=1, spectral_every=0))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randint(0, 97, (2, 32))
    for _ in range(2):
        loss = compiled(x, x)[1]
        loss.backward()
        watch.step(loss)
    for m in watch.last_metrics:
        assert (m["rows"] == 64).all() and (m["shadow_rows"] == 64).all()
    watch.detach()
