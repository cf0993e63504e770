"""The watch on a sharded model: 2 CPU processes (gloo), or the same run in one process.

Usage: python fsdp_watch.py OUT_DIR PORT MODE:MODEL [MODE:MODEL ...]

The runs go one after the other in the same processes (one launch): with a
sharded MODE among them, 2 processes, the ``single`` runs first, shared out
between them (before the process group starts: each alone in its process), then
every sharded run in one process group; with ``single`` runs only, one process.

MODE   fsdp2  ``fully_shard`` per block and on the root; 6 optimizer steps, a DCP
              checkpoint after step 4, then a fresh model, optimizer and watch
              resumed from it run steps 5-6 again.
       fsdp2compiled  torchtitan's order: each block compiled on its own (aot_eager), then ``fully_shard`` per
              block and on the root; 6 steps.
       fsdp1  ``FullyShardedDataParallel`` (``use_orig_params=True``) wrapping each block: sigma from the
              attention weights rebuilt with one all-reduce per spectral step.
       fsdp1units  as fsdp1 with ``use_orig_params=False``: sigma read inside each block's gather.
       fsdp1layers  as fsdp1 with each attention module its own unit (its weights split between the ranks) and
              room for one layer's weights at a time: one all-reduce per layer.
       fsdp1fail  as fsdp1layers, with layer 0's ``w_q`` failing on rank 1 from step 3 on.
       single one process, unsharded, the same global batch as two micro-batches
              (the ranks' halves) with the loss halved: the same gradients bit for bit.
MODEL  nanogpt (the package's GPT, no position embedding: many repeated maxima) | llama (HF, GQA 4:2)

Each rank (or the single process) writes ``OUT_DIR/<mode>_<model>_rank<r>.json`` per run: the watch's
per-step metrics, switches, alerts, state, sigma per head, the reference sigma
of the gathered float64 weights, and how often the training steps rebuilt the weights
(``whole_params`` all-reduces) and gathered FSDP1 units.
"""
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

STEPS, RESUME_AT, VOCAB, SEQ, GLOBAL_BATCH = 6, 4, 61, 24, 4


def build(name):
    torch.manual_seed(0)
    if name == "nanogpt":
        from nanogpt import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=64, pos_embedding=False))
        return model, list(model.h)
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                                   intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    return model, list(model.model.layers)


def loss_of(name, model, ids):
    if name == "nanogpt":
        return model(ids[:, :-1], ids[:, 1:])[1]
    return model(input_ids=ids, labels=ids).loss


def batches():
    g = torch.Generator().manual_seed(1)
    # few distinct tokens: equal keys in the first layer, repeated maxima in many rows
    return [torch.randint(0, 7, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS)]


def make_watch(model):
    from instability_watch import InstabilityWatch, WatchConfig

    # switches decided from the statistics reduced over ranks: a rising multi-max rate on these data
    cfg = WatchConfig(probe_every=1, shadow_every=2, spectral_every=1, log_every=3, warmup_steps=2, sustain=1,
                      auto_switch=True)
    seen = []
    watch = InstabilityWatch(model, cfg, listeners=[lambda r: seen.extend(r.metrics)])
    watch.seen = seen  # every read-back's per-step metrics
    return watch


GATHERS = {"whole_params": 0, "unit_gathers": 0}


def _count_gathers():
    """Count, in GATHERS, the FSDP1 reads the watch makes: whole_params all-reduces, unit gathers."""
    import instability_watch.model.sharding as sharding
    import instability_watch.observe.observation as observation

    whole, unit = sharding.whole_params, sharding.full_params

    def counted_whole(*a, **k):
        GATHERS["whole_params"] += 1
        return whole(*a, **k)

    def counted_unit(u, *a, **k):
        GATHERS["unit_gathers"] += u is not None
        return unit(u, *a, **k)

    observation.whole_params = counted_whole
    sharding.full_params = counted_unit


def train(name, model, watch, opt, data, first, last, shard):
    """Steps ``first..last``; ``shard`` None: both halves as micro-batches, else this rank's half."""
    half = GLOBAL_BATCH // 2
    for step in range(first, last + 1):
        ids = data[step - 1]
        if shard is None:
            losses = []
            for r in range(2):
                loss = loss_of(name, model, ids[r * half:(r + 1) * half])
                (loss * 0.5).backward()
                losses.append(loss.detach())
            loss = (losses[0] + losses[1]) * 0.5
        else:
            loss = loss_of(name, model, ids[shard * half:(shard + 1) * half])
            loss.backward()
        opt.step()
        opt.zero_grad()
        if name == "llama" and step == 2 and not watch.switched:
            watch.switch(1, 1)  # RoPE leaves few repeated maxima to switch on: a manual switch, on every rank
        watch.step(loss.detach())
        if step == RESUME_AT:  # where the fsdp2 run checkpoints: every mode reads back there
            watch.flush()
    watch.flush()


def reference_sigma(model, watch, mode):
    """sigma_max per layer and head of the whole float64 W_Q (gathered where sharded)."""
    out = []
    for site in watch.observation.sites:
        if mode.startswith("fsdp1"):
            from instability_watch.model.sharding import fsdp1_units, full_params, innermost_unit

            unit = innermost_unit(site.layer.module, fsdp1_units([model]))
            with full_params(unit):
                w = getattr(site.layer.w_q, "own", site.layer.w_q)().detach().clone()
        else:
            w = site.layer.w_q().detach()
            if hasattr(w, "full_tensor"):
                w = w.full_tensor()
        out.append(torch.linalg.matrix_norm(w.double(), ord=2).tolist())
    return out


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    return x


