"""The on-disk cache of curriculum scores, keyed by a hash of the data and one of the scorer.

The cache file, ``cache_dir/scores-<key>.pt``, is keyed by a hash of the data (every sample's content, see
`dataset_fingerprint`; or a caller's ``data_fingerprint``) and one of the scorer (`scorer_fingerprint`):
its ``fingerprint()`` method (or string attribute) if it has one, else, for a plain function or a
``functools.partial`` of one, its qualified name, bytecode, bound arguments and the plain data it reads. It is
written under a temporary name and renamed into place, so a crash leaves no half-written file, and read back with
``torch.load(weights_only=True)``.

Shapes: the cached scores are ``(N,)`` float64.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import CodeType
from typing import Any

import torch
from torch import Tensor, nn

from lightning_peft._atomic import write_files

__all__ = ["cache_key", "cache_path", "dataset_fingerprint", "module_digest", "read_scores", "scorer_fingerprint", "write_scores"]

log = logging.getLogger(__name__)


def cache_key(dataset: Sequence[Any], scorer: Any, data_fingerprint: str | None = None) -> dict[str, str]:
    """``{"data": ..., "scorer": ...}``: what a cache entry must match to be read back."""
    return {"data": data_fingerprint or dataset_fingerprint(dataset), "scorer": scorer_fingerprint(scorer)}


def cache_path(cache_dir: str | Path, key: dict[str, str]) -> Path:
    """The cache file of ``key`` in ``cache_dir``."""
    digest = hashlib.sha256(f"{key['data']}\n{key['scorer']}".encode()).hexdigest()[:32]
    return Path(cache_dir) / f"scores-{digest}.pt"


def write_scores(path: Path, key: dict[str, str], scores: Tensor) -> None:
    """Writes ``scores`` under ``key`` to ``path`` atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {**key, "scores": scores}
    write_files({path: lambda tmp: torch.save(entry, tmp)})


def read_scores(path: Path, key: dict[str, str], count: int) -> Tensor | None:
    """The cached scores if ``path`` holds them for ``key`` and ``count`` samples, else None."""
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, weights_only=True)
    except Exception as error:  # unreadable: score again and overwrite
        log.warning("compute_scores: could not read the score cache %s (%s); scoring again.", path, error)
        return None
    scores = entry.get("scores") if isinstance(entry, dict) else None
    same_key = isinstance(entry, dict) and all(entry.get(k) == v for k, v in key.items())
    if not same_key or not isinstance(scores, Tensor) or scores.shape != (count,):
        return None
    return scores.to(torch.float64)


def dataset_fingerprint(dataset: Sequence[Any]) -> str:
    """A hash of every sample's content (mappings, sequences, tensors, arrays, strings and numbers).

    Raises:
        TypeError: If a sample holds a value of another type.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str(len(dataset)).encode())
    for index in range(len(dataset)):
        _feed(digest, dataset[index], index)
    return digest.hexdigest()


def _feed(digest: Any, value: Any, index: int) -> None:
    if isinstance(value, Tensor):
        _feed_tensor(digest, value)
    elif isinstance(value, Mapping):
        digest.update(b"{%d" % len(value))
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, value[key], index)
    elif isinstance(value, (list, tuple)):
        digest.update(b"[%d" % len(value))
        for item in value:
            _feed(digest, item, index)
    elif value is None or isinstance(value, (str, bytes, numbers.Number)):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    elif all(hasattr(value, attr) for attr in ("tobytes", "dtype", "shape")):  # a numpy array
        digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
        digest.update(value.tobytes())
    else:
        raise TypeError(
            f"compute_scores: sample {index} holds a {type(value).__name__}, which the score cache cannot "
            "hash; pass compute_scores(..., data_fingerprint='<a name for this data>'), or cache_dir=None."
        )


def module_digest(module: nn.Module) -> str:
    """A hash of ``module``'s state dict: every entry's name, dtype, shape and bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        _feed_tensor(digest, tensor)
    return digest.hexdigest()


