"""FlexAttention and varlen_attn on CUDA: the statistics' CUDA paths (FlexAttention's own row maximum; the
statistics kernel's document mask) against their PyTorch paths, and training through both with the watch.
Skipped without a GPU."""
import pytest
import torch
import torch.nn as nn

from instability_watch import InstabilityWatch, Probe, WatchConfig
from instability_watch.kernels.stats.flex import FlexCall, flex_stats
from instability_watch.kernels.stats.varlen import VARLEN_OP, VarlenCall, varlen_stats
from instability_watch.model.layer import AttentionLayer

from helpers import seeded

pytestmark = pytest.mark.gpu
fa = pytest.importorskip("torch.nn.attention.flex_attention")
DEV = "cuda"
DOCS = (300, 200, 524)


def _doc_ids(docs):
    return torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs)).to(DEV)


def _int_inputs(key, B, H, h_kv, N, D, dtype=torch.bfloat16):
    g = seeded(*key)
    q = torch.randint(-2, 3, (B, H, N, D), generator=g).to(DEV, dtype)
    k = torch.randint(-2, 3, (B, h_kv, N, D), generator=g).to(DEV, dtype)
    v = torch.randn(B, h_kv, N, D, generator=g).to(DEV, dtype)
    return q, k, v


def test_flex_statistics_through_the_op_equal_the_dense_path():
    """Integer q, k: every score exact, so the two paths' counts are equal and the maxima too."""
    N = sum(DOCS)
    q, k, v = _int_inputs(("flex_gpu",), 2, 8, 2, N, 64)
    doc = _doc_ids(DOCS)
    block = fa.create_block_mask(lambda b, h, qi, kv: (doc[qi] == doc[kv]) & (qi >= kv), None, None, N, N,
                                 device=DEV)
    bias = torch.linspace(-1, 1, 8, device=DEV)
    call = FlexCall(q, k, v, lambda s, b, h, qi, kv: s + bias[h], block.as_tuple(), 0.125, {}, rest=())
    probes = {}
    for through_op in (True, False):
        probes[through_op] = Probe(8, device=DEV)
        flex_stats(call, None, probes[through_op].counts, probes[through_op].values, eps=0.3, through_op=through_op)
    a, b = probes[True], probes[False]
    for name in ("rows", "multi_max_rows", "masked_rows", "nonfinite_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.multi_max_rows > 0).all()
    torch.testing.assert_close(a.max_score, b.max_score, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(VARLEN_OP is None, reason="this PyTorch has no varlen_attn")
def test_varlen_statistics_kernel_equals_the_pytorch_path():
    g = seeded("varlen_gpu")
    cu = torch.tensor([0, 300, 500, 1024, 1500], dtype=torch.int32, device=DEV)
    q = torch.randint(-2, 3, (1500, 8, 64), generator=g).to(DEV, torch.bfloat16)
    k = torch.randint(-2, 3, (1500, 2, 64), generator=g).to(DEV, torch.bfloat16)
    for window in ((-1, 0), (128, 0), (64, 16)):
        call = VarlenCall(q, k, k, cu, cu, window[1] == 0 and window[0] < 0, 0.125, window, False)
        tri, ref = Probe(8, device=DEV), Probe(8, device=DEV)
        varlen_stats(call, None, tri.counts, tri.values, eps=0.3, triton=True)
        varlen_stats(call, None, ref.counts, ref.values, eps=0.3, triton=False)
        assert torch.equal(tri.counts, ref.counts), window
        assert torch.equal(tri.values, ref.values), window


class FlexBlock(nn.Module):
    """Causal document attention through compiled FlexAttention, as torchtitan's flex wrapper."""

    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.h, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.flex = torch.compile(fa.flex_attention)

    def forward(self, x, block):
        B, N, C = x.shape
        q, k, v = (t.view(B, N, self.h, self.hd).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        return self.proj(self.flex(q, k, v, block_mask=block).transpose(1, 2).reshape(B, N, C))


def test_training_through_compiled_flex_is_observed_and_shadowed():
    torch.manual_seed(0)
    model = FlexBlock().to(DEV)
    layer = AttentionLayer(model, 4, lambda: model.qkv.weight[:256].view(4, 64, 256), name="flex")
    watch = InstabilityWatch(model, WatchConfig(probe_every=2, shadow_every=2, spectral_every=2, log_every=2,
                                                warmup_steps=100, strict=True), layers=[layer])
    N = sum(DOCS)
    doc = _doc_ids(DOCS)
    block = fa.create_block_mask(lambda b, h, qi, kv: (doc[qi] == doc[kv]) & (qi >= kv), None, None, N, N,
                                 device=DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(4):
        x = torch.randn(2, N, 256, device=DEV, generator=torch.Generator(DEV).manual_seed(step))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, block).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        watch.step(loss)
    (cov,) = watch.coverage()
    assert cov.unobserved_calls == {} and cov.observed_calls == 2 and cov.shadow_calls == 2
    watch.detach()


@pytest.mark.skipif(VARLEN_OP is None, reason="this PyTorch has no varlen_attn")
def test_our_kernels_over_documents_match_varlen_attn():
    """flash_attention_varlen on CUDA against PyTorch's varlen_attn (flash) on the same packed call: outputs and
    gradients within twice PyTorch's own BF16 error against float64."""
    from torch.nn.attention.varlen import varlen_attn

    from instability_watch import flash_attention_varlen

    g = seeded("varlen_kernels_gpu")
    cu = torch.tensor([0, 300, 500, 1024, 1500], dtype=torch.int32, device=DEV)
    q = torch.randn(1500, 8, 64, generator=g).to(DEV, torch.bfloat16)
    k, v, do = (torch.randn(1500, 2 if i < 2 else 8, 64, generator=g).to(DEV, torch.bfloat16) for i in range(3))

    def run(fn, dtype):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
        o = fn(qq, kk, vv)
        o.backward(do.to(dtype))
        return [t.float() for t in (o, qq.grad, kk.grad, vv.grad)]

    ours = run(lambda a, b, c: flash_attention_varlen(a, b, c, cu, causal=True), torch.bfloat16)
    import inspect

    if "enable_gqa" in inspect.signature(varlen_attn).parameters:  # torch >= 2.12
        theirs = run(lambda a, b, c: varlen_attn(a, b, c, cu, cu, 524, 524, window_size=(-1, 0), enable_gqa=True),
                     torch.bfloat16)
    else:  # torch 2.11: no GQA (keys and values repeated per query head)
        theirs = run(lambda a, b, c: varlen_attn(a, b.repeat_interleave(4, 1), c.repeat_interleave(4, 1), cu, cu,
                                                 524, 524, window_size=(-1, 0)), torch.bfloat16)
    exact = run(lambda a, b, c: flash_attention_varlen(a, b, c, cu, causal=True, backend="reference"),
                torch.float64)
    for a, b, e in zip(ours, theirs, exact):
        assert (a - e).abs().max() <= 2 * (b - e).abs().max() + 1e-3


def _listed_blocks(N: int, block: int = 128):
    """A BlockMask built from its blocks whose mask_mod (causal) says less than they do: each query block sees
    its own key block and the one before; and the dense mask compiled FlexAttention applies with it."""
    n = N // block
    qb = torch.arange(n)
    cols = [qb, (qb - 1).clamp(min=0)] + [qb] * (n - 2)
    idx = torch.stack(cols, -1).view(1, 1, n, n).int().to(DEV)
    num = torch.where(qb > 0, 2, 1).int().view(1, 1, n).to(DEV)
    mask = fa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=block, mask_mod=lambda b, h, qi, kv: qi >= kv,
                                       seq_lengths=(N, N))
    i = torch.arange(N, device=DEV)
    return mask, (i[:, None] >= i[None, :]) & (i[:, None] // block - i[None, :] // block <= 1)


@pytest.mark.parametrize("kind", ["causal", "sliding", "document", "listed blocks"])
def test_switched_compiled_flex_calls_run_on_our_kernels_within_twice_flex_error(kind):
    """A switched head's compiled FlexAttention calls (causal, sliding window, documents, a mask built from its
    blocks) on our kernels: outputs and gradients within twice FlexAttention's own BF16 error against float64
    (our reference kernels in float64 with the same mask), and counted as kernel calls with nothing "not
    applied"."""
    from instability_watch import flash_attention

    N, H, D = sum(DOCS), 8, 64
    doc = _doc_ids(DOCS)
    masks = {"causal": lambda b, h, qi, kv: qi >= kv,
             "sliding": lambda b, h, qi, kv: (qi >= kv) & (qi - kv < 256),
             "document": lambda b, h, qi, kv: (doc[qi] == doc[kv]) & (qi >= kv)}
    if kind in masks:
        block = fa.create_block_mask(masks[kind], None, None, N, N, device=DEV)
        keep = fa.create_mask(masks[kind], None, None, N, N, device=DEV)
    else:
        block, keep = _listed_blocks(N)
    g = seeded("flex_switch_gpu", kind)
    q = torch.randn(2, H, N, D, generator=g).to(DEV, torch.bfloat16)
    k, v = (torch.randn(2, 2, N, D, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    do = torch.randn(2, H, N, D, generator=g).to(DEV, torch.bfloat16)
    flex = torch.compile(fa.flex_attention)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.anchor = nn.Parameter(torch.zeros(1, device=DEV))  # where the watch finds the model's device

        def forward(self, a, b, c):
            return flex(a, b, c, block_mask=block, enable_gqa=True)

    def run(fn, dtype):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
        o = fn(qq, kk, vv)
        o.backward(do.to(dtype))
        return [t.float() for t in (o, qq.grad, kk.grad, vv.grad)]

    layer = Layer()
    theirs = run(layer, torch.bfloat16)
    watch = InstabilityWatch(layer, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                warmup_steps=100, strict=True),
                             layers=[AttentionLayer(layer, H, lambda: torch.zeros(H, D, D, device=DEV), name="f")])
    watch.switch(0, 3)
    ours = run(layer, torch.bfloat16)
    watch.step(ours[0].sum())
    (cov,) = watch.coverage()
    assert cov.kernel_calls == 1 and cov.not_applied == {}
    watch.detach()
    exact = run(lambda a, b, c: flash_attention(a, b, c, attn_mask=keep, backend="reference"), torch.float64)
    for a, b, e in zip(ours, theirs, exact):
        assert (a - e).abs().max() <= 2 * (b - e).abs().max() + 1e-3


def test_pytorch_transformer_encoder_on_the_gpu_is_observed_and_a_switched_layer_runs_our_kernels():
    """nn.MultiheadAttention's SDPA call under BF16 autocast on CUDA: every call observed and shadowed (training
    bitwise the unwatched model's until the switch), then layer 1 on our Triton kernels."""
    def build():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(256, 4, 512, batch_first=True, dropout=0.0, device=DEV)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    model, plain = build(), build()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=1, log_every=2, warmup_steps=0))
    x = torch.randn(4, 512, 256, device=DEV)
    mask = nn.Transformer.generate_square_subsequent_mask(512, device=DEV)
    for step in range(4):
        if step == 2:
            watch.switch(1, 3)
        losses = []
        for m in (model, plain):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(x, mask=mask, is_causal=True).float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        if step < 2:
            assert torch.equal(losses[0], losses[1]), step
        else:
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=1e-4)
        watch.step(losses[0])
    cov = watch.coverage()
    assert all(c.observed_calls == 4 and not c.unobserved_calls and c.shadow_calls == 4 for c in cov), cov
    assert cov[1].kernel_calls == 2 and not cov[1].not_applied and cov[0].kernel_calls == 0
    watch.detach()
