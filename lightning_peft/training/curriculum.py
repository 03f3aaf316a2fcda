"""Curriculum learning: train on the easiest data first and admit harder data as training goes on.

Papers: Bengio et al., "Curriculum Learning", ICML 2009 (doi:10.1145/1553374.1553380); Hacohen & Weinshall,
"On The Power of Curriculum Learning in Training Deep Networks", arXiv:1904.03626 (a *scoring function* orders
the data, a *pacing function* says how much of it is admitted); Platanios et al., "Competence-based Curriculum
Learning for Neural Machine Translation", arXiv:1903.09848 (the "root" pacing). Sequence-length warm-up: Li et
al., "The Stability-Efficiency Dilemma: Investigating Sequence Length Warmup for Training GPT Models",
arXiv:2108.06084, as MosaicML Composer's ``SeqLengthWarmup``.

The pieces, one module each (all importable from here and from [`lightning_peft.training`][lightning_peft.training]):

- scoring (`scoring`): a scorer maps a sample to a number, low = easy
  ([`LengthScorer`][lightning_peft.training.LengthScorer], [`LossScorer`][lightning_peft.training.LossScorer]);
  [`compute_scores`][lightning_peft.training.compute_scores] scores a data set once, with an on-disk cache
  (`score_cache`); a saved teacher model (`teacher`);
- pacing (`pacing`): step ``t`` admits the easiest ``ceil(g(t) * N)`` samples, ``g`` one of `PACINGS`
  ([`pacing_fraction`][lightning_peft.training.pacing_fraction]);
- sampling (`sampler`): [`CurriculumSampler`][lightning_peft.training.CurriculumSampler] draws each batch from its
  step's pool, resumable and split over DDP ranks;
- sequence-length warm-up (`seq_warmup`): [`warmup_length`][lightning_peft.training.warmup_length],
  [`truncate_batch`][lightning_peft.training.truncate_batch].

Shapes: scores ``(N,)`` float64; batches are dicts of ``(B, T)`` tensors (``input_ids``, ``attention_mask``,
...) plus per-sample ones such as ``labels`` ``(B,)``.

Examples:
    Score by length, then draw: step 0 admits the shorter half, step 1 all four samples.

    >>> data = [{"input_ids": [1] * n} for n in (5, 2, 9, 3)]
    >>> scores = compute_scores(data, LengthScorer())
    >>> sampler = CurriculumSampler(scores, batch_size=2, duration=1, start_fraction=0.5)
    >>> sampler.order, sorted(list(sampler)[:2])
    ([1, 3, 0, 2], [1, 3])
"""

from __future__ import annotations

from lightning_peft.training.pacing import PACINGS, check_pacing, pacing_fraction
from lightning_peft.training.sampler import CurriculumSampler
from lightning_peft.training.score_cache import dataset_fingerprint, scorer_fingerprint
from lightning_peft.training.scoring import (
    LengthScorer,
    LossScorer,
    check_ordered,
    classification_loss,
    compute_scores,
    dotted_name,
    resolve_scorer,
)
from lightning_peft.training.seq_warmup import TRUNCATED_KEYS, truncate_batch, warm_up_batch, warmup_length
from lightning_peft.training.teacher import check_teacher, load_teacher, teacher_report

__all__ = [
    "PACINGS", "TRUNCATED_KEYS", "CurriculumSampler", "LengthScorer", "LossScorer", "check_ordered", "check_pacing",
    "check_teacher", "classification_loss", "compute_scores", "dataset_fingerprint", "dotted_name", "load_teacher",
    "pacing_fraction", "resolve_scorer", "scorer_fingerprint", "teacher_report", "truncate_batch", "warm_up_batch",
    "warmup_length",
]