def _feed_tensor(digest: Any, tensor: Tensor) -> None:
    tensor = tensor.detach().cpu().contiguous()
    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def scorer_fingerprint(scorer: Any) -> str:
    """The scorer's part of the cache key (see the module docstring).

    Raises:
        TypeError: If the scorer has no fingerprint and is not a function (or a partial or method of one).
    """
    own = getattr(scorer, "fingerprint", None)
    if callable(own):
        return str(own())
    if isinstance(own, str):
        return own
    if isinstance(scorer, functools.partial):
        keywords = sorted(scorer.keywords.items())
        return f"partial({scorer_fingerprint(scorer.func)}, args={scorer.args!r}, keywords={keywords!r})"
    if inspect.ismethod(scorer):  # what the method reads of its object is keyed too
        return f"{scorer_fingerprint(scorer.__func__)}:self={_object_key(scorer.__self__)}"
    code = getattr(scorer, "__code__", None)
    if isinstance(code, CodeType):
        digest = hashlib.blake2b(digest_size=16)
        _feed_code(digest, code)
        defaults = (getattr(scorer, "__defaults__", None), sorted((getattr(scorer, "__kwdefaults__", None) or {}).items()))
        # What the code reads besides its arguments: closure cells and the module globals it names. Plain data is
        # keyed by value (a threshold captured by a closure, a MAX_LEN constant); anything else by its type only.
        cells = [_data_key(cell.cell_contents) for cell in (getattr(scorer, "__closure__", None) or ())
                 if _cell_is_set(cell)]
        names = _code_names(code)
        module_globals = getattr(scorer, "__globals__", {})
        reads = sorted((name, _data_key(module_globals[name])) for name in names if name in module_globals)
        digest.update(repr((cells, reads)).encode())
        return f"{scorer.__module__}.{scorer.__qualname__}:{digest.hexdigest()}:{defaults!r}"
    raise TypeError(
        f"compute_scores: cannot key the score cache by {_qualname(scorer)}, a {type(scorer).__name__} without a "
        "fingerprint; give it a fingerprint() method returning a string that changes when its scores would, "
        "use a plain function, or pass cache_dir=None."
    )


def _object_key(value: Any) -> str:
    """A key of an object's state, for the object a scoring method is bound to: its own ``fingerprint()`` if it
    has one; tensors and modules by content; plain data by value; other objects by their attributes.

    Raises:
        TypeError: For state that cannot be keyed (an object without ``__dict__`` nor a fingerprint).
    """
    own = getattr(value, "fingerprint", None)
    if callable(own):
        return str(own())
    if isinstance(value, Tensor):
        digest = hashlib.blake2b(digest_size=16)
        _feed_tensor(digest, value)
        return f"tensor:{digest.hexdigest()}"
    if isinstance(value, nn.Module):
        return f"{type(value).__qualname__}({_object_key(dict(value.state_dict()))}, training={value.training})"
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return repr(value)
    if isinstance(value, tuple | list):
        return f"{type(value).__name__}({[_object_key(v) for v in value]})"
    if isinstance(value, Mapping):
        return f"dict({sorted((repr(k), _object_key(v)) for k, v in value.items())})"
    if callable(value) and hasattr(value, "__code__"):
        return scorer_fingerprint(value)
    state = getattr(value, "__dict__", None)
    if state is None:
        raise TypeError(
            f"compute_scores: cannot key the score cache by the state of a {type(value).__qualname__} (a scoring "
            "method's object); give its class a fingerprint() method returning a string that changes when its "
            "scores would, or pass cache_dir=None."
        )
    return f"{type(value).__module__}.{type(value).__qualname__}({_object_key(dict(state))})"


def _data_key(value: Any) -> str:
    """``repr`` for plain data (numbers, strings, bytes, None, and tuples, lists, sets and dicts of them); the type
    for anything else (a module, a function, an object), whose state cannot be keyed reliably."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return repr(value)
    if isinstance(value, tuple | list | frozenset | set):
        items = [_data_key(v) for v in value]
        return f"{type(value).__name__}({sorted(items) if isinstance(value, frozenset | set) else items})"
    if isinstance(value, dict):
        return f"dict({sorted((_data_key(k), _data_key(v)) for k, v in value.items())})"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _cell_is_set(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


def _code_names(code: CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _code_names(const)
    return names


def _feed_code(digest: Any, code: CodeType) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, CodeType):
            _feed_code(digest, const)
        else:
            digest.update(repr(const).encode())


def _qualname(scorer: Any) -> str:
    return getattr(scorer, "__qualname__", None) or type(scorer).__qualname__
