"""Run on 2 ranks by ``tests/matrix/test_matrix.py``: every row of the matrix under every 2-process column, then
the resume check of the all-in-one cell per strategy family, in one process group (a launch costs more than a
tiny fit).

Usage: ``python matrix_script.py OUT [COLUMN ...]`` on each rank, with MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK
and LOCAL_RANK set as torchrun sets them. Each cell writes ``OUT/<row>/<column>/<model>/result.json``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tests.matrix.cells import COLUMNS, ROWS, run_cell, run_resume  # noqa: E402
from tests.strategies._launch import exit_worker  # noqa: E402


def main(out: Path, names: list[str]) -> None:
    columns = [c for c in COLUMNS if c.devices == 2 and (not names or c.name in names)]
    rows = os.environ.get("MATRIX_ROWS")  # for a rerun of some cells by hand: "LoRA;Curriculum"
    kind = os.environ.get("MATRIX_KIND") or None
    for column in columns:
        for row in ROWS if not rows else [r for r in ROWS if r.name in rows.split(";")]:
            start = time.perf_counter()
            result = run_cell(out, row, column, kind=kind)
            print(f"[matrix] {column.name} | {row.name}: {result['outcome']} in {time.perf_counter() - start:.1f} s",
                  flush=True)
        if column.family and not rows:
            run_resume(out, column)
            print(f"[matrix] {column.name} | resume done", flush=True)


def run(out: Path) -> None:
    """The job ``matrix`` of ``tests/_two_ranks.py``: every 2-process column."""
    main(out, [])


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    exit_worker()
