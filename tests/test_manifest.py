"""An export of two folders: a kill at any point leaves the previous export or, once completed, the new one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_peft._manifest import MANIFEST, check_export, write_export
from lightning_peft.peft import recover_export

ROOT = Path(__file__).resolve().parents[1]

# Writes export "new" into argv[1]; at argv[2] ("writing": inside the adapter's writer, "between": after the first
# folder is swapped in) it touches argv[3] and waits to be killed.
EXPORTER = """
import sys, time
from pathlib import Path
from lightning_peft import _atomic
from lightning_peft._manifest import write_export

directory, stage, ready = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
swap = _atomic.swap

def wait():
    ready.touch()
    time.sleep(60)

def paused_swap(new, final):
    swap(new, final)
    if stage == "between":
        wait()

def adapter(folder):
    (folder / "adapter_model.safetensors").write_text("adapter new")
    if stage == "writing":
        wait()

_atomic.swap = paused_swap
write_export(directory, {"merged": lambda f: (f / "model.safetensors").write_text("merged new"), "adapter": adapter},
             global_step=2)
"""


def _export(directory: Path, tag: str, step: int) -> None:
    write_export(directory, {"merged": lambda f: (f / "model.safetensors").write_text(f"merged {tag}"),
                             "adapter": lambda f: (f / "adapter_model.safetensors").write_text(f"adapter {tag}")},
                 global_step=step)


def _contents(directory: Path) -> tuple[str, str]:
    return ((directory / "merged" / "model.safetensors").read_text(),
            (directory / "adapter" / "adapter_model.safetensors").read_text())


def _kill_at(directory: Path, stage: str, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", EXPORTER, str(directory), stage, str(ready)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert ready.exists(), f"the exporter did not reach {stage!r} (exit code {child.poll()})"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()


def test_both_folders_name_the_same_export(tmp_path):
    _export(tmp_path, "old", 1)
    merged, adapter = (json.loads((tmp_path / part / MANIFEST).read_text()) for part in ("merged", "adapter"))
    assert merged["export"] == adapter["export"] and merged["global_step"] == 1
    assert merged["parts"] == ["adapter", "merged"] and merged["files"] == {"model.safetensors": len("merged old")}
    assert sorted(os.listdir(tmp_path)) == ["adapter", "merged"]


def test_a_kill_while_writing_leaves_the_previous_export_and_the_next_one_cleans_up(tmp_path):
    directory = tmp_path / "out"
    _export(directory, "old", 1)

    _kill_at(directory, "writing", tmp_path)

    assert _contents(directory) == ("merged old", "adapter old")
    check_export(directory / "adapter", "load_adapter")
    assert len(os.listdir(directory)) == 4  # and the killed writer's two temporary folders
    _export(directory, "next", 3)
    assert _contents(directory) == ("merged next", "adapter next")
    assert sorted(os.listdir(directory)) == ["adapter", "merged"]


def test_a_kill_between_the_two_folders_is_refused_on_load_and_completed_by_recovery(tmp_path):
    directory = tmp_path / "out"
    _export(directory, "old", 1)

    _kill_at(directory, "between", tmp_path)

    assert _contents(directory) == ("merged new", "adapter old")  # the two halves of two exports
    with pytest.raises(RuntimeError, match=r"load_adapter\('.*adapter'\): this folder is export \d+-\d+ \(global step 1\) "
                                           r"but its sibling merged/ is export \d+-\d+ \(global step 2\): an export was "
                                           r"interrupted .* lightning_peft\.peft\.recover_export"):
        check_export(directory / "adapter", "load_adapter")
    recover_export(directory)
    assert _contents(directory) == ("merged new", "adapter new")
    assert sorted(os.listdir(directory)) == ["adapter", "merged"]
    check_export(directory / "adapter", "load_adapter")


def test_a_previous_folder_moved_aside_by_a_killed_writer_is_put_back(tmp_path):
    _export(tmp_path, "old", 1)
    os.replace(tmp_path / "merged", tmp_path / ".merged.old-999999999")  # what the earlier two-rename swap left

    recover_export(tmp_path)

    assert _contents(tmp_path) == ("merged old", "adapter old")
    assert sorted(os.listdir(tmp_path)) == ["adapter", "merged"]
