"""FlexAttention calls: statistics on the call's own scores (score_mod, block mask), per packed document, and a
Hugging Face model built with attn_implementation="flex_attention" watched with no call unobserved.

On the CPU, FlexAttention runs the forward only (no backward): the calls here are train-mode forwards under
no_grad, as issue 43 plans; training through flex is a GPU matter."""
import warnings

import pytest
import torch

from instability_watch import Probe
from instability_watch.kernels.stats.flex import FlexCall, flex_stats

from helpers import seeded

fa = pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

EPS = 1e-3
DOCS = (50, 40, 38)  # three documents packed into one row of 128 tokens


def _packed(B=2, H=4, h_kv=2, D=16):
    """Integer-valued q and k (every score exact in float32 and float64, ties exact), a document-causal
    block mask over DOCS and a score_mod that adds a per-head bias and soft-caps."""
    g = seeded("flex_packed")
    N = sum(DOCS)
    q = torch.randint(-2, 3, (B, H, N, D), generator=g).float()
    k = torch.randint(-2, 3, (B, h_kv, N, D), generator=g).float()
    v = torch.randn(B, h_kv, N, D, generator=g)
    doc = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))
    bias = torch.tensor([0.0, 0.5, -1.0, 2.0])

    def mask_mod(b, h, qi, kv):
        return (doc[qi] == doc[kv]) & (qi >= kv)

    def score_mod(s, b, h, qi, kv):
        return 8.0 * torch.tanh((s + bias[h]) / 8.0)

    block = fa.create_block_mask(mask_mod, None, None, N, N, device="cpu", BLOCK_SIZE=32)
    return q, k, v, score_mod, block, bias


def _reference(q, k, bias, scale):
    """Per head: rows, multi-max rows, max score, document by document in float64."""
    H, g = q.shape[1], q.shape[1] // k.shape[1]
    rows = torch.zeros(H, dtype=torch.int64)
    multi = torch.zeros(H, dtype=torch.int64)
    top = torch.full((H,), float("-inf"), dtype=torch.float64)
    start = 0
    for n in DOCS:
        qd = q[:, :, start:start + n].double()
        kd = k[:, :, start:start + n].double().repeat_interleave(g, dim=1)
        s = (qd @ kd.transpose(-1, -2)) * scale
        s = 8.0 * torch.tanh((s + bias.double().view(1, -1, 1, 1)) / 8.0)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        t1, t2 = s.topk(2, dim=-1).values.unbind(-1) if n > 1 else (s[..., 0], torch.full_like(s[..., 0], -1e300))
        rows += torch.full((H,), q.shape[0] * n)
        multi += (t2 >= t1 - EPS).sum(dim=(0, 2))
        top = torch.maximum(top, t1.amax(dim=(0, 2)))
        start += n
    return rows, multi, top


@pytest.mark.parametrize("through_op", [False, True])
def test_flex_statistics_per_document_equal_a_float64_reference(through_op):
    q, k, v, score_mod, block, bias = _packed()
    scale = 0.25
    probe = Probe(q.shape[1])
    call = FlexCall(q, k, v, score_mod, block.as_tuple(), scale, {}, rest=())
    assert call.unobservable(4) is None
    flex_stats(call, None, probe.counts, probe.values, eps=EPS, through_op=through_op)
    rows, multi, top = _reference(q, k, bias, scale)
    assert torch.equal(probe.rows, rows)
    assert torch.equal(probe.multi_max_rows, multi)
    assert multi.min() > 0 and (multi < rows).all()  # the check can fail both ways
    torch.testing.assert_close(probe.max_score.double(), top, rtol=1e-6, atol=1e-6)
    assert probe.masked_rows.sum() == 0 and probe.nonfinite_rows.sum() == 0


