"""Switching a FlexAttention layer: after ``watch.switch`` its flex calls run on our kernels with the mask its
``mask_mod`` gives (causal, sliding window, packed documents), as eager and compiled calls; a ``score_mod`` that
changes the scores is refused by name and the call stays on FlexAttention, untouched.

On the CPU FlexAttention refuses a backward, so the model tests are train-mode forwards under no_grad; the
gradients of a switched call (ours, through the op's outputs, the log-sum-exp's included) are checked by calling
the op itself, which is where the watch meets every flex call."""
import math
import warnings

import numpy as np
import pytest
import torch

from instability_watch import InstabilityWatch, WatchConfig
from instability_watch.model.layer import AttentionLayer

from helpers import seeded

fa = pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

H, H_KV, D, E = 4, 2, 16, 64
DOCS = (40, 30, 26)
N = sum(DOCS)
DOC = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))
WINDOW = 12


def causal(b, h, qi, kv):
    return qi >= kv


def sliding(b, h, qi, kv):
    return (qi >= kv) & (qi - kv < WINDOW)


def document(b, h, qi, kv):
    return (DOC[qi] == DOC[kv]) & (qi >= kv)


MASKS = {"causal": causal, "sliding": sliding, "document": document}


def soft_cap(score, b, h, qi, kv):
    return 20.0 * torch.tanh(score / 20.0)


class FlexLayer(torch.nn.Module):
    """Grouped-query attention through flex_attention, as torchtitan's and gpt-fast's layers call it."""

    def __init__(self):
        super().__init__()
        self.wq = torch.nn.Linear(E, H * D, bias=False)
        self.wkv = torch.nn.Linear(E, 2 * H_KV * D, bias=False)

    def forward(self, x, block, score_mod=None, lse=False):
        B, n, _ = x.shape
        q = self.wq(x).view(B, n, H, D).transpose(1, 2)
        k, v = self.wkv(x).view(B, n, 2, H_KV, D).permute(2, 0, 3, 1, 4)
        return fa.flex_attention(q, k, v, block_mask=block, score_mod=score_mod, enable_gqa=True,
                                 return_aux=fa.AuxRequest(lse=True) if lse else None)


def _watched(model, layer_module):
    layer = AttentionLayer(layer_module, H, lambda: layer_module.wq.weight.view(H, D, E), name="flex")
    return InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                               warmup_steps=100, strict=True), layers=[layer])


