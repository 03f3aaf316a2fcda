"""Benchmark: peak training memory and time of reversible pre-norm transformer blocks against the residual stack.

What is compared. ``N`` ``TransformerBlock(hidden 256, 4 heads, ffn 1024, norm_first=True)`` (LayerNorm, GELU,
biases, no dropout; the same block instances, so the same parameters, on both sides) for ``N`` in 4, 8, 16, 24
(``--depths``), fp32 on the CPU, input ``h`` of shape (B=8, L=512, H=256) requiring grad, every parameter
trainable; one forward + backward with a fixed output gradient (B, L, H):

- **residual**: ``h -> block_1 -> ... -> block_N``, each block ``h = h + attn(norm_1(h)); h = h + mlp(norm_2(h))``
  under ordinary autograd, which keeps every block's activations until backward;
- **reversible**: ``ReversibleSequence(F_i = block_i.attention_branch, G_i = block_i.feed_forward_branch)`` on
  ``cat([h, h], -1)`` (B, L, 2H), output the mean of the two halves (B, L, H): what ``TransformerDecoder(
  reversible=True)`` runs. It keeps only its output and runs every branch again in backward.

Both run the same branches on the same tokens at width H, so the forward costs the same; the two are not the same
function (the couplings route the residuals differently: a reversible transformer is its own architecture, as in
Reformer and RevViT), so no output is compared between them. What the tests check instead, and this script checks
again before measuring: the reversible backward's gradients (input and every parameter) equal autograd through the
same couplings. Here in fp32, at each depth, on a small input (1 x 64 tokens); the run aborts if the largest
difference exceeds 1e-3 of the largest gradient.

Peak memory: each (contender, depth) in a fresh process (``--memory-child``, ``_memory.fresh_runs``), as in
``bench_attention.py``: a warm-up step of a one-block stack on 16 tokens (thread pools, kernels), then the blocks
and inputs are built, the kernel's peak-RSS counter (``VmHWM``) is reset to the current RSS through ``/proc/self/clear_refs`` and one
forward + backward runs; ``VmHWM`` after minus RSS before is its peak RSS growth. That growth includes the
parameter gradients backward allocates, the same on both sides (4 bytes x parameters, shown beside it); the rest
is activation memory. Goals: the reversible stack's memory **flat in depth** (the slope of growth minus parameter
gradients against depth, least squares, at most 5% of the residual stack's slope) and **<= 0.3x the residual
stack at the deepest depth** (24 blocks).

Time: for each depth both contenders share the blocks and inputs and alternate inside every repeat (the first one
rotates between repeats), one untimed warm-up step each, ``--steps`` steps per repeat timed with
``time.perf_counter`` after a ``gc.collect()`` (``bench_lora.alternate``); tables show the median over
``--repeats`` and the ratio reversible / residual. No goal; the anchor is RevViT's ~1.3x compute for 15.5x less
activation memory (one more forward of every branch over forward + backward is 4/3 by FLOP count).

Usage (the numbers on ``docs/reversible.md``)::

    python benchmarks/bench_reversible.py --json benchmarks/results/reversible.json \\
        --txt benchmarks/results/reversible.txt --plot docs/img/reversible.png

``--quick``: depths 1 and 2 of 64-wide blocks on 1 x 64 tokens, 1 repeat, 1 thread, the four memory processes
at once (a smoke run of about 15 s, most of it imports; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import say, say_machine, write_results  # noqa: E402
from _memory import fresh_runs, reset_peak_rss, rss_kb  # noqa: E402
from lightning_peft.nn.reversible import ReversibleSequence  # noqa: E402
from lightning_peft.nn.transformer import TransformerBlock  # noqa: E402

DEPTHS = (4, 8, 16, 24)
CONTENDERS = ("reversible", "residual")
GRADIENT_TOLERANCE = 1e-3
class Branch(nn.Module):
    """One residual branch of a block, ``F`` (attention) or ``G`` (feed-forward), the block a submodule."""

    def __init__(self, block: TransformerBlock, which: str) -> None:
        super().__init__()
        self.block = block
        self.which = which

    def forward(self, x: Tensor) -> Tensor:
        if self.which == "attention":
            return self.block.attention_branch(x)[0]
        return self.block.feed_forward_branch(x)


def build(args: argparse.Namespace, depth: int, seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(
        TransformerBlock(args.hidden, args.heads, args.ffn, norm_first=True, activation="gelu")
        for _ in range(depth)
    )


def reversible_stack(blocks: nn.ModuleList) -> ReversibleSequence:
    return ReversibleSequence([Branch(b, "attention") for b in blocks], [Branch(b, "feed_forward") for b in blocks])


def contender(name: str, blocks: nn.ModuleList) -> Callable[[Tensor], Tensor]:
    """``(B, L, H) -> (B, L, H)``: the residual stack, or the reversible couplings on two copies of the input."""
    if name == "residual":
        def run(h: Tensor) -> Tensor:
            for block in blocks:
                h = block(h)
            return h
        return run
    stack = reversible_stack(blocks)

    def run_reversible(h: Tensor) -> Tensor:
        y1, y2 = stack(torch.cat([h, h], dim=-1)).chunk(2, dim=-1)  # (B, L, H) each
        return (y1 + y2) / 2
    return run_reversible


def make_inputs(args: argparse.Namespace, batch: int, length: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """The input (B, L, H), requiring grad, and a fixed output gradient of the same shape."""
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, length, args.hidden, generator=generator).requires_grad_()
    return h, torch.randn(batch, length, args.hidden, generator=generator)


def step_fn(name: str, blocks: nn.ModuleList, inputs: tuple[Tensor, Tensor]) -> Callable[[], None]:
    """One forward + backward; gradients are dropped after it (``set_to_none``, as Lightning does)."""
    run, (h, out_grad) = contender(name, blocks), inputs
    params = list(blocks.parameters())

    def step() -> None:
        run(h).backward(out_grad)
        h.grad = None
        for p in params:
            p.grad = None

    return step


def parameter_grad_mb(blocks: nn.ModuleList) -> float:
    return sum(p.numel() * p.element_size() for p in blocks.parameters()) / 2**20


# ------------------------------------------------------------------------------------------------ checks


def check_gradients(args: argparse.Namespace) -> dict[str, float]:
    """Per depth: max |reversible grad - autograd grad| / max |autograd grad| through the same couplings, fp32."""
    errors = {}
    for depth in args.depths:
        blocks = build(args, depth)
        stack = reversible_stack(blocks)
        h, out_grad = make_inputs(args, 1, 64)
        results = []
        for reversible in (True, False):
            x = torch.cat([h, h], dim=-1)
            if reversible:
                y = stack(x)
            else:  # the same couplings under plain autograd
                x1, x2 = x.chunk(2, dim=-1)
                for f, g in zip(stack.f_blocks, stack.g_blocks, strict=True):
                    x1 = x1 + f(x2)
                    x2 = x2 + g(x1)
                y = torch.cat([x1, x2], dim=-1)
            y1, y2 = y.chunk(2, dim=-1)
            ((y1 + y2) / 2).backward(out_grad)
            results.append([h.grad, *(p.grad for p in blocks.parameters())])
            h.grad = None
            blocks.zero_grad(set_to_none=True)
        ours, reference = results
        diff = max((a - b).abs().max().item() for a, b in zip(ours, reference, strict=True))
        scale = max(b.abs().max().item() for b in reference)
        errors[str(depth)] = diff / scale
        if not errors[str(depth)] <= GRADIENT_TOLERANCE:
            sys.exit(f"bench_reversible: at depth {depth} the reversible gradients differ from autograd through the "
                     f"same couplings by {errors[str(depth)]:.2e} of the largest gradient (> {GRADIENT_TOLERANCE}).")
    return errors


# ------------------------------------------------------------------------------------------------ memory


def memory_child(args: argparse.Namespace) -> dict:
    """The peak RSS growth of one forward + backward of one contender at one depth (also printed, as JSON)."""
    torch.set_num_threads(args.threads)
    step_fn(args.memory_child, build(args, 1), make_inputs(args, 1, 16))()  # warm-up: thread pools, kernels
    blocks = build(args, args.memory_depth)
    step = step_fn(args.memory_child, blocks, make_inputs(args, args.batch_size, args.seq_len))
    gc.collect()
    was_reset = reset_peak_rss()
    before, _ = rss_kb()
    step()
    _, after = rss_kb()
    result = {"growth_mb": (after - before) / 1024, "before_mb": before / 1024, "peak_was_reset": was_reset,
              "parameter_grad_mb": parameter_grad_mb(blocks)}
    print(json.dumps(result))
    return result


def measure_memory(args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Peak RSS growth in MB, memory[contender][str(depth)], and the parameter gradients' MB per depth."""
    memory: dict[str, dict[str, float]] = {name: {} for name in CONTENDERS}
    grads: dict[str, float] = {}
    cells = [(depth, name) for depth in args.depths for name in CONTENDERS]
    argvs = []
    for depth, name in cells:
        argv = ["--memory-child", name, "--memory-depth", str(depth)]
        for flag in ("batch_size", "seq_len", "hidden", "heads", "ffn", "threads"):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        argvs.append(argv)
    # --memory-jobs processes at a time: each measures its own peak, so they may overlap
    for (depth, name), result in zip(cells, fresh_runs(main, argvs, jobs=args.memory_jobs), strict=True):
        if not result["peak_was_reset"]:
            say("bench_reversible: cannot reset the peak RSS here; the memory numbers are upper bounds")
        memory[name][str(depth)] = result["growth_mb"]
        grads[str(depth)] = result["parameter_grad_mb"]
    return memory, grads


