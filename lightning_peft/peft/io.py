"""Save and load adapters in the Hugging Face PEFT layout, for every technique through the adapter protocol.

A directory holds ``adapter_config.json`` (PEFT's fields) and ``adapter_model.safetensors`` (its header records the
base the adapter was trained on, which PEFT passes over and `load_adapter` checks: `lightning_peft.peft._base_identity`)
with keys ``base_model.model.<module path>.<tensor>``; for LoRA: ``lora_A.weight`` /
``lora_B.weight`` (``lora_embedding_A`` / ``lora_embedding_B`` for embeddings), ``<path>.base_layer.bias`` for trained
biases of adapted layers, ``<path>.<param>`` for ``modules_to_save``. ``peft.PeftModel.from_pretrained`` loads what
[`save_adapter`][lightning_peft.peft.save_adapter] writes, and [`load_adapter`][lightning_peft.peft.load_adapter] loads
what PEFT writes. A model with adapters of several techniques is saved one directory per technique,
``<directory>/<kind>/``.

Files are written under a temporary name and renamed into place, so a failure never leaves a half-written
adapter; non-finite weights, and a scale or factors that overflow the dtype the adapted layers compute in
(`lightning_peft.peft._limits`), are refused before anything is written or loaded. Weights are read with
safetensors, or from PEFT's legacy ``adapter_model.bin`` with ``torch.load(weights_only=True)``: an adapter file from
a stranger cannot run code.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import Tensor, nn

from .._atomic import write_files
from .._manifest import check_export
from ._base_identity import header, read_record, warn_if_other_base
from ._limits import check_loaded_values, refuse_overflow
from .adapter import DEFAULT, Adapter, attached, require_adapters, technique, technique_for_peft_type, unwrap

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
KEY_PREFIX = "base_model.model."
_OVERFLOW_ON_SAVE = ("Nothing was written. Check the training for divergence (loss, learning rate), or lower alpha; "
                     "a model that loads this adapter would compute nothing but inf and NaN.")


def peft_config(model: nn.Module) -> dict:
    """The ``adapter_config.json`` content for ``model``'s (single) adapter, in PEFT's vocabulary: PEFT's fields
    only (``peft.LoraConfig(**peft_config(model))`` builds its config); the file adds ``lightning_peft``."""
    adapters = require_adapters(model, "peft_config")
    return next(iter(adapters.values())).peft_config(model)


def save_adapter(
    model: nn.Module, directory: str | os.PathLike, adapter_names: Sequence[str] | None = None
) -> Path:
    """Write ``model``'s adapters to ``directory`` in the Hugging Face PEFT layout.

    Named LoRA adapters follow PEFT's multi-adapter layout: ``default`` at ``directory/``, every other adapter in
    ``directory/<name>/`` (``peft.PeftModel.from_pretrained(base, directory / name)`` loads each one).

    Args:
        model: A model adapted with [`inject_lora`][lightning_peft.peft.inject_lora] (or another technique). For a
            Hugging Face model, the ``PreTrainedModel`` itself, so that the key paths are the ones PEFT expects.
        directory: Created if missing; existing adapter files in it are replaced. With adapters of several
            techniques, each goes to ``directory/<kind>/``.
        adapter_names: The named LoRA adapters to save (default: all).

    Returns:
        The directory.

    Raises:
        RuntimeError: If ``model`` has no adapter.
        ValueError: If an adapter name is unknown, an adapter holds non-finite values, or PEFT would run it
            differently (e.g. a dilated Conv2d, which PEFT's LoRA layer builds without the dilation).
    """
    directory = Path(directory)
    files = _all_files(model, directory, adapter_names)
    for path in {p.parent for p in files}:
        path.mkdir(parents=True, exist_ok=True)
    write_files(files)
    return directory


def check_saveable(model: nn.Module, adapter_names: Sequence[str] | None = None) -> None:
    """Raise what [`save_adapter`][lightning_peft.peft.save_adapter] would raise (no adapter, non-finite values, a
    layout PEFT runs differently)."""
    _all_files(model, Path("."), adapter_names)


def _all_files(model: nn.Module, directory: Path, adapter_names: Sequence[str] | None) -> dict[Path, Any]:
    adapters = require_adapters(model, "save_adapter")
    files = {}
    for kind, adapter in adapters.items():
        where = directory if len(adapters) == 1 else directory / kind
        for name in _names_to_save(adapter, adapter_names):
            files.update(_adapter_files(model, adapter, where if name in (None, DEFAULT) else where / name, name))
    return files


def _names_to_save(adapter: Adapter, adapter_names: Sequence[str] | None) -> list[str | None]:
    names = getattr(adapter, "names", None)
    if names is None:
        return [None]
    if adapter_names is None:
        return list(names)
    if isinstance(adapter_names, str):
        adapter_names = [adapter_names]
    unknown = [n for n in adapter_names if n not in names]
    if unknown:
        raise ValueError(f"save_adapter(adapter_names={list(adapter_names)!r}): no adapter named {unknown[0]!r}; "
                         f"the model has {list(names)}.")
    return list(adapter_names)


def _adapter_files(model: nn.Module, adapter: Adapter, directory: Path, name: str | None) -> dict[Path, Any]:
    problems = adapter.peft_problems(model)
    if problems:
        raise ValueError(
            f"save_adapter: Hugging Face PEFT would run this {adapter.kind} adapter differently: "
            f"{'; '.join(problems)}. Export the merged model instead (merged_state_dict / MergeOnSave with "
            "save_adapter=False), or adapt other layers."
        )
    named = {} if name is None else {"adapter_name": name}
    state = adapter.peft_state(model, **named)
    tensors = _writable(state, adapter.peft_key_prefix)
    refuse_overflow(adapter.value_problems(model, state, **named), "save_adapter", _OVERFLOW_ON_SAVE)
    text = json.dumps(adapter.peft_config(model, **named), indent=2, sort_keys=True) + "\n"
    metadata = {"format": "pt", **header(model, adapter, state)}
    return {
        directory / WEIGHTS_NAME: lambda tmp: Path(tmp).write_bytes(safetensors_bytes(tensors, metadata)),
        directory / CONFIG_NAME: lambda tmp: Path(tmp).write_text(text),
    }


def safetensors_bytes(tensors: dict[str, Tensor], metadata: dict[str, str]) -> bytes:
    """``tensors`` and ``metadata`` as a safetensors file whose bytes depend on them alone.

    safetensors writes its ``__metadata__`` map in hash order, which changes from process to process once it holds two
    entries; the header is written again with the entries sorted (the same JSON text reordered, so of the same length,
    and the tensors' offsets stay), so that saving one adapter twice gives one file.
    """
    data = bytearray(save(tensors, metadata=metadata))
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) <= length:  # (a JSON writer that escapes differently: keep safetensors' own header)
        data[8:8 + length] = text.ljust(length)  # safetensors pads its header with spaces too
    return bytes(data)


def _writable(state: dict[str, Tensor], prefix: str = KEY_PREFIX) -> dict[str, Tensor]:
    """Prefixed, detached, finite tensors; a tensor shared by two keys (tied copies) is written under both."""
    for key, value in state.items():
        if not value.is_meta and not torch.isfinite(value.detach()).all():
            raise ValueError(
                f"save_adapter: {key} holds inf or NaN; an adapter with non-finite weights would break every model "
                "that loads it. Nothing was written. Check the training for divergence (loss, learning rate)."
            )
    return unshared({prefix + k: v.detach() for k, v in state.items()})


def unshared(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous tensors, each key its own memory: safetensors refuses tensors that share it (tied weights)."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        pointer = value.untyped_storage().data_ptr()
        out[key] = value.clone() if pointer in seen else value.contiguous()
        seen.add(pointer)
    return out


def read_adapter_config(directory: Path) -> dict:
    """The parsed ``adapter_config.json`` of ``directory``; a clear error if it is missing or malformed."""
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"load_adapter: {path} does not exist; is {directory} an adapter directory?")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"load_adapter: {path} is not valid JSON ({err}); it is not a PEFT adapter config.") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"load_adapter: {path} holds a JSON {type(config).__name__}, not an object; it is not a PEFT adapter "
            "config."
        )
    return config


def read_adapter_weights(directory: Path, prefix: str = KEY_PREFIX) -> dict[str, Tensor]:
    """Adapter tensors from ``directory``, with ``prefix`` (PEFT's ``base_model.model.``) removed. Never unpickles
    code."""
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
    return {k.removeprefix(prefix): v for k, v in tensors.items()}


def _and_more(keys: list[str], prefix: str) -> str:
    return f"{prefix}{keys[0]}" + (f" (and {len(keys) - 1} more)" if len(keys) > 1 else "")


def _check_fit(
    model: nn.Module, adapter: Adapter, tensors: dict[str, Tensor], source: Path, asker: str, named: dict
) -> dict[str, Tensor]:
    """The model tensors that ``tensors`` will be copied into; raises, naming the key, if they do not fit."""
    expected = dict(adapter.peft_state(model, **named))
    # PEFT's save_embedding_layers also writes the base weight of adapted embeddings; PEFT loads it, so do we.
    for name, layer in adapter.wrapped(model).items():
        key = f"{name}.base_layer.weight"
        if key in tensors:
            expected[key] = layer.base_layer.weight
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(
            f"load_adapter: {source} has key {_and_more(unexpected, adapter.peft_key_prefix)} that "
            f"{type(unwrap(model)).__name__} has no place for. Was the adapter trained on another model?"
        )
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(
            f"load_adapter: {source} lacks key {_and_more(missing, adapter.peft_key_prefix)} that {asker} on "
            f"{type(unwrap(model)).__name__}."
        )
    for key, value in tensors.items():
        if value.shape != expected[key].shape:
            raise ValueError(
                f"load_adapter: {source} key {adapter.peft_key_prefix}{key} has shape {tuple(value.shape)}, but the model "
                f"needs {tuple(expected[key].shape)}. The adapter does not fit this model."
            )
    return expected


def load_adapter(model: nn.Module, directory: str | os.PathLike, adapter_name: str = DEFAULT) -> nn.Module:
    """Load a PEFT-format adapter into ``model``, in place.

    If ``model`` has no adapter of that technique, it is injected from the adapter's config first; if it has
    one (e.g. from the ``LoRA`` callback) the weights are loaded into it; a LoRA adapter under a name the model
    lacks is added beside its others. On any error the model is left as it was.

    Layouts read back whole (what [`save_adapter`][lightning_peft.peft.save_adapter] and PEFT's ``save_pretrained``
    write): with ``adapter_name="default"``, LoRA adapters in ``directory/<name>/`` subfolders are loaded too, under
    their folder's name; a directory without ``adapter_config.json`` but with ``<kind>/`` subfolders (several
    techniques) or ``<name>/`` subfolders (PEFT's layout without a ``default``) loads each of them.

    Args:
        model: The base model (for a Hugging Face model, the ``PreTrainedModel``).
        directory: A directory with ``adapter_config.json`` and ``adapter_model.safetensors``.
        adapter_name: The name the (LoRA) adapter at ``directory`` gets on ``model``.

    Returns:
        ``model``.

    Raises:
        ValueError: If the files are not an adapter that fits ``model`` (the message names the key).
    """
    directory = Path(directory)
    check_export(directory, "load_adapter")  # a MergeOnSave export: adapter/ and merged/ are of one export
    if (directory / CONFIG_NAME).is_file():
        _load_one(model, directory, adapter_name)
        if adapter_name == DEFAULT:
            _load_named_subfolders(model, directory)
        return model
    parts = sorted(p.parent for p in directory.glob(f"*/{CONFIG_NAME}")) if directory.is_dir() else []
    if not parts:
        raise FileNotFoundError(
            f"load_adapter: {directory / CONFIG_NAME} does not exist; is {directory} an adapter directory?"
        )
    for part in parts:
        if _is_kind_folder(part):
            _load_one(model, part, DEFAULT)
            _load_named_subfolders(model, part)
        else:
            _load_one(model, part, part.name)
    return model


def _is_kind_folder(folder: Path) -> bool:
    """``<kind>/`` of a several-technique save: named after the technique whose config it holds."""
    try:
        return technique(folder.name).peft_type == read_adapter_config(folder).get("peft_type")
    except ValueError:
        return False


def _load_named_subfolders(model: nn.Module, directory: Path) -> None:
    for part in sorted(p.parent for p in directory.glob(f"*/{CONFIG_NAME}")):
        if not _is_kind_folder(part) and _has_named_adapters(read_adapter_config(part).get("peft_type"), part):
            _load_one(model, part, part.name)


def _has_named_adapters(peft_type: object, folder: Path) -> bool:
    """Whether adapters of ``peft_type`` can sit beside others under their own names (PEFT's multi-adapter layout)."""
    try:
        return hasattr(technique_for_peft_type(peft_type, str(folder)), "names")
    except ValueError:
        return False


def _load_one(model: nn.Module, directory: Path, adapter_name: str) -> None:
    config = read_adapter_config(directory)
    recorded = read_record(directory / WEIGHTS_NAME)  # lightning-peft's record of the base, checked once the adapter fits
    source = str(directory / CONFIG_NAME)
    cls = technique_for_peft_type(config.get("peft_type"), source)
    _check_fields(config, cls, source)
    tensors = read_adapter_weights(directory, cls.peft_key_prefix)
    _refuse_non_finite(tensors, directory, cls.peft_key_prefix)
    adapter = attached(model).get(cls.kind)
    multi = hasattr(cls, "names")
    named = {"adapter_name": adapter_name} if multi else {}
    injected = adapter is None or (multi and adapter_name not in adapter.names)
    if injected:
        requires_grad = {name: p.requires_grad for name, p in unwrap(model).named_parameters()}
        added_to = adapter
        adapter = cls.from_peft(model, config, source, **named)
        asker = "its adapter config asks for"
    else:
        adapter.check_peft_config(model, config, source, **named)
        asker = f"the model's existing {cls.kind} adapter has (it was injected before loading)"
    try:
        expected = _check_fit(model, adapter, tensors, directory, asker, named)
        check_loaded_values(model, adapter, tensors, expected, directory, named)
    except Exception:
        if injected:
            _undo_injection(model, adapter, added_to, adapter_name, requires_grad)
        raise
    warn_if_other_base(model, adapter, config, recorded, tensors, source)
    with torch.no_grad():
        for key, value in tensors.items():
            expected[key].copy_(value)


def _check_fields(config: dict, cls: type[Adapter], source: str) -> None:
    """The file's version and fields against what ``cls`` reads. Our own format (``format_version`` set) is exact: a
    field we do not know would be ignored, so it is refused. PEFT's fields are open (a typo, or a newer format, is
    ignored), so they are warned about."""
    known = cls.peft_fields
    unknown = sorted(set(config) - known) if known is not None else []
    what = f"{cls.kind.replace('_', ' ')} adapter"
    if cls.format_version is not None:
        if config.get("format_version") != cls.format_version:
            raise ValueError(
                f"load_adapter: {source} has format_version={config.get('format_version')!r}; this version of "
                f"lightning-peft reads {what}s of format_version {cls.format_version}. Upgrade lightning-peft."
            )
        if unknown:
            raise ValueError(
                f"load_adapter: {source} has field {unknown[0]!r}, which a {what} config does not have; loading it "
                f"would ignore what it means. Fields: {', '.join(sorted(known or ()))}."
            )
    elif unknown:
        warnings.warn(
            f"load_adapter: {source} has field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}, "
            f"which Hugging Face PEFT's {cls.peft_type} config does not have (as of peft 0.21.2); "
            f"{'they are' if len(unknown) > 1 else 'it is'} ignored. Check the file for a typo, or a newer format "
            "that this version of lightning-peft cannot read.",
            UserWarning, stacklevel=4,
        )


def _refuse_non_finite(tensors: dict[str, Tensor], directory: Path, prefix: str) -> None:
    """An adapter with inf or NaN would poison every output: refused before the model is touched."""
    bad = sorted(k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all())
    if bad:
        raise ValueError(
            f"load_adapter: {directory} key {_and_more(bad, prefix)} holds inf or NaN; loading it would make every "
            "output of the model non-finite. Nothing was loaded. The adapter was saved from a diverged training run "
            "(save_adapter refuses to write such weights); retrain it, or load an earlier checkpoint."
        )


def _undo_injection(model, adapter, added_to, adapter_name: str, requires_grad: dict[str, bool]) -> None:
    if added_to is None:
        adapter.unload(model, merge=False)
    else:
        adapter.remove(model, adapter_name)
    for name, param in unwrap(model).named_parameters():
        param.requires_grad_(requires_grad[name])
