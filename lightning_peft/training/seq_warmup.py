"""Sequence-length warm-up: train on shorter sequences first.

Paper: Li et al., "The Stability-Efficiency Dilemma: Investigating Sequence Length Warmup for Training GPT Models",
arXiv:2108.06084, as MosaicML Composer's ``SeqLengthWarmup``. At step ``t`` the batch's ``(B, T)`` tensors are cut to
``L(t)`` positions ([`warmup_length`][lightning_peft.training.warmup_length],
[`truncate_batch`][lightning_peft.training.truncate_batch]), ``L`` rising from ``min_length`` to ``max_length`` over
``duration`` steps in multiples of 8.

Shapes: batches are dicts of ``(B, T)`` tensors (``input_ids``, ``attention_mask``, ...) plus per-sample ones such as
``labels`` ``(B,)``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch  # noqa: F401 (the examples below use it)
from torch import Tensor

from lightning_peft._checks import integer

__all__ = ["TRUNCATED_KEYS", "truncate_batch", "warm_up_batch", "warmup_length"]

TRUNCATED_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels")


def warmup_length(
    step: int, min_length: int, max_length: int, duration: int, multiple: int = 8, who: str = "warmup_length"
) -> int:
    """The sequence length at step ``step``: ``min_length`` rising by ``multiple`` to ``max_length``.

    ``L(t) = min(max_length, min_length + multiple * floor((max_length - min_length) * t / (multiple * T)))``
    for ``t < T = duration``, and ``max_length`` from ``T`` on.

    Raises:
        TypeError: If an argument is not an integer.
        ValueError: If an argument is out of range, or ``min_length > max_length``.

    Examples:
        >>> [warmup_length(t, 8, 32, 4) for t in range(5)]
        [8, 8, 16, 24, 32]
    """
    integer(who, "step", step, minimum=0)
    integer(who, "min_length", min_length, minimum=1)
    integer(who, "max_length", max_length, minimum=1)
    integer(who, "duration", duration, minimum=1)
    integer(who, "multiple", multiple, minimum=1)
    if min_length > max_length:
        raise ValueError(
            f"{who}(min_length={min_length}, max_length={max_length}): min_length must be <= max_length."
        )
    if step >= duration:
        return max_length
    rises = ((max_length - min_length) * step) // (multiple * duration)
    return min(max_length, min_length + multiple * rises)


def truncate_batch(
    batch: Mapping[str, Any], length: int, keys: Sequence[str] = TRUNCATED_KEYS
) -> dict[str, Any]:
    """A copy of ``batch`` whose ``(B, T)`` tensors keep their first ``length`` positions.

    The tensors cut are those named in ``keys`` with at least 2 dimensions and ``T`` (the length of
    ``input_ids``) positions on dimension 1: ``labels`` of shape ``(B,)`` stays whole, token labels ``(B, T)``
    are cut. Plain truncation, as Composer's ``SeqLengthWarmup`` does by default: the end of a longer sequence
    (its ``[SEP]`` or end-of-sequence token) is dropped. Assumes right padding: with left padding the first
    positions are padding. The tensors are views of the originals; ``batch`` itself is not changed.

    Raises:
        TypeError: If ``batch`` is not a mapping.
        ValueError: If it has no ``input_ids`` tensor of shape ``(B, T)``, or ``length`` is not positive.

    Examples:
        >>> batch = {"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.tensor([0, 1])}
        >>> {k: tuple(v.shape) for k, v in truncate_batch(batch, 3).items()}
        {'input_ids': (2, 3), 'labels': (2,)}
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"truncate_batch: the batch is a {type(batch).__name__}; it must be a dict of (B, T) tensors "
            "such as input_ids and attention_mask (what a Hugging Face tokenizer and collator give)."
        )
    integer("truncate_batch", "length", length, minimum=1)
    ids = batch.get("input_ids")
    if not isinstance(ids, Tensor) or ids.ndim < 2:
        raise ValueError(
            "truncate_batch: the batch needs an input_ids tensor of shape (B, T); its keys are "
            f"{sorted(batch)}."
        )
    full = ids.shape[1]
    return {
        key: value[:, :length]
        if key in keys and isinstance(value, Tensor) and value.ndim >= 2 and value.shape[1] == full
        else value
        for key, value in batch.items()
    }


def warm_up_batch(batch: Any, step: int, min_length: int, max_length: int, duration: int,
                  who: str = "warm_up_batch") -> int:
    """Cut ``batch`` in place to the warm-up length of step ``step``
    ([`warmup_length`][lightning_peft.training.warmup_length],
    [`truncate_batch`][lightning_peft.training.truncate_batch]) and return its sequence length now: a training step that
    gets this same dict trains on the cut tensors.

    Raises:
        TypeError: If ``batch`` is not a mutable mapping of ``(B, T)`` tensors.
    """
    if not isinstance(batch, MutableMapping):
        raise TypeError(
            f"{who}(length_warmup_steps={duration}): the batch is a {type(batch).__name__}; the sequence-length "
            "warm-up needs dict batches of (B, T) tensors (input_ids, attention_mask, ...)."
        )
    batch.update(truncate_batch(batch, warmup_length(step, min_length, max_length, duration)))
    return int(batch["input_ids"].shape[1])
