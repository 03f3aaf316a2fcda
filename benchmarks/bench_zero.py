"""Benchmark: per-rank memory and step time of ZeRO stages 1-3 (DeepSpeed and native) against DDP, 2 CPU ranks.

What is compared. A BERT classifier (hidden 256, 4 layers, 4 heads, FFN 1024, vocabulary 8192: 5.3M parameters;
``--quick``: hidden 64, 2 layers, vocabulary 512), batches of 8 sequences of 64 tokens per rank, AdamW, float32,
trained by a real ``Trainer(accelerator="cpu", devices=2)`` on 2 processes (gloo; each process one thread) under
``ddp`` and ``ZeROStrategy(stage=1|2|3, backend="deepspeed"|"native")``, in two modes: full fine-tuning and LoRA
(rank 8 on query/value, the head trained in full).
DeepSpeed stage 3 gets ``stage3_param_persistence_threshold = 10 * hidden`` (the rule of Hugging Face's "auto"
DeepSpeed config; DeepSpeed's default of 1e5 elements would keep most of this small model whole on every rank).

Memory: :func:`lightning_peft.parallel.memory.rank_bytes` on each rank during the 4th step: the tensors the
rank holds, found and measured (local shards, ZeRO-3 partitions, optimizer state tensors, engine master copies,
every other live tensor), not computed from shapes. Gradients are read just before the optimizer step,
``parameters (in step)`` between forward and backward, the rest right after the step. **model states** =
parameters + gradients + optimizer state + master weights (what ZeRO partitions); ``other`` = every other tensor
allocated since the fit's ``setup`` hook (communication buckets, the batch; tensors earlier fits in the same
process left behind are not counted). Memory is deterministic: measured in the first repeat. The tables show rank 0
(rank 1 is printed in the JSON).

Time: every (mode, strategy) runs ``--steps`` timed steps after ``--warmup`` untimed ones, timed per step from
``on_train_batch_start`` to ``on_train_batch_end`` on rank 0 (the ranks move in lockstep through the collectives);
contenders alternate inside every repeat (the order rotates between repeats); the table shows the median over
repeats of each fit's median step time, and the ratio to DDP. The floor: DDP itself (the same model, the same data
split, no partitioning); ZeRO trades communication for memory, so below 1.0 is not expected.

Goals (issue 10): ZeRO-3 model states per rank <= 0.55x DDP for full fine-tuning; step time within 1.5x of DDP.
The floor for stage 3: DDP's step plus two all-gathers of every parameter (before forward and before backward;
measured in the same processes: one ``all_gather_into_tensor`` of all parameters, each rank giving half). DDP
moves only gradients, and with LoRA almost nothing, so for LoRA the floor alone can exceed 1.5x: the table says.

Usage (the numbers on ``docs/zero.md``)::

    python benchmarks/bench_zero.py --json benchmarks/results/zero.json --txt benchmarks/results/zero.txt

``--quick``: the small model, 4 + 2 steps, 1 repeat (a smoke run; its numbers mean nothing). ``--strategies`` and
``--modes`` pick contenders (DDP first).
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

STRATEGIES = ["ddp", "deepspeed1", "deepspeed2", "deepspeed3", "native1", "native2", "native3"]
MODES = ["full", "lora"]
STATES = ("parameters", "gradients", "optimizer_state", "master_weights")


def shapes(quick: bool) -> dict:
    if quick:
        return {"hidden": 64, "layers": 2, "heads": 2, "ffn": 128, "vocab": 512, "tokens": 16, "batch": 4}
    return {"hidden": 256, "layers": 4, "heads": 4, "ffn": 1024, "vocab": 8192, "tokens": 64, "batch": 8}


# --- worker (one per rank) ------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from transformers import BertConfig, BertForSequenceClassification

    from lightning_peft.peft import LoRAConfig, inject_lora
    from lightning_peft.strategies import ZeROStrategy
    from lightning_peft.parallel.memory import rank_bytes

    size = shapes(args.quick)
    rank = int(os.environ["RANK"])
    total_steps = args.warmup + args.steps

    def make(name: str):
        if name == "ddp":
            return "ddp"
        stage, backend = int(name[-1]), name[:-1]
        options = {"stage3_param_persistence_threshold": 10 * size["hidden"]} if name == "deepspeed3" else {}
        return ZeROStrategy(stage=stage, backend=backend, **options)

    class Classifier(pl.LightningModule):
        def __init__(self, lora: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            config = BertConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                                num_attention_heads=size["heads"], intermediate_size=size["ffn"], num_labels=5,
                                max_position_embeddings=size["tokens"], hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0)
            self.model = BertForSequenceClassification(config)
            if lora:
                inject_lora(self.model, LoRAConfig(rank=8, alpha=16, target_modules=["query", "value"],
                                                   modules_to_save=["classifier"]))

        def training_step(self, batch, batch_idx):
            ids, labels = batch
            return self.model(input_ids=ids, labels=labels).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(1)
            count = size["batch"] * 2 * total_steps
            dataset = TensorDataset(torch.randint(0, size["vocab"], (count, size["tokens"]), generator=generator),
                                    torch.randint(0, 5, (count,), generator=generator))
            sampler = DistributedSampler(dataset, 2, self.trainer.global_rank, shuffle=False)
            return DataLoader(dataset, batch_size=size["batch"], sampler=sampler)

    class Probe(Callback):
        def __init__(self, measure: bool) -> None:
            self.measure, self.memory, self.times, self.start, self.before = measure, {}, [], 0.0, 0

        def setup(self, trainer, pl_module, stage):
            # Tensors a previous fit left in this process (reference cycles in the engines) are not this fit's;
            # measured before the strategy builds its engine, so the engine's buffers count.
            if self.measure:
                self.before = rank_bytes(pl_module, trainer.optimizers)["other"]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_before_backward(self, trainer, pl_module, loss):
            if self.measure and trainer.global_step == 3:
                self.memory["parameters_in_step"] = rank_bytes(pl_module, trainer.optimizers)["parameters"]

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if self.measure and trainer.global_step == 3:
                self.memory["gradients"] = rank_bytes(pl_module, trainer.optimizers)["gradients"]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step > args.warmup:
                self.times.append(time.perf_counter() - self.start)
            if self.measure and trainer.global_step == 4:
                after = rank_bytes(pl_module, trainer.optimizers)
                after["other"] -= self.before
                self.memory.update({k: v for k, v in after.items() if k != "gradients"})

    results: dict = {"memory": {}, "times": {}}
    contenders = [(mode, name) for mode in args.modes for name in args.strategies]
    for repeat in range(args.repeats):
        shift = repeat % len(contenders)
        for mode, name in contenders[shift:] + contenders[:shift]:
            probe = Probe(measure=repeat == 0)
            trainer = pl.Trainer(
                accelerator="cpu", devices=2, strategy=make(name), max_steps=total_steps, logger=False,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                use_distributed_sampler=False, callbacks=[probe], default_root_dir=args.workdir,
            )
            trainer.fit(Classifier(lora=mode == "lora"))
            key = f"{mode}/{name}"
            results["times"].setdefault(key, []).append(statistics.median(probe.times))
            if repeat == 0:
                results["memory"][key] = probe.memory
    results["all_gather_ms"] = all_gather_ms(Classifier(lora=False), repeats=7)
    Path(args.workdir, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()
    exit_worker()


def all_gather_ms(model, repeats: int) -> float:
    """Median time of one all-gather of every parameter of ``model`` (each rank contributing half), in ms: what
    ZeRO-3 must move twice a step (before forward and before backward) and DDP never moves."""
    import torch
    import torch.distributed as dist

    total = sum(p.numel() for p in model.parameters())
    total += total % 2
    shard, full = torch.randn(total // 2), torch.empty(total)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_into_tensor(full, shard)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


# --- launcher and report ----------------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, workdir: str) -> list[dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, __file__, "--worker", "--workdir", workdir, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--strategies", *args.strategies,
               "--modes", *args.modes] + (["--quick"] if args.quick else [])
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for rank, proc in enumerate(procs):
        output = proc.communicate()[0]
        if proc.returncode != 0:
            raise SystemExit(f"rank {rank} failed:\n{output[-5000:]}")
    return [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(2)]


def report(ranks: list[dict], args: argparse.Namespace) -> dict:
    rank0 = ranks[0]
    size = shapes(args.quick)
    say(f"ZeRO on 2 CPU ranks (gloo), BERT hidden {size['hidden']} x {size['layers']} layers, vocabulary "
        f"{size['vocab']}, {size['batch']} x {size['tokens']} tokens per rank, AdamW, float32; "
        f"{args.repeats} repeats of {args.steps} timed steps, medians")
    out: dict = {"shapes": size, "repeats": args.repeats, "steps": args.steps, "modes": {}}
    for mode in args.modes:
        ddp_mem = rank0["memory"][f"{mode}/ddp"]
        ddp_states = sum(ddp_mem[k] for k in STATES)
        ddp_time = statistics.median(rank0["times"][f"{mode}/ddp"])
        say()
        say(f"{'full fine-tuning' if mode == 'full' else 'LoRA r=8 (query, value) + head'}: bytes per rank (rank 0), "
            "ratios to DDP")
        say(f"{'strategy':<11} {'params':>9} {'(in step)':>9} {'grads':>9} {'optim':>9} {'master':>9} "
            f"{'states':>9} {'x DDP':>6} {'other':>9} {'step ms':>8} {'x DDP':>6}")
        rows = {}
        for name in args.strategies:
            mem = rank0["memory"][f"{mode}/{name}"]
            states = sum(mem[k] for k in STATES)
            step = statistics.median(rank0["times"][f"{mode}/{name}"])
            rows[name] = {**mem, "model_states": states, "states_vs_ddp": states / ddp_states,
                          "step_ms": 1000 * step, "time_vs_ddp": step / ddp_time,
                          "step_ms_per_repeat": [1000 * t for t in rank0["times"][f"{mode}/{name}"]],
                          "rank1": ranks[1]["memory"][f"{mode}/{name}"]}
            say(f"{name:<11} {_kb(mem['parameters'])} {_kb(mem['parameters_in_step'])} {_kb(mem['gradients'])} "
                f"{_kb(mem['optimizer_state'])} {_kb(mem['master_weights'])} {_kb(states)} "
                f"{states / ddp_states:>6.3f} {_kb(mem['other'])} {1000 * step:>8.1f} {step / ddp_time:>6.2f}")
        out["modes"][mode] = rows
    say("(kB; states = params + grads + optim + master; 'in step': parameters held between forward and backward)")
    gather = rank0["all_gather_ms"]
    say()
    say(f"floor of ZeRO-3: DDP's step + 2 all-gathers of every parameter (one all-gather: {gather:.1f} ms, measured "
        "in the same processes)")
    for mode in args.modes:
        ddp_ms = out["modes"][mode]["ddp"]["step_ms"]
        floor = (ddp_ms + 2 * gather) / ddp_ms
        out.setdefault("stage3_floor_vs_ddp", {})[mode] = floor
        measured = ", ".join(f"{n} {out['modes'][mode][n]['time_vs_ddp']:.2f}" for n in ("deepspeed3", "native3")
                             if n in out["modes"][mode])
        say(f"  {mode}: floor {floor:.2f}x DDP; measured {measured}")
    out["all_gather_ms"] = gather
    full = out["modes"].get("full", {})
    worst_memory = max((full[n]["states_vs_ddp"] for n in ("deepspeed3", "native3") if n in full), default=float("nan"))
    worst_time = max(row["time_vs_ddp"] for mode in out["modes"].values() for n, row in mode.items() if n != "ddp")
    say()
    say(f"goal: ZeRO-3 model states <= 0.55x DDP (full fine-tuning): worst {worst_memory:.3f} -> "
        f"{'met' if worst_memory <= 0.55 else 'NOT met'}")
    say(f"goal: step time within 1.5x of DDP: worst {worst_time:.2f} -> {'met' if worst_time <= 1.5 else 'NOT met'}")
    out["goals"] = {"zero3_states_vs_ddp": worst_memory, "worst_time_vs_ddp": worst_time}
    return out


def _kb(value: float) -> str:
    return f"{value / 1024:>9.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES,
                        help="contenders (ddp first: the ratios are to it)")
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--json")
    parser.add_argument("--txt")
    args = parser.parse_args()
    say_machine()
    if args.strategies[0] != "ddp":
        parser.error("--strategies: the first must be ddp (the ratios are to it)")
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 4, 1
    with tempfile.TemporaryDirectory() as workdir:
        result = report(launch(args, workdir), args)
    write_results(args.json, args.txt, result)


if __name__ == "__main__":
    main()
