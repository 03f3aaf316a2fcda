"""``RNGState``: the random generators in every checkpoint, so a resumed run draws what the straight run drew.

Dropout (the model's own and the adapters') draws from the global generators; Lightning saves none of them, so a
run resumed from a checkpoint used to draw other masks than the straight run from the first step on. This hidden
callback saves, with every checkpoint, the state of the generators of **every rank** (torch CPU, CUDA when
available, NumPy, Python's ``random``) and gives each rank its own back on resume.

- Saving: Lightning calls ``state_dict`` on every rank but writes rank 0's copy only, so ``state_dict`` gathers all
  ranks' states to every rank (``torch.distributed.all_gather_object`` on the default group when it is
  initialized). The states are those of the moment the checkpoint is written (after the optimizer step for a step
  checkpoint); a validation inside ``fit`` leaves the training generators as the last batch left them (its
  loader's seed is a draw, and a resumed run skips the validation the straight run ran after a step checkpoint).
- Restoring: the resumed run must reach its first batch with the generators where the straight run had them. The
  straight run made the epoch's train iterator (a draw for its seed) before a mid-epoch checkpoint and after an
  epoch-end one; the resumed run makes one while resuming. So the states are set when loaded (before that
  iterator), set again at ``on_train_start`` for a mid-epoch checkpoint (undoing the iterator's draw), or at
  ``on_train_epoch_start`` when Lightning will make the new epoch's iterator there; the validation Lightning skips
  on resume is run under ``isolate_rng``. A checkpoint saved by another number of processes is resumed with a
  warning, and without its generators (ranks no longer map one to one).

Every lightning-peft callback adds one instance to ``trainer.callbacks`` in its ``setup`` (`keep_rng`); Lightning
restores callback states after ``setup``, by ``state_key``, so a callback added there is restored like one passed to
the ``Trainer``. A ``Trainer`` without any of our callbacks can pass ``RNGState()`` itself.

Mid-epoch, the batches themselves must come back too: that is the loader's part (a loader with ``state_dict`` /
``load_state_dict``, as Lightning requires). When Lightning loaded that loader before the restore (asked for
``estimated_stepping_batches`` in ``configure_optimizers``), ``on_train_start`` gives it the checkpoint's position
(`restore_loader_position`), which Lightning would otherwise drop. Not covered: workers of a mid-epoch iterator (their seeds were drawn at
the epoch's start) and draws made by user hooks that run between the checkpoint and the next batch in one run only.
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng
from typing_extensions import override

from lightning_peft.callbacks._train_loader import restore_loader_position

__all__ = ["RNGState", "keep_rng"]

FORMAT = 1


def _capture() -> dict[str, Any]:
    """This process's generator states, as tensors and plain Python values (loadable with ``weights_only=True``)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _apply(state: dict[str, Any]) -> None:
    """Set this process's generators from a `_capture` result."""
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _world() -> tuple[int, int]:
    """``(size, rank)`` of the default process group, ``(1, 0)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def _gather(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``state``, in rank order, on every rank."""
    size, _ = _world()
    if size == 1:
        return [state]
    gathered: list[Any] = [None] * size
    torch.distributed.all_gather_object(gathered, state)
    return gathered


class RNGState(Callback):
    """Save every rank's random generators with each checkpoint and restore them on resume (see the module)."""

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._saved: dict[str, Any] | None = None  # this rank's state from the checkpoint, until on_train_start
        self._after_step: dict[str, Any] | None = None  # the state at the end of the last training batch
        self._held: dict[str, Any] | None = None  # the training state while a validation inside fit runs

    @property
    @override
    def state_key(self) -> str:
        return "lightning_peft.RNGState"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    @override
    def state_dict(self) -> dict[str, Any]:
        state = self._held if self._held is not None else _capture()
        return {"format": FORMAT, "ranks": _gather(state)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._fitting():
            return
        saved = state_dict.get("ranks") or []
        size, rank = _world()
        if len(saved) != size:
            rank_zero_warn(
                f"RNGState: the checkpoint holds the random generators of {len(saved)} process(es); this run has "
                f"{size}. They are not restored, so dropout and other random draws differ from the run that wrote "
                "the checkpoint. Resume with the same number of processes for a bit-exact continuation."
            )
            return
        # Now, before Lightning makes the train iterator (its seed is a draw): a checkpoint at an epoch's end is
        # followed, in the straight run, by the next epoch's iterator.
        self._saved = saved[rank]
        _apply(self._saved)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        resumed = self._saved is not None
        fetched = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # batches of this epoch before the save
        if resumed and 0 < fetched < trainer.num_training_batches:
            # Mid-epoch: the straight run made this epoch's iterator before the checkpoint, so the draw of the
            # resumed run's new iterator is taken back.
            _apply(self._saved)
            self._saved = None
        # The batches come back too, for a loader made before the restore; after the generators, so that its new
        # iterator draws from where Lightning's would have (isolated: the generators stay where they are).
        restore_loader_position(trainer)
        if resumed:
            _isolate_skipped_validation(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        saved, self._saved = self._saved, None
        loop = trainer.fit_loop
        if saved is not None and trainer.current_epoch > 0 and not loop.is_resuming and not loop.epoch_loop.restarting:
            # This epoch gets a new iterator (Lightning's condition), as it did in the straight run after the
            # checkpoint: the draws of the iterators made while resuming are taken back.
            _apply(saved)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._saved = None
        trainer.fit_loop.epoch_loop.val_loop.__dict__.pop("increment_progress_to_evaluation_end", None)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._after_step = _capture()  # the last hook before a validation makes its iterator (a draw)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A validation inside fit leaves the training generators as the batch left them: a resumed run skips the
        # validation the straight run ran after a step checkpoint, so its draws must not shift the training draws.
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._held, self._after_step = self._after_step, None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        held, self._held = self._held, None
        if held is not None:
            _apply(held)

    def _fitting(self) -> bool:
        return self._trainer is not None and self._trainer.state.fn == TrainerFn.FITTING


def _isolate_skipped_validation(trainer: pl.Trainer) -> None:
    """A run resumed from a checkpoint written just before a validation skips that validation, but Lightning makes
    its iterator (a draw) while skipping it; the straight run's validation left the generators unchanged
    (`RNGState.on_validation_start`), so the skip must too. Undone at the first training batch."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    skip = getattr(val_loop, "increment_progress_to_evaluation_end", None)
    if skip is None:
        return

    def isolated() -> None:
        with isolate_rng():
            skip()

    val_loop.increment_progress_to_evaluation_end = isolated


def keep_rng(trainer: pl.Trainer) -> RNGState:
    """The trainer's `RNGState`, added to ``trainer.callbacks`` if it has none (call it from ``setup``)."""
    for callback in trainer.callbacks:
        if isinstance(callback, RNGState):
            return callback
    callback = RNGState()
    callback._trainer = trainer
    trainer.callbacks.append(callback)
    return callback
