"""``Curriculum`` callback: easiest data first (a scoring and a pacing function); sequence-length warm-up.

The rules live in `lightning_peft.training.curriculum` (Hacohen & Weinshall, arXiv:1904.03626). In ``setup`` the
callback wraps Lightning's one request for the train loader (``_train_loader.wrap_train_loader``, undone at
``teardown``), so the user's ``train_dataloader`` stays as it is: the wrapper scores the loader's dataset (once per fit,
on rank 0, broadcast so that every rank sorts alike) and hands Lightning a copy with a
[`CurriculumSampler`][lightning_peft.training.CurriculumSampler] (``_train_loader.ResampledLoader``, which Lightning's
DDP wrapping leaves alone: rank ``r`` takes positions ``r::R`` of one global stream).

Resume. The callback's state holds its settings (a resume with others is refused), the scores (so a self-paced run
keeps the order of its untrained model) and the position ``(epoch, batches done)``, read from the trainer's own
progress counters when the checkpoint is written: on resume Lightning skips that many batches of the epoch and the
sampler starts after them, so a resumed run draws what the straight run drew. (Lightning's own loader-state mechanism
is not used: it is skipped when ``configure_optimizers`` asks for ``estimated_stepping_batches``, as
``HFSequenceClassifier`` does. Lightning therefore still warns, on a mid-epoch resume, that the dataloader "is not
resumable"; for this loader the warning is wrong.)

Logged: ``curriculum_fraction`` (the admitted share at the step) and, with the warm-up, ``sequence_length``.

YAML:

```yaml
- class_path: lightning_peft.callbacks.Curriculum
  init_args: {duration: 103, scorer: length, pacing: linear, start_fraction: 0.3}
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_peft._checks import integer
from lightning_peft._seams import data_parallel, refuse, splits_layers, strategy_family
from lightning_peft.callbacks._accumulation import accumulation_of, limited_batches, refuse_epoch_accumulation
from lightning_peft.callbacks._lightning import Patches, PatchingCallback, on_rank_zero, refuse_changed_settings
from lightning_peft.callbacks._train_loader import ResampledLoader, check_resamplable, wrap_train_loader
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.callbacks.merge_on_save import TRAINING_RECORD
from lightning_peft.training.curriculum import (
    CurriculumSampler, LengthScorer, LossScorer, check_ordered, check_pacing, check_teacher, compute_scores,
    dotted_name, load_teacher, resolve_scorer, teacher_report, warm_up_batch, warmup_length,
)

__all__ = ["Curriculum"]

_SETTINGS = ("duration", "scorer", "teacher", "pacing", "start_fraction", "stairs", "seed",
             "length_warmup_steps", "min_length", "max_length")


class Curriculum(PatchingCallback):
    """Train on the easiest share of the data first, growing it with the optimizer step; resumable, DDP-aware.

    Args:
        duration: Optimizer steps until all the data is admitted (the pacing's ``T``).
        scorer: ``"length"`` (number of real tokens of ``sample["input_ids"]``, or the attention mask's sum),
            ``"loss"`` (self-paced: the loss of each sample under the model as it is when training starts,
            with the loader's collate function and batch size), or a scoring function ``sample -> float``: the
            function itself or its dotted import path (``"my_package.scores.rarity"``). Low scores are easy; data
            whose samples all score the same has no order and is refused (unless ``start_fraction=1``).
        pacing: ``"linear"``, ``"root"``, ``"step"`` or ``"exponential"`` (see ``pacing_fraction``).
        start_fraction: Share of the easiest data admitted at step 0, in ``(0, 1]``.
        stairs: Number of equal rises of the ``"step"`` pacing.
        seed: Seed of the draws and of the order of tied scores.
        cache_dir: Folder where scores are cached, keyed by the data and the scorer; None: no cache.
        teacher: For ``scorer="loss"``: a directory holding a Hugging Face sequence classifier saved with
            ``save_pretrained`` (``MergeOnSave`` writes one as ``<dirpath>/merged``) whose per-sample loss scores
            the data (Hacohen & Weinshall's transfer scoring); None scores with the model being trained, as it is
            when training starts (self-paced).
        model_attribute: For ``scorer="loss"`` without a teacher: the model inside the LightningModule to score with
            (see ``LoRA``); None picks its one Hugging Face model, or the LightningModule itself.
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
        integer("Curriculum", "seed", seed, minimum=0)
        integer("Curriculum", "length_warmup_steps", length_warmup_steps, minimum=0, meaning="0 turns the warm-up off")
        if length_warmup_steps:
            warmup_length(0, min_length, max_length, length_warmup_steps, who="Curriculum")
        self.scoring_function = resolve_scorer(scorer, "Curriculum")
        check_teacher(teacher, scorer, "Curriculum")
        self.scorer = scorer if isinstance(scorer, str) else dotted_name(scorer)
        self.duration, self.pacing, self.start_fraction = duration, pacing, start_fraction
        self.stairs, self.seed = stairs, seed
        self.teacher, self.cache_dir, self.model_attribute, self.log_values = teacher, cache_dir, model_attribute, log
        self.length_warmup_steps, self.min_length, self.max_length = length_warmup_steps, min_length, max_length
        self._self_paced = self.scoring_function is None and scorer == "loss" and teacher is None  # the model scores
        self.scores: Tensor | None = None  # (N,) of the current fit
        self.sampler: CurriculumSampler | None = None
        self._trainer: pl.Trainer | None = None
        self._patches = Patches()
        self._loader: ResampledLoader | None = None
        self._restored: dict[str, Any] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        if stage != "fit":
            return
        refuse_epoch_accumulation(trainer, "Curriculum", "changes the count between epochs, and the curriculum paces by "
                                  "the optimizer step of each batch; use lightning_peft.callbacks.GradientAccumulation("
                                  "schedule={step: count}) keyed by each epoch's first step (the curriculum follows it)")
        _check_scoring(self, trainer)
        self._trainer, self.scores, self.sampler, self._loader = trainer, None, None, None
        wrap_train_loader(trainer, self._patches, lambda loader: self._curriculum_loader(loader, trainer, pl_module),
                          "Curriculum", "replaces the train sampler", "use Lightning 2.x (tested: 2.6)")

    def _curriculum_loader(self, loader: object, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        loader = check_resamplable(loader, "Curriculum")
        self._loader = ResampledLoader(loader, self._resample(loader, trainer, pl_module))
        return self._loader

    def _resample(self, loader: DataLoader, trainer: pl.Trainer, pl_module: pl.LightningModule) -> CurriculumSampler:
        """The scores and a sampler over them for ``loader``, at the restored position if any. Every loader made
        before training starts gets it (DeepSpeed makes one before the restore, the fit loop another after it);
        one reloaded later starts afresh (`on_train_start` lets the restored state go)."""
        scores = self._scores(loader, trainer, pl_module)
        if self.start_fraction < 1.0:  # else every step admits all the data: no order is used (the warm-up alone)
            check_ordered(scores, self.scorer, "Curriculum")
        replicas, rank = data_parallel(trainer.strategy)  # not the world: pipeline stages share one batch
        settings = {
            "batch_size": loader.batch_size, "duration": self.duration, "pacing": self.pacing,
            "start_fraction": self.start_fraction, "stairs": self.stairs, "seed": self.seed,
            "num_replicas": replicas, "rank": rank, "drop_last": loader.drop_last,
            "accumulate_grad_batches": accumulation_of(trainer, loader.batch_size),
        }
        sampler = CurriculumSampler(scores, **settings)
        limited = limited_batches(sampler.full_batches, trainer.limit_train_batches)
        if limited != sampler.full_batches:  # epochs cut short: the step count follows the trainer's
            sampler = CurriculumSampler(scores, **settings, batches_per_epoch=limited)
        if self._restored and self._restored["position"] is not None:
            sampler.load_state_dict(self._restored["position"])
        self.scores, self.sampler = scores, sampler
        return sampler

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
        if self._self_paced and strategy_family(trainer.strategy) != "plain":  # a sharded model's forward runs
            # collectives on every rank: every rank scores (rank 0 writes the cache)
            return compute_scores(loader.dataset, self._scorer(loader, pl_module),
                                  cache_dir=self.cache_dir if trainer.global_rank == 0 else None)
        work = lambda: compute_scores(loader.dataset, self._scorer(loader, pl_module), cache_dir=self.cache_dir)  # noqa: E731
        return on_rank_zero(trainer, work, "Curriculum", "scoring", share=True)

    def _scorer(self, loader: DataLoader, pl_module: pl.LightningModule) -> Callable[[Any], float]:
        if self.scoring_function is not None:
            return self.scoring_function
        if self.scorer == "length":
            return LengthScorer()
        if self.teacher is None:  # self-paced
            model = resolve_target(pl_module, self.model_attribute, "Curriculum")[1]
        else:
            model = load_teacher(self.teacher, "Curriculum").to(pl_module.device)
            told, warning = teacher_report(self.teacher, TRAINING_RECORD, "Curriculum")
            rank_zero_info(told)
            if warning:
                rank_zero_warn(warning)
        return LossScorer(model, collate_fn=loader.collate_fn, batch_size=loader.batch_size)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restored = None  # the train loader is made: a later reload starts its epoch afresh

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.sampler is None:
            return
        step = trainer.global_step
        if self.log_values:
            pl_module.log("curriculum_fraction", self.sampler.fraction(step), on_step=True, on_epoch=False)
        if not self.length_warmup_steps:
            return
        length = warm_up_batch(batch, step, self.min_length, self.max_length, self.length_warmup_steps, "Curriculum")
        if self.log_values:
            pl_module.log("sequence_length", float(length), on_step=True, on_epoch=False)

    def _settings(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SETTINGS}

    @override
    def state_dict(self) -> dict[str, Any]:
        position = None
        if self.sampler is not None and self._trainer is not None:  # from the trainer: workers fetch ahead
            trainer = self._trainer
            position = self.sampler.position(trainer.fit_loop.epoch_loop.batch_progress.current.ready, trainer.global_step)
        return {**self._settings(), "scores": self.scores, "position": position}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse_changed_settings("Curriculum", {name: state_dict.get(name) for name in _SETTINGS}, self._settings())
        self._restored = {"scores": state_dict.get("scores"), "position": state_dict.get("position")}
        if self._loader is not None and self._trainer is not None:  # the loader came first (some strategies)
            self._loader.use(self._resample(self._loader.loader, self._trainer, self._trainer.lightning_module))


def _check_scoring(curriculum: Curriculum, trainer: pl.Trainer) -> None:
    """Raises for self-paced scoring under a strategy that puts different layers on different ranks."""
    if curriculum._self_paced and splits_layers(trainer.strategy):
        raise refuse(
            "Curriculum(scorer='loss')", trainer.strategy,
            "self-paced scoring runs the whole model on each sample, and this strategy keeps only some layers on "
            "each rank", "score with a teacher (Curriculum(scorer='loss', teacher=<a saved model directory>)), "
            "with scorer='length' or a function, or pass the scores through a cached run on one process",
        )
