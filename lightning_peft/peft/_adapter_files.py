"""Reading one adapter directory from a stranger: every refusal names the file and the cause; and the bytes of the
weights file we write (`safetensors_bytes`: the same adapter always gives the same file).

What is read, and what is refused before the model is touched:

- ``adapter_config.json``: a JSON object; JSON nested past Python's recursion limit, or an integer with more digits
  than Python converts (``sys.get_int_max_str_digits``), is refused naming the file;
- ``adapter_model.safetensors`` (or PEFT's legacy ``adapter_model.bin``, read with ``torch.load(weights_only=True)``):
  floating-point tensors only. ``float16`` / ``bfloat16`` / ``float32`` / ``float64`` are read as they are; a
  ``float8`` tensor (``float8_e4m3fn``, ``float8_e5m2``, ...) is widened to ``float32``, which is exact (every float8
  value is a float32 value), as a bf16 file is widened when it is copied into float32 adapter parameters. An integer,
  boolean or complex tensor is refused (it would be cast to float silently), read from the safetensors header before
  any data;
- inf or NaN values;
- a path that resolves outside the adapter directory (a symbolic link to another folder or file). The one exception is
  the Hugging Face hub cache, whose ``snapshots/<revision>/`` files link into the repository's own ``blobs/``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import Tensor

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
KEY_PREFIX = "base_model.model."

_KEPT = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes read as they are (F8_*: widened)
_TORCH_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                "U32": "uint32", "I64": "int64", "U64": "uint64", "C64": "complex64", "F4": "float4_e2m1fn_x2"}


@dataclass(frozen=True)
class AdapterFiles:
    """The files of one adapter directory, for messages: its config, its weights, the key prefix of the weights."""

    config: Path
    weights: Path
    prefix: str = KEY_PREFIX

    def torn(self, key: str, shape: tuple[int, ...], dim: int, field: str, value: int) -> ValueError:
        """The error for a tensor whose size along ``dim`` is not the ``value`` of the file's own config ``field``."""
        got = f"size {shape[dim]} along dimension {dim}" if len(shape) > dim else f"no dimension {dim}"
        return ValueError(
            f"load_adapter: {self.weights} key {self.prefix}{key} has shape {tuple(shape)} ({got}), but its own "
            f"config {self.config} says {field}={value}: the file's tensors disagree with its config, so the save is "
            "probably torn or mixed (the weights and the config come from different saves). Nothing was loaded; "
            "re-save the adapter, or restore both files from one save."
        )

    def lacking(self, keys: list[str], asker: str, model_name: str) -> ValueError:
        """The error for keys the adapter needs that the weights file does not have."""
        return ValueError(
            f"load_adapter: {self.weights.parent} lacks key {and_more(sorted(keys), self.prefix)} that {asker} on "
            f"{model_name}."
        )


def and_more(keys: list[str], prefix: str) -> str:
    return f"{prefix}{keys[0]}" + (f" (and {len(keys) - 1} more)" if len(keys) > 1 else "")


def read_adapter_config(directory: Path) -> dict:
    """The parsed ``adapter_config.json`` of ``directory``; a clear error if it is missing or malformed."""
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"load_adapter: {path} does not exist; is {directory} an adapter directory?")
    try:
        config = json.loads(path.read_text())
    except RecursionError:
        raise ValueError(
            f"load_adapter: {path} nests JSON arrays or objects deeper than Python's parser can follow; a PEFT "
            "adapter config is a flat object of a few dozen fields, so the file is damaged or not an adapter config."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"load_adapter: {path} is not valid JSON ({err}); it is not a PEFT adapter config.") from None
    except ValueError as err:  # an integer longer than sys.get_int_max_str_digits()
        raise ValueError(
            f"load_adapter: {path} holds a number Python refuses to read ({err}); no adapter config field needs "
            "such a number, so the file is damaged or not an adapter config."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"load_adapter: {path} holds a JSON {type(config).__name__}, not an object; it is not a PEFT adapter "
            "config."
        )
    return config


def weights_path(directory: Path) -> Path:
    """The weights file of ``directory``: safetensors, else PEFT's legacy ``.bin``."""
    path = directory / WEIGHTS_NAME
    if path.exists() or not (directory / LEGACY_WEIGHTS_NAME).exists():
        return path
    return directory / LEGACY_WEIGHTS_NAME


