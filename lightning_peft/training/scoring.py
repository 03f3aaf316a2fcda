"""Curriculum scoring: map each sample to a number, low = easy, and score a data set once.

Paper: Hacohen & Weinshall, "On The Power of Curriculum Learning in Training Deep Networks", arXiv:1904.03626 (a
*scoring function* orders the data: a sample's loss under a teacher, "transfer scoring", or under the model itself,
"self-paced"). Built in: [`LengthScorer`][lightning_peft.training.LengthScorer] (the number of real tokens) and
[`LossScorer`][lightning_peft.training.LossScorer] (the per-sample loss under a reference model: a teacher, or the model
itself before training). [`compute_scores`][lightning_peft.training.compute_scores] scores a dataset once and can cache
the scores on disk (`lightning_peft.training.score_cache`), so a second run reads them back.

Shapes: scores ``(N,)`` float64; a [`LossScorer`][lightning_peft.training.LossScorer] batch is what ``collate_fn``
makes of a list of samples, its losses ``(B,)``.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import default_collate

from lightning_peft._checks import integer
from lightning_peft.training.score_cache import (
    cache_key,
    cache_path,
    module_digest,
    read_scores,
    scorer_fingerprint,
    write_scores,
)

__all__ = [
    "LengthScorer", "LossScorer", "check_ordered", "classification_loss", "compute_scores", "dotted_name",
    "resolve_scorer",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LengthScorer:
    """Scores a sample by its number of real tokens: short is easy.

    The length is ``sum(sample["attention_mask"])`` when the sample is a mapping with an attention mask, else
    the number of entries of ``sample[key]`` that are not ``pad_token_id`` (all of them when it is None).

    Args:
        key: Where the token ids are in a sample: a mapping key, or an index for tuple samples.
        pad_token_id: The padding id not to count; None counts every entry.

    Examples:
        >>> LengthScorer()({"input_ids": [101, 7, 8, 102], "labels": 1})
        4.0
        >>> LengthScorer(key=0, pad_token_id=0)((torch.tensor([5, 6, 0, 0]), 1))
        2.0
    """

    key: str | int = "input_ids"
    pad_token_id: int | None = None

    def __call__(self, sample: Any) -> float:
        if isinstance(sample, Mapping) and "attention_mask" in sample and self.pad_token_id is None:
            return float(torch.as_tensor(sample["attention_mask"]).sum())
        try:
            ids = sample[self.key]
        except (KeyError, IndexError, TypeError):
            raise TypeError(
                f"LengthScorer(key={self.key!r}): a sample of type {type(sample).__name__} has no entry "
                f"{self.key!r}; set key to where the token ids are (a dict key, or 0 for (ids, label) "
                "tuples)."
            ) from None
        ids = torch.as_tensor(ids)
        return float(ids.numel() if self.pad_token_id is None else (ids != self.pad_token_id).sum())

    def fingerprint(self) -> str:
        """What the score cache keys this scorer by: its class and settings."""
        return f"{type(self).__module__}.{self!r}"


def classification_loss(model: nn.Module, batch: Any) -> Tensor:
    """Per-sample cross-entropy of a classifier, shape ``(B,)``: the default loss of
    [`LossScorer`][lightning_peft.training.LossScorer].

    Args:
        model: Returns logits ``(B, C)``, or an object with ``.logits`` (a Hugging Face model).
        batch: A dict with ``labels`` ``(B,)`` whose other entries are the model's keyword arguments, or an
            ``(inputs, labels, ...)`` sequence.

    Raises:
        ValueError: If the logits are not ``(B, C)`` or the labels not ``(B,)``.
    """
    if isinstance(batch, Mapping):
        labels = batch["labels"]
        output = model(**{key: value for key, value in batch.items() if key != "labels"})
    else:
        output, labels = model(batch[0]), batch[1]
    logits = getattr(output, "logits", output)  # (B, C)
    if logits.ndim != 2 or labels.ndim != 1:
        raise ValueError(
            "LossScorer: the default loss takes logits (B, C) and labels (B,), got logits "
            f"{tuple(logits.shape)} and labels {tuple(labels.shape)}; pass loss_fn=f(model, batch) -> (B,) "
            "losses for other tasks (a language model's mean token loss per sample, for instance)."
        )
    return F.cross_entropy(logits.float(), labels, reduction="none")


class LossScorer:
    """Scores samples by their loss under a reference model: a teacher, or the untrained model (self-paced).

    The model runs in eval mode (every module's mode is put back afterwards) without gradients, on batches of
    ``batch_size`` samples collated by ``collate_fn`` and moved to the model's device.

    Args:
        model: The reference model.
        collate_fn: Makes a batch of a list of samples; None uses ``torch``'s ``default_collate``.
        batch_size: Samples per forward pass.
        loss_fn: ``loss_fn(model, batch) -> (B,)`` per-sample losses; None uses `classification_loss`.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``batch_size`` is not positive.
    """

    def __init__(
        self,
        model: nn.Module,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        batch_size: int = 32,
        loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"LossScorer(model={type(model).__name__}): model must be a torch.nn.Module.")
        integer("LossScorer", "batch_size", batch_size, minimum=1)
        for name, value in (("collate_fn", collate_fn), ("loss_fn", loss_fn)):
            if value is not None and not callable(value):
                raise TypeError(f"LossScorer({name}={value!r}): {name} must be callable or None.")
        self.model = model
        self.collate_fn = collate_fn or default_collate
        self.batch_size = batch_size
        self.loss_fn = loss_fn or classification_loss

    @torch.no_grad()
    def score_batch(self, samples: list[Any]) -> Tensor:
        """The losses of ``samples``, shape ``(len(samples),)``."""
        device = next(self.model.parameters(), torch.empty(0)).device
        batch = _to_device(self.collate_fn(samples), device)
        modes = {module: module.training for module in self.model.modules()}
        self.model.eval()
        try:
            return self.loss_fn(self.model, batch).detach().float().cpu()
        finally:
            for module, training in modes.items():
                module.training = training

    def __call__(self, sample: Any) -> float:
        return float(self.score_batch([sample])[0])

    def fingerprint(self) -> str:
        """What the score cache keys this scorer by: the model's class and weights, and the loss function."""
        return (f"LossScorer(model={type(self.model).__qualname__}:{module_digest(self.model)}, "
                f"loss_fn={scorer_fingerprint(self.loss_fn)}, collate_fn={scorer_fingerprint(self.collate_fn)}, "
                f"batch_size={self.batch_size})")


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(value, device) for value in batch)
    return batch


