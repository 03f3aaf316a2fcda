"""Benchmark: per-rank memory and step time of 2-way tensor parallelism against one process and DDP, 2 CPU ranks.

What is compared. The project's decoder (`lightning_peft.nn.TransformerDecoder`: hidden 512, 4 layers, 8 heads,
SwiGLU feed-forward 2048, vocabulary 8192, untied head: 25.2M parameters; ``--quick``: hidden 64, 2 layers,
vocabulary 256), float32, next-token cross-entropy on a global batch of 8 sequences of 128 tokens, AdamW, in two
modes: full fine-tuning and LoRA (rank 8 on every projection, the rest frozen). Three contenders on the same model,
the same global batch and the same CPU cores:

- **single**: one process, 2 threads, the whole batch;
- **ddp**: ``torch.nn.parallel.DistributedDataParallel``, 2 processes (gloo, 1 thread each), 4 sequences each;
- **tp**: :func:`lightning_peft.parallel.tensor_parallel.parallelize` with ``plan="auto"`` (what
  ``TensorParallelStrategy(tensor_parallel_size=2)`` applies), 2 processes (gloo, 1 thread each), every rank the
  whole batch and half of every layer.

The loop is plain PyTorch (the engines the strategies drive, without Lightning's per-step overhead, the same for
all three).

Memory: :func:`lightning_peft.parallel.memory.rank_bytes` on each rank: parameters (local shards), gradients
(just before the optimizer step of the last step), optimizer state and every other live tensor (after it); and the
peak RSS growth of one step (``VmHWM`` reset to the current RSS before the last step), which adds the activations.
Tables show rank 0; ratios are to ``single``. Memory is deterministic: measured in the first repeat.

Time: each contender runs ``--warmup`` untimed and ``--steps`` timed steps (``time.perf_counter`` around each
step, on rank 0; the ranks move in lockstep through the collectives); the contenders alternate inside every repeat
(the first one rotates between repeats), each launch a fresh set of processes; the table shows the median over
repeats of each run's median step time, and the ratio to ``single``. No goal: tensor parallelism trades two
all-reduces per layer (forward and backward) for halving the per-rank weights, which on CPU with gloo costs more
than it saves in compute; its point is memory.

Usage (the numbers on ``docs/tensor_parallel.md``)::

    python benchmarks/bench_tensor_parallel.py --json benchmarks/results/tensor_parallel.json \\
        --txt benchmarks/results/tensor_parallel.txt

``--quick``: the small model, 1 + 2 steps, 1 repeat (a smoke run of about 30 s, most of it imports; its numbers
mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import exit_worker, say, say_machine, write_results  # noqa: E402

CONTENDERS = ("single", "ddp", "tp")
MODES = ("full", "lora")
CATEGORIES = ("parameters", "gradients", "optimizer_state", "other")


def shapes(quick: bool) -> dict:
    if quick:
        return {"vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_size": 128,
                "batch": 4, "length": 16}
    return {"vocab_size": 8192, "hidden_size": 512, "num_layers": 4, "num_heads": 8, "ffn_size": 2048,
            "batch": 8, "length": 128}


# ------------------------------------------------------------------------------------------------ one rank


def worker(args: argparse.Namespace) -> None:
    """One rank of one run: builds, splits or wraps the model, trains, writes its numbers to ``args.out``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from _memory import reset_peak_rss, rss_kb
    from lightning_peft.nn import TransformerDecoder
    from lightning_peft.peft import inject_lora
    from lightning_peft.parallel.memory import rank_bytes

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(2 if args.contender == "single" else 1)
    if world > 1:
        dist.init_process_group("gloo")
    size = shapes(args.quick)
    torch.manual_seed(0)
    model = TransformerDecoder(
        vocab_size=size["vocab_size"], hidden_size=size["hidden_size"], num_layers=size["num_layers"],
        num_heads=size["num_heads"], ffn_size=size["ffn_size"],
    )
    if args.mode == "lora":
        inject_lora(model, rank=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                                             "gate_proj", "down_proj"])
    if args.contender == "tp":
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_peft.parallel.tensor_parallel import parallelize

        parallelize(model, init_device_mesh("cpu", (world,)))
        run = model
    elif args.contender == "ddp":
        run = torch.nn.parallel.DistributedDataParallel(model)
    else:
        run = model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, size["vocab_size"], (size["batch"], size["length"]), generator=generator)
    if args.contender == "ddp":
        batch = batch.chunk(world)[rank]  # (B / world, L)
    grads: dict[str, int] = {}
    times, peak = [], 0
    for step in range(args.warmup + args.steps):
        last = step == args.warmup + args.steps - 1
        if last:
            reset_peak_rss()
            before = rss_kb()[0]
        start = time.perf_counter()
        logits = run(batch)  # (B, L, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, size["vocab_size"]), batch[:, 1:].reshape(-1))
        loss.backward()
        if last:
            grads = rank_bytes(model, [optimizer])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        if last:
            peak = rss_kb()[1] - before
    held = rank_bytes(model, [optimizer])
    memory = {"parameters": held["parameters"], "gradients": grads["gradients"],
              "optimizer_state": held["optimizer_state"], "other": held["other"], "peak_rss_growth": peak * 1024}
    Path(args.out).write_text(json.dumps({"rank": rank, "step_s": statistics.median(times), "memory": memory}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    exit_worker()


# ------------------------------------------------------------------------------------------------ launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, contender: str, mode: str, workdir: str) -> list[dict]:
    """Runs one contender in fresh processes; the ranks' reports."""
    world = 1 if contender == "single" else 2
    port = str(_free_port())
    procs, outs = [], []
    for rank in range(world):
        out = Path(workdir) / f"{contender}-{mode}-{rank}.json"
        outs.append(out)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world),
               "RANK": str(rank), "OMP_NUM_THREADS": "2" if contender == "single" else "1"}
        command = [sys.executable, __file__, "--worker", "--contender", contender, "--mode", mode, "--out", str(out),
                   "--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{contender}/{mode} failed:\n" + "\n".join(log[-3000:] for log in logs))
    return [json.loads(out.read_text()) for out in outs]


