"""Benchmark: peak memory and time of `chunked_cross_entropy` against plain ``F.cross_entropy`` on the full logits.

What is compared. A frozen language-model head ``weight`` (V, H) and hidden states ``hidden`` (N, H) requiring grad
(what a LoRA fine-tune with a frozen head gives the loss), float32 on the CPU, labels uniform in ``[0, V)`` with
one in eight ignored (-100); one forward + backward of the mean loss:

- **plain**: ``F.cross_entropy(hidden @ weight.T, labels)``, autograd holding the (N, V) logits' log-probabilities
  and, in backward, their gradient;
- **chunked**: ``chunked_cross_entropy(hidden, weight, labels, chunk_size=c)``, which never holds more than one
  chunk's (c, V) logits.

Before measuring, the two are checked against each other on a small input (loss and ``hidden``'s gradient, float32):
the run aborts if they differ by more than 1e-4 relative.

Peak memory: each (contender, vocabulary) in a fresh subprocess (``--memory-child``), as in
``bench_reversible.py``: a warm-up step on a tiny input (thread pools, kernels), then the inputs are built, the
kernel's peak-RSS counter (``VmHWM``) is reset to the current RSS through ``/proc/self/clear_refs`` and one forward +
backward runs; ``VmHWM`` after minus RSS before is the loss's peak memory above its inputs. It includes ``hidden``'s
gradient (N x H x 4 bytes, the same on both sides, shown beside it). Goal at the headline size (hidden 1024,
vocabulary 131,072, 8,192 tokens): chunked / plain **<= 0.2**. The vocabulary sweep (``--vocabs``) is the plot.

Time: both contenders share the inputs and alternate inside every repeat (the first one rotates between repeats;
``_timing.alternate``), after a warm-up step on a smaller input; tables show the median over ``--repeats`` of
one forward + backward and the ratio chunked / plain. Goal: **<= 1.1**.

Chunk size: at ``--sweep-tokens`` tokens and the headline vocabulary, every ``--chunk-sizes`` value is timed
(alternating with the plain loss) and its peak memory measured in a fresh process; the default of
`chunked_cross_entropy` (``DEFAULT_CHUNK_SIZE``) comes from that table.

Usage (the numbers on ``docs/chunked_loss.md``)::

    python benchmarks/bench_chunked_loss.py --json benchmarks/results/chunked_loss.json \\
        --txt benchmarks/results/chunked_loss.txt --plot docs/img/chunked_loss_memory.png

``--quick``: hidden 32, vocabulary 512 (sweep 256, 512), 256 tokens, 1 repeat, 1 thread, memory measured in this
process (a smoke run of a few seconds; its numbers mean nothing).
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
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _memory import interpreter_run, reset_peak_rss, rss_kb  # noqa: E402
from _report import save_figure, say, say_machine, write_results  # noqa: E402
from _timing import alternate, row  # noqa: E402
from lightning_peft.nn.chunked_loss import DEFAULT_CHUNK_SIZE, chunked_cross_entropy  # noqa: E402

CHECK_TOLERANCE = 1e-4


TRAINABLE_HEAD = False  # --trainable-head: the weight requires grad too (a fully trained head, as CausalLM's)


def make_inputs(tokens: int, hidden: int, vocab: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``hidden`` (N, H) requiring grad, a frozen ``weight`` (V, H), ``labels`` (N,) with one in eight ignored."""
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=generator).requires_grad_()
    weight = torch.randn(vocab, hidden, generator=generator) / hidden**0.5  # logits of unit scale
    weight.requires_grad_(TRAINABLE_HEAD)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::8] = -100
    return h, weight, labels


def loss_fn(name: str, chunk_size: int) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    if name == "plain":
        return lambda h, w, y: F.cross_entropy(h @ w.T, y)
    return lambda h, w, y: chunked_cross_entropy(h, w, y, chunk_size=chunk_size)


