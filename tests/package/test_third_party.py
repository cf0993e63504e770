"""The watch on nanoGPT's own ``model.py`` (Karpathy's code, unmodified).

The file is not part of this repository. Put it at ``.thirdparty/nanogpt_model.py``
(e.g. ``git -C nanoGPT show HEAD:model.py > .thirdparty/nanogpt_model.py`` from a
clone of https://github.com/karpathy/nanoGPT); without it these tests skip.
"""
import importlib.util

import pytest
import torch

from instability_watch import InstabilityWatch, WatchConfig

from helpers import REPO

MODEL_PY = REPO / ".thirdparty" / "nanogpt_model.py"


def _nanogpt():
    if not MODEL_PY.exists():
        pytest.skip(f"nanoGPT's model.py not at {MODEL_PY}")
    spec = importlib.util.spec_from_file_location("nanogpt_model", MODEL_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train(device, watch_config, steps=12):
    mod = _nanogpt()
    torch.manual_seed(0)
    cfg = mod.GPTConfig(block_size=64, vocab_size=97, n_layer=2, n_head=4, n_embd=64, dropout=0.1, bias=True)
    model = mod.GPT(cfg).to(device)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), device)
    watch = InstabilityWatch(model, watch_config) if watch_config else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 97, (4, 64), generator=g).to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if watch:
            watch.step(loss)
    return model, losses, watch


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nanogpt_model_py_with_dropout_trains_identically_and_is_observed(device):
    plain, ref, _ = _train(device, None)
    model, losses, watch = _train(device, WatchConfig(probe_every=2, shadow_every=2, log_every=6))
    deterministic = device == "cpu" or all(torch.equal(a, b) for a, b in zip(_train(device, None)[1], ref))
    if deterministic:  # then the watch must not change a bit
        assert all(torch.equal(a, b) for a, b in zip(losses, ref))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    else:  # PyTorch's own backward is not run-to-run deterministic here
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref), rtol=1e-2, atol=0)
    watch.flush()
    assert watch.layer_names == ["transformer.h.0.attn", "transformer.h.1.attn"]
    for c in watch.coverage():
        assert c.observed_calls == 6 and c.unobserved_calls == {} and c.shadow_skipped == {"dropout": 6}
    watch.detach()
