"""Hugging Face ``Trainer`` runs of InstabilityWatchTrainerCallback (shared by tests/callbacks/test_hf_trainer.py).

Usage (two CPU processes, gloo):
    python -m torch.distributed.run --standalone --nproc_per_node 2 hf_trainer_run.py OUT_DIR MODE [MODE ...]
        # per MODE, one after the other in the same two processes (one launch: starting them dominates on
        # CPU), in OUT_DIR/MODE: an uninterrupted run in full/ (6 optimizer steps, checkpoints at 3 and 6), then
        # a copy of it in resumed/ continued from its checkpoint-3; each rank writes {full,resumed}-rank{r}.json.
        # ddp: GPT-2 under DDP. fsdp1 / fsdp2: Llama (GQA) sharded by the Trainer with
        # TrainingArguments(fsdp=True, fsdp_config={"version": 1 or 2, ...}), decoder layers auto-wrapped;
        # fsdp1 also runs GPT-2 (gpt2/, gpt2-rank{r}.json) and a refused run (bad-rank{r}.json).

On CPU Accelerate ignores the FSDP plugin (``AcceleratorState`` turns FSDP on only for
GPU-like devices: with ``use_cpu`` the run is plain DDP, silently). ``CpuFsdpTrainer``
turns it on after the Accelerator is built, so the Trainer's own FSDP code runs (the
wrapping, ``accelerator.prepare``, FSDP checkpoints and their loading) on CPU with gloo.

Imported by the tests for ``build``, ``TokenDataset``, ``training_args`` and ``plain``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: every model is built from a config

import torch  # noqa: E402

VOCAB, SEQ = 97, 32


class TokenDataset(torch.utils.data.Dataset):
    """``n`` random token sequences, each its own labels (causal LM)."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def build(name: str):
    """A small Hugging Face model from its config (seeded), attention through SDPA."""
    import transformers as t

    torch.manual_seed(0)
    if name == "gpt2":  # GPT2Config's own dropout (0.1) kept
        cfg = t.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64,
                           bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
        return t.GPT2LMHeadModel(cfg)
    if name == "llama":  # GQA: 4 query heads on 2 key/value heads
        cfg = t.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
                            bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
        return t.LlamaForCausalLM(cfg)
    raise ValueError(f"unknown model {name!r}")


def training_args(out, **kw):
    from transformers import TrainingArguments

    args = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                logging_steps=1, save_steps=3, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                dataloader_num_workers=0)
    args.update(kw)
    return TrainingArguments(**args)


def plain(x):
    """``x`` with every float NaN as the string "nan" (comparable with ==), tuples as lists."""
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


# multi-max alerts on any rise over the first step's frequency: heads switch on statistics that each rank
# alone would judge differently (each rank trains on its own data), so agreeing takes the reduction
DDP_CONFIG = dict(probe_every=1, shadow_every=1, spectral_every=1, log_every=2, warmup_steps=1, sustain=1,
                  multi_max_factor=1.0, multi_max_min_rise=0.0, auto_switch=True)


def fsdp_args(version: int, wrap=("LlamaDecoderLayer",)) -> dict:
    """TrainingArguments for the Trainer's FSDP (``version`` 1 or 2), decoder layers auto-wrapped.

    ``wrap``: the classes auto-wrapped as FSDP units; none: only the root unit (``NO_WRAP``).
    ``SHARDED_STATE_DICT`` checkpoints (DCP): FSDP1's default ``FULL_STATE_DICT`` gathers with
    ``offload_to_cpu=True``, which crashes (SIGSEGV in FSDP's state-dict hook) when the
    weights are already on the CPU. ``sync_module_states`` is off: the plugin looks for an
    accelerator device to sync on (every rank builds the same seeded model anyway).
    """
    config = {"version": version, "state_dict_type": "SHARDED_STATE_DICT", "sync_module_states": "false"}
    # the layer classes to wrap as units of their own, or none: one unit, the root, holds every weight
    config.update({"transformer_layer_cls_to_wrap": list(wrap)} if wrap else {"auto_wrap_policy": "NO_WRAP"})
    args = dict(fsdp=True, fsdp_config=config)
    if version == 1:
        # FSDP1's sharded optimizer checkpoint does not come back in this CPU setup: the resumed AdamW
        # holds step 1 and other moments than the saved ones (the weights come back exactly; presumably
        # the state FSDP.optim_state_dict makes up for a fresh optimizer, which Accelerate's
        # load_fsdp_optimizer loads into, is not overwritten). Plain SGD keeps no state, so the resumed
        # run trains exactly as the uninterrupted one and the comparison tests the watch alone
        args.update(optim="sgd", learning_rate=1e-2)
    return args