def compute_scores(
    dataset: Sequence[Any],
    scorer: Callable[[Any], float],
    cache_dir: str | Path | None = None,
    data_fingerprint: str | None = None,
) -> Tensor:
    """Scores every sample of ``dataset`` (low = easy), reading and writing an on-disk cache if asked to.

    A scorer is a callable ``sample -> number``. One with a ``score_batch(samples) -> (B,)`` method and a ``batch_size``
    (as [`LossScorer`][lightning_peft.training.LossScorer]) is called on batches instead. The cache file,
    ``cache_dir/scores-<key>.pt``, is keyed by a hash of the data (every sample's content; or ``data_fingerprint``) and
    one of the scorer: its ``fingerprint()`` method (or string attribute) if it has one, else, for a plain function or a
    ``functools.partial`` of one, its qualified name, bytecode and bound arguments. It is written under a temporary name
    and renamed into place, so a crash leaves no half-written file.

    Args:
        dataset: A map-style dataset (``len`` and ``[i]``).
        scorer: The scoring function.
        cache_dir: Folder of the score cache; None scores without caching.
        data_fingerprint: Stands for the data in the cache key instead of hashing every sample (for large data
            sets: a version string, for instance).

    Returns:
        The scores, shape ``(N,)`` float64.

    Raises:
        ValueError: If the dataset is empty, a score is not finite, or ``score_batch`` miscounts.
        TypeError: If a score is not a number, or a scorer cannot be fingerprinted for the cache.
    """
    count = len(dataset)
    name = _name(scorer)
    if count == 0:
        raise ValueError(f"compute_scores: the dataset is empty, so there is nothing for {name} to score.")
    path = key = None
    if cache_dir is not None:
        key = cache_key(dataset, scorer, data_fingerprint)
        path = cache_path(cache_dir, key)
        cached = read_scores(path, key, count)
        if cached is not None:
            log.info("compute_scores: read the %d scores of %s from %s.", count, name, path)
            return cached
    scores = _score_all(dataset, scorer, name)
    if path is not None:
        write_scores(path, key, scores)
        log.info("compute_scores: scored %d samples with %s; cached in %s.", count, name, path)
    return scores