def read_adapter_weights(directory: Path, prefix: str = KEY_PREFIX) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Adapter tensors from ``directory``, with ``prefix`` (PEFT's ``base_model.model.``) removed; floating point only
    (float8 widened to float32); and the safetensors header's metadata (empty for a legacy ``.bin``). Never unpickles
    code."""
    path = weights_path(directory)
    metadata: dict[str, str] = {}
    if path.name == WEIGHTS_NAME and path.exists():
        tensors, metadata = _read_safetensors(path)
    elif path.exists():
        tensors = _read_legacy(path)
        for key, value in tensors.items():
            name = str(value.dtype).removeprefix("torch.")
            _check_dtype(path, key, name, name)
    else:
        raise FileNotFoundError(f"load_adapter: {directory} holds neither {WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME}.")
    return {k.removeprefix(prefix): _widened(v) for k, v in tensors.items()}, metadata


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    try:
        with safe_open(path, framework="pt") as header:  # dtypes from the header, before any data is read
            keys = list(header.keys())
            for key in keys:
                code = header.get_slice(key).get_dtype()
                _check_dtype(path, key, code, _TORCH_NAMES.get(code, code))
            return {key: header.get_tensor(key) for key in keys}, header.metadata() or {}
    except (SafetensorError, OSError, ValueError, TypeError) as err:
        if isinstance(err, ValueError) and str(err).startswith("load_adapter:"):
            raise
        raise ValueError(
            f"load_adapter: {path} is not a valid safetensors file ({err}). If it is a pickle, it is refused: "
            "a pickle can run code. Re-save the adapter with safetensors."
        ) from None


def _read_legacy(path: Path) -> dict[str, Tensor]:
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # the unpickler raises several types for a hostile or broken file
        raise ValueError(
            f"load_adapter: {path} could not be read with torch.load(weights_only=True) ({err}); "
            "it is refused because it holds more than tensors."
        ) from None
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in tensors.items()
    ):
        raise ValueError(
            f"load_adapter: {path} holds a {type(tensors).__name__}, not a dict of tensor names to tensors; "
            "it is not a PEFT adapter."
        )
    return tensors


def _check_dtype(path: Path, key: str, code: str, name: str) -> None:
    """Floating point only: an integer, boolean or complex tensor is not a trained weight; casting it would hide
    that. ``code``: safetensors' name of the dtype (``F32``) or torch's (``float32``)."""
    if code in _KEPT or code in ("float16", "bfloat16", "float32", "float64") or code.startswith(("F8_", "float8_")):
        return
    raise ValueError(
        f"load_adapter: {path} key {key} has dtype {name}; adapter weights are floating point, and loading it would "
        "cast it to float silently. Nothing was loaded. The file is not an adapter of this kind or was written "
        "wrongly: re-save it from the trained model (float16, bfloat16, float32 or float64)."
    )


def _widened(value: Tensor) -> Tensor:
    """float8 to float32 (exact); any other dtype as it is."""
    return value.float() if value.is_floating_point() and value.element_size() == 1 else value


def refuse_non_finite(tensors: dict[str, Tensor], directory: Path, prefix: str) -> None:
    """An adapter with inf or NaN would poison every output: refused before the model is touched."""
    bad = sorted(k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all())
    if bad:
        raise ValueError(
            f"load_adapter: {directory} key {and_more(bad, prefix)} holds inf or NaN; loading it would make every "
            "output of the model non-finite. Nothing was loaded. The adapter was saved from a diverged training run "
            "(save_adapter refuses to write such weights); retrain it, or load an earlier checkpoint."
        )


def refuse_outside(root: Path, path: Path) -> None:
    """Raise if ``path`` (a subfolder or a file of adapter directory ``root``) resolves outside ``root``: a symbolic
    link would load an adapter from elsewhere. Links of a Hugging Face hub snapshot into its ``blobs/`` are allowed."""
    real_root, real = root.resolve(), path.resolve()
    allowed = [real_root]
    for folder in (real_root, *real_root.parents):
        if folder.parent.name == "snapshots":  # <repo>/snapshots/<revision>/...: files link to <repo>/blobs/<hash>
            allowed.append(folder.parent.parent / "blobs")
            break
    if not any(real == a or real.is_relative_to(a) for a in allowed):
        raise ValueError(
            f"load_adapter: {path} resolves to {real}, outside the adapter directory {real_root} (a symbolic link); "
            "an adapter directory is read only from its own files. Copy the files in instead of linking them, or "
            "load that folder by its own path."
        )


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


def unshared(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous tensors, each key its own memory: safetensors refuses tensors that share it (tied weights)."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        pointer = value.untyped_storage().data_ptr()
        out[key] = value.clone() if pointer in seen else value.contiguous()
        seen.add(pointer)
    return out
