"""What the Hugging Face ``Trainer`` callback checks and adapts before the watch attaches: the model the
Trainer trains (under its wrappers), the parallelism it refuses (DeepSpeed, tensor/context/sequence/pipeline
parallelism), and FSDP1's flat parameters. Framework facts only: no import of ``transformers`` here."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from instability_watch.model.layer import AttentionLayer, find_attention_layers
from instability_watch.model.sharding import fsdp1_class, fsdp1_units, full_params, innermost_unit, zero3_parameters
from instability_watch.ranks import distributed


def unwrap(model: nn.Module) -> nn.Module:
    """The module the user gave the Trainer: without DDP / DataParallel / FSDP1 / ``torch.compile`` wrappers.

    Under FSDP1 the Trainer passes callbacks its ``FullyShardedDataParallel`` root
    (``trainer.model`` is replaced by it); its ``.module`` is the user's model
    (FSDP1's ``_fsdp_wrapped_module``). FSDP2 shards the model in place: nothing to unwrap.
    """
    fsdp1 = fsdp1_class()
    for _ in range(8):
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif fsdp1 is not None and isinstance(model, fsdp1):
            model = model.module
        elif hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        else:
            break
    return model


_WRAPPER_LEVELS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A module's qualified name without the levels wrappers insert (``model.layers.0._fsdp_wrapped_module.self_attn``
    -> ``model.layers.0.self_attn``)."""
    for level in _WRAPPER_LEVELS:
        name = name.replace(level, "")
    return name


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def fsdp2_class():
    """FSDP2's ``FSDPModule`` class (``None`` where this torch has none)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch, or built without distributed
        return None
    return FSDPModule


def sharding_of(model: nn.Module, wrapper: nn.Module) -> Optional[str]:
    """``"fsdp1"``, ``"fsdp2"`` or ``None``: how the weights of ``model`` (inside ``wrapper``) are sharded."""
    if fsdp1_units([wrapper, model]):
        return "fsdp1"
    fsdp2 = fsdp2_class()
    if fsdp2 is not None and any(isinstance(m, fsdp2) for m in model.modules()):
        return "fsdp2"
    return None


def _accelerate_state(name: str) -> Any:
    """An attribute of Accelerate's (already initialised) ``AcceleratorState``, or ``None``; creates nothing."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:  # pragma: no cover - the Trainer needs accelerate
        return None
    return getattr(AcceleratorState, "_shared_state", {}).get(name)


def _deepspeed(args: Any) -> Tuple[bool, Optional[int]]:
    """Whether the run is configured for DeepSpeed, and its ZeRO stage where it can be told."""
    used = bool(getattr(args, "deepspeed", None)) or _truthy_env("ACCELERATE_USE_DEEPSPEED")
    plugin = None
    if "DEEPSPEED" in str(_accelerate_state("distributed_type") or ""):
        used = True
        plugin = getattr(_accelerate_state("deepspeed_plugin"), "zero_stage", None)
    stage = None
    hf_config = getattr(args, "hf_deepspeed_config", None)
    if hf_config is not None and callable(getattr(hf_config, "is_zero3", None)):
        stage = 3 if hf_config.is_zero3() else None
    if stage is None and isinstance(plugin, int):
        stage = plugin
    config = getattr(args, "deepspeed", None)
    if stage is None and isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, ValueError):
            config = None
    if stage is None and isinstance(config, dict):
        value = (config.get("zero_optimization") or {}).get("stage")
        stage = value if isinstance(value, int) else None
    return used, stage


def _parallel_sizes(args: Any, model: nn.Module) -> Dict[str, int]:
    """Tensor / context / sequence / pipeline parallel degrees > 1 configured for this run."""
    out: Dict[str, int] = {}
    configs = [getattr(args, "parallelism_config", None), _accelerate_state("parallelism_config"),
               getattr(getattr(model, "config", None), "distributed_config", None)]
    for pc in configs:
        for name in ("tp_size", "cp_size", "sp_size", "pp_size"):
            value = getattr(pc, name, None)
            if isinstance(value, int) and value > 1:
                out.setdefault(name, value)
    value = getattr(model, "_tp_size", None)  # from_pretrained(tp_plan=...) / distributed_config
    if isinstance(value, int) and value > 1:
        out.setdefault("tp_size", value)
    return out


_PARALLEL_WHY = {
    "tp_size": "tensor parallelism (tp_size={}) splits each attention layer's heads across ranks: each rank sees "
               "only some heads",
    "sp_size": "sequence parallelism (sp_size={}, Ulysses) splits each attention layer's heads across ranks: each "
               "rank sees only some heads",
    "cp_size": "context parallelism (cp_size={}) splits each sequence across ranks: each rank sees only some of "
               "the queries and keys of a head",
    "pp_size": "pipeline parallelism (pp_size={}) puts different layers on different ranks",
}


