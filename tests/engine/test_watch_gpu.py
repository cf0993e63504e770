"""The watch on a CUDA GPU: the user's SDPA observed by the Triton statistics kernels (marker ``gpu``)."""
import copy

import numpy as np
import pytest
import torch

from instability_watch import InstabilityWatch, WatchConfig
from instability_watch.kernels import stats as st
from instability_watch.probe.bank import Probe

from nanogpt import GPT, GPTConfig

pytestmark = pytest.mark.gpu


def _train(model, steps, watch=None, sync_check_from=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(0)
    losses = []
    for step in range(1, steps + 1):
        x = torch.randint(0, 256, (4, 256), device="cuda", generator=g)
        check = sync_check_from is not None and step >= sync_check_from
        if check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, x)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            if watch is not None:
                watch.step(loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        losses.append(loss.detach())
    return losses


def _gpt(dropout=0.0):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, block_size=256, dropout=dropout)).cuda()


def test_watched_training_on_gpu_is_identical_and_fills_every_head():
    base = _gpt()
    twin, watched = copy.deepcopy(base), copy.deepcopy(base)
    ref = _train(base, 6)
    again = _train(twin, 6)
    metrics = []
    watch = InstabilityWatch(watched, WatchConfig(probe_every=1, log_every=3, shadow_every=2, spectral_every=2),
                             listeners=[lambda r: metrics.extend(r.metrics)])
    losses = _train(watched, 6, watch)
    deterministic = all(torch.equal(a, b) for a, b in zip(ref, again))
    if deterministic:  # PyTorch's own run-to-run result: the watch must not change a bit of it
        assert all(torch.equal(a, b) for a, b in zip(losses, ref))
    else:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref), rtol=1e-2, atol=0)
    assert [m.step for m in metrics] == [1, 2, 3, 4, 5, 6]
    for m in metrics:
        assert (m["rows"] == 4 * 256).all()
        assert np.isfinite(m["max_score"]).all() and (m["nonfinite_rows"] == 0).all()
    assert [int(m["shadow_rows"][0, 0]) for m in metrics] == [1024, 0, 1024, 0, 1024, 0]
    assert all(np.isfinite(m["delta_err_sum"]).all() for m in metrics[::2])
    assert [c.observed_calls for c in watch.coverage()] == [6, 6]
    watch.detach()


def test_gpu_statistics_equal_the_reference_on_the_same_call():
    """The Triton statistics of a probe step equal the PyTorch definition run on the captured inputs."""
    model = _gpt()
    captured = []
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=0))
    hooks = [b.attn.c_attn.register_forward_hook(lambda m, i, o: captured.append(o.detach())) for b in model.h]
    x = torch.randint(0, 256, (2, 256), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(x)
    for h in hooks:
        h.remove()
    for i, qkv in enumerate(captured):
        B, T, C = qkv.shape
        q, k, _ = (t.view(B, T, 4, C // 12).transpose(1, 2) for t in qkv.split(C // 3, dim=2))
        ref = Probe(4, "cuda")
        st.stats_reference(q, k, None, None, ref.counts, ref.values, causal=True, scale=(C // 12) ** -0.5, eps=1e-3)
        probe = watch.observation.bank.probes[i]
        assert torch.equal(probe.rows, ref.rows) and torch.equal(probe.masked_rows, ref.masked_rows)
        assert (probe.multi_max_rows - ref.multi_max_rows).abs().max() <= 2  # fp32 summation order at the eps edge
        torch.testing.assert_close(probe.max_score, ref.max_score, rtol=1e-6, atol=1e-6)
    watch.detach()


def test_switching_a_head_does_not_recompile_and_changes_only_that_head():
    from helpers import compiled_kernels

    from instability_watch.kernels.attention import triton as ta

    model = _gpt()
    watch = InstabilityWatch(model, WatchConfig(probe_every=10 ** 6, shadow_every=0))
    x = torch.randint(0, 256, (2, 256), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        watch.observation.route(0)  # layer 0 on our standard kernel
        base = model(x)[0]
        before = compiled_kernels(ta.attn_fwd)
        watch.switch(0, 2)
        out = model(x)[0]
    assert compiled_kernels(ta.attn_fwd) == before
    assert watch.observation.stabilized() == [[False, False, True, False], [False] * 4]
    # exact in exact arithmetic: the logits move by rounding only
    assert (out.float() - base.float()).abs().max().item() < 0.25
    watch.detach()


def test_no_host_sync_between_read_backs():
    """Probe, shadow and spectral steps, a switched layer and the plain steps between: no host sync."""
    model = _gpt(dropout=0.1)
    watch = InstabilityWatch(model, WatchConfig(probe_every=2, log_every=8, shadow_every=2, spectral_every=2))
    watch.switch(1, 1)
    _train(model, 7, watch, sync_check_from=2)  # step 1 reads back once (the coverage check)
    assert watch.step_count == 7 and watch.flushed_through == 1
    torch.cuda.set_sync_debug_mode("error")
    try:
        watch.switch(0, 1)  # also without a sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    watch.flush()
    cov = watch.coverage()
    # the switched layer's dropout calls run on our kernels (dropout seeded on the device: no sync)
    assert [c.observed_calls for c in cov] == [4, 4] and cov[1].kernel_calls == 4
    assert cov[1].not_applied == {}
    watch.detach()
