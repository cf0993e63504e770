"""More model families nobody here wrote, built from their libraries' configs (tiny sizes, other defaults kept).

Each :class:`Family` builds a model and a batch; ``loss(model, batch)`` is what
its users backpropagate; ``attention`` is the class name of its attention
layers. Sizes are tiny on purpose: BF16 matmul on a CPU is slow. Awkward
lengths where the model allows them: T5's decoder is shorter than its encoder,
a ViT sees 17 tokens (16 patches and a class token).

timm and litgpt are optional (see :func:`need`): timm needs torchvision, whose
PyPI build is the CUDA one and does not load beside CPU torch; litgpt declares
``huggingface-hub<1.4``, which transformers 5 does not allow. Neither is in the
``test`` extra; their tests skip, with the reason, where they cannot be imported.
"""
from __future__ import annotations

import importlib
import os
from typing import Callable, Dict, NamedTuple

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: every model is built from a config

VOCAB, SEQ, DEC_SEQ, BATCH = 97, 16, 11, 2

HOW_TO_INSTALL = {
    "transformers": "pip install transformers",
    "timm": "timm needs torchvision built for the installed torch (the CPU build for CPU torch), then "
            "pip install --no-deps timm",
    "litgpt": "pip install --no-deps litgpt psutil 'jsonargparse<=4.41' (litgpt declares huggingface-hub<1.4, "
              "which transformers 5 does not allow)",
}


class Family(NamedTuple):
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], dict]
    loss: Callable[[torch.nn.Module, dict], torch.Tensor]
    attention: str  # class name of the attention layers
    layers: int
    heads: int
    dropout: bool  # attention dropout on by default


def need(name: str):
    """Import ``name``, or skip the test saying why it cannot be imported and how to get it."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a broken install (e.g. a CUDA torchvision) raises more than ImportError
        pytest.skip(f"{name} cannot be imported ({type(exc).__name__}: {exc}); {HOW_TO_INSTALL[name]}")


# ----------------------------------------------------------------------------- batches and losses


def _tokens(g: torch.Generator) -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)}


def _lm_loss(model, batch):
    return model(**batch, labels=batch["input_ids"]).loss


def _seq2seq(g: torch.Generator) -> dict:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 5:] = 0  # the second source sequence is 5 tokens shorter
    ids[1, SEQ - 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(1, VOCAB, (BATCH, DEC_SEQ), generator=g)}


def _seq2seq_loss(model, batch):
    return model(**batch).loss


def _images(g: torch.Generator) -> dict:
    return {"x": torch.randn(BATCH, 3, 16, 16, generator=g), "y": torch.randint(0, 5, (BATCH,), generator=g)}


def _image_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def _litgpt_loss(model, batch):
    x = batch["input_ids"]
    logits = model(x[:, :-1])  # (B, N - 1, V)
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


# ----------------------------------------------------------------------------- models


def hf_gpt_neox() -> torch.nn.Module:
    """Pythia's architecture (``GPTNeoXConfig``): fused ``query_key_value`` interleaved per head, partial RoPE."""
    t = need("transformers")
    cfg = t.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
                          vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0)
    return t.GPTNeoXForCausalLM(cfg)


def hf_phi3_gqa() -> torch.nn.Module:
    t = need("transformers")
    cfg = t.Phi3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                       intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return t.Phi3ForCausalLM(cfg)


def hf_falcon_gqa() -> torch.nn.Module:
    """Falcon's new decoder architecture: ``query_key_value`` grouped per key/value head, 2 query heads a group."""
    t = need("transformers")
    cfg = t.FalconConfig(num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                         hidden_size=32, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    return t.FalconForCausalLM(cfg)


def hf_t5() -> torch.nn.Module:
    """``T5Config()`` shrunk: dropout 0.1, relative position bias, encoder/decoder self- and cross-attention."""
    t = need("transformers")
    cfg = t.T5Config(num_layers=2, num_decoder_layers=2, num_heads=4, d_model=32, d_kv=8, d_ff=64,
                     vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return t.T5ForConditionalGeneration(cfg)


def timm_vit() -> torch.nn.Module:
    need("timm")
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5)


def litgpt_gqa() -> torch.nn.Module:
    need("litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT

    cfg = Config(n_layer=2, n_head=4, n_query_groups=2, n_embd=32, block_size=SEQ, vocab_size=VOCAB,
                 padded_vocab_size=VOCAB, intermediate_size=64)
    return GPT(cfg)


FAMILIES: Dict[str, Family] = {
    "hf-gpt-neox": Family(hf_gpt_neox, _tokens, _lm_loss, "GPTNeoXAttention", 2, 4, False),
    "hf-phi3-gqa": Family(hf_phi3_gqa, _tokens, _lm_loss, "Phi3Attention", 2, 4, False),
    "hf-falcon-gqa": Family(hf_falcon_gqa, _tokens, _lm_loss, "FalconAttention", 2, 4, False),
    # 2 encoder self-attention, 2 decoder self-attention, 2 cross-attention layers
    "hf-t5": Family(hf_t5, _seq2seq, _seq2seq_loss, "T5Attention", 6, 4, True),
    "timm-vit": Family(timm_vit, _images, _image_loss, "Attention", 2, 4, False),
    "litgpt-gqa": Family(litgpt_gqa, _tokens, _litgpt_loss, "CausalSelfAttention", 2, 4, False),
}
