"""Atomic writes: readable permissions, nothing half-written, the previous files kept on failure."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lightning_peft._atomic import write_dir, write_files


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_get_umask_permissions_not_owner_only(tmp_path, umask_022):
    write_files({tmp_path / "a.json": lambda p: Path(p).write_text("{}"), tmp_path / "b.bin": lambda p: Path(p).write_bytes(b"x")})
    assert (tmp_path / "a.json").read_text() == "{}" and mode(tmp_path / "a.json") == 0o644
    assert mode(tmp_path / "b.bin") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin"]


def test_a_failing_writer_leaves_every_previous_file(tmp_path):
    (tmp_path / "a.json").write_text("old a")
    (tmp_path / "b.bin").write_text("old b")

    def fail(path):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_files({tmp_path / "a.json": lambda p: Path(p).write_text("new a"), tmp_path / "b.bin": fail})
    assert (tmp_path / "a.json").read_text() == "old a"  # not renamed: the other file failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin"]


def test_directory_swap_permissions_and_failure(tmp_path, umask_022):
    final = tmp_path / "merged"

    def fill(directory: Path, text: str) -> None:
        (directory / "sub").mkdir()
        (directory / "sub" / "model.safetensors").write_text(text)

    write_dir(final, lambda d: fill(d, "v1"))
    assert mode(final) == 0o755 and mode(final / "sub") == 0o755 and mode(final / "sub" / "model.safetensors") == 0o644
    write_dir(final, lambda d: fill(d, "v2"))
    assert (final / "sub" / "model.safetensors").read_text() == "v2"

    def broken(directory: Path) -> None:
        (directory / "partial").write_text("half")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        write_dir(final, broken)
    assert (final / "sub" / "model.safetensors").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # no temporary or old directories left