def _mesh_parallelism(model: nn.Module) -> Optional[str]:
    """A ``DTensor`` parameter's mesh dimension that splits heads or sequences (``tp``, ``cp``, ``sp``), if any."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None or type(p).__name__ != "DTensor":
            continue
        for name, size in zip(getattr(mesh, "mesh_dim_names", None) or (), tuple(mesh.shape)):
            if size > 1 and name in ("tp", "cp", "sp"):  # FSDP's own dims: "dp_shard", "dp_shard_cp", "fsdp", ...
                return f"{name}={size}"
    return None


def unsupported(args: Any, model: nn.Module, wrapper: Optional[nn.Module] = None) -> Optional[str]:
    """Why this run cannot be watched (``None`` if it can).

    ``model`` is the user's model, ``wrapper`` what the Trainer passed to the
    callbacks (FSDP1's root, or ``model`` itself). Every head's ``W_Q`` must be
    readable whole (FSDP1 and FSDP2 are gathered by the engine) and every rank
    must see every head of every layer.
    """
    wrapper = model if wrapper is None else wrapper
    used, stage = _deepspeed(args)
    if zero3_parameters(model) or (used and stage == 3):
        return ("DeepSpeed ZeRO-3 partitions every parameter, W_Q included, and the watch has no gather for "
                "DeepSpeed's partitions; use FSDP instead (TrainingArguments(fsdp=True, fsdp_config=...)): the "
                "watch gathers W_Q under FSDP1 and FSDP2 (DeepSpeed ZeRO 1/2 keep W_Q whole but are not tested "
                "with this callback)")
    if used:
        at = f"ZeRO stage {stage}" if stage is not None else "its ZeRO stage not known"
        return (f"DeepSpeed ({at}) is not tested with this callback, so it is refused rather than watched "
                "unchecked; train with DDP or FSDP (TrainingArguments(fsdp=True, fsdp_config=...))")
    sizes = _parallel_sizes(args, model)
    for name, why in _PARALLEL_WHY.items():
        if name in sizes:
            return why.format(sizes[name])
    mesh = _mesh_parallelism(model)
    if mesh is not None:
        return (f"the parameters are DTensors on a device mesh with {mesh}: the attention is split across ranks "
                "(tensor / context / sequence parallelism), each rank sees only some heads or positions")
    if sharding_of(model, wrapper) is None and any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return ("the parameters are DTensors but the model is not sharded by FSDP2 (fully_shard): presumably "
                "tensor parallelism, where each rank sees only some heads")
    if int(getattr(args, "n_gpu", 1) or 1) > 1:
        return ("nn.DataParallel (several GPUs in one process) replicates the model at every step, out of the "
                "watch's sight; launch one process per GPU instead (torchrun / accelerate launch: DDP)")
    return None


def all_true(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    if not distributed():
        return flag
    flags: List[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(flags, bool(flag))
    return all(flags)


def fsdp1_layers(layers: List[AttentionLayer], model: nn.Module, wrapper: nn.Module, *,
                  relocate: bool) -> List[AttentionLayer]:
    """The layers of an FSDP1 model, located and checked on whole weights: a collective (every rank).

    Outside FSDP1's forward a parameter is a piece of the rank's flat shard (``use_orig_params=True``:
    the Trainer's default) or not usable at all, and a locator that reads a weight's shape when it
    locates (GPT-2's ``Conv1D``) would read the piece. So each layer is located again inside
    ``summon_full_params`` of the innermost FSDP1 unit holding it (one unit at a time, as on
    spectral steps), and its ``W_Q`` read there once: every rank must see the same
    ``(heads, head_dim, d_in)``, else a ``ValueError`` on every rank.
    """
    units = fsdp1_units([wrapper, model])
    inner = {id(m) for u in units for m in u.modules() if m is not u and m in units}
    for root in [u for u in units if id(u) not in inner]:
        # before any forward: FSDP1 takes the first unit it gathers for the root; gather the real
        # root first (its own parameters only), so that a layer's unit is not taken for one
        with fsdp1_class().summon_full_params(root, recurse=False, writeback=False):
            pass
    out: List[AttentionLayer] = []
    seen: List[Any] = []
    for layer in layers:
        try:
            with full_params(innermost_unit(layer.module, units)):
                if relocate:
                    again = [x for x in find_attention_layers(layer.module) if x.module is layer.module]
                    if len(again) == 1 and again[0].num_heads == layer.num_heads:
                        layer = dataclasses.replace(again[0], name=layer.name)
                w = layer.w_q()
                shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        except Exception as exc:  # noqa: BLE001 - said on every rank below
            shape = f"{type(exc).__name__}: {exc}"
        out.append(layer)
        seen.append((layer.name, layer.num_heads, shape))
    ranks: List[Any] = [seen]
    if distributed():
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, seen)
    for r, rank_seen in enumerate(ranks):
        for (name, heads, shape), (_, _, shape0) in zip(rank_seen, ranks[0]):
            good = isinstance(shape, tuple) and len(shape) == 3 and shape[0] == heads and min(shape) > 0
            if not good or shape != shape0 or len(rank_seen) != len(ranks[0]):
                raise ValueError(
                    f"InstabilityWatchTrainerCallback: under FSDP1, W_Q of layer {name!r} read inside "
                    f"summon_full_params is {shape} on rank {r} and {shape0} on rank 0 (expected ({heads}, head_dim, "
                    "d_in) on every rank): its locator does not read the whole weight. Use FSDP2 "
                    "(fsdp_config={'version': 2}) or fsdp_config={'use_orig_params': False}, or pass layers= "
                    "whose w_q() reads the weight when called")
    return out
