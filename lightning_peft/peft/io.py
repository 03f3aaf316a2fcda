"""Save and load LoRA adapters in the Hugging Face PEFT layout.

A directory holds ``adapter_config.json`` (only fields PEFT knows) and ``adapter_model.safetensors`` with keys
``base_model.model.<module path>.lora_A.weight`` / ``lora_B.weight`` (``lora_embedding_A`` / ``lora_embedding_B``
for embeddings, ``<path>.base_layer.bias`` for trained biases of adapted layers, ``<path>.<param>`` for
``modules_to_save``). ``peft.PeftModel.from_pretrained`` loads what :func:`save_adapter` writes, and
:func:`load_adapter` loads what PEFT writes.

Files are written under a temporary name and renamed into place, so a failure never leaves a half-written
adapter. Weights are read with safetensors, or from PEFT's legacy ``adapter_model.bin`` with
``torch.load(weights_only=True)``: an adapter file from a stranger cannot run code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .._atomic import write_files
from .lora import (
    LoRAConfig,
    adapter_state_dict,
    inject_lora,
    lora_layers,
    lora_spec,
    name_matches,
    require_spec,
    set_submodule,
    SPEC_ATTRIBUTE,
)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
KEY_PREFIX = "base_model.model."

# PEFT initialisations that rewrite the base weights as well (PEFT re-runs them when it loads the adapter).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")

# PEFT features this library does not implement: loading such an adapter would silently change its meaning.
_UNSUPPORTED = {
    "use_dora": False,
    "layers_to_transform": None,
    "layers_pattern": None,
    "target_parameters": None,
    "lora_bias": False,
    "layer_replication": None,
    "trainable_token_indices": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "use_bdlora": None,
    "kasa_config": None,
    "monteclora_config": None,
    "arrow_config": None,
    "velora_config": None,
}


def peft_config(model: nn.Module) -> dict:
    """The ``adapter_config.json`` content for ``model``'s adapter, in PEFT's vocabulary.

    Targets are written as the exact module names adapted (so PEFT adapts exactly the same modules), and
    per-module ranks/alphas that differ from the defaults as escaped exact-name patterns.
    """
    spec = require_spec(model, "save_adapter")
    config = spec.config
    layers = lora_layers(model)
    name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None)
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": name_or_path or None,
        "inference_mode": True,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": list(spec.targets),
        "exclude_modules": None,
        "modules_to_save": list(spec.modules_to_save) or None,
        "rank_pattern": {re.escape(n): m.rank for n, m in layers.items() if m.rank != config.rank},
        "alpha_pattern": {re.escape(n): m.alpha for n, m in layers.items() if m.alpha != config.alpha},
        "bias": config.bias,
        "fan_in_fan_out": any(getattr(m, "fan_in_fan_out", False) for m in layers.values()),
        "init_lora_weights": "gaussian" if config.init == "gaussian" else True,
        "use_rslora": config.use_rslora,
        "use_dora": False,
    }


def save_adapter(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write ``model``'s adapter to ``directory`` in the Hugging Face PEFT layout.

    Args:
        model: A model adapted with :func:`~lightning_peft.peft.inject_lora` (for a Hugging Face model, the
            ``PreTrainedModel`` itself, so that the key paths are the ones PEFT expects).
        directory: Created if missing; existing adapter files in it are replaced.

    Returns:
        The directory.
    """
    config = peft_config(model)
    tensors = {KEY_PREFIX + k: v.contiguous() for k, v in adapter_state_dict(model).items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    write_files({
        directory / WEIGHTS_NAME: lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}),
        directory / CONFIG_NAME: lambda tmp: Path(tmp).write_text(text),
    })
    return directory


def config_from_peft(config: dict, source: str = "adapter_config.json") -> LoRAConfig:
    """Translate a PEFT ``LoraConfig`` dict to :class:`LoRAConfig`; refuses features this library lacks."""
    if config.get("peft_type") != "LORA":
        raise ValueError(f"load_adapter: {source} has peft_type={config.get('peft_type')!r}; only 'LORA' is supported.")
    for key, neutral in _UNSUPPORTED.items():
        value = config.get(key, neutral)
        if value not in (neutral, [], {}):
            raise ValueError(
                f"load_adapter: {source} sets {key}={value!r}, which lightning-peft does not support; "
                "load this adapter with Hugging Face PEFT instead."
            )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(
            f"load_adapter: {source} sets init_lora_weights={init!r}, an initialisation that also rewrites the base "
            "weights; lightning-peft does not implement it, so the adapter would mean something else here. "
            "Load it with Hugging Face PEFT instead."
        )
    absent = [key for key in ("r", "target_modules") if config.get(key) is None]
    if absent:
        raise ValueError(f"load_adapter: {source} has no {absent[0]!r}; it is not a complete LoRA adapter config.")
    return LoRAConfig(
        rank=config["r"],
        alpha=config.get("lora_alpha", 8),
        dropout=config.get("lora_dropout", 0.0),
        target_modules=config["target_modules"],
        exclude_modules=config.get("exclude_modules"),
        modules_to_save=config.get("modules_to_save"),
        rank_pattern=config.get("rank_pattern") or {},
        alpha_pattern=config.get("alpha_pattern") or {},
        bias=config.get("bias", "none"),
        init="gaussian" if init == "gaussian" else "kaiming",
        use_rslora=config.get("use_rslora", False),
    )


