"""Benchmark: ``lightning_peft.nn.MoE`` against transformers' Mixtral sparse-MoE block, and as experts grow.

Issue 9's goals: **>= 1.3x the tokens/s of transformers' ``MixtralSparseMoeBlock`` at 16 experts, top-2**, with the
same router and expert weights, dropless on both sides since Mixtral drops nothing (the outputs must agree within
1e-4 before anything is timed); and **time within 1.3x across 4, 8, 16, 32, 64 experts** at fixed top-2 and fixed
tokens (slowest / fastest of ours). Both in two modes: *forward* (``eval``, ``torch.no_grad``: inference) and
*forward+backward* (``train``, input and every parameter requiring grad, ``backward`` with a fixed output gradient,
gradients set to None after each call on every side alike: training).

Contenders at 16 experts, top-2:

- ``ours``: ``MoE(dropless=True)``: the assignments sorted by expert, one gather, each expert's ``FeedForward`` on
  its contiguous slice, one ``index_add``.
- ``mixtral``: ``MixtralSparseMoeBlock`` with ``experts_implementation="eager"``: a loop over the experts hit, each
  one finding its tokens with ``torch.where`` over a one-hot mask, gathering them, running a slice of the stacked
  3-D weights and adding back with its own ``index_add`` (the block the issue names; a block built on its own runs
  it, and so does a model where no grouped-matmul kernel is available). **The goal is against this one.**
- ``mixtral_grouped_mm``: the same block with ``experts_implementation="grouped_mm"``, what transformers 5 picks by
  default inside ``from_pretrained`` models when torch has a grouped-matmul kernel: one sort, one
  ``grouped_mm`` per projection over the stacked weights. Reported, no goal.
- ``floor``: the experts alone, each on a contiguous slice of the sizes ours routed (no router, no gather, no
  gates): the least any dispatch running the same expert matmuls can cost. Reported, also in the scaling sweep.
- ``every_expert``: every expert run on every token, combined with the ``(T, E)`` gate matrix that is zero off each
  token's top-k (same weights; the same function): what sparsity saves. Reported.
- ``dense``: a dense SwiGLU ``FeedForward`` of width ``top_k * ffn_size``: the same active parameters and FLOPs per
  token as one routed token, so the ratio is what routing costs. Reported.

Sizes, and why: 4096 tokens (8 sequences of 512: a realistic training micro-batch for a small decoder on a CPU),
hidden 256 (the width of this repo's ``TransformerDecoder`` default and of the BBC News MoE decoder), expert ffn 512
(2x hidden: narrower than a dense feed-forward, as fine-grained MoEs build their experts; narrow experts make the
routing overhead relatively larger, the harder case for a router), fp32, every CPU thread. At 16 experts and top-2,
8192 assignments give each expert ~512 rows, enough for its matmuls to run at full speed; one forward is
``2 * 3 * H * F * T * k`` = 6.4 GFLOP (plus the router), a training call about 3x that. The scaling sweep keeps T
and k, so the FLOPs stay constant; what changes is the rows per expert (2048 .. 128) and the per-expert overhead.

Timing: ``bench_lora.alternate``: the contenders alternate inside every repeat (the first rotates between
repeats), ``gc.collect()`` before each, one untimed warm-up call each; ``--repeats`` (5) repeats of ``--steps`` (1)
calls; tables show medians, tokens/s = tokens / median seconds per call.

Usage (the numbers on ``docs/moe.md``)::

    python benchmarks/bench_moe.py --json benchmarks/results/moe.json --txt benchmarks/results/moe.txt \\
        --plot docs/img/moe.png

``--quick``: a smoke run (256 tokens, hidden 32, ffn 64, 8 experts, scaling 4 and 8, 1 repeat, 1 thread; a few
seconds after the imports; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import say, say_machine, write_results  # noqa: E402
from lightning_peft.nn.moe import MoE  # noqa: E402
from lightning_peft.nn.transformer import FeedForward  # noqa: E402

MODES = ("forward", "forward+backward")
MAIN_CONTENDERS = ("ours", "mixtral", "mixtral_grouped_mm", "floor", "every_expert", "dense")
SCALING_CONTENDERS = ("ours", "mixtral", "mixtral_grouped_mm", "floor")
LABELS = {
    "ours": "lightning_peft MoE",
    "mixtral": "transformers Mixtral block (eager)",
    "mixtral_grouped_mm": "transformers Mixtral block (grouped_mm)",
    "floor": "the experts alone on pre-sorted slices",
    "every_expert": "every expert on every token",
    "dense": "dense FeedForward, top_k x ffn wide",
}
TOLERANCE = 1e-4
class EveryExpert(nn.Module):
    """Every expert of ``moe`` on every token, combined with the ``(T, E)`` gates that are zero off the top-k."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: Tensor) -> Tensor:
        moe = self.moe
        tokens = x.reshape(-1, moe.hidden_size)  # (T, H)
        probs = moe.router_logits(tokens).softmax(-1)  # (T, E)
        top, chosen = probs.topk(moe.top_k, dim=-1)  # (T, k)
        gates = torch.zeros_like(probs).scatter(1, chosen, top / top.sum(-1, keepdim=True))  # (T, E)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(moe.experts):
            out = out + gates[:, e : e + 1].to(tokens.dtype) * expert(tokens)
        return out.reshape(x.shape)