def test_flex_statistics_count_rows_without_keys_and_nonfinite_output():
    q, k, v, score_mod, _, _ = _packed(B=1)
    N = q.shape[2]
    block = fa.create_block_mask(lambda b, h, qi, kv: (qi >= 10) & (qi >= kv), None, None, N, N, device="cpu",
                                 BLOCK_SIZE=32)
    o = torch.zeros(1, 4, N, 16)
    o[0, 1, 20, 3] = float("nan")
    for through_op in (False, True):
        probe = Probe(4)
        flex_stats(FlexCall(q, k, v, score_mod, block.as_tuple(), 0.25, {}, rest=()), o, probe.counts,
                   probe.values, eps=EPS, through_op=through_op)
        assert probe.masked_rows.tolist() == [10] * 4, through_op  # rows 0..9 see no key
        assert probe.rows.tolist() == [N - 10] * 4
        assert probe.nonfinite_rows.tolist() == [0, 1, 0, 0]


# ----------------------------------------------------------------------------- Hugging Face, flex vs sdpa


def _llama(impl):
    t = pytest.importorskip("transformers")
    cfg = t.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                        intermediate_size=128, vocab_size=64, max_position_embeddings=256, bos_token_id=0,
                        eos_token_id=0, attn_implementation=impl)
    torch.manual_seed(0)
    return t.LlamaForCausalLM(cfg)


def _probe_step(model, batch):
    """One train-mode forward under no_grad on a probe step; the metrics the watch read back."""
    from instability_watch import InstabilityWatch, WatchConfig

    metrics = []
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                warmup_steps=100, strict=True),
                             listeners=[lambda r: metrics.extend(r.metrics)])
    model.train()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(**batch).logits.float().pow(2).mean()
    watch.step(loss)
    coverage = watch.coverage()
    watch.detach()
    return metrics, coverage


def _hf_batch(key: str, packed: bool) -> dict:
    """Three documents of 40, 30 and 26 tokens in one row as DataCollatorWithFlattening packs them (position_ids
    restarting per document, the packing kwargs), or unpacked: the same tokens as a batch of two rows."""
    g = seeded(key, packed)
    lengths = (40, 30, 26)
    ids = torch.randint(1, 64, (1, sum(lengths)), generator=g)
    if not packed:
        return dict(input_ids=ids.expand(2, -1).clone())
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, 40, 70, 96], dtype=torch.int32)
    return dict(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=40,
                max_length_k=40, use_cache=False)


@pytest.mark.parametrize("packed", [False, True])
def test_hf_llama_flex_attention_is_watched_like_sdpa(packed):
    """The same weights through sdpa and through flex_attention: 0 calls unobserved, the same per-head
    statistics. Packed: three documents in one row as DataCollatorWithFlattening packs them (position_ids
    restart per document; the packing kwargs make the document mask on sdpa and flex alike)."""
    batch = _hf_batch("hf_flex", packed)
    results = {}
    for impl in ("sdpa", "flex_attention"):
        metrics, coverage = _probe_step(_llama(impl), batch)
        assert [c.unobserved_calls for c in coverage] == [{}, {}], impl
        assert all(c.observed_calls == 1 for c in coverage), impl
        results[impl] = metrics
    sdpa, flex = results["sdpa"], results["flex_attention"]
    assert len(sdpa) == len(flex) == 1
    for name in ("rows", "multi_max_rows", "masked_rows"):
        assert torch.equal(torch.as_tensor(flex[0][name]), torch.as_tensor(sdpa[0][name])), name
    torch.testing.assert_close(torch.as_tensor(flex[0]["max_score"]), torch.as_tensor(sdpa[0]["max_score"]),
                               rtol=1e-5, atol=1e-5)


