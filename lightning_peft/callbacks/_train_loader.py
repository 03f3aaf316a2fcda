"""The train loader as a callback reads and replaces it: Lightning's one request for it wrapped, the loader as the user
gave it, its fixed batch size, and a train loader remade around another sampler (the curriculum's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_peft.callbacks._lightning import Patches


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


def restore_loader_position(trainer: pl.Trainer) -> None:
    """Give the train loader the position the checkpoint holds, when Lightning loaded the loader before the restore.

    Lightning positions a stateful train loader (``state_dict`` / ``load_state_dict``) when it loads the loader after
    the checkpoint's training state. ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` (the usual
    total of a warm-up schedule) loads it earlier, and Lightning then keeps the position without ever applying it
    (Lightning issue 20550), so a mid-epoch resume would train on the epoch's first batches again. Call it before
    the first batch (``on_train_start``): the position is applied, and the epoch's iterator made again from it, as
    Lightning does after loading the loader itself. The new iterator's seed draw is isolated, so the generators stay
    where the restore left them.
    """
    loop = trainer.fit_loop
    # Lightning's own fields, read directly: a Lightning that renamed them fails here loudly (the test of this
    # resume fails too), rather than resuming from the epoch's start without a word.
    pending = loop._combined_loader_states_to_load
    if not (loop.restarting and pending and loop._data_fetcher is not None):
        return  # not resuming, or nothing pending: Lightning applied the position (or there is none)
    loop._load_combined_loader_states()
    with isolate_rng():
        iter(loop._data_fetcher)  # the epoch's iterator from the restored position (Lightning's setup_data does so)


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


# ---------------------------------------------------------------------------------- a train loader with our sampler


def check_resamplable(loader: object, who: str) -> DataLoader:
    """``loader`` if it is one ``DataLoader`` of a map-style dataset with a ``batch_size``, whose sampler can be
    replaced without losing what it chose (`_default_sampler`); raises ``TypeError`` naming what it is otherwise."""
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
    if not _default_sampler(loader):
        raise TypeError(
            f"{who}: the train DataLoader has a sampler of its own ({_sampler_name(loader.sampler, loader.dataset)}), "
            f"which the curriculum sampler would replace: it chooses every batch's samples, so that sampler's "
            f"choice would be lost. To train on part of the data, give the DataLoader "
            f"torch.utils.data.Subset(dataset, indices) as its dataset; else drop sampler= (shuffle=True or False is "
            f"fine: the curriculum owns the order), or remove the {who} callback."
        )
    return loader


def _default_sampler(loader: DataLoader) -> bool:
    """Whether ``loader``'s sampler only orders its whole dataset, so that nothing is lost when the curriculum sampler
    replaces it: the one ``shuffle=`` makes (a ``SequentialSampler``, or a ``RandomSampler`` without replacement or a
    sample count), a plain ``DistributedSampler`` over it (not Lightning's wrapper of a custom sampler), or a sampler
    that declares ``permutes_dataset = True`` (each epoch a permutation of ``range(len(dataset))``, as
    `lightning_peft.data.EpochShuffleSampler`) and has the dataset's length."""
    sampler, dataset = loader.sampler, loader.dataset
    if type(sampler) is SequentialSampler:
        return sampler.data_source is dataset
    if type(sampler) is RandomSampler:
        return sampler.data_source is dataset and not sampler.replacement and sampler._num_samples is None
    if type(sampler) is DistributedSampler:
        return sampler.dataset is dataset
    return getattr(sampler, "permutes_dataset", False) is True and len(sampler) == len(dataset)


def _sampler_name(sampler: Any, dataset: Any) -> str:
    name = type(sampler).__name__
    source = getattr(sampler, "data_source", getattr(sampler, "dataset", dataset))
    if type(sampler) in (SequentialSampler, RandomSampler, DistributedSampler) and source is not dataset:
        return f"{name} over another data source than the DataLoader's dataset"
    if type(sampler) is RandomSampler:  # a shuffle= sampler but for its settings
        return f"RandomSampler(replacement={sampler.replacement}, num_samples={sampler._num_samples})"
    if getattr(sampler, "permutes_dataset", False) is True:
        return f"{name} of {len(sampler)} samples for a dataset of {len(dataset)}"
    return name


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
