"""Lightning glue every callback shares: refusing a resume with other settings, work done on rank 0 alone, patches of
objects the callbacks do not own (Lightning's train-loader request and accumulation decisions, a LightningModule's
``configure_optimizers``) undone at teardown, the trainer's accumulation as a callback sees it, and a train loader
remade around another sampler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.utils.data import DataLoader, IterableDataset

from lightning_peft._seams import data_parallel

T = TypeVar("T")


def refuse_changed_settings(
    who: str, saved: dict[str, Any], now: dict[str, Any], ignored: tuple[str, ...] = ()
) -> None:
    """Raise if a resumed callback's settings differ from the checkpoint's (``ignored``: settings that only steer
    training and may change on resume). Called from a callback's ``load_state_dict``."""
    differing = [k for k in saved if k not in ignored and saved[k] != now.get(k)]
    if differing:
        raise ValueError(
            f"{who}: the checkpoint was trained with " + ", ".join(f"{k}={saved[k]!r}" for k in differing)
            + "; this run has " + ", ".join(f"{k}={now.get(k)!r}" for k in differing)
            + ". Resume with the checkpoint's settings, or start a new run without ckpt_path."
        )


def on_rank_zero(trainer: pl.Trainer, work: Callable[[], T], who: str, what: str, share: bool = False) -> T | None:
    """Run ``work`` on global rank 0; if it fails there, every rank raises (none is left waiting in a collective).

    ``share``: every rank returns rank 0's result (broadcast); otherwise the other ranks return None.
    """
    error: Exception | None = None
    result = None
    if trainer.is_global_zero:
        try:
            result = work()
        except Exception as caught:  # re-raised below, after the other ranks heard of it
            error = caught
    message = None if error is None else f"{type(error).__name__}: {error}"
    shared, failure = trainer.strategy.broadcast((result if share else None, message), src=0)
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"{who}: {what} on rank 0 failed ({failure}); stopping this rank as well.")
    return shared if share else result


# ------------------------------------------------------------------------------------- patches of Lightning's loops

_MISSING = object()


class Patches:
    """Attributes a callback sets on objects it does not own, for one fit (or one ``with`` block), undone in reverse
    order.

    Lightning 2.6 has no public hook for some decisions (which train loader to use, when to step and zero under
    accumulation, how a LightningModule builds its optimizers); a callback replaces them on the trainer's loop objects
    or the module (instance attributes) and gives them back at ``teardown`` (and ``on_exception``: Lightning skips
    teardown hooks after an exception). On a class (``Optimizer.add_param_group``), use it as a context manager.
    """

    def __init__(self) -> None:
        self._done: list[tuple[object, str, object]] = []

    def __bool__(self) -> bool:
        return bool(self._done)

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def set(self, owner: object, name: str, value: object) -> None:
        """``owner.name = value``, remembering what ``vars(owner)`` held (nothing: the class's attribute showed)."""
        self._done.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, before in reversed(self._done):
            if before is not _MISSING:
                setattr(owner, name, before)
            elif name in vars(owner):
                delattr(owner, name)
        self._done.clear()


def wrap_train_loader(trainer: pl.Trainer, patches: Patches, transform: Callable[[Any], Any], who: str, purpose: str,
                      fix: str) -> None:
    """Make Lightning's one request for the train loader return ``transform(loader)``.

    Lightning has no public hook that transforms the train loader, so ``trainer.fit_loop._data_source.dataloader``
    (the one call through which it asks, whether the loader comes from the LightningModule, the datamodule or
    ``fit(train_dataloaders=...)``) is wrapped. Lightning calls it in ``setup_data``, from
    ``trainer.estimated_stepping_batches`` or at the start of the fit loop: after the LightningModule's ``setup``
    (which may build the data), before the first step. Wrapping the datamodule's hook instead would miss loaders
    passed to ``fit`` directly.

    Raises:
        RuntimeError: If this Lightning has no such call (``purpose``: what the callback does through it; ``fix``:
            what to do instead).
    """
    source = getattr(trainer.fit_loop, "_data_source", None)
    if not callable(getattr(source, "dataloader", None)):
        raise RuntimeError(
            f"{who}: this Lightning version ({pl.__version__}) has no trainer.fit_loop._data_source.dataloader, "
            f"through which the callback {purpose}; {fix}."
        )
    original = source.dataloader
    patches.set(source, "dataloader", lambda: transform(original()))