class ExpertFloor(nn.Module):
    """The experts alone: each on a contiguous slice of the sizes ``moe`` routed, no router, no gather, no gates.

    Input ``(1, T, H)``: its rows repeated ``top_k`` times (one copy) stand in for the dispatched tokens; the output
    sums the ``top_k`` copies back to ``(1, T, H)``. What any dispatch of the same expert matmuls costs at least.
    """

    def __init__(self, moe: MoE, counts: list[int]) -> None:
        super().__init__()
        self.moe = moe
        self.counts = counts

    def forward(self, x: Tensor) -> Tensor:
        moe = self.moe
        rows = x.reshape(-1, moe.hidden_size)  # (T, H)
        dispatched = rows.repeat(moe.top_k, 1)  # (k T, H)
        outputs = [expert(chunk) for expert, chunk in zip(moe.experts, dispatched.split(self.counts), strict=True)]
        return torch.cat(outputs).view(moe.top_k, *rows.shape).sum(0).view_as(x)


def mixtral_block(moe: MoE, implementation: str) -> nn.Module:
    """transformers' ``MixtralSparseMoeBlock`` holding ``moe``'s router and expert weights (copies)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=moe.hidden_size, intermediate_size=moe.ffn_size, num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, hidden_act="silu", router_jitter_noise=0.0,
    )
    config._experts_implementation = implementation
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.weight)
        for e, expert in enumerate(moe.experts):
            block.experts.gate_up_proj[e].copy_(torch.cat([expert.gate_proj.weight, expert.up_proj.weight]))
            block.experts.down_proj[e].copy_(expert.down_proj.weight)
    return block


def build(args: argparse.Namespace, num_experts: int, names: tuple[str, ...]) -> dict[str, nn.Module]:
    torch.manual_seed(args.seed + num_experts)
    ours = MoE(args.hidden_size, args.ffn_size, num_experts, top_k=args.top_k, dropless=True)
    modules: dict[str, nn.Module] = {"ours": ours}
    for name in names:
        if name == "mixtral":
            modules[name] = mixtral_block(ours, "eager")
        elif name == "mixtral_grouped_mm":
            modules[name] = mixtral_block(ours, "grouped_mm")
        elif name == "every_expert":
            modules[name] = EveryExpert(ours)
        elif name == "floor":
            with torch.no_grad():
                ours.eval()(make_input(args))
            modules[name] = ExpertFloor(ours, ours.last_stats["tokens_per_expert"].tolist())
        elif name == "dense":
            modules[name] = FeedForward(args.hidden_size, args.top_k * args.ffn_size, activation="silu", gated=True,
                                        bias=False)
    return modules


def make_input(args: argparse.Namespace) -> Tensor:
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randn(1, args.tokens, args.hidden_size, generator=generator)  # (1, T, H)


def agreement(modules: dict[str, nn.Module], x: Tensor) -> dict[str, float]:
    """Max |ours - other| on the same input, for every contender computing the same function."""
    with torch.no_grad():
        ours = modules["ours"].eval()(x)
        return {name: (module.eval()(x) - ours).abs().max().item()
                for name, module in modules.items() if name not in ("ours", "floor", "dense")}


def call_fn(module: nn.Module, mode: str, x: Tensor, out_grad: Tensor) -> Callable[[], None]:
    """One forward (no grad) or one forward + backward (gradients cleared afterwards) of a contender."""
    params = list(module.parameters())

    def forward() -> None:
        with torch.no_grad():
            module(x)

    def train() -> None:
        module(x).backward(out_grad)
        x.grad = None
        for p in params:
            p.grad = None

    return forward if mode == "forward" else train


def time_modules(args: argparse.Namespace, modules: dict[str, nn.Module]) -> dict[str, dict[str, list[float]]]:
    """Milliseconds per call: times[mode][contender] -> one value per repeat."""
    from bench_lora import alternate

    times: dict[str, dict[str, list[float]]] = {}
    for mode in MODES:
        x = make_input(args).requires_grad_(mode != "forward")
        out_grad = torch.randn_like(x)
        for module in modules.values():
            module.train(mode != "forward")
            for p in module.parameters():
                p.requires_grad_(mode != "forward")
        calls = {name: call_fn(module, mode, x, out_grad) for name, module in modules.items()}
        times[mode] = alternate(calls, repeats=args.repeats, steps=args.steps, warmup=args.warmup)
    return times


def grouped_mm_runs(args: argparse.Namespace) -> tuple[bool, str]:
    """Whether the grouped_mm Mixtral variant runs here (and why not)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = MoE(8, 16, 4, top_k=2, dropless=True)
            out = mixtral_block(probe, "grouped_mm")(torch.randn(1, 8, 8))
        return bool(torch.isfinite(out).all()), "ok"
    except Exception as error:  # noqa: BLE001 - reported, the rest of the benchmark still runs
        return False, f"{type(error).__name__}: {error}"


