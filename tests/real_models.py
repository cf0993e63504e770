"""Models nobody here wrote, built from their libraries' configs (small sizes, every other default kept).

Each entry builds a model and a batch; ``loss(model, batch)`` is what its users
backpropagate. The defaults that matter are the libraries' own: GPT-2's and
BERT's dropout 0.1, Llama's float32 q/k at SDPA under autocast (RoPE), Mistral's
sliding-window mask, BERT's padding mask.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, NamedTuple

import pytest
import torch

from nanogpt import GPT, GPTConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: every model is built from a config

VOCAB, SEQ, BATCH = 97, 32, 2


class RealModel(NamedTuple):
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], dict]
    loss: Callable[[torch.nn.Module, dict], torch.Tensor]
    layers: int
    heads: int


def _tokens(g: torch.Generator) -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)}


def _padded(g: torch.Generator) -> dict:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 9:] = 0  # the second sequence is 9 tokens shorter
    ids[1, SEQ - 9:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (BATCH,), generator=g)}


def _lm_loss(model, batch):
    return model(**batch, labels=batch["input_ids"]).loss


def _cls_loss(model, batch):
    return model(**batch).loss


def _nanogpt_loss(model, batch):
    x = batch["input_ids"]
    return model(x, x)[1]


def _transformers():
    return pytest.importorskip("transformers")


def nanogpt_dropout() -> torch.nn.Module:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=64, dropout=0.1))


def hf_gpt2_default() -> torch.nn.Module:
    """``GPT2Config()`` with only its size shrunk: attn/resid/embd dropout 0.1 as shipped."""
    t = _transformers()
    cfg = t.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=SEQ, vocab_size=VOCAB,
                       bos_token_id=0, eos_token_id=0)
    return t.GPT2LMHeadModel(cfg)


def hf_llama_gqa() -> torch.nn.Module:
    t = _transformers()
    cfg = t.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ,
                        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return t.LlamaForCausalLM(cfg)


def hf_mistral_sliding_window() -> torch.nn.Module:
    t = _transformers()
    cfg = t.MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                          intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ, sliding_window=8,
                          bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return t.MistralForCausalLM(cfg)


def hf_bert_padding() -> torch.nn.Module:
    t = _transformers()
    cfg = t.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128,
                       vocab_size=VOCAB, max_position_embeddings=SEQ, num_labels=2)
    return t.BertForSequenceClassification(cfg)


MODELS: Dict[str, RealModel] = {
    "nanogpt-dropout": RealModel(nanogpt_dropout, _tokens, _nanogpt_loss, 2, 4),
    "hf-gpt2-default": RealModel(hf_gpt2_default, _tokens, _lm_loss, 2, 4),
    "hf-llama-gqa": RealModel(hf_llama_gqa, _tokens, _lm_loss, 2, 4),
    "hf-mistral-sliding-window": RealModel(hf_mistral_sliding_window, _tokens, _lm_loss, 2, 4),
    "hf-bert-padding": RealModel(hf_bert_padding, _padded, _cls_loss, 2, 4),
}


def train(spec, steps: int, config=None, setup=None):
    """``steps`` AdamW steps of ``spec`` (a RealModel or a Family) under CPU bf16 autocast from seed 0,
    watched with ``config`` if given (``setup(watch)`` called before the first step); returns
    ``(model, losses, watch, metrics read back)``."""
    from instability_watch import InstabilityWatch

    torch.manual_seed(0)
    model = spec.build()
    model.train()
    metrics = []
    watch = None
    if config is not None:
        watch = InstabilityWatch(model, config, listeners=[lambda r: metrics.extend(r.metrics)])
        if setup is not None:
            setup(watch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = spec.batch(g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = spec.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if watch is not None:
            watch.step(loss)
    return model, losses, watch, metrics
