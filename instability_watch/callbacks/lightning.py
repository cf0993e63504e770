"""``InstabilityWatchCallback``: the watch in a Lightning ``Trainer``.

An adapter over :class:`~instability_watch.InstabilityWatch` (all logic lives
in the engine, the run-directory policy in :mod:`~instability_watch.outputs.rundir`,
what both framework callbacks share in :class:`._common.WatchAdapter`): it attaches in ``setup``, calls ``watch.step`` once per
optimizer step, pauses the statistics during validation and sanity checking,
sends a few scalars to the trainer's loggers, keeps the watch's state in
checkpoints and detaches on teardown. Rank 0 prints alert panels (and the live
table) and writes the run directory; under DDP the engine reduces the
statistics across ranks first, so every rank switches the same heads at the
same step.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from instability_watch.callbacks.common import missing_extra

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
except ImportError as exc:  # lightning is an optional dependency
    raise missing_extra("instability_watch.callbacks.lightning (InstabilityWatchCallback)", "PyTorch Lightning",
                        "lightning") from exc

from instability_watch.callbacks.common import WatchAdapter, run_dir_under, scalars
from instability_watch.engine.readback import ReadBack
from instability_watch.engine.watch import InstabilityWatch
from instability_watch.model.layer import AttentionLayer
from instability_watch.ranks import log_rank_zero

log = logging.getLogger("instability_watch")


_STATE_VERSION = 1


def unsupported_strategy(strategy: Any) -> Optional[str]:
    """Why a strategy cannot be watched (``None`` if it can).

    Sharded weights are read whole where needed: FSDP2 ``DTensor`` objects (``ModelParallelStrategy``)
    and FSDP1 units (``FSDPStrategy``), see :mod:`instability_watch.model.sharding`. DeepSpeed
    ZeRO-3 partitions parameters in its own way, which the watch cannot gather.
    """
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    name = type(strategy).__name__
    if "DeepSpeed" in name and getattr(strategy, "zero_stage_3", False):
        return (f"{name} with ZeRO stage 3 partitions every parameter across ranks (W_Q included) and the watch "
                "has no gather for DeepSpeed's partitions; use ZeRO stage 1 or 2 (the weights stay whole on "
                "every rank), or FSDPStrategy / ModelParallelStrategy")
    if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy)):
        return None
    return (f"{name} is not one of the supported strategies (single device, DDP, FSDPStrategy, "
            "ModelParallelStrategy, DeepSpeed ZeRO 1-2)")


class InstabilityWatchCallback(WatchAdapter, Callback):
    """Watch every attention head while a Lightning ``Trainer`` fits.

    Args:
        config: a :class:`~instability_watch.WatchConfig` (or a dict of its
            fields); the defaults if ``None``.
        layers: ``None`` to find attention layers with the built-in locators
            (nanoGPT, Hugging Face GPT-2 / Llama-style / BERT-style, ``nn.MultiheadAttention``),
            a list of :class:`~instability_watch.AttentionLayer`, or a function
            of the LightningModule returning one.
        run_dir: where to write ``metrics.csv``, ``events.csv`` and
            ``meta.json``. ``None``: ``<trainer.log_dir>/instability_watch``
            (or ``<default_root_dir>/instability_watch`` without a logger); a
            resumed run continues the directory recorded in its checkpoint.
        overwrite: replace a run already in ``run_dir`` (else that is an error).
        write_csv: write the run directory at all.
        console: the rich ``Console`` for alert panels and the live table;
            rich's global console if ``None`` (the one ``RichProgressBar`` uses).
        alerts: print a panel per alert.
        live_table: show a live table of the ``top`` worst heads, refreshed at
            every read-back.
        top: rows in the live table.
        log_scalars: send aggregate scalars (``instability_watch/...``) to the
            trainer's loggers at every read-back.

    Raises:
        TypeError, ValueError: bad arguments, at construction.
        MisconfigurationException: in ``setup``, for a strategy the watch
            cannot read weights under (DeepSpeed ZeRO-3, or one that is not
            single-device, DDP, ``FSDPStrategy`` or ``ModelParallelStrategy``)
            or a model with no attention layer the locators find.

    Example::

        from lightning.pytorch import Trainer
        from instability_watch import InstabilityWatchCallback, WatchConfig

        cb = InstabilityWatchCallback(WatchConfig(auto_switch=True), live_table=True)
        Trainer(precision="bf16-mixed", callbacks=[cb]).fit(model, data)
        # then: instability-watch report <trainer.log_dir>/instability_watch
    """

    error = MisconfigurationException

    def _init_state(self) -> None:
        """The adapter's own state (called by ``WatchAdapter.__init__``, after the arguments are checked)."""
        self._trainer: Optional["pl.Trainer"] = None
        self._pending_state: Optional[dict] = None  # loaded before the watch existed
        self._restored = False  # the watch state came from the checkpoint being resumed
        self._last_global_step = 0
        self._loss_sum: Optional[torch.Tensor] = None  # the recorded step's micro-batch losses, on the device
        self._loss_n = 0

    # ------------------------------------------------------------------ attach / detach

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Check the strategy and attach (or, for layers built in ``configure_model``, wait for fit start)."""
        if stage != "fit":
            return
        why = unsupported_strategy(trainer.strategy)
        if why is not None:
            raise MisconfigurationException(f"InstabilityWatchCallback cannot watch this run: {why}.")
        if self.watch is not None:
            self.watch.detach(read_back=False)  # a callback reused for another fit: start clean
        self._start_run()
        self._trainer = trainer
        self._pending_state, self._restored = None, False
        layers = self._resolve_layers(pl_module, may_wait=True)
        if layers is not None:  # else the model's layers are built in configure_model: attach at fit start
            self._attach(trainer, pl_module, layers)

    def _resolve_layers(self, pl_module: "pl.LightningModule", *, may_wait: bool) -> Optional[List[AttentionLayer]]:
        layers = self._find_layers(pl_module)
        if layers:
            return layers
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if may_wait and is_overridden("configure_model", pl_module, pl.LightningModule):
            return None
        from instability_watch.model.layer import not_found_message

        raise MisconfigurationException(
            f"InstabilityWatchCallback, in {type(pl_module).__name__}: {not_found_message(pl_module)}")

    def _attach(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", layers: List[AttentionLayer]) -> None:
        run_dir = self._default_run_dir(trainer)  # on every rank: trainer.log_dir is a collective under DDP
        listeners = self._listeners(run_dir, is_zero=trainer.is_global_zero, scalars=self._log_scalars)
        # the callback steps the watch once per optimizer step (global_step): no check of the step() calls
        self.watch = InstabilityWatch(pl_module, self.config, layers=layers, listeners=listeners,
                                      check_step_calls=False)
        if self._pending_state is not None:
            self._load_watch_state(self._pending_state)
            self._pending_state = None

    def _default_run_dir(self, trainer: "pl.Trainer") -> Path:
        """``run_dir``, else the logger's version directory, else a new ``version_N`` (every rank calls it)."""
        if self.run_dir_arg is not None:
            return self.run_dir_arg
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        if trainer.loggers and isinstance(trainer.loggers[0], (CSVLogger, TensorBoardLogger)):
            return run_dir_under(trainer.log_dir)  # log_dir is per run (version_N) and broadcast
        return run_dir_under(trainer.default_root_dir, new_version=True, broadcast=trainer.strategy.broadcast)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Attach now if the model's layers were built in ``configure_model``."""
        if self.watch is None and not self._finished:
            self._attach(trainer, pl_module, self._resolve_layers(pl_module, may_wait=False))

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Line the watch's step up with the trainer's and open the run directory (rank 0)."""
        watch = self.watch
        if watch is None:
            return
        self._last_global_step = trainer.global_step
        self._loss_sum, self._loss_n = None, 0
        wrapper = getattr(trainer.strategy, "model", None)
        if isinstance(wrapper, torch.nn.Module) and wrapper is not pl_module:
            # FSDPStrategy wraps the LightningModule itself: its FSDP1 units may sit above pl_module
            watch.sharding_roots = [wrapper]
        if watch.step_count != trainer.global_step:
            # a checkpoint without our state (or of another run): count on from the trainer's step
            if trainer.is_global_zero:
                log.info("instability_watch: resuming at step %d without watch state; the warm-up starts again",
                         trainer.global_step)
            watch.start_at(trainer.global_step)
            self._restored = False
        if not self._restored:
            self.run_dir = self.run_dir_arg  # not the checkpoint's directory: this run is not that run
        elif self.run_dir_arg is None and self.run_dir is not None and self.writer is not None:
            self.writer.run_dir = self.run_dir  # continue the directory of the checkpointed run
        self._open_run_dir(restored=self._restored, broadcast=trainer.strategy.broadcast, extra_meta={"trainer": {
            "precision": str(trainer.precision), "world_size": trainer.world_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "strategy": type(trainer.strategy).__name__,
        }})

    # ------------------------------------------------------------------ the step

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Keep the loss of a recorded step; call ``watch.step`` once per optimizer step."""
        watch = self.watch
        if watch is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        # the loss is kept on recorded steps only: between probe steps the callback does nothing on the device
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and watch.is_recorded(self._last_global_step + 1):
            loss = loss.detach().float().reshape(())
            if pl_module.automatic_optimization:
                # Lightning hands back the loss divided by accumulate_grad_batches (what it backpropagated)
                loss = loss * trainer.accumulate_grad_batches
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss  # on device, no sync
            self._loss_n += 1
        stepped = trainer.global_step - self._last_global_step
        if stepped <= 0:
            return  # a micro-batch of gradient accumulation: its statistics add up into the coming step
        self._last_global_step = trainer.global_step
        mean = self._loss_sum / self._loss_n if self._loss_sum is not None else None
        self._loss_sum, self._loss_n = None, 0
        for i in range(stepped):  # several optimizers can step on one batch
            watch.step(mean if i == stepped - 1 else None)

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Pause the statistics: validation and sanity checking are not training steps."""
        if self.watch is not None:
            self.watch.pause_statistics()

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Resume the statistics."""
        if self.watch is not None:
            self.watch.resume_statistics()

    # ------------------------------------------------------------------ outputs

    def _log_scalars(self, record: ReadBack) -> None:
        trainer = self._trainer
        values = scalars(record)
        if trainer is None or not trainer.loggers or values is None:
            return
        for logger in trainer.loggers:  # log_metrics is rank-zero only
            logger.log_metrics(values, step=record.step)

    # ------------------------------------------------------------------ end

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Read back the pending steps (every rank: a collective under DDP) and stop the live table."""
        if self.watch is not None:
            self.watch.read_back()
        if self.reporter is not None:
            self.reporter.close()  # stop the live table before the progress bar stops

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        """Detach and close (Lightning does not call ``teardown`` after an exception)."""
        self._finish(crashed=True)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Read back what is pending, restore the model, close the console and the run directory."""
        if stage == "fit":
            self._finish(crashed=False)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """The watch state and the run directory, for the checkpoint (after reading back the pending steps)."""
        if self.watch is None:
            watch_state = self._pending_state
        else:
            if self.watch.distributed and not self._finished:
                # every rank saves (Lightning calls this on all ranks): read back first, so the
                # checkpoint holds no rank-local pending rows (rank 0's would be summed world-size times)
                self.watch.read_back()
            watch_state = self.watch.state_dict()
        return {
            "version": _STATE_VERSION,
            "watch": watch_state,
            "run_dir": str(self.writer.run_dir) if self.writer is not None else (
                str(self.run_dir) if self.run_dir is not None else None),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the watch state of a checkpoint (into the watch, or kept until it exists); without a
        ``run_dir`` argument the run continues the checkpoint's directory."""
        watch_state = state_dict.get("watch")
        run_dir = state_dict.get("run_dir")
        if run_dir and self.run_dir_arg is None:
            self.run_dir = Path(run_dir)
        if watch_state is None:
            return
        if self.watch is None:
            self._pending_state = watch_state
        else:
            self._load_watch_state(watch_state)

    def _load_watch_state(self, state: dict) -> None:
        try:
            self.watch.load_state_dict(state)
        except ValueError as exc:  # other layers (a renamed module, a compiled wrapper): start fresh
            if self.config.strict:
                raise
            log_rank_zero(logging.WARNING, "instability_watch: the checkpoint's watch state does not fit this model "
                          "(%s); the watch starts fresh at the resumed step", exc)
            self._restored = False
            return
        self._restored = self.watch.attached