def _float64_output(model, x, mask):
    """The layer's attention in float64 from its BF16 projections (B, H, N, D)."""
    with torch.no_grad():
        B, n, _ = x.shape
        q = model.wq(x).view(B, n, H, D).transpose(1, 2).double()
        k, v = (t.double().repeat_interleave(H // H_KV, dim=1)
                for t in model.wkv(x).view(B, n, 2, H_KV, D).permute(2, 0, 3, 1, 4))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        keep = fa.create_mask(mask, None, None, n, n, device="cpu")
        return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("kind", list(MASKS))
def test_a_switched_layer_runs_flex_calls_on_our_kernels(kind):
    """Causal, sliding-window and document masks: the switched call is counted as a kernel call with nothing
    "not applied"; its error against float64 is within twice FlexAttention's own BF16 error; its log-sum-exp
    is FlexAttention's (natural log, from the op's log2 units)."""
    torch.manual_seed(0)
    model = FlexLayer().to(torch.bfloat16)
    x = torch.randn(2, N, E, generator=seeded("flex_switch", kind)).to(torch.bfloat16)
    block = fa.create_block_mask(MASKS[kind], None, None, N, N, device="cpu", BLOCK_SIZE=32)
    exact = _float64_output(model, x, MASKS[kind])
    with torch.no_grad():
        theirs, aux = model(x, block, lse=True)
    watch = _watched(model, model)
    watch.switch(0, 1)
    model.train()
    with torch.no_grad():
        ours, our_aux = model(x, block, lse=True)
    watch.step(ours.float().pow(2).mean())
    (cov,) = watch.coverage()
    assert cov.kernel_calls == 1 and cov.not_applied == {} and cov.unobserved_calls == {}
    assert cov.observed_calls == 1
    err_ours = (ours.double() - exact).abs().max().item()
    err_theirs = (theirs.double() - exact).abs().max().item()
    assert err_ours <= 2 * err_theirs + 1e-6, (err_ours, err_theirs)
    assert not torch.equal(ours, theirs)  # it did run elsewhere
    torch.testing.assert_close(our_aux.lse, aux.lse, rtol=0, atol=2e-2)
    watch.detach()


def test_a_score_mod_is_refused_by_name_and_the_call_left_alone():
    """A soft-capping score_mod: the call stays on FlexAttention (bitwise the unwatched output), "not applied"
    names the function, and the switch_not_applied event says where the calls stay."""
    torch.manual_seed(0)
    model = FlexLayer().to(torch.bfloat16)
    x = torch.randn(2, N, E, generator=seeded("flex_refuse")).to(torch.bfloat16)
    block = fa.create_block_mask(causal, None, None, N, N, device="cpu")
    with torch.no_grad():
        want = model(x, block, soft_cap)
    watch = _watched(model, model)
    watch.switch(0, 2)
    model.train()
    with torch.no_grad():
        got = model(x, block, soft_cap)
    watch.step(got.float().pow(2).mean())
    assert torch.equal(got, want)
    (cov,) = watch.coverage()
    assert cov.kernel_calls == 0 and cov.observed_calls == 1
    (reason,) = cov.not_applied
    assert "'soft_cap'" in reason and "stay on FlexAttention" in reason
    events = [e for e in watch.events if e.kind == "switch_not_applied"]
    assert events and "'soft_cap'" in events[0].reason and "PyTorch's attention" in events[0].sentence()
    watch.detach()


def test_gradients_through_a_switched_flex_call_equal_float64_autograd():
    """The op's outputs from a switched call (our reference kernels in float64 on the CPU): gradients of a loss
    of the output and of the log-sum-exp (as attention sinks use it) equal autograd through float64 attention,
    document mask, grouped-query heads."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_op

    g = seeded("flex_switch_grad")
    q = torch.randn(2, H, N, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, H_KV, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    w_o = torch.randn(2, H, N, D, generator=g, dtype=torch.float64)
    w_l = torch.randn(2, H, N, generator=g, dtype=torch.float64)
    block = fa.create_block_mask(document, None, None, N, N, device="cpu", BLOCK_SIZE=32)
    scale = 0.3

    class Op(torch.nn.Module):
        def forward(self, q, k, v):
            opts = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False, "BACKEND": "AUTO"}
            return flex_op(q, k, v, fa._identity, block.as_tuple(), scale, opts)

    model = Op()
    layer = AttentionLayer(model, H, lambda: torch.zeros(H, D, E), name="op")
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                warmup_steps=100, strict=True), layers=[layer])
    watch.switch(0, 0)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse2, _ = model(*leaves)
    loss = (out * w_o).sum() + (lse2 * math.log(2.0) * w_l).sum()
    got = torch.autograd.grad(loss, leaves)
    (cov,) = watch.coverage()
    assert cov.kernel_calls == 0 and cov.not_applied == {}  # counted on probe steps only: this was not one
    watch.detach()

    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    s = (ref[0] @ ref[1].repeat_interleave(H // H_KV, 1).transpose(-1, -2)) * scale
    keep = fa.create_mask(document, None, None, N, N, device="cpu")
    s = s.masked_fill(~keep, float("-inf"))
    o = torch.softmax(s, dim=-1) @ ref[2].repeat_interleave(H // H_KV, 1)
    lse = torch.logsumexp(s, dim=-1)
    torch.testing.assert_close(out, o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse2 * math.log(2.0), lse, rtol=1e-10, atol=1e-10)
    want = torch.autograd.grad((o * w_o).sum() + (lse * w_l).sum(), ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_a_switched_flex_layer_compiled_fullgraph_equals_eager():
    """torch.compile(fullgraph=True) over a switched flex layer: no graph break, the same output as the
    eager switched call, and a kernel call counted."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = FlexLayer().to(torch.bfloat16)
    x = torch.randn(2, N, E, generator=seeded("flex_switch_compiled")).to(torch.bfloat16)
    block = fa.create_block_mask(document, None, None, N, N, device="cpu")
    watch = _watched(model, model)
    watch.switch(0, 3)
    model.train()
    with torch.no_grad():
        eager = model(x, block)
    watch.step(eager.float().pow(2).mean())
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        out = compiled(x, block)
    watch.step(out.float().pow(2).mean())
    torch.testing.assert_close(out, eager, rtol=0, atol=2 ** -7)
    (cov,) = watch.coverage()
    assert cov.kernel_calls == 2 and cov.not_applied == {}
    watch.detach()


def test_hf_llama_on_flex_attention_switches_like_sdpa():
    """An HF Llama with attn_implementation="flex_attention": its score_mod (every modification off) is the
    identity, so a switched layer's calls run on our kernels, and give the output of the same weights through
    sdpa switched the same way."""
    t = pytest.importorskip("transformers")
    outs = {}
    ids = torch.randint(1, 64, (2, 96), generator=seeded("hf_flex_switch"))
    for impl in ("sdpa", "flex_attention"):
        cfg = t.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                            intermediate_size=128, vocab_size=64, max_position_embeddings=256, bos_token_id=0,
                            eos_token_id=0, attn_implementation=impl)
        torch.manual_seed(0)
        model = t.LlamaForCausalLM(cfg).to(torch.bfloat16)
        watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                    warmup_steps=100, strict=True))
        watch.switch(1, 2)
        model.train()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits = model(input_ids=ids).logits
        watch.step(logits.float().pow(2).mean())
        cov = watch.coverage()
        assert [c.kernel_calls for c in cov] == [0, 1], impl
        assert all(c.not_applied == {} and c.unobserved_calls == {} for c in cov), impl
        outs[impl] = logits
        watch.detach()
    torch.testing.assert_close(outs["flex_attention"], outs["sdpa"], rtol=0, atol=2e-2)


