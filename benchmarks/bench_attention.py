"""Benchmark: ``lightning_peft.nn.attention`` against naive ``softmax(Q K^T) V``: time and peak memory vs length.

Shapes: batch 1, 12 heads of 32 (MiniLM's attention), fp32 on the CPU, no mask, not causal; sequence lengths
512, 1024, 2048, 4096 (``--lengths``). ``attention`` runs SDPA's fused CPU flash kernel (the ``auto`` backend here);
the naive side is ``softmax((scale * q) @ k^T) @ v`` in plain PyTorch, which stores the (H, L, L) scores and
probabilities. Before measuring, the run aborts unless both agree within 1e-4 at the smallest length.

Time: the two contenders alternate inside every repeat (the first one rotates between repeats); each repeat
times ``--steps`` calls (default: more calls at short lengths) with ``time.perf_counter`` after a ``gc.collect()``,
after one untimed warm-up call each; tables show the median over ``--repeats`` (``bench_lora.alternate``).
Two modes: *forward* (under ``torch.no_grad``: inference) and *forward+backward* (inputs require grad; forward,
then ``backward`` with a fixed output gradient: training).

Peak memory: each (contender, mode, length) in a fresh process (``--memory-child``; forked from a server that
imported this script once: ``_memory.fresh_runs``), so no allocator cache from an earlier measurement hides or adds
memory. The child makes one small warm-up call (thread pools, kernels), builds
the inputs (and the output gradient), then resets the kernel's peak-RSS counter (``VmHWM``) to the current RSS
through ``/proc/self/clear_refs`` and runs the call once; ``VmHWM`` after minus RSS before is the peak RSS growth
of the call: everything the call allocates and touches (scores, softmax, saved activations, the output, the
input gradients), from any allocator, with glibc malloc as a user gets it. ``tracemalloc`` would not see torch's
allocations and the profiler's memory events only torch's; RSS sees both. Memory goal: linear in the length (the
log-log slope between the two longest lengths ~1; naive: ~2) and <= 0.1x naive at 4096 tokens; time goal: ours /
naive < 1 at every length.

Usage: ``python benchmarks/bench_attention.py [--repeats 5] [--lengths 512 1024 2048 4096]
[--json benchmarks/results/attention.json] [--txt benchmarks/results/attention.txt] [--plot docs/img/attention.png]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _memory import fresh_runs, reset_peak_rss, rss_kb  # noqa: E402
from _report import say, say_machine, say_table, write_results  # noqa: E402
from lightning_peft.nn.attention import attention, select_backend  # noqa: E402

LENGTHS = (512, 1024, 2048, 4096)
CONTENDERS = ("ours", "naive")
MODES = ("forward", "forward+backward")
TOLERANCE = 1e-4
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(scale * q k^T) v``: the (B, H, L, L) scores and probabilities exist in memory."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.softmax((q * scale) @ k.transpose(-1, -2), dim=-1) @ v  # (B, H, L, D)


def ours_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attention(q, k, v)


FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {"ours": ours_attention, "naive": naive_attention}


def make_inputs(args: argparse.Namespace, length: int, grad: bool, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v (B, H, L, D) and an output gradient of the same shape."""
    generator = torch.Generator().manual_seed(seed)
    shape = (args.batch_size, args.heads, length, args.head_dim)
    q, k, v, out_grad = (torch.randn(shape, generator=generator) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(grad)
    return [q, k, v, out_grad]


def call_fn(name: str, mode: str, inputs: list[torch.Tensor]) -> Callable[[], None]:
    """One forward (no grad) or one forward + backward of a contender on fixed inputs."""
    fn = FUNCTIONS[name]
    q, k, v, out_grad = inputs

    def forward() -> None:
        with torch.no_grad():
            fn(q, k, v)

    def train() -> None:
        fn(q, k, v).backward(out_grad)
        for t in (q, k, v):
            t.grad = None

    return forward if mode == "forward" else train


# ------------------------------------------------------------------------------------------------ memory


def memory_child(args: argparse.Namespace) -> dict:
    """The peak RSS growth of one call of one contender at one length (also printed, as JSON)."""
    torch.set_num_threads(args.threads)
    name, mode, length = args.memory_child, args.memory_mode, args.memory_length
    call_fn(name, mode, make_inputs(args, 64, mode != "forward"))()  # warm-up: thread pools, kernel choice
    step = call_fn(name, mode, make_inputs(args, length, mode != "forward"))
    gc.collect()
    was_reset = reset_peak_rss()
    before, _ = rss_kb()
    step()
    _, after = rss_kb()
    result = {"growth_mb": (after - before) / 1024, "before_mb": before / 1024, "peak_was_reset": was_reset}
    print(json.dumps(result))
    return result


def measure_memory(args: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    """Peak RSS growth in MB: memory[mode][contender][str(length)], each in a fresh process."""
    memory: dict[str, dict[str, dict[str, float]]] = {mode: {name: {} for name in CONTENDERS} for mode in MODES}
    cells = [(mode, length, name) for mode in MODES for length in args.lengths for name in CONTENDERS]
    argvs = []
    for mode, length, name in cells:
        argv = ["--memory-child", name, "--memory-mode", mode, "--memory-length", str(length)]
        for flag in ("batch_size", "heads", "head_dim", "threads"):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        argvs.append(argv)
    for (mode, length, name), result in zip(cells, fresh_runs(main, argvs), strict=True):
        if not result["peak_was_reset"]:
            say("bench_attention: cannot reset the peak RSS here; the memory numbers are upper bounds")
        memory[mode][name][str(length)] = result["growth_mb"]
    return memory


def slope(values: dict[str, float], lengths: list[int]) -> float | None:
    """The log-log slope of memory against length between the two longest lengths (1: linear, 2: quadratic)."""
    if len(lengths) < 2:
        return None
    (a, b) = lengths[-2:]
    low, high = max(values[str(a)], 1e-3), max(values[str(b)], 1e-3)
    return math.log(high / low) / math.log(b / a)


# ------------------------------------------------------------------------------------------------ report


def check_same(args: argparse.Namespace) -> float:
    q, k, v, _ = make_inputs(args, min(args.lengths), grad=False)
    diff = (ours_attention(q, k, v) - naive_attention(q, k, v)).abs().max().item()
    if not diff <= TOLERANCE:
        sys.exit(f"bench_attention: attention and the naive reference disagree by {diff:.2e} (> {TOLERANCE}).")
    return diff


def time_all(args: argparse.Namespace) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Milliseconds per call: times[mode][str(length)][contender] -> one value per repeat."""
    from bench_lora import alternate

    times: dict[str, dict[str, dict[str, list[float]]]] = {mode: {} for mode in MODES}
    for length in args.lengths:
        steps = args.steps or max(1, round((2048 / length) ** 2))
        for mode in MODES:
            inputs = make_inputs(args, length, mode != "forward")
            contenders = {name: call_fn(name, mode, inputs) for name in CONTENDERS}
            times[mode][str(length)] = alternate(contenders, repeats=args.repeats, steps=steps, warmup=1)
    return times


def memory_row(measurement: str, ours: float, naive: float, goal: float | None) -> dict:
    ratio = ours / naive if naive > 0 else float("nan")  # tiny lengths can grow RSS by nothing
    return {"measurement": measurement, "ours": ours, "baseline": naive, "ratio": ratio, "goal": goal,
            "met": None if goal is None or math.isnan(ratio) else ratio <= goal}


def print_rows(title: str, rows: list[dict], unit: str) -> None:
    say_table(title, rows, (f"ours ({unit})", f"naive ({unit})"))


def report_tables(args: argparse.Namespace, times: dict, memory: dict) -> dict:
    from bench_lora import row

    time_rows, memory_rows, slopes = [], [], {}
    longest = max(args.lengths)
    for mode in MODES:
        for length in args.lengths:
            t = times[mode][str(length)]
            time_rows.append(row(f"{mode}, {length} tokens", t["ours"], t["naive"], args.goal_time))
        for length in args.lengths:
            m = memory[mode]
            goal = args.goal_memory if length == longest else None
            memory_rows.append(memory_row(f"{mode}, {length} tokens", m["ours"][str(length)],
                                          m["naive"][str(length)], goal))
        slopes[mode] = {name: slope(memory[mode][name], list(args.lengths)) for name in CONTENDERS}
    print_rows("Time (median ms per call)", time_rows, "ms")
    print_rows("Peak memory (MB of peak RSS growth during one call, fresh process each)", memory_rows, "MB")
    if len(args.lengths) >= 2:
        a, b = args.lengths[-2:]
        say(f"\nMemory growth exponent between {a} and {b} tokens (log-log slope; 1 = linear, 2 = quadratic):")
        for mode, by_name in slopes.items():
            say(f"- {mode}: ours {by_name['ours']:.2f}, naive {by_name['naive']:.2f}")
    return {"time": time_rows, "memory": memory_rows, "memory_slope": slopes}


def plot(times: dict, memory: dict, lengths: list[int], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.8))
    styles = {"ours": ("tab:blue", "o", "lightning_peft attention (SDPA flash CPU kernel)"),
              "naive": ("tab:red", "s", "naive softmax(QK^T)V")}
    for name, (color, marker, label) in styles.items():
        for mode, line in (("forward+backward", "-"), ("forward", "--")):
            mem = [max(memory[mode][name][str(n)], 0.1) for n in lengths]
            ms = [statistics.median(times[mode][str(n)][name]) for n in lengths]
            left.plot(lengths, mem, line, color=color, marker=marker, label=f"{label}, {mode}")
            right.plot(lengths, ms, line, color=color, marker=marker, label=f"{label}, {mode}")
    start = max(memory["forward+backward"]["naive"][str(lengths[0])], 0.1)
    for power, dots in ((1, ":"), (2, "-.")):  # guides: linear and quadratic growth from the naive first point
        left.plot(lengths, [start * (n / lengths[0]) ** power for n in lengths], dots, color="grey", linewidth=1,
                  label=f"length^{power}")
    for ax, ylabel in ((left, "peak memory growth (MB)"), (right, "median time per call (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    left.set_title("memory")
    right.set_title("time")
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    say(f"\nwrote {path}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.memory_child:
        return memory_child(args)
    torch.set_num_threads(args.threads)
    say_machine()
    started = time.perf_counter()
    shape = f"batch {args.batch_size}, {args.heads} heads x {args.head_dim}, fp32, {args.threads} CPU threads"
    probe = torch.zeros(1, args.heads, 1, args.head_dim)
    say(f"## attention vs naive softmax(QK^T)V ({shape}; backend: {select_backend(probe)}; "
        f"torch {torch.__version__}; {args.repeats} repeats)")
    report: dict = {"config": {k: v for k, v in vars(args).items() if not k.startswith("memory_")},
                    "torch": torch.__version__, "backend": select_backend(probe)}
    report["max_abs_diff"] = check_same(args)
    times = time_all(args)
    memory = measure_memory(args)
    report |= {"raw_ms": times, "memory_mb": memory}
    report["rows"] = report_tables(args, times, memory)
    if args.plot:
        plot(times, memory, list(args.lengths), args.plot, f"attention vs naive: {shape}")
    report["seconds"] = time.perf_counter() - started
    say(f"\nwhole run: {report['seconds']:.0f} s")
    write_results(args.json, args.txt, report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--lengths", type=int, nargs="+", default=list(LENGTHS))
    add("--batch-size", type=int, default=1)
    add("--heads", type=int, default=12)
    add("--head-dim", type=int, default=32)
    add("--repeats", type=int, default=5)
    add("--steps", type=int, default=None, help="calls per timed repeat; default: (2048 / length)^2, at least 1")
    add("--threads", type=int, default=torch.get_num_threads())
    add("--goal-time", type=float, default=1.0)
    add("--goal-memory", type=float, default=0.1)
    add("--json", default=None)
    add("--txt", default=None, help="write the printed tables here")
    add("--plot", default=None)
    add("--memory-child", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    add("--memory-mode", choices=MODES, default="forward", help=argparse.SUPPRESS)
    add("--memory-length", type=int, default=512, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.lengths = sorted(args.lengths)
    return args


if __name__ == "__main__":
    main()
