"""torchtitan's attention, as torchtitan builds it: its Llama 3 debug model with the FlexAttention and the varlen
backends, on documents packed into each row (torchtitan's own document masks from restarting positions).

On the CPU torchtitan's flex backend runs (forward only) and its varlen backend reaches PyTorch's varlen op,
which has a CPU kernel here only from tests/varlen_cpu.py (attention per document in float32). Train-mode
forwards under no_grad and bf16 autocast, as torchtitan trains."""
import warnings

import numpy as np
import pytest
import torch

import varlen_cpu  # noqa: F401 - registers the CPU kernel of PyTorch's varlen op

pytest.importorskip("torch.nn.attention.flex_attention")
llama3 = pytest.importorskip("torchtitan.models.llama3")
pytestmark = pytest.mark.filterwarnings("ignore")

DOCS = (50, 40, 38)


def _probe_step(backend, state=None, switch=None):
    from instability_watch import InstabilityWatch, WatchConfig

    torch.manual_seed(0)
    model = llama3.model_registry("debugmodel", attn_backend=backend).model.build()
    if state is not None:
        model.load_state_dict(state)
    metrics = []
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=1, log_every=1,
                                                warmup_steps=100, strict=True),
                             listeners=[lambda r: metrics.extend(r.metrics)])
    if switch is not None:
        watch.switch(*switch)
    tokens = torch.randint(0, 2048, (2, sum(DOCS)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in DOCS]).repeat(2, 1)
    model.train()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
    watch.step(out.float().pow(2).mean())
    coverage = watch.coverage()
    heads = watch.head_counts
    watch.detach()
    if switch is not None:
        return out, coverage
    return model, metrics[0], coverage, heads


def test_torchtitan_flex_and_varlen_are_watched_document_by_document():
    model, flex, cov_flex, heads = _probe_step("flex")
    _, varlen, cov_varlen, _ = _probe_step("varlen", model.state_dict())
    assert heads == [16] * 6  # the torchtitan family found every GQAttention
    for cov in (cov_flex, cov_varlen):
        assert all(c.unobserved_calls == {} and c.observed_calls == 1 for c in cov)
    for m in (flex, varlen):
        assert (np.asarray(m["rows"]) == 2 * sum(DOCS)).all()
        assert np.isfinite(np.asarray(m["sigma_wq"])).all()
    # the first layer sees the same q and k through both entry points: the same per-document statistics
    for name in ("rows", "multi_max_rows", "masked_rows", "max_score"):
        np.testing.assert_array_equal(np.asarray(flex[name])[0], np.asarray(varlen[name])[0], err_msg=name)
    assert np.asarray(flex["multi_max_rows"])[0].sum() > 0


def test_torchtitan_switched_layer_runs_flex_and_varlen_calls_on_our_kernels():
    """A head switched in layer 2: that layer's calls run on our kernels through either backend (flex: its mask
    from torchtitan's document mask_mod; varlen: its cu_seqlens), nothing "not applied", and the two models,
    with the same weights, give the same output within BF16 rounding."""
    model, *_ = _probe_step("flex")
    outs = {}
    for backend in ("flex", "varlen"):
        outs[backend], cov = _probe_step(backend, model.state_dict(), switch=(2, 5))
        assert [c.kernel_calls for c in cov] == [0, 0, 1, 0, 0, 0], backend
        assert all(c.not_applied == {} and c.unobserved_calls == {} for c in cov), backend
    scale = outs["varlen"].float().abs().max()
    assert (outs["flex"].float() - outs["varlen"].float()).abs().max() <= 2 ** -5 * scale


@pytest.fixture
def dynamo_config():
    """Dynamo's settings put back after the test (torchtitan's apply_compile sets some for the process)."""
    saved = torch._dynamo.config.save_config()
    yield
    torch._dynamo.config.load_config(saved)


def _compiled_forward(backend, compile_as, *, watched=True, switch=None):
    """Two train-mode forwards of the debug model compiled ``"regional"``-ly by torchtitan's own ``apply_compile``
    (each TransformerBlock in place, fullgraph, aot_eager: its flex regions lowered by inductor) or ``"whole"``;
    returns the output, the first step's metrics and the coverage."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.parallel_dims import ParallelDims

    from instability_watch import InstabilityWatch, WatchConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = llama3.model_registry("debugmodel", attn_backend=backend).model.build()
    metrics, watch = [], None
    if watched:
        watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0, spectral_every=1, log_every=1,
                                                    warmup_steps=100, strict=True),
                                 listeners=[lambda r: metrics.extend(r.metrics)])
        if switch is not None:
            watch.switch(*switch)
    forward = model
    if compile_as == "regional":
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        apply_compile(model, compile_config=CompileConfig(backend="aot_eager"), parallel_dims=dims)
    else:
        forward = torch.compile(model, backend="aot_eager", fullgraph=True)
    tokens = torch.randint(0, 2048, (2, sum(DOCS)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in DOCS]).repeat(2, 1)
    model.train()
    for _ in range(2):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = forward(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
        if watch is not None:
            watch.step(out.float().pow(2).mean())
    coverage = watch.coverage() if watch is not None else None
    if watch is not None:
        watch.detach()
    return out, (metrics[0] if metrics else None), coverage


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_torchtitan_blocks_compiled_as_torchtitan_compiles_them_are_each_watched(backend, dynamo_config):
    """torchtitan's regional compilation (apply_compile: every TransformerBlock compiled in place, fullgraph): one
    graph serves every block, and each block's statistics stay its own. The output is the unwatched one's bit for
    bit; no call unobserved, no graph break (fullgraph); varlen's statistics are those of the whole model compiled
    (the same aot_eager code, bit for bit); flex's first layer, which sees the same q and k either way, equals it
    too (inductor lowers flex's regions: the layers after it differ in BF16 rounding). A switched head's layer
    runs on our kernels, and only that layer."""
    out, regional, cov = _compiled_forward(backend, "regional")
    plain, _, _ = _compiled_forward(backend, "regional", watched=False)
    assert torch.equal(out, plain)
    assert all(c.unobserved_calls == {} and c.observed_calls == 2 for c in cov)
    _, whole, _ = _compiled_forward(backend, "whole")
    rows = np.asarray(regional["rows"])
    assert (rows == 2 * sum(DOCS)).all()
    top = np.asarray(regional["max_score"])
    assert len({round(float(t), 6) for t in top.max(axis=1)}) == 6  # six layers, six different maxima
    layers = slice(None) if backend == "varlen" else slice(0, 1)
    for name in ("rows", "multi_max_rows", "masked_rows", "max_score"):
        np.testing.assert_array_equal(np.asarray(regional[name])[layers], np.asarray(whole[name])[layers],
                                      err_msg=name)
    _, _, cov = _compiled_forward(backend, "regional", switch=(2, 5))
    assert [c.kernel_calls for c in cov] == [0, 0, 2, 0, 0, 0]
    assert all(c.not_applied == {} and c.unobserved_calls == {} for c in cov)
