"""``InstabilityWatchTrainerCallback``: the watch in a Hugging Face ``transformers.Trainer``.

A thin adapter over :class:`~instability_watch.InstabilityWatch` (all logic
lives in the engine), used as ``Trainer(..., callbacks=[InstabilityWatchTrainerCallback()])``:

* ``on_train_begin``: attaches to the model the Trainer trains (the module you
  gave it, not Accelerate's DDP or FSDP wrapper), restores the watch state from
  the checkpoint being resumed, opens the run directory
  (``<output_dir>/instability_watch`` by default) on the main process;
* ``on_step_end`` (once per optimizer step, also with gradient accumulation):
  one ``watch.step(loss)``;
* ``on_save``: writes the watch state into the Trainer's checkpoint directory
  (``checkpoint-N/instability_watch.pt``);
* ``on_log``: adds the watch's scalars (``instability_watch/...``) to the
  Trainer's next log, so ``state.log_history`` and every ``report_to``
  integration (W&B, TensorBoard, ...) receive them;
* ``on_train_end``: reads back the pending steps, restores the model, closes the files.

Under DDP (``torchrun``; Accelerate) the engine reduces the statistics across
ranks, so every rank switches the same heads at the same step; the main process
prints alert panels and writes the run directory.

Under FSDP (``TrainingArguments(fsdp=True, fsdp_config=...)``) the weights are
sharded; the engine reads ``W_Q`` whole where it needs it (spectral steps):
FSDP2 (``fsdp_config["version"] = 2``, the default: ``fully_shard`` in place,
``DTensor`` parameters) through per-head Grams of the DTensors, FSDP1
(``FullyShardedDataParallel``, which the Trainer hands to callbacks as the
model) inside ``summon_full_params`` of the unit holding each layer; the
callback unwraps FSDP1's root to find the layers and gives the root to the
engine (``watch.sharding_roots``). See :mod:`instability_watch.model.sharding`.
Refused with a ``ValueError`` at train begin: DeepSpeed ZeRO-3 (partitioned
parameters), DeepSpeed ZeRO 1/2 (not tested with this callback), tensor,
context, sequence and pipeline parallelism.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from instability_watch.callbacks.common import missing_extra

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # transformers is an optional dependency
    raise missing_extra("instability_watch.callbacks.hf (InstabilityWatchTrainerCallback)", "Hugging Face transformers",
                        "hf") from exc

from instability_watch.callbacks.common import WatchAdapter, run_dir_under, scalars  # noqa: E402
from instability_watch.callbacks.hf_setup import all_true, clean_name, fsdp1_layers, sharding_of, unsupported, unwrap
from instability_watch.engine.readback import ReadBack
from instability_watch.engine.watch import InstabilityWatch
from instability_watch.model.layer import AttentionLayer, not_found_message
from instability_watch.outputs.rundir import RUN_DIR_NAME
from instability_watch.ranks import broadcast_from_rank_zero, distributed, log_rank_zero, rank

log = logging.getLogger("instability_watch")


STATE_FILE = "instability_watch.pt"  # in each checkpoint directory
_STATE_VERSION = 1
































class InstabilityWatchTrainerCallback(WatchAdapter, TrainerCallback):
    """Watch every attention head while a Hugging Face ``transformers.Trainer`` trains.

    Args:
        config: a :class:`~instability_watch.WatchConfig` (or a dict of its
            fields); the defaults if ``None``.
        layers: ``None`` to find attention layers with the built-in locators
            (Hugging Face GPT-2 / Llama-style / BERT-style and the other
            families in the README), a list of
            :class:`~instability_watch.AttentionLayer`, or a function of the
            model (the module given to the Trainer) returning one.
        run_dir: where to write ``metrics.csv``, ``events.csv`` and
            ``meta.json``. ``None``: ``<args.output_dir>/instability_watch``.
        overwrite: replace a run already in ``run_dir`` (else that is an error,
            except when resuming from a checkpoint holding the watch state).
        write_csv: write the run directory at all.
        console: the rich ``Console`` for alert panels and the live table;
            rich's global console if ``None``.
        alerts: print a panel per alert (main process only).
        live_table: show a live table of the ``top`` worst heads, refreshed at
            every read-back (main process only).
        top: rows in the live table.
        log_scalars: add aggregate scalars (``instability_watch/...``, see
            :meth:`InstabilityWatch.summary`) of the latest read-back to the
            Trainer's next log (``state.log_history`` and ``report_to``).

    Raises:
        TypeError, ValueError: bad arguments, at construction.
        ValueError: at train begin, for a run the watch cannot see whole
            (DeepSpeed ZeRO-3; DeepSpeed ZeRO 1/2, not tested; tensor, context,
            sequence or pipeline parallelism; ``nn.DataParallel``), a model
            with no attention layer the locators find, or a run directory that
            already holds a run (without ``overwrite``). FSDP1 and FSDP2 are
            watched.

    Attributes:
        watch: the :class:`~instability_watch.InstabilityWatch` (from train begin on).
        run_dir: the run directory (on the main process, once opened).
        model: the module the Trainer trains, without its wrappers (from train begin on).
        sharding: ``"fsdp1"``, ``"fsdp2"`` or ``None`` (whole weights on every rank), from train begin on.

    Example::

        from transformers import Trainer, TrainingArguments
        from instability_watch import WatchConfig
        from instability_watch.callbacks.hf import InstabilityWatchTrainerCallback

        cb = InstabilityWatchTrainerCallback(WatchConfig(auto_switch=True))
        Trainer(model=model, args=TrainingArguments("out", bf16=True), train_dataset=ds, callbacks=[cb]).train()
        # then: instability-watch report out/instability_watch
    """

    def _init_state(self) -> None:
        """The adapter's own state (called by ``WatchAdapter.__init__``, after the arguments are checked)."""
        self.model: Optional[nn.Module] = None
        self.sharding: Optional[str] = None
        self._last_step = 0
        self._pending_scalars: Dict[str, float] = {}  # the latest read-back's, for the Trainer's next log
        self._save_failed = False  # reported once
        self._hook = None  # the forward hook on the model that keeps its loss
        self._loss_parts: List[torch.Tensor] = []
        self._loss_summed = False  # the model normalised its loss by the step's token count (num_items_in_batch)
        self._loss_ranks = 1  # ... counted over this many ranks (average_tokens_across_devices)

    # ------------------------------------------------------------------ the callback's place

    def _place(self) -> bool:
        """Run right after ``DefaultFlowCallback``, before the reporting integrations.

        The Trainer puts the ``report_to`` integrations (W&B, TensorBoard, ...)
        before the user's callbacks, and each ``on_log`` sees the same ``logs``
        dict in that order: to reach them, the scalars must be added before them.
        The callback list is the Trainer's ``callback_handler.callbacks``, found
        as the object calling this callback. Returns whether it was found.
        """
        frame = sys._getframe(1)
        handler = None
        try:
            for _ in range(6):
                if frame is None:
                    break
                obj = frame.f_locals.get("self")
                if isinstance(obj, CallbackHandler) and any(cb is self for cb in obj.callbacks):
                    handler = obj
                    break
                frame = frame.f_back
        finally:
            del frame
        if handler is None:
            return False
        callbacks = handler.callbacks
        flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
        target = flow[-1] + 1 if flow else 0
        i = next(i for i, cb in enumerate(callbacks) if cb is self)
        if i > target:  # callbacks after us keep their index: an event being dispatched reaches each once
            callbacks.insert(target, callbacks.pop(i))
        return True

    def on_init_end(self, args, state, control, **kwargs):
        """Take the callback's place in the Trainer's list (see :meth:`_place`)."""
        self._place()

    # ------------------------------------------------------------------ attach

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Attach to the model the Trainer trains, restore the checkpoint's watch state, open the run directory."""
        if not self._place() and self.log_scalars:
            log_rank_zero(logging.WARNING, "instability_watch: could not find the Trainer's callback list; the "
                          "scalars reach state.log_history and the callbacks after this one, but not the report_to "
                          "integrations")
        if self.watch is not None and not self._finished:
            self.close()  # a callback reused for another train() without its end: start clean
        self._start_run()
        self._pending_scalars, self._loss_parts, self._save_failed = {}, [], False
        if model is None:
            raise ValueError("InstabilityWatchTrainerCallback: the Trainer passed no model to on_train_begin")
        wrapper = model  # under FSDP1 the Trainer's FullyShardedDataParallel root
        model = unwrap(model)
        why = unsupported(args, model, wrapper)
        if why is not None:
            self._finished = True
            raise ValueError(f"InstabilityWatchTrainerCallback cannot watch this run: {why}.")
        self.sharding = sharding_of(model, wrapper)
        layers = self._resolve_layers(model)
        if self.sharding == "fsdp1":
            layers = fsdp1_layers(layers, model, wrapper, relocate=self.layers is None)
        self.model = model
        self._last_step = state.global_step
        self._loss_ranks = args.world_size if getattr(args, "average_tokens_across_devices", False) else 1
        run_dir = self.run_dir_arg or run_dir_under(args.output_dir)
        listeners = self._listeners(run_dir, is_zero=bool(state.is_world_process_zero), scalars=self._collect_scalars)

        def make() -> InstabilityWatch:
            watch = InstabilityWatch(model, self.config, layers=layers, listeners=listeners)
            if wrapper is not model:
                # FSDP1: the root unit wraps the model from outside; the engine looks for the unit holding
                # each layer (to gather its W_Q) under the model and under these modules
                watch.sharding_roots = [wrapper]
            return watch

        try:
            self.watch = make()
            restored = self._resume(args, state, make) if state.global_step > 0 else False
            self._open_run_dir(restored=restored, broadcast=broadcast_from_rank_zero, extra_meta={"trainer": {
                "library": "transformers",
                "world_size": args.world_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "bf16": bool(args.bf16), "fp16": bool(args.fp16),
                "sharding": self.sharding,
                "output_dir": str(args.output_dir),
            }})
        except BaseException:
            self._finished = True
            if self.watch is not None:
                self.watch.detach(read_back=False)
            if self.reporter is not None:
                self.reporter.close()
            raise
        self._hook = model.register_forward_hook(self._capture_loss, with_kwargs=True)

    def _resolve_layers(self, model: nn.Module) -> List[AttentionLayer]:
        layers = self._find_layers(model)
        if not layers:
            raise ValueError(f"InstabilityWatchTrainerCallback, in {type(model).__name__}: {not_found_message(model)}")
        # the names of the user's model: without the wrappers' own levels (FSDP1's auto-wrapped units,
        # activation checkpointing, torch.compile), so a run's CSV and watch state read the same however sharded
        return [dataclasses.replace(x, name=clean_name(x.name)) if clean_name(x.name) != x.name else x
                for x in layers]

    def _resume(self, args, state, fresh: Callable[[], InstabilityWatch]) -> bool:
        """Load the watch state of the checkpoint being resumed; without it, count on from its step.
        Returns whether every rank restored it."""
        payload = self._read_state(args, state)
        loaded = False
        if payload is not None:
            try:
                self.watch.load_state_dict(payload["watch"])  # checks everything first: a misfit changes nothing
                loaded = self.watch.attached
            except (KeyError, TypeError, ValueError) as exc:  # other layers (another model): start fresh
                if self.config.strict:
                    raise
                log_rank_zero(logging.WARNING, "instability_watch: the checkpoint's watch state does not fit this "
                              "model (%s); the watch starts fresh at step %d", exc, state.global_step)
        ok = all_true(loaded)  # every rank restores, or every rank starts fresh: the ranks stay in lockstep
        if not ok:
            if loaded:  # restored here but not on another rank: drop it
                self.watch.detach(read_back=False)
                self.watch = fresh()
            if state.is_world_process_zero:
                log.info("instability_watch: resuming at step %d without watch state; the warm-up starts again",
                         state.global_step)
            self.watch.start_at(state.global_step)
        return ok

    def _read_state(self, args, state) -> Optional[dict]:
        """The watch state saved in the checkpoint at ``state.global_step``, or ``None``.

        The Trainer does not tell callbacks which checkpoint it resumes from; it
        loads ``state`` from it, so the checkpoint is ``checkpoint-<global_step>``
        under ``args.output_dir`` (or ``args.resume_from_checkpoint``, where a
        script set it).
        """
        step = state.global_step
        candidates = []
        if isinstance(getattr(args, "resume_from_checkpoint", None), str):
            candidates.append(Path(args.resume_from_checkpoint))
        candidates.append(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}")
        for d in candidates:
            path = d / STATE_FILE
            if not path.is_file():
                continue
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - a damaged file: train on, fresh
                if self.config.strict:
                    raise
                log.warning("instability_watch (rank %d): cannot read %s (%s); ignored", rank(), path, exc)
                continue
            if not isinstance(payload, dict) or payload.get("version") != _STATE_VERSION:
                log_rank_zero(logging.WARNING, "instability_watch: %s is not a watch state of version %d; ignored",
                              path, _STATE_VERSION)
                continue
            if payload.get("global_step") != step:
                log_rank_zero(logging.WARNING, "instability_watch: %s was saved at step %s, the Trainer resumes at "
                              "step %d; ignored", path, payload.get("global_step"), step)
                continue
            return payload
        return None

    # ------------------------------------------------------------------ the step

    def _capture_loss(self, module, args, kwargs, output) -> None:
        """Keep the model's own loss of each micro-batch of a recorded step (on the device, no sync)."""
        watch = self.watch
        if watch is None or not module.training or not torch.is_grad_enabled():
            return
        if not watch.is_recorded(self._last_step + 1):
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            return
        # a copy: the Trainer scales the model's loss in place afterwards (``loss *= num_processes`` with
        # average_tokens_across_devices), and without a DDP wrapper (FSDP) that is this very tensor
        self._loss_parts.append(loss.detach().float().reshape(()).clone())
        # with num_items_in_batch the model divides by the token count of the whole optimizer step
        # (all micro-batches, and all ranks with average_tokens_across_devices): the parts add up
        self._loss_summed = kwargs.get("num_items_in_batch") is not None

    def _step_loss(self) -> Optional[torch.Tensor]:
        """The step's loss as the Trainer logs it: the mean of the micro-batch losses (or their sum, scaled)."""
        parts, self._loss_parts = self._loss_parts, []
        if not parts:
            return None
        total = torch.stack(parts).sum()
        if self._loss_summed:
            return total * self._loss_ranks  # the engine averages over ranks
        return total / len(parts)

    def on_step_end(self, args, state, control, **kwargs):
        """One ``watch.step(loss)`` per optimizer step (the mean of the step's micro-batch losses)."""
        watch = self.watch
        if watch is None or self._finished:
            return
        stepped = state.global_step - self._last_step
        if stepped <= 0:
            return
        self._last_step = state.global_step
        loss = self._step_loss()
        for i in range(stepped):
            watch.step(loss if i == stepped - 1 else None)
        if 0 < state.max_steps <= state.global_step:
            watch.read_back()  # every rank; the last steps' scalars then reach the Trainer's final logs

    # ------------------------------------------------------------------ outputs

    def _collect_scalars(self, record: ReadBack) -> None:
        if not record.metrics:
            return
        self._pending_scalars = scalars(record) or {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Add the latest read-back's scalars to ``logs`` (and to the entry just appended to ``log_history``)."""
        if not self._pending_scalars or logs is None:
            return
        scalars, self._pending_scalars = self._pending_scalars, {}
        logs.update(scalars)  # what the integrations after this callback see
        # Trainer.log appended a copy of logs ({**logs, "step": global_step}) just before on_log
        history = state.log_history
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(scalars)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """What ``on_save`` writes into a checkpoint, after reading back the pending steps.

        Call it on every rank: under DDP the read-back is a collective.
        """
        watch = self.watch
        if watch is None:
            return {"version": _STATE_VERSION, "watch": None}
        if not self._finished:
            # Read back first, on every process, also without DDP: the checkpoint then holds no
            # rank-local rows, so every rank's state is the same and one file serves any number of
            # processes on resume (one process's pending rows, loaded by every rank of a DDP run,
            # would be summed once per rank).
            watch.read_back()
        return {
            "version": _STATE_VERSION,
            "world_size": torch.distributed.get_world_size() if distributed() else 1,
            "global_step": watch.step_count,
            "watch": watch.state_dict(),
            "run_dir": str(self.run_dir) if self.run_dir is not None else None,
        }

    def on_save(self, args, state, control, **kwargs):
        """Write :meth:`state_dict` into the checkpoint directory as ``instability_watch.pt`` (every rank
        computes it; the saving process writes it)."""
        if self.watch is None or self._finished:
            return
        payload = self.state_dict()  # on every rank (a collective under DDP)
        if not args.should_save:
            return  # every rank's state is the same: the process that writes the checkpoint writes it once
        ckpt = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        path = ckpt / STATE_FILE
        try:
            if not ckpt.is_dir():
                raise FileNotFoundError(f"no checkpoint directory {ckpt}")
            tmp = path.with_name(path.name + ".tmp")
            torch.save(payload, tmp)
            os.replace(tmp, path)
        except Exception as exc:  # noqa: BLE001 - a checkpoint without watch state resumes fresh
            if self.config.strict:
                raise
            if not self._save_failed:  # reported once
                self._save_failed = True
                log.error("instability_watch: could not save the watch state into the checkpoint (%s); resuming "
                          "from it starts the watch fresh (reported once)", exc)

    # ------------------------------------------------------------------ end

    def on_train_end(self, args, state, control, **kwargs):
        """Read back the pending steps, restore the model, close the console and the run directory."""
        self._finish(crashed=False)

    def close(self) -> None:
        """Detach and close now, e.g. after an exception stopped ``trainer.train()`` (the Trainer has
        no hook for that). Under DDP nothing is read back (the other ranks may never get there)."""
        self._finish(crashed=True)

    def _finish(self, *, crashed: bool) -> None:
        if self.watch is None or self._finished:
            return
        try:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
        finally:
            self._pending_scalars = {}
            WatchAdapter._finish(self, crashed=crashed)


__all__ = ["InstabilityWatchTrainerCallback", "STATE_FILE", "RUN_DIR_NAME"]
