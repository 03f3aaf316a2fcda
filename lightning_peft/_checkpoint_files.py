"""Reading the files of a checkpoint someone else wrote: one place that knows what can go wrong with a file and says so.

`read_file` is ``torch.load`` on the CPU, restricted to ``weights_only=True`` (plus an exact list of classes) unless
the caller trusts the file, and it turns what torch raises into a message that names the file and the cause: empty,
truncated, not a checkpoint, or holding objects that could run code (then pointing to ``trust=True``).
`check_file` is the cheap part of that (empty, truncated) for a file that another reader will load.
`inside` keeps a read within the checkpoint's directory.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# How each reader is told to trust a file (the message names the caller's own switch).
_TRUST = {"consolidate_checkpoint": "consolidate_checkpoint(..., weights_only=False)"}
FIX = "Save the checkpoint again, or use another one."
# What torch.load raises on bytes that are not the checkpoint it expects (a torn or foreign file).
UNREADABLE = (RuntimeError, EOFError, pickle.UnpicklingError, KeyError, ValueError, IndexError, TypeError,
              AttributeError, UnicodeDecodeError)


def trust_hint(who: str) -> str:
    """How the caller ``who`` reads a checkpoint unrestricted."""
    switch = _TRUST.get(who, "convert_checkpoint(..., trust=True) (--trust on the command line)")
    return f"if you trust where this checkpoint comes from, pass {switch}."


def untrusted(who: str, file: Path, what: str) -> ValueError:
    """The refusal of ``file``, which holds ``what`` (objects a restricted reader does not read)."""
    hint = trust_hint(who)
    return ValueError(f"{who}: {str(file)!r} holds {what}; reading it unrestricted could run code from whoever wrote "
                      f"it. {hint[0].upper()}{hint[1:]}")


def check_file(file: Path, who: str) -> bool:
    """Refuse an empty ``file``, or a zip archive (what ``torch.save`` writes) cut off before its end.

    Returns:
        Whether ``file`` is a zip archive (else it may be ``torch.save``'s legacy format, or no checkpoint at all).

    Raises:
        ValueError: Naming ``file`` and what is wrong with it.
    """
    size = file.stat().st_size
    if size == 0:
        raise ValueError(f"{who}: {str(file)!r} is empty (0 bytes), not a checkpoint: its save was cut off before "
                         f"it wrote anything. {FIX}")
    with file.open("rb") as handle:
        zipped = handle.read(4) == b"PK\x03\x04"
        whole = not zipped or zipfile.is_zipfile(handle)
    if not whole:
        raise ValueError(f"{who}: {str(file)!r} is truncated: a checkpoint of {size} bytes that stops before its end "
                         f"(a save, copy or download cut off part-way). {FIX}")
    return zipped


def read_file(file: Path, who: str, trust: bool, safe_globals: Sequence[type] = ()) -> Any:
    """``torch.load`` of ``file`` on the CPU: ``weights_only`` (allowing exactly ``safe_globals``) unless ``trust``.

    Raises:
        ValueError: If ``file`` is empty, truncated or not a checkpoint, or (unless ``trust``) holds objects that
            ``weights_only`` does not read; the message names the file.
    """
    zipped = check_file(file, who)
    try:
        if trust:
            return torch.load(file, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(file, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as error:
        if not trust and "Weights only load failed" in str(error):
            raise untrusted(who, file, f"objects that torch.load(weights_only=True) does not read ({refused(error)})"
                            ) from None
        raise _not_a_checkpoint(who, file, error) from None
    except UNREADABLE as error:
        raise _not_a_checkpoint(who, file, error) from None


def refused(error: pickle.UnpicklingError) -> str:
    """What a restricted unpickler refused: the global it names, or the first line of its message."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    return found.group(1) if found else _first_line(error)


def _not_a_checkpoint(who: str, file: Path, error: BaseException) -> ValueError:
    return ValueError(f"{who}: {str(file)!r} is not a checkpoint torch.load can read ({type(error).__name__}: "
                      f"{_first_line(error)}). {FIX}")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or ["no message"])[0][:200]


def inside(root: Path, path: Path, who: str, trust: bool) -> Path:
    """``path``, checked (unless ``trust``) to lie inside ``root`` once links are followed.

    Raises:
        ValueError: If ``path`` is a link that leaves ``root``.
    """
    if trust or path.resolve().is_relative_to(root.resolve()):
        return path
    raise ValueError(f"{who}: {str(path)!r} is a link to {os.path.realpath(path)!r}, outside the checkpoint "
                     f"{str(root)!r}; a checkpoint from a stranger must not make us read elsewhere. Copy the file into "
                     f"the checkpoint, or, {trust_hint(who)}")
