"""The weights of a torch distributed checkpoint (``.metadata`` + ``.distcp`` files), read without running its code.

torch's reader unpickles ``.metadata`` with plain ``pickle`` and every non-tensor entry with
``torch.load(weights_only=False)`` (``DefaultLoadPlanner.load_bytes``); its tensors it reads with ``weights_only=True``.
Unless trusted, `_Reader` reads ``.metadata`` with an unpickler that allows exactly the classes torch writes there
(module and name, so a name reached through an allowed module, ``torch.distributed.checkpoint.metadata`` + ``os.system``,
is refused), checks that every data file it names is a plain file of the directory, and `_Planner` reads the non-tensor
entries with ``weights_only=True``. Only the ``state_dict`` entries are read (the optimizer's are not converted).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_peft._checkpoint_files import FIX, UNREADABLE, inside, refused, untrusted

_WHO = "convert_checkpoint"
_METADATA_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
    # dtypes and memory formats: the objects themselves, looked up by exact name
    *(("torch", name) for name, value in vars(torch).items()
      if isinstance(value, (torch.dtype, torch.memory_format))),
}


class _Refused(pickle.UnpicklingError):
    """A global that `_MetadataUnpickler` does not allow."""


class _MetadataUnpickler(pickle.Unpickler):
    """Reads ``.metadata`` allowing only the (module, name) pairs of `_METADATA_CLASSES`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        raise _Refused(f"GLOBAL {module}.{name}")


def read_metadata(file: Path, directory: Path) -> Metadata:
    """``file`` (a ``.metadata``) read with `_MetadataUnpickler`; every data file it names checked to be a plain
    file of ``directory``."""
    try:
        with file.open("rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except _Refused as error:
        raise untrusted(_WHO, file, f"objects a distributed checkpoint's metadata does not ({refused(error)})") from None
    except UNREADABLE as error:  # empty, truncated, or not a pickle
        metadata = error
    if not isinstance(metadata, Metadata):
        what = f"{type(metadata).__name__}: {metadata}" if isinstance(metadata, BaseException) else \
            f"it holds a {type(metadata).__name__}"
        raise ValueError(f"{_WHO}: {str(file)!r} is empty, truncated or not a distributed checkpoint's metadata "
                         f"({what[:200]}). {FIX}")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise ValueError(f"{_WHO}: {str(file)!r} names the data file {name!r}, which is not a file name in "
                             f"{str(directory)!r}; a distributed checkpoint keeps its data files beside it.")
        inside(directory, directory / name, _WHO, trust=False)
    return metadata


class _Reader(FileSystemReader):
    """torch's file reader, given the ``.metadata`` that `read_metadata` read (torch's loader would take a failure to
    read it as a reason to look for another file)."""

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__(directory)
        if metadata.storage_meta is None:  # as torch's reader completes it
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata


class _Planner(_EmptyStateDictLoadPlanner):
    """Rebuilds the ``state_dict`` entries, reading a non-tensor entry with ``torch.load(weights_only=True)``."""

    def __init__(self, directory: Path) -> None:
        super().__init__(keys=["state_dict"])
        self.directory = directory
        self.refusal: ValueError | None = None  # torch's loader wraps what load_bytes raises

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            entry = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            name = self.metadata.storage_data[read_item.storage_index].relative_path
            self.refusal = untrusted(_WHO, self.directory / name, f"the entry {key!r}, an object that torch.load("
                                                                  f"weights_only=True) does not read ({refused(error)})")
            raise self.refusal from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes puts it
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[key], entry)
        else:
            self.state_dict[key] = entry


def distributed_weights(directory: Path, trust: bool) -> dict[str, Any]:
    """The ``state_dict`` entries of the distributed checkpoint ``directory`` (one process, no process group)."""
    loaded: dict[str, Any] = {}
    if trust:
        reader, planner = FileSystemReader(directory), _EmptyStateDictLoadPlanner(keys=["state_dict"])
    else:
        reader = _Reader(directory, read_metadata(inside(directory, directory / ".metadata", _WHO, trust), directory))
        planner = _Planner(directory)
    try:
        _load_state_dict(loaded, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException:  # what torch's loader makes of any error in a step (a BaseException)
        if getattr(planner, "refusal", None) is not None:
            raise planner.refusal from None
        raise
    return loaded["state_dict"]
