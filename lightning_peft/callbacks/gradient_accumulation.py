"""``GradientAccumulation`` callback: a step-keyed accumulation schedule, or a target global batch size.

The windows and their sizes come from :class:`lightning_peft.training.AccumulationSchedule`; this callback makes
Lightning follow them. Lightning decides by modulo arithmetic on the batch index within the epoch: it zeroes the
gradients when ``batch_idx % accumulate_grad_batches == 0`` and steps when ``batches_so_far %
accumulate_grad_batches == 0`` or the epoch ends. Windows that start elsewhere (after a change of count in the
middle of an epoch) cannot be put that way, so for the fit the callback replaces those two decisions on the
trainer's own loop objects (instance attributes, removed again at teardown):

- ``fit_loop.epoch_loop._accumulated_batches_reached``: true at the last micro-batch of a window;
- ``fit_loop.epoch_loop.automatic_optimization._make_zero_grad_fn``: zeroes only at a window's first micro-batch
  (Lightning's own function does the zeroing, hooks included);

and sets ``trainer.accumulate_grad_batches`` to the current window's size before each micro-batch, so that
Lightning divides the loss by the size of *its* window: a short last window of 2 divides by 2, not by the count.

A stream of unknown length (``trainer.num_training_batches == inf``) works too: the windows follow the schedule
and, if the stream ends inside a window, Lightning steps on the last micro-batch and the callback first rescales
the gradient accumulated so far (:func:`~lightning_peft.training.accumulation.shorten_window`), so that step too
averages over the micro-batches it had.

Resumed from a checkpoint saved inside a window (a ``trainer.save_checkpoint`` in a batch hook; Lightning's own
checkpoints fall at optimizer steps), the run keeps the straight run's windows, but the gradient of that window's
micro-batches before the checkpoint is not in the checkpoint: the rest of the window is divided by the number of
micro-batches it has left, so that step averages over the micro-batches it got, like every other step.

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

from lightning_peft._seams import data_parallel, refuse, strategy_family
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.training.accumulation import AccumulationSchedule, Window, shorten_window

_MISSING = object()


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
        if global_batch_size is not None and (
            isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int)
        ):
            raise TypeError(f"GradientAccumulation(global_batch_size={global_batch_size!r}): must be an integer.")
        if global_batch_size is not None and global_batch_size < 1:
            raise ValueError(f"GradientAccumulation(global_batch_size={global_batch_size}): must be >= 1.")
        self.global_batch_size = global_batch_size
        self.log_count = log
        self._active: AccumulationSchedule | None = self.schedule  # target mode: derived from the loader
        # (epoch, batch, step): a window of `epoch` starts at micro-batch `batch` and produces optimizer step `step`.
        self._anchor: tuple[int, int, int] | None = None
        self._patched: list[tuple[object, str, object]] = []
        self._saved_count: int | None = None
        # A checkpoint was loaded; (epoch, batch) where the resumed run started (a window there may lack its head).
        self._restored = False
        self._resumed_at: tuple[int, int] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        if stage != "fit":
            return
        self._check_conflicts(trainer, pl_module)
        self._restored, self._resumed_at = False, None  # a checkpoint's state, if any, is loaded after setup
        strategy = trainer.strategy
        self._saved_count = trainer.accumulate_grad_batches
        if self.global_batch_size is not None:
            self._active = None
            if strategy.handles_gradient_accumulation:  # it reads the count in its own setup: derive it now
                self._derive(trainer, _micro_batch_size(trainer, self.global_batch_size))
            else:  # when Lightning first asks for the train loader (after the LightningModule's own setup)
                self._derive_on_first_request(trainer)
                self._take_over_window_decisions(trainer)
                return
        schedule = self._schedule()
        if strategy.handles_gradient_accumulation and not schedule.is_constant:
            raise RuntimeError(
                f"GradientAccumulation(schedule={schedule.schedule}): {type(strategy).__name__} accumulates "
                "gradients itself and reads the count once, at setup, so it cannot change during a run. Use a "
                "constant count (schedule=K or global_batch_size=...) with this strategy, or, for DeepSpeed, "
                "lightning_peft.strategies.ZeROStrategy(backend='deepspeed'), whose engine follows the schedule."
            )
        # Set before configure_optimizers: trainer.estimated_stepping_batches is then exact for a constant count
        # and, with the smallest count of a changing schedule, an upper bound (a OneCycleLR never runs past it).
        trainer.accumulate_grad_batches = schedule.min_count
        if not strategy.handles_gradient_accumulation:  # such a strategy (DeepSpeed) reads the count in its setup
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
        """Wraps the one call through which Lightning asks for the train loader, to read its batch size.

        Lightning asks in ``setup_data``: from ``trainer.estimated_stepping_batches`` (in ``configure_optimizers``)
        or at the start of the fit loop, in both cases after the LightningModule's ``setup`` (which may build the
        data) and before the first step. Calling the loader here in ``setup`` instead would run before the
        module's ``setup``, and would build it before a checkpoint's callback states are restored.
        """
        source = getattr(trainer.fit_loop, "_data_source", None)
        if not callable(getattr(source, "dataloader", None)):
            raise RuntimeError(
                f"GradientAccumulation(global_batch_size={self.global_batch_size}): this Lightning version "
                f"({pl.__version__}) has no trainer.fit_loop._data_source.dataloader, through which the callback "
                "reads the micro-batch size; use schedule=K with K = global batch / (micro-batch size x devices)."
            )
        original = source.dataloader

        def dataloader() -> Any:
            loader = original()
            if self._active is None:
                self._derive(trainer, _loader_batch_size(loader, self.global_batch_size))
            return loader

        self._patch(source, "dataloader", dataloader)

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
        if not self._patched:
            return
        window = self._window(trainer, batch_idx, anchor=True)
        if self._restored:  # the first micro-batch after a checkpoint was loaded
            self._restored, self._resumed_at = False, (trainer.current_epoch, batch_idx)
        first = window.start
        if self._resumed_at is not None and self._resumed_at[0] == trainer.current_epoch and (
            window.start < self._resumed_at[1] < window.start + window.size
        ):
            # Resumed inside this window: the gradient of its micro-batches before the checkpoint is not in the
            # checkpoint, so the step averages over the ones this run has.
            first = self._resumed_at[1]
        end = window.start + window.size
        size = end - first
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and batch_idx + 1 < end:
            # The stream ended inside the window (only a loader without len() can): Lightning steps after this
            # micro-batch, so make the ones before count 1 / actual instead of 1 / size.
            actual = batch_idx + 1 - first
            if actual > 1:
                params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
                shorten_window(params, size, actual)
            size = actual
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
        if trainer.max_epochs == -1 or trainer.max_epochs is None:
            return math.inf if trainer.max_steps == -1 else trainer.max_steps
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # as trainer.estimated_stepping_batches does
        num_batches = trainer.num_training_batches
        if num_batches == math.inf:
            return math.inf if trainer.max_steps == -1 else trainer.max_steps
        steps = schedule.steps_in_epochs(int(num_batches), max(trainer.max_epochs, 1))
        return steps if trainer.max_steps == -1 else min(steps, trainer.max_steps)

    @override
    def state_dict(self) -> dict[str, Any]:
        settings = self._settings()
        return {**settings, "anchor": None if self._anchor is None else list(self._anchor)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {k: state_dict.get(k) for k in ("schedule", "global_batch_size")}
        now = self._settings()
        if saved != now:
            raise ValueError(
                f"GradientAccumulation: the checkpoint was trained with {saved}; this run has {now}. Resume with the "
                "checkpoint's settings, or start a new run without ckpt_path."
            )
        anchor = state_dict.get("anchor")
        self._anchor = None if anchor is None else (int(anchor[0]), int(anchor[1]), int(anchor[2]))
        self._restored, self._resumed_at = True, None

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
        epoch_loop = getattr(trainer.fit_loop, "epoch_loop", None)
        automatic = getattr(epoch_loop, "automatic_optimization", None)
        progress = getattr(epoch_loop, "batch_progress", None)
        if not (
            callable(getattr(epoch_loop, "_accumulated_batches_reached", None))
            and callable(getattr(automatic, "_make_zero_grad_fn", None))
            and hasattr(progress, "is_last_batch")
            and hasattr(getattr(progress, "current", None), "ready")
        ):
            raise RuntimeError(
                f"GradientAccumulation: Lightning {pl.__version__} lacks fit_loop.epoch_loop._accumulated_batches_"
                "reached, .automatic_optimization._make_zero_grad_fn or .batch_progress, where Lightning 2.6 decides "
                "when to step and when to zero the gradients (this callback replaces those decisions). Use a "
                "Lightning that has them, or Trainer(accumulate_grad_batches=K) for a constant count."
            )
        lightning_zero_grad_fn = automatic._make_zero_grad_fn  # type: ignore[union-attr]

        def make_zero_grad_fn(batch_idx: int, optimizer: Optimizer) -> Any:
            if batch_idx != self._window(trainer, batch_idx, anchor=True).start:
                return None
            # Lightning zeroes when batch_idx % accumulate_grad_batches == 0, true with 1; the rest (skipping
            # backward, the zero-grad hooks) stays Lightning's own.
            size, trainer.accumulate_grad_batches = trainer.accumulate_grad_batches, 1
            try:
                return lightning_zero_grad_fn(batch_idx, optimizer)
            finally:
                trainer.accumulate_grad_batches = size

        def window_ends() -> bool:
            ready = progress.current.ready  # type: ignore[union-attr]  # micro-batches fetched this epoch
            if ready == 0:
                return True
            window = self._window(trainer, ready - 1, anchor=False)
            return window is None or ready == window.start + window.size

        self._patch(epoch_loop, "_accumulated_batches_reached", window_ends)
        self._patch(automatic, "_make_zero_grad_fn", make_zero_grad_fn)

    def _window(self, trainer: pl.Trainer, batch: int, anchor: bool) -> Window | None:
        """The window of micro-batch ``batch`` of the current epoch.

        Windows are laid from an anchor, a micro-batch known to start a window and the step it produces: the
        epoch's first micro-batch and the step then (saved in checkpoints, so a resumed epoch keeps its windows).
        Without an anchor for this epoch, ``batch`` becomes one when ``anchor`` (a checkpoint from a step's end).
        """
        epoch = trainer.current_epoch
        if self._anchor is None or self._anchor[0] != epoch or batch < self._anchor[1]:
            if not anchor:
                return None
            self._anchor = (epoch, batch, trainer.global_step)
        _, first, step = self._anchor
        window = self._schedule().window_at(batch - first, trainer.num_training_batches - first, step)
        return Window(window.start + first, window.size, window.step)

    def _patch(self, owner: object, name: str, value: object) -> None:
        self._patched.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def _restore(self, trainer: pl.Trainer) -> None:
        for owner, name, before in reversed(self._patched):
            if before is _MISSING:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, before)
        self._patched.clear()
        if self._saved_count is not None:
            trainer.accumulate_grad_batches = self._saved_count
            self._saved_count = None


def _micro_batch_size(trainer: pl.Trainer, global_batch_size: int) -> int:
    """The train dataloader's fixed ``batch_size``, read before configure_optimizers needs the count."""
    loader = trainer.train_dataloader
    if loader is None:
        # The loader itself, not Lightning's processed copy: loading that here would skip, on resume, the
        # restoring of a stateful loader's position (Lightning restores it only when it loads the loader).
        source = getattr(trainer.fit_loop, "_data_source", None)
        if source is None or not source.is_defined():
            raise RuntimeError(
                f"GradientAccumulation(global_batch_size={global_batch_size}): the trainer has no train dataloader "
                "to read the micro-batch size from; pass one to fit."
            )
        loader = source.dataloader()
    return _loader_batch_size(loader, global_batch_size)


def _loader_batch_size(loader: Any, global_batch_size: int) -> int:
    """The loader's fixed ``batch_size`` (or its batch sampler's)."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"GradientAccumulation(global_batch_size={global_batch_size}): the train dataloader "
            f"({type(loader).__name__}) has no fixed batch_size to derive the count from; give it an integer "
            "batch_size, or use schedule=K with K = global batch / (micro-batch size x devices)."
        )
    return size