def test_packed_batch_statistics_equal_the_documents_one_by_one():
    """A packed row (DataCollatorWithFlattening's position_ids and packing kwargs) on sdpa and on flex: the
    per-head statistics of the documents run one by one; without the packing kwargs they differ (the
    documents then see each other, as HF builds no document mask from position_ids alone)."""
    g = seeded("hf_packed_docs")
    lengths = (40, 30, 26)
    docs = [torch.randint(1, 64, (1, n), generator=g) for n in lengths]
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, 40, 70, 96], dtype=torch.int32)
    # use_cache=False as in training: with a cache HF looks for no packed documents in position_ids
    packed = dict(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=40,
                  max_length_k=40, use_cache=False)
    one_by_one = [_probe_step(_llama("sdpa"), dict(input_ids=d))[0][0] for d in docs]
    rows = sum(torch.as_tensor(m["rows"]) for m in one_by_one)
    multi = sum(torch.as_tensor(m["multi_max_rows"]) for m in one_by_one)
    top = torch.stack([torch.as_tensor(m["max_score"]) for m in one_by_one]).amax(dim=0)
    for impl in ("sdpa", "flex_attention"):
        m = _probe_step(_llama(impl), packed)[0][0]
        assert torch.equal(torch.as_tensor(m["rows"]), rows), impl
        assert torch.equal(torch.as_tensor(m["multi_max_rows"]), multi), impl
        torch.testing.assert_close(torch.as_tensor(m["max_score"]), top, rtol=1e-5, atol=1e-5, msg=impl)
    leaky = _probe_step(_llama("sdpa"), dict(input_ids=ids, position_ids=pos, use_cache=True))[0][0]
    assert not torch.allclose(torch.as_tensor(leaky["max_score"]), top, rtol=1e-5, atol=1e-5)


def test_flex_shadow_equals_a_float64_reference():
    """The shadow pass of a FlexAttention call (O_hp: the call again in float32, through FlexAttention's
    op) against delta_hp = sum_j P_ij (dO_i . v_j) in float64 on the call's scores, document by document."""
    from instability_watch.observe.sdpa import FlexShadowTap
    from instability_watch.kernels.stats.flex import flex_shadow_forward

    q, k, v, score_mod, block, bias = _packed()
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    scale = 0.25
    call = FlexCall(q, k, v, score_mod, block.as_tuple(), scale, {}, rest=())
    with torch.no_grad():
        o = fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block, scale=scale, enable_gqa=True)
    o_hp, live = flex_shadow_forward(call)
    assert live.all()
    probe = Probe(4)
    leaf = o.detach().requires_grad_(True)
    do = torch.randn(o.shape, generator=seeded("flex_shadow_do")).to(o.dtype)
    FlexShadowTap.apply(leaf, o_hp, live, probe.counts, probe.values, None).backward(do)
    assert torch.equal(leaf.grad, do)  # the gradient passes unchanged
    # float64 reference, document by document
    H, g = q.shape[1], q.shape[1] // k.shape[1]
    err = torch.zeros(q.shape[0], H, 0, dtype=torch.float64)
    start = 0
    for n in DOCS:
        sl = slice(start, start + n)
        qd, kd, vd = q[:, :, sl].double(), k[:, :, sl].double().repeat_interleave(g, 1), v[:, :, sl].double()
        s = 8.0 * torch.tanh(((qd @ kd.transpose(-1, -2)) * scale + bias.double().view(1, -1, 1, 1)) / 8.0)
        p = torch.softmax(s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
        dod = do[:, :, sl].double()
        d_hp = (p * (dod @ vd.repeat_interleave(g, 1).transpose(-1, -2))).sum(-1)
        d_lp = (dod * o[:, :, sl].double()).sum(-1)
        err = torch.cat([err, d_lp - d_hp], dim=2)
        start += n
    assert probe.shadow_rows.tolist() == [q.shape[0] * sum(DOCS)] * 4
    assert probe.delta_err_pos.tolist() == (err > 0).sum(dim=(0, 2)).tolist()
    torch.testing.assert_close(probe.delta_err_abs.double(), err.abs().sum(dim=(0, 2)), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(probe.delta_err_sum.double(), err.sum(dim=(0, 2)), rtol=1e-3, atol=1e-3)
    assert probe.shadow_calls.tolist() == [1] * 4


class _FlexBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(64, 192, bias=False)

    def forward(self, x, block):
        B, N, C = x.shape
        q, k, v = (t.view(B, N, 4, 16).transpose(1, 2) for t in self.qkv(x).split(64, dim=2))
        o = fa.flex_attention(q, k, v, block_mask=block, score_mod=lambda s, b, h, qi, kv: s * 0.5)
        return o.transpose(1, 2).reshape(B, N, C)


class _FlexModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_FlexBlock(), _FlexBlock()])

    def forward(self, x, block):
        for b in self.blocks:
            x = x + b(x, block)
        return x