def test_hf_llama_on_flex_under_autocast_switches():
    """Under BF16 autocast a float32 model's RoPE hands FlexAttention float32 q, k and a BF16 v; FlexAttention's
    autocast rule computes in BF16, and so does the switched call (nothing "not applied", BF16 out, close to the
    unswitched output)."""
    t = pytest.importorskip("transformers")
    cfg = t.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                        intermediate_size=128, vocab_size=64, max_position_embeddings=256, bos_token_id=0,
                        eos_token_id=0, attn_implementation="flex_attention")
    torch.manual_seed(0)
    model = t.LlamaForCausalLM(cfg)
    ids = torch.randint(1, 64, (2, 96), generator=seeded("hf_flex_autocast"))
    model.train()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(input_ids=ids).logits
        watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                    warmup_steps=100, strict=True))
        watch.switch(0, 1)
        got = model(input_ids=ids).logits
    watch.step(got.float().pow(2).mean())
    cov = watch.coverage()
    assert [c.kernel_calls for c in cov] == [1, 0]
    assert all(c.not_applied == {} for c in cov)
    assert not torch.equal(got, want)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=5e-2)
    watch.detach()


def test_a_switched_call_keeps_to_a_block_masks_own_blocks():
    """A BlockMask built from its blocks, its mask_mod causal alone: the switched call sees only the listed blocks,
    as compiled FlexAttention does; within twice compiled FlexAttention's BF16 error against float64."""
    from test_flex import _local_blocks

    torch.manual_seed(0)
    n = 128
    model = FlexLayer().to(torch.bfloat16)
    x = torch.randn(2, n, E, generator=seeded("flex_switch", "blocks")).to(torch.bfloat16)
    block, dense = _local_blocks(n)
    with torch.no_grad():
        B = x.shape[0]
        q = model.wq(x).view(B, n, H, D).transpose(1, 2)
        k, v = model.wkv(x).view(B, n, 2, H_KV, D).permute(2, 0, 3, 1, 4)
        s = (q.double() @ k.double().repeat_interleave(H // H_KV, 1).transpose(-1, -2)) / math.sqrt(D)
        exact = torch.softmax(s.masked_fill(~dense, float("-inf")), -1) @ v.double().repeat_interleave(H // H_KV, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch._dynamo.reset()  # earlier tests' compiles may have reached the recompile limit (then: eager)
            theirs = torch.compile(fa.flex_attention)(q, k, v, block_mask=block, enable_gqa=True)
    watch = _watched(model, model)
    watch.switch(0, 1)
    model.train()
    with torch.no_grad():
        ours = model(x, block)
    watch.step(ours.float().pow(2).mean())
    (cov,) = watch.coverage()
    assert cov.kernel_calls == 1 and cov.not_applied == {}
    err_ours = (ours.double() - exact).abs().max().item()
    err_theirs = (theirs.double() - exact).abs().max().item()
    assert err_ours <= 2 * err_theirs + 1e-6, (err_ours, err_theirs)
    watch.detach()


@pytest.mark.parametrize("impl", ["sdpa", "flex_attention"])
def test_a_switched_layers_evaluation_forwards_are_not_observed(impl, monkeypatch):
    """A switched layer's evaluation forwards (``model.eval()`` between training steps, the watch not told) still
    run on our kernels, but add nothing to the probe: on probe steps with two evaluation forwards beside each
    training forward, each layer counts only the training forwards' calls, and the probe's numbers are those of the
    training forwards alone (before, a routed layer's evaluation calls were observed too)."""
    t = pytest.importorskip("transformers")
    from instability_watch.observe import sdpa

    routed = []  # the calls our kernels served
    kernels = sdpa.flash_attention
    monkeypatch.setattr(sdpa, "flash_attention", lambda *a, **kw: routed.append(1) or kernels(*a, **kw))
    cfg = t.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                        intermediate_size=128, vocab_size=64, max_position_embeddings=256, bos_token_id=0,
                        eos_token_id=0, attn_implementation=impl)
    ids = torch.randint(1, 64, (1, 96), generator=torch.Generator().manual_seed(7))
    other = torch.randint(1, 64, (1, 96), generator=torch.Generator().manual_seed(8))

    def run(evaluations):
        torch.manual_seed(0)
        model = t.LlamaForCausalLM(cfg)
        metrics = []
        watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                    warmup_steps=100, strict=True),
                                 listeners=[lambda r: metrics.extend(r.metrics)])
        watch.switch(0, 0)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                model.train()
                loss = model(input_ids=ids).logits.float().pow(2).mean()
                model.eval()
                for _ in range(evaluations):
                    model(input_ids=other)
                model.train()
                watch.step(loss)
        watch.flush()
        cov = watch.coverage()
        watch.detach()
        return cov, metrics

    cov, metrics = run(2)
    assert [c.observed_calls for c in cov] == [3, 3]
    assert len(routed) == 9  # layer 0's 3 training and 6 evaluation calls, on our kernels
    plain_cov, plain_metrics = run(0)
    assert [c.observed_calls for c in plain_cov] == [3, 3]
    assert len(metrics) == len(plain_metrics) == 3
    for m, p in zip(metrics, plain_metrics):
        assert m.values.keys() == p.values.keys()
        for name in m.values:
            np.testing.assert_array_equal(m[name], p[name], err_msg=name)