def cpu_fsdp_trainer():
    """``transformers.Trainer`` whose Accelerator really uses FSDP on the CPU (see the module's docstring)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer

    class CpuFsdpTrainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            assert state.distributed_type == DistributedType.MULTI_CPU and self.args.fsdp_plugin_args
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state.device = torch.device("cpu")  # FSDP1 checks device_id ("cpu:0") against the compute device ("cpu")
            self.is_fsdp_enabled = True

    return CpuFsdpTrainer


def reference_sigma(trainer, cb, mode: str):
    """sigma_max per layer and head of the whole W_Q in float64: gathered by FSDP1's ``summon_full_params``
    (of the Trainer's root) or FSDP2's ``full_tensor()``."""
    out = []
    for site in cb.watch.observation.sites:
        if mode == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(trainer.model, writeback=False):
                w = site.layer.w_q().detach().double().clone()
        else:
            w = site.layer.w_q().detach()
            w = (w.full_tensor() if hasattr(w, "full_tensor") else w).double()
        out.append(torch.linalg.matrix_norm(w, ord=2).tolist())
    return out


def _leg(mode: str, out_dir: str, resume, report: str, name: Optional[str] = None, layers=None, **kw) -> None:
    """One Trainer run on every rank; writes ``report`` (``{rank}`` filled in) with what the watch did.
    ``mode``: ddp | fsdp1 | fsdp2; ``name``: the model (ddp: GPT-2, fsdp: Llama); ``kw``: TrainingArguments."""
    from transformers import Trainer, TrainerCallback

    from instability_watch.callbacks.hf import InstabilityWatchTrainerCallback

    fsdp = mode.startswith("fsdp")
    name = name or ("llama" if fsdp else "gpt2")
    model = build(name)
    cb = InstabilityWatchTrainerCallback(DDP_CONFIG, alerts=False, layers=layers)
    seen = {}

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            # what the Trainer hands the callbacks, and what the watch made of it
            seen["model"] = type(model).__name__
            seen["watched"] = type(cb.watch.model).__name__
            seen["roots"] = [type(m).__name__ for m in cb.watch.sharding_roots]

        def on_step_end(self, args, state, control, **kwargs):
            # RoPE leaves Llama few repeated maxima to switch on: a manual switch (every rank)
            if name == "llama" and state.global_step == 2 and (1, 1) not in cb.watch.switched:
                cb.watch.switch(1, 1)

    extra, cls = ({}, Trainer)
    if fsdp:
        # GPT-2: no unit but the root, which the Trainer hands the callbacks (the watch must search it)
        extra, cls = fsdp_args(int(mode[-1]), [] if name == "gpt2" else ["LlamaDecoderLayer"]), cpu_fsdp_trainer()
    extra.update(kw)
    trainer = cls(model=model, args=training_args(out_dir, ddp_backend="gloo", **extra), train_dataset=TokenDataset(),
                  callbacks=[cb, Probe()])
    rank = torch.distributed.get_rank()
    try:
        trainer.train(resume_from_checkpoint=resume)
    except ValueError as exc:  # the callback refused the run at train begin
        with open(report.format(rank=rank), "w") as f:
            json.dump({"rank": rank, "error": str(exc), "steps": trainer.state.global_step}, f)
        return
    w = cb.watch
    result = {
        "rank": rank,
        "world_size": torch.distributed.get_world_size(),
        "steps": w.step_count,
        "state": w.state_dict(),
        "disabled": sorted(w.disabled),
        "wrote": cb.writer is not None,
        "log_history": trainer.state.log_history,
        # no forward of ours on a module, our loss hook gone (FSDP2 keeps hooks of its own on the model)
        "detached": not any("forward" in vars(m) for m in model.modules() if m is not model)
        and not any(getattr(h, "__self__", None) is cb for h in model._forward_hooks.values()),
        "seen": seen,
        "sharding": cb.sharding,
        "trainer_model": type(trainer.model).__name__,
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
    }
    if fsdp:
        result["sigma_last"] = [[float(x) for x in row] for row in w.last_metrics[-1]["sigma_wq"]]
        result["sigma_last_step"] = w.last_metrics[-1].step
        result["sigma_ref"] = reference_sigma(trainer, cb, mode)
    with open(report.format(rank=rank), "w") as f:
        json.dump(plain(result), f)


def sharded_gpt2_layers(model):
    """GPT-2's layers described by a locator that reads the weight's shape when it locates (outside any
    gather: under FSDP1 a piece of the flat shard), as the built-in one did: refused under FSDP1."""
    from instability_watch import AttentionLayer

    out = []
    for i, block in enumerate(model.transformer.h):
        attn = block.attn
        e = attn.c_attn.weight.shape[0]
        out.append(AttentionLayer(attn, attn.num_heads, lambda a=attn, e=e: a.c_attn.weight[:, :e].t().reshape(
            a.num_heads, -1, a.c_attn.weight.shape[0]), f"transformer.h.{i}.attn"))
    return out


def run_mode(mode: str, out: str) -> None:
    """Every leg of ``mode`` (see the module's docstring) in ``out``."""
    import torch.distributed as dist

    full, resumed = os.path.join(out, "full"), os.path.join(out, "resumed")
    _leg(mode, full, None, os.path.join(out, "full-rank{rank}.json"))
    if dist.get_rank() == 0:  # the run, as it stood, continued from its step-3 checkpoint in a copy
        shutil.copytree(full, resumed)
    dist.barrier()
    _leg(mode, resumed, os.path.join(resumed, "checkpoint-3"), os.path.join(out, "resumed-rank{rank}.json"))
    if mode == "fsdp1":
        # GPT-2 (Conv1D: its locator reads W's shape) with the Trainer's default use_orig_params=True, and
        # no unit but the Trainer's root (NO_WRAP); then a locator of the user's that reads the shape outside
        # the gather: refused on every rank
        _leg(mode, os.path.join(out, "gpt2"), None, os.path.join(out, "gpt2-rank{rank}.json"), name="gpt2",
             max_steps=2, save_strategy="no")
        _leg(mode, os.path.join(out, "bad"), None, os.path.join(out, "bad-rank{rank}.json"), name="gpt2",
             layers=sharded_gpt2_layers, max_steps=2, save_strategy="no")
    dist.barrier()


def main() -> None:
    import torch.distributed as dist

    out, modes = sys.argv[1], sys.argv[2:] or ["ddp"]
    for mode in modes:
        run_mode(mode, os.path.join(out, mode))
    dist.destroy_process_group()  # gloo's threads joined before the interpreter exits


if __name__ == "__main__":
    main()
