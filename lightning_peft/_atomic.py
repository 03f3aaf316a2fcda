"""Atomic file and directory writes: fill a temporary name in the target folder, then rename it into place.

A failure part-way leaves the previous files as they were and no temporary debris; a kill part-way leaves the
previous files as they were and a temporary that the next write into that folder removes (`clean_stale`). The
temporary is in the target folder, so the rename never crosses filesystems (a cross-filesystem "move" is a copy that
truncates the target first). Files are flushed to disk (``fsync``) before the rename. Files and directories end up
with the usual permissions (``0o666`` / ``0o777`` less the umask), not the owner-only permissions that `tempfile`
gives, so an exported model can be read by the process that serves it.

Temporary names say whose they are: ``.<name>.<tmp|new|old>-<host>-<pid>-<random>``. One is stale, and removed,
when its writer (that pid on this host) is no longer running, or when nothing was written to it for `STALE_AFTER`
seconds (a writer on another host sharing the folder).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import socket
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

STALE_AFTER = 3600.0
HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|new|old)-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[a-z0-9_]+$")
# what earlier versions named their temporaries: ".<name>.<8 random>[.tmp]", ".<name>.old-<pid>"
LEGACY = re.compile(r"^\.(?P<name>.+)\.(?:old-(?P<pid>\d+)|[a-z0-9_]{8}\.tmp|(?P<dir>[a-z0-9_]{8}))$")


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


def temporary_prefix(name: str, kind: str = "tmp") -> str:
    """The prefix of this process's temporary names for ``name`` (`tempfile` appends a random part)."""
    return f".{name}.{kind}-{HOST}-{os.getpid()}-"


def write_files(writers: dict[Path, Callable[[str], object]]) -> None:
    """Write every file under a temporary name first, then rename them all into place.

    Args:
        writers: Final path -> function that writes the given temporary path.
    """
    for folder in {path.parent for path in writers}:
        clean_stale(folder)
    temporary: dict[Path, str] = {}
    try:
        for path, write in writers.items():
            fd, temporary[path] = tempfile.mkstemp(prefix=temporary_prefix(path.name), dir=path.parent)
            os.close(fd)
            write(temporary[path])
            os.chmod(temporary[path], 0o666 & ~_umask())
            _fsync(temporary[path])
        for path, tmp in temporary.items():
            os.replace(tmp, path)
        for folder in {path.parent for path in writers}:
            _fsync(folder)
    except BaseException:
        for tmp in temporary.values():
            Path(tmp).unlink(missing_ok=True)
        raise


def save_torch(obj: object, path: Path, who: str = "save") -> None:
    """``torch.save(obj, path)`` as one step (`write_files`). A failed write (a full disk) raises its ``OSError``
    naming ``path``, not torch's ``unexpected pos`` message."""
    import torch

    def save(temporary: str) -> None:
        with open(temporary, "wb") as file:
            try:
                torch.save(obj, file)
            except RuntimeError as err:
                cause = err.__context__
                if not isinstance(cause, OSError):
                    raise
                raise OSError(cause.errno, f"{who}: writing {path} failed: {cause.strerror}; the file there before "
                              "is kept") from err

    write_files({Path(path): save})


def write_dir(final: Path, write: Callable[[Path], object]) -> None:
    """Fill a temporary sibling directory with ``write(tmp_dir)``, then swap it in for ``final``."""
    write_dirs({final: write})


def write_dirs(writers: dict[Path, Callable[[Path], object]]) -> None:
    """Fill a temporary sibling directory for every final directory, then swap them in one after another.

    Each directory is replaced in one step (``renameat2(RENAME_EXCHANGE)`` where the filesystem has it), so its
    final name always holds a whole directory. The set is not one step: a kill between two swaps leaves the
    later directories' new contents in their temporaries (see `lightning_peft._manifest` for how a pair is
    completed).
    """
    made: dict[Path, Path] = {}
    try:
        for final in writers:
            refuse_link(final, "write_dir")
            final.parent.mkdir(parents=True, exist_ok=True)
        for folder in {final.parent for final in writers}:  # the pair of an export shares one folder
            clean_stale(folder)
        for final, write in writers.items():
            made[final] = Path(tempfile.mkdtemp(prefix=temporary_prefix(final.name, "new"), dir=final.parent))
            write(made[final])
            finish_dir(made[final])
        for final, tmp in made.items():
            swap(tmp, final)
    except BaseException:
        for tmp in made.values():
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def refuse_link(final: Path, who: str) -> None:
    """A rename replaces a symbolic link itself, not the folder it points to: refuse one (and a plain file)."""
    if final.is_symlink():
        raise ValueError(f"{who}: {final} is a symbolic link (to {os.readlink(final)}); an atomic write replaces the "
                         "link, not what it points to. Write to the real folder, or remove the link.")
    if final.exists() and not final.is_dir():
        raise ValueError(f"{who}: {final} is a file, not a folder; remove it or write elsewhere.")


