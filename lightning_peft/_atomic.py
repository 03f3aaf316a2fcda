"""Atomic file and directory writes: fill a temporary name, then rename it into place.

A failure part-way leaves the previous files as they were and no temporary debris. Files and directories
end up with the usual permissions (``0o666`` / ``0o777`` less the umask), not the owner-only permissions
that `tempfile` gives, so an exported model can be read by the process that serves it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` alone would briefly set it for all threads)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return _UMASK_AT_IMPORT


def _read_umask_at_import() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK_AT_IMPORT = _read_umask_at_import()  # import time: before any writer thread of ours exists


def write_files(writers: dict[Path, Callable[[str], object]]) -> None:
    """Write every file under a temporary name first, then rename them all into place.

    Args:
        writers: Final path -> function that writes the given temporary path.
    """
    temporary: dict[Path, str] = {}
    try:
        for path, write in writers.items():
            fd, temporary[path] = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            write(temporary[path])
            os.chmod(temporary[path], 0o666 & ~_umask())
        for path, tmp in temporary.items():
            os.replace(tmp, path)
    except BaseException:
        for tmp in temporary.values():
            Path(tmp).unlink(missing_ok=True)
        raise


def write_dir(final: Path, write: Callable[[Path], object]) -> None:
    """Fill a temporary sibling directory with ``write(tmp_dir)``, then swap it in for ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        mask = _umask()
        os.chmod(tmp, 0o777 & ~mask)
        for path in tmp.rglob("*"):
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
        _swap(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap(new: Path, final: Path) -> None:
    """Put directory ``new`` at ``final``; if that fails, the previous ``final`` is put back."""
    if not final.exists():
        os.replace(new, final)
        return
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    os.replace(final, old)
    try:
        os.replace(new, final)
    except BaseException:
        os.replace(old, final)
        raise
    shutil.rmtree(old)