def train_loader(trainer: pl.Trainer) -> Any:
    """The train loader as the user gave it (not Lightning's processed copy), or None if the trainer has none.

    Calling the user's loader, not ``setup_data``: loading Lightning's copy here would skip, on resume, the restoring
    of a stateful loader's position (Lightning restores it only when it loads the loader itself).
    """
    if trainer.train_dataloader is not None:
        return trainer.train_dataloader
    source = getattr(trainer.fit_loop, "_data_source", None)
    return source.dataloader() if source is not None and source.is_defined() else None


def loader_batch_size(loader: Any, who: str, fix: str) -> int:
    """The train loader's fixed ``batch_size`` (or its batch sampler's).

    Raises:
        RuntimeError: If ``loader`` is None (the trainer has none).
        ValueError: If it has no fixed batch size (``fix``: what to do instead).
    """
    if loader is None:
        raise RuntimeError(f"{who}: the trainer has no train dataloader to read the micro-batch size from; pass one to "
                           "fit.")
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{who}: the train dataloader ({type(loader).__name__}) has no fixed batch_size to derive the "
                         f"count from; {fix}.")
    return size


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


# ---------------------------------------------------------------------------------- a train loader with our sampler


def check_resamplable(loader: object, who: str) -> DataLoader:
    """``loader`` if it is one ``DataLoader`` of a map-style dataset with a ``batch_size``, whose sampler can be
    replaced; raises ``TypeError`` naming what it is otherwise."""
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"{who}: the train dataloader is a {type(loader).__name__}; it must be one torch DataLoader (not a list "
            "or dict of them, nor a CombinedLoader), whose sampler the callback replaces."
        )
    if loader.batch_size is None or isinstance(loader.dataset, IterableDataset):
        given = (f"an IterableDataset ({type(loader.dataset).__name__})" if isinstance(loader.dataset, IterableDataset)
                 else f"a custom batch_sampler ({type(loader.batch_sampler).__name__}) and batch_size=None")
        raise TypeError(
            f"{who}: the train DataLoader has {given}; it must have a map-style dataset and a batch_size, because "
            f"the curriculum sampler chooses each batch's samples. Give the DataLoader a map-style dataset and "
            f"batch_size=..., or remove the {who} callback."
        )
    return loader


class ResampledLoader:
    """What Lightning gets as the train loader: the user's DataLoader remade around another sampler.

    The copy has the same dataset, batch size, collate function and worker settings. It is wrapped in this small
    iterable, *not* a ``DataLoader``: under DDP Lightning would otherwise wrap the sampler in its
    ``DistributedSamplerWrapper``, which reshuffles within each rank (with ``use_distributed_sampler=False`` too, the
    split is the sampler's own). Its iterator starts the DataLoader's (and the workers' prefetching) only at the
    first batch, after a checkpoint is restored and the epoch is set. The sampler needs ``seed`` and ``epoch``.
    """

    def __init__(self, template: DataLoader, sampler: Any) -> None:
        self._kwargs = {
            "batch_size": template.batch_size, "collate_fn": template.collate_fn,
            "num_workers": template.num_workers, "pin_memory": template.pin_memory,
            "drop_last": template.drop_last, "timeout": template.timeout,
            "worker_init_fn": template.worker_init_fn,
            "multiprocessing_context": template.multiprocessing_context, "generator": template.generator,
            "persistent_workers": template.persistent_workers,
            "pin_memory_device": template.pin_memory_device,
        }
        if template.num_workers > 0:
            self._kwargs["prefetch_factor"] = template.prefetch_factor
        if hasattr(template, "in_order"):
            self._kwargs["in_order"] = template.in_order
        self.dataset = template.dataset
        self.use(sampler)

    def use(self, sampler: Any) -> None:
        """Remake the DataLoader around ``sampler``."""
        self.sampler = sampler
        self.loader = DataLoader(self.dataset, sampler=sampler, **self._kwargs)
        self._own_generator = self._kwargs["generator"] is None
        if self._own_generator:
            # A DataLoader without a generator seeds its workers with a draw from torch's global generator when its
            # iterator starts: at an epoch's first batch in a straight run, after the restore in a resumed one, so
            # the resumed run's dropout would draw one step behind. Its own generator, seeded per epoch, draws none.
            self.loader.generator = torch.Generator()

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    @property
    def worker_init_fn(self) -> Callable[[int], None] | None:
        return self.loader.worker_init_fn

    @worker_init_fn.setter
    def worker_init_fn(self, value: Callable[[int], None] | None) -> None:
        self.loader.worker_init_fn = value  # set by Lightning under seed_everything(workers=True)

    @property
    def _iterator(self) -> Any:  # Lightning shuts persistent workers down through it
        return self.loader._iterator

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        self.loader._iterator = value

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        if self._own_generator:
            self.loader.generator.manual_seed(self.sampler.seed * 1_000_003 + self.sampler.epoch)
        yield from self.loader
