"""QK-clip under torch.distributed: 2 CPU processes (gloo) through torchrun, or the same runs in one process.

Usage::

    python -m torch.distributed.run --standalone --nproc_per_node 2 qk_clip_dist.py OUT_DIR CASE [CASE ...]
    python qk_clip_dist.py OUT_DIR CASE [CASE ...]     # no torchrun: one process, unsharded (the reference)

CASE is ``MODE-MODEL``; MODEL is ``nanogpt`` (the package's GPT) or ``llama`` (HF Llama, GQA: 4 query heads on
2 key heads), both with their query and key rows scaled up at init (large logits from the first step) and one
query head per layer scaled down (it stays below tau: never clipped).

MODE   ddp    ``DistributedDataParallel``; probe every step.
       fsdp2  ``fully_shard`` on every block and on the root; probe every second step.
       fsdp1  ``FullyShardedDataParallel(use_orig_params=True)``, blocks auto-wrapped; probe every second step.
       (these three: AdamW, ``qk_clip="always"``, each rank its own half of each global batch)
       tau2, tau1  one layer, lr 0 (only the clip changes weights), FSDP2 / FSDP1, the same batch on every step,
              probe and read back every step: a clipped head's largest logit of the next step is tau.

Without torchrun (world size 1) every case runs unsharded on the whole global batch, as two micro-batches (the
ranks' halves) with the loss halved: the gradients of the 2-rank run, summed in another order.

Each rank writes ``OUT_DIR/<case>_rank<r>.json`` (one process: ``<case>_single.json``): the clips read back,
the per-step largest logits (reduced over ranks) and this rank's own before the reduction, a hash of the whole
parameters before training and after every step, the watch's state; rank 0 also ``<case>_dist_weights.pt``
(one process: ``<case>_single_weights.pt``), the whole parameters before training and at the end.
"""
import hashlib
import json
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

VOCAB, SEQ, GLOBAL_BATCH = 61, 32, 4
STEPS = {"ddp": 6, "fsdp2": 7, "fsdp1": 7, "tau2": 3, "tau1": 3}
# below the boosted heads' logits (every step), above the damped head's: several heads clip, not all
TAU = {"nanogpt": 1.0, "llama": 1.0}


def _boost(q, k, heads, damped):
    """Scale query and key rows up (x6), then one query head down (stays below tau)."""
    with torch.no_grad():
        q.mul_(6.0)
        k.mul_(6.0)
        q.view(heads, -1, q.shape[-1])[damped].mul_(0.1)


def build(name, layers):
    torch.manual_seed(0)
    if name == "nanogpt":
        from nanogpt import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=layers, n_head=4, n_embd=32))
        for block in model.h:
            w = block.attn.c_attn.weight
            _boost(w[:32], w[32:64], 4, 1)
        return model, list(model.h)
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                   max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                                   attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        # query head 0 shares key head 0 with head 1: the clip of head 1 must leave it alone
        _boost(layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, 4, 0)
    return model, list(model.model.layers)


def loss_of(name, model, ids):
    if name == "nanogpt":
        return model(ids[:, :-1], ids[:, 1:])[1]
    return model(input_ids=ids, labels=ids).loss


def batches(mode):
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS[mode])]
    if mode.startswith("tau"):  # the same batch every step: the next step's logits are the clipped ones
        data = [data[0]] * len(data)
    return data


def config(mode, name):
    from instability_watch import WatchConfig

    if mode.startswith("tau"):
        return WatchConfig(qk_clip="always", qk_clip_tau=TAU[name], probe_every=1, log_every=1, warmup_steps=1,
                           shadow_every=0, spectral_every=0)
    return WatchConfig(qk_clip="always", qk_clip_tau=TAU[name], probe_every=1 if mode == "ddp" else 2,
                       log_every=3, warmup_steps=2, shadow_every=2, spectral_every=3)


def wrap(mode, model, blocks, world):
    if world == 1:
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if mode in ("fsdp2", "tau2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(blocks[0])}), device_id=torch.device("cpu"),
                use_orig_params=True)


def whole_parameters(model):
    """name -> the whole parameter (gathered where sharded), float32 CPU copies, the original names."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, writeback=False):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    inner = getattr(model, "module", model)  # DDP
    out = {}
    for n, p in inner.named_parameters():
        t = p.detach()
        out[n] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def digest(params):
    h = hashlib.sha256()
    for n in sorted(params):
        h.update(n.encode())
        h.update(params[n].contiguous().numpy().tobytes())
    return h.hexdigest()


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    return x


def run_case(case, out_dir, rank, world):
    from instability_watch import InstabilityWatch

    mode, name = case.split("-")
    layers = 1 if mode.startswith("tau") else 2
    model, blocks = build(name, layers)
    model = wrap(mode, model, blocks, world)
    clips, metrics, local = [], [], []

    def listener(record):
        clips.extend([c.step, c.layer, c.head, c.factor, c.max_logit, c.tau, c.layer_name] for c in record.clips)
        metrics.extend({"step": m.step, "max_score": m.values["max_score"].tolist()} for m in record.metrics)

    watch = InstabilityWatch(model, config(mode, name), listeners=[listener])
    own_clip = watch.clipper.clip

    def qk_clip(**kwargs):  # this rank's own largest logits, before the watch max-reduces them over the ranks
        smax = watch.clipper.pending_logits
        local.append([watch.step_count, None if smax is None else smax.tolist()])
        return own_clip(**kwargs)

    watch.clipper.clip = qk_clip
    initial = whole_parameters(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0 if mode.startswith("tau") else 3e-3)
    half = GLOBAL_BATCH // 2
    hashes = []
    for ids in batches(mode):
        if world == 1:
            for r in range(2):
                (loss_of(name, model, ids[r * half:(r + 1) * half]) * 0.5).backward()
            loss = None
        else:
            loss = loss_of(name, model, ids[rank * half:(rank + 1) * half])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        watch.step(None if loss is None else loss.detach())
        hashes.append(digest(whole_parameters(model)))
    watch.flush()
    weights = whole_parameters(model)
    result = {
        "case": case, "world": world, "steps": watch.step_count, "tau": TAU[name],
        "head_counts": list(watch.head_counts),
        "clips": clips, "metrics": metrics, "local_max": local, "initial_hash": digest(initial), "hashes": hashes,
        "clip_counts": watch.clip_counts.tolist(),
        "state": json.loads(json.dumps(watch.state_dict(), default=str)),
        "disabled": dict(watch.disabled), "problems": watch.faults.reported,
    }
    watch.detach()
    suffix = "single" if world == 1 else f"rank{rank}"
    with open(os.path.join(out_dir, f"{case}_{suffix}.json"), "w") as f:
        json.dump(_clean(result), f)
    if rank == 0:
        torch.save({"initial": initial, "final": weights},
                   os.path.join(out_dir, f"{case}_{'single' if world == 1 else 'dist'}_weights.pt"))


def main():
    out_dir, cases = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    try:
        for case in cases:
            run_case(case, out_dir, rank, world)
            if distributed:
                dist.barrier()
    finally:
        if distributed:
            dist.destroy_process_group()
    if distributed:
        # Every result is written and the group is gone: leave without the interpreter's teardown, where a gloo
        # thread still joinable ended a rank in std::terminate after all the work was done ("terminate called
        # without an active exception": 2 of 9 CI runs on 2026-11-27; ddp_watch.py met it first).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