def slope(depths: list[int], values: list[float]) -> float:
    """Least-squares slope of ``values`` against ``depths`` (MB per block)."""
    mean_d, mean_v = statistics.fmean(depths), statistics.fmean(values)
    spread = sum((d - mean_d) ** 2 for d in depths)
    return sum((d - mean_d) * (v - mean_v) for d, v in zip(depths, values, strict=True)) / spread if spread else 0.0


# ------------------------------------------------------------------------------------------------ report


def time_all(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Milliseconds per step: times[str(depth)][contender] -> one value per repeat."""
    from bench_lora import alternate

    times = {}
    for depth in args.depths:
        blocks = build(args, depth)
        inputs = make_inputs(args, args.batch_size, args.seq_len)
        steps = {name: step_fn(name, blocks, inputs) for name in CONTENDERS}
        times[str(depth)] = alternate(steps, repeats=args.repeats, steps=args.steps, warmup=1)
        say(f"timed depth {depth}: " + ", ".join(
            f"{name} {statistics.median(times[str(depth)][name]):.0f} ms" for name in CONTENDERS))
    return times


def report_tables(args: argparse.Namespace, times: dict, memory: dict, grads: dict, errors: dict) -> dict:
    from bench_lora import row

    depths, deepest = list(args.depths), max(args.depths)
    time_rows = [row(f"forward+backward, {d} blocks", times[str(d)]["reversible"], times[str(d)]["residual"], None)
                 for d in depths]
    memory_rows = []
    for d in depths:
        ours, base = memory["reversible"][str(d)], memory["residual"][str(d)]
        ratio = ours / base if base > 0 else float("nan")
        goal = args.goal_memory if d == deepest else None
        memory_rows.append({"measurement": f"forward+backward, {d} blocks", "ours": ours, "baseline": base,
                            "ratio": ratio, "goal": goal, "parameter_grad_mb": grads[str(d)],
                            "met": None if goal is None else ratio <= goal})
    activation = {name: [memory[name][str(d)] - grads[str(d)] for d in depths] for name in CONTENDERS}
    slopes = {name: slope(depths, activation[name]) for name in CONTENDERS}
    flat_ratio = slopes["reversible"] / slopes["residual"] if slopes["residual"] > 0 else float("nan")
    flatness = {"slope_mb_per_block": slopes, "ratio": flat_ratio, "goal": args.goal_flat,
                "met": flat_ratio <= args.goal_flat}

    say("\n### Peak memory (MB of peak RSS growth during one forward + backward, fresh process each)\n")
    say("| depth | reversible (MB) | residual (MB) | ratio reversible / residual | of which parameter gradients "
        "(MB, each side) | goal | met? |")
    say("| ---: | ---: | ---: | ---: | ---: | ---: | :---: |")
    for d, r in zip(depths, memory_rows, strict=True):
        goal = "—" if r["goal"] is None else f"≤ {r['goal']:.2f}"
        met = "—" if r["met"] is None else ("yes" if r["met"] else "NO")
        say(f"| {d} | {r['ours']:.0f} | {r['baseline']:.0f} | {r['ratio']:.3f} | {r['parameter_grad_mb']:.1f} | "
            f"{goal} | {met} |")
    say(f"\nActivation memory (growth minus parameter gradients) per added block, least squares over depths "
        f"{', '.join(map(str, depths))}: reversible {slopes['reversible']:.2f} MB, residual "
        f"{slopes['residual']:.2f} MB; ratio {flat_ratio:.3f} (goal flat: ≤ {args.goal_flat:.2f}; "
        f"{'met' if flatness['met'] else 'NOT met'}).")

    say("\n### Time (median ms per forward + backward)\n")
    say("| depth | reversible (ms) | residual (ms) | ratio reversible / residual | paired ratio | anchor |")
    say("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for d, r in zip(depths, time_rows, strict=True):
        say(f"| {d} | {r['ours']:.0f} | {r['baseline']:.0f} | {r['ratio']:.2f} | {r['paired_ratio']:.2f} | "
            "RevViT ~1.3 |")
    say("\nGradient check (fp32, 1 x 64 tokens): max |reversible - autograd through the same couplings| / max "
        "|gradient|: " + ", ".join(f"{d} blocks {errors[str(d)]:.1e}" for d in depths))
    return {"time": time_rows, "memory": memory_rows, "flatness": flatness}


def plot(args: argparse.Namespace, times: dict, memory: dict, grads: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = list(args.depths)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.6))
    styles = {"reversible": ("tab:blue", "o", "ReversibleSequence (F = attention, G = feed-forward)"),
              "residual": ("tab:red", "s", "residual stack (plain autograd)")}
    for name, (color, marker, label) in styles.items():
        left.plot(depths, [memory[name][str(d)] for d in depths], "-", color=color, marker=marker, label=label)
        right.plot(depths, [statistics.median(times[str(d)][name]) / 1000 for d in depths], "-", color=color,
                   marker=marker, label=label)
    left.plot(depths, [grads[str(d)] for d in depths], ":", color="grey", label="parameter gradients (both)")
    for ax, ylabel in ((left, "peak memory growth (MB)"), (right, "median seconds per forward + backward")):
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.set_xlabel("blocks")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    left.set_title("training memory")
    right.set_title("time")
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
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
    shape = (f"pre-norm blocks H={args.hidden}, {args.heads} heads, ffn {args.ffn}; batch {args.batch_size} x "
             f"{args.seq_len} tokens, fp32, {args.threads} CPU threads")
    say(f"## ReversibleSequence vs residual stack ({shape}; torch {torch.__version__}; {args.repeats} repeats)")
    report: dict = {"config": {k: v for k, v in vars(args).items() if not k.startswith("memory_")},
                    "torch": torch.__version__}
    report["gradient_rel_error"] = check_gradients(args)
    times = time_all(args)
    memory, grads = measure_memory(args)
    report |= {"raw_ms": times, "memory_mb": memory, "parameter_grad_mb": grads}
    report["rows"] = report_tables(args, times, memory, grads, report["gradient_rel_error"])
    if args.plot:
        plot(args, times, memory, grads, args.plot, f"reversible vs residual: {shape}")
    report["seconds"] = time.perf_counter() - started
    say(f"\nwhole run: {report['seconds']:.0f} s")
    write_results(args.json, args.txt, report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--depths", type=int, nargs="+", default=list(DEPTHS))
    add("--batch-size", type=int, default=8)
    add("--seq-len", type=int, default=512)
    add("--hidden", type=int, default=256)
    add("--heads", type=int, default=4)
    add("--ffn", type=int, default=1024)
    add("--repeats", type=int, default=3)
    add("--steps", type=int, default=1, help="forward + backward steps per timed repeat")
    add("--threads", type=int, default=torch.get_num_threads())
    add("--goal-memory", type=float, default=0.3)
    add("--goal-flat", type=float, default=0.05)
    add("--quick", action="store_true", help="smoke run: depths 1 2, 64 wide, 1 x 64 tokens, 1 repeat")
    add("--json", default=None)
    add("--txt", default=None, help="write the printed tables here")
    add("--plot", default=None)
    add("--memory-jobs", type=int, default=1, help="memory processes run at once (each measures its own peak)")
    add("--memory-child", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    add("--memory-depth", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.depths, args.batch_size, args.seq_len, args.hidden, args.heads, args.ffn = [1, 2], 1, 64, 64, 2, 128
        args.repeats, args.steps, args.threads, args.memory_jobs = 1, 1, 1, 4
    args.depths = sorted(args.depths)
    return args


if __name__ == "__main__":
    main()
