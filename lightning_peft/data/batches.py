"""From tokenised examples to batches: a shuffle that a resumed run replays exactly, an evaluation split dealt to
data-parallel ranks without repeats, and dynamic padding.

`EpochShuffleSampler`: the order of epoch ``e`` is ``torch.randperm(n)`` from a generator seeded with
``blake2b(f"{seed},{e}")``, so it depends on ``(seed, e)`` only. `EvaluationShardSampler`: rank ``r`` of ``w`` reads
items ``r, r + w, ...`` and, where it is one short, a filler item, so every rank reads as many. `PaddingCollator`:
pads each batch to its longest item; batches are dicts of ``(B, T)`` int64 tensors (``input_ids``,
``attention_mask``, ...) and ``labels`` ``(B,)``. Pure PyTorch: nothing here imports Lightning.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DistributedSampler, Sampler

from lightning_peft._checks import choice, integer

__all__ = ["EpochShuffleSampler", "EvaluationShardSampler", "PaddingCollator"]


class EpochShuffleSampler(Sampler[int]):
    """A shuffle whose order in epoch ``e`` depends only on ``(seed, e)``, so resuming does not change it.

    A ``DataLoader(shuffle=True, generator=...)`` draws each epoch's order from where the generator stopped in
    this process; a run resumed from a checkpoint therefore replays epoch 0's order. Here the order of epoch
    ``e`` is ``torch.randperm(num_samples)`` drawn from a fresh ``torch.Generator`` seeded with the first 8
    bytes of BLAKE2b of ``f"{seed},{e}"``: distinct ``(seed, epoch)`` pairs get unrelated seeds, whereas
    ``seed + e`` would give run ``seed=1`` at epoch 0 the order of run ``seed=0`` at epoch 1.

    Lightning calls ``set_epoch`` on a training DataLoader's sampler at the start of every epoch, resumed runs
    included (``_set_sampler_epoch`` in its fit loop, for any sampler with a ``set_epoch`` method; under DDP
    its ``DistributedSamplerWrapper`` forwards the call). In a plain loop call ``set_epoch`` yourself, as for
    ``DistributedSampler``; without it every pass has epoch 0's order.

    ``permutes_dataset`` tells a callback that owns the order (``Curriculum``) that every epoch is a permutation of
    ``range(num_samples)``: replacing this sampler loses nothing, unlike a subset's or weights'.

    Args:
        num_samples: Size of the dataset; indices run over ``range(num_samples)``.
        seed: Seed of the shuffle.

    Raises:
        TypeError: If ``num_samples`` or ``seed`` is not an integer.
        ValueError: If ``num_samples`` is negative.

    Examples:
        >>> sampler = EpochShuffleSampler(6, seed=0)
        >>> first = list(sampler); sorted(first)
        [0, 1, 2, 3, 4, 5]
        >>> sampler.set_epoch(1); list(sampler) == first
        False
        >>> sampler.set_epoch(0); list(sampler) == first
        True
    """

    permutes_dataset = True

    def __init__(self, num_samples: int, seed: int) -> None:
        integer("EpochShuffleSampler", "num_samples", num_samples, minimum=0)
        integer("EpochShuffleSampler", "seed", seed)
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Selects the order of epoch ``epoch`` for the next iterations.

        Raises:
            TypeError: If ``epoch`` is not an integer.
            ValueError: If ``epoch`` is negative.
        """
        integer("EpochShuffleSampler.set_epoch", "epoch", epoch, minimum=0)
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        # A generator: the order is drawn at the first index, not when the iterator is made. Lightning makes the
        # first epoch's iterator of a run before it calls set_epoch, so a run resumed at epoch e would otherwise
        # replay epoch 0's order wherever the loader hands this sampler over directly (DataLoader(batch_size=None),
        # SFTDataModule's packed batches), instead of through a lazy BatchSampler.
        digest = hashlib.blake2b(f"{self.seed},{self.epoch}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        yield from torch.randperm(self.num_samples, generator=generator).tolist()


class EvaluationShardSampler(DistributedSampler):
    """Deals ``num_items`` evaluation items (whole batches) to ``num_replicas`` data-parallel ranks, none twice.

    ``DistributedSampler`` (which Lightning puts under every evaluation loader under DDP) repeats items until the
    count divides by the number of ranks, so a token-weighted loss over the split counts them twice. Here rank ``r``
    reads items ``r, r + w, ...`` in order, and a rank left one short reads the index ``num_items``, one past the
    items: a filler the dataset answers with a batch that has no target (labels all -100), which a token-weighted
    metric does not count. Every rank still runs the same number of forwards, as strategies that gather sharded
    weights in each forward (ZeRO-3, FSDP) and per-step ``sync_dist`` logging need.

    It is a ``DistributedSampler`` so that Lightning keeps it instead of wrapping the loader in its own.

    Args:
        num_items: How many items the split has (the filler not counted).
        num_replicas: Data-parallel size.
        rank: This process's data-parallel rank.

    Raises:
        ValueError: If ``rank`` is not in ``[0, num_replicas)``.

    Examples:
        >>> [list(EvaluationShardSampler(5, num_replicas=2, rank=r)) for r in (0, 1)]
        [[0, 2, 4], [1, 3, 5]]
    """

    def __init__(self, num_items: int, num_replicas: int, rank: int) -> None:
        integer("EvaluationShardSampler", "num_items", num_items, minimum=0)
        super().__init__(range(num_items), num_replicas=num_replicas, rank=rank, shuffle=False)
        self.num_items = num_items
        self.num_samples = -(-num_items // num_replicas)  # ceil: what every rank reads

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        own = list(range(self.rank, self.num_items, self.num_replicas))
        return iter(own + [self.num_items] * (self.num_samples - len(own)))


@dataclass(frozen=True)
class PaddingCollator:
    """Pads a list of tokenised items to the longest one in the batch (dynamic padding).

    Args:
        pad_token_id: Value padding ``input_ids``; ``attention_mask`` and ``token_type_ids`` are padded
            with 0. A tokenizer without a pad token (GPT-2's) has ``pad_token_id=None``: pass its
            ``eos_token_id`` instead; the attention mask hides the padding either way.
        padding_side: ``"right"`` or ``"left"``, as the tokenizer wants.

    Raises:
        TypeError: If ``pad_token_id`` is not an int.
        ValueError: If ``padding_side`` is neither ``"right"`` nor ``"left"``.

    Examples:
        >>> batch = PaddingCollator(pad_token_id=0)([
        ...     {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": 1},
        ...     {"input_ids": [5], "attention_mask": [1], "labels": 0}])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
        ([[5, 6, 7], [5, 0, 0]], [[1, 1, 1], [1, 0, 0]], [1, 0])
    """

    pad_token_id: int
    padding_side: str = "right"

    def __post_init__(self) -> None:
        integer("PaddingCollator", "pad_token_id", self.pad_token_id, example="tokenizer.pad_token_id",
                meaning="a tokenizer without a pad token, like GPT-2's, passes its eos_token_id")
        choice("PaddingCollator", "padding_side", self.padding_side, ("right", "left"))

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Tensor]:
        longest = max(len(item["input_ids"]) for item in items)
        batch: dict[str, Tensor] = {}
        for key in (key for key in items[0] if key != "labels"):
            if not isinstance(items[0][key], list):  # per-sample values such as a MultiLoRA adapter name
                batch[key] = [item[key] for item in items]
                continue
            value = self.pad_token_id if key == "input_ids" else 0
            batch[key] = torch.tensor([self._pad(item[key], longest, value) for item in items])  # (B, T)
        batch["labels"] = torch.tensor([item["labels"] for item in items])  # (B,)
        return batch

    def _pad(self, ids: list[int], length: int, value: int) -> list[int]:
        padding = [value] * (length - len(ids))
        return padding + list(ids) if self.padding_side == "left" else list(ids) + padding