# ------------------------------------------------------------------------------------------------ report


def speed_row(mode: str, baseline: str, ours_ms: list[float], base_ms: list[float], tokens: int,
              goal: float | None) -> dict:
    ours_med, base_med = statistics.median(ours_ms), statistics.median(base_ms)
    speedup = base_med / ours_med
    return {
        "mode": mode, "baseline": baseline, "ours_ms": ours_med, "baseline_ms": base_med,
        "ours_tokens_per_s": tokens / ours_med * 1000, "baseline_tokens_per_s": tokens / base_med * 1000,
        "speedup": speedup, "paired_speedup": statistics.median(b / a for a, b in zip(ours_ms, base_ms, strict=True)),
        "goal": goal, "met": None if goal is None else speedup >= goal,
        "ours_range_ms": [min(ours_ms), max(ours_ms)], "baseline_range_ms": [min(base_ms), max(base_ms)],
    }


def print_main(title: str, rows: list[dict]) -> None:
    say(f"\n### {title}\n")
    say("| mode | ours (tokens/s) | baseline | baseline (tokens/s) | speedup ours / baseline | goal | met? |")
    say("| --- | ---: | --- | ---: | ---: | ---: | :---: |")
    for r in rows:
        met = "—" if r["met"] is None else ("yes" if r["met"] else "NO")
        goal = "—" if r["goal"] is None else f"≥ {r['goal']:.2f}"
        say(f"| {r['mode']} | {r['ours_tokens_per_s']:,.0f} | {LABELS[r['baseline']]} | "
            f"{r['baseline_tokens_per_s']:,.0f} | {r['speedup']:.2f}x | {goal} | {met} |")


def scaling_rows(args: argparse.Namespace, scaling: dict, names: list[str]) -> list[dict]:
    rows = []
    for mode in MODES:
        ms = {name: [statistics.median(scaling[str(e)][mode][name]) for e in args.scaling_experts] for name in names}
        spread = max(ms["ours"]) / min(ms["ours"])
        rows.append({"mode": mode, "experts": list(args.scaling_experts), "median_ms": ms,
                     "slowest_over_fastest": spread, "goal": args.goal_scaling, "met": spread <= args.goal_scaling,
                     "others_slowest_over_fastest": {n: max(v) / min(v) for n, v in ms.items() if n != "ours"}})
    return rows


def print_scaling(title: str, rows: list[dict]) -> None:
    experts = rows[0]["experts"]
    say(f"\n### {title}\n")
    say("| mode | contender | " + " | ".join(f"{e} experts" for e in experts) + " | slowest / fastest | goal | met? |")
    say("| --- | --- | " + " | ".join("---:" for _ in experts) + " | ---: | ---: | :---: |")
    for r in rows:
        for name, values in r["median_ms"].items():
            spread = r["slowest_over_fastest"] if name == "ours" else r["others_slowest_over_fastest"][name]
            goal = f"≤ {r['goal']:.2f}" if name == "ours" else "—"
            met = ("yes" if r["met"] else "NO") if name == "ours" else "—"
            cells = " | ".join(f"{v:.1f}" for v in values)
            say(f"| {r['mode']} | {LABELS[name]} | {cells} | {spread:.2f} | {goal} | {met} |")


