"""Benchmark: the mixed-adapter decode step (one token per sample, each sample its own LoRA adapter) and the mixed
batch at 32 x 16, against one adapter, the bare model and Hugging Face PEFT.

Decode. Model: a Hugging Face ``LlamaForCausalLM`` with SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3
key/value heads, feed-forward 1536, vocabulary 49152, tied embeddings; random weights, seeded: no weights are
downloaded), fp32. 32 adapters loaded, LoRA rank 8, alpha 16 on ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``
(120 layers), ``A`` Kaiming, ``B`` N(0, 0.02) (seeded). PEFT's model carries the same 32 adapters with the same
values; the run aborts unless its mixed decode logits agree with ours within 1e-4. A 32-sample batch of 16-token
prompts is prefilled once per model into a ``DynamicCache``; one timed call is the decode step of the next token
for all 32 samples (``model(ids (32, 1), past_key_values=cache)``), after which the cache is cropped back, so every
call sees the same 16 cached tokens. Contenders, alternating:

- bare: the model without LoRA (the floor);
- one adapter: ours with ``set_adapter`` (every sample on ``a0``, the plain LoRA path);
- mixed: ours inside :func:`~lightning_peft.peft.route_adapters` with 32 names over 32 adapters (goal: <= 1.10x one
  adapter);
- PEFT one adapter, PEFT mixed (``adapter_names=``, a loop over the batch's adapters with a mask each).

Beside the step: ``generate`` (greedy, 16 new tokens after the 16-token prompts, the prefill included) routed over 32
adapters, ours (``route_adapters`` around ``model.generate``) against PEFT's ``generate(adapter_names=...)`` and ours
with one adapter; and the decode step against the number of distinct adapters in the batch (1 to 32), ours and PEFT,
relative to the one-adapter step: a table and a PNG plot (``--plot``, shown on ``docs/multi_lora.md``).

Large (``--large``, on by default, off with ``--quick``): the same decode step at TinyLlama-1.1B's shape (hidden
2048, 22 layers, 32 heads, 4 key/value heads, feed-forward 5632, vocabulary 32000, random weights), 32 adapters as
above: mixed against one adapter (goal <= 1.10), the bare model and the gather alone. There the 32 adapters' factors
are 7% of the model's bytes; at SmolLM2-135M's shape they are 22%, and a mixed step has to read them all. Two samples'
mixed logits are checked against the whole batch on their own adapter (no PEFT copy at this size).

Mixed batch at 32 x 16 (``bench_multi_lora.py``'s model: the real MiniLM, 32 LoRA adapters on query/key/value): the
mixed inference batch over 32 adapters against the bare model (goal <= 1.10) and PEFT's, and the mixed training step
(forward with labels, backward, AdamW, ``zero_grad``) against the same step with one adapter and against the
training floor (the frozen model's forward and input-gradient backward, ``bench_lora.py``'s).

Usage::

    python benchmarks/bench_mixed_decode.py --json benchmarks/results/mixed_decode.json \\
        --txt benchmarks/results/mixed_decode.txt --plot docs/img/mixed_decode.png

``--quick``: a 2-layer, 64-wide Llama, 4 adapters, 1 repeat, no MiniLM section (a smoke run; its numbers mean
nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_multi_lora as multi
import torch
from _report import finish, output_arguments, say, say_machine, say_table
from _timing import alternate, row
from torch import Tensor, nn

from lightning_peft.peft import route_adapters, set_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# SmolLM2-135M's shape (the real run) and a smoke shape (--quick).
LLAMA = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
         "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 2048}
# TinyLlama-1.1B's shape (--large): where 32 rank-8 adapters on q/k/v/o are 7% of the model's bytes, not 22%.
TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False,
             "max_position_embeddings": 2048}
QUICK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True, "max_position_embeddings": 256}
TOLERANCE = 1e-4


def llama_base(shape: dict, seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**shape, attention_dropout=0.0)).eval()


class Decode:
    """One model's decode step with a prefilled cache: ``step(how, names)`` runs the next token for the batch."""

    def __init__(self, model: nn.Module, prompts: Tensor, peft_model: bool = False) -> None:
        from transformers import DynamicCache

        self.model, self.peft = model, peft_model
        self.cache = DynamicCache()
        self.next_ids = prompts[:, -1:]  # (B, 1): any token; the cache holds the prompt
        with torch.inference_mode():
            self.model(input_ids=prompts, cache=self.cache, use_cache=True)

    def logits(self, names: list[str] | None) -> Tensor:
        with torch.inference_mode():
            if names is None or self.peft:
                extra = {} if names is None else {"adapter_names": names}
                out = self.model(input_ids=self.next_ids, cache=self.cache, use_cache=True, **extra)
            else:
                with route_adapters(self.model, names):
                    out = self.model(input_ids=self.next_ids, cache=self.cache, use_cache=True)
        self.cache.crop(-1)  # back to the prompt: every call decodes the same position
        return out.logits

    def step_fn(self, names: list[str] | None) -> Callable[[], None]:
        def run() -> None:
            self.logits(names)

        return run