def summary(model, watch, mode):
    return {
        "steps": watch.step_count,
        "switched": sorted([layer, head, s] for (layer, head), s in watch.switched.items()),
        "alerts": [[a.step, a.layer, a.head, a.kind] for a in watch.alerts],
        "disabled": dict(watch.disabled),
        "metrics": [{"step": m.step, "loss": m.loss, **{k: v.tolist() for k, v in m.values.items()}}
                    for m in watch.seen],
        "sigma_ref": reference_sigma(model, watch, mode),
        "coverage": [c.to_dict() if hasattr(c, "to_dict") else str(c) for c in watch.coverage()],
        "problems": watch.faults.reported,
    }


def shard_fsdp2(model, blocks):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(rank, mode, name, out_dir):
    data = batches()
    model, blocks = build(name)
    if mode == "fsdp2":
        model = shard_fsdp2(model, blocks)
    elif mode == "fsdp2compiled":
        torch._dynamo.reset()
        for block in blocks:
            block.compile(backend="aot_eager")
        model = shard_fsdp2(model, blocks)
    elif mode in ("fsdp1", "fsdp1fail", "fsdp1units", "fsdp1layers"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        # fsdp1layers and fsdp1fail wrap each attention module as its own unit: its weights then straddle the two
        # ranks (half of c_attn's elements in rank 1's piece), where a block puts them all in rank 0's half
        unit = type(blocks[0].attn) if mode in ("fsdp1layers", "fsdp1fail") else type(blocks[0])
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({unit}), device_id=torch.device("cpu"),
                     use_orig_params=mode != "fsdp1units")
    watch = make_watch(model)
    if mode == "fsdp1fail" and rank == 1:
        layer = watch.observation.sites[0].layer
        own = layer.w_q

        def failing():
            if watch.step_count >= 2:  # recorded as step 3
                raise RuntimeError("injected W_Q failure")
            return own()

        layer.w_q = failing
        failing.own = own  # what reference_sigma reads
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    shard = None if mode == "single" else rank
    result = {}
    if mode == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        train(name, model, watch, opt, data, 1, RESUME_AT, shard)
        ckpt = os.path.join(out_dir, f"ckpt_{name}")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        watch_state = watch.state_dict()  # read back on every rank first (train() flushed at RESUME_AT)
        assert watch_state["pending_steps"] == [], watch_state["pending_steps"]
        if rank == 0:
            torch.save(watch_state, ckpt + "_watch.pt")
        dist.barrier()
        result["state_at_resume_equal_on_ranks"] = None  # filled by the test from the two files
        result["state_at_resume"] = _clean(json.loads(json.dumps(watch_state, default=str)))
        train(name, model, watch, opt, data, RESUME_AT + 1, STEPS, shard)
        result["run"] = summary(model, watch, mode)
        result["final_state"] = json.loads(json.dumps(_clean(watch.state_dict()), default=str))
        watch.detach()
        # resume: a fresh model, optimizer and watch from the checkpoint (rank 0's watch file)
        model2, blocks2 = build(name)
        model2 = shard_fsdp2(model2, blocks2)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=3e-3)
        msd2, osd2 = get_state_dict(model2, opt2)
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        watch2 = make_watch(model2)
        watch2.load_state_dict(torch.load(ckpt + "_watch.pt", weights_only=False))
        train(name, model2, watch2, opt2, data, RESUME_AT + 1, STEPS, shard)
        result["resumed_state"] = json.loads(json.dumps(_clean(watch2.state_dict()), default=str))
        result["resumed_switched"] = sorted([layer, head, s] for (layer, head), s in watch2.switched.items())
        watch2.detach()
    else:
        import instability_watch.model.sharding as sharding

        # fsdp1fail too: the failing read (layer 0) is followed by layer 1's all-reduce, which rank 1 must join
        sharding.WHOLE_BYTES = 1 if mode in ("fsdp1layers", "fsdp1fail") else 256 * 2 ** 20
        GATHERS.update(whole_params=0, unit_gathers=0)
        train(name, model, watch, opt, data, 1, STEPS, shard)
        result["gathers"] = dict(GATHERS)  # the training steps' (reference_sigma below gathers units too)
        result["run"] = summary(model, watch, mode)
        result["final_state"] = json.loads(json.dumps(_clean(watch.state_dict()), default=str))
        watch.detach()
    with open(os.path.join(out_dir, f"{mode}_{name}_rank{rank}.json"), "w") as f:
        json.dump(_clean(result), f)


def run_all(rank, jobs, out_dir, port, world):
    _count_gathers()
    single = [name for mode, name in jobs if mode == "single"]
    for name in single[rank::world]:
        run(0, "single", name, out_dir)  # one process alone: its file says rank 0
    sharded = [(mode, name) for mode, name in jobs if mode != "single"]
    if not sharded:
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for mode, name in sharded:
        run(rank, mode, name, out_dir)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out_dir, port = sys.argv[1], int(sys.argv[2])
    jobs = [tuple(job.split(":")) for job in sys.argv[3:]]
    if all(mode == "single" for mode, _ in jobs):
        run_all(0, jobs, out_dir, port, 1)
    else:
        mp.spawn(run_all, args=(jobs, out_dir, port, 2), nprocs=2, join=True)
