"""``switch_to="exact_delta"`` on models we did not write, trained as their users train them (CPU, BF16 autocast):
HF Llama with GQA, Mistral with a sliding window (its mask), BERT with padding (its mask)."""
import math

import pytest

from instability_watch import WatchConfig
from instability_watch.experimental import high_precision_delta_calls

from real_models import MODELS, train

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["hf-llama-gqa", "hf-mistral-sliding-window", "hf-bert-padding"])
def test_exact_delta_switch_on_real_models(name):
    """Every head of the first layer switched to the exact delta before training: that layer's calls all run on our
    kernels (none left on PyTorch's), their backward takes the exact delta, and the losses stay those of the
    unwatched run to within BF16 noise (that layer's kernel and its backward's delta differ)."""
    spec = MODELS[name]
    config = WatchConfig(probe_every=1, shadow_every=1, spectral_every=0, log_every=1, switch_to="exact_delta",
                         strict=True)

    def switch_first_layer(watch):
        for head in range(watch.head_counts[0]):
            watch.switch(0, head)

    calls = high_precision_delta_calls()
    _, watched, watch, _ = train(spec, 3, config, setup=switch_first_layer)
    assert high_precision_delta_calls() >= calls + 3  # at least one backward call a step took the exact delta
    _, plain, _, _ = train(spec, 3)
    watched, plain = [x.item() for x in watched], [x.item() for x in plain]
    cov = watch.coverage()
    assert cov[0].kernel_calls == 3 and cov[0].not_applied == {} and cov[0].unobserved_calls == {}
    assert all(c.kernel_calls == 0 for c in cov[1:])  # the other layers stay on PyTorch's attention
    assert all(math.isfinite(x) for x in watched)
    assert max(abs(a - b) for a, b in zip(watched, plain)) < 0.05
