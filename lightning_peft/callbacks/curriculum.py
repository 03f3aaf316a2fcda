"""``Curriculum`` callback: easiest data first (a scoring and a pacing function); sequence-length warm-up.

The rules live in :mod:`lightning_peft.training.curriculum` (Hacohen & Weinshall, arXiv:1904.03626); this
callback puts a :class:`~lightning_peft.training.curriculum.CurriculumSampler` under the training data without
any change to the user's ``train_dataloader``, and keeps its position in the checkpoint.

How the sampler gets in. Lightning has no public hook that transforms the train loader, so in ``setup`` the
callback wraps ``trainer.fit_loop._data_source.dataloader`` (the one call through which Lightning asks for the
train loader, whether it comes from the LightningModule, the datamodule or ``fit(train_dataloaders=...)``;
``teardown`` unwraps it). The wrapper takes the user's ``DataLoader``, scores its dataset (once per fit, on
rank 0, broadcast so that every rank sorts alike) and hands Lightning a copy with the same dataset, batch
size, collate function and worker settings, but the curriculum sampler. The copy is wrapped in a small
iterable that is *not* a ``DataLoader``: under DDP Lightning would otherwise wrap the sampler in its
``DistributedSamplerWrapper``, which reshuffles within each rank and so destroys the order (with
``use_distributed_sampler=False`` too, the split is the sampler's own: rank ``r`` takes positions ``r::R`` of
one global stream). It also starts the ``DataLoader`` iterator (and with it the workers' prefetching) only at
the first batch, after a checkpoint is restored and the epoch is set. Wrapping the datamodule's hook instead
would miss loaders passed to ``fit`` directly.

Resume. The callback's state holds its settings (a resume with others is refused), the scores (so a self-paced
run keeps the order of its untrained model) and the position ``(epoch, batches done)``, read from the
trainer's own progress counters when the checkpoint is written: on resume Lightning skips that many batches of
the epoch and the sampler starts after them, so a resumed run draws what the straight run drew. (Lightning's
own loader-state mechanism is not used: it is skipped when ``configure_optimizers`` asks for
``estimated_stepping_batches``, as ``HFSequenceClassifier`` does. Lightning therefore still warns, on a
mid-epoch resume, that the dataloader "is not resumable"; for this loader the warning is wrong.)

Logged: ``curriculum_fraction`` (the admitted share at the step) and, with the warm-up, ``sequence_length``.

YAML::

    - class_path: lightning_peft.callbacks.Curriculum
      init_args: {duration: 103, scorer: length, pacing: linear, start_fraction: 0.3}
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, MutableMapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_peft._seams import data_parallel, refuse, splits_layers, strategy_family
from lightning_peft.callbacks._lightning import on_rank_zero
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.callbacks.gradient_accumulation import GradientAccumulation
from lightning_peft.callbacks.merge_on_save import TRAINING_RECORD
from lightning_peft.training.accumulation import AccumulationSchedule
from lightning_peft.training.curriculum import (
    CurriculumSampler,
    LengthScorer,
    LossScorer,
    check_pacing,
    compute_scores,
    truncate_batch,
    warmup_length,
)

__all__ = ["Curriculum"]

_SETTINGS = ("duration", "scorer", "teacher", "pacing", "start_fraction", "stairs", "seed",
             "length_warmup_steps", "min_length", "max_length")


class Curriculum(Callback):
    """Train on the easiest share of the data first, growing it with the optimizer step; resumable, DDP-aware.

    Args:
        duration: Optimizer steps until all the data is admitted (the pacing's ``T``).
        scorer: ``"length"`` (number of real tokens of ``sample["input_ids"]``, or the attention mask's sum),
            ``"loss"`` (self-paced: the loss of each sample under the model as it is when training starts,
            with the loader's collate function and batch size), or a scoring function ``sample -> float``: the
            function itself or its dotted import path (``"my_package.scores.rarity"``). Low scores are easy.
        pacing: ``"linear"``, ``"root"``, ``"step"`` or ``"exponential"`` (see ``pacing_fraction``).
        start_fraction: Share of the easiest data admitted at step 0, in ``(0, 1]``.
        stairs: Number of equal rises of the ``"step"`` pacing.
        seed: Seed of the draws and of the order of tied scores.
        cache_dir: Folder where scores are cached, keyed by the data and the scorer; None: no cache.
        teacher: For ``scorer="loss"``: a directory holding a Hugging Face sequence classifier saved with
            ``save_pretrained`` (``MergeOnSave`` writes one as ``<dirpath>/merged``) whose per-sample loss scores
            the data (Hacohen & Weinshall's transfer scoring); None scores with the model being trained, as it is
            when training starts (self-paced).
        model_attribute: For ``scorer="loss"`` without a teacher: the model inside the LightningModule to score with (see
            ``LoRA``); None picks its one Hugging Face model, or the LightningModule itself.
        length_warmup_steps: Sequence-length warm-up over this many optimizer steps; 0 turns it off. Batches
            must then be dicts of ``(B, T)`` tensors, cut in place in ``on_train_batch_start``.
        min_length: Sequence length at step 0 of the warm-up.
        max_length: Sequence length at its end (longer batches are cut to it from then on).
        log: Log ``curriculum_fraction`` (and ``sequence_length`` with the warm-up) every step.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, the pacing unknown, or a scoring path cannot be imported.
    """

    def __init__(
        self,
        duration: int,
        scorer: str | Callable[[Any], float] = "length",
        pacing: str = "linear",
        start_fraction: float = 0.2,
        stairs: int = 4,
        seed: int = 0,
        cache_dir: str | None = None,
        teacher: str | None = None,
        model_attribute: str | None = None,
        length_warmup_steps: int = 0,
        min_length: int = 8,
        max_length: int = 512,
        log: bool = True,
    ) -> None:
        check_pacing(pacing, start_fraction, duration, stairs, who="Curriculum")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"Curriculum(seed={seed!r}): seed must be an integer >= 0.")
        if seed < 0:
            raise ValueError(f"Curriculum(seed={seed!r}): seed must be an integer >= 0.")
        if isinstance(length_warmup_steps, bool) or not isinstance(length_warmup_steps, int):
            raise TypeError(
                f"Curriculum(length_warmup_steps={length_warmup_steps!r}): it must be an integer >= 0."
            )
        if length_warmup_steps < 0:
            raise ValueError(
                f"Curriculum(length_warmup_steps={length_warmup_steps}): it must be >= 0 (0 turns the "
                "warm-up off)."
            )
        if length_warmup_steps:
            warmup_length(0, min_length, max_length, length_warmup_steps, who="Curriculum")
        self.scoring_function = _resolve_scorer(scorer)
        _check_teacher(teacher, scorer)
        self.teacher = teacher
        self.duration, self.pacing, self.start_fraction = duration, pacing, start_fraction
        self.stairs, self.seed = stairs, seed
        self.scorer = scorer if isinstance(scorer, str) else _dotted_name(scorer)
        self.cache_dir, self.model_attribute = cache_dir, model_attribute
        self.length_warmup_steps = length_warmup_steps
        self.min_length, self.max_length = min_length, max_length
        self.log_values = log
        self.scores: Tensor | None = None  # (N,) of the current fit
        self.sampler: CurriculumSampler | None = None
        self._trainer: pl.Trainer | None = None
        self._source: Any = None
        self._loader: _CurriculumLoader | None = None
        self._restored: dict[str, Any] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        if stage != "fit":
            return
        source = getattr(trainer.fit_loop, "_data_source", None)
        if not callable(getattr(source, "dataloader", None)):
            raise RuntimeError(
                f"Curriculum: this Lightning version ({pl.__version__}) has no trainer.fit_loop._data_source."
                "dataloader, through which the callback replaces the train sampler; use Lightning 2.x "
                "(tested: 2.6)."
            )
        _check_accumulation(trainer)
        _check_scoring(self, trainer)
        original = source.dataloader
        self._trainer, self._source = trainer, source
        self.scores, self.sampler, self._loader = None, None, None
        source.dataloader = lambda: self._curriculum_loader(original(), trainer, pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._source is not None and "dataloader" in vars(self._source):
            del self._source.dataloader  # the class's method again
        self._source = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning skips teardown hooks after an exception

    def _curriculum_loader(
        self, loader: object, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> _CurriculumLoader:
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"Curriculum: the train dataloader is a {type(loader).__name__}; it must be one torch "
                "DataLoader (not a list or dict of them, nor a CombinedLoader), whose sampler the callback "
                "replaces."
            )
        if loader.batch_size is None or isinstance(loader.dataset, IterableDataset):
            given = (f"an IterableDataset ({type(loader.dataset).__name__})" if isinstance(loader.dataset, IterableDataset)
                     else f"a custom batch_sampler ({type(loader.batch_sampler).__name__}) and batch_size=None")
            raise TypeError(
                f"Curriculum: the train DataLoader has {given}; it must have a map-style dataset and a batch_size, "
                "because the curriculum sampler chooses each batch's samples. Give the DataLoader a map-style "
                "dataset and batch_size=..., or remove the Curriculum callback."
            )
        scores = self._scores(loader, trainer, pl_module)
        sampler = self._make_sampler(scores, loader, trainer)
        self.scores, self.sampler, self._restored = scores, sampler, None  # a reloaded loader starts afresh
        self._loader = _CurriculumLoader(loader, sampler)
        return self._loader

    def _scores(self, loader: DataLoader, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Tensor:
        """The restored scores, the ones of this fit (a reloaded loader), or new ones scored on rank 0."""
        count = len(loader.dataset)
        restored = self._restored["scores"] if self._restored else None
        if restored is not None:
            if len(restored) != count:
                raise ValueError(
                    f"Curriculum: the checkpoint holds the scores of {len(restored)} samples, but the train "
                    f"dataset has {count}; resume with the data of the checkpoint's run, or start a new run "
                    "without ckpt_path."
                )
            return restored
        if self.scores is not None and len(self.scores) == count:
            return self.scores
        if self._scores_on_every_rank(trainer):  # a sharded model's forward runs collectives on every rank
            return compute_scores(loader.dataset, self._scorer(loader, pl_module),
                                  cache_dir=self.cache_dir if trainer.global_rank == 0 else None)
        work = lambda: compute_scores(loader.dataset, self._scorer(loader, pl_module), cache_dir=self.cache_dir)  # noqa: E731
        return on_rank_zero(trainer, work, "Curriculum", "scoring", share=True)

    def _scores_on_every_rank(self, trainer: pl.Trainer) -> bool:
        """Self-paced scoring under a strategy that shards the model: every rank must run the forward."""
        return self._self_paced and strategy_family(trainer.strategy) != "plain"

    @property
    def _self_paced(self) -> bool:
        return self.scoring_function is None and self.scorer == "loss" and self.teacher is None

    def _scorer(self, loader: DataLoader, pl_module: pl.LightningModule) -> Callable[[Any], float]:
        if self.scoring_function is not None:
            return self.scoring_function
        if self.scorer == "length":
            return LengthScorer()
        if self.teacher is not None:
            model = _load_teacher(self.teacher).to(pl_module.device)
            return LossScorer(model, collate_fn=loader.collate_fn, batch_size=loader.batch_size)
        _, model = resolve_target(pl_module, self.model_attribute, "Curriculum")
        return LossScorer(model, collate_fn=loader.collate_fn, batch_size=loader.batch_size)

    def _make_sampler(self, scores: Tensor, loader: DataLoader, trainer: pl.Trainer) -> CurriculumSampler:
        replicas, rank = data_parallel(trainer.strategy)  # not the world: pipeline stages share one batch
        settings = {
            "batch_size": loader.batch_size, "duration": self.duration, "pacing": self.pacing,
            "start_fraction": self.start_fraction, "stairs": self.stairs, "seed": self.seed,
            "num_replicas": replicas, "rank": rank, "drop_last": loader.drop_last,
            "accumulate_grad_batches": _accumulation(trainer, loader.batch_size),
        }
        sampler = CurriculumSampler(scores, **settings)
        limited = _limited_batches(sampler.full_batches, trainer.limit_train_batches)
        if limited != sampler.full_batches:  # epochs cut short: the step count follows the trainer's
            sampler = CurriculumSampler(scores, **settings, batches_per_epoch=limited)
        position = self._restored["position"] if self._restored else None
        if position is not None:
            sampler.load_state_dict(position)
        return sampler

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.sampler is None:
            return
        step = trainer.global_step
        if self.log_values:
            fraction = self.sampler.pool_size(step) / len(self.sampler.order)
            pl_module.log("curriculum_fraction", fraction, on_step=True, on_epoch=False)
        if not self.length_warmup_steps:
            return
        if not isinstance(batch, MutableMapping):
            raise TypeError(
                f"Curriculum(length_warmup_steps={self.length_warmup_steps}): the batch is a "
                f"{type(batch).__name__}; the sequence-length warm-up needs dict batches of (B, T) tensors "
                "(input_ids, attention_mask, ...)."
            )
        length = warmup_length(step, self.min_length, self.max_length, self.length_warmup_steps)
        batch.update(truncate_batch(batch, length))  # in place: training_step gets this same dict
        if self.log_values:
            pl_module.log("sequence_length", float(batch["input_ids"].shape[1]), on_step=True, on_epoch=False)

    def _settings(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SETTINGS}

    @override
    def state_dict(self) -> dict[str, Any]:
        position = None
        if self.sampler is not None and self._trainer is not None:
            done = self._trainer.fit_loop.epoch_loop.batch_progress.current.ready
            position = {"epoch": self.sampler.epoch, "batches": min(done, self.sampler.batches_per_epoch),
                        "step": self._trainer.global_step, "epoch_step": self.sampler.step(self.sampler.epoch, 0)}
        return {**self._settings(), "scores": self.scores, "position": position}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {name: state_dict.get(name) for name in _SETTINGS}
        now = self._settings()
        if saved != now:
            raise ValueError(
                f"Curriculum: the checkpoint was trained with {saved}; this run has {now}. Resume with the "
                "checkpoint's settings, or start a new run without ckpt_path."
            )
        self._restored = {"scores": state_dict.get("scores"), "position": state_dict.get("position")}
        if self._loader is not None and self._trainer is not None:  # the loader came first (some strategies)
            loader = self._loader.loader
            scores = self._scores(loader, self._trainer, self._trainer.lightning_module)
            self.scores, self.sampler = scores, self._make_sampler(scores, loader, self._trainer)
            self._loader.use(self.sampler)
            self._restored = None


class _CurriculumLoader:
    """What Lightning gets as the train loader: the user's DataLoader remade with the curriculum sampler.

    Not a ``DataLoader`` itself, so that Lightning leaves the sampler alone; its iterator starts the
    DataLoader's (and the workers' prefetching) only when the first batch is asked for.
    """

    def __init__(self, template: DataLoader, sampler: CurriculumSampler) -> None:
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

    def use(self, sampler: CurriculumSampler) -> None:
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


def _limited_batches(batches: int, limit: float) -> int:
    """The batches of an epoch that ``Trainer(limit_train_batches=limit)`` trains (as Lightning counts)."""
    if isinstance(limit, int):
        return max(1, min(batches, limit))
    return max(1, int(batches * limit))


def _check_accumulation(trainer: pl.Trainer) -> None:
    """Raises for Lightning's epoch-keyed accumulation scheduler, whose windows the pacing cannot follow."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, GradientAccumulationScheduler):
            raise ValueError(
                f"Curriculum: GradientAccumulationScheduler(scheduling={callback.scheduling}) changes the number of "
                "micro-batches per optimizer step between epochs, and the curriculum paces by the optimizer step of "
                "each batch; use lightning_peft.callbacks.GradientAccumulation(schedule={step: count}) instead, "
                "keyed by the first optimizer step of each epoch (the curriculum follows its windows)."
            )


def _accumulation(trainer: pl.Trainer, micro_batch_size: int) -> int | AccumulationSchedule:
    """Micro-batches per optimizer step: a ``GradientAccumulation`` callback's schedule, else the trainer's count.

    (While ``GradientAccumulation`` runs, ``trainer.accumulate_grad_batches`` holds the current window's length,
    which at an epoch's end is shorter; its own schedule is the one to pace by.)
    """
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, GradientAccumulation):
            if callback.schedule is not None:
                return callback.schedule
            count = callback.count_for(micro_batch_size, data_parallel(trainer.strategy)[0])
            if count is not None:
                return count
    return trainer.accumulate_grad_batches


def _check_scoring(curriculum: Curriculum, trainer: pl.Trainer) -> None:
    """Raises for self-paced scoring under a strategy that puts different layers on different ranks."""
    if curriculum._self_paced and splits_layers(trainer.strategy):
        raise refuse(
            "Curriculum(scorer='loss')", trainer.strategy,
            "self-paced scoring runs the whole model on each sample, and this strategy keeps only some layers on "
            "each rank", "score with a teacher (Curriculum(scorer='loss', teacher=<a saved model directory>)), "
            "with scorer='length' or a function, or pass the scores through a cached run on one process",
        )


def _check_teacher(teacher: object, scorer: object) -> None:
    """Raises unless ``teacher`` is None, or a path and ``scorer`` is ``"loss"``."""
    if teacher is None:
        return
    if not isinstance(teacher, str):
        raise TypeError(f"Curriculum(teacher={teacher!r}): teacher must be the path of a model directory, or None.")
    if scorer != "loss":
        raise ValueError(
            f"Curriculum(scorer={scorer!r}, teacher={teacher!r}): a teacher scores by its loss; set scorer='loss'."
        )


def _load_teacher(directory: str) -> Any:
    """The Hugging Face sequence classifier saved in ``directory``, frozen, in eval mode.

    The directory is looked for here, when the data is scored (before the first step), not when the callback is
    made: a config naming the output of an earlier run must parse before that run has happened.
    """
    if not os.path.isdir(directory):
        raise ValueError(
            f"Curriculum(teacher={directory!r}): no such directory; give a directory written by save_pretrained "
            "(MergeOnSave writes one as <dirpath>/merged, e.g. artifacts/minilm_bbc/merged after `make demo`)."
        )
    try:
        from transformers import AutoModelForSequenceClassification
    except ImportError as error:
        raise RuntimeError(
            "Curriculum(teacher=...) loads a Hugging Face model and needs the transformers package; install it "
            "with `pip install 'lightning-peft[hf]'`."
        ) from error
    try:
        model = AutoModelForSequenceClassification.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"Curriculum(teacher={directory!r}): not a Hugging Face sequence classifier directory ({error})."
        ) from error
    _report_teacher(directory)
    return model.eval().requires_grad_(False)


MIN_TEACHER_STEPS = 100


def _report_teacher(directory: str) -> None:
    """Says which teacher scores the data and how long it trained (MergeOnSave records it next to the export); a
    teacher that trained a few steps, or stopped before its run's end, ranks the data close to an untrained model."""
    record_path = os.path.join(directory, TRAINING_RECORD)
    record = None
    if os.path.isfile(record_path):
        with open(record_path) as handle:
            record = json.load(handle)
    if record is None:
        rank_zero_info(f"Curriculum: scoring with the teacher in {os.path.abspath(directory)} (no training record: not "
                       "written by MergeOnSave).")
        return
    steps, planned = record.get("optimizer_steps"), record.get("planned_steps")
    told = f"{steps} optimizer steps" + (f" of the {planned} its run planned" if planned else "")
    rank_zero_info(f"Curriculum: scoring with the teacher in {os.path.abspath(directory)}, trained for {told}.")
    if isinstance(steps, int) and (steps < MIN_TEACHER_STEPS or (isinstance(planned, int) and steps < planned)):
        rank_zero_warn(
            f"Curriculum(teacher={directory!r}): the teacher trained for {told}; an undertrained teacher ranks the "
            "data close to an untrained model, and the curriculum then orders it almost at random. Train the teacher "
            "to its end first (e.g. `make demo` for artifacts/minilm_bbc/merged), or use scorer='length'."
        )


def _resolve_scorer(scorer: object) -> Callable[[Any], float] | None:
    """None for the built-in names, the callable for a callable or a dotted path to one."""
    if callable(scorer):
        return scorer
    if not isinstance(scorer, str):
        raise TypeError(
            f"Curriculum(scorer={scorer!r}): scorer must be 'length', 'loss', a function sample -> float, or "
            "its dotted import path."
        )
    if scorer in ("length", "loss"):
        return None
    module_name, _, attribute = scorer.rpartition(".")
    try:
        function = getattr(importlib.import_module(module_name), attribute) if module_name else None
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"Curriculum(scorer={scorer!r}): cannot import it ({type(error).__name__}: {error}); use "
            "'length', 'loss', or the dotted path of a function sample -> float."
        ) from None
    if not callable(function):
        raise ValueError(
            f"Curriculum(scorer={scorer!r}): not 'length' or 'loss', nor the dotted path of a function; use "
            "one of those."
        )
    return function


def _dotted_name(function: Callable[..., Any]) -> str:
    module = getattr(function, "__module__", None) or type(function).__module__
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}"

