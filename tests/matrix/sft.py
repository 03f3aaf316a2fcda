"""The matrix's causal-LM kind (``"sft"``): `HFCausalLM` around a tiny Hugging Face Llama, trained on packed SFT
batches (``SFTDataModule(packing=True)``'s layout), where a data-parallel rank holds a different number of target
tokens than the other. A global step's rows are split over the data-parallel ranks and each rank packs its share into
one ``(1, T)`` row, so the reference (one process) packs all of them: equal only if the loss is the token mean of the
global batch.
"""

from __future__ import annotations

import tempfile

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_peft._seams import data_parallel
from lightning_peft.data.sft import pack_examples
from lightning_peft.data.sft_rows import IGNORE_INDEX, Example
from lightning_peft.modules import HFCausalLM

ROWS_PER_STEP, VOCAB = 4, 64


def _rows(count: int, seed: int) -> list[Example]:
    """Rows of 3 to 12 tokens, the first 1 to 3 of them a masked prompt."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(3, 13, (), generator=generator))
        prompt = int(torch.randint(1, 4, (), generator=generator))
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        rows.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return rows


class PackedSFT(HFCausalLM):
    """`HFCausalLM` on a tiny Llama (saved to a directory of this process, seeded: every rank loads the same
    weights), its own packed loaders: ``steps`` global batches of 4 rows for training, 2 for validation."""

    def __init__(self, steps: int, fused: bool = False) -> None:
        from tests._models import save_llama

        # 2 key/value heads: tensor parallelism over 2 ranks splits whole heads
        directory = save_llama(tempfile.mkdtemp(prefix="matrix-llama-"), vocab_size=VOCAB, num_key_value_heads=2)
        super().__init__(directory, learning_rate=1e-2, warmup_ratio=0.2, fused=fused or None)
        self.steps = steps

    def _loader(self, steps: int, seed: int) -> DataLoader:
        replicas, rank = data_parallel(self.trainer.strategy)
        rows = _rows(steps * ROWS_PER_STEP, seed)
        batches = [pack_examples(rows[i:i + ROWS_PER_STEP][rank::replicas])
                   for i in range(0, len(rows), ROWS_PER_STEP)]
        # the batches are this rank's already: a sampler over them alone keeps Lightning from splitting them again
        return DataLoader(batches, batch_size=None, sampler=DistributedSampler(batches, 1, 0, shuffle=False))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.steps, seed=1)

    def val_dataloader(self) -> DataLoader:
        return self._loader(2, seed=2)
