"""What the watch costs on a training step of models nobody here wrote, against the same model unwatched.

Hugging Face models built from their configs (``GPT2Config()`` as shipped:
GPT-2 small with its dropout; a ~1.1B Llama with GQA 32/4, TinyLlama's shape),
trained in a plain loop under ``torch.autocast(bfloat16)`` with AdamW, attention
by PyTorch's SDPA at its default backend (cuDNN on an H100). Two copies of the
model train side by side in one process, in interleaved blocks of steps:

* ``plain``  -- no watch;
* ``watch``  -- ``InstabilityWatch(model)`` at the ``WatchConfig`` defaults, attached
  once, for the whole run.

Both copies see the same batches, so they do the same work (the watch does not
change training). The ratio per round is plain time / watch time; the table gives
the median over rounds, and (``est.``, on CUDA) the ratio the watched copy's own
median step times give at its cadence: plain / (plain + (probe - plain) / probe_every),
for models whose rounds scatter more than the watch costs (host-bound ones; a read-back
on a step other than a probe step is not in it), and (``paired``, on CUDA) the unwatched copy's median
step over the watched copy's at its cadence (both from CUDA events around every step of the same
interleaved blocks: a side-by-side ratio that a round's drift moves less, though the two copies may
differ by more than the watch costs; ``--toggle-rounds`` adds rounds on one copy, a watch attached for one block
and none for the next, which have no such difference). Then the cost of each kind of step, measured on the plain copy
with a watch attached for one block (its first steps untimed):

* ``probe``    -- a statistics pass on every step (``probe_every=1``, no shadow);
* ``shadow``   -- statistics and shadow on every step;
* ``switched`` -- one layer switched, all its heads on the stabilized kernel, no probes;
* ``clip``     -- ``probe`` with ``qk_clip="always"`` (tau 100): the clip's cost is ``clip`` - ``probe``
  (its in-place multiplies run whether or not a head is over tau).

Entry points other than plain SDPA calls (issue 43), on packed batches (documents of random lengths in one row,
``position_ids`` restarting per document, ``use_cache=False``: what ``DataCollatorWithFlattening`` gives a model):

* ``packed-sdpa`` / ``packed-flex`` -- a Llama (12 layers, 1024 wide, 16 query heads on 4) built with
  ``attn_implementation="sdpa"`` / ``"flex_attention"`` (HF compiles its flex calls); HF builds the document mask;
* ``packed-varlen`` -- the same shape with attention by ``torch.nn.attention.varlen.varlen_attn`` from the
  documents' ``cu_seqlens`` (a model written here, Llama-style ``q_proj``/``k_proj``);
* ``packed-fa4`` -- that model with attention by flash-attn 4's ``flash_attn_varlen_func`` (``flash_attn.cute``,
  installed by ``benchmarks/fa4_contact.sh``); ``packed-hf-fa4`` -- the Llama built with
  ``attn_implementation="flash_attention_4"`` (the documents' flash-attention kwargs passed as the collator
  passes them).

Run:  python benchmarks/observer_overhead.py [--models hf-gpt2,hf-llama-1b] [--rounds 4] [--block 40]
                                             [--json out.json]
      python benchmarks/observer_overhead.py --models packed-sdpa,packed-flex,packed-varlen
      python benchmarks/observer_overhead.py --models packed-fa4,packed-hf-fa4      (with flash-attn 4)
"""
from __future__ import annotations

import argparse
import copy
import inspect
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from instability_watch import InstabilityWatch, WatchConfig

from _common import device_name, sync, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def hf_gpt2(tiny: bool):
    import transformers as t

    cfg = t.GPT2Config() if not tiny else t.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=512)
    cfg._attn_implementation = "sdpa"
    seq, batch = (1024, 16) if not tiny else (64, 2)
    return t.GPT2LMHeadModel(cfg), cfg.vocab_size, batch, seq


def hf_llama_1b(tiny: bool):
    import transformers as t

    if tiny:
        cfg = t.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
        seq, batch = 64, 2
    else:  # TinyLlama-1.1B's shape: 22 layers, 2048 wide, 32 query heads on 4 KV heads
        cfg = t.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                            num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
        seq, batch = 2048, 4
    cfg._attn_implementation = "sdpa"
    return t.LlamaForCausalLM(cfg), cfg.vocab_size, batch, seq


