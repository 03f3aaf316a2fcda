"""Benchmark: PipelineStrategy (2 CPU processes) against one process and DDP; throughput against the bubble.

What is compared. The same `CausalLM` (``TransformerDecoder``: hidden 256, 8 layers, 4 heads, vocabulary 2,000,
untied head), fp32, AdamW, on random token batches of ``B = 16`` sequences x 128 tokens, under a real Lightning
``Trainer`` on the CPU (gloo), ``--threads`` threads per process:

- **single**: one process, ``devices=1``, the whole batch;
- **ddp**: 2 processes, ``strategy="ddp"``, each half the batch (the same global batch);
- **pipeline-1f1b** / **pipeline-gpipe**: 2 processes, ``PipelineStrategy(num_stages=2, num_microbatches=m)``
  (stages balanced by parameter count), every process the whole batch as ``m`` micro-batches.

Each contender is one fit of ``--steps`` steps in fresh processes (started here, ranks by environment variables);
the first ``--warmup`` steps are not timed. Per step, every rank's ``training_step`` to ``on_train_batch_end`` is
timed and the slowest rank counts; a run's time is its median step. Contenders alternate inside every repeat (the
order rotates between repeats); tables show the median over ``--repeats`` and ratios to one process.

Memory per rank, after the last step: the bytes of parameters, gradients and optimizer state the rank holds
(``lightning_peft.parallel.memory.rank_bytes``: a pipeline rank holds its stages only) and the process's peak
RSS (``VmHWM``; it includes the interpreter, torch and Lightning, about the same for every contender).

Bubble: for ``m`` in 1, 2, 4, 8 (``--microbatches``) the pipeline's tokens per second against the prediction
``throughput(m) = throughput(inf) * (1 - (p - 1) / (m + p - 1))`` with ``p = 2``: the plot shows measured / best
measured next to the predicted ``1 - bubble``, scaled to meet at the largest ``m`` (per-micro-batch overhead, which
the formula leaves out, grows with ``m`` on small micro-batches).

Usage (the numbers on ``docs/pipeline.md``)::

    python benchmarks/bench_pipeline.py --json benchmarks/results/pipeline.json \\
        --txt benchmarks/results/pipeline.txt --plot docs/img/pipeline.png

``--quick``: a 2-layer 32-wide model, 3 steps, 1 repeat, micro-batches 1 and 2 (a smoke run of about a minute,
mostly process starts; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import exit_worker, say, say_machine, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> None:
    """One rank of one contender: a fit of ``args.steps`` steps; writes its timings and memory to ``args.out``."""
    import warnings

    import lightning.pytorch as pl
    import torch
    from _memory import rss_kb
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, Dataset

    from lightning_peft.modules import CausalLM
    from lightning_peft.strategies import PipelineStrategy
    from lightning_peft.parallel.memory import rank_bytes

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    world = 1 if args.worker == "single" else 2

    class Tokens(Dataset):
        def __len__(self) -> int:
            return args.batch_size * args.steps

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            generator = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(0, args.vocab, (args.seq_len,), generator=generator)}

    class Timer(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.memory: dict[str, int] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seconds = torch.tensor(time.perf_counter() - self.started, dtype=torch.float64)
            if world > 1:
                torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
            self.seconds.append(float(seconds))
            if batch_idx == args.steps - 1:
                self.memory = rank_bytes(pl_module, trainer.optimizers)

    torch.manual_seed(0)
    model = CausalLM(vocab_size=args.vocab, decoder={"hidden_size": args.hidden, "num_layers": args.layers,
                                                     "num_heads": args.heads}, warmup_fraction=0.0)
    if args.worker == "single":
        strategy = "auto"
    elif args.worker == "ddp":
        strategy = "ddp"
    else:
        strategy = PipelineStrategy(num_stages=2, schedule=args.worker.split("-")[1], num_microbatches=args.m)
    timer = Timer()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[timer], use_distributed_sampler=args.worker == "ddp")
    per_rank_batch = args.batch_size // (2 if args.worker == "ddp" else 1)
    trainer.fit(model, DataLoader(Tokens(), batch_size=per_rank_batch))
    _, peak_kb = rss_kb()
    Path(args.out).write_text(json.dumps({"seconds": timer.seconds, "memory": timer.memory, "peak_rss_kb": peak_kb}))
    if world > 1:
        torch.distributed.destroy_process_group()
    exit_worker()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, contender: str, m: int, out: Path) -> list[dict]:
    """Runs one contender in fresh processes; returns every rank's report."""
    world = 1 if contender == "single" else 2
    port = str(_free_port())
    common = [sys.executable, __file__, "--worker", contender, "--m", str(m), *_model_args(args)]
    procs, files = [], []
    for rank in range(world):
        file = out / f"{contender}-m{m}-rank{rank}.json"
        files.append(file)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if world > 1:
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world), "RANK": str(rank),
                    "LOCAL_RANK": str(rank), "NODE_RANK": "0"}
        procs.append(subprocess.Popen([*common, "--out", str(file)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        log = proc.communicate(timeout=1800)[0]
        if proc.returncode:
            raise RuntimeError(f"{contender} (m={m}) failed:\n{log[-3000:]}")
    return [json.loads(f.read_text()) for f in files]


def _model_args(args: argparse.Namespace) -> list[str]:
    names = ("batch_size", "seq_len", "hidden", "layers", "heads", "vocab", "steps", "threads")
    return [x for n in names for x in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]


# ------------------------------------------------------------------------------------------------ driver
def run_all(args: argparse.Namespace, out: Path) -> dict[str, list[dict]]:
    """Every (contender, m), alternating inside every repeat; returns the rank reports per repeat."""
    runs = [("single", 1), ("ddp", 1)] + [("pipeline-1f1b", m) for m in args.microbatches if m >= 2]
    runs += [("pipeline-gpipe", m) for m in args.microbatches]
    results: dict[str, list[dict]] = {f"{c}-m{m}": [] for c, m in runs}
    for repeat in range(args.repeats):
        shift = repeat % len(runs)
        for contender, m in runs[shift:] + runs[:shift]:
            ranks = launch(args, contender, m, out)
            step = statistics.median(ranks[0]["seconds"][args.warmup:])
            results[f"{contender}-m{m}"].append({"step_s": step, "ranks": ranks})
            say(f"repeat {repeat + 1}: {contender:>15} m={m}: {step * 1000:8.1f} ms/step")
    return results


def report_tables(args: argparse.Namespace, results: dict[str, list[dict]]) -> dict:
    tokens = args.batch_size * args.seq_len
    rows = {}
    for key, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)
        last = runs[-1]["ranks"]
        rows[key] = {
            "step_ms": step * 1000, "tokens_per_s": tokens / step,
            "state_mb": [sum(v for k, v in r["memory"].items() if k != "other") / 2**20 for r in last],
            "peak_rss_mb": [r["peak_rss_kb"] / 1024 for r in last],
        }
    base = rows["single-m1"]
    say("\n### step time and memory per rank (median over repeats)\n")
    say("| contender | ms / step | vs one process | params + grads + optimizer state per rank (MB) | "
        "peak RSS per rank (MB) |")
    say("| --- | ---: | ---: | --- | --- |")
    for key, row in rows.items():
        state = " / ".join(f"{v:.1f}" for v in row["state_mb"])
        rss = " / ".join(f"{v:.0f}" for v in row["peak_rss_mb"])
        say(f"| {key} | {row['step_ms']:.1f} | {row['step_ms'] / base['step_ms']:.2f}x | {state} | {rss} |")
    say("\n### pipeline throughput against the bubble (p = 2)\n")
    say("| schedule | m | tokens/s | bubble (p-1)/(m+p-1) | measured / best | predicted / predicted at max m |")
    say("| --- | ---: | ---: | ---: | ---: | ---: |")
    for schedule in ("gpipe", "1f1b"):
        keys = [(m, f"pipeline-{schedule}-m{m}") for m in args.microbatches if f"pipeline-{schedule}-m{m}" in rows]
        if not keys:
            continue
        best = max(rows[k]["tokens_per_s"] for _, k in keys)
        top = 1 - 1 / (max(m for m, _ in keys) + 1)
        for m, key in keys:
            bubble = 1 / (m + 1)
            rows[key] |= {"bubble": bubble, "relative": rows[key]["tokens_per_s"] / best,
                          "predicted_relative": (1 - bubble) / top}
            say(f"| {schedule} | {m} | {rows[key]['tokens_per_s']:.0f} | {bubble:.3f} | "
                f"{rows[key]['relative']:.2f} | {rows[key]['predicted_relative']:.2f} |")
    return rows


def plot(args: argparse.Namespace, rows: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for schedule, color in (("gpipe", "tab:blue"), ("1f1b", "tab:green")):
        ms = [m for m in args.microbatches if f"pipeline-{schedule}-m{m}" in rows]
        if ms:
            ax.plot(ms, [rows[f"pipeline-{schedule}-m{m}"]["relative"] for m in ms], "o-", color=color,
                    label=f"measured, {schedule} (tokens/s over best)")
    ms = list(args.microbatches)
    top = 1 - 1 / (max(ms) + 1)
    ax.plot(ms, [(1 - 1 / (m + 1)) / top for m in ms], "k--", label="predicted 1 - (p-1)/(m+p-1), p = 2")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("relative throughput")
    ax.set_ylim(0, 1.1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    say(f"\nwrote {path}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    say_machine()
    if args.worker:
        worker(args)
        return {}
    import tempfile

    import torch

    started = time.perf_counter()
    shape = (f"CausalLM H={args.hidden}, {args.layers} layers, vocab {args.vocab}; batch {args.batch_size} x "
             f"{args.seq_len} tokens, fp32, {args.threads} threads per process")
    say(f"## PipelineStrategy vs one process and DDP ({shape}; torch {torch.__version__}; {args.repeats} repeats)\n")
    with tempfile.TemporaryDirectory() as tmp:
        results = run_all(args, Path(tmp))
    report: dict = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "m")},
                    "torch": torch.__version__, "raw": {k: [r["step_s"] for r in v] for k, v in results.items()}}
    report["rows"] = report_tables(args, results)
    if args.plot:
        plot(args, report["rows"], args.plot, f"pipeline throughput vs bubble: {shape}")
    report["seconds"] = time.perf_counter() - started
    say(f"\nwhole run: {report['seconds']:.0f} s")
    write_results(args.json, args.txt, report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--batch-size", type=int, default=16)
    add("--seq-len", type=int, default=128)
    add("--hidden", type=int, default=256)
    add("--layers", type=int, default=8)
    add("--heads", type=int, default=4)
    add("--vocab", type=int, default=2000)
    add("--steps", type=int, default=8, help="steps per fit (the first --warmup are not timed)")
    add("--warmup", type=int, default=2)
    add("--repeats", type=int, default=3)
    add("--threads", type=int, default=1, help="torch threads per process")
    add("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    add("--quick", action="store_true", help="smoke run: 2 layers, 32 wide, 3 steps, 1 repeat, m = 1 2")
    add("--json", default=None)
    add("--txt", default=None, help="write the printed tables here")
    add("--plot", default=None)
    add("--worker", default=None, help=argparse.SUPPRESS)
    add("--m", type=int, default=1, help=argparse.SUPPRESS)
    add("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.seq_len, args.hidden, args.layers, args.heads, args.vocab = 4, 16, 32, 2, 2, 100
        args.steps, args.warmup, args.repeats, args.microbatches = 3, 1, 1, [1, 2]
    args.microbatches = sorted(args.microbatches)
    if not args.worker and any(args.batch_size % m for m in args.microbatches):
        parser.error(f"--microbatches {args.microbatches} must all divide --batch-size {args.batch_size}")
    return args


if __name__ == "__main__":
    main()