def _score_all(dataset: Sequence[Any], scorer: Callable[[Any], float], name: str) -> Tensor:
    count = len(dataset)
    score_batch = getattr(scorer, "score_batch", None)
    values: list[Any] = []
    if callable(score_batch):
        size = getattr(scorer, "batch_size", 32)
        for start in range(0, count, size):
            samples = [dataset[i] for i in range(start, min(start + size, count))]
            got = score_batch(samples)
            if len(got) != len(samples):
                raise ValueError(
                    f"compute_scores: {name}.score_batch returned {len(got)} scores for {len(samples)} "
                    "samples; it must return one score per sample."
                )
            values.extend(got)
    else:
        values = [scorer(dataset[i]) for i in range(count)]
    scores = torch.empty(count, dtype=torch.float64)
    for index, value in enumerate(values):
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"compute_scores: {name} returned a {type(value).__name__} for sample {index}; a scorer must "
                "return a number (an int, a float or a one-element tensor)."
            )
        if not math.isfinite(value):
            raise ValueError(
                f"compute_scores: {name} gave {value} for sample {index}; scores must be finite. Fix the "
                "scorer or the sample (an empty sample, or a loss that overflowed, gives nan or inf)."
            )
        scores[index] = float(value)
    return scores


def check_ordered(scores: Tensor, scorer: str, who: str = "CurriculumSampler") -> None:
    """Raises if two or more samples all have the same score: they have no easy-to-hard order, so a curriculum over
    them would admit a random share of the data as if it were the easiest.

    Args:
        scores: The scores, shape ``(N,)``.
        scorer: What scored them (``"length"``, ``"loss"``, a function's dotted path), named in the message; for
            ``"length"`` the message says that padding counts as tokens without an attention mask.
        who: Who complains, in the message.

    Raises:
        ValueError: If ``N >= 2`` and every score is the same.

    Examples:
        >>> check_ordered(torch.tensor([3.0, 1.0]), "length")
        >>> check_ordered(torch.tensor([4.0, 4.0]), "length")
        Traceback (most recent call last):
        ...
        ValueError: CurriculumSampler(scorer='length'): all 2 samples have the same score (4.0), ...
    """
    scores = torch.as_tensor(scores)
    if scores.numel() < 2 or not bool((scores == scores.flatten()[0]).all()):
        return
    fix = ("give the samples an attention_mask (without one, LengthScorer counts padding as tokens, so padded samples "
           "all have the padded length), or score with LengthScorer(pad_token_id=<the pad id>) as the scorer"
           if scorer == "length" else "check the scorer: it gave every sample the same value")
    raise ValueError(
        f"{who}(scorer={scorer!r}): all {scores.numel()} samples have the same score ({scores.flatten()[0].item()}), "
        f"so there is no easy-to-hard order and the curriculum would admit a random share of the data; {fix}."
    )


def _name(scorer: Any) -> str:
    if isinstance(scorer, LengthScorer):
        return repr(scorer)
    return getattr(scorer, "__qualname__", None) or type(scorer).__qualname__


def resolve_scorer(scorer: object, who: str = "Curriculum") -> Callable[[Any], float] | None:
    """None for the built-in names ``"length"`` and ``"loss"``; the callable for a callable or a dotted import path
    to one (``"my_package.scores.rarity"``).

    Raises:
        TypeError: If ``scorer`` is neither a string nor a callable.
        ValueError: If a dotted path cannot be imported or names no function.
    """
    if callable(scorer):
        return scorer
    if not isinstance(scorer, str):
        raise TypeError(
            f"{who}(scorer={scorer!r}): scorer must be 'length', 'loss', a function sample -> float, or "
            "its dotted import path."
        )
    if scorer in ("length", "loss"):
        return None
    module_name, _, attribute = scorer.rpartition(".")
    try:
        function = getattr(importlib.import_module(module_name), attribute) if module_name else None
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"{who}(scorer={scorer!r}): cannot import it ({type(error).__name__}: {error}); use "
            "'length', 'loss', or the dotted path of a function sample -> float."
        ) from None
    if not callable(function):
        raise ValueError(
            f"{who}(scorer={scorer!r}): not 'length' or 'loss', nor the dotted path of a function; use "
            "one of those."
        )
    return function


def dotted_name(function: Callable[..., Any]) -> str:
    """``module.qualname`` of ``function``: what `resolve_scorer` imports back.

    Examples:
        >>> dotted_name(classification_loss)
        'lightning_peft.training.scoring.classification_loss'
    """
    module = getattr(function, "__module__", None) or type(function).__module__
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}"