def plot(args: argparse.Namespace, scaling: dict, main_times: dict, names: list[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    styles = {"ours": ("tab:blue", "o"), "mixtral": ("tab:red", "s"), "mixtral_grouped_mm": ("tab:orange", "^"),
              "floor": ("tab:green", "v")}
    experts = list(args.scaling_experts)
    for ax, mode in zip(axes, MODES, strict=True):
        for name in names:
            color, marker = styles[name]
            ms = [statistics.median(scaling[str(e)][mode][name]) for e in experts]
            ax.plot(experts, ms, "-", color=color, marker=marker, label=LABELS[name])
        dense = statistics.median(main_times[mode]["dense"])
        ax.axhline(dense, color="grey", linestyle="--", linewidth=1, label=LABELS["dense"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(experts, [str(e) for e in experts])
        ax.set_xlabel(f"experts (top-{args.top_k}, {args.tokens} tokens)")
        ax.set_ylabel("median time per call (ms)")
        ax.set_title(mode)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    say(f"\nwrote {path}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    say_machine()
    started = time.perf_counter()
    import transformers

    shape = (f"{args.tokens} tokens, hidden {args.hidden_size}, expert ffn {args.ffn_size}, top-{args.top_k}, "
             f"fp32, {args.threads} CPU threads")
    say(f"## MoE vs transformers' Mixtral block ({shape}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; {args.repeats} repeats x {args.steps} calls)")
    grouped_ok, why = grouped_mm_runs(args)
    if not grouped_ok:
        say(f"\nmixtral_grouped_mm left out: it does not run here ({why})")
    main_names = tuple(n for n in MAIN_CONTENDERS if n != "ours" and (grouped_ok or n != "mixtral_grouped_mm"))
    scale_names = [n for n in SCALING_CONTENDERS if grouped_ok or n != "mixtral_grouped_mm"]
    report: dict = {"config": vars(args), "torch": torch.__version__, "transformers": transformers.__version__,
                    "grouped_mm": {"runs": grouped_ok, "why": why,
                                   "torch_nn_functional_grouped_mm": hasattr(torch.nn.functional, "grouped_mm")}}

    modules = build(args, args.experts, main_names)
    x = make_input(args)
    report["agreement"] = agreement(modules, x)
    worst = max(report["agreement"].values())
    say("\noutputs agree with ours (max |diff|): " + ", ".join(f"{k} {v:.1e}" for k, v in report["agreement"].items()))
    if not worst <= TOLERANCE:
        sys.exit(f"bench_moe: a contender disagrees with ours by {worst:.2e} (> {TOLERANCE}); nothing timed.")
    active = sum(p.numel() for p in modules["dense"].parameters())
    total = sum(p.numel() for p in modules["ours"].parameters())
    say(f"parameters: MoE {total:,} in all, {active + args.hidden_size * args.experts:,} active per token "
        f"(dense FeedForward {active:,} + router)")
    main_times = time_modules(args, modules)
    rows = [
        speed_row(mode, name, main_times[mode]["ours"], main_times[mode][name], args.tokens,
                  args.goal_speedup if name == "mixtral" else None)
        for mode in MODES for name in main_names
    ]
    report |= {"main_raw_ms": main_times, "rows": rows}
    print_main(f"{args.experts} experts, top-{args.top_k}, dropless: tokens per second (median)", rows)

    scaling: dict[str, dict] = {}
    for num_experts in args.scaling_experts:
        group = build(args, num_experts, tuple(n for n in scale_names if n != "ours"))
        diff = max(agreement(group, x).values())
        if not diff <= TOLERANCE:
            sys.exit(f"bench_moe: at {num_experts} experts a contender disagrees with ours by {diff:.2e}.")
        scaling[str(num_experts)] = time_modules(args, group)
    report["scaling_raw_ms"] = scaling
    report["scaling_rows"] = scaling_rows(args, scaling, scale_names)
    print_scaling(f"Time as experts grow (top-{args.top_k}, {args.tokens} tokens; median ms per call)",
                  report["scaling_rows"])
    if args.plot:
        plot(args, scaling, main_times, scale_names, args.plot, f"MoE time vs number of experts: {shape}")
    report["seconds"] = time.perf_counter() - started
    say(f"\nwhole run: {report['seconds']:.0f} s")
    write_results(args.json, args.txt, report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--tokens", type=int, default=4096)
    add("--hidden-size", type=int, default=256)
    add("--ffn-size", type=int, default=512)
    add("--experts", type=int, default=16, help="experts of the main comparison")
    add("--top-k", type=int, default=2)
    add("--scaling-experts", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    add("--repeats", type=int, default=5)
    add("--steps", type=int, default=1, help="calls per timed repeat")
    add("--warmup", type=int, default=1)
    add("--threads", type=int, default=torch.get_num_threads())
    add("--seed", type=int, default=0)
    add("--goal-speedup", type=float, default=1.3)
    add("--goal-scaling", type=float, default=1.3)
    add("--json", default=None)
    add("--txt", default=None, help="write the printed tables here")
    add("--plot", default=None)
    add("--quick", action="store_true", help="smoke run: tiny sizes, 1 repeat, 1 thread")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden_size, args.ffn_size, args.experts = 256, 32, 64, 8
        args.scaling_experts, args.repeats, args.steps, args.threads = [4, 8], 1, 1, 1
    args.scaling_experts = sorted(args.scaling_experts)
    return args


if __name__ == "__main__":
    main()
