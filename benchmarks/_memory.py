"""Peak-memory helpers shared by the benchmarks: the kernel's resident-set counters of this process (Linux)."""

from __future__ import annotations


def rss_kb() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in KiB.

    The peak is the kernel's per-address-space high-water mark (``VmHWM``), the counter behind
    ``ru_maxrss``. ``ru_maxrss`` itself is not read: after ``exec`` it is floored at the parent's peak RSS,
    which here is larger than anything a child measures.
    """
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0])
    return values["VmRSS"], values["VmHWM"]


def reset_peak_rss() -> bool:
    """Set the kernel's peak-RSS counter to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