def finish_dir(directory: Path) -> None:
    """Give a filled temporary directory the usual permissions and flush it to disk."""
    mask = _umask()
    os.chmod(directory, 0o777 & ~mask)
    for path in directory.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
        _fsync(path)
    _fsync(directory)


def swap(new: Path, final: Path) -> None:
    """Put directory ``new`` at ``final`` and remove the previous ``final``; ``final`` never lacks a whole directory
    where the filesystem can exchange two names, else only between two renames (`restore_moved` puts it back).
    A file or a symbolic link at ``final`` is replaced, not followed (as Lightning replaces a file by a folder
    checkpoint)."""
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        final.unlink()  # a rename cannot put a folder over a file or a link in one step
    if not final.exists():
        os.replace(new, final)
    elif exchange(new, final):  # ``new`` holds the previous directory now
        shutil.rmtree(new)
    else:
        old = Path(tempfile.mkdtemp(prefix=temporary_prefix(final.name, "old"), dir=final.parent))
        os.replace(final, old)  # replaces the empty directory just made
        try:
            os.replace(new, final)
        except BaseException:
            os.replace(old, final)
            raise
        shutil.rmtree(old)
    _fsync(final.parent)


_RENAMEAT2: list = []


def exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system or the
    filesystem cannot."""
    if not _RENAMEAT2:
        try:
            _RENAMEAT2.append(getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None))
        except OSError:
            _RENAMEAT2.append(None)
    renameat2 = _RENAMEAT2[0]
    if renameat2 is None:
        return False
    at_cwd, rename_exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def _fsync(path: str | Path) -> None:
    """Flush a file's data (or a directory's entries) to disk, where the system allows opening it for that."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (a process we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _last_write(path: Path) -> float:
    times = [path.lstat().st_mtime]
    if path.is_dir() and not path.is_symlink():
        times += [p.lstat().st_mtime for p in path.rglob("*")]
    return max(times)


def stale(path: Path) -> bool:
    """Whether ``path`` is a temporary of ours whose writer is gone (see the module docstring)."""
    ours, legacy = TEMPORARY.match(path.name), LEGACY.match(path.name)
    if not (ours or legacy) or (legacy and legacy["dir"] and not path.is_dir()):
        return False
    if ours and ours["host"] == HOST:
        return not alive(int(ours["pid"]))
    if legacy and legacy["pid"]:
        return not alive(int(legacy["pid"]))
    try:
        return time.time() - _last_write(path) > STALE_AFTER
    except FileNotFoundError:  # its writer renamed or removed it meanwhile
        return False


def clean_stale(folder: Path) -> list[Path]:
    """Remove the stale temporaries of ours in ``folder`` (not below it); first put back a directory that a kill
    between the two renames of `swap` left only under its temporary name (`restore_moved`). Returns what was
    removed."""
    try:
        entries = sorted(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for path in entries:
        if not stale(path) or restore_moved(path):
            continue
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            removed.append(path)
    return removed


def restore_moved(path: Path) -> bool:
    """If ``path`` is the previous directory that `swap` had moved aside and its final name is empty, put it back."""
    ours, legacy = TEMPORARY.match(path.name), LEGACY.match(path.name)
    moved = ours if ours and ours["kind"] == "old" else legacy if legacy and legacy["pid"] else None
    final = path.with_name(moved["name"]) if moved else None
    if final is None or final.exists() or final.is_symlink() or not path.is_dir():
        return False
    os.replace(path, final)
    return True
