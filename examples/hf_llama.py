"""The watch on a Hugging Face ``LlamaForCausalLM``, unchanged, in a Lightning ``Trainer``.

    python examples/hf_llama.py                # a small Llama (GQA: 4 query heads on 2 KV heads), CPU or GPU
    python examples/hf_llama.py --steps 300

The model comes from ``transformers`` (``pip install "instability_watch[hf]"``),
built from a small config with ``attn_implementation="sdpa"``; nothing in it is
modified. The callback finds its attention layers (``q_proj``/``k_proj``), routes
their ``scaled_dot_product_attention`` calls (``enable_gqa=True``) through our
kernels and watches every query head. The corpus is the Python standard
library's source, byte by byte (vocabulary 256).
"""
from __future__ import annotations

import argparse
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from instability_watch import InstabilityWatchCallback, WatchConfig
from instability_watch.cli import report_command

from byte_corpus import ByteWindows, stdlib_text, train_val_split

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # pragma: no cover
    sys.exit('this example needs transformers: pip install "instability_watch[hf]"')


class LlamaModule(pl.LightningModule):
    def __init__(self, hidden: int, layers: int, heads: int, kv_heads: int, block: int, lr: float) -> None:
        super().__init__()
        config = LlamaConfig(
            vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=block,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch                                   # (B, T) bytes and the next bytes
        logits = self.model(input_ids=x).logits        # (B, T, 256); no padding mask: SDPA is causal
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default="runs", help="runs go to OUT/hf-llama/version_N (default runs)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.block < 2:
        ap.error(f"--steps and --batch must be >= 1 and --block >= 2, got {args.steps}, {args.batch}, {args.block}")
    pl.seed_everything(args.seed, verbose=False)

    train_bytes, _ = train_val_split(stdlib_text(2_000_000))
    data = DataLoader(ByteWindows(train_bytes, args.block, args.steps * args.batch, seed=args.seed),
                      batch_size=args.batch, drop_last=True)
    model = LlamaModule(hidden=128, layers=2, heads=4, kv_heads=2, block=args.block, lr=args.lr)
    watch = InstabilityWatchCallback(
        WatchConfig(probe_every=5, shadow_every=5, spectral_every=5, log_every=10, warmup_steps=min(50, args.steps)),
        live_table=True, top=6,
    )
    trainer = pl.Trainer(
        accelerator="auto", devices=1, precision="bf16-mixed", max_steps=args.steps, callbacks=[watch],
        logger=pl.loggers.CSVLogger(args.out, name="hf-llama"), enable_checkpointing=False,
        enable_model_summary=False, log_every_n_steps=5,
    )
    trainer.fit(model, data)
    w = watch.watch
    if trainer.is_global_zero and w is not None:
        unobserved = sum(n for c in w.coverage() for n in c.unobserved_calls.values())
        print(f"\nwatched {len(w.layer_names)} layers x {w.head_counts[0]} query heads "
              f"({unobserved} calls not observed); alerts: {len(w.alerts)}, heads switched: {len(w.switched)}")
        print(f"postmortem: {report_command(watch.run_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
