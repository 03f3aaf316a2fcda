"""Printing and writing a benchmark's report: every line printed is kept for ``--txt``, the numbers go to ``--json``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

LINES: list[str] = []


def say(text: str = "") -> None:
    """Print a line and keep it for ``--txt``."""
    print(text, flush=True)
    LINES.append(text)


def machine() -> dict[str, Any]:
    """What the numbers depend on: the CPU (model, instruction level, native bf16 or not), the threads, versions."""
    import platform

    import torch

    from lightning_peft._hardware import cpu_bf16_is_native

    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": cpu_bf16_is_native(), "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version()}


def say_machine() -> dict[str, Any]:
    """Print (and keep for ``--txt``) one line on the machine, at the top of a run; returns `machine`'s dict."""
    m = machine()
    say(f"machine: {m['cpu']}, CPU capability {m['cpu_capability']}, native bf16 {'yes' if m['native_bf16'] else 'no'}"
        f", {m['threads']} torch threads of {m['cpus']} CPUs; torch {m['torch']}, python {m['python']}")
    return m


def say_table(title: str, rows: list[dict], columns: tuple[str, str] = ("ours (ms)", "baseline (ms)")) -> None:
    """Print (and keep for ``--txt``) `_timing.row` rows as a markdown table: both times, the ratio, goal, met."""
    say(f"\n### {title}\n")
    say(f"| measurement | {columns[0]} | {columns[1]} | ratio | goal | met? |")
    say("| --- | ---: | ---: | ---: | ---: | :---: |")
    for r in rows:
        met = "—" if r["met"] is None else ("yes" if r["met"] else "NO")
        goal = "—" if r["goal"] is None else f"≤ {r['goal']:.2f}"
        say(f"| {r['measurement']} | {r['ours']:.2f} | {r['baseline']:.2f} | {r['ratio']:.3f} | {goal} | {met} |")


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


def output_arguments(parser: Any) -> None:
    """The flags every benchmark writes its results with: ``--json``, ``--txt``, ``--plot``."""
    parser.add_argument("--json", default=None, help="write the numbers here")
    parser.add_argument("--txt", default=None, help="write the printed tables here")
    parser.add_argument("--plot", default=None, help="write the figure here (PNG)")


def save_figure(fig: Any, path: str) -> None:
    """Lay out and write a matplotlib figure (120 dpi), creating its folder, and say where."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    say(f"\nwrote {path}")


def finish(report: dict, started: float, json_path: str | None, txt_path: str | None) -> dict:
    """Record and print the run's wall time since ``started`` (``time.perf_counter``), write the results, return
    ``report``."""
    report["seconds"] = time.perf_counter() - started
    say(f"\nwhole run: {report['seconds']:.0f} s")
    write_results(json_path, txt_path, report)
    return report
