"""Benchmark: `CausalLM.generate` with its key/value cache against transformers' `generate` on the same weights, and
against the uncached loop `CausalLM.generate` ran before the cache.

Model: a random Llama (``LlamaForCausalLM``, float32; default hidden 512, 4 layers, 8 heads, feed-forward 1376,
vocabulary 32000), saved with ``save_pretrained`` and loaded on our side with `TransformerDecoder.from_pretrained`, so
both sides hold the same weights. Prompts: ``--batch-sizes`` rows (default 1, 8, 32) of ``--prompt`` random tokens (32,
no padding); ``--new-tokens`` greedy tokens (96), no stop token, so every contender makes exactly as many steps.

Contenders (one call = a whole generation):

- *ours*: `lightning_peft.nn.generate` (what `CausalLM.generate` runs): the prompt once, then one token per step on
  a preallocated `KVCache`, the head on the last position only;
- *transformers*: ``LlamaForCausalLM.generate(do_sample=False)`` (its dynamic cache, SDPA attention);
- *uncached* (batch 1 only, ``--uncached-batch-sizes``): the loop `CausalLM.generate` ran before the cache, kept
  here as `uncached_generate`: the whole context through the decoder for every token, logits at every position.

Before timing, the run aborts unless ours and transformers' tokens are equal at every batch size (greedy on the same
weights; the uncached loop is checked too). Time: the contenders alternate inside every repeat (the first rotates
between repeats, ``_timing.alternate``), one untimed warm-up call each, median over ``--repeats``; the table gives the
ratio of the medians and the median of the per-repeat (paired) ratios. Goal: ours <= 1.0x transformers' time at every
batch size. The machine is shared: the load average is printed before and after.

``--quick``: hidden 64, 2 layers, vocabulary 512, batch sizes 1 and 4, 8 new tokens, 1 repeat (a smoke test).

Usage: ``python benchmarks/bench_generate.py [--repeats 5] [--threads 1] [--json benchmarks/results/generate.json]
[--txt benchmarks/results/generate.txt] [--plot docs/img/generate.png]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import finish, output_arguments, save_figure, say, say_machine
from _timing import alternate, row

from lightning_peft.nn import TransformerDecoder, generate


def build_models(args: argparse.Namespace, directory: str) -> tuple[TransformerDecoder, torch.nn.Module]:
    """The random Llama saved to ``directory``, loaded by transformers and by `TransformerDecoder`, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    theirs = LlamaForCausalLM.from_pretrained(directory).eval()
    theirs.generation_config.eos_token_id = theirs.generation_config.pad_token_id = None
    return TransformerDecoder.from_pretrained(directory).eval(), theirs


@torch.no_grad()
def uncached_generate(decoder: TransformerDecoder, input_ids: Tensor, max_new_tokens: int) -> Tensor:
    """The greedy loop `CausalLM.generate` ran before the cache: every token recomputes the whole context."""
    tokens = input_ids
    for _ in range(max_new_tokens):
        logits = decoder(tokens[:, -decoder.max_position_embeddings :])[:, -1].float()  # (B, V)
        tokens = torch.cat([tokens, logits.argmax(dim=-1, keepdim=True).to(tokens.dtype)], dim=1)
    return tokens


def contenders(args: argparse.Namespace, ours: TransformerDecoder, theirs: torch.nn.Module,
               ids: Tensor) -> dict[str, Callable[[], Tensor]]:
    mask = torch.ones_like(ids)
    calls = {
        "ours": lambda: generate(ours, ids, args.new_tokens),
        "transformers": lambda: theirs.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                                do_sample=False),
    }
    if ids.shape[0] in args.uncached_batch_sizes:
        calls["uncached"] = lambda: uncached_generate(ours, ids, args.new_tokens)
    return calls


def check_tokens(args: argparse.Namespace, ours: TransformerDecoder, theirs: torch.nn.Module) -> None:
    for batch in args.batch_sizes:
        ids = prompts(args, batch)
        results = {name: call() for name, call in contenders(args, ours, theirs, ids).items()}
        for name, tokens in results.items():
            if not torch.equal(tokens, results["transformers"]):
                sys.exit(f"bench_generate: {name}'s greedy tokens differ from transformers' at batch {batch} "
                         f"({int((tokens != results['transformers']).sum())} tokens).")


def prompts(args: argparse.Namespace, batch: int) -> Tensor:
    return torch.randint(0, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))


