"""Benchmark: packed attention on SDPA (the CPU): one call per sequence, one block-diagonal mask, one padded batch,
and `packed_attention`'s default (padded groups of similar length).

What is compared. A packed batch ``q`` (1, H, T, D), ``k``/``v`` (1, Hkv, T, D), float32, requiring grad, and its
``cu_seqlens``; one forward + backward (the sum of the output) of causal attention inside each sequence:

- **loop**: ``packed_attention(..., sdpa_method="loop")``: one SDPA call per sequence;
- **mask**: one SDPA call over all T tokens with a block-diagonal causal (T, T) boolean mask, built once per batch
  outside the timed step (as a cache shared by the layers would);
- **padded**: ``sdpa_method="padded"``: every sequence gathered into one (N, H, l_max, D) batch, one call;
- **groups** (the default, ``sdpa_method="auto"``): sequences of similar length gathered into padded groups, one call
  per group (`lightning_peft.nn.packed_sdpa`).

Then the whole decoder: one training step (forward, token cross-entropy, backward) of a small Llama-shaped
`TransformerDecoder` (``--decoder-hidden`` wide, 4 layers, 8 heads, 2 key/value heads) on the same rows packed
(``cu_seqlens``, the default SDPA groups) against the same rows as one right-padded batch with an attention mask:
the time per real token, padded / packed.

Length mixes: many short rows, a few long ones, and a long-tailed mix (Pareto lengths, 16 * Pareto(1.2), capped at
512, the issue's "realistic mix"). Before timing, every contender's output is checked against the loop's (1e-5).
Contenders alternate inside every repeat (``_timing.alternate``), medians; ratios are against the loop (today's
path). The machine is shared: the load average is printed.

Usage (the numbers on ``docs/benchmarks.md``)::

    python benchmarks/bench_packed_attention.py --json benchmarks/results/packed_attention.json \\
        --txt benchmarks/results/packed_attention.txt

``--quick``: tiny sizes, 1 repeat (a smoke run; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import finish, output_arguments, say, say_machine
from _timing import alternate

from lightning_peft.nn import TransformerDecoder, packed_attention
from lightning_peft.nn.packed_sdpa import length_groups

CONTENDERS = ("loop", "mask", "padded", "groups")


def mixes(total: int, seed: int = 0) -> dict[str, list[int]]:
    """Length mixes of about ``total`` tokens each."""
    rng = random.Random(seed)
    tail: list[int] = []
    while sum(tail) < total:
        tail.append(min(512, max(4, int(16 * rng.paretovariate(1.2)))))
    return {f"{total // 16} rows of 16": [16] * (total // 16), f"{total // 64} rows of 64": [64] * (total // 64),
            f"{total // 512} rows of 512": [512] * max(1, total // 512), "long-tailed (Pareto, cap 512)": tail}


def block_diagonal_mask(lengths: list[int]) -> torch.Tensor:
    """(T, T) bool: True where query i may see key j (same sequence, j <= i)."""
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # (T,)
    total = len(sequence)
    return (sequence[:, None] == sequence[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()


def steps(lengths: list[int], heads: int, kv_heads: int, head_dim: int) -> dict[str, Callable[[], torch.Tensor]]:
    total = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, total, head_dim, generator=generator).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    mask = block_diagonal_mask(lengths)
    calls = {
        "loop": lambda: packed_attention(q, k, v, cu, causal=True, sdpa_method="loop"),
        "mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads),
        "padded": lambda: packed_attention(q, k, v, cu, causal=True, sdpa_method="padded"),
        "groups": lambda: packed_attention(q, k, v, cu, causal=True, sdpa_method="auto"),
    }
    reference = calls["loop"]().detach()
    for name, call in calls.items():
        error = float((call().detach() - reference).abs().max())
        if not error <= 1e-5:
            sys.exit(f"bench_packed_attention: {name} differs from the loop by {error:.1e} on {lengths}")

    def step(call: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            call().sum().backward()
            q.grad = k.grad = v.grad = None
        return run

    return {name: step(call) for name, call in calls.items()}


def decoder_steps(lengths: list[int], hidden: int) -> dict[str, Callable[[], None]]:
    """A training step of a small decoder on the rows packed, and on the rows as one padded batch."""
    torch.manual_seed(0)
    decoder = TransformerDecoder(vocab_size=1024, hidden_size=hidden, num_layers=4, num_heads=8, num_kv_heads=2)
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 1024, (n,), generator=generator) for n in lengths]
    packed_ids = torch.cat(rows)[None]  # (1, T)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    packed_labels = packed_ids.clone()
    packed_labels[0, cu[:-1].long()] = -100  # no target across a boundary
    padded_ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # (N, l_max)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(n, dtype=torch.long) for n in lengths], batch_first=True)
    padded_labels = padded_ids.masked_fill(mask == 0, -100)

    def step(ids: torch.Tensor, labels: torch.Tensor, **inputs: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            logits = decoder(ids, **inputs)[:, :-1]
            F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100).backward()
            decoder.zero_grad(set_to_none=True)
        return run

    return {"packed": step(packed_ids, packed_labels, cu_seqlens=cu),
            "padded": step(padded_ids, padded_labels, attention_mask=mask)}


def decoder_section(args: argparse.Namespace) -> list[dict]:
    say(f"\n## A decoder training step, packed vs padded (hidden {args.decoder_hidden}, 4 layers, 8 heads, 2 key/value "
        f"heads, vocabulary 1024, float32, median of {args.repeats})\n")
    say("| lengths | rows | real tokens | padded tokens | packed ms | padded ms | padded / packed (time per real token) |")
    say("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for label, lengths in mixes(args.tokens).items():
        if len(lengths) == 1 or len(set(lengths)) == 1 and lengths[0] > 64:
            continue  # nothing to pad
        times = alternate(decoder_steps(lengths, args.decoder_hidden), repeats=args.repeats, steps=1, warmup=1)
        packed, padded = statistics.median(times["packed"]), statistics.median(times["padded"])
        rows.append({"lengths": label, "rows": len(lengths), "tokens": sum(lengths),
                     "padded_tokens": len(lengths) * max(lengths), "packed_ms": packed, "padded_ms": padded,
                     "ratio": padded / packed, "raw_ms": times})
        say(f"| {label} | {len(lengths)} | {sum(lengths)} | {len(lengths) * max(lengths)} | {packed:.0f} | "
            f"{padded:.0f} | {padded / packed:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    say_machine()
    started = time.perf_counter()
    say(f"load average at start: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    say(f"\n## Packed causal attention on SDPA, forward + backward (H={args.heads}, Hkv={args.kv_heads}, "
        f"D={args.head_dim}, float32, {args.threads} thread(s), median of {args.repeats}; ratios: / loop)\n")
    say("| lengths | rows | T | SDPA calls (groups) | loop ms | mask | padded | groups (default) |")
    say("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for label, lengths in mixes(args.tokens).items():
        times = alternate(steps(lengths, args.heads, args.kv_heads, args.head_dim), repeats=args.repeats, steps=1,
                          warmup=1)
        median = {name: statistics.median(times[name]) for name in CONTENDERS}
        ratio = {name: median[name] / median["loop"] for name in CONTENDERS}
        calls = len(length_groups(lengths))
        rows.append({"lengths": label, "rows": len(lengths), "tokens": sum(lengths), "group_calls": calls,
                     "ms": median, "ratio_to_loop": ratio, "raw_ms": times})
        say(f"| {label} | {len(lengths)} | {sum(lengths)} | {calls} | {median['loop']:.1f} | "
            + " | ".join(f"{ratio[n]:.2f}" for n in CONTENDERS[1:]) + " |")
    decoder = decoder_section(args)
    say(f"load average at end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return finish({"config": vars(args), "rows": rows, "decoder": decoder}, started, args.json, args.txt)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run: tiny sizes, 1 repeat")
    add("--tokens", type=int, default=2048, help="tokens per packed batch")
    add("--heads", type=int, default=8)
    add("--kv-heads", type=int, default=2)
    add("--head-dim", type=int, default=64)
    add("--repeats", type=int, default=5)
    add("--threads", type=int, default=1)
    add("--decoder-hidden", type=int, default=256)
    output_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.heads, args.kv_heads, args.head_dim, args.repeats = 512, 2, 1, 8, 1
        args.decoder_hidden = 32
    return args


if __name__ == "__main__":
    main()
