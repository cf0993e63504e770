"""``switch_to="exact_delta"`` on models we did not write, trained as their users train them (CPU, BF16 autocast):
HF Llama with GQA, Mistral with a sliding window (its mask), BERT with padding (its mask)."""
import math

import pytest
import torch

from instability_watch import InstabilityWatch, WatchConfig
from instability_watch.experimental import high_precision_delta_calls

from real_models import MODELS

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["hf-llama-gqa", "hf-mistral-sliding-window", "hf-bert-padding"])
def test_exact_delta_switch_on_real_models(name):
    """Every head of the first layer switched to the exact delta before training: that layer's calls all run on our
    kernels (none left on PyTorch's), their backward takes the exact delta, and the losses stay those of the
    unwatched run to within BF16 noise (that layer's kernel and its backward's delta differ)."""
    spec = MODELS[name]

    def run(watched: bool):
        torch.manual_seed(0)
        model = spec.build()
        model.train()
        watch = None
        if watched:
            watch = InstabilityWatch(model, WatchConfig(probe_every=1, shadow_every=1, spectral_every=0, log_every=1,
                                                        switch_to="exact_delta", strict=True))
            for head in range(watch.head_counts[0]):
                watch.switch(0, head)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            batch = spec.batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = spec.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if watch is not None:
                watch.step(loss)
        return losses, watch

    calls = high_precision_delta_calls()
    watched, watch = run(True)
    assert high_precision_delta_calls() >= calls + 3  # at least one backward call a step took the exact delta
    plain, _ = run(False)
    cov = watch.coverage()
    assert cov[0].kernel_calls == 3 and cov[0].not_applied == {} and cov[0].unobserved_calls == {}
    assert all(c.kernel_calls == 0 for c in cov[1:])  # the other layers stay on PyTorch's attention
    assert all(math.isfinite(x) for x in watched)
    assert max(abs(a - b) for a, b in zip(watched, plain)) < 0.05
