"""``GradientAccumulation`` callback: a step-keyed accumulation schedule, or a target global batch size.

The windows come from [`lightning_peft.training.AccumulationSchedule`][lightning_peft.training.AccumulationSchedule] and
are laid, also across a resume or a stream that ends inside one, by `lightning_peft.training.windows.WindowTracker`.
Lightning decides by modulo arithmetic on the batch index within the epoch, so for the fit the callback replaces its two
decisions (`take_over_accumulation`) and sets ``trainer.accumulate_grad_batches`` to the current window's size before
each micro-batch: Lightning divides the loss by the size of *its* window (a short last window of 2 divides by 2, not by
the count).

YAML:

```yaml
- class_path: lightning_peft.callbacks.GradientAccumulation
  init_args: {schedule: {0: 1, 100: 4}}       # or: {global_batch_size: 64}
```
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_peft._checks import integer
from lightning_peft._seams import data_parallel, refuse, strategy_family
from lightning_peft.callbacks._accumulation import refuse_epoch_accumulation, take_over_accumulation
from lightning_peft.callbacks._lightning import Patches, PatchingCallback, refuse_changed_settings
from lightning_peft.callbacks._train_loader import loader_batch_size, train_loader, wrap_train_loader
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.training.accumulation import AccumulationSchedule, shorten_window
from lightning_peft.training.windows import WindowTracker, fit_steps


class GradientAccumulation(PatchingCallback):
    """Accumulate gradients over a step-keyed number of micro-batches, or up to a target global batch size.

    Args:
        schedule: ``{optimizer step: accumulation count}`` (step 0 is 1 when absent), or one count.
        global_batch_size: The number of samples per optimizer step over all devices; the count is
            ``global_batch_size / (micro-batch size * data-parallel size)``, the micro-batch size read from the
            train dataloader's ``batch_size``, the data-parallel size from the strategy (the number of distinct
            batches one pass sees: all processes under DDP and ZeRO, 1 under ``PipelineStrategy``, ``world / tp``
            under ``TensorParallelStrategy``).
        log: Log the number of micro-batches of each optimizer step as ``grad_accumulation``.

    Give exactly one of ``schedule`` and ``global_batch_size``. For a schedule whose count changes,
    ``trainer.estimated_stepping_batches`` is computed with the smallest count (an upper bound on the steps); the exact
    number is [`total_steps`][lightning_peft.callbacks.GradientAccumulation.total_steps].

    Raises:
        ValueError: If both or neither of ``schedule`` and ``global_batch_size`` are given, or one is invalid.
        TypeError: If ``schedule`` or ``global_batch_size`` has the wrong type.
    """

    def __init__(
        self, schedule: dict[int, int] | int | None = None, global_batch_size: int | None = None, log: bool = True
    ) -> None:
        if (schedule is None) == (global_batch_size is None):
            raise ValueError(
                f"GradientAccumulation(schedule={schedule!r}, global_batch_size={global_batch_size!r}): give exactly "
                "one of them: schedule={optimizer step: count} or global_batch_size=<samples per optimizer step>."
            )
        self.schedule = None if schedule is None else AccumulationSchedule(schedule, who="GradientAccumulation")
        if global_batch_size is not None:
            integer("GradientAccumulation", "global_batch_size", global_batch_size, minimum=1)
        self.global_batch_size = global_batch_size
        self.log_count = log
        self._active: AccumulationSchedule | None = self.schedule  # target mode: derived from the loader
        self._windows = WindowTracker()
        self._patches = Patches()  # on Lightning's loops, and the trainer's count: given back at teardown

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        if stage != "fit":
            return
        self._check_conflicts(trainer, pl_module)
        self._windows.start_fit()
        self._patches.set(trainer, "accumulate_grad_batches", trainer.accumulate_grad_batches)
        own = trainer.strategy.handles_gradient_accumulation  # it (DeepSpeed) reads the count once, in its setup
        if self.global_batch_size is not None:
            self._active = None
            if own:  # derive the count now
                self._derive(trainer, train_loader(trainer))
            else:  # when Lightning first asks for the train loader (after the LightningModule's setup builds data)
                wrap_train_loader(trainer, self._patches, lambda loader: self._derive(trainer, loader),
                                  f"GradientAccumulation(global_batch_size={self.global_batch_size})",
                                  "reads the micro-batch size",
                                  "use schedule=K with K = global batch / (micro-batch size x devices)")
        if self._active is not None:
            if own and not self._active.is_constant:
                raise RuntimeError(
                    f"GradientAccumulation(schedule={self._active.schedule}): {type(trainer.strategy).__name__} "
                    "accumulates gradients itself and reads the count once, at setup, so it cannot change during a "
                    "run. Use a constant count (schedule=K or global_batch_size=...) with this strategy, or, for "
                    "DeepSpeed, lightning_peft.strategies.ZeROStrategy(backend='deepspeed'), whose engine follows the "
                    "schedule."
                )
            # Set before configure_optimizers: trainer.estimated_stepping_batches is then exact for a constant count
            # and, with the smallest count of a changing schedule, an upper bound (a OneCycleLR never runs past it).
            trainer.accumulate_grad_batches = self._active.min_count
        if not own:  # the windows are ours (a strategy that accumulates itself reads the count once, above)
            now = lambda: (self._schedule(), trainer.current_epoch, trainer.num_training_batches, trainer.global_step)  # noqa: E731
            take_over_accumulation(trainer, self._patches, "GradientAccumulation",
                                   lambda batch: self._windows.starts(*now(), batch),
                                   lambda ready: self._windows.ends(*now(), ready))

    @property
    def count(self) -> int | None:
        """The constant micro-batches per optimizer step; None for a changing schedule, or before a target is derived."""
        return self._active.min_count if self._active is not None and self._active.is_constant else None

    def accumulation_for(self, micro_batch_size: int, data_parallel_size: int) -> int | AccumulationSchedule | None:
        """Its schedule, or the count a target global batch gives with these loaders (what
        ``_accumulation.accumulation_of`` asks)."""
        if self.global_batch_size is None:
            return self.schedule
        return AccumulationSchedule.for_global_batch(
            self.global_batch_size, micro_batch_size, data_parallel_size, who="GradientAccumulation").min_count

    def _schedule(self) -> AccumulationSchedule:
        """The schedule in use; for a target global batch, known once Lightning has asked for the train loader."""
        if self._active is None:
            raise RuntimeError(
                f"GradientAccumulation(global_batch_size={self.global_batch_size}): the count is derived from the "
                "train loader's batch size when Lightning first asks for the loader, which has not happened yet."
            )
        return self._active

    def _derive(self, trainer: pl.Trainer, loader: Any) -> Any:
        """Turns the target global batch into a count, from ``loader``'s batch size (once); returns ``loader``."""
        if self._active is not None:
            return loader
        micro = loader_batch_size(loader, f"GradientAccumulation(global_batch_size={self.global_batch_size})",
                                  "give it an integer batch_size, or use schedule=K with K = global batch / (micro-batch "
                                  "size x devices)")
        replicas, _ = data_parallel(trainer.strategy)
        self._active = AccumulationSchedule.for_global_batch(int(self.global_batch_size or 0), micro, replicas,
                                                             who="GradientAccumulation")
        # Before estimated_stepping_batches reads it: exact for the user's learning-rate schedule.
        trainer.accumulate_grad_batches = self._active.min_count
        rank_zero_info(
            f"GradientAccumulation: global batch {self.global_batch_size} = micro-batch {micro} x "
            f"{replicas} data-parallel replica(s) x {self._active.min_count} accumulated micro-batches."
        )
        return loader

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The loader is known from here: refuse what cannot cut a window short, a stream without len() under DeepSpeed.
        if (trainer.num_training_batches == math.inf and max(self._schedule().schedule.values()) > 1
                and strategy_family(trainer.strategy) == "deepspeed"):
            raise refuse(
                "GradientAccumulation", trainer.strategy,
                "the train loader has no len(), so a window may be cut short by the stream's end, and then the "
                "gradient accumulated so far must be rescaled (shorten_window, on p.grad); DeepSpeed accumulates in "
                "its own buffers, out of reach there (p.grad is None from stage 2; measured wrong at stages 1 to 3)",
                "give the train loader a len(), or use ZeROStrategy(backend='native'), where a cut window is "
                "rescaled as under DDP",
            )
        if not self._schedule().is_constant:
            rank_zero_info(
                f"GradientAccumulation: the schedule {self._active.schedule} gives {self.total_steps(trainer)} "
                f"optimizer steps in this run; trainer.estimated_stepping_batches "
                f"({trainer.estimated_stepping_batches}) assumes the count {self._active.min_count} throughout. "
                "Use GradientAccumulation.total_steps(trainer) for a learning-rate schedule."
            )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.strategy.handles_gradient_accumulation:  # the strategy's windows, not ours
            return
        size, planned = self._windows.loss_window(
            self._schedule(), trainer.current_epoch, batch_idx, trainer.num_training_batches, trainer.global_step,
            last=trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        if planned is not None:  # the stream ended inside the window: the micro-batches before count 1 / size
            shorten_window([p for group in trainer.optimizers[0].param_groups for p in group["params"]], planned, size)
        trainer.accumulate_grad_batches = size

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        if self.log_count:
            pl_module.log("grad_accumulation", float(trainer.accumulate_grad_batches), on_step=True, on_epoch=False)

    @staticmethod
    def total_steps(trainer: pl.Trainer) -> int | float:
        """The number of optimizer steps of the fit: exact for a changing schedule, unlike Lightning's estimate.

        Call it from ``configure_optimizers`` (or later). Without a ``GradientAccumulation`` callback on the
        trainer it is ``trainer.estimated_stepping_batches``. Like that estimate it assumes every epoch has
        ``trainer.num_training_batches`` micro-batches; ``inf`` when the run has no end in steps.

        Raises:
            RuntimeError: In target-batch mode, before the callback's ``setup`` has derived the count.
        """
        ours = next((c for c in trainer.callbacks if isinstance(c, GradientAccumulation)), None)  # type: ignore[attr-defined]
        if ours is None:
            return trainer.estimated_stepping_batches
        epochs = None if trainer.max_epochs == -1 else trainer.max_epochs
        if trainer.train_dataloader is None and (ours._active is None or epochs is not None):
            # Asks for the loader (which derives a target global batch's count), as estimated_stepping_batches does.
            trainer.fit_loop.setup_data()
        if ours._active is None:
            raise RuntimeError(
                f"GradientAccumulation.total_steps: the count for global_batch_size={ours.global_batch_size} is "
                "derived in the callback's setup; call total_steps from configure_optimizers or later."
            )
        return fit_steps(ours._active, math.inf if epochs is None else trainer.num_training_batches, epochs,
                         trainer.max_steps)

    @override
    def state_dict(self) -> dict[str, Any]:
        anchor = self._windows.anchor
        return {**self._settings(), "anchor": None if anchor is None else list(anchor)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse_changed_settings("GradientAccumulation", {k: state_dict.get(k) for k in self._settings()}, self._settings())
        self._windows.restore(state_dict.get("anchor"))

    def _settings(self) -> dict[str, Any]:
        return {"schedule": None if self.schedule is None else self.schedule.schedule,
                "global_batch_size": self.global_batch_size}

    def _check_conflicts(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"GradientAccumulation: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is set as "
                "well; remove it from the Trainer (this callback sets the count) or remove the callback."
            )
        # A second GradientAccumulation: Lightning itself refuses two stateful callbacks of one type.
        refuse_epoch_accumulation(trainer, "GradientAccumulation", "sets the accumulation too; keep one (for an "
                                  "epoch-keyed schedule, key this callback's schedule by the first step of each epoch)")
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                f"GradientAccumulation: {type(pl_module).__name__} uses manual optimization, where Lightning does not "
                "accumulate; remove the callback and accumulate in training_step (AccumulationSchedule.micro_batches "
                "gives each micro-batch's window size and step)."
            )
