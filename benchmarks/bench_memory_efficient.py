"""Benchmark: peak training memory of the memory-efficient stack (LoRA + NF4 base + activation checkpointing +
chunked loss) against LoRA alone, on our ``TransformerDecoder``, and what each technique adds.

What is compared. ``TransformerDecoder(vocab 32,000, hidden 768, 12 heads, 12 blocks, SwiGLU ffn 3072, untied
head)``, float32 on the CPU, LoRA rank 16 (alpha 32, ``B`` drawn small so that every adapter is on the gradient
path) on every linear layer of every block (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
``up_proj``, ``down_proj``: 84 layers), embeddings and head frozen and never quantized (the head is not adapted, so
the chunked loss reads it directly), random token ids and labels, batch 8 x 512. One training step: forward, the
language-model cross-entropy, backward, ``torch.optim.AdamW.step`` over the adapters. Contenders, each technique
added one at a time (``--configs``):

- **lora** (A): float32 base, ordinary autograd, ``F.cross_entropy`` on the full ``(B*L, V)`` logits;
- **+nf4**: the adapted layers' base weights in NF4 (``inject_lora(quantize="nf4")``, torchao);
- **+checkpointing**: and every ``TransformerBlock`` checkpointed (non-reentrant, ``apply_activation_checkpointing``);
- **+chunked** (B): and ``chunked_cross_entropy(decoder.hidden_states(ids), lm_head.weight, labels, 1024)``.

Memory: each contender in a fresh process (``--memory-child``) with ``MALLOC_MMAP_THRESHOLD_=131072`` (as
``bench_checkpointing.py``: every block of 128 KiB or more its own mapping, returned on free, so RSS follows the live
tensors; ``--malloc default`` for glibc as a user gets it). The child warms up (one step of a 1-block, 64-wide model:
thread pools, kernels, torchao), reads its RSS (``start``), builds and prepares the model (LoRA, quantization,
checkpointing; float32 weights freed), reads its RSS again (``model``), resets the kernel's peak counter
(``VmHWM``, ``/proc/self/clear_refs``) and runs one step; ``VmHWM`` after it is the step's peak. Reported, in MB:

- **peak training memory** = peak during the step - ``start``: the model as resident for training plus everything
  the step holds at its worst moment (activations, logits, gradients, optimizer state). Goal: B / A **<= 0.35**;
- **model** = ``model`` - ``start`` (the resident weights) and **step** = peak - ``model`` (above the built model);
- **build peak** = the peak while building, above ``start`` (a float32 model exists before NF4 replaces it: a
  transient of loading, not of training).

Time: the same child runs ``--timed-steps`` more steps after the measured one (the first pays page faults); the
median is each contender's step time, and the table shows it over A's. One run, one process per contender in the
order of ``--configs``, so the contenders do not share a CPU.

Usage (the numbers on ``docs/qlora.md``, "Together: the memory-efficient stack")::

    python benchmarks/bench_memory_efficient.py --json benchmarks/results/memory_efficient.json \\
        --txt benchmarks/results/memory_efficient.txt --plot docs/img/memory_efficient.png

``--batch-size`` / ``--seq-len`` / ``--hidden`` / ``--layers`` / ``--vocab`` change the size. ``--quick``: 2 blocks,
64 wide, vocabulary 512, 2 x 32 tokens, chunk 16, memory measured in this process (a smoke run; numbers mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _memory import MALLOC_MODES, interpreter_run, reset_peak_rss, rss_kb  # noqa: E402
from _report import finish, output_arguments, save_figure, say, say_machine  # noqa: E402
from bench_checkpointing import make_inputs  # noqa: E402  (ids, labels) (B, L), uniform in [0, args.vocab)
from lightning_peft.nn import TransformerDecoder, apply_activation_checkpointing, chunked_cross_entropy  # noqa: E402
from lightning_peft.peft import inject_lora  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {  # name: (quantize, checkpointing, chunked loss), each one technique more than the one before
    "lora": (None, False, False),
    "+nf4": ("nf4", False, False),
    "+checkpointing": ("nf4", True, False),
    "+chunked": ("nf4", True, True),
}
GOAL = 0.35
SIZES = {"batch_size": (8, 2), "seq_len": (512, 32), "hidden": (768, 64), "heads": (12, 2), "layers": (12, 2),
         "vocab": (32000, 512), "chunk": (1024, 16), "rank": (16, 4)}


def build(args: argparse.Namespace, config: str, layers: int | None = None, hidden: int | None = None) -> nn.Module:
    quantize, checkpointing, _ = CONFIGS[config]
    hidden = hidden or args.hidden
    torch.manual_seed(0)
    model = TransformerDecoder(vocab_size=args.vocab, hidden_size=hidden, num_layers=layers or args.layers,
                               num_heads=args.heads if hidden == args.hidden else 2, ffn_size=4 * hidden,
                               max_position_embeddings=args.seq_len)
    inject_lora(model, rank=args.rank, alpha=2 * args.rank, target_modules=TARGETS, quantize=quantize)
    with torch.no_grad():  # B != 0: the adapters' A receive gradients too, as after the first update
        for p in (p for name, p in model.named_parameters() if "lora_B" in name):
            p.normal_(0, 0.02)
    if checkpointing:
        apply_activation_checkpointing(model)
    return model.train()


def loss_of(model: nn.Module, config: str, ids: Tensor, labels: Tensor, chunk: int) -> Tensor:
    if CONFIGS[config][2]:
        hidden = model.hidden_states(ids)  # (B, L, H); the (B*L, V) logits never exist
        return chunked_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, labels.flatten(), chunk_size=chunk)
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())  # logits (B*L, V)


def step_fn(model: nn.Module, config: str, inputs: tuple[Tensor, Tensor], chunk: int):
    """One training step: forward, loss, backward, AdamW step; gradients dropped after it (as Lightning does)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step() -> float:
        loss = loss_of(model, config, *inputs, chunk)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def measure_one(args: argparse.Namespace, config: str) -> dict[str, float]:
    """Memory (MB) and step times (ms) of one contender, in this process (see the module docstring)."""
    torch.set_num_threads(args.threads)
    settle = (lambda: None) if args.quick else gc.collect  # --quick: in a full process gc takes seconds
    warm = build(args, config, layers=1, hidden=64)
    step_fn(warm, config, make_inputs(args, 1, 8), 4)()  # thread pools, kernels, torchao's dispatch
    del warm
    settle()
    start, _ = rss_kb()
    was_reset = reset_peak_rss()
    model = build(args, config)
    settle()
    ready, build_peak = rss_kb()
    step = step_fn(model, config, make_inputs(args, args.batch_size, args.seq_len), args.chunk)
    settle()
    was_reset = reset_peak_rss() and was_reset
    began = time.perf_counter()
    loss = step()
    first = time.perf_counter() - began
    _, peak = rss_kb()
    times = []
    for _ in range(args.timed_steps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return {"peak_mb": (peak - start) / 1024, "model_mb": (ready - start) / 1024, "step_mb": (peak - ready) / 1024,
            "build_peak_mb": (build_peak - start) / 1024, "first_step_ms": first * 1e3,
            "step_ms": statistics.median(times) * 1e3 if times else first * 1e3, "loss": loss,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad), "peak_was_reset": was_reset}


