"""Trainable tokens' setting, ``trainable_token_indices``: which rows to train (`check_indices`).

>>> check_indices([32001, 32000])
[32001, 32000]
>>> check_indices({"embed_tokens": [5, 5]})
Traceback (most recent call last):
ValueError: LoRA(trainable_token_indices['embed_tokens']=[5, 5]): token id 5 is listed twice; list each id once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from ..._checks import integer

Indices = list[int] | dict[str, list[int]]
FIELD = "trainable_token_indices"


def check_indices(value: object, who: str = "LoRA") -> Indices:
    """``trainable_token_indices`` normalised: a list of distinct token ids ``>= 0``, or ``{module name: ids}``."""
    if isinstance(value, Mapping):
        if not value or not all(isinstance(k, str) and k for k in value):
            raise TypeError(f"{who}({FIELD}={value!r}): give {{embedding module name: token ids}}, e.g. "
                            "{'embed_tokens': [32000, 32001]}, with non-empty names.")
        return {key: _ids(ids, who, f"{FIELD}[{key!r}]") for key, ids in value.items()}
    return _ids(value, who, FIELD)


def _ids(value: object, who: str, what: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise TypeError(f"{who}({what}={value!r}): give a non-empty list of token ids, e.g. [32000, 32001] (the "
                        "input embedding), or a dict {embedding module name: ids}, e.g. {'embed_tokens': [32000]}.")
    ids = [integer(who, what, v, minimum=0, example="32000") for v in value]
    twice = sorted(i for i, n in Counter(ids).items() if n > 1)
    if twice:
        raise ValueError(f"{who}({what}={list(value)!r}): token id {twice[0]} is listed twice; list each id once.")
    return ids
