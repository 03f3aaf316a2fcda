"""LoRA under mixed precision: a zero update leaves the base output bit-for-bit alone, adapters stay float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from lightning_peft.peft import LoRAConv2d, LoRAEmbedding, LoRALinear

from tests._models import conv1d, randomise

LAYERS = {
    "linear": (lambda: nn.Linear(6, 5), LoRALinear, lambda: torch.randn(2, 3, 6)),
    "conv1d": (lambda: conv1d(6, 5), LoRALinear, lambda: torch.randn(2, 3, 6)),
    "embedding": (lambda: nn.Embedding(11, 5), LoRAEmbedding, lambda: torch.randint(0, 11, (2, 3))),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3, padding=1), LoRAConv2d, lambda: torch.randn(2, 3, 5, 5)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_zero_update_under_autocast_returns_the_base_output_exactly(kind, dtype):
    make_base, cls, make_input = LAYERS[kind]
    base = make_base()
    layer = cls(base, rank=2, alpha=4.0)  # B = 0 (A = 0 for embeddings): the update is exactly zero
    x = make_input()
    with torch.autocast("cpu", dtype=dtype):
        expected = base(x)
        out = layer(x)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)
    assert all(p.dtype == torch.float32 for p in layer.adapter_parameters().values())


@pytest.mark.parametrize("kind", list(LAYERS))
def test_autocast_update_matches_float64_reference_within_bf16_precision(kind):
    make_base, cls, make_input = LAYERS[kind]
    layer = cls(make_base(), rank=2, alpha=4.0)
    randomise([layer])
    x = make_input()
    reference = layer.double()(x if kind == "embedding" else x.double())
    layer.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    scale = reference.abs().max().item()
    assert_close(out.double(), reference, rtol=0, atol=2**-6 * scale)  # a few bf16 steps of the largest value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_casting_the_model_to_half_precision_keeps_adapters_float32(kind, dtype):
    make_base, cls, make_input = LAYERS[kind]
    layer = cls(make_base(), rank=2, alpha=4.0)
    randomise([layer])
    before = {k: p.detach().clone() for k, p in layer.adapter_parameters().items()}
    model = nn.Sequential(layer).to(dtype)  # what Trainer(precision="bf16-true") does after setup
    assert layer.base_layer.weight.dtype == dtype
    for key, param in layer.adapter_parameters().items():
        assert param.dtype == torch.float32
        assert torch.equal(param, before[key])  # not rounded through the half type
    x = make_input()
    out = model(x if kind == "embedding" else x.to(dtype))
    assert out.dtype == dtype
    model.double()  # a cast to float64 (reference tests) still reaches the adapters
    assert all(p.dtype == torch.float64 for p in layer.adapter_parameters().values())


def test_zero_update_on_a_bfloat16_base_returns_the_base_output_exactly():
    base = nn.Linear(6, 5).to(torch.bfloat16)
    layer = LoRALinear(base, rank=2, alpha=4.0)
    assert layer.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(3, 6, dtype=torch.bfloat16)
    assert torch.equal(layer(x), base(x))
