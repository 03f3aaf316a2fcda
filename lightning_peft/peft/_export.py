"""A merged Hugging Face export of a model whose input and output embeddings are tied.

A model that ties them (``config.tie_word_embeddings``) keeps one matrix for both; an adapter on one of them (the LM
head, the token embedding) is folded into that one only, so the merged two differ. Written as they are, with the
config still saying tied, transformers 5 keeps them apart only because it compares the values (and warns to fix the
config); a loader that follows the config ties them again and loses the adapted one. So the export writes both
matrices, each under its own key, and a copy of the config with ``tie_word_embeddings=False``; the live config,
which the model's submodules share, is never changed. A model whose merged embeddings stay equal is saved as
``save_pretrained`` saves it (one matrix, the config as it is).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from .adapter import clean_key, unwrap
from .io import unshared


def embeddings_untied(model: nn.Module, state: dict[str, Tensor]) -> bool:
    """Whether ``model`` ties its input and output embeddings (``config.tie_word_embeddings``, one matrix for both)
    but ``state``, its [`merged_state_dict`][lightning_peft.peft.merged_state_dict], holds two different ones: an
    adapter on one of them (the LM head, the token embedding) was folded into that one only.
    """
    model = unwrap(model)
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return False
    try:
        modules = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):  # not a Hugging Face model, or one without embeddings
        return False
    names = {id(module): name for name, module in model.named_modules()}
    keys = [clean_key(f"{names[id(module)]}.weight") if id(module) in names else None for module in modules]
    if None in keys or keys[0] == keys[1] or not all(key in state for key in keys):
        return False
    first, second = (state[key] for key in keys)
    return first.shape != second.shape or not (first.data_ptr() == second.data_ptr() or first.equal(second))


def untied_config(config: Any) -> Any:
    """A copy of a Hugging Face ``config`` with ``tie_word_embeddings=False`` (also in the text config of a
    composite model); ``config`` itself is not changed."""
    config = copy.deepcopy(config)
    text = config.get_text_config(decoder=True) if callable(getattr(config, "get_text_config", None)) else config
    for part in {id(config): config, id(text): text}.values():
        if getattr(part, "tie_word_embeddings", False):
            part.tie_word_embeddings = False
    return config


def save_pretrained_merged(model: nn.Module, state: dict[str, Tensor], directory: Path, **options: Any) -> None:
    """``model.save_pretrained(directory, state_dict=state, **options)`` for ``state``, its
    [`merged_state_dict`][lightning_peft.peft.merged_state_dict], with the config untied where the merge untied the
    embeddings (`embeddings_untied`)."""
    untie = embeddings_untied(model, state)
    model.save_pretrained(directory, state_dict=unshared(state) if untie else state, **options)
    if untie:  # a copy, after save_pretrained has recorded the architecture and dtype in the live config
        untied_config(model.config).save_pretrained(directory)
