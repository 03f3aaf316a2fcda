"""Printing and writing a benchmark's report: every line printed is kept for ``--txt``, the numbers go to ``--json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

LINES: list[str] = []


def say(text: str = "") -> None:
    """Print a line and keep it for ``--txt``."""
    print(text, flush=True)
    LINES.append(text)


def write_results(json_path: str | None, txt_path: str | None, report: dict) -> None:
    """Write ``report`` as JSON and the printed lines as text, to the paths given (None: skip)."""
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    if txt_path:
        Path(txt_path).parent.mkdir(parents=True, exist_ok=True)
        Path(txt_path).write_text("\n".join(LINES) + "\n")


def exit_worker() -> None:
    """Ends a multi-process worker whose work (and teardown) is done: gloo's worker threads can abort interpreter
    finalisation after a passing run (exit 134, "terminate called without an active exception"), so it skips it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
