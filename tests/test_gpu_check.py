"""The prepared GPU check (``benchmarks/gpu_check.py``) plans every part on this CPU machine and keeps its promises about
the report: every part present and sized, every measurement null in a dry run, one line per module it cannot import,
and a part that overruns its budget is stopped and reported while the run goes on."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_dry_run_plans_every_part_with_null_measurements_and_says_what_it_cannot_import(gpu_check, tmp_path, capsys):
    report = gpu_check.main(["--dry-run", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == json.loads(json.dumps(report, default=str))
    text = (tmp_path / "gpu_check.md").read_text()

    assert list(report["parts"]) == ["tests", "lora", "qlora", "memory", "attention", "zero", "main"]
    assert report["budget_s"] <= 8 * 60 - 30  # every part at its whole budget, with 30 s for imports and start-ups
    for name, part in report["parts"].items():
        assert part["status"] == "planned", (name, part.get("error_tail"))
        assert part["results"] and all(value is None for value in part["results"].values()), name
        assert f"## {name}: " in text

    plans = {name: part["plan"] for name, part in report["parts"].items()}
    assert {"tests/nn/test_attention.py", "tests/strategies/test_device_map.py",
            "tests/callbacks/test_rng.py"} <= set(plans["tests"]["files"])
    assert "tests/callbacks/test_rng.py::test_cuda_generators_are_saved_and_restored" in plans["tests"]["tests"]
    for name in ("lora", "qlora"):  # a 1B-class decoder at batch 8 x 1024
        assert 1.0e9 < plans[name]["parameters"] < 1.2e9 and plans[name]["batch"] == [8, 1024]
    assert 1.0e9 < plans["memory"]["parameters"] < 1.3e9
    assert list(plans["memory"]["configs"]) == ["lora", "+nf4", "+checkpointing", "+chunked"]
    assert plans["attention"]["lengths"] == [4096, 16384]
    assert "--trainer.precision=bf16-mixed" in plans["main"]["command"]

    missing = [name for name, info in report["imports"].items() if not info["importable"]]
    assert len(report["import_lines"]) == len(missing)
    for name, line in zip(missing, report["import_lines"]):
        assert line.startswith(f"{name}: not importable (") and line in printed and line in text
    if "flash_attn" in missing:  # the CPU machine: part 5 falls back to SDPA's flash backend, and says so
        assert any(line.startswith("flash_attn: not importable (ModuleNotFoundError")
                   and line.endswith("- part 5 uses SDPA's flash backend") for line in report["import_lines"])
        assert plans["attention"]["flash_path"] == "sdpa (flash backend only)"


def test_a_part_over_its_budget_is_stopped_and_reported_and_the_next_part_still_runs(gpu_check, tmp_path):
    report = gpu_check.main(["--parts", "lora,attention", "--budget-scale", "0.0001", "--out", str(tmp_path)])
    for name in ("lora", "attention"):
        part = report["parts"][name]
        assert part["status"] == "timeout" and part["seconds"] < 5
        assert part["error_tail"] == [(f"stopped after its budget of {part['budget_s']:.0f} s; results above are "
                                       "those recorded before")]
        assert all(value is None for value in part["results"].values())
    assert "status **timeout**" in (tmp_path / "gpu_check.md").read_text()


def test_parts_see_what_the_caller_put_on_pythonpath(gpu_check, monkeypatch):
    """On the GPU machine the carried wheels are installed into a folder on PYTHONPATH: every child process (the
    parts, pytest, the main job) must keep it, with the repository first."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert gpu_check.child_env()["PYTHONPATH"].split(":") == [str(gpu_check.ROOT), "/tmp/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert gpu_check.child_env()["PYTHONPATH"] == str(gpu_check.ROOT)