def test_flex_calls_are_observed_once_eager_or_compiled_fullgraph():
    """An eager flex_attention call is itself traced (Dynamo's eager backend) and the traced graph calls the op
    again as it runs: each call must count once. The same model compiled with fullgraph=True (no graph break at
    attention) gives the same statistics."""
    from instability_watch import InstabilityWatch, WatchConfig
    from instability_watch.model.layer import AttentionLayer

    results = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = _FlexModel()
        layers = [AttentionLayer(b, 4, (lambda b=b: b.qkv.weight[:64].view(4, 16, 64)), name=f"b{i}")
                  for i, b in enumerate(model.blocks)]
        metrics = []
        watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                    warmup_steps=100, strict=True),
                                 layers=layers, listeners=[lambda r: metrics.extend(r.metrics)])
        forward = torch.compile(model, fullgraph=True) if mode == "compiled" else model
        block = fa.create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, 128, 128, device="cpu")
        x = torch.randn(2, 128, 64, generator=seeded("flex_once"))
        with torch.no_grad():
            y = forward(x, block)
        watch.step(y.pow(2).mean())
        assert [(c.observed_calls, c.unobserved_calls) for c in watch.coverage()] == [(1, {}), (1, {})], mode
        results[mode] = metrics[0]
        watch.detach()
    assert (torch.as_tensor(results["eager"]["rows"]) == 2 * 128).all()  # each of the 2 x 128 rows once
    for name in ("rows", "multi_max_rows", "masked_rows"):
        assert torch.equal(torch.as_tensor(results["eager"][name]), torch.as_tensor(results["compiled"][name])), name
    torch.testing.assert_close(torch.as_tensor(results["eager"]["max_score"]),
                               torch.as_tensor(results["compiled"]["max_score"]), rtol=1e-5, atol=1e-6)


def test_hf_compiled_flex_is_compiled_once_for_every_layer():
    """Hugging Face compiles its FlexAttention call and calls it from eager layer forwards. The watch's code in
    that call reads nothing of its layer's own, so the layers share one graph per kind of step: with 12 layers
    (more than Dynamo's recompile limit of 8) nothing falls back to eager FlexAttention, every layer is observed
    on every probe step, and the outputs are the unwatched model's."""
    from torch._dynamo.utils import counters

    from instability_watch import InstabilityWatch, WatchConfig

    t = pytest.importorskip("transformers")
    cfg = t.LlamaConfig(num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                        intermediate_size=128, vocab_size=64, max_position_embeddings=256,
                        attn_implementation="flex_attention")
    torch.manual_seed(0)
    model = t.LlamaForCausalLM(cfg)
    ids = torch.randint(1, 64, (2, 96), generator=seeded("hf_flex_once"))
    model.train()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(input_ids=ids).logits
        before = counters["stats"]["unique_graphs"]
        watch = InstabilityWatch(model, WatchConfig(probe_every=2, shadow_every=0, spectral_every=0, log_every=2,
                                                    warmup_steps=100, strict=True))
        for _ in range(6):
            got = model(input_ids=ids).logits
            watch.step(got.float().pow(2).mean())
    assert counters["stats"]["unique_graphs"] - before <= 3  # probe, plain (and the first call's)
    assert torch.equal(got, want)
    assert [c.observed_calls for c in watch.coverage()] == [3] * 12
    watch.detach()


