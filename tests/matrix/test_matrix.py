"""The compatibility matrix: every callback under every strategy equals the one-process run or is refused at setup.

``matrix_script.py`` (the job ``matrix`` of the session's 2-rank launch, ``tests/_two_ranks.py``) trains every row under every 2-process column (and the resume
check per strategy family); the one-process columns run here. Then each cell is compared with the reference, and
``docs/compatibility.md`` must be what ``page.py`` writes from the outcomes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("deepspeed")

from tests.matrix import cells, page  # noqa: E402
from tests.matrix.cells import COLUMNS, REFERENCE, ROWS, Column, Row, cell_dir  # noqa: E402

TOLERANCES = {"default": 1e-5, "tensor parallel": 5e-5}  # the strategy tests' bars (TP with AdamW: 5e-5)


@pytest.fixture(scope="module")
def runs(two_ranks) -> Path:
    out = two_ranks.path("matrix")  # matrix_script.py on 2 ranks (tests/_two_ranks.py); the one-process cells here
    for column in (c for c in COLUMNS if c.devices == 1):
        for row in ROWS:
            cells.run_cell(out, row, column)
    pipeline = next(c for c in COLUMNS if c.name == "pipeline")
    for row in ROWS:  # the reference on the pipeline's model
        if cells.model_kind(row, pipeline) != row.kind:
            cells.run_cell(out, row, REFERENCE, kind=cells.model_kind(row, pipeline))
    torch.manual_seed(0)
    cells.run_resume(out, REFERENCE)
    return out


def result(out: Path, row: Row, column: Column) -> dict:
    return json.loads((cell_dir(out, row, column) / "result.json").read_text())


def exported(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file of an export, by relative file path and key."""
    tensors = {}
    for path in sorted(directory.rglob("*.safetensors")):
        for key, value in load_file(path).items():
            tensors[f"{path.relative_to(directory)}:{key}"] = value
    return tensors


def difference(out: Path, row: Row, column: Column) -> str | None:
    """None when the cell equals the reference; else what differs."""
    got, want = result(out, row, column), json.loads(
        (cell_dir(out, row, REFERENCE, kind=cells.model_kind(row, column)) / "result.json").read_text())
    tolerance = TOLERANCES.get(column.name, TOLERANCES["default"])
    if want["outcome"] != "trained":
        return f"the reference did not train: {want.get('error')}"
    if got["steps"] != want["steps"]:
        return f"{got['steps']} optimizer steps, the reference took {want['steps']}"
    for name, value in want["metrics"].items():
        if abs(got["metrics"].get(name, float("nan")) - value) > tolerance:
            return f"{name} = {got['metrics'].get(name)}, the reference {value}"
    mine = exported(cell_dir(out, row, column) / "export")
    theirs = exported(cell_dir(out, row, REFERENCE, kind=got["kind"]) / "export")
    if not theirs:
        return "the reference exported nothing"
    if sorted(mine) != sorted(theirs):
        return f"exported {sorted(mine)}, the reference {sorted(theirs)}"
    for key, value in theirs.items():
        gap = (mine[key].double() - value.double()).abs().max().item()
        if not gap <= tolerance:
            return f"{key} is {gap:.2e} away from the reference's"
    return None


def outcome(out: Path, row: Row, column: Column) -> dict:
    cell = result(out, row, column)
    if cell["outcome"] == "refused":
        return {"outcome": "refused", "reason": cell["error"]}
    if cell["outcome"] == "failed":
        return {"outcome": "failed", "reason": cell["traceback"]}
    if column is REFERENCE:
        return {"outcome": "equal"}
    gap = difference(out, row, column)
    return {"outcome": "equal"} if gap is None else {"outcome": "differs", "reason": gap}


def resumed_equals_straight(out: Path, column: Column) -> bool:
    here = out / "resume" / cells._slug(column.name)
    straight, resumed = exported(here / "straight"), exported(here / "resumed")
    return bool(straight) and sorted(straight) == sorted(resumed) and all(
        torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.fixture(scope="module")
def outcomes(runs: Path) -> dict:
    table = {row.name: {column.name: outcome(runs, row, column) for column in COLUMNS} for row in ROWS}
    table["resume"] = {c.name: resumed_equals_straight(runs, c) for c in COLUMNS if c.family}
    if os.environ.get("MATRIX_RESULTS"):
        Path(os.environ["MATRIX_RESULTS"]).write_text(json.dumps({"results": table, "tolerances": TOLERANCES}))
    return table


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("column", [c.name for c in COLUMNS])
def test_every_cell_equals_the_reference_or_is_refused_at_setup(outcomes: dict, column: str) -> None:
    wrong = {row: cell for row, cells_ in outcomes.items() if row != "resume"
             for name, cell in cells_.items() if name == column and cell["outcome"] not in ("equal", "refused")}
    assert not wrong, json.dumps(wrong, indent=1)[:6000]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_training_dynamics_row_trains_something_else_than_lora_alone(runs: Path) -> None:
    """Equal to the reference proves nothing if the callback does nothing: each row's reference must differ from
    the LoRA row's (noise that adds nothing, say, would equal it). A row that only saves memory (activation
    checkpointing) must instead equal it, bit for bit."""
    lora = ROWS[0]
    for row in ROWS:
        if not isinstance(row.callbacks(row.kind)[0], cells.LoRA) or row.name in (lora.name, "MergeOnSave") or row.fused:
            continue
        if row.kind not in (lora.kind, "encoder"):  # a LoRA target on a model of its own: nothing to compare with
            continue
        mine = exported(cell_dir(runs, row, REFERENCE) / "export")
        plain = exported(cell_dir(runs, lora, REFERENCE, kind=row.kind) / "export")
        if not row.changes_training:
            assert mine.keys() == plain.keys() and all(torch.equal(mine[k], plain[k]) for k in plain), row.name
            continue
        assert mine.keys() != plain.keys() or any(not torch.equal(mine[k], plain[k]) for k in plain), row.name


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_resumed_all_in_one_run_equals_the_straight_one_with_dropout_on(outcomes: dict) -> None:
    assert all(outcomes["resume"].values()), outcomes["resume"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_compatibility_page_is_what_the_outcomes_write(outcomes: dict) -> None:
    expected = page.write(outcomes, TOLERANCES)
    assert page.PAGE.read_text() == expected, (
        "docs/compatibility.md is not what the matrix gives: rerun with MATRIX_RESULTS=/tmp/m.json and "
        "`python -m tests.matrix.page /tmp/m.json`, and check the change."
    )


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_readme_says_per_strategy_what_the_matrix_refuses(outcomes: dict) -> None:
    block = page.README.read_text().split(page.START, 1)[1].split(page.END, 1)[0]
    assert block == "\n".join(page.summary(outcomes)) + "\n"
