"""locate.py: the attention layers found in unmodified models, and W_Q per head (H, D, C) as each layout stores it."""
import torch

from instability_watch.model.layer import find_attention_layers

from nanogpt import GPT, GPTConfig
from real_models import hf_bert_padding, hf_gpt2_default, hf_llama_gqa


def test_hf_gpt2_w_q_is_the_transposed_conv1d_slice():
    torch.manual_seed(0)
    model = hf_gpt2_default()
    layers = find_attention_layers(model)
    attn = model.transformer.h[1].attn
    w = layers[1].w_q()
    e = attn.embed_dim
    x = torch.randn(3, e)
    q_ref = (x @ attn.c_attn.weight[:, :e]).view(3, 4, e // 4)  # Conv1D: x @ weight + bias
    torch.testing.assert_close(torch.einsum("nc,hdc->nhd", x, w), q_ref)


def test_llama_w_q_is_q_proj_per_head():
    torch.manual_seed(0)
    model = hf_llama_gqa()
    layers = find_attention_layers(model)
    assert [tuple(layer.w_q().shape) for layer in layers] == [(4, 16, 64)] * 2
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 64)
    torch.testing.assert_close(torch.einsum("nc,hdc->nhd", x, layers[0].w_q()), attn.q_proj(x).view(3, 4, 16))


def test_bert_w_q_is_the_query_projection_per_head():
    torch.manual_seed(0)
    model = hf_bert_padding()
    layers = find_attention_layers(model)
    assert [layer.num_heads for layer in layers] == [4, 4]
    assert [layer.name for layer in layers] == ["bert.encoder.layer.0.attention.self", "bert.encoder.layer.1.attention.self"]
    attn = model.bert.encoder.layer[1].attention.self
    x = torch.randn(3, 64)
    q = torch.einsum("nc,hdc->nhd", x, layers[1].w_q()) + attn.query.bias.view(4, 16)
    torch.testing.assert_close(q, attn.query(x).view(3, 4, 16))


def test_nanogpt_w_q_is_first_third_of_c_attn():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
    (l0, _) = find_attention_layers(model)
    torch.testing.assert_close(l0.w_q().reshape(64, 64), model.h[0].attn.c_attn.weight[:64])


def test_an_attention_module_wrapped_for_activation_checkpointing_is_found_once():
    """Wrappers hand attribute reads on to the module they wrap (checkpoint_wrapper; FSDP1 alike): the wrapper
    itself must not be located as a second attention layer."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32))
    assert hasattr(checkpoint_wrapper(model.h[0].attn), "c_attn")  # what made the wrapper look like attention
    for block in model.h:
        block.attn = checkpoint_wrapper(block.attn)
    layers = find_attention_layers(model)
    assert [layer.name for layer in layers] == [f"h.{i}.attn._checkpoint_wrapped_module" for i in range(2)]
    assert all(type(layer.module).__name__ == "CausalSelfAttention" for layer in layers)
