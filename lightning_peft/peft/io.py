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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._atomic import write_files
from .._manifest import check_export
from ._adapter_files import CONFIG_NAME, KEY_PREFIX, WEIGHTS_NAME, AdapterFiles, and_more, read_adapter_config
from ._adapter_files import read_adapter_weights, refuse_non_finite, refuse_outside, safetensors_bytes, unshared
from ._adapter_files import weights_path
from ._base_identity import header, read_record, warn_if_other_base
from ._limits import check_loaded_values, refuse_overflow
from .adapter import DEFAULT, Adapter, attached, require_adapters, technique, technique_for_peft_type, unwrap

_OVERFLOW_ON_SAVE = ("Nothing was written. Check the training for divergence (loss, learning rate), or lower alpha; "
                     "a model that loads this adapter would compute nothing but inf and NaN.")


def peft_config(model: nn.Module) -> dict:
    """The ``adapter_config.json`` content for ``model``'s (single) adapter, in PEFT's vocabulary: PEFT's fields
    only (``peft.LoraConfig(**peft_config(model))`` builds its config); the file adds ``lightning_peft``."""
    adapters = require_adapters(model, "peft_config")
    return next(iter(adapters.values())).peft_config(model)


def save_adapter(
    model: nn.Module, directory: str | os.PathLike, adapter_names: Sequence[str] | None = None,
    convert_to_lora: bool = False,
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
        convert_to_lora: Write a LoRA adapter whose start rewrote the base weights (``init="pissa"``, ``"olora"``)
            as a plain LoRA of rank ``2r`` on the original base, as PEFT's ``path_initial_model_for_weight_conversion``
            (`lightning_peft.peft.lora.init`); without it such an adapter is refused. Plain adapters are unchanged.

    Returns:
        The directory.

    Raises:
        RuntimeError: If ``model`` has no adapter.
        ValueError: If an adapter name is unknown, an adapter holds non-finite values, or PEFT would run it
            differently (e.g. a dilated Conv2d, which PEFT's LoRA layer builds without the dilation).
    """
    directory = Path(directory)
    files = _all_files(model, directory, adapter_names, convert_to_lora)
    for path in {p.parent for p in files}:
        path.mkdir(parents=True, exist_ok=True)
    write_files(files)
    return directory


def check_saveable(model: nn.Module, adapter_names: Sequence[str] | None = None, convert_to_lora: bool = False) -> None:
    """Raise what [`save_adapter`][lightning_peft.peft.save_adapter] would raise (no adapter, non-finite values, a
    layout PEFT runs differently)."""
    _all_files(model, Path("."), adapter_names, convert_to_lora)


def _all_files(model: nn.Module, directory: Path, adapter_names: Sequence[str] | None,
               convert_to_lora: bool = False) -> dict[Path, Any]:
    adapters = require_adapters(model, "save_adapter")
    files = {}
    for kind, adapter in adapters.items():
        where = directory if len(adapters) == 1 else directory / kind
        for name in _names_to_save(adapter, adapter_names):
            files.update(_adapter_files(model, adapter, where if name in (None, DEFAULT) else where / name, name,
                                        convert_to_lora))
    return files


def _names_to_save(adapter: Adapter, adapter_names: Sequence[str] | None) -> list[str | None]:
    if not adapter.named:
        return [None]
    names = adapter.names
    if adapter_names is None:
        return list(names)
    if isinstance(adapter_names, str):
        adapter_names = [adapter_names]
    unknown = [n for n in adapter_names if n not in names]
    if unknown:
        raise ValueError(f"save_adapter(adapter_names={list(adapter_names)!r}): no adapter named {unknown[0]!r}; "
                         f"the model has {list(names)}.")
    return list(adapter_names)


def _adapter_files(model: nn.Module, adapter: Adapter, directory: Path, name: str | None,
                   convert_to_lora: bool = False) -> dict[Path, Any]:
    problems = adapter.peft_problems(model)
    if problems:
        raise ValueError(
            f"save_adapter: Hugging Face PEFT would run this {adapter.kind} adapter differently: "
            f"{'; '.join(problems)}. Export the merged model instead (merged_state_dict / MergeOnSave with "
            "save_adapter=False), or adapt other layers."
        )
    named = {} if name is None else {"adapter_name": name}
    options = {**named, "convert_to_lora": True} if convert_to_lora and adapter.converts_to_lora else named
    state = adapter.peft_state(model, **options)
    tensors = _writable(state, adapter.peft_key_prefix)
    refuse_overflow(adapter.value_problems(model, state, **named), "save_adapter", _OVERFLOW_ON_SAVE)
    text = json.dumps(adapter.peft_config(model, **options), indent=2, sort_keys=True) + "\n"
    return {  # the header (the base's record) is built only when the file is written, not for check_saveable
        directory / WEIGHTS_NAME: lambda tmp: Path(tmp).write_bytes(
            safetensors_bytes(tensors, {"format": "pt", **header(model, adapter, state)})),
        directory / CONFIG_NAME: lambda tmp: Path(tmp).write_text(text),
    }


def _writable(state: dict[str, Tensor], prefix: str = KEY_PREFIX) -> dict[str, Tensor]:
    """Prefixed, detached, finite tensors; a tensor shared by two keys (tied copies) is written under both."""
    for key, value in state.items():
        if not value.is_meta and not torch.isfinite(value.detach()).all():
            raise ValueError(
                f"save_adapter: {key} holds inf or NaN; an adapter with non-finite weights would break every model "
                "that loads it. Nothing was written. Check the training for divergence (loss, learning rate)."
            )
    return unshared({prefix + k: v.detach() for k, v in state.items()})


def _check_fit(
    model: nn.Module, adapter: Adapter, tensors: dict[str, Tensor], files: AdapterFiles, asker: str, named: dict
) -> dict[str, Tensor]:
    """The model tensors that ``tensors`` will be copied into; raises, naming the key, if they do not fit."""
    expected = dict(adapter.peft_state(model, **named))
    # PEFT's save_embedding_layers also writes the base weight of adapted embeddings; PEFT loads it, so do we.
    for name, layer in adapter.wrapped(model).items():
        key = f"{name}.base_layer.weight"
        if key in tensors:
            expected[key] = layer.base_layer.weight
    model_name = type(unwrap(model)).__name__
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(
            f"load_adapter: {files.weights.parent} has key {and_more(unexpected, files.prefix)} that {model_name} "
            "has no place for. Was the adapter trained on another model?"
        )
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise files.lacking(missing, asker, model_name)
    for key, value in tensors.items():
        if value.shape != expected[key].shape:
            raise ValueError(
                f"load_adapter: {files.weights.parent} key {files.prefix}{key} has shape {tuple(value.shape)}, but "
                f"the model needs {tuple(expected[key].shape)}. The adapter does not fit this model."
            )
    return expected


def load_adapter(model: nn.Module, directory: str | os.PathLike, adapter_name: str = DEFAULT) -> nn.Module:
    """Load a PEFT-format adapter into ``model``, in place.

    If ``model`` has no adapter of that technique, it is injected from the adapter's config first; if it has
    one (e.g. from the ``LoRA`` callback) the weights are loaded into it; a LoRA adapter under a name the model
    lacks is added beside its others. All or nothing: every file of every part is read and checked before the model
    is touched, and if a part still fails to fit, the parts loaded before it are taken out again, so on any error
    the model is left as it was (its modules, values and ``requires_grad``).

    Layouts read back whole (what [`save_adapter`][lightning_peft.peft.save_adapter] and PEFT's ``save_pretrained``
    write): with ``adapter_name="default"``, LoRA adapters in ``directory/<name>/`` subfolders are loaded too, under
    their folder's name; a directory without ``adapter_config.json`` but with ``<kind>/`` subfolders (several
    techniques) or ``<name>/`` subfolders (PEFT's layout without a ``default``) loads each of them.

    Files from a stranger are read defensively (`lightning_peft.peft._adapter_files`): floating-point tensors only,
    nothing that resolves outside ``directory``, and tensor shapes checked against the file's own config before any
    layer is allocated.

    Args:
        model: The base model (for a Hugging Face model, the ``PreTrainedModel``).
        directory: A directory with ``adapter_config.json`` and ``adapter_model.safetensors``.
        adapter_name: The name the (LoRA) adapter at ``directory`` gets on ``model``.

    Returns:
        ``model``.

    Raises:
        ValueError: If the files are not an adapter that fits ``model`` (the message names the file and the key).
    """
    directory = Path(directory)
    check_export(directory, "load_adapter")  # a MergeOnSave export: adapter/ and merged/ are of one export
    parts = []
    for folder, name in _parts(directory, adapter_name):
        parts.append(_read_part(directory, folder, name))
    undo: list = []
    try:
        for index, part in enumerate(parts):
            undo.append(_apply(model, part, keep_old=index < len(parts) - 1))
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    return model


def _parts(directory: Path, adapter_name: str) -> list[tuple[Path, str]]:
    """The (folder, adapter name) pairs ``directory`` holds, in loading order."""
    if (directory / CONFIG_NAME).is_file():
        return [(directory, adapter_name), *(_named_subfolders(directory) if adapter_name == DEFAULT else [])]
    folders = _subfolders(directory) if directory.is_dir() else []
    if not folders:
        raise FileNotFoundError(
            f"load_adapter: {directory / CONFIG_NAME} does not exist; is {directory} an adapter directory?"
        )
    parts = []
    for folder in folders:
        if _is_kind_folder(folder):
            parts += [(folder, DEFAULT), *_named_subfolders(folder)]
        else:
            parts.append((folder, folder.name))
    return parts


def _subfolders(directory: Path) -> list[Path]:
    """The subfolders of ``directory`` with an adapter config; one that resolves elsewhere (a link) is refused."""
    folders = sorted(p.parent for p in directory.glob(f"*/{CONFIG_NAME}"))
    for folder in folders:
        refuse_outside(directory, folder)
    return folders


def _is_kind_folder(folder: Path) -> bool:
    """``<kind>/`` of a several-technique save: named after the technique whose config it holds."""
    try:
        return technique(folder.name).peft_type == read_adapter_config(folder).get("peft_type")
    except ValueError:
        return False


def _named_subfolders(directory: Path) -> list[tuple[Path, str]]:
    return [(part, part.name) for part in _subfolders(directory)
            if not _is_kind_folder(part) and _has_named_adapters(read_adapter_config(part).get("peft_type"), part)]


def _has_named_adapters(peft_type: object, folder: Path) -> bool:
    """Whether adapters of ``peft_type`` can sit beside others under their own names (PEFT's multi-adapter layout)."""
    try:
        return technique_for_peft_type(peft_type, str(folder)).named
    except ValueError:
        return False


@dataclass(frozen=True)
class _Part:
    """One adapter of a directory, read and checked on its own (nothing about the model yet)."""

    files: AdapterFiles
    name: str
    config: dict
    cls: type[Adapter]
    tensors: dict[str, Tensor]
    recorded: object  # lightning-peft's record of the base (the weights' header), checked once the adapter fits


def _read_part(root: Path, folder: Path, name: str) -> _Part:
    config = read_adapter_config(folder)
    source = str(folder / CONFIG_NAME)
    cls = technique_for_peft_type(config.get("peft_type"), source)
    _check_fields(config, cls, source)
    if folder != root and cls.named:
        _check_folder_name(folder, name)
    files = AdapterFiles(folder / CONFIG_NAME, weights_path(folder), cls.peft_key_prefix)
    for path in (files.config, files.weights):
        refuse_outside(root, path)
    tensors, metadata = read_adapter_weights(folder, cls.peft_key_prefix)
    refuse_non_finite(tensors, folder, cls.peft_key_prefix)
    return _Part(files, name, config, cls, tensors, read_record(metadata))


def _check_folder_name(folder: Path, name: str) -> None:
    """A named adapter's folder name becomes its adapter name, part of its parameter names."""
    if not name.isidentifier():
        raise ValueError(
            f"load_adapter: subfolder {folder} would load as adapter {name!r}, which is not a usable adapter name "
            "(it becomes part of the parameter names, lora_A.<name>.weight: a non-empty identifier without dots, "
            "e.g. 'sports'). Nothing was loaded. Rename the folder, or load it on its own with "
            "load_adapter(model, folder, adapter_name=...)."
        )


def _apply(model: nn.Module, part: _Part, keep_old: bool):
    """Inject (or check) and fill ``part``'s adapter; returns what undoes it. ``keep_old``: keep the values it
    overwrites, so that a later part's failure can put them back."""
    cls, name, config, tensors = part.cls, part.name, part.config, part.tensors
    source = str(part.files.config)
    adapter = attached(model).get(cls.kind)
    multi = cls.named
    named = {"adapter_name": name} if multi else {}
    injected = adapter is None or (multi and name not in adapter.names)
    # Before anything is allocated: a size the config decides must be the file's (a 3 KB file asking for r=2**24).
    cls.check_peft_shapes(model, config, {k: tuple(v.shape) for k, v in tensors.items()}, part.files, injected,
                          **named)
    undo_injection = _no_undo
    if injected:
        undo_injection = _undoer(model, cls.kind, name)
        adapter = cls.from_peft(model, config, source, **named)
        asker = "its adapter config asks for"
    else:
        adapter.check_peft_config(model, config, source, **named)
        asker = f"the model's existing {cls.kind} adapter has (it was injected before loading)"
    try:
        expected = _check_fit(model, adapter, tensors, part.files, asker, named)
        check_loaded_values(model, adapter, tensors, expected, part.files.weights.parent, named)
    except BaseException:
        undo_injection()
        raise
    warn_if_other_base(model, adapter, config, part.recorded, tensors, part.files.weights.parent)
    old = {k: expected[k].detach().clone() for k in tensors} if keep_old else {}
    with torch.no_grad():
        for key, value in tensors.items():
            expected[key].copy_(value)

    def undo() -> None:
        with torch.no_grad():
            for key, value in old.items():
                expected[key].copy_(value)
        undo_injection()

    return undo


def _no_undo() -> None:
    pass


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


def _undoer(model: nn.Module, kind: str, adapter_name: str):
    """What takes out an adapter about to be injected (``adapter_name`` of ``kind``), restoring ``requires_grad``."""
    requires_grad = {name: p.requires_grad for name, p in unwrap(model).named_parameters()}
    added_to = attached(model).get(kind)

    def undo() -> None:
        adapter = attached(model)[kind]
        if added_to is None:
            adapter.unload(model, merge=False)
        else:
            adapter.remove(model, adapter_name)
        for name, param in unwrap(model).named_parameters():
            param.requires_grad_(requires_grad[name])

    return undo
