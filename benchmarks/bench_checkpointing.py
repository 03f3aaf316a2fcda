"""Benchmark: activation memory and step time of activation checkpointing on our ``TransformerDecoder``.

What is compared. ``TransformerDecoder(vocab 2048, hidden 256, 4 heads, ffn 1024 (SwiGLU, the decoder's
feed-forward), N blocks)`` for ``N`` in 4, 8, 16, 24 (``--depths``), fp32 on the CPU, LoRA rank 8 on every
attention projection (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) over a frozen base and frozen embeddings (the
case where reentrant checkpointing silently gives zero gradients), batch 4 x 256 tokens, one forward + backward of
the language-model cross-entropy on random labels:

- **plain**: ordinary autograd, which keeps every block's activations until backward;
- **checkpointed**: :func:`lightning_peft.nn.apply_activation_checkpointing` (every ``TransformerBlock``,
  non-reentrant) with ``release_memory=None``: on glibc, ``malloc_trim(0)`` after each block's forward returns the
  heap pages its temporaries freed; each block keeps its input and is run again in backward;
- **kept**: the same with ``release_memory=False``, the default (the freed pages stay with glibc).

Both are the same model with the same weights; before measuring, the script checks on a small input that every
trainable gradient is the same on both sides (aborts above 1e-6 relative).

Activation memory: each (contender, depth) in a fresh subprocess (``--memory-child``): a warm-up step on 8 tokens,
then the model and inputs are built, the kernel's peak-RSS counter (``VmHWM``) is reset through
``/proc/self/clear_refs``, and one forward + backward runs; the peak RSS growth above model + inputs, minus the
trainable parameters' gradients (1.5 MB at 24 blocks, shown), is the activation memory. Twice (``--malloc-modes``,
as ``bench_lora.py`` does): glibc malloc as a user gets it, where freed blocks stay in the heap and fragment it, and
with ``MALLOC_MMAP_THRESHOLD_=131072``, where RSS follows the live tensors. Goal: checkpointed / plain **<= 0.3 at
24 blocks**. Plot: activation memory against depth, both contenders, both modes (``--plot``).

Time, at the deepest depth: the checkpointed step, the plain step, and the plain model's forward (building the
graph, ``F``) and backward (``B``) timed apart run in every repeat, in an order that rotates, after one untimed
warm-up each; medians of ``--repeats``. The floor of checkpointing is one more forward per step,
``(2F + B) / (F + B)``. Goal: checkpointed / plain **within 1.1x of that floor**. The kept variant runs in the
same rotation: checkpointed / kept is the release's cost.

Usage (the numbers on ``docs/activation_checkpointing.md``)::

    python benchmarks/bench_checkpointing.py --json benchmarks/results/checkpointing.json \\
        --txt benchmarks/results/checkpointing.txt --plot docs/img/checkpointing_memory.png

``--quick``: depths 1 and 2, 32 wide, 1 x 16 tokens, 1 repeat, memory measured in this process (a smoke run; its
numbers mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _memory import MALLOC_MODES, interpreter_run, reset_peak_rss, rss_kb  # noqa: E402
from _report import finish, output_arguments, save_figure, say, say_machine  # noqa: E402
from lightning_peft.nn import TransformerDecoder, apply_activation_checkpointing  # noqa: E402
from lightning_peft.nn.checkpointing import checkpointed_modules  # noqa: E402
from lightning_peft.peft import inject_lora  # noqa: E402

DEPTHS = (4, 8, 16, 24)
CONTENDERS = ("checkpointed", "plain", "kept")  # kept: checkpointed with release_memory=False (the default)
GRADIENT_TOLERANCE = 1e-6
# The model's and the batch's sizes: (the real run's, --quick's); a memory child gets the same.
SIZES = {"batch_size": (4, 1), "seq_len": (256, 16), "hidden": (256, 32), "heads": (4, 2), "ffn": (1024, 64),
         "vocab": (2048, 64), "threads": (torch.get_num_threads(), 1)}


def build(args: argparse.Namespace, depth: int, name: str) -> nn.Module:
    """The decoder with LoRA; ``name``: "plain", "checkpointed" (``release_memory=None``: freed heap pages released
    after each block's forward) or "kept" (checkpointed with ``release_memory=False``, the default)."""
    torch.manual_seed(0)
    model = TransformerDecoder(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=depth,
                               num_heads=args.heads, ffn_size=args.ffn, max_position_embeddings=args.seq_len)
    inject_lora(model, rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    with torch.no_grad():  # B != 0, so the adapters are on the gradient path of every block
        for key, p in model.named_parameters():
            if "lora_B" in key:
                p.normal_(0, 0.02)
    if name != "plain":
        apply_activation_checkpointing(model, release_memory=None if name == "checkpointed" else False)
    return model.train()


def make_inputs(args: argparse.Namespace, batch: int, length: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (batch, length), generator=generator)  # (B, L)
    return ids, torch.randint(0, args.vocab, (batch, length), generator=generator)  # labels (B, L)


def loss_of(model: nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    logits = model(ids)  # (B, L, V)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def step_fn(model: nn.Module, inputs: tuple[Tensor, Tensor]) -> Callable[[], None]:
    """One forward + backward; gradients dropped after it (``set_to_none``, as Lightning does)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        loss_of(model, *inputs).backward()
        for p in params:
            p.grad = None

    return step


def trainable_grad_mb(model: nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20


def check_gradients(args: argparse.Namespace) -> float:
    """Max relative difference of every trainable gradient, checkpointed against plain, on a small input."""
    inputs = make_inputs(args, 1, min(args.seq_len, 32))
    grads = []
    for name in ("checkpointed", "plain"):
        model = build(args, min(args.depths), name)
        loss_of(model, *inputs).backward()
        grads.append([p.grad for p in model.parameters() if p.requires_grad])
    diff = max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))
    error = diff / max(b.abs().max().item() for b in grads[1])
    if not error <= GRADIENT_TOLERANCE:
        sys.exit(f"bench_checkpointing: checkpointed gradients differ from plain by {error:.2e} (> {GRADIENT_TOLERANCE})")
    return error


# ------------------------------------------------------------------------------------------------ memory


def measure_one(args: argparse.Namespace, name: str, depth: int) -> dict[str, float]:
    """Peak RSS growth of one forward + backward above the built model and inputs, in MB."""
    torch.set_num_threads(args.threads)
    warm = build(args, 1, name)
    step_fn(warm, make_inputs(args, 1, 8))()  # thread pools, kernels
    del warm
    model = build(args, depth, name)
    step = step_fn(model, make_inputs(args, args.batch_size, args.seq_len))
    gc.collect()
    was_reset = reset_peak_rss()
    before, _ = rss_kb()
    step()
    _, after = rss_kb()
    grads = trainable_grad_mb(model)
    return {"growth_mb": (after - before) / 1024, "activation_mb": (after - before) / 1024 - grads,
            "trainable_grad_mb": grads, "peak_was_reset": was_reset,
            "checkpointed_blocks": len(checkpointed_modules(model))}


def measure_memory(args: argparse.Namespace) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """memory[malloc mode][contender][str(depth)]: ``measure_one``'s numbers, each from a fresh process with the
    mode's environment (quick: in this process, glibc as it is)."""
    memory: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for mode in args.malloc_modes:
        memory[mode] = {name: {} for name in CONTENDERS}
        for depth in args.depths:
            for name in CONTENDERS:
                if args.quick:
                    result = measure_one(args, name, depth)
                else:
                    argv = ["--memory-child", name, "--memory-depth", str(depth)]
                    for field in SIZES:
                        argv += [f"--{field.replace('_', '-')}", str(getattr(args, field))]
                    result = interpreter_run(__file__, argv, "bench_checkpointing", mode)
                if not result["peak_was_reset"]:
                    say("bench_checkpointing: cannot reset the peak RSS here; the memory numbers are upper bounds")
                memory[mode][name][str(depth)] = result
    return memory


# ------------------------------------------------------------------------------------------------ time


def measure_time(args: argparse.Namespace) -> dict[str, list[float]]:
    """Milliseconds per repeat: the two steps, and the plain model's forward and backward timed apart; the three
    run in every repeat, in an order that rotates, after one untimed warm-up each."""
    depth = max(args.depths)
    inputs = make_inputs(args, args.batch_size, args.seq_len)
    models = {name: build(args, depth, name) for name in CONTENDERS}
    steps = {name: step_fn(model, inputs) for name, model in models.items()}
    params = [p for p in models["plain"].parameters() if p.requires_grad]
    times: dict[str, list[float]] = {"checkpointed": [], "kept": [], "plain": [], "forward": [], "backward": []}

    def split() -> tuple[float, float]:  # F and B of the plain model
        start = time.perf_counter()
        loss = loss_of(models["plain"], *inputs)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        for p in params:
            p.grad = None
        return (middle - start) * 1000, (end - middle) * 1000

    order = ["checkpointed", "kept", "plain", "split"]
    for repeat in range(args.repeats + 1):  # repeat 0 is the warm-up
        for name in order[repeat % 4:] + order[:repeat % 4]:
            if not args.quick:  # a collection costs ~0.3 s once torch.utils.checkpoint has loaded dynamo
                gc.collect()
            if name == "split":
                f_ms, b_ms = split()
                measured = {"forward": f_ms, "backward": b_ms}
            else:
                start = time.perf_counter()
                steps[name]()
                measured = {name: (time.perf_counter() - start) * 1000}
            if repeat:
                for key, value in measured.items():
                    times[key].append(value)
    return times


# ------------------------------------------------------------------------------------------------ report


def report_tables(args: argparse.Namespace, times: dict, memory: dict, error: float) -> dict:
    depths, deepest = list(args.depths), max(args.depths)
    rows = []
    say("\n### Activation memory (MB: peak RSS growth of one forward + backward above model + inputs, minus the "
        "trainable gradients; a fresh process each)\n")
    say("| glibc malloc | blocks | checkpointed (MB) | plain (MB) | ratio checkpointed / plain | goal | met? | "
        "kept: release_memory=False (MB) | kept / plain |")
    say("| :--- | ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: |")
    for mode, measured in memory.items():
        for d in depths:
            ours, base = measured["checkpointed"][str(d)]["activation_mb"], measured["plain"][str(d)]["activation_mb"]
            kept = measured["kept"][str(d)]["activation_mb"]
            ratio = ours / base if base > 0 else float("nan")
            kept_ratio = kept / base if base > 0 else float("nan")
            goal = args.goal_memory if d == deepest else None
            rows.append({"malloc": mode, "blocks": d, "checkpointed_mb": ours, "plain_mb": base, "ratio": ratio,
                         "goal": goal, "met": None if goal is None else ratio <= goal, "kept_mb": kept,
                         "kept_ratio": kept_ratio})
            say(f"| {mode} | {d} | {ours:.1f} | {base:.1f} | {ratio:.3f} | "
                f"{'—' if goal is None else f'≤ {goal:.2f}'} | {'—' if goal is None else ('yes' if ratio <= goal else 'NO')} "
                f"| {kept:.1f} | {kept_ratio:.3f} |")
    grads = next(iter(memory.values()))["plain"][str(deepest)]["trainable_grad_mb"]
    say(f"\nTrainable (LoRA) gradients subtracted: {grads:.2f} MB at {deepest} blocks. mmap128k: "
        "MALLOC_MMAP_THRESHOLD_=131072, every block of 128 KiB or more its own mapping, returned on free. "
        "checkpointed: release_memory=None (glibc's malloc_trim(0) after each block's forward); kept: "
        "release_memory=False, the default.")
    med = {k: statistics.median(v) for k, v in times.items()}
    f_ms, b_ms = med["forward"], med["backward"]
    floor = (2 * f_ms + b_ms) / (f_ms + b_ms)
    ratio = med["checkpointed"] / med["plain"]
    paired = statistics.median(a / b for a, b in zip(times["checkpointed"], times["plain"], strict=True))
    time_row = {"blocks": deepest, "checkpointed_ms": med["checkpointed"], "plain_ms": med["plain"],
                "kept_ms": med["kept"], "release_cost": med["checkpointed"] / med["kept"],
                "forward_ms": f_ms, "backward_ms": b_ms, "ratio": ratio, "paired_ratio": paired, "floor": floor,
                "ratio_over_floor": ratio / floor, "goal": args.goal_time, "met": ratio / floor <= args.goal_time}
    say(f"\n### Step time at {deepest} blocks (median ms of {args.repeats} repeats, alternating)\n")
    say("| checkpointed (ms) | plain (ms) | ratio | paired ratio | F (ms) | B (ms) | floor (2F+B)/(F+B) | "
        "ratio / floor | goal | met? |")
    say("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |")
    say(f"| {med['checkpointed']:.0f} | {med['plain']:.0f} | {ratio:.3f} | {paired:.3f} | {f_ms:.0f} | {b_ms:.0f} | "
        f"{floor:.3f} | {ratio / floor:.3f} | ≤ {args.goal_time:.2f} | {'yes' if time_row['met'] else 'NO'} |")
    say(f"\nThe release's cost: checkpointed (release on) / kept (release_memory=False), medians: "
        f"{med['checkpointed']:.0f} / {med['kept']:.0f} ms = {time_row['release_cost']:.3f}.")
    say(f"\nGradient check (fp32, 1 x {min(args.seq_len, 32)} tokens, {min(depths)} blocks): max |checkpointed - "
        f"plain| / max |gradient| = {error:.1e}")
    return {"memory": rows, "time": time_row}


def plot(args: argparse.Namespace, memory: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = list(args.depths)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for (mode, measured), style in zip(memory.items(), ("--", "-")):
        for name, color, marker in (("plain", "tab:red", "s"), ("checkpointed", "tab:blue", "o"),
                                    ("kept", "tab:gray", "^")):
            ax.plot(depths, [measured[name][str(d)]["activation_mb"] for d in depths], style, color=color,
                    marker=marker, label=f"{name} (glibc malloc: {mode})")
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("blocks")
    ax.set_ylabel("activation memory (MB, peak RSS growth)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    save_figure(fig, path)


def describe(args: argparse.Namespace) -> str:
    return (f"TransformerDecoder H={args.hidden}, {args.heads} heads, ffn {args.ffn}, vocab {args.vocab}, LoRA r=8 "
            f"on q/k/v/o; batch {args.batch_size} x {args.seq_len}, fp32, {args.threads} CPU threads")


def main(argv: list[str] | None = None) -> dict:
    started, args = time.perf_counter(), parse_args(argv)
    torch.set_num_threads(args.threads)
    say_machine()
    if args.memory_child:  # one measurement, as JSON for the parent
        print(json.dumps(measure_one(args, args.memory_child, args.memory_depth)))
        return {}
    shape = describe(args)
    say(f"## Activation checkpointing vs plain ({shape}; torch {torch.__version__})")
    error, times = check_gradients(args), measure_time(args)
    memory = measure_memory(args)
    report = {"config": {k: v for k, v in vars(args).items() if not k.startswith("memory_")},
              "torch": torch.__version__, "gradient_rel_error": error, "raw_ms": times, "memory_mb": memory,
              "rows": report_tables(args, times, memory, error)}
    if args.plot:
        plot(args, memory, args.plot, f"activation checkpointing: {shape}")
    return finish(report, started, args.json, args.txt)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--depths", type=int, nargs="+", default=list(DEPTHS))
    for field, (real, _) in SIZES.items():
        add(f"--{field.replace('_', '-')}", type=int, default=real)
    add("--repeats", type=int, default=5)
    add("--malloc-modes", nargs="+", choices=sorted(MALLOC_MODES), default=list(MALLOC_MODES),
        help="glibc malloc settings to measure memory under (a fresh process each)")
    add("--goal-memory", type=float, default=0.3)
    add("--goal-time", type=float, default=1.1, help="checkpointed/plain over its floor (2F+B)/(F+B)")
    add("--quick", action="store_true", help="smoke run: depths 1 2, 32 wide, 1 x 16 tokens, 1 repeat")
    output_arguments(parser)
    add("--memory-child", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    add("--memory-depth", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        for field, (_, quick) in SIZES.items():
            setattr(args, field, quick)
        args.depths, args.repeats, args.malloc_modes = [1, 2], 1, ["default"]  # quick: measured in this process
    args.depths = sorted(args.depths)
    return args


if __name__ == "__main__":
    main()
