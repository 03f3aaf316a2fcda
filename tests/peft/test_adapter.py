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
from lightning_peft.peft.lora.init import Start
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


def test_lora_answers_the_protocol_s_generic_members():
    from lightning_peft.peft import add_adapter, set_adapter
    from lightning_peft.peft.adapter import DEFAULT, wrapped_layers

    model = Tiny().double().eval()
    inject_lora(model, rank=2, target_modules=["query"])
    add_adapter(model, "b", rank=1, target_modules=["value"])
    lora = attached(model)["lora"]
    # wrapped: the LoRA layers, each with its frozen base layer; wrapped_layers gathers them over techniques.
    assert sorted(lora.wrapped(model)) == ["blocks.0.query", "blocks.0.value", "blocks.1.query", "blocks.1.value"]
    assert wrapped_layers(model).keys() == lora.wrapped(model).keys()
    assert all(isinstance(layer.base_layer, nn.Linear) for layer in lora.wrapped(model).values())
    # matches: the named adapters' settings, not the targets or the active adapter.
    config = lora.config_dict()
    assert lora.matches(config)
    assert not lora.matches({"adapters": {DEFAULT: config["adapters"][DEFAULT]}})
    assert lora.matches({"adapters": {"x": config["adapters"][DEFAULT]}, "first_only": True})
    # resume_fields: what must agree to resume, less the training-only settings (dropout, init) and the active one;
    # init as far as a start rewrote the base (kaiming and gaussian compare equal).
    assert lora.training_only == ("dropout", "init")
    fields = type(lora).resume_fields(config)
    assert fields["rank"] == 2 and fields["b.rank"] == 1 and "dropout" not in fields
    assert fields["b.init"] == Start("gaussian") != Start("pissa") != Start("olora")
    set_adapter(model, "b")
    assert type(lora).resume_fields(lora.config_dict()) == fields
    # merged_state with a name folds that adapter whichever is active.
    randomise(lora.wrapped(model))
    set_adapter(model, DEFAULT)
    with_b, active = merged_state_dict(model, "b"), merged_state_dict(model)
    base = model.blocks[0].value.base_layer.weight
    assert_close(with_b["blocks.0.value.weight"], model.blocks[0].value.merged_weight("b"))
    assert_close(active["blocks.0.value.weight"], base)  # the default adapter does not adapt value
    # remove deletes one named adapter; the layers it alone adapted become plain modules again.
    lora.remove(model, "b")
    assert lora.names == (DEFAULT,) and isinstance(model.blocks[0].value, nn.Linear)
    with pytest.raises(RuntimeError, match=r"delete_adapter\('default'\): it is the model's only LoRA adapter"):
        lora.remove(model, DEFAULT)


def test_a_technique_without_named_adapters_refuses_remove_and_keeps_the_defaults():
    model = Tiny().double()
    scale = ScaleAdapter.inject(model, {"targets": ["blocks.0.value"]})
    assert scale.training_only == () and scale.matches({"targets": ["blocks.0.value"]})
    assert scale.resume_fields(scale.config_dict()) == {"targets": ["blocks.0.value"]}
    with pytest.raises(RuntimeError, match="has no named adapters to remove"):
        scale.remove(model, "x")


def test_every_registered_technique_declares_named_adapters_consistently():
    """Generic code asks ``Adapter.named``, never whether ``names`` exists: a technique that keeps several named
    adapters declares it and provides what that promises (``names``; ``adapter_name`` on its PEFT-format methods,
    ``name`` on ``merged_state``), and one that declares nothing has no ``names``."""
    import inspect

    from lightning_peft.peft.adapter import _REGISTRY

    for cls in _REGISTRY.values():
        assert cls.named == hasattr(cls, "names"), cls.kind
        if cls.named:
            for method in ("peft_config", "peft_state", "check_peft_config", "check_peft_shapes", "from_peft"):
                assert "adapter_name" in inspect.signature(getattr(cls, method)).parameters, (cls.kind, method)
            assert "name" in inspect.signature(cls.merged_state).parameters, cls.kind
    assert {kind for kind, cls in _REGISTRY.items() if cls.named} == {"lora", "ia3"}
