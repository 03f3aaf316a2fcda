"""The adapter protocol: generic machinery works for any technique, and several techniques compose in any order.

A second technique written here (a learned per-output scale, in the spirit of IA3) implements the protocol;
LoRA and it are combined on one model in both orders.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from lightning_peft.peft import (
    Adapter,
    adapter_state_dict,
    attached,
    inject_lora,
    load_adapter,
    merged_state_dict,
    save_adapter,
    trainable_parameters,
    unload_lora,
)
from lightning_peft.peft.adapter import attach, detach, register
from lightning_peft.peft.modules_to_save import set_submodule

from tests._models import Tiny, randomise


class Scaled(nn.Module):
    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.scale = nn.Parameter(torch.ones(base.out_features, dtype=base.weight.dtype))  # (out,)

    def forward(self, x: Tensor) -> Tensor:
        return self.base_layer(x) * self.scale


@register
class ScaleAdapter(Adapter):
    kind: ClassVar[str] = "test_scale"
    peft_type: ClassVar[str] = "TEST_SCALE"
    mergeable: ClassVar[bool] = True

    def __init__(self, targets: list[str]) -> None:
        self.targets = list(targets)

    def state(self, model):
        return {f"{n}.scale": model.get_submodule(n).scale for n in self.targets}

    def config_dict(self):
        return {"targets": self.targets}

    @classmethod
    def inject(cls, model, config):
        for name in config["targets"]:
            set_submodule(model, name, Scaled(model.get_submodule(name)))
        adapter = cls(config["targets"])
        attach(model, adapter)
        return adapter

    def merged_state(self, model, state):
        for name in self.targets:
            scale = state.pop(f"{name}.scale")
            for key in [k for k in state if k.startswith(f"{name}.base_layer.")]:
                state[key.replace(".base_layer.", ".")] = state.pop(key)
            state[f"{name}.weight"] = state[f"{name}.weight"] * scale[:, None]
            state[f"{name}.bias"] = state[f"{name}.bias"] * scale
        return state

    def unload(self, model, merge):
        for name in self.targets:
            set_submodule(model, name, model.get_submodule(name).base_layer)
        detach(model, self.kind)

    def peft_config(self, model) -> dict[str, Any]:
        return {"peft_type": self.peft_type, "targets": self.targets}

    @classmethod
    def from_peft(cls, model, config, source):
        return cls.inject(model, {"targets": config["targets"]})


def scale_values(model: nn.Module) -> None:
    with torch.no_grad():
        for tensor in attached(model)["test_scale"].state(model).values():
            tensor.uniform_(0.5, 1.5)


def adapt(model: nn.Module, order: str) -> nn.Module:
    steps = {
        "lora": lambda: randomise(inject_lora(model, rank=2, target_modules=["query"], modules_to_save=["head"])),
        "scale": lambda: (ScaleAdapter.inject(model, {"targets": ["blocks.0.value", "blocks.1.value"]}),
                          scale_values(model)),
    }
    for step in order.split("+"):
        steps[step]()
    return model


EXPECTED_TRAINABLE = {
    "blocks.0.query.lora_A.default.weight", "blocks.0.query.lora_B.default.weight", "blocks.1.query.lora_A.default.weight",
    "blocks.1.query.lora_B.default.weight", "head.trained_module.weight", "head.trained_module.bias",
    "blocks.0.value.scale", "blocks.1.value.scale",
}


@pytest.mark.parametrize("order", ["lora+scale", "scale+lora"])
def test_freezing_is_the_union_of_techniques_in_either_order(order):
    model = adapt(Tiny().double(), order)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == EXPECTED_TRAINABLE
    assert set(adapter_state_dict(model)) == EXPECTED_TRAINABLE
    assert trainable_parameters(model).trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    model(torch.randint(0, 10, (2, 3))).sum().backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == EXPECTED_TRAINABLE


@pytest.mark.parametrize("order", ["lora+scale", "scale+lora"])
def test_merged_state_dict_folds_every_technique_into_the_plain_model(order):
    model = adapt(Tiny().double(), order).eval()
    plain = Tiny().double().eval()
    plain.load_state_dict(merged_state_dict(model))  # strict: exactly the plain model's keys
    ids = torch.randint(0, 10, (3, 4))
    assert_close(plain(ids), model(ids), rtol=1e-12, atol=1e-12)


def test_several_techniques_save_one_directory_each_and_load_back(tmp_path):
    torch.manual_seed(0)
    base = Tiny().double().eval()
    model = Tiny().double().eval()
    model.load_state_dict(base.state_dict())
    adapt(model, "lora+scale")
    save_adapter(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora", "test_scale"]
    fresh = Tiny().double().eval()
    fresh.load_state_dict(base.state_dict())
    load_adapter(fresh, tmp_path)
    assert set(attached(fresh)) == {"lora", "test_scale"}
    ids = torch.randint(0, 10, (3, 4))
    assert_close(fresh(ids), model(ids), rtol=1e-12, atol=1e-12)


def test_unloading_one_technique_keeps_the_other_trainable():
    model = adapt(Tiny().double(), "scale+lora")
    unload_lora(model)
    assert set(attached(model)) == {"test_scale"}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"blocks.0.value.scale", "blocks.1.value.scale"}