def step_fn(name: str, chunk_size: int, inputs: tuple[Tensor, Tensor, Tensor]) -> Callable[[], None]:
    """One forward + backward; the gradient is dropped after it."""
    fn, (h, weight, labels) = loss_fn(name, chunk_size), inputs

    def step() -> None:
        fn(h, weight, labels).backward()
        h.grad = weight.grad = None

    return step


def check(args: argparse.Namespace) -> float:
    """Max relative difference of loss and hidden gradient, chunked vs plain, on 300 tokens x 1000 classes."""
    h, weight, labels = make_inputs(300, 64, 1000)
    results = []
    for name in ("chunked", "plain"):
        loss = loss_fn(name, 128)(h, weight, labels)
        (grad,) = torch.autograd.grad(loss, h)
        results.append((loss, grad))
    (ours, ours_grad), (ref, ref_grad) = results
    error = max(float((ours - ref).abs().detach() / ref.abs().detach()),
                float((ours_grad - ref_grad).abs().max() / ref_grad.abs().max()))
    if not error <= CHECK_TOLERANCE:
        sys.exit(f"bench_chunked_loss: chunked and plain differ by {error:.2e} relative (> {CHECK_TOLERANCE}).")
    return error


# ------------------------------------------------------------------------------------------------ memory


def peak_growth(name: str, tokens: int, hidden: int, vocab: int, chunk: int) -> dict[str, float]:
    """The peak RSS growth of one forward + backward of one contender, in this process."""
    step_fn(name, 16, make_inputs(64, 16, 128))()  # warm-up: thread pools, kernels
    inputs = make_inputs(tokens, hidden, vocab)
    step = step_fn(name, chunk, inputs)
    gc.collect()
    was_reset = reset_peak_rss()
    before, _ = rss_kb()
    step()
    _, after = rss_kb()
    return {"growth_mb": (after - before) / 1024, "before_mb": before / 1024, "peak_was_reset": was_reset,
            "hidden_grad_mb": inputs[0].numel() * 4 / 2**20}


def memory_child(args: argparse.Namespace) -> dict:
    """Print, as JSON, the peak RSS growth of one forward + backward of one contender (returns nothing: ``{}``)."""
    torch.set_num_threads(args.threads)
    print(json.dumps(peak_growth(args.memory_child, args.memory_tokens, args.hidden, args.memory_vocab,
                                 args.memory_chunk)))
    return {}


def measure_memory(args: argparse.Namespace, name: str, tokens: int, vocab: int, chunk: int) -> dict[str, float]:
    """Peak RSS growth (MB) of one contender in a fresh process (in this one with ``--quick``)."""
    if args.memory_in_process:
        return peak_growth(name, tokens, args.hidden, vocab, chunk)
    argv = ["--memory-child", name, "--memory-tokens", str(tokens), "--memory-vocab", str(vocab), "--memory-chunk",
            str(chunk), "--hidden", str(args.hidden), "--threads", str(args.threads)]
    result = interpreter_run(__file__, argv + (["--trainable-head"] if args.trainable_head else []),
                             "bench_chunked_loss")
    if not result["peak_was_reset"]:
        say("bench_chunked_loss: cannot reset the peak RSS here; the memory numbers are upper bounds")
    return result


# ------------------------------------------------------------------------------------------------ sections