def _mib(value: float) -> str:
    return f"{value / 2**20:8.2f}"


def report(results: dict, args: argparse.Namespace) -> dict:
    summary: dict = {"shapes": shapes(args.quick), "repeats": args.repeats, "steps": args.steps, "modes": {}}
    for mode in args.modes:
        runs = results[mode]
        say(f"\n## {mode}: per-rank memory (rank 0, MiB) and step time (median of {args.repeats} repeats)\n")
        say("| contender | parameters | gradients | optimizer state | other | peak RSS growth (step) | "
            "step s | step vs single | parameters vs single |")
        say("|---|---|---|---|---|---|---|---|---|")
        single_time = statistics.median(r[0]["step_s"] for r in runs["single"])
        single_params = runs["single"][0][0]["memory"]["parameters"]
        summary["modes"][mode] = {}
        for contender in args.contenders:
            memory = runs[contender][0][0]["memory"]  # first repeat, rank 0
            step = statistics.median(r[0]["step_s"] for r in runs[contender])
            say(f"| {contender} | {_mib(memory['parameters'])} | {_mib(memory['gradients'])} | "
                f"{_mib(memory['optimizer_state'])} | {_mib(memory['other'])} | {_mib(memory['peak_rss_growth'])} | "
                f"{step:.4f} | {step / single_time:.2f}x | {memory['parameters'] / single_params:.2f}x |")
            summary["modes"][mode][contender] = {
                "step_s": step, "step_ratio_to_single": step / single_time,
                "memory_rank0": memory, "memory_all_ranks": [r["memory"] for r in runs[contender][0]],
                "parameters_ratio_to_single": memory["parameters"] / single_params,
                "step_s_per_repeat": [r[0]["step_s"] for r in runs[contender]],
            }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--json")
    parser.add_argument("--txt")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    say_machine()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 1, 2
    if "single" not in args.contenders:
        args.contenders.insert(0, "single")  # the reference of every ratio
    size = shapes(args.quick)
    say(f"# Tensor parallelism (2 ranks) against one process and DDP: TransformerDecoder hidden {size['hidden_size']}, "
        f"{size['num_layers']} layers, vocabulary {size['vocab_size']}, global batch {size['batch']} x "
        f"{size['length']} tokens, AdamW, float32")
    results: dict = {mode: {c: [] for c in args.contenders} for mode in args.modes}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for mode in args.modes:
                shift = repeat % len(args.contenders)
                order = args.contenders[shift:] + args.contenders[:shift]
                for contender in order:
                    results[mode][contender].append(launch(args, contender, mode, workdir))
    write_results(args.json, args.txt, report(results, args))


if __name__ == "__main__":
    main()