def read_adapter_weights(directory: Path) -> dict[str, Tensor]:
    """Adapter tensors from ``directory``, with the ``base_model.model.`` prefix removed. Never unpickles code."""
    path = directory / WEIGHTS_NAME
    if path.exists():
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(
                f"load_adapter: {path} is not a valid safetensors file ({err}). If it is a pickle, it is refused: "
                "a pickle can run code. Re-save the adapter with safetensors."
            ) from None
    elif (directory / LEGACY_WEIGHTS_NAME).exists():
        legacy = directory / LEGACY_WEIGHTS_NAME
        try:
            tensors = torch.load(legacy, map_location="cpu", weights_only=True)
        except Exception as err:  # the unpickler raises several types for a hostile or broken file
            raise ValueError(
                f"load_adapter: {legacy} could not be read with torch.load(weights_only=True) ({err}); "
                "it is refused because it holds more than tensors."
            ) from None
        if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in tensors.items()
        ):
            raise ValueError(
                f"load_adapter: {legacy} holds a {type(tensors).__name__}, not a dict of tensor names to tensors; "
                "it is not a PEFT adapter."
            )
    else:
        raise FileNotFoundError(f"load_adapter: {directory} holds neither {WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME}.")
    return {k.removeprefix(KEY_PREFIX): v for k, v in tensors.items()}


def _and_more(keys: list[str]) -> str:
    return f"{KEY_PREFIX}{keys[0]}" + (f" (and {len(keys) - 1} more)" if len(keys) > 1 else "")


def _check_fit(model: nn.Module, tensors: dict[str, Tensor], source: Path) -> dict[str, Tensor]:
    """The model tensors that ``tensors`` will be copied into; raises, naming the key, if they do not fit."""
    expected = adapter_state_dict(model)
    # PEFT's save_embedding_layers also writes the base weight of adapted embeddings; PEFT loads it, so do we.
    for name, layer in lora_layers(model).items():
        key = f"{name}.base_layer.weight"
        if key in tensors:
            expected[key] = layer.base_layer.weight.detach()
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(
            f"load_adapter: {source} has key {_and_more(unexpected)} that {type(model).__name__} has no place for. "
            "Was the adapter trained on another model?"
        )
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(
            f"load_adapter: {source} lacks key {_and_more(missing)} that the adapter config asks for on "
            f"{type(model).__name__}."
        )
    for key, value in tensors.items():
        if value.shape != expected[key].shape:
            raise ValueError(
                f"load_adapter: {source} key {KEY_PREFIX}{key} has shape {tuple(value.shape)}, but the model "
                f"needs {tuple(expected[key].shape)}. The adapter does not fit this model."
            )
    return expected


def load_adapter(model: nn.Module, directory: str | os.PathLike) -> nn.Module:
    """Load a PEFT-format LoRA adapter into ``model``, in place.

    If ``model`` has no LoRA layers they are injected from the adapter's config first; if it has them
    (e.g. from the ``LoRA`` callback) the weights are loaded into them. On any error the model is left
    as it was.

    Args:
        model: The base model (for a Hugging Face model, the ``PreTrainedModel``).
        directory: A directory with ``adapter_config.json`` and ``adapter_model.safetensors``.

    Returns:
        ``model``.

    Raises:
        ValueError: If the files are not a LoRA adapter that fits ``model`` (the message names the key).
    """
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"load_adapter: {config_path} does not exist; is {directory} an adapter directory?")
    tensors = read_adapter_weights(directory)
    merged = [name for name, layer in lora_layers(model).items() if layer.merged]
    if merged:
        raise RuntimeError(f"load_adapter: layer {merged[0]!r} is merged; call unmerge_lora(model) before loading.")
    config = config_from_peft(json.loads(config_path.read_text()), str(config_path))
    injected = lora_spec(model) is None
    if injected:
        requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
        replaced = inject_lora(model, _existing_modules_to_save(model, config))
    else:
        _check_scaling(model, config, config_path)
    try:
        expected = _check_fit(model, tensors, directory)
    except Exception:
        if injected:
            _undo_injection(model, replaced, requires_grad)
        raise
    with torch.no_grad():
        for key, value in tensors.items():
            expected[key].copy_(value)
    return model


def _existing_modules_to_save(model: nn.Module, config: LoRAConfig) -> LoRAConfig:
    """Drop ``modules_to_save`` entries that name no module, as PEFT does.

    PEFT's ``SEQ_CLS`` task writes ``["classifier", "score"]`` whatever the model calls its head.
    """
    names = [n for n, _ in model.named_modules() if n]
    present = [m for m in dict.fromkeys(config.modules_to_save or []) if any(name_matches(n, [m]) for n in names)]
    return dataclasses.replace(config, modules_to_save=present or None)


def _check_scaling(model: nn.Module, config: LoRAConfig, source: Path) -> None:
    """An adapter loaded into existing LoRA layers must be scaled as it was trained."""
    for name, layer in lora_layers(model).items():
        alpha = config.alpha_for(name)
        if (layer.alpha, layer.use_rslora) != (alpha, config.use_rslora):
            raise ValueError(
                f"load_adapter: {source} gives {name!r} alpha={alpha}, use_rslora={config.use_rslora}, but the "
                f"model's LoRA layer has alpha={layer.alpha}, use_rslora={layer.use_rslora}; the adapter would be "
                "scaled differently. Load it into a model without LoRA layers."
            )


def _undo_injection(model: nn.Module, replaced: dict, requires_grad: dict[str, bool]) -> None:
    for name, layer in replaced.items():
        set_submodule(model, name, layer.base_layer)
    for name, param in model.named_parameters():
        param.requires_grad_(requires_grad[name])
    delattr(model, SPEC_ATTRIBUTE)
