"""LightningModules for the callback tests (also imported by the subprocess scripts)."""
from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from nanogpt import GPT, GPTConfig
from watch_models import TiedAttention, tied_batch, tied_loss


class Indices(Dataset):
    """Item i is the tensor [i]; the modules make their data from it (or from the step)."""

    def __init__(self, n: int = 10_000) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


class TinyGPT(pl.LightningModule):
    """A 2-layer, 2-head nanoGPT on random bytes; records every micro-batch loss."""

    def __init__(self, n_layer: int = 2, n_head: int = 2, n_embd: int = 32, seq: int = 24, batch: int = 2,
                 val: bool = False) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=64, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
        self.seq, self.batch, self.val = seq, batch, val
        self.losses = []  # (global_step, loss) per micro-batch

    def _tokens(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(i))
        return torch.randint(0, 64, (self.batch, self.seq + 1), generator=g)

    def training_step(self, batch, batch_idx):
        t = self._tokens(int(batch[0]))
        _, loss = self.model(t[:, :-1], t[:, 1:])
        self.losses.append((self.global_step, float(loss.detach())))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        t = self._tokens(100_000 + int(batch[0]))
        _, loss = self.model(t[:, :-1], t[:, 1:])
        self.log("val_loss", loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(Indices(), batch_size=1)

    def val_dataloader(self):
        return DataLoader(Indices(4), batch_size=1)


class TiedModule(pl.LightningModule):
    """``TiedAttention`` in Lightning: data comes from the optimizer step (and the rank), so a
    resumed run sees exactly the batches an uninterrupted one does."""

    def __init__(self, seed_stride: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = TiedAttention()
        self.seed_stride = seed_stride

    def training_step(self, batch, batch_idx):
        o = self.attn(*tied_batch(self.seed_stride * self.global_step + self.global_rank))
        return tied_loss(o)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(Indices(), batch_size=1)

    def watch_layers(self):
        return self.attn.layers()