def nanogpt_small(tiny: bool):
    """The package's nanoGPT-style GPT-2 small (no dropout, nanoGPT's padded vocabulary), as the main job trains it."""
    from nanogpt import GPT, GPTConfig

    if tiny:
        return _NanoLM(GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64))), 512, 2, 64
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    return _NanoLM(GPT(cfg)), 50304, 16, 1024


class _NanoLM(torch.nn.Module):
    """nanoGPT's (logits, loss) behind the Hugging Face call signature used here."""

    def __init__(self, gpt) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, labels):
        return _Out(self.gpt(input_ids, labels)[1])


class _Out:
    def __init__(self, loss) -> None:
        self.loss = loss


def _documents(g: torch.Generator, total: int, lo: int, hi: int) -> List[int]:
    """Random document lengths in [lo, hi) filling ``total`` tokens exactly (the last one cut)."""
    lengths, n = [], 0
    while n < total:
        lengths.append(min(total - n, int(torch.randint(lo, hi, (1,), generator=g))))
        n += lengths[-1]
    return lengths


def _packed_batch(vocab: int, total: int, lo: int, hi: int, varlen: bool, flash_kwargs: bool = False):
    """A packed row: ``input_ids``/``labels`` (1, total), ``position_ids`` restarting per document (and, for the
    varlen model, ``cu_seqlens`` and ``max_len``; with ``flash_kwargs``, the documents' ``cu_seq_lens_q/k`` and
    ``max_length_q/k`` as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives them: Hugging Face's
    flash-attention integrations otherwise find them from ``position_ids``, the lengths as 0-d tensors, which
    flash-attn 4 4.0.0b36 refuses)."""
    def make(g: torch.Generator) -> dict:
        lengths = _documents(g, total, lo, hi)
        ids = torch.randint(0, vocab, (1, total), generator=g)
        batch = {"input_ids": ids, "labels": ids,
                 "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)}
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        if varlen:
            batch["cu_seqlens"] = cu
            batch["max_len"] = max(lengths)
        if flash_kwargs:
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        return batch
    return make


def _llama_cfg(tiny: bool, impl: str):
    import transformers as t

    if tiny:
        cfg = t.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, use_cache=False)
    else:
        cfg = t.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                            num_key_value_heads=4, vocab_size=32000, max_position_embeddings=8192, use_cache=False)
    cfg._attn_implementation = impl
    return cfg


def _packed_hf(impl: str):
    def build(tiny: bool):
        import transformers as t

        cfg = _llama_cfg(tiny, impl)
        total, lo, hi = (128, 8, 40) if tiny else (8192, 128, 2048)
        return t.LlamaForCausalLM(cfg), cfg.vocab_size, 1, total, _packed_batch(
            cfg.vocab_size, total, lo, hi, False, flash_kwargs=impl.startswith("flash_attention"))
    return build


class _VarlenAttention(torch.nn.Module):
    """Llama-style projections, RoPE-free, attention by ``varlen_attn`` over the batch's documents."""

    def __init__(self, dim: int, heads: int, kv_heads: int, fa4: bool = False) -> None:
        super().__init__()
        self.num_heads, self.kv, self.hd, self.fa4 = heads, kv_heads, dim // heads, fa4
        self.q_proj = torch.nn.Linear(dim, dim, bias=False)
        self.k_proj = torch.nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v_proj = torch.nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o_proj = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, cu, max_len):
        from torch.nn.attention.varlen import varlen_attn

        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.hd)
        k = self.k_proj(x).view(T, self.kv, self.hd)
        v = self.v_proj(x).view(T, self.kv, self.hd)
        if self.fa4:  # flash-attn 4 (GQA native; returns (out, lse))
            from flash_attn.cute import flash_attn_varlen_func

            o = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                       max_seqlen_k=max_len, causal=True)[0]
        elif "enable_gqa" in inspect.signature(varlen_attn).parameters:  # torch >= 2.12
            o = varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), enable_gqa=self.kv < self.num_heads)
        else:  # torch 2.11: no GQA, keys and values repeated per query head
            g = self.num_heads // self.kv
            o = varlen_attn(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), cu, cu, max_len, max_len,
                            window_size=(-1, 0))
        return self.o_proj(o.reshape(T, -1))


