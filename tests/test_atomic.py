"""Atomic writes: readable permissions, nothing half-written, the previous files kept on failure."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_peft._atomic import save_torch, write_dir, write_files


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


SAVER = """
import sys, torch
from lightning_peft._atomic import save_torch
save_torch({"weights": torch.ones(int(sys.argv[2]))}, sys.argv[1])
"""


def _kill_while_writing(target: Path, numel: int) -> None:
    """Start a process that saves (as `AtomicCheckpointIO` does) ``numel`` floats to ``target`` and SIGKILL it once it has begun writing."""
    before = target.stat()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(target), str(numel)], env=env)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and saver.poll() is None:
            others = [p for p in target.parent.iterdir() if p != target]
            changed = target.stat().st_mtime_ns != before.st_mtime_ns or target.stat().st_size != before.st_size
            if changed or any(p.stat().st_size > 0 for p in others):
                break
            time.sleep(0.001)
        assert saver.poll() is None, "the saver finished before it could be killed; save more"
        os.kill(saver.pid, signal.SIGKILL)
    finally:
        saver.kill()
        saver.wait()  # reaped: its pid is no longer alive


def test_a_kill_while_saving_keeps_the_previous_file_and_the_next_save_cleans_up(tmp_path):
    target = tmp_path / "last.ckpt"
    save_torch({"weights": torch.arange(10.0)}, target)
    before = target.read_bytes()

    _kill_while_writing(target, 2**25)  # 128 MiB: writing takes a while

    assert target.read_bytes() == before
    (left,) = [p for p in tmp_path.iterdir() if p != target]  # the killed writer's temporary
    assert left.name.startswith(".last.ckpt.tmp-")
    save_torch({"weights": torch.arange(3.0)}, tmp_path / "epoch=1.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["epoch=1.ckpt", "last.ckpt"]  # its writer is gone: removed
