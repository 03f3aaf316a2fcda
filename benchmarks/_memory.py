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


def fresh_runs(main, argvs: list[list[str]], jobs: int = 1) -> list[dict]:
    """``main(argv)`` for each ``argv`` in a new process of its own; their return values, in order.

    Each process is forked from one server process that imported the benchmark script (torch included) once, so
    a run starts in milliseconds instead of the seconds of a new interpreter, and still starts clean: no allocator
    cache, no tensors and no peak from an earlier measurement (the server itself computes nothing). ``jobs`` runs
    that many at once; each measures its own peak. A run that fails ends the benchmark with its traceback.
    """
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__"])
    results: list[dict] = [{} for _ in argvs]
    pending = list(enumerate(argvs))
    while pending:
        batch, pending = pending[:jobs], pending[jobs:]
        running = []
        for index, argv in batch:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_fresh_run, args=(main, argv, send))
            process.start()
            send.close()
            running.append((index, argv, process, receive))
        for index, argv, process, receive in running:
            status, value = receive.recv()
            process.join()
            if status != "ok":
                raise SystemExit(f"run {' '.join(argv)} failed:\n{value}")
            results[index] = value
    return results


def _fresh_run(main, argv: list[str], send) -> None:
    import traceback

    try:
        send.send(("ok", main(argv)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the benchmark
        send.send(("error", traceback.format_exc()))


#: glibc malloc settings a memory child can run under (environment variables read at interpreter start).
MALLOC_MODES = {
    # glibc as a user gets it: freed blocks under the (self-raising) mmap threshold stay in the heap.
    "default": {},
    # Every block of 128 KiB or more is its own mapping, returned on free: RSS follows the live tensors.
    "mmap128k": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}


def interpreter_run(script: str, argv: list[str], who: str, malloc: str = "default") -> dict:
    """``python script *argv`` in a new interpreter under the glibc settings ``malloc`` (``MALLOC_MODES``, replacing
    any ``MALLOC_*`` of this environment); the JSON of its last output line. A failing run ends the benchmark with
    its stderr (exit -9: killed for memory). For measurements that need their own malloc settings, which a forked
    :func:`fresh_runs` process cannot change."""
    import json
    import os
    import subprocess
    import sys

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **MALLOC_MODES[malloc]}
    child = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env)
    if child.returncode != 0:
        raise SystemExit(f"{who}: run {' '.join(argv)} ({malloc} malloc) failed (exit {child.returncode}):\n"
                         f"{child.stderr[-3000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])
