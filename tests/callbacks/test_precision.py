"""LoRA under the Trainer's precisions: every layer type keeps float32 adapters and a zero update is exact."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_peft.callbacks import LoRA
from lightning_peft.peft import lora_layers

from tests._models import trainer


class EveryLayerType(pl.LightningModule):
    """An Embedding, a Linear, a transformers Conv1D and a Conv2d in one model."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.embed = nn.Embedding(16, 8)
        self.linear = nn.Linear(8, 8)
        self.conv1d = Conv1D(8, 8)  # (out, in) arguments, weight (in, out)
        self.conv2d = nn.Conv2d(1, 2, 3, padding=1)
        self.head = nn.Linear(2 * 8 * 4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv1d(self.linear(self.embed(ids)).relu())  # (B, 4, 8)
        h = self.conv2d(h.unsqueeze(1))  # (B, 2, 4, 8)
        return self.head(h.flatten(1))  # (B, 3)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return nn.functional.cross_entropy(self(ids).float(), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.1)


class CheckLayers(pl.Callback):
    """At the first batch, inside the Trainer's own precision context: each layer equals its base (B = 0)."""

    def __init__(self) -> None:
        self.checked: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx:
            return
        ids = batch[0]
        inputs = {"embed": ids, "linear": torch.randn(4, 8), "conv1d": torch.randn(4, 8),
                  "conv2d": torch.randn(4, 1, 4, 8)}
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            for name, layer in lora_layers(pl_module).items():
                x = inputs[name]
                if x.is_floating_point():
                    x = x.to(layer.base_layer.weight.dtype)
                assert torch.equal(layer(x), layer.base_layer(x)), name
                assert all(p.dtype == torch.float32 for p in layer.adapter_parameters().values()), name
                self.checked.append(name)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_every_layer_type_under_trainer_precision(precision, tmp_path):
    torch.manual_seed(0)
    module = EveryLayerType()
    check = CheckLayers()
    data = DataLoader(TensorDataset(torch.randint(0, 16, (8, 4)), torch.randint(0, 3, (8,))), batch_size=4)
    lora = LoRA(rank=2, alpha=4, target_modules=["embed", "linear", "conv1d", "conv2d"], modules_to_save=["head"])
    trainer(tmp_path, max_steps=2, precision=precision, callbacks=[lora, check]).fit(module, data)
    assert sorted(check.checked) == ["conv1d", "conv2d", "embed", "linear"]
    expected_base = torch.bfloat16 if precision == "bf16-true" else torch.float32
    for layer in lora_layers(module).values():
        assert layer.base_layer.weight.dtype == expected_base
        for param in layer.adapter_parameters().values():
            assert param.dtype == torch.float32  # after two optimizer steps too
        assert torch.count_nonzero(layer.delta_weight()) > 0  # and they trained


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_that_emulates_it_warns(native, tmp_path, monkeypatch):
    import lightning_peft.callbacks._lightning as glue

    monkeypatch.setattr(glue, "cpu_bf16_is_native", lambda: native)
    data = DataLoader(TensorDataset(torch.randint(0, 16, (4, 4)), torch.randint(0, 3, (4,))), batch_size=4)
    lora = LoRA(rank=2, target_modules=["linear"])
    run = trainer(tmp_path, max_steps=1, precision="bf16-mixed", callbacks=[lora])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(EveryLayerType(), data)
    messages = [str(w.message) for w in caught if "without native bf16" in str(w.message)]
    if native:
        assert messages == []
    else:
        assert messages == [
            "LoRA: Trainer(precision='bf16-mixed') on a CPU without native bf16 (no AVX512-BF16 or AMX): PyTorch "
            "emulates it, and a LoRA training step runs many times slower than in float32 (17x measured on such a "
            "CPU). Use precision='32-true' on this machine; bf16 pays on GPUs and on CPUs with AVX512-BF16/AMX."
        ]
