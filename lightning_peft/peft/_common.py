"""Scaffolding every PEFT technique shares: name matching for ``target_modules`` and the task heads of Hugging Face
task models.

Name matching follows Hugging Face PEFT, so a config means the same thing in both: a list entry matches a module
whose full name equals it or ends with ``"." + entry``; a string is a regular expression matched against the whole
name (``re.fullmatch``).

>>> name_matches("encoder.layer.0.attention.self.query", ["query"])
True
>>> name_matches("encoder.layer.0.attention.self.query", r".*\.0\..*query")
True
>>> unmatched(["query", "qeury"], ["layer.0.query"])
['qeury']
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

Targets = list[str] | str

# Hugging Face task models and the heads from_pretrained creates for them (PEFT's task types save the same).
_TASK_HEADS = {
    "ForSequenceClassification": ("classifier", "score"),
    "ForTokenClassification": ("classifier", "score"),
    "ForQuestionAnswering": ("qa_outputs",),
    "ForMultipleChoice": ("classifier",),
}


def pattern_matches(key: str, name: str) -> bool:
    return re.match(rf"(.*\.)?({key})$", name) is not None


def name_matches(name: str, targets: Targets) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in targets)


def unmatched(targets: Targets, names: Iterable[str]) -> list[str]:
    """The entries of a ``target_modules`` list that match none of ``names`` (a regex string: none)."""
    if isinstance(targets, str):
        return []
    names = list(names)
    return [t for t in targets if not any(name_matches(n, [t]) for n in names)]


def refuse_unmatched(who: str, targets: Targets, names: Iterable[str], model: nn.Module, describe) -> None:
    """Raise if an entry of a ``target_modules`` list matches no module: a typo would silently adapt fewer modules.

    ``describe(model)`` lists the modules the technique can adapt, for the message.
    """
    missing = unmatched(targets, names)
    if missing:
        raise ValueError(
            f"{who}(target_modules={targets!r}): {', '.join(repr(m) for m in missing)} matched no module of "
            f"{type(model).__name__} (an entry matches a module whose name equals it or ends with '.' + it). "
            f"Fix or remove {'it' if len(missing) == 1 else 'them'}; modules it can adapt: {describe(model)}."
        )


def task_heads(model: nn.Module) -> list[str]:
    """Names of the task head a Hugging Face task model creates at random (empty for other models)."""
    kind = next((suffix for suffix in _TASK_HEADS if type(model).__name__.endswith(suffix)), None)
    if kind is None:
        return []
    heads = _TASK_HEADS[kind]
    return [n for n, _ in model.named_children() if n in heads]
