"""Timing helpers shared by the benchmarks (no heavy imports): contenders alternating, medians, ratio rows."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable


def alternate(
    contenders: dict[str, Callable[[], None]], repeats: int, steps: int, warmup: int
) -> dict[str, list[float]]:
    """Milliseconds per call of each contender, one entry per repeat; the order rotates every repeat."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            fn = contenders[name]
            gc.collect()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - start) * 1000 / steps)
    return times


def row(measurement: str, ours: list[float], baseline: list[float], goal: float | None) -> dict:
    """A table row: ratio of the medians, plus the median of the per-repeat (paired) ratios."""
    ours_ms, base_ms = statistics.median(ours), statistics.median(baseline)
    ratio = ours_ms / base_ms
    return {
        "measurement": measurement,
        "ours": ours_ms,
        "baseline": base_ms,
        "ratio": ratio,
        "paired_ratio": statistics.median(a / b for a, b in zip(ours, baseline, strict=True)),
        "goal": goal,
        "met": None if goal is None else ratio <= goal,
        "ours_range": [min(ours), max(ours)],
        "baseline_range": [min(baseline), max(baseline)],
    }