def test_hf_compiled_flex_is_not_compiled_again_for_each_new_watch():
    """A new watch attached to a model after the last one detached (the benchmark's kind rounds, a fit per trial
    in one process) takes the key the last one gave back, so Hugging Face's compiled FlexAttention reuses the graphs
    compiled for it: 9 watches one after another (past Dynamo's recompile limit of 8, which would send
    FlexAttention to its unfused eager path) compile nothing after the first, and each observes every call."""
    from torch._dynamo.utils import counters

    from instability_watch import InstabilityWatch, WatchConfig

    torch._dynamo.reset()  # this test counts flex_attention's graphs from none
    model = _llama("flex_attention")
    ids = torch.randint(1, 64, (1, 96), generator=seeded("hf_flex_new_watches"))
    model.train()
    compiled = []
    for _ in range(9):
        before = counters["stats"]["unique_graphs"]
        watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=0, log_every=1,
                                                    warmup_steps=100, strict=True))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):
                watch.step(model(input_ids=ids).logits.float().pow(2).mean())
        watch.flush()
        assert [(c.observed_calls, c.unobserved_calls) for c in watch.coverage()] == [(2, {})] * 2
        watch.detach()
        compiled.append(counters["stats"]["unique_graphs"] - before)
    assert compiled[0] >= 1 and compiled[1:] == [0] * 8, compiled


@pytest.mark.parametrize("packed", [False, True])
def test_flex_statistics_through_sdpas_passes_with_the_mask_equal_the_default(packed, monkeypatch):
    """flex.VIA_MASK (SDPA's passes over the call's inputs and its mask from mask_mod, for calls whose score_mod
    leaves the scores as they are, as HF's does): the same per-head statistics as the default passes and as
    sdpa, 0 calls unobserved."""
    import instability_watch.kernels.stats.flex as flex

    batch = _hf_batch("hf_flex_via_mask", packed)
    calls = []
    real = flex.keep_mask
    monkeypatch.setattr(flex, "keep_mask", lambda call: calls.append(1) or real(call))
    results = {}
    for via_mask in (False, True):
        monkeypatch.setattr(flex, "VIA_MASK", via_mask)
        metrics, coverage = _probe_step(_llama("flex_attention"), batch)
        assert [c.unobserved_calls for c in coverage] == [{}, {}] and all(c.observed_calls == 1 for c in coverage)
        results[via_mask] = metrics[0]
    assert len(calls) == 2  # the mask path ran, once a layer
    for name in ("rows", "multi_max_rows", "masked_rows", "nonfinite_rows"):
        assert torch.equal(torch.as_tensor(results[True][name]), torch.as_tensor(results[False][name])), name
    via, default = (torch.as_tensor(results[v]["max_score"]) for v in (True, False))
    torch.testing.assert_close(via, default, rtol=1e-6, atol=1e-6)


