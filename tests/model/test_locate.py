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
    """Wrappers hand attribute reads on to the module they wrap (checkpoint_wrapper; FSDP1 and torch.compile
    alike): the wrapper itself must not be located as a second attention layer."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32))
    assert hasattr(checkpoint_wrapper(model.h[0].attn), "c_attn")  # what made the wrapper look like attention
    for block in model.h:
        block.attn = checkpoint_wrapper(block.attn)
    layers = find_attention_layers(model)
    assert [layer.name for layer in layers] == [f"h.{i}.attn._checkpoint_wrapped_module" for i in range(2)]
    assert all(type(layer.module).__name__ == "CausalSelfAttention" for layer in layers)


def test_an_attention_module_compiled_on_its_own_is_found_once():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32))
    for block in model.h:
        block.attn = torch.compile(block.attn)  # a wrapper (OptimizedModule); nothing compiles until a call
    assert [layer.name for layer in find_attention_layers(model)] == [f"h.{i}.attn._orig_mod" for i in range(2)]
    # a whole compiled model: its layers once, under _orig_mod
    whole = torch.compile(GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32)))
    assert [layer.name for layer in find_attention_layers(whole)] == [f"_orig_mod.h.{i}.attn" for i in range(2)]


def _gpt(n_layer=2):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=n_layer, n_head=4, n_embd=32))


def test_attention_compiled_block_by_block_is_found_in_each_block():
    """torch.compile per block (torchtitan's way), through a wrapper or in place: every block's layer is found once,
    under its block (that they are watched apart in the one graph Dynamo makes for them: test_compile.py)."""
    from instability_watch import InstabilityWatch

    model = _gpt()
    for i, block in enumerate(model.h):
        model.h[i] = torch.compile(block)
    assert InstabilityWatch(model).layer_names == ["h.0._orig_mod.attn", "h.1._orig_mod.attn"]
    model = _gpt()
    for block in model.h:
        block.compile()  # in place: the same, without a wrapper
    assert InstabilityWatch(model).layer_names == ["h.0.attn", "h.1.attn"]


def test_a_whole_compiled_model_or_one_compiled_region_is_watched():
    from instability_watch import InstabilityWatch

    assert InstabilityWatch(torch.compile(_gpt())).layer_names == ["_orig_mod.h.0.attn", "_orig_mod.h.1.attn"]
    model = _gpt()
    model.h = torch.compile(model.h)  # one region holding every layer: traced layer by layer
    assert len(InstabilityWatch(model).layer_names) == 2
    model = _gpt(3)  # two blocks compiled one by one, a third not
    model.h[0], model.h[1] = torch.compile(model.h[0]), torch.compile(model.h[1])
    assert InstabilityWatch(model).layer_names == ["h.0._orig_mod.attn", "h.1._orig_mod.attn", "h.2.attn"]


def test_compiled_regions_of_different_classes_each_compile_their_own_graph():
    """Two compiled modules of different classes, each holding layers, are two code objects: each layer's
    statistics land in its own probe (aot_eager: Dynamo and AOT autograd without inductor's compile time)."""
    from instability_watch import InstabilityWatch, WatchConfig

    class Tower(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.h = torch.nn.ModuleList(_gpt(n).h)

        def forward(self, x):
            for block in self.h:
                x = block(x)
            return x

    class OtherTower(Tower):
        pass

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.compile(Tower(2), backend="aot_eager")
            self.b = torch.compile(OtherTower(1), backend="aot_eager")

        def forward(self, x):
            return self.b(self.a(x))

    model = Two().train()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=1, spectral_every=1, log_every=2))
    assert len(watch.layer_names) == 3
    model(torch.randn(2, 16, 32, requires_grad=True)).sum().backward()  # the shadow backward runs too
    assert [int(p.counts[0].sum()) for p in watch.observation.bank.probes] == [2 * 16 * 4] * 3  # rows x heads
    watch.detach()
