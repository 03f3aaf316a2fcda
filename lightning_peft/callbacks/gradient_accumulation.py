"""``GradientAccumulation`` callback: a step-keyed accumulation schedule, or a target global batch size.

The windows and their sizes come from :class:`lightning_peft.training.AccumulationSchedule`, laid and divided by
:class:`lightning_peft.training.windows.WindowTracker` (also when resumed inside a window, or when a stream of unknown
length ends inside one); this callback makes Lightning follow them. Lightning decides by modulo arithmetic on the batch
index within the epoch, so windows that start elsewhere (after a change of count in the middle of an epoch) need its
two decisions replaced for the fit (:func:`~lightning_peft.callbacks._lightning.take_over_accumulation`), and
``trainer.accumulate_grad_batches`` set to the current window's size before each micro-batch, so that Lightning
divides the loss by the size of *its* window: a short last window of 2 divides by 2, not by the count.

YAML::

    - class_path: lightning_peft.callbacks.GradientAccumulation
      init_args: {schedule: {0: 1, 100: 4}}       # or: {global_batch_size: 64}
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_peft._checks import integer
from lightning_peft._seams import data_parallel, refuse, strategy_family
from lightning_peft.callbacks._lightning import Patches, loader_batch_size, refuse_changed_settings, train_loader
from lightning_peft.callbacks._lightning import take_over_accumulation, wrap_train_loader
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.training.accumulation import AccumulationSchedule, shorten_window
from lightning_peft.training.windows import WindowTracker, fit_steps


class GradientAccumulation(Callback):
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
    ``trainer.estimated_stepping_batches`` is computed with the smallest count (an upper bound on the steps);
    the exact number is :meth:`total_steps`.

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
        self._patches = Patches()
        self._saved_count: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        if stage != "fit":
            return
        self._check_conflicts(trainer, pl_module)
        self._windows.start_fit()
        self._saved_count = trainer.accumulate_grad_batches
        own = trainer.strategy.handles_gradient_accumulation  # it (DeepSpeed) reads the count once, in its setup
        if self.global_batch_size is not None:
            self._active = None
            if own:  # derive the count now
                self._derive(trainer, self._batch_size(train_loader(trainer)))
            else:  # when Lightning first asks for the train loader (after the LightningModule's own setup)
                self._derive_on_first_request(trainer)
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
        if not own:
            self._take_over_window_decisions(trainer)

    @property
    def count(self) -> int | None:
        """The constant number of micro-batches per optimizer step; None for a changing schedule, or before a
        target global batch has been turned into a count."""
        return self._active.min_count if self._active is not None and self._active.is_constant else None

    def count_for(self, micro_batch_size: int, data_parallel_size: int) -> int | None:
        """The constant count this callback uses with loaders of ``micro_batch_size`` on ``data_parallel_size``
        data-parallel replicas (``lightning_peft._seams.data_parallel(trainer.strategy)[0]``)."""
        if self.global_batch_size is None:
            return self.count
        return AccumulationSchedule.for_global_batch(
            self.global_batch_size, micro_batch_size, data_parallel_size, who="GradientAccumulation").min_count

    @staticmethod
    def schedule_of(trainer: pl.Trainer, micro_batch_size: int) -> int | AccumulationSchedule:
        """Micro-batches per optimizer step: a ``GradientAccumulation`` callback's schedule, else the trainer's count.

        (While ``GradientAccumulation`` runs, ``trainer.accumulate_grad_batches`` holds the current window's length,
        which at an epoch's end is shorter; its own schedule is the one to follow.)
        """
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, GradientAccumulation):
                if callback.schedule is not None:
                    return callback.schedule
                count = callback.count_for(micro_batch_size, data_parallel(trainer.strategy)[0])
                if count is not None:
                    return count
        return trainer.accumulate_grad_batches

    def _schedule(self) -> AccumulationSchedule:
        """The schedule in use; for a target global batch, known once Lightning has asked for the train loader."""
        if self._active is None:
            raise RuntimeError(
                f"GradientAccumulation(global_batch_size={self.global_batch_size}): the count is derived from the "
                "train loader's batch size when Lightning first asks for the loader, which has not happened yet."
            )
        return self._active

    def _derive(self, trainer: pl.Trainer, micro: int) -> None:
        replicas, _ = data_parallel(trainer.strategy)
        self._active = AccumulationSchedule.for_global_batch(
            int(self.global_batch_size or 0), micro, replicas, who="GradientAccumulation"
        )
        # Before estimated_stepping_batches reads it: exact for the user's learning-rate schedule.
        trainer.accumulate_grad_batches = self._active.min_count
        rank_zero_info(
            f"GradientAccumulation: global batch {self.global_batch_size} = micro-batch {micro} x "
            f"{replicas} data-parallel replica(s) x {self._active.min_count} accumulated micro-batches."
        )

    def _derive_on_first_request(self, trainer: pl.Trainer) -> None:
        """Reads the micro-batch size when Lightning first asks for the train loader (after the LightningModule's
        ``setup``, which may build the data; before a checkpoint's callback states are restored would be too early)."""

        def derive(loader: Any) -> Any:
            if self._active is None:
                self._derive(trainer, self._batch_size(loader))
            return loader

        wrap_train_loader(trainer, self._patches, derive, f"GradientAccumulation(global_batch_size={self.global_batch_size})",
                          "reads the micro-batch size", "use schedule=K with K = global batch / (micro-batch size x devices)")

    def _batch_size(self, loader: Any) -> int:
        """The train loader's fixed micro-batch size."""
        who = f"GradientAccumulation(global_batch_size={self.global_batch_size})"
        if loader is None:
            raise RuntimeError(f"{who}: the trainer has no train dataloader to read the micro-batch size from; pass one "
                               "to fit.")
        size = loader_batch_size(loader)
        if size is None:
            raise ValueError(
                f"{who}: the train dataloader ({type(loader).__name__}) has no fixed batch_size to derive the count "
                "from; give it an integer batch_size, or use schedule=K with K = global batch / (micro-batch size x "
                "devices)."
            )
        return size

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_stream(trainer)
        if not self._schedule().is_constant:
            rank_zero_info(
                f"GradientAccumulation: the schedule {self._active.schedule} gives {self.total_steps(trainer)} "
                f"optimizer steps in this run; trainer.estimated_stepping_batches "
                f"({trainer.estimated_stepping_batches}) assumes the count {self._active.min_count} throughout. "
                "Use GradientAccumulation.total_steps(trainer) for a learning-rate schedule."
            )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._patches:
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

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore(trainer)  # Lightning skips teardown hooks after an exception

    @staticmethod
    def total_steps(trainer: pl.Trainer) -> int | float:
        """The number of optimizer steps of the fit: exact for a changing schedule, unlike Lightning's estimate.

        Call it from ``configure_optimizers`` (or later). Without a ``GradientAccumulation`` callback on the
        trainer it is ``trainer.estimated_stepping_batches``. Like that estimate it assumes every epoch has
        ``trainer.num_training_batches`` micro-batches; ``inf`` when the run has no end in steps.

        Raises:
            RuntimeError: In target-batch mode, before the callback's ``setup`` has derived the count.
        """
        ours = [c for c in trainer.callbacks if isinstance(c, GradientAccumulation)]  # type: ignore[attr-defined]
        if not ours:
            return trainer.estimated_stepping_batches
        if ours[0]._active is None and trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # asks for the loader, which derives a target global batch's count
        schedule = ours[0]._active
        if schedule is None:
            raise RuntimeError(
                f"GradientAccumulation.total_steps: the count for global_batch_size={ours[0].global_batch_size} is "
                "derived in the callback's setup; call total_steps from configure_optimizers or later."
            )
        epochs = None if trainer.max_epochs == -1 else trainer.max_epochs
        if epochs is not None and trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # as trainer.estimated_stepping_batches does
        return fit_steps(schedule, math.inf if epochs is None else trainer.num_training_batches, epochs, trainer.max_steps)

    @override
    def state_dict(self) -> dict[str, Any]:
        anchor = self._windows.anchor
        return {**self._settings(), "anchor": None if anchor is None else list(anchor)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse_changed_settings("GradientAccumulation", {k: state_dict.get(k) for k in self._settings()}, self._settings())
        self._windows.restore(state_dict.get("anchor"))

    def _settings(self) -> dict[str, Any]:
        return {
            "schedule": None if self.schedule is None else self.schedule.schedule,
            "global_batch_size": self.global_batch_size,
        }

    def _check_conflicts(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"GradientAccumulation: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is set as "
                "well; remove it from the Trainer (this callback sets the count) or remove the callback."
            )
        # A second GradientAccumulation: Lightning itself refuses two stateful callbacks of one type.
        if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):  # type: ignore[attr-defined]
            raise ValueError(
                "GradientAccumulation: the trainer also has a GradientAccumulationScheduler, which sets the "
                "accumulation too; keep one (for an epoch-keyed schedule, key this callback's schedule by the first "
                "step of each epoch)."
            )
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                f"GradientAccumulation: {type(pl_module).__name__} uses manual optimization, where Lightning does not "
                "accumulate; remove the callback and accumulate in training_step (AccumulationSchedule.micro_batches "
                "gives each micro-batch's window size and step)."
            )

    def _check_stream(self, trainer: pl.Trainer) -> None:
        """Refuse, before the first step, what cannot cut a window short: a stream without len() under DeepSpeed.

        The first point where the loader is known: Lightning loads it after the callbacks' ``setup``.
        """
        counts = self._schedule().schedule.values()
        if trainer.num_training_batches != math.inf or max(counts) == 1:
            return
        if strategy_family(trainer.strategy) == "deepspeed":
            raise refuse(
                "GradientAccumulation", trainer.strategy,
                "the train loader has no len(), so a window may be cut short by the stream's end, and then the "
                "gradient accumulated so far must be rescaled (shorten_window, on p.grad); DeepSpeed accumulates in "
                "its own buffers, out of reach there (p.grad is None from stage 2; measured wrong at stages 1 to 3)",
                "give the train loader a len(), or use ZeROStrategy(backend='native'), where a cut window is "
                "rescaled as under DDP",
            )

    def _take_over_window_decisions(self, trainer: pl.Trainer) -> None:
        def here() -> tuple[Any, ...]:
            return self._schedule(), trainer.current_epoch

        take_over_accumulation(
            trainer, self._patches, "GradientAccumulation",
            lambda batch: self._windows.starts(*here(), batch, trainer.num_training_batches, trainer.global_step),
            lambda ready: self._windows.ends(*here(), ready, trainer.num_training_batches, trainer.global_step))

    def _restore(self, trainer: pl.Trainer) -> None:
        self._patches.undo()
        if self._saved_count is not None:
            trainer.accumulate_grad_batches = self._saved_count
            self._saved_count = None