def test_flex_shadow_through_sdpas_pass_with_the_mask_equals_the_default(monkeypatch):
    """The shadow of a document-causal FlexAttention call with no score_mod: SDPA's shadow pass over its mask
    (flex.VIA_MASK) against the default (the call again in float32): the same rows, signs and sums."""
    import instability_watch.kernels.stats.flex as flex
    from instability_watch.kernels.stats.flex import flex_shadow_forward
    from instability_watch.observe.sdpa import FlexShadowTap, ShadowTap

    q, k, v, _, block, _ = _packed()
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    scale = 0.25
    call = FlexCall(q, k, v, lambda s, b, h, qi, kv: s, block.as_tuple(), scale, {}, rest=())
    with torch.no_grad():
        o = fa.flex_attention(q, k, v, block_mask=block, scale=scale, enable_gqa=True)
    do = torch.randn(o.shape, generator=seeded("flex_shadow_via_mask")).to(o.dtype)
    default, via = Probe(4), Probe(4)
    o_hp, live = flex_shadow_forward(call)
    FlexShadowTap.apply(o.detach().requires_grad_(True), o_hp, live, default.counts, default.values, None).backward(do)
    assert flex.VIA_MASK  # the default
    qm, km, vm, keep, sc = flex.mask_inputs(call)
    assert keep.shape[-2:] == (sum(DOCS), sum(DOCS)) and sc == scale
    monkeypatch.setattr(flex, "VIA_MASK_MAX_BYTES", keep.numel() - 1)
    assert flex.mask_inputs(call) is None  # a mask over the limit: FlexAttention's passes
    ShadowTap.apply(o.detach().requires_grad_(True), qm, km, vm, keep, via.counts, via.values, False, sc,
                    None).backward(do)
    assert via.shadow_rows.tolist() == default.shadow_rows.tolist() == [q.shape[0] * sum(DOCS)] * 4
    assert via.delta_err_pos.tolist() == default.delta_err_pos.tolist()
    torch.testing.assert_close(via.delta_err_sum, default.delta_err_sum, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(via.delta_err_abs, default.delta_err_abs, rtol=1e-4, atol=1e-5)


def _local_blocks(N, block=32, full=False):
    """A BlockMask built from its blocks (``BlockMask.from_kv_blocks``), as hand-made masks are: each query block
    sees its own key block and the one before, causally, and nothing else; its ``mask_mod`` is causal alone, so
    the blocks say more than it. With ``full``, the blocks before the diagonal are listed as full blocks (seen
    whole, ``mask_mod`` not applied). Returns the block mask and its dense (N, N) mask."""
    n_blocks = -(-N // block)
    qb = torch.arange(n_blocks)
    diag, prev = qb, (qb - 1).clamp(min=0)

    def listed(*cols):  # (1, 1, n_blocks, n_blocks): the listed blocks first, then anything (past the count)
        return torch.stack([*cols, *[diag] * (n_blocks - len(cols))], -1).view(1, 1, n_blocks, n_blocks).int()

    if full:
        num = torch.ones(1, 1, n_blocks, dtype=torch.int32)
        idx = listed(diag)
        fnum = (qb > 0).int().view(1, 1, n_blocks)
        fidx = listed(prev)
        mask = fa.BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=block, mask_mod=causal_mod,
                                           seq_lengths=(N, N))
    else:
        num = torch.where(qb > 0, 2, 1).int().view(1, 1, n_blocks)
        idx = listed(diag, prev)
        mask = fa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=block, mask_mod=causal_mod, seq_lengths=(N, N))
    i = torch.arange(N)
    dense = (i[:, None] >= i[None, :]) & (i[:, None] // block - i[None, :] // block <= 1)
    return mask, dense


def causal_mod(b, h, qi, kv):
    return qi >= kv


@pytest.mark.parametrize("full", [False, True])
def test_flex_statistics_keep_to_a_block_masks_own_blocks(full):
    """A block the BlockMask does not list is not seen, whatever its mask_mod says, as compiled FlexAttention
    computes it (PyTorch's eager FlexAttention applies mask_mod alone: checked here too, so a PyTorch that changes
    either is noticed): the statistics equal a float64 reference over the blocks' dense mask, and differ from
    mask_mod's alone."""
    g = seeded("flex_blocks", full)
    B, H, N, D = 2, 4, 128, 16
    q = torch.randint(-2, 3, (B, H, N, D), generator=g).float()
    k = torch.randint(-2, 3, (B, H, N, D), generator=g).float()
    v = torch.randn(B, H, N, D, generator=g)
    block, dense = _local_blocks(N, full=full)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    scores = (q.double() @ k.double().transpose(-1, -2)) * 0.25

    def attend(keep):
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v.double()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._dynamo.reset()  # earlier tests' compiles may have reached the recompile limit (then: eager)
        compiled = torch.compile(fa.flex_attention)(q, k, v, block_mask=block, scale=0.25)
        eager = fa.flex_attention(q, k, v, block_mask=block, scale=0.25)
    torch.testing.assert_close(compiled.double(), attend(dense), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(eager.double(), attend(causal), rtol=1e-4, atol=1e-4)

    def multi_max(keep):
        t1, t2 = scores.masked_fill(~keep, float("-inf")).topk(2, dim=-1).values.unbind(-1)
        return ((t2 >= t1 - EPS) & torch.isfinite(t2)).sum(dim=(0, 2)), t1.amax(dim=(0, 2))

    multi, top = multi_max(dense)
    assert not torch.equal(multi_max(causal)[0], multi)  # the blocks matter to the statistic
    probe = Probe(H)
    flex_stats(FlexCall(q, k, v, fa._identity, block.as_tuple(), 0.25, {}, rest=()), None, probe.counts,
               probe.values, eps=EPS, through_op=False)
    assert torch.equal(probe.multi_max_rows, multi)
    assert probe.rows.tolist() == [B * N] * H
    torch.testing.assert_close(probe.max_score.double(), top, rtol=1e-6, atol=1e-6)
