"""The HF Trainer callback on the GPU with FlexAttention and padding-free packing (FlexAttention trains on CUDA
only, so the CPU suite cannot run this). Skipped without a GPU."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("torch.nn.attention.flex_attention")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("impl", ["flex_attention", "sdpa"])
def test_packed_batches_train_watched_on_the_gpu(tmp_path, impl):
    """DataCollatorWithFlattening, BF16, HF Llama on flex_attention (compiled by HF) and on sdpa: every call
    observed and shadowed, every packed token a row on each probe step, a finite loss."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from instability_watch import WatchConfig, load_run
    from instability_watch.callbacks.hf import InstabilityWatchTrainerCallback

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                      intermediate_size=128, vocab_size=96, max_position_embeddings=256, bos_token_id=0,
                      eos_token_id=0, attn_implementation=impl, use_cache=False)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    # documents of 80-200 tokens, two a row: every packed row >= 128 tokens (Inductor lowers a flex call of fewer
    # query rows with its decoding kernel, which on torch 2.11 found no config for these calls, watched or not)
    docs = [torch.randint(1, 96, (int(n),), generator=g).tolist() for n in torch.randint(80, 200, (16,), generator=g)]
    data = [{"input_ids": d, "labels": list(d)} for d in docs]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    if impl == "flex_attention":
        # On torch 2.11 / transformers 5.17 (the GPU image, 2026-11-28) HF's compiled flex call on packed rows of
        # 97 tokens failed in Inductor with no watch at all (benchmarks/results/entry_points_gpu/h200_2026-11-28/
        # hf_flex_packed_unwatched.txt): nothing to watch where the user's own model does not train
        plain = LlamaForCausalLM(cfg)
        plain_args = TrainingArguments(output_dir=str(tmp_path / "plain"), max_steps=1, per_device_train_batch_size=2,
                                       report_to=[], disable_tqdm=True, bf16=True, save_strategy="no")
        try:
            Trainer(model=plain, args=plain_args, train_dataset=data, data_collator=collator).train()
        except Exception as exc:  # noqa: BLE001
            pytest.skip(f"HF's flex_attention on packed batches does not train unwatched here: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200]}")
        torch._dynamo.reset()
    cb = InstabilityWatchTrainerCallback(
        WatchConfig(probe_every=1, shadow_every=1, spectral_every=1, log_every=2, warmup_steps=2), alerts=False)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, logging_steps=1, save_steps=100, report_to=[], seed=0,
                             disable_tqdm=True, dataloader_num_workers=0, bf16=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb], data_collator=collator)
    trainer.train()
    run = load_run(cb.run_dir)
    coverage = run.meta["coverage"]
    assert all(c["unobserved_calls"] == {} and c["observed_calls"] > 0 for c in coverage), coverage
    assert all(c["shadow_calls"] > 0 for c in coverage), coverage
    m = run.metrics
    assert m.groupby("step")["rows"].first().sum() == sum(len(d) for d in docs)
    assert torch.isfinite(torch.tensor(m["loss"].to_numpy())).all()
