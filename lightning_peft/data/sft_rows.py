"""Instruction rows to token ids and labels for supervised fine-tuning (SFT): the half of
[`SFTDataModule`][lightning_peft.data.SFTDataModule] that reads and tokenises, without Lightning.

A file is a JSON array of objects or JSON lines (one object a line); each row is one of:

| row | prompt | response (the tokens that train) |
| --- | --- | --- |
| ``{"prompt": p, "response": r}`` | ``p`` as written | ``r`` + the end token |
| ``{"instruction": i, "input": x, "output": o}`` (Alpaca; ``input`` optional) | Alpaca's template around ``i`` (and ``x``) | ``o`` + the end token |
| ``{"messages": [{"role": ..., "content": ...}, ...]}`` | every token outside an assistant turn | each assistant turn as the tokenizer's chat template renders it (its end-of-turn tokens included) |

Prompt and response are tokenised apart (``tokenizer(prompt)`` with the tokenizer's special tokens, then
``tokenizer(response, add_special_tokens=False)`` and the end token: eos, else ``[SEP]``), so the prompt's tokens are
the ones generation will see after training. ``messages`` are rendered with ``tokenizer.apply_chat_template`` and
tokenised as it tokenises (no special tokens added: the template writes them); an assistant turn's span is found by
rendering the conversation up to it with ``add_generation_prompt=True`` and up to its end, which must be prefixes of
the whole conversation's tokens (a template that rewrites earlier turns once later ones follow is refused).

``labels`` are the ids with every prompt token set to -100, and the first token of every row too: it has no token
before it to be predicted from, so a row's loss never reaches into the row before it when rows are packed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ALPACA_PROMPT", "ALPACA_PROMPT_WITH_INPUT", "IGNORE_INDEX", "Example", "read_rows", "tokenize_row"]

IGNORE_INDEX = -100  # the label cross-entropy skips (torch's default ignore_index)
ALPACA_PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                 "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n"
    "### Response:\n")
_SHAPES = "'prompt' and 'response', Alpaca's 'instruction' and 'output' (and an optional 'input'), or 'messages'"


@dataclass(frozen=True)
class Example:
    """One tokenised row: ``input_ids`` and ``labels`` of equal length, and the row's routing value (None without
    a routing field)."""

    input_ids: list[int]
    labels: list[int]
    route: str | int | None = None

    def trains(self) -> bool:
        """Whether any token has a label."""
        return any(label != IGNORE_INDEX for label in self.labels)

    def truncated(self, max_length: int) -> Example:
        return Example(self.input_ids[:max_length], self.labels[:max_length], self.route)


def read_rows(path: Path, who: str) -> list[dict[str, Any]]:
    """The rows of ``path``: a JSON array of objects, or JSON lines (blank lines skipped).

    Raises:
        ValueError: If the file is missing, does not parse, holds no row, or a row is not an object.
    """
    if not path.is_file():
        raise ValueError(f"{who}(data_path={str(path)!r}): no such file. Give a JSON or JSON-lines file of rows.")
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise ValueError(f"{who}: {path} is neither a JSON array nor JSON lines ({err}).") from None
    if not rows:
        raise ValueError(f"{who}: {path} holds no row.")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise ValueError(  # noqa: TRY004  (bad data in a file, not a bad argument)
                f"{who}: {path} row {number} is a JSON {type(row).__name__}, not an object with {_SHAPES}.")
    return rows


def tokenize_row(row: dict[str, Any], tokenizer: Any, end_id: int | None, where: str,
                 routing_field: str | None = None) -> Example:
    """``row`` (one of the shapes of the module docstring) as token ids and labels; ``where`` names it in errors.

    Raises:
        ValueError: If the row has none of the shapes, a field is not a string, the response (or every assistant
            turn) is empty, a ``messages`` row meets a tokenizer without a chat template, or the routing field is
            missing.
    """
    route = _route(row, routing_field, where)
    if "messages" in row:
        ids, labels = _conversation(row["messages"], tokenizer, where)
    elif "prompt" in row and "response" in row:
        ids, labels = _pair(_text(row, "prompt", where), _text(row, "response", where), tokenizer, end_id, where)
    elif "instruction" in row and "output" in row:
        given = _text(row, "input", where) if row.get("input") is not None else ""
        template = ALPACA_PROMPT_WITH_INPUT if given.strip() else ALPACA_PROMPT
        prompt = template.format(instruction=_text(row, "instruction", where), input=given)
        ids, labels = _pair(prompt, _text(row, "output", where), tokenizer, end_id, where)
    else:
        raise ValueError(f"{where}: a row needs {_SHAPES}; this one has {sorted(row)}.")
    return Example(ids, [IGNORE_INDEX, *labels[1:]], route)


def _route(row: dict[str, Any], field: str | None, where: str) -> str | int | None:
    if field is None:
        return None
    if field not in row:
        raise ValueError(f"{where}: the row has no {field!r} (routing_field) naming its adapter; give one in every row "
                         "(null for the base model).")
    value = row[field]
    if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
        raise ValueError(f"{where}: {field}={value!r} must be an adapter name, an integer id, or null.")
    return value


def _text(row: dict[str, Any], key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} is a {type(value).__name__}, not a string.")  # noqa: TRY004  (data)
    return value


def _pair(prompt: str, response: str, tokenizer: Any, end_id: int | None, where: str) -> tuple[list[int], list[int]]:
    """Prompt tokens (with the tokenizer's special tokens, as generation gets them) masked, then the response's."""
    if not response.strip():
        raise ValueError(f"{where}: the response is empty; a row needs something to learn.")
    if end_id is None:
        raise ValueError(f"{where}: the tokenizer has neither an eos nor a [SEP] token to end the response with; set "
                         "one (tokenizer.eos_token = ...; tokenizer.save_pretrained(...)).")
    prompt_ids = list(tokenizer(prompt)["input_ids"])
    response_ids = [*tokenizer(response, add_special_tokens=False)["input_ids"], end_id]
    return prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids


def _conversation(messages: object, tokenizer: Any, where: str) -> tuple[list[int], list[int]]:
    """The chat template's tokens of ``messages``, labels on the assistant turns only."""
    _check_messages(messages, where)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{where}: 'messages' rows are rendered with the tokenizer's chat template, and tokenizer "
            f"{getattr(tokenizer, 'name_or_path', '')!r} has none. Use a tokenizer with a chat_template (an instruct "
            "model's), set one (tokenizer.chat_template = ...; tokenizer.save_pretrained(...)), or write the rows "
            "as prompt/response.")
    ids = _render(tokenizer, messages, False)
    labels = [IGNORE_INDEX] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # (transformers renders no empty conversation: a first assistant turn starts at 0)
        start = len(_render(tokenizer, messages[:turn], True, ids, where)) if turn else 0
        end = len(_render(tokenizer, messages[:turn + 1], False, ids, where))
        labels[start:end] = ids[start:end]
    return ids, labels


def _check_messages(messages: object, where: str) -> None:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}.")
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    if not answers or not all(answer.strip() for answer in answers):
        raise ValueError(f"{where}: the conversation has {'an empty' if answers else 'no'} assistant message; a row "
                         "needs something to learn.")


def _render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool, whole: list[int] | None = None,
            where: str = "") -> list[int]:
    """Token ids of ``messages`` as ``apply_chat_template`` gives them; with ``whole``, checked to be its prefix."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if whole is not None and whole[:len(ids)] != ids:
        raise ValueError(f"{where}: the tokenizer's chat template renders the turns before message {len(messages)} "
                         "differently once later turns follow, so the assistant's tokens cannot be located; use a "
                         "template that renders a conversation's beginning alike, or rows of prompt/response.")
    return ids