def measure(args: argparse.Namespace, config: str) -> dict[str, float]:
    """``measure_one`` in a fresh process with the malloc mode's environment (``--quick``: in this one)."""
    if args.quick:
        return measure_one(args, config)
    sizes = [text for field in SIZES for text in (f"--{field.replace('_', '-')}", str(getattr(args, field)))]
    argv = ["--memory-child", config, "--threads", str(args.threads), "--timed-steps", str(args.timed_steps), *sizes]
    return interpreter_run(__file__, argv, "bench_memory_efficient", args.malloc)


def _over(value: float, base: float) -> float:
    """``value / base``; NaN where ``base`` is not positive (``--quick``'s in-process peaks can be 0)."""
    return value / base if base > 0 else math.nan


def report_table(results: dict[str, dict[str, float]]) -> dict[str, float]:
    base = results["lora"]
    say("\n| contender | peak training memory (MB) | / lora | model (MB) | step above model (MB) | build peak (MB) "
        "| step (s) | / lora |")
    say("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    before = None
    for name, r in results.items():
        say(f"| {name} | {r['peak_mb']:.0f} | {_over(r['peak_mb'], base['peak_mb']):.3f} | {r['model_mb']:.0f} | "
            f"{r['step_mb']:.0f} | {r['build_peak_mb']:.0f} | {r['step_ms'] / 1e3:.2f} | "
            f"{r['step_ms'] / base['step_ms']:.2f} |")
        if before is not None:
            r["saved_mb"] = before["peak_mb"] - r["peak_mb"]
        before = r
    saved = ", ".join(f"{name} {r['saved_mb']:.0f} MB" for name, r in results.items() if "saved_mb" in r)
    say(f"\npeak training memory saved by each contender against the one before it: {saved}")
    last = results[list(results)[-1]]
    ratio = _over(last["peak_mb"], base["peak_mb"])
    met = ratio <= GOAL
    say(f"peak training memory, {list(results)[-1]} (all together) / lora: {ratio:.3f} (goal <= {GOAL}: "
        f"{'met' if met else 'NOT met'}); step time ratio {last['step_ms'] / base['step_ms']:.2f}")
    return {"peak_ratio": ratio, "step_ratio": last["step_ms"] / base["step_ms"], "goal": GOAL, "met": met}


def plot(results: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    model = [results[n]["model_mb"] for n in names]
    step = [results[n]["step_mb"] for n in names]
    ax.bar(names, model, label="model (resident weights)", color="#4c72b0")
    ax.bar(names, step, bottom=model, label="step above the model (activations, logits, grads, AdamW)",
           color="#dd8452")
    for i, n in enumerate(names):
        ax.text(i, results[n]["peak_mb"], f"{results[n]['peak_mb']:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("peak training memory (MB)")
    ax.set_title("TransformerDecoder, LoRA r=16 on every block linear: one training step", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, memory in this process (smoke run)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--malloc", choices=sorted(MALLOC_MODES), default="mmap128k")
    parser.add_argument("--threads", type=int, default=None, help="default: all (--quick: 1)")
    parser.add_argument("--timed-steps", type=int, default=1, help="steps timed after the measured one")
    for field, (real, _) in SIZES.items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, help=f"default {real}")
    parser.add_argument("--memory-child", choices=list(CONFIGS), default=None, help=argparse.SUPPRESS)
    output_arguments(parser)
    args = parser.parse_args(argv)
    say_machine()
    for field, (real, quick) in SIZES.items():
        if getattr(args, field) is None:
            setattr(args, field, quick if args.quick else real)
    if args.threads is None:
        args.threads = 1 if args.quick else torch.get_num_threads()
    if args.memory_child:
        print(json.dumps(measure_one(args, args.memory_child)))
        return {}
    if "lora" not in args.configs:
        parser.error("--configs must include lora (the reference of every ratio)")
    started = time.perf_counter()
    say(f"torch {torch.__version__}, python {platform.python_version()}, {args.threads} threads of {os.cpu_count()} "
        f"CPUs, CPU capability {torch.backends.cpu.get_cpu_capability()}, malloc {args.malloc}")
    say(f"TransformerDecoder hidden {args.hidden}, {args.layers} blocks, vocabulary {args.vocab}, batch "
        f"{args.batch_size} x {args.seq_len}, LoRA r={args.rank} on {', '.join(TARGETS)}; chunk {args.chunk}")
    results = {}
    for config in [c for c in CONFIGS if c in args.configs]:
        results[config] = measure(args, config)
        if not results[config]["peak_was_reset"]:
            say("bench_memory_efficient: cannot reset the peak RSS here; the step numbers are upper bounds")
        r = results[config]
        say(f"  {config}: peak {r['peak_mb']:.0f} MB, step {r['step_ms'] / 1e3:.2f} s, loss {r['loss']:.3f}")
    summary = report_table(results)
    if args.plot:
        plot(results, args.plot)
    report = {"config": vars(args) | {"cpu_capability": torch.backends.cpu.get_cpu_capability()},
              "results": results, "summary": summary}
    return finish(report, started, args.json, args.txt)


if __name__ == "__main__":
    main()