def gather_fn(model: nn.Module, names: list[str]) -> Callable[[], None]:
    """The reads a mixed decode step cannot avoid, alone: every LoRA layer's factors of each sample's adapter,
    stacked as the routed path stacks them (32 adapters: 32x the factor bytes one adapter reads)."""
    from lightning_peft.peft import lora_layers

    layers = list(lora_layers(model).values())

    def run() -> None:
        with torch.inference_mode():
            for layer in layers:
                torch.stack([layer.lora_A[n].weight for n in names])  # (B, r, in)
                torch.stack([layer.lora_B[n].weight for n in names])  # (B, out, r)

    return run


def generate_fn(model: nn.Module, prompts: Tensor, names: list[str] | None, how: str, new: int) -> Callable:
    options = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}

    def run() -> Tensor:
        with torch.inference_mode():
            if how == "peft" and names is not None:
                return model.generate(input_ids=prompts, adapter_names=names, **options)
            if names is None:
                return model.generate(input_ids=prompts, **options)
            with route_adapters(model, names):
                return model.generate(input_ids=prompts, **options)

    return run


def build_pair(base: nn.Module, loaded: int, seed: int) -> tuple[nn.Module, nn.Module]:
    ours = multi.build_ours(base, loaded, seed, targets=TARGETS).eval()
    theirs = multi.build_peft(base, ours, loaded, targets=TARGETS).eval()
    set_adapter(ours, "a0")
    theirs.set_adapter("a0")
    return ours, theirs


def time_decode(args: argparse.Namespace) -> dict:
    shape = QUICK if args.quick else LLAMA
    base = llama_base(shape, args.seed)
    ours, theirs = build_pair(base, args.adapters, args.seed)
    prompts = torch.randint(1, shape["vocab_size"], (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(args.seed))
    decoders = {"bare": Decode(base, prompts), "ours": Decode(ours, prompts), "peft": Decode(theirs, prompts, True)}
    route = multi.routes(args.batch, args.adapters, args.seed)
    diff = (decoders["ours"].logits(route) - decoders["peft"].logits(route)).abs().max().item()
    if not diff <= TOLERANCE:
        sys.exit(f"bench_mixed_decode: ours and PEFT disagree on the mixed decode step by {diff:.2e}.")
    share = factor_share(ours, route)
    say(f"\nmixed decode step, ours against PEFT's logits: max |difference| {diff:.1e}; the {len(set(route))} "
        f"adapters' factors are {share:.1%} of the model's bytes")
    kwargs = {"repeats": args.repeats, "steps": args.steps, "warmup": args.warmup}
    times = alternate({
        "bare": decoders["bare"].step_fn(None), "one": decoders["ours"].step_fn(None),
        "mixed": decoders["ours"].step_fn(route), "peft one": decoders["peft"].step_fn(None),
        "peft mixed": decoders["peft"].step_fn(route), "gather": gather_fn(ours, route),
    }, **kwargs)
    times["one + gather"] = [a + b for a, b in zip(times["one"], times["gather"], strict=True)]
    what = f"decode step, {args.batch} samples over {args.adapters} adapters"
    rows = [
        row(f"{what}: ours mixed / ours one adapter", times["mixed"], times["one"], args.goal),
        row(f"{what}: ours mixed / bare model *", times["mixed"], times["bare"], None),
        row(f"{what}: ours one adapter / bare model *", times["one"], times["bare"], None),
        row(f"{what}: PEFT mixed / PEFT one adapter *", times["peft mixed"], times["peft one"], None),
        row(f"{what}: ours mixed / PEFT mixed *", times["mixed"], times["peft mixed"], None),
        row(f"{what}: (ours one adapter + the gather alone) / ours one adapter: this path's floor *",
            times["one + gather"], times["one"], None),
        row(f"{what}: ours mixed / (ours one adapter + the gather alone) *", times["mixed"], times["one + gather"],
            None),
    ]
    say_table(f"Decode step ({args.batch} x 1 after {args.prompt} cached tokens; median ms)", rows,
          ("contender (ms)", "baseline (ms)"))
    report = {"rows": rows, "equivalence": diff, "shape": shape, "factor_share": share}
    report["generate"] = time_generate(base, ours, theirs, prompts, route, args)
    report["curve"] = time_curve(decoders, args)
    report["our_decoder"] = time_our_decoder(base, ours, prompts, route, args)
    return report


def factor_share(model: nn.Module, names: list[str]) -> float:
    """Bytes of the distinct adapters ``names`` use, over the bare model's: what a mixed step must read beyond one
    adapter's step."""
    from lightning_peft.peft import lora_layers

    adapter = sum(p.numel() for layer in lora_layers(model).values() for n in set(names)
                  for p in layer.factors(n))
    base = sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)
    return adapter / base


