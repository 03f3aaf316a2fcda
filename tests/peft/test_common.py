"""The scaffolding the PEFT techniques share (peft/_common.py): the wrapper around a base layer and the checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_peft.peft._common import (
    LayerWrapper,
    adapter_dtype,
    refuse_absent,
    refuse_second_injection,
    wraps_a_layer,
)


class Scaled(LayerWrapper):
    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__(base_layer)
        self.scale = nn.Linear(base_layer.out_features, base_layer.out_features)

    def forward(self, x):
        return self.base_layer(x) + self.scale(self.base_layer(x).to(self.scale.weight.dtype)).to(x.dtype)


def test_a_wrapper_reads_the_base_layers_attributes_and_is_recognised():
    layer = Scaled(nn.Linear(4, 3))
    assert (layer.in_features, layer.out_features) == (4, 3) and layer.weight is layer.base_layer.weight
    assert wraps_a_layer(layer) and not wraps_a_layer(layer.base_layer)
    with pytest.raises(AttributeError):
        layer.nothing_like_this


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_cast_reaches_the_base_layer_only(dtype):
    layer = Scaled(nn.Linear(4, 3))
    before = layer.scale.weight.detach().clone()
    nn.Sequential(layer).to(dtype)
    assert layer.base_layer.weight.dtype == dtype
    assert layer.scale.weight.dtype == torch.float32 and torch.equal(layer.scale.weight, before)
    layer.double()  # any other cast reaches everything
    assert {p.dtype for p in layer.parameters()} == {torch.float64}


def test_adapter_dtype_is_float32_or_wider():
    assert adapter_dtype(nn.Linear(2, 2).to(torch.bfloat16)) == torch.float32
    assert adapter_dtype(nn.Linear(2, 2).double()) == torch.float64
    assert adapter_dtype(torch.zeros(2, dtype=torch.int8)) == torch.float32
    assert adapter_dtype(nn.ReLU()) is None


def test_the_checks_name_what_is_wrong():
    model = nn.Sequential(nn.Linear(2, 2))
    refuse_absent(model, ["0"], "X: the recorded adapter")
    with pytest.raises(ValueError, match=r"X: the recorded adapter names module 'head', which Sequential does not "
                                         r"have; it was written for another model\."):
        refuse_absent(model, ["0", "head"], "X: the recorded adapter")
    refuse_second_injection("inject_x", model, None, "x was")
    with pytest.raises(RuntimeError, match=r"inject_x: Sequential already has a thing; x was injected twice\. Use "
                                           r"the model as it is, or build a fresh one\."):
        refuse_second_injection("inject_x", model, "a thing", "x was")
