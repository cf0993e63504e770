"""A small, readable nanoGPT-style GPT (the model the examples and tests train).

Written in the style of Karpathy's nanoGPT: a fused ``c_attn`` linear layer
producing queries, keys and values, and attention through
``F.scaled_dot_product_attention(..., is_causal=True)``. Nothing in it knows
about ``instability_watch``; the watch attaches to it from the outside, which
is the point.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """The model's sizes and options, validated when built (a ``ValueError`` names the bad field)."""

    vocab_size: int = 256      # byte-level
    block_size: int = 256      # context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = False
    # False: no position embedding (NoPE; causal attention still orders tokens). Then equal
    # tokens have equal first-layer keys, so rows with repeated maxima are common.
    pos_embedding: bool = True
    # nanoGPT's dropout: on attention probabilities (SDPA's dropout_p), after the attention and
    # MLP projections and on the embeddings. 0.0 as nanoGPT's default (pretraining); 0.1 for finetuning.
    dropout: float = 0.0
    # None: the attention computes in its inputs' dtype (autocast's, under autocast). A dtype (e.g.
    # torch.bfloat16): q, k, v are cast to it for SDPA and the output cast back, so the attention runs in
    # BF16 while the rest of the model runs in float32 (the CPU demo on CPUs without native BF16).
    attention_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool) or not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.attention_dtype is not None and not (isinstance(self.attention_dtype, torch.dtype)
                                                     and self.attention_dtype.is_floating_point):
            raise ValueError(f"GPTConfig.attention_dtype must be None or a floating torch.dtype, got "
                             f"{self.attention_dtype!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: a fused ``c_attn`` (``n_embd -> 3 * n_embd``), then SDPA.

    The layout the watch's nanoGPT locator recognises: ``W_Q`` is rows ``[0, n_embd)`` of
    ``c_attn.weight``, ``n_head`` heads of ``n_embd // n_head`` dims.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = float(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.attention_dtype = config.attention_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, T, C)`` -> ``(B, T, C)``, same dtype (autocast's under autocast).

        SDPA sees ``q, k, v`` of shape ``(B, n_head, T, C // n_head)``, ``is_causal=True``, with
        attention dropout in training mode only.
        """
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        dt = self.attention_dtype
        if dt is not None:
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        if dt is not None:
            y = y.to(x.dtype)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GPT-2's feed-forward block: ``n_embd -> 4 * n_embd``, tanh-GELU, back to ``n_embd``, dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(..., n_embd)`` -> ``(..., n_embd)``, same dtype."""
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, T, n_embd)`` -> ``(B, T, n_embd)``, same dtype."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 architecture: token + position embeddings, pre-norm blocks, tied LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos_embedding else None
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled residual init
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Next-token logits, and the loss when ``targets`` are given.

        Args:
            idx: token ids, int64 ``(B, T)`` with ``T <= block_size``.
            targets: the next token at each position, int64 ``(B, T)``, or ``None``.

        Returns:
            ``(logits, loss)``: logits ``(B, T, vocab_size)`` in the model's dtype (autocast's
            under autocast); loss a float32 scalar, the mean cross-entropy computed on the
            logits upcast to float32, or ``None`` without targets.

        Raises:
            ValueError: ``T`` exceeds ``block_size``.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.wte(idx)                                   # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
