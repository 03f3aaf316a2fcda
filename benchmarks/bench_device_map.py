"""Benchmark: what a device map costs (hook overhead, step time) and what it buys (parameter memory per device).

What is compared. A Llama-layout ``TransformerDecoder`` (hidden 256, 8 layers, 4 heads, vocabulary 8,000, untied
head; ``--quick``: hidden 32, 4 layers) with LoRA (rank 8 on q/v) trained one step at a time (forward, token
cross-entropy, backward) on a (B=8, L=128) batch of random tokens, fp32:

- **one device**: the model as it is, no hooks (the baseline);
- **map N**: the same model dispatched by ``infer_device_map`` over N devices (2 and 4): on the CPU, N ``"cpu"``
  entries (every hook and copy runs, all no-ops), which measures the strategy's own overhead; with CUDA devices
  (``--cuda``, at least N), cuda:0..N-1, which measures the real split.

All contenders share the weights and the batch and compute the same loss (the script checks they agree before
timing: exactly on the CPU, within 1e-4 across GPUs). Time: contenders alternate inside every repeat (the first one
rotates), one untimed warm-up step each, ``--steps`` steps per repeat; medians over ``--repeats`` and the ratio to
one device. Memory: the parameter bytes each device holds under each map (exact, from the placement), and with
``--cuda`` each device's peak allocated memory in a step (``torch.cuda.max_memory_allocated``). Goals: on the CPU,
map N within 1.05x of one device (the hooks are a handful of Python calls per layer); with GPUs, the largest
device's parameter bytes about 1/N of the model's. A device map does not make a step faster (one device works at a
time); a pipeline does (see docs/pipeline.md).

Usage (the numbers on ``docs/device_map.md``)::

    python benchmarks/bench_device_map.py --json benchmarks/results/device_map.json \\
        --txt benchmarks/results/device_map.txt            # add --cuda on a machine with >= 2 GPUs

``--quick``: a 4-layer 32-wide model, 2 repeats of 2 steps (a smoke run of a few seconds; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import say, say_machine, write_results  # noqa: E402
from bench_lora import alternate  # noqa: E402
from lightning_peft.nn import TransformerDecoder  # noqa: E402
from lightning_peft.peft import inject_lora  # noqa: E402
from lightning_peft.parallel import balanced_groups, dispatch_model  # noqa: E402

CPU_GOAL = 1.05


def build(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    model = TransformerDecoder(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                               num_heads=args.heads)
    inject_lora(model, rank=8, target_modules=["q_proj", "v_proj"])
    return model


def step_fn(model: nn.Module, ids: torch.Tensor):
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> float:
        logits = model(ids)  # (B, L, V), back on the input's device
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        for p in params:
            p.grad = None
        return loss.item()

    return step


def group_mb(model: nn.Module, groups: dict[str, int]) -> list[float]:
    """Parameter MB of each group (each tensor counted once, in the group of its first unit)."""
    sizes = [0.0] * (max(groups.values()) + 1)
    seen: set[int] = set()
    for unit, group in groups.items():
        params = [p for p in model.get_submodule(unit).parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        sizes[group] += sum(p.numel() * p.element_size() for p in params) / 2**20
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cuda", action="store_true", help="split over cuda:0..N-1 instead of N 'cpu' entries")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--txt")
    args = parser.parse_args()
    say_machine()
    if args.quick:
        args.hidden, args.layers, args.heads, args.vocab, args.batch, args.length = 32, 4, 2, 500, 2, 32
        args.repeats, args.steps, args.groups = 2, 2, [2]
        torch.set_num_threads(1)
    kind = "cuda" if args.cuda else "cpu"
    if args.cuda and torch.cuda.device_count() < max(args.groups):
        raise SystemExit(f"--cuda needs {max(args.groups)} CUDA devices; this machine has {torch.cuda.device_count()}.")

    base = build(args)
    first = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    ids = torch.randint(0, args.vocab, (args.batch, args.length), generator=torch.Generator().manual_seed(1)).to(first)
    models = {"one device": copy.deepcopy(base).to(first)}
    maps = {}
    for n in args.groups:
        devices = [f"cuda:{i}" for i in range(n)] if args.cuda else ["cpu"] * n
        model = copy.deepcopy(base)
        groups = balanced_groups(model, n)
        dispatch_model(model, {unit: devices[group] for unit, group in groups.items()}, first)
        models[f"map {n}"] = model
        maps[f"map {n}"] = {"groups": groups, "device_map": {unit: devices[g] for unit, g in groups.items()}}

    steps = {name: step_fn(model, ids) for name, model in models.items()}
    losses = {name: fn() for name, fn in steps.items()}
    reference = losses["one device"]
    for name, loss in losses.items():
        ok = loss == reference if kind == "cpu" else abs(loss - reference) <= 1e-4 * abs(reference)
        if not ok:
            raise SystemExit(f"{name}: loss {loss!r} differs from one device's {reference!r}; not timing.")

    say(f"device map benchmark on {kind}: decoder hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        f"LoRA r=8 on q/v; batch {args.batch} x {args.length}; {args.repeats} repeats x {args.steps} steps")
    total_mb = sum(group_mb(base, balanced_groups(base, 1)))
    say(f"parameters: {total_mb:.2f} MB")
    say()
    say("placement (parameter MB per group, in forward order)")
    report: dict = {"config": vars(args), "kind": kind, "parameter_mb": total_mb, "placement": {}, "time": [],
                    "memory": {}}
    for name, info in maps.items():
        sizes = group_mb(models[name], info["groups"])
        report["placement"][name] = {"group_mb": sizes, "largest_share": max(sizes) / total_mb, **info}
        say(f"  {name}: " + " | ".join(f"{s:.2f}" for s in sizes) + f"   largest group {max(sizes) / total_mb:.2f} of "
            "the model")

    times = alternate(steps, repeats=args.repeats, steps=args.steps, warmup=1)
    say()
    say(f"{'contender':<12} {'ms/step':>9} {'ratio':>7}")
    base_ms = statistics.median(times["one device"])
    for name, values in times.items():
        ms = statistics.median(values)
        goal = CPU_GOAL if kind == "cpu" and name != "one device" else None
        report["time"].append({"contender": name, "ms": ms, "ratio": ms / base_ms, "range": [min(values), max(values)],
                               "goal": goal, "met": None if goal is None else ms / base_ms <= goal})
        say(f"{name:<12} {ms:>9.2f} {ms / base_ms:>7.3f}" + (f"   goal <= {goal}" if goal else ""))

    if args.cuda:
        say()
        say("peak allocated memory per device in one step (MB)")
        for name, fn in steps.items():
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)
            fn()
            peaks = [torch.cuda.max_memory_allocated(i) / 2**20 for i in range(max(args.groups))]
            report["memory"][name] = peaks
            say(f"  {name}: " + " | ".join(f"cuda:{i} {p:.1f}" for i, p in enumerate(peaks)))
    write_results(args.json, args.txt, report)


if __name__ == "__main__":
    main()