def sweep_chunk_sizes(args: argparse.Namespace) -> dict:
    """Time (alternating with plain) and peak memory of each chunk size at ``--sweep-tokens`` tokens."""
    inputs = make_inputs(args.sweep_tokens, args.hidden, args.vocab)
    steps = {f"chunk {c}": step_fn("chunked", c, inputs) for c in args.chunk_sizes} | {
        "plain": step_fn("plain", 0, inputs)}
    step_fn("chunked", 16, make_inputs(64, 16, 128))()
    times = alternate(steps, repeats=args.repeats, steps=1, warmup=0)
    del inputs, steps
    gc.collect()
    memory = {f"chunk {c}": measure_memory(args, "chunked", args.sweep_tokens, args.vocab, c)["growth_mb"]
              for c in args.chunk_sizes}
    memory["plain"] = measure_memory(args, "plain", args.sweep_tokens, args.vocab, 0)["growth_mb"]
    say(f"\n### Chunk size ({args.sweep_tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab})\n")
    say("| chunk size | median ms | time / plain | peak MB | memory / plain |")
    say("| ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for name in steps_names(args):
        ms, ratio = statistics.median(times[name]), statistics.median(times[name]) / statistics.median(times["plain"])
        mem_ratio = ratio_of(memory[name], memory["plain"])
        rows.append({"contender": name, "ms": ms, "time_ratio": ratio, "memory_mb": memory[name],
                     "memory_ratio": mem_ratio})
        say(f"| {name.removeprefix('chunk ')} | {ms:.0f} | {ratio:.2f} | {memory[name]:.0f} | {mem_ratio:.3f} |")
    return {"rows": rows, "raw_ms": times}


def ratio_of(ours: float, base: float) -> float:
    return ours / base if base > 0 else float("nan")


def steps_names(args: argparse.Namespace) -> list[str]:
    return [f"chunk {c}" for c in args.chunk_sizes] + ["plain"]


def headline(args: argparse.Namespace) -> dict:
    """Memory (fresh processes) over the vocabulary sweep, then time at the headline size, alternating."""
    memory: dict[str, dict[str, float]] = {"chunked": {}, "plain": {}}
    grad_mb = 0.0
    for vocab in args.vocabs:
        for name in ("chunked", "plain"):
            result = measure_memory(args, name, args.tokens, vocab, args.chunk_size)
            memory[name][str(vocab)] = result["growth_mb"]
            grad_mb = result["hidden_grad_mb"]
        say(f"memory at vocabulary {vocab}: chunked {memory['chunked'][str(vocab)]:.0f} MB, plain "
            f"{memory['plain'][str(vocab)]:.0f} MB")
    step_fn("chunked", 16, make_inputs(64, 16, 128))()
    inputs = make_inputs(args.tokens, args.hidden, args.vocab)
    steps = {name: step_fn(name, args.chunk_size, inputs) for name in ("chunked", "plain")}
    times = alternate(steps, repeats=args.repeats, steps=1, warmup=0)
    time_row = row("forward+backward: chunked / plain", times["chunked"], times["plain"], args.goal_time)
    ours, base = memory["chunked"][str(args.vocab)], memory["plain"][str(args.vocab)]
    memory_row = {"measurement": "peak memory above the inputs: chunked / plain", "ours": ours, "baseline": base,
                  "ratio": ratio_of(ours, base), "goal": args.goal_memory,
                  "met": ratio_of(ours, base) <= args.goal_memory}

    say(f"\n### Headline ({args.tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab}, chunk "
        f"{args.chunk_size}, float32, {'trainable' if args.trainable_head else 'frozen'} head)\n")
    say("| measurement | chunked | plain | ratio | goal | met? |")
    say("| --- | ---: | ---: | ---: | ---: | :---: |")
    say(f"| peak memory above the inputs (MB; hidden's gradient {grad_mb:.0f} MB on each side) | {ours:.0f} | "
        f"{base:.0f} | {memory_row['ratio']:.3f} | ≤ {args.goal_memory} | {'yes' if memory_row['met'] else 'NO'} |")
    say(f"| forward + backward (median ms of {args.repeats}; paired ratio {time_row['paired_ratio']:.2f}) | "
        f"{time_row['ours']:.0f} | {time_row['baseline']:.0f} | {time_row['ratio']:.2f} | ≤ {args.goal_time} | "
        f"{'yes' if time_row['met'] else 'NO'} |")
    say("\n### Peak memory against the vocabulary (MB above the inputs, fresh process each)\n")
    say("| vocabulary | chunked | plain | ratio | one (N, V) float32 logits |")
    say("| ---: | ---: | ---: | ---: | ---: |")
    for vocab in args.vocabs:
        c, p = memory["chunked"][str(vocab)], memory["plain"][str(vocab)]
        say(f"| {vocab} | {c:.0f} | {p:.0f} | {ratio_of(c, p):.3f} | {args.tokens * vocab * 4 / 2**20:.0f} |")
    return {"time": time_row, "memory": memory_row, "memory_mb": memory, "raw_ms": times, "hidden_grad_mb": grad_mb}


def plot(args: argparse.Namespace, memory: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocabs = list(args.vocabs)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(vocabs, [memory["plain"][str(v)] / 1024 for v in vocabs], "s-", color="tab:red",
            label="F.cross_entropy(hidden @ weight.T, labels)")
    ax.plot(vocabs, [memory["chunked"][str(v)] / 1024 for v in vocabs], "o-", color="tab:blue",
            label=f"chunked_cross_entropy(chunk_size={args.chunk_size})")
    ax.plot(vocabs, [args.tokens * v * 4 / 2**30 for v in vocabs], ":", color="grey",
            label="one (N, V) float32 logits tensor")
    ax.set_xscale("log", base=2)
    ax.set_xticks(vocabs, [f"{v // 1024}k" for v in vocabs])
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel("peak memory above the inputs (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.memory_child:
        return memory_child(args)
    torch.set_num_threads(args.threads)
    say_machine()
    started = time.perf_counter()
    head = "trainable head" if args.trainable_head else "frozen head"
    say(f"## chunked_cross_entropy vs F.cross_entropy (float32, {head}; torch {torch.__version__}; "
        f"{args.threads} CPU threads; {args.repeats} repeats)")
    report: dict = {"config": {k: v for k, v in vars(args).items() if not k.startswith("memory_")},
                    "torch": torch.__version__, "check_rel_error": check(args)}
    if args.chunk_sizes:
        report["sweep"] = sweep_chunk_sizes(args)
    report["headline"] = headline(args)
    report["rows"] = [report["headline"]["memory"], report["headline"]["time"]]
    report["seconds"] = time.perf_counter() - started
    if args.plot:
        plot(args, report["headline"]["memory_mb"], args.plot,
             f"chunked vs plain cross-entropy: {args.tokens} tokens, hidden {args.hidden}, float32, {head}")
    say(f"\ncheck (300 tokens x 1000 classes): max relative difference {report['check_rel_error']:.1e}; whole run: "
        f"{report['seconds']:.0f} s")
    write_results(args.json, args.txt, report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run: tiny sizes, 1 repeat, 1 thread")
    add("--tokens", type=int, default=8192)
    add("--hidden", type=int, default=1024)
    add("--vocab", type=int, default=131072, help="the headline vocabulary (timed)")
    add("--vocabs", type=int, nargs="+", default=[16384, 32768, 65536, 131072], help="memory sweep (plot)")
    add("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    add("--chunk-sizes", type=int, nargs="*", default=[256, 512, 1024, 2048], help="sweep; none to skip")
    add("--sweep-tokens", type=int, default=2048)
    add("--repeats", type=int, default=3)
    add("--threads", type=int, default=torch.get_num_threads())
    add("--goal-memory", type=float, default=0.2)
    add("--trainable-head", action="store_true", help="the head's weight requires grad (default: frozen)")
    add("--goal-time", type=float, default=1.1)
    add("--json", default=None)
    add("--memory-in-process", action="store_true", help="measure memory in this process (smoke runs only)")
    add("--txt", default=None, help="write the printed tables here")
    add("--plot", default=None)
    add("--memory-child", choices=("chunked", "plain"), default=None, help=argparse.SUPPRESS)
    add("--memory-tokens", type=int, default=0, help=argparse.SUPPRESS)
    add("--memory-vocab", type=int, default=0, help=argparse.SUPPRESS)
    add("--memory-chunk", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global TRAINABLE_HEAD
    TRAINABLE_HEAD = args.trainable_head
    if args.quick:
        args.tokens, args.hidden, args.vocab, args.vocabs = 256, 32, 512, [256, 512]
        args.chunk_sizes, args.sweep_tokens, args.chunk_size = [64], 128, 64
        args.repeats, args.threads, args.memory_in_process = 1, 1, True
    if args.vocab not in args.vocabs:
        args.vocabs = sorted([*args.vocabs, args.vocab])
    return args


if __name__ == "__main__":
    main()
