"""An export of several folders written as one (``merged/`` and ``adapter/`` of ``MergeOnSave``), with a manifest.

Every folder is filled under a temporary name and then swapped in, one after another (`lightning_peft._atomic`):
each name always holds a whole folder, but a kill between two swaps would leave the folders of two exports side by
side. So each folder gets a manifest, ``lightning_peft_export.json``: the export's id, the folders it wrote together
(``parts``), its ``global_step`` and the size of every file. A folder whose manifest names a sibling that holds
another export is refused where it is loaded (`check_export`), and the next export into the same directory first
completes the interrupted one from the folders the killed writer left under their temporary names
(`recover_export`), then removes what is left of them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_peft._atomic import TEMPORARY, clean_stale, stale, swap, write_dirs

MANIFEST = "lightning_peft_export.json"


def write_export(directory: Path, writers: dict[str, Callable[[Path], object]], **record: Any) -> dict[str, Path]:
    """Write ``directory/<part>`` for every ``part -> writer(folder)`` as one export; returns the final paths.

    ``record`` (e.g. ``global_step``) goes into every part's manifest.
    """
    directory.mkdir(parents=True, exist_ok=True)
    recover_export(directory)
    export = f"{time.time_ns()}-{os.getpid()}"
    head = {"export": export, "parts": sorted(writers), **record}

    def part(write: Callable[[Path], object]) -> Callable[[Path], None]:
        def filled(folder: Path) -> None:
            write(folder)
            files = {p.relative_to(folder).as_posix(): p.stat().st_size
                     for p in sorted(folder.rglob("*")) if p.is_file()}
            (folder / MANIFEST).write_text(json.dumps({**head, "files": files}, indent=1) + "\n")
        return filled

    paths = {name: directory / name for name in writers}
    write_dirs({paths[name]: part(write) for name, write in writers.items()})
    return paths


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of ``folder`` (None: no folder, no manifest, or one that is not ours)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and isinstance(manifest.get("export"), str) and isinstance(manifest.get("parts"), list)
    return manifest if ok else None


def _whole(folder: Path, manifest: dict[str, Any]) -> bool:
    files = manifest.get("files")
    return isinstance(files, dict) and all(
        (folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items())


def recover_export(directory: str | os.PathLike) -> None:
    """Complete an export a kill interrupted between its swaps, then remove the stale temporaries in ``directory``.

    The newest export that one of the final folders holds is completed from the whole folders left under
    temporary names by a writer that is gone (else the one before it, and so on); an export that no final folder
    holds was never put in place and is dropped with the other temporaries.
    """
    directory = Path(directory)
    finals, spare, parts = _whole_folders(directory)
    for export in sorted(set(finals.values()), key=lambda e: int(e.split("-")[0]), reverse=True):
        missing = [name for name in parts[export] if finals.get(name) != export]
        if all(name in spare.get(export, {}) for name in missing):
            for name in missing:
                swap(spare[export][name], directory / name)
            break
    clean_stale(directory)


def _whole_folders(directory: Path) -> tuple[dict[str, str], dict[str, dict[str, Path]], dict[str, list[str]]]:
    """``(part -> export id under its final name, export id -> part -> a whole folder of it under a stale
    temporary name, export id -> its parts)``."""
    finals: dict[str, str] = {}
    spare: dict[str, dict[str, Path]] = {}
    parts: dict[str, list[str]] = {}
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        temporary = TEMPORARY.match(path.name)
        manifest = None if path.is_symlink() or (temporary and not stale(path)) else read_manifest(path)
        name = temporary["name"] if temporary else path.name
        if manifest is None or name not in manifest["parts"] or not _whole(path, manifest):
            continue
        parts[manifest["export"]] = manifest["parts"]
        if temporary:
            spare.setdefault(manifest["export"], {}).setdefault(name, path)
        else:
            finals[name] = manifest["export"]
    return finals, spare, parts


def check_export(folder: str | os.PathLike, who: str) -> None:
    """Refuse ``folder`` if its manifest names a sibling folder that holds another export (see the module docstring).

    A folder without a manifest (not written by `write_export`) and a sibling that is missing are accepted.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return
    for name in manifest["parts"]:
        sibling = folder.parent / name
        other = read_manifest(sibling) if name != folder.name else manifest
        if sibling.is_dir() and (other is None or other["export"] != manifest["export"]):
            step = lambda m: "without a manifest" if m is None else f"export {m['export']} (global step {m.get('global_step')})"
            raise RuntimeError(
                f"{who}({str(folder)!r}): this folder is {step(manifest)} but its sibling {name}/ is {step(other)}: "
                "an export was interrupted between writing the two. Call lightning_peft.peft.recover_export"
                f"({str(folder.parent)!r}) (MergeOnSave does it before its next export) to complete it, then load again."
            )