class _VarlenBlock(torch.nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int, kv_heads: int, fa4: bool) -> None:
        super().__init__()
        self.n1, self.n2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.attn = _VarlenAttention(dim, heads, kv_heads, fa4)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, hidden, bias=False), torch.nn.SiLU(),
                                       torch.nn.Linear(hidden, dim, bias=False))

    def forward(self, x, cu, max_len):
        x = x + self.attn(self.n1(x), cu, max_len)
        return x + self.mlp(self.n2(x))


class _VarlenLM(torch.nn.Module):
    def __init__(self, cfg, fa4: bool = False) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.emb = torch.nn.Embedding(cfg.vocab_size, d)
        self.blocks = torch.nn.ModuleList(_VarlenBlock(d, cfg.intermediate_size, cfg.num_attention_heads,
                                                       cfg.num_key_value_heads, fa4)
                                          for _ in range(cfg.num_hidden_layers))
        self.norm = torch.nn.RMSNorm(d)
        self.head = torch.nn.Linear(d, cfg.vocab_size, bias=False)

    def forward(self, input_ids, labels, position_ids, cu_seqlens, max_len):
        x = self.emb(input_ids[0])
        for b in self.blocks:
            x = b(x, cu_seqlens, max_len)
        logits = self.head(self.norm(x)).float()
        return _Out(torch.nn.functional.cross_entropy(logits[:-1], labels[0, 1:]))


def packed_varlen(tiny: bool, fa4: bool = False):
    cfg = _llama_cfg(tiny, "sdpa")
    total, lo, hi = (128, 8, 40) if tiny else (8192, 128, 2048)
    return _VarlenLM(cfg, fa4), cfg.vocab_size, 1, total, _packed_batch(cfg.vocab_size, total, lo, hi, True)


def packed_fa4(tiny: bool):
    return packed_varlen(tiny, fa4=True)


MODELS: Dict[str, Callable] = {"hf-gpt2": hf_gpt2, "hf-llama-1b": hf_llama_1b, "nanogpt-small": nanogpt_small,
                               "packed-sdpa": _packed_hf("sdpa"), "packed-flex": _packed_hf("flex_attention"),
                               "packed-varlen": packed_varlen, "packed-fa4": packed_fa4,
                               "packed-hf-fa4": _packed_hf("flash_attention_4")}