def time_large(args: argparse.Namespace) -> dict:
    """The decode step at TinyLlama-1.1B's shape: ours mixed over 32 adapters against one adapter and the bare
    model, and the gather alone (no PEFT copy: three 1.1B-parameter models would not leave the machine room)."""
    base = llama_base(TINYLLAMA, args.seed)
    ours = multi.build_ours(base, args.adapters, args.seed, targets=TARGETS).eval()
    set_adapter(ours, "a0")
    prompts = torch.randint(1, TINYLLAMA["vocab_size"], (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(args.seed))
    bare, mine = Decode(base, prompts), Decode(ours, prompts)
    route = multi.routes(args.batch, args.adapters, args.seed)
    mixed = mine.logits(route)
    for sample in (0, 1):  # each checked sample against the whole batch on its own adapter alone
        set_adapter(ours, route[sample])
        diff = (mixed[sample] - mine.logits(None)[sample]).abs().max().item()
        if not diff <= TOLERANCE:
            sys.exit(f"bench_mixed_decode: sample {sample}'s mixed decode logits differ from its adapter alone by "
                     f"{diff:.2e} at the large shape.")
    set_adapter(ours, "a0")
    share = factor_share(ours, route)
    say(f"\nTinyLlama-1.1B shape: the {len(set(route))} adapters' factors are {share:.1%} of the model's bytes "
        "(SmolLM2-135M shape: see above); mixed logits equal each checked sample on its adapter alone")
    times = alternate({"bare": bare.step_fn(None), "one": mine.step_fn(None), "mixed": mine.step_fn(route),
                       "gather": gather_fn(ours, route)},
                      repeats=args.repeats, steps=max(1, args.steps // 2), warmup=1)
    times["one + gather"] = [a + b for a, b in zip(times["one"], times["gather"], strict=True)]
    what = f"decode step at TinyLlama-1.1B's shape, {args.batch} samples over {args.adapters} adapters"
    rows = [row(f"{what}: ours mixed / ours one adapter", times["mixed"], times["one"], args.goal),
            row(f"{what}: ours one adapter / bare model *", times["one"], times["bare"], None),
            row(f"{what}: (ours one adapter + the gather alone) / ours one adapter: this path's floor *",
                times["one + gather"], times["one"], None)]
    say_table(f"Decode step at TinyLlama-1.1B's shape ({args.batch} x 1 after {args.prompt} cached tokens; median "
              "ms)", rows, ("contender (ms)", "baseline (ms)"))
    return {"rows": rows, "factor_share": share, "shape": TINYLLAMA}


def time_our_decoder(base: nn.Module, ours: nn.Module, prompts: Tensor, route: list[str],
                     args: argparse.Namespace) -> dict:
    """Our `TransformerDecoder` on the same weights (``from_pretrained``), the same 32 adapters: its cached
    ``generate`` routed over them against one adapter and the bare decoder."""
    import tempfile

    from lightning_peft.nn import TransformerDecoder, generate
    from lightning_peft.peft import lora_layers

    with tempfile.TemporaryDirectory() as directory:
        base.save_pretrained(directory)
        bare = TransformerDecoder.from_pretrained(directory).eval()
    decoder = multi.build_ours(bare, args.adapters, args.seed, targets=TARGETS).eval()
    theirs = dict(lora_layers(ours))
    with torch.no_grad():  # the adapters of the Hugging Face model, so both generate the same tokens
        for name, layer in lora_layers(decoder).items():
            source = theirs["model." + name.replace(".attn.", ".self_attn.")]  # layers.0.attn.q_proj
            for adapter in layer.adapter_names:
                layer.lora_B[adapter].weight.copy_(source.lora_B[adapter].weight)
                layer.lora_A[adapter].weight.copy_(source.lora_A[adapter].weight)
    set_adapter(decoder, "a0")
    new = args.new_tokens

    def run(model: nn.Module, names: list[str] | None) -> Callable[[], Tensor]:
        def call() -> Tensor:
            if names is None:
                return generate(model, prompts, new)
            with route_adapters(model, names):
                return generate(model, prompts, new)

        return call

    same = torch.equal(run(decoder, route)(), generate_fn(ours, prompts, route, "ours", new)())
    say(f"\nour decoder's routed generate against transformers' on the same weights and adapters: tokens "
        f"{'equal' if same else 'DIFFER'}")
    times = alternate({"mixed": run(decoder, route), "one": run(decoder, None), "bare": run(bare, None),
                       "transformers mixed": generate_fn(ours, prompts, route, "ours", new)},
                      repeats=args.generate_repeats, steps=1, warmup=1)
    what = f"our decoder's cached generate {args.batch} x {args.prompt} + {new} over {args.adapters} adapters"
    rows = [row(f"{what}: mixed / one adapter", times["mixed"], times["one"], None),
            row(f"{what}: mixed / bare decoder *", times["mixed"], times["bare"], None),
            row(f"{what}: mixed / transformers' generate routed the same *", times["mixed"],
                times["transformers mixed"], None)]
    say_table("Our decoder, routed generate (median ms)", rows, ("contender (ms)", "baseline (ms)"))
    return {"rows": rows, "tokens_equal_transformers": same}


def time_generate(base: nn.Module, ours: nn.Module, theirs: nn.Module, prompts: Tensor, route: list[str],
                  args: argparse.Namespace) -> dict:
    new = args.new_tokens
    mixed = generate_fn(ours, prompts, route, "ours", new)
    tokens = mixed()
    agree = (tokens == generate_fn(theirs, prompts, route, "peft", new)()).float().mean().item()
    say(f"\ngenerate over {args.adapters} adapters, ours against PEFT's greedy tokens: {agree:.1%} equal")
    times = alternate({"mixed": mixed, "one": generate_fn(ours, prompts, None, "ours", new),
                       "peft mixed": generate_fn(theirs, prompts, route, "peft", new),
                       "bare": generate_fn(base, prompts, None, "bare", new)},
                      repeats=args.generate_repeats, steps=1, warmup=1)
    what = f"generate {args.batch} x {args.prompt} + {new} tokens over {args.adapters} adapters"
    rows = [row(f"{what}: ours mixed / ours one adapter", times["mixed"], times["one"], None),
            row(f"{what}: ours mixed / PEFT generate(adapter_names=...)", times["mixed"], times["peft mixed"], None),
            row(f"{what}: ours mixed / bare model *", times["mixed"], times["bare"], None)]
    say_table("Routed generate (median ms)", rows, ("contender (ms)", "baseline (ms)"))
    return {"rows": rows, "token_agreement": agree}


def time_curve(decoders: dict[str, Decode], args: argparse.Namespace) -> dict:
    counts = [c for c in (1, 2, 4, 8, 16, 32) if c <= args.adapters]
    contenders = {"one": decoders["ours"].step_fn(None), "peft one": decoders["peft"].step_fn(None)}
    for count in counts:
        route = multi.routes(args.batch, count, args.seed)
        contenders[f"ours {count}"] = decoders["ours"].step_fn(route)
        contenders[f"peft {count}"] = decoders["peft"].step_fn(route)
    times = alternate(contenders, repeats=args.repeats, steps=max(1, args.steps // 2), warmup=1)
    one = statistics.median(times["one"])
    curve = {"counts": counts, "one_ms": one, "peft_one_ms": statistics.median(times["peft one"]),
             "ours": [statistics.median(times[f"ours {c}"]) / one for c in counts],
             "peft": [statistics.median(times[f"peft {c}"]) / one for c in counts]}
    say(f"\n### Decode step against distinct adapters in the batch (time / ours with one adapter, "
        f"{one:.1f} ms)\n")
    say("| adapters in the batch | " + " | ".join(str(c) for c in counts) + " |")
    say("| --- |" + " ---: |" * len(counts))
    for side in ("ours", "peft"):
        say(f"| {side} | " + " | ".join(f"{v:.2f}" for v in curve[side]) + " |")
    return curve


def time_minilm(args: argparse.Namespace) -> dict:
    """The mixed batch at 32 x 16 over 32 adapters on MiniLM: inference against the bare model and PEFT, and the
    training step against one adapter and the floor."""
    base = multi.load_base(args.seed).eval()
    vocab = base.config.vocab_size
    ours = multi.build_ours(base, 32, args.seed).eval()
    theirs = multi.build_peft(base, ours, 32).eval()
    batch = multi.make_batch(32, 16, vocab, args.seed)
    route = multi.routes(32, 32, args.seed)
    multi.check_same(ours, theirs, batch, route)
    kwargs = {"repeats": args.repeats, "steps": args.steps, "warmup": args.warmup}
    times = alternate({"bare": multi.inference_fn(base, batch, "bare", route),
                       "ours": multi.inference_fn(ours, batch, "ours", route),
                       "one": multi.inference_fn(ours, batch, "ours", [route[0]] * 32),
                       "peft": multi.inference_fn(theirs, batch, "peft", route)}, **kwargs)
    rows = [row("mixed batch 32 x 16 over 32: ours / bare model", times["ours"], times["bare"], args.goal),
            row("mixed batch 32 x 16 over 32: PEFT adapter_names / bare model *", times["peft"], times["bare"], None),
            row("32 x 16, every sample one adapter / bare model *", times["one"], times["bare"], None)]
    train = ours.train()
    optimizer = torch.optim.AdamW([p for p in train.parameters() if p.requires_grad], lr=1e-4)
    floor = multi.floor_model(base, list(multi.lora_layers(train))).train()
    times = alternate({"mixed": multi.train_step_fn(train, optimizer, batch, route),
                       "one": multi.train_step_fn(train, optimizer, batch, [route[0]] * 32),
                       "floor": multi.floor_step_fn(floor, batch)}, **kwargs)
    rows += [row("training step 32 x 16, mixed over 32 / one adapter", times["mixed"], times["one"], args.goal),
             row("training step 32 x 16: mixed / floor (frozen fwd + input-grad bwd) *", times["mixed"],
                 times["floor"], None),
             row("training step 32 x 16: one adapter / floor *", times["one"], times["floor"], None)]
    say_table("Mixed batch at 32 x 16 on MiniLM (median ms)", rows, ("contender (ms)", "baseline (ms)"))
    return {"rows": rows}


def plot(curve: dict, path: str, threads: int) -> None:
    multi.plot_curve(curve, path, xlabel="distinct adapters among 32 samples", ylabel="decode step time / one adapter",
                     title=f"Decode step, SmolLM2-135M shape, r=8 q/k/v/o, {threads} thread(s)",
                     baseline="ours, one adapter (set_adapter)")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict = {"machine": say_machine(), "config": vars(args)}
    report["decode"] = time_decode(args)
    if args.plot:
        plot(report["decode"]["curve"], args.plot, torch.get_num_threads())
    if not args.quick:
        report["minilm"] = time_minilm(args)
    if args.large:
        report["large"] = time_large(args)
    return finish(report, started, args.json, args.txt)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--batch", type=int, default=32, help="samples in the decode batch")
    add("--adapters", type=int, default=32, help="adapters loaded, and distinct adapters in the mixed batch")
    add("--prompt", type=int, default=16, help="cached prompt tokens per sample")
    add("--new-tokens", type=int, default=16, help="tokens generate adds")
    add("--repeats", type=int, default=7)
    add("--steps", type=int, default=4, help="timed calls per repeat (the curve: half)")
    add("--generate-repeats", type=int, default=3, help="repeats of the generate comparisons (one call each)")
    add("--warmup", type=int, default=2)
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add("--goal", type=float, default=1.10)
    add("--quick", action="store_true", help="smoke run: a 2-layer Llama, 4 adapters, 1 repeat, no MiniLM")
    add("--large", action=argparse.BooleanOptionalAction, default=True,
        help="the decode step at TinyLlama-1.1B's shape too (about 9 GB of memory, 5 minutes)")
    output_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.large = False
        args.adapters, args.batch, args.repeats, args.steps, args.warmup, args.new_tokens = 4, 4, 1, 1, 1, 2
        args.generate_repeats = 1
    return args


if __name__ == "__main__":
    main()
