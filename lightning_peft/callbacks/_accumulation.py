"""The trainer's gradient accumulation as a callback sees it (another callback's schedule, Lightning's epoch-keyed
scheduler refused, the batches an epoch trains) and replaces it (Lightning's two accumulation decisions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_peft._seams import data_parallel
from lightning_peft.callbacks._lightning import Patches


def accumulation_of(trainer: pl.Trainer, micro_batch_size: int) -> Any:
    """Micro-batches per optimizer step (a count or a step-keyed schedule) for loaders of ``micro_batch_size``: what
    a callback with ``accumulation_for(micro_batch_size, data_parallel_size)`` (``GradientAccumulation``) says, else
    the trainer's count. (While ``GradientAccumulation`` runs, ``trainer.accumulate_grad_batches`` holds the current
    window's length, which at an epoch's end is shorter; its own schedule is the one to follow.)"""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        accumulation = getattr(callback, "accumulation_for", None)
        found = accumulation(micro_batch_size, data_parallel(trainer.strategy)[0]) if callable(accumulation) else None
        if found is not None:
            return found
    return trainer.accumulate_grad_batches


def refuse_epoch_accumulation(trainer: pl.Trainer, who: str, why: str) -> None:
    """Raises ``ValueError`` if the trainer has Lightning's epoch-keyed ``GradientAccumulationScheduler`` (``why``:
    what it breaks, and what to use instead)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, GradientAccumulationScheduler):
            raise ValueError(f"{who}: GradientAccumulationScheduler(scheduling={callback.scheduling}) {why}.")


def limited_batches(batches: int, limit: float) -> int:
    """The batches of an epoch that ``Trainer(limit_train_batches=limit)`` trains (as Lightning counts)."""
    if isinstance(limit, int):
        return max(1, min(batches, limit))
    return max(1, int(batches * limit))


def take_over_accumulation(trainer: pl.Trainer, patches: Patches, who: str, starts_window: Callable[[int], bool],
                           window_ends: Callable[[int], bool]) -> None:
    """Replace Lightning's two accumulation decisions for the fit, so windows may start anywhere in an epoch.

    Lightning decides by modulo arithmetic on the batch index within the epoch: it zeroes the gradients when
    ``batch_idx % accumulate_grad_batches == 0`` and steps when ``batches_so_far % accumulate_grad_batches == 0`` or
    the epoch ends. Replaced, on the trainer's own loop objects (undone by ``patches``):

    - ``fit_loop.epoch_loop._accumulated_batches_reached``: ``window_ends(ready)``, ``ready`` the micro-batches
      fetched this epoch (true at the last micro-batch of a window);
    - ``fit_loop.epoch_loop.automatic_optimization._make_zero_grad_fn``: zeroes only where
      ``starts_window(batch_idx)`` (Lightning's own function does the zeroing, hooks included).

    Raises:
        RuntimeError: If this Lightning lacks those decisions (``who``: the callback, in the message).
    """
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
            f"{who}: Lightning {pl.__version__} lacks fit_loop.epoch_loop._accumulated_batches_reached, "
            ".automatic_optimization._make_zero_grad_fn or .batch_progress, where Lightning 2.6 decides when to step "
            "and when to zero the gradients (this callback replaces those decisions). Use a Lightning that has them, "
            "or Trainer(accumulate_grad_batches=K) for a constant count."
        )
    lightning_zero_grad_fn = automatic._make_zero_grad_fn  # type: ignore[union-attr]

    def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Any:
        if not starts_window(batch_idx):
            return None
        # Lightning zeroes when batch_idx % accumulate_grad_batches == 0, true with 1; the rest (skipping backward,
        # the zero-grad hooks) stays Lightning's own.
        size, trainer.accumulate_grad_batches = trainer.accumulate_grad_batches, 1
        try:
            return lightning_zero_grad_fn(batch_idx, optimizer)
        finally:
            trainer.accumulate_grad_batches = size

    patches.set(epoch_loop, "_accumulated_batches_reached", lambda: window_ends(progress.current.ready))
    patches.set(automatic, "_make_zero_grad_fn", make_zero_grad_fn)