class Copy:
    """One copy of the model with its optimizer (and, for the watched copy, its watch)."""

    def __init__(self, model, device, watch_config: Optional[WatchConfig] = None, compile: bool = False) -> None:
        self.model = model.to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device == "cuda")
        self.watch = InstabilityWatch(self.model, watch_config) if watch_config is not None else None
        self.forward = torch.compile(self.model) if compile else self.model  # after the watch attached
        self.events: List[tuple] = []  # (step kind, start, end) CUDA events, read after the run
        self.recording = True  # CUDA events around each step (off after the timed rounds)

    def step(self, batch: dict, device: str) -> None:
        record = device == "cuda" and self.recording
        if record:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = self.forward(**batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        kind = "unwatched"
        if self.watch is not None:
            probe = (self.watch.step_count % self.watch.config.probe_every) == 0  # the step now closing
            self.watch.step(loss)
            kind = "probe" if probe else "plain"
        if record:
            end.record()
            self.events.append((kind, start, end))

    def step_times(self) -> Dict[str, float]:
        """Median milliseconds of the copy's steps by kind (from CUDA events): the watched copy's probe steps and
        its other steps ("plain"), the unwatched copy's ("unwatched")."""
        torch.cuda.synchronize()
        by: Dict[str, List[float]] = {}
        for kind, a, b in self.events:
            by.setdefault(kind, []).append(a.elapsed_time(b))
        return {k: statistics.median(v) for k, v in by.items()}


def profile_steps(name: str, c: Copy, batches: Callable[[int], List[dict]], device: str, folder: str) -> None:
    """Kernel tables of one ordinary step and one probe step (with its shadow and sigma(W_Q), as the cadence has
    them) of the watched copy, into ``folder/steps_<name>_<kind>.txt``: where a probe step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    every = c.watch.config.probe_every
    while c.watch.step_count % every == 0:  # the step about to run is an ordinary one
        c.step(batches(1)[0], device)
    sync(device)
    for kind in ("plain", "probe"):
        if kind == "probe":  # run up to the next probe step (steps 1, 1 + every, ...: step_count a multiple)
            for batch in batches((-c.watch.step_count) % every):
                c.step(batch, device)
            sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            c.step(batches(1)[0], device)
            sync(device)
            wall = (time.perf_counter() - t0) * 1e3
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in events) / 1e3
        via = "_via_mask" if name.endswith("flex") and _flex_via_mask() else ""
        path = os.path.join(folder, f"steps_{name}{via}_{kind}.txt")
        with open(path, "w") as f:
            f.write(f"{name}, one {kind} step: wall {wall:.2f} ms, GPU busy {busy:.2f} ms\n")
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=50))
        events.sort(key=lambda e: e.self_device_time_total, reverse=True)
        top = ", ".join(f"{e.key[:36]} {e.self_device_time_total / 1e3:.2f}" for e in events[:5])
        print(f"[{name}] profile, {kind} step: wall {wall:.2f} ms, GPU busy {busy:.2f} ms; top: {top}", flush=True)


def _flex_via_mask() -> bool:
    import instability_watch.kernels.stats.flex as flex_stats

    return flex_stats.VIA_MASK


def timed(c: Copy, batches: List[dict], device: str, skip: int = 0) -> float:
    """Seconds per step over ``batches`` (the first ``skip`` steps run untimed)."""
    for batch in batches[:skip]:
        c.step(batch, device)
    sync(device)
    t0 = time.perf_counter()
    for batch in batches[skip:]:
        c.step(batch, device)
    sync(device)
    return (time.perf_counter() - t0) / max(1, len(batches) - skip)


def toggled(name: str, c: Copy, batches: Callable[[int], List[dict]], device: str, args) -> dict:
    """The watch's cost on one copy of the model: blocks of ``args.block`` steps with a watch (the default config)
    attached and with none, alternating (``args.toggle_rounds`` rounds, the order flipped each round; each block's
    first two steps untimed: the attach and the first probe step out of it, the cadence kept in the rest). The two
    copies of the side-by-side rounds can differ by more than the watch costs (their steps did by up to 5%); here
    both blocks run the same modules, memory and compiled graphs. A round's ratio (``ratios``): the unwatched
    block's seconds per step over the watched block's (wall clock). On CUDA also ``median_ratios``, from CUDA
    events around each step: the unwatched block's median step over the watched block's medians at its cadence
    (plain + (probe - plain) / probe_every), which a block's few slow steps move less."""
    ratios, median_ratios, on_ms, off_ms = [], [], [], []
    c.recording = True
    for r in range(args.toggle_rounds):
        times, medians = {}, {}
        for watched in ((True, False) if r % 2 == 0 else (False, True)):
            data = batches(args.block + 2)
            if watched:
                c.watch = InstabilityWatch(c.model, WatchConfig())
            c.events.clear()
            times[watched] = timed(c, data, device, skip=2)
            if device == "cuda":
                c.events = c.events[2:]
                steps = c.step_times()
                if watched:
                    every = c.watch.config.probe_every
                    medians[watched] = steps["plain"] + (steps.get("probe", steps["plain"]) - steps["plain"]) / every
                else:
                    medians[watched] = steps["unwatched"]
            if watched:
                c.watch.flush()
                c.watch.detach()
                c.watch = None
        on_ms.append(1e3 * times[True])
        off_ms.append(1e3 * times[False])
        ratios.append(times[False] / times[True])
        if medians:
            median_ratios.append(medians[False] / medians[True])
        print(f"[{name}] toggled round {r}: unwatched {off_ms[-1]:.2f} ms/step, watched {on_ms[-1]:.2f} ms/step, "
              f"ratio {ratios[-1]:.4f}" + (f"; medians {medians[False]:.2f} / {medians[True]:.2f} ms, ratio "
                                           f"{median_ratios[-1]:.4f}" if medians else ""), flush=True)
    c.events.clear()
    c.recording = False
    out = {"rounds": args.toggle_rounds, "block": args.block, "ratios": ratios, "watched_ms": on_ms,
           "unwatched_ms": off_ms, "median": statistics.median(ratios),
           "ratio_of_medians": statistics.median(off_ms) / statistics.median(on_ms)}
    if median_ratios:
        out["median_ratios"] = median_ratios
        out["median_of_median_ratios"] = statistics.median(median_ratios)
    return out


KINDS = {
    "probe": dict(probe_every=1, shadow_every=0, spectral_every=0),
    "shadow": dict(probe_every=1, shadow_every=1, spectral_every=0),
    "switched": dict(probe_every=10 ** 9, shadow_every=0, spectral_every=0),
    "clip": dict(probe_every=1, shadow_every=0, spectral_every=0, qk_clip="always"),
}


def bench(name: str, args, device: str) -> dict:
    torch.manual_seed(0)
    base, vocab, batch, seq, *make = MODELS[name](args.tiny)
    plain = Copy(copy.deepcopy(base), device, compile=args.compile)
    watched = Copy(base, device, WatchConfig(), compile=args.compile)
    g = torch.Generator().manual_seed(0)

    def one() -> dict:
        if make:  # a packed row: its own tensors (and ints)
            return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in make[0](g).items()}
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        return {"input_ids": ids, "labels": ids}

    def batches(n):
        return [one() for _ in range(n)]

    for c in (plain, watched):  # warm-up: allocator, cuDNN plans, compiled graphs, the first probe and read-back
        timed(c, batches(12 if args.compile else 3), device)
        c.events.clear()
    ratios, t_plain, t_watch = [], [], []
    for r in range(args.rounds):
        data = batches(args.block)
        order = (plain, watched) if r % 2 == 0 else (watched, plain)
        times = {id(c): timed(c, data, device) for c in order}
        t_plain.append(times[id(plain)])
        t_watch.append(times[id(watched)])
        ratios.append(times[id(plain)] / times[id(watched)])
        print(f"[{name}] round {r}: plain {1e3 * t_plain[-1]:.2f} ms/step, watch {1e3 * t_watch[-1]:.2f} "
              f"ms/step, ratio {ratios[-1]:.4f}", flush=True)
    watched.watch.flush()
    coverage = [c.to_dict() for c in watched.watch.coverage()]
    unobserved = sum(sum(c["unobserved_calls"].values()) for c in coverage)
    out = {
        "model": name, "batch": batch, "seq": seq, "layers": len(watched.watch.head_counts),
        "heads": watched.watch.head_counts[0], "rounds": args.rounds, "block": args.block,
        "plain_ms": [1e3 * t for t in t_plain], "watch_ms": [1e3 * t for t in t_watch], "ratios": ratios,
        "ratio_median": statistics.median(ratios), "unobserved_calls": unobserved,
        "observed_calls": sum(c["observed_calls"] for c in coverage), "coverage": coverage,
        "alerts": len(watched.watch.alerts), "kinds": {}, "compile": args.compile,
        "watched_step_ms": watched.step_times() if device == "cuda" else {},
        "unwatched_step_ms": plain.step_times().get("unwatched") if device == "cuda" else None,
    }
    plain.recording = watched.recording = False  # (the per-kind costs below time the plain copy by wall clock)
    if args.compile:
        from torch._dynamo.utils import counters

        out["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
        print(f"[{name}] dynamo: {out['dynamo']}", flush=True)
    steps = out["watched_step_ms"]
    if "plain" in steps and "probe" in steps:  # the medians at the watch's cadence: a probe step every probe_every
        every = watched.watch.config.probe_every
        at_cadence = steps["plain"] + (steps["probe"] - steps["plain"]) / every
        out["estimated_ratio"] = steps["plain"] / at_cadence
        if out["unwatched_step_ms"]:  # side by side: the unwatched copy's median step, in the same blocks
            out["paired_ratio"] = out["unwatched_step_ms"] / at_cadence
    print(f"[{name}] watched copy, median ms per step: {steps}; estimated ratio at the cadence: "
          f"{out.get('estimated_ratio', float('nan')):.4f}; unwatched copy's median step "
          f"{out['unwatched_step_ms'] or float('nan'):.2f} ms, paired ratio (unwatched median / watched at the "
          f"cadence) {out.get('paired_ratio', float('nan')):.4f}", flush=True)
    if args.profile and device == "cuda":
        profile_steps(name, watched, batches, device, args.profile)
    watched.watch.detach()
    if args.toggle_rounds:
        out["toggled"] = toggled(name, plain, batches, device, args)
    # -- the cost of each kind of step, on the plain copy
    for kind, cfg in (() if args.compile else KINDS.items()):
        costs = []
        for r in range(args.kind_rounds):
            data = batches(args.kind_block + 2)
            ref = timed(plain, data, device, skip=2)
            watch = InstabilityWatch(plain.model, WatchConfig(log_every=10 ** 6, **cfg))
            if kind == "switched":
                for h in range(watch.head_counts[0]):
                    watch.switch(0, h)
            plain.watch = watch
            t = timed(plain, data, device, skip=2)
            plain.watch = None
            watch.flush()
            cov = watch.coverage()[0]
            watch.detach()
            costs.append(t / ref - 1)
        if not costs:
            continue
        out["kinds"][kind] = {"costs": costs, "median": statistics.median(costs),
                              "layer0_not_applied": cov.not_applied, "layer0_kernel_calls": cov.kernel_calls}
        print(f"[{name}] {kind}: {', '.join(f'{100 * c:+.2f}%' for c in costs)}", flush=True)
    del plain, watched, base
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="hf-gpt2,hf-llama-1b,nanogpt-small")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=50, help="steps per timed block (the defaults probe every 10)")
    ap.add_argument("--kind-rounds", type=int, default=2)
    ap.add_argument("--kind-block", type=int, default=10)
    ap.add_argument("--toggle-rounds", type=int, default=0,
                    help="also this many rounds of the watch attached and detached on one copy (blocks of --block "
                         "steps, alternating): the side-by-side cost without two copies' differences")
    ap.add_argument("--tiny", action="store_true", help="tiny models (a CPU check of this script)")
    ap.add_argument("--compile", action="store_true", help="torch.compile both copies (after the watch attached); "
                                                           "no per-kind costs")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--flex-stats", choices=("flex", "mask"), default=None,
                    help="the statistics and shadow passes of FlexAttention calls: FlexAttention's own or SDPA's "
                         "over the call's mask (kernels.stats.flex.VIA_MASK); default: the library's (mask)")
    ap.add_argument("--profile", metavar="DIR", help="also a kernel table of one ordinary and one probe step of each "
                                                     "model's watched copy, into DIR (CUDA)")
    args = ap.parse_args()
    import instability_watch.kernels.stats.flex as flex_stats

    if args.flex_stats is not None:
        flex_stats.VIA_MASK = args.flex_stats == "mask"
    args.flex_stats = "mask" if flex_stats.VIA_MASK else "flex"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = [bench(name, args, device) for name in args.models.split(",")]
    if args.json:
        write_json(args.json, {"device": device_name(device), "torch": torch.__version__,
                               "flex_stats": args.flex_stats, "results": results})
    print(f"\n{'model':<14} {'plain ms':>9} {'watch ms':>9} {'ratio':>7} {'range':>15} {'est.':>7} {'paired':>7} {'unobserved':>10}  "
          f"{'probe':>7} {'shadow':>7} {'switched':>8} {'clip':>7}")
    for r in results:
        if "toggled" in r:
            tg = r["toggled"]
            print(f"{r['model']}: toggled on one copy, {tg['rounds']} rounds: ratio median {tg['median']:.4f} "
                  f"(range {min(tg['ratios']):.4f}-{max(tg['ratios']):.4f}), ratio of the medians "
                  f"{tg['ratio_of_medians']:.4f}" + ("" if "median_ratios" not in tg else
                  f"; from CUDA events' medians: {tg['median_of_median_ratios']:.4f} (range "
                  f"{min(tg['median_ratios']):.4f}-{max(tg['median_ratios']):.4f})"))
    for r in results:
        k = r["kinds"]
        if not k:
            print(f"{r['model']:<14} {statistics.median(r['plain_ms']):9.2f} {statistics.median(r['watch_ms']):9.2f} "
                  f"{r['ratio_median']:7.4f} {min(r['ratios']):7.4f}-{max(r['ratios']):.4f} "
                  f"{r['unobserved_calls']:10d}  {'(compiled) ' if r['compile'] else ''}"
                  f"watched copy's steps (ms): {r['watched_step_ms']}")
            continue
        print(f"{r['model']:<14} {statistics.median(r['plain_ms']):9.2f} {statistics.median(r['watch_ms']):9.2f} "
              f"{r['ratio_median']:7.4f} {min(r['ratios']):7.4f}-{max(r['ratios']):.4f} "
              f"{r.get('estimated_ratio', float('nan')):7.4f} {r.get('paired_ratio', float('nan')):7.4f} "
              f"{r['unobserved_calls']:10d}  "
              f"{100 * k['probe']['median']:+6.2f}% {100 * k['shadow']['median']:+6.2f}% "
              f"{100 * k['switched']['median']:+7.2f}% {100 * k['clip']['median']:+6.2f}%"
              + ("" if not k["switched"]["layer0_not_applied"] else
                 f" (switch not applied: {', '.join(k['switched']['layer0_not_applied'])})"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
