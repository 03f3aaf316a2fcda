"""Hugging Face PEFT's config side: reading one (`peft_dict`), the fields every written one has
(`peft_common`), and injecting from one (`inject_from_peft`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from .._base_identity import adapter_task_type, base_model_name
from .._common import exact_choice
from ..adapter import clean_key, unwrap
from ..modules_to_save import present_modules


def peft_dict(config: Any, peft_type: str, source: str) -> dict[str, Any]:
    """A Hugging Face PEFT config (object or dict) as a dict, refused if it is another method's or names no
    ``target_modules`` (PEFT's per-architecture defaults are not guessed)."""
    if not isinstance(config, dict):
        config = config.to_dict()
    given = getattr(config.get("peft_type"), "value", config.get("peft_type"))  # PEFT's enum, or its string
    if given not in (peft_type, None):
        raise ValueError(f"load_adapter: {source} has peft_type={given!r}, not {peft_type!r}.")
    if config.get("target_modules") is None:
        raise ValueError(f"load_adapter: {source} has target_modules=None; lightning-peft does not guess PEFT's "
                         "per-architecture defaults. Name them in the config.")
    return config


def listed(value: object) -> object:
    """A PEFT config's set (its in-memory form) as a sorted list; anything else as it is."""
    return sorted(value) if isinstance(value, (set, frozenset)) else value


def peft_common(model: nn.Module, peft_type: str, targets: Iterable[str],
                modules_to_save: Iterable[str]) -> dict[str, Any]:
    """The fields every written ``adapter_config.json`` has, the targets written out as exactly the adapted modules
    (so PEFT adapts the same ones whatever the rules that chose them said)."""
    names = [clean_key(n) for n, _ in unwrap(model).named_modules() if n]
    return {
        "peft_type": peft_type,
        "task_type": adapter_task_type(model, targets, modules_to_save),
        "base_model_name_or_path": base_model_name(model),
        "inference_mode": True,
        "target_modules": exact_choice([clean_key(n) for n in targets], names),
        "modules_to_save": [clean_key(n) for n in modules_to_save] or None,
    }


def inject_from_peft(model: nn.Module, config: Any, source: str, inject: Callable[[Any], object]) -> None:
    """``inject(config)``, ``config`` read from PEFT's ``source``: the ``modules_to_save`` ``model`` lacks dropped
    (PEFT's task types write ["classifier", "score"] whatever the model calls its head), and a refusal naming the
    file."""
    config = dataclasses.replace(config, modules_to_save=present_modules(unwrap(model), config.modules_to_save,
                                                                         source))
    try:
        inject(config)
    except ValueError as err:
        raise ValueError(f"load_adapter: {source}: {err}") from None