def load() -> str:
    return "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def measure(args: argparse.Namespace, ours: TransformerDecoder, theirs: torch.nn.Module) -> dict[str, dict]:
    """times[str(batch)][contender] -> ms per whole generation, one value per repeat."""
    times = {}
    for batch in args.batch_sizes:
        calls = contenders(args, ours, theirs, prompts(args, batch))
        times[str(batch)] = alternate({name: (lambda c=c: c()) for name, c in calls.items()},
                                      repeats=args.repeats, steps=1, warmup=1)
        say(f"batch {batch}: " + ", ".join(f"{name} {statistics.median(t):.0f} ms" for name, t in
                                            times[str(batch)].items()) + f" ({load()})")
    return times


def print_rows(title: str, rows: list[dict], baseline: str) -> None:
    say(f"\n### {title}\n")
    say(f"| measurement | ours (ms) | {baseline} (ms) | ratio | paired ratio | goal | met? |")
    say("| --- | ---: | ---: | ---: | ---: | ---: | :---: |")
    for r in rows:
        met = "—" if r["met"] is None else ("yes" if r["met"] else "NO")
        goal = "—" if r["goal"] is None else f"≤ {r['goal']:.2f}"
        say(f"| {r['measurement']} | {r['ours']:.0f} | {r['baseline']:.0f} | {r['ratio']:.3f} | "
            f"{r['paired_ratio']:.3f} | {goal} | {met} |")


def plot(args: argparse.Namespace, times: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    batches = args.batch_sizes
    for name, style in (("ours", "o-"), ("transformers", "s--")):
        per_token = [statistics.median(times[str(b)][name]) / args.new_tokens for b in batches]
        left.plot(batches, per_token, style, label=f"{name} (cached)" if name == "ours" else name)
    uncached = [b for b in batches if "uncached" in times[str(b)]]
    if uncached:
        left.plot(uncached, [statistics.median(times[str(b)]["uncached"]) / args.new_tokens for b in uncached], "x",
                  markersize=10, label="uncached (before)")
    left.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms per generated token (whole batch)",
             title=f"{args.new_tokens} new tokens after {args.prompt}")
    left.set_xticks(batches, [str(b) for b in batches])
    left.legend()
    ratios = [statistics.median(times[str(b)]["ours"]) / statistics.median(times[str(b)]["transformers"])
              for b in batches]
    right.bar([str(b) for b in batches], ratios, color="tab:blue")
    right.axhline(args.goal, color="tab:red", linestyle=":", label=f"goal ≤ {args.goal:.2f}")
    right.set(xlabel="batch size", ylabel="ours / transformers (time)", title="cached generate vs transformers")
    right.legend()
    fig.suptitle(f"greedy generation, random Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
                 f"float32, {args.threads} CPU thread(s)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = say_machine()
    started = time.perf_counter()
    say(f"## generate: ours (KV cache) vs transformers {__import__('transformers').__version__} (float32, "
        f"{args.threads} CPU thread(s), {args.repeats} repeats; {load()})")
    with tempfile.TemporaryDirectory() as directory:
        ours, theirs = build_models(args, directory)
    check_tokens(args, ours, theirs)
    say("greedy tokens: ours == transformers == uncached loop at every batch size")
    times = measure(args, ours, theirs)
    rows = [row(f"batch {b}, {args.new_tokens} new tokens", times[str(b)]["ours"], times[str(b)]["transformers"],
                args.goal) for b in args.batch_sizes]
    print_rows("Cached generate vs transformers' generate (median ms per generation)", rows, "transformers")
    before = [row(f"batch {b}, {args.new_tokens} new tokens", times[str(b)]["ours"], times[str(b)]["uncached"], None)
              for b in args.batch_sizes if "uncached" in times[str(b)]]
    if before:
        print_rows("Cached generate vs the uncached loop it replaces", before, "uncached")
    if args.plot:
        plot(args, times, args.plot)
    say(f"\nafter the run: {load()}")
    report = {"config": vars(args), "machine": machine, "times_ms": times, "rows": rows, "vs_uncached": before}
    return finish(report, started, args.json, args.txt)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run: a tiny model, 1 repeat")
    add("--hidden", type=int, default=512)
    add("--layers", type=int, default=4)
    add("--heads", type=int, default=8)
    add("--kv-heads", type=int, default=8)
    add("--ffn", type=int, default=1376)
    add("--vocab", type=int, default=32000)
    add("--positions", type=int, default=512)
    add("--prompt", type=int, default=32)
    add("--new-tokens", type=int, default=96)
    add("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    add("--uncached-batch-sizes", type=int, nargs="*", default=[1])
    add("--repeats", type=int, default=5)
    add("--threads", type=int, default=1)
    add("--goal", type=float, default=1.0)
    output_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab = 64, 2, 4, 2, 128, 512
        args.batch_sizes, args.uncached_batch_sizes, args.new_tokens, args.repeats = [1, 4], [1], 8, 1
    return args


if __name__ == "__main__":
    main()
