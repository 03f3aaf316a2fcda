"""Run for tests/modules/test_hf_causal_lm_ddp.py (the job ``hf_causal_lm`` of ``tests/_two_ranks.py``): `HFCausalLM`
with LoRA on packed batches under a real 2-process DDP fit (gloo), each rank holding a different number of target
tokens; every rank saves what it saw. ``fit(out, devices=1, ...)`` is the one-process reference on the concatenated
batches.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_peft.callbacks import LoRA
from lightning_peft.data.sft import pack_examples
from lightning_peft.data.sft_rows import IGNORE_INDEX, Example
from lightning_peft.modules import HFCausalLM
from lightning_peft.peft import adapter_state_dict
from tests._models import VOCAB, llama_model

STEPS = 2
# (length, prompt tokens) of the rows of each rank's batch at each step: rank 0 holds about three times rank 1's targets
SHAPES = {0: [[(9, 2), (12, 3), (7, 1)], [(11, 2), (10, 4), (8, 2)]],
          1: [[(5, 3), (4, 1)], [(6, 4), (3, 1)]]}


def rows(rank: int, step: int) -> list[Example]:
    """The rows of ``rank``'s batch at ``step``, drawn from a generator of their own."""
    generator = torch.Generator().manual_seed(100 * rank + step)
    examples = []
    for length, prompt in SHAPES[rank][step]:
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        examples.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return examples


def save_model(directory: Path) -> str:
    """A tiny float64-ready Llama with weights large enough that attention is far from uniform."""
    torch.manual_seed(0)
    llama_model(initializer_range=0.3).save_pretrained(directory)
    return str(directory)


class Record(pl.Callback):
    """Every trained parameter's gradient after each backward (DDP has averaged it by then), and ``train_loss``."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []
        self.tokens: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.tokens.append(int(batch["labels"][:, 1:].ne(IGNORE_INDEX).sum()))

    def on_after_backward(self, trainer, pl_module) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()
                           if p.requires_grad})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def fit(out: Path, devices: int, batches: list[dict]) -> dict:
    """``STEPS`` steps of LoRA on ``batches`` (this rank's); returns what `Record` saw and the final adapter."""
    module = HFCausalLM(save_model(out / f"model-rank{os.environ.get('RANK', '0')}"),
                        torch_dtype="float64", learning_rate=1e-2, warmup_ratio=0.0)
    record = Record()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=out,
        use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[LoRA(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]), record],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return {"grads": record.grads, "losses": record.losses, "tokens": record.tokens,
            "adapter": adapter_state_dict(module.model)}


def run(out: Path) -> None:
    """The 2-rank fit: each rank its own packed batches; saves ``OUT/rank<r>.pt``."""
    rank = int(os.environ["RANK"])
    result = fit(out, 2, [pack_examples(rows(rank, step)) for step in range(STEPS)])
    torch.save(result, out / f"rank{rank}.pt")
