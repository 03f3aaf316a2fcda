"""LoRA on Conv1d / Conv2d / Conv3d (grouped and depthwise included) and ``lora_bias``, against float64 references
written here, plus their refusals; the PEFT oracle rows are in test_peft_cases.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from lightning_peft.peft import (
    LoRAConfig,
    LoRAConv,
    LoRAConv2d,
    LoRALinear,
    add_adapter,
    combine_adapters,
    inject_lora,
    load_adapter,
    lora_layers,
    merge_lora,
    merged_state_dict,
    route_adapters,
    save_adapter,
)
from tests._models import randomise

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
# (dims, Conv kwargs): a plain, a strided and padded, a dilated, a grouped and a depthwise convolution
BASES = [
    (1, {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "stride": 2, "padding": 1}),
    (1, {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "dilation": 2, "padding": 2}),
    (2, {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "groups": 2}),
    (3, {"in_channels": 2, "out_channels": 6, "kernel_size": 2, "padding": 1}),
    (3, {"in_channels": 4, "out_channels": 4, "kernel_size": 3, "groups": 4}),  # depthwise
]


def _conv(dims: int, **kwargs) -> nn.Module:
    return (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1](**kwargs).double()


def _input(dims: int, channels: int, batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, channels, *[5] * dims, dtype=torch.float64)


def _reference(base: nn.Module, layer: LoRAConv, x: torch.Tensor, name: str = "default") -> torch.Tensor:
    """``W * x + b + s (B * (A * x) + b_B)``: A with the base's stride, padding and dilation, B 1x1 with its groups."""
    conv = CONV[base.weight.dim() - 2]
    a, b = layer.lora_A[name].weight, layer.lora_B[name]
    hidden = conv(x, a, stride=base.stride, padding=base.padding, dilation=base.dilation)
    return base(x) + layer.specs[name].scaling * conv(hidden, b.weight, b.bias, groups=base.groups)


@pytest.mark.parametrize("lora_bias", [False, True])
@pytest.mark.parametrize(("dims", "kwargs"), BASES)
def test_conv_layer_matches_the_reference_and_merges_when_ungrouped(dims, kwargs, lora_bias):
    base = _conv(dims, **kwargs)
    layer = LoRAConv(base, rank=4, alpha=6.0, lora_bias=lora_bias)
    randomise([layer])
    x = _input(dims, kwargs["in_channels"])
    expected = _reference(base, layer, x)
    assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    assert ("lora_B.default.bias" in layer.adapter_parameters()) == lora_bias
    if kwargs.get("groups", 1) > 1:
        return
    before = base.weight.detach().clone(), base.bias.detach().clone()
    layer.merge()
    assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    layer.unmerge()
    assert_close(base.weight, before[0], rtol=0, atol=1e-15)
    assert_close(base.bias, before[1], rtol=0, atol=1e-15)


@pytest.mark.parametrize(("dims", "kwargs"), [b for b in BASES if b[1].get("groups", 1) > 1])
def test_a_grouped_conv_is_refused_at_merge_and_nothing_changes(dims, kwargs):
    model = nn.Sequential(_conv(dims, **kwargs))
    inject_lora(model, rank=4, target_modules=["0"])
    randomise(lora_layers(model))
    weight = model[0].base_layer.weight.detach().clone()
    groups = kwargs["groups"]
    message = rf"layer '0': LoRAConv: the base Conv{dims}d has groups={groups}; .* so it cannot be merged \(PEFT refuses"
    with pytest.raises(RuntimeError, match=message):
        merge_lora(model)
    with pytest.raises(RuntimeError, match=message):
        merged_state_dict(model)
    assert torch.equal(model[0].base_layer.weight, weight) and not model[0].merged


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_a_rank_that_does_not_split_into_the_groups_is_refused_before_anything_changes(dims):
    model = nn.Sequential(_conv(dims, in_channels=4, out_channels=8, kernel_size=1, groups=4))
    with pytest.raises(ValueError, match=rf"LoRA: '0' is a Conv{dims}d with groups=4, so the rank must be a multiple "
                                         r"of 4 \(B is a grouped 1x1 convolution, as in PEFT\); got rank=6\. Use "
                                         r"rank=8, or rank_pattern=\{'0': 8\}\."):
        inject_lora(model, rank=6, target_modules=["0"])
    assert not lora_layers(model)
    with pytest.raises(ValueError, match=r"LoRAConv: 'default' is a .* got rank=2"):
        LoRAConv(model[0], rank=2, alpha=2.0)
    inject_lora(model, rank=6, rank_pattern={"0": 8}, target_modules=["0"])  # the fix the message names
    assert model[0].lora_B["default"].weight.shape == (8, 2, *[1] * dims)


def test_conv2d_keeps_its_public_name():
    assert LoRAConv2d is LoRAConv


@pytest.mark.parametrize(("dims", "kwargs"), [BASES[0], BASES[2], BASES[4]])
def test_a_mixed_batch_on_a_conv_equals_each_sample_run_with_its_own_adapter(dims, kwargs):
    model = nn.Sequential(_conv(dims, **kwargs))
    inject_lora(model, rank=4, target_modules=["0"], lora_bias=True)
    add_adapter(model, "other", rank=8, alpha=3.0, target_modules=["0"])
    randomise(lora_layers(model))
    x = _input(dims, kwargs["in_channels"])
    layer, names = model[0], ["other", None, "default"]
    expected = torch.cat([(_reference(layer.base_layer, layer, x[i:i + 1], n) if n else layer.base_layer(x[i:i + 1]))
                          for i, n in enumerate(names)])
    with route_adapters(model, names):
        assert_close(model(x), expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- lora_bias


def test_lora_bias_on_a_linear_layer_is_trained_and_merged_into_the_base_bias():
    base = nn.Linear(5, 7).double()
    layer = LoRALinear(base, rank=3, alpha=6.0, lora_bias=True)
    assert torch.equal(layer.lora_B["default"].bias, torch.zeros(7, dtype=torch.float64))  # starts at the base
    randomise([layer])
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"]
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    expected = base(x) + 2.0 * F.linear(F.linear(x, a), b.weight, b.bias)
    assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    layer(x).sum().backward()
    assert b.bias.grad is not None and b.bias.grad.abs().sum() > 0
    bias = base.bias.detach().clone()
    layer.merge()
    assert_close(base.bias, bias + 2.0 * b.bias, rtol=1e-12, atol=1e-12)
    assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    state = layer.state_dict()  # taken unmerged, as every merged layer's state
    assert_close(state["base_layer.bias"], bias, rtol=0, atol=1e-15)
    layer.unmerge()
    assert_close(base.bias, bias, rtol=0, atol=1e-15)


def test_lora_bias_into_a_base_without_bias_warns_at_inject_and_is_refused_at_merge():
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 2)).double()
    with pytest.warns(UserWarning, match=r"LoRA\(lora_bias=True\): '0' have no bias, so merging this adapter"):
        inject_lora(model, rank=2, target_modules=["0", "1"], lora_bias=True)
    randomise(lora_layers(model))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"layer '0': LoRALinear: adapter 'default' has lora_bias=True, but the base "
                                           r"Linear has no bias to merge it into \(PEFT refuses this merge too\)"):
        merge_lora(model)
    with pytest.raises(RuntimeError, match=r"layer '0': .* has no bias to merge it into"):
        merged_state_dict(model)
    assert not any(layer.merged for layer in lora_layers(model).values())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"use_dora": True}, (r"LoRA\(lora_bias=True, use_dora=True\): PEFT supports lora_bias only for plain LoRA "
                          r"initialised as init='kaiming'; drop use_dora or lora_bias\.")),
    ({"init": "gaussian"}, r"LoRA\(lora_bias=True, init='gaussian'\): .*; drop init or lora_bias\."),
])
def test_lora_bias_with_what_peft_refuses_it_with_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(lora_bias=True, **kwargs)


def test_lora_bias_on_an_embedding_is_refused_before_anything_changes():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"LoRA\(lora_bias=True\): '0' is an Embedding, which PEFT's lora_bias does "
                                        r"not support; exclude it \(exclude_modules=\['0'\]\) or set lora_bias=False"):
        inject_lora(model, rank=2, target_modules=["0", "1"], lora_bias=True)
    assert not lora_layers(model)


def test_a_mixed_batch_with_lora_bias_on_linear_equals_each_sample_with_its_own_adapter():
    model = nn.Sequential(nn.Linear(5, 4)).double()
    inject_lora(model, rank=2, alpha=2.0, target_modules=["0"], lora_bias=True)
    add_adapter(model, "other", rank=3, target_modules=["0"])
    randomise(lora_layers(model))
    x = torch.randn(3, 2, 5, dtype=torch.float64)
    names = ["default", None, "other"]
    expected = []
    for i, name in enumerate(names):
        with route_adapters(model, [name]):
            expected.append(model(x[i:i + 1]))
    with route_adapters(model, names):
        out = model(x)
    assert_close(out, torch.cat(expected), rtol=1e-12, atol=1e-12)
    assert_close(expected[0], model[0].base_layer(x[:1]) + model[0].lora_B["default"](
        model[0].lora_A["default"](x[:1])), rtol=1e-12, atol=1e-12)  # alpha = rank: s = 1, bias included


def test_lora_bias_round_trips_in_peft_format_and_a_file_without_the_bias_is_refused(tmp_path):
    peft = pytest.importorskip("peft")
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.Flatten(), nn.Linear(12, 2)).double()
    base = copy.deepcopy(model)
    inject_lora(model, rank=2, target_modules=["0", "2"], lora_bias=True)
    randomise(lora_layers(model))
    x = torch.randn(3, 2, 5, dtype=torch.float64)
    save_adapter(model, tmp_path)
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    assert "base_model.model.0.lora_B.default.bias" in dict(theirs.named_parameters())
    assert_close(theirs(x), model(x), rtol=1e-12, atol=1e-12)
    assert_close(load_adapter(copy.deepcopy(base), tmp_path)(x), model(x), rtol=1e-12, atol=1e-12)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "adapter_model.safetensors")
    del tensors["base_model.model.0.lora_B.bias"]
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"lacks key base_model\.model\.0\.lora_B\.bias"):
        load_adapter(copy.deepcopy(base), tmp_path)


def test_lora_bias_on_a_quantized_base_trains_and_merges_when_dequantized():
    pytest.importorskip("torchao")
    model = nn.Sequential(nn.Linear(64, 256))
    reference = copy.deepcopy(model)
    inject_lora(model, rank=2, target_modules=["0"], lora_bias=True, quantize="nf4")
    randomise(lora_layers(model))
    x = torch.randn(3, 64)
    out = model(x)
    merge_lora(model, dequantize=True)
    assert_close(model(x), out, rtol=1e-5, atol=1e-5)
    layer = model[0]
    expected = reference[0].bias + layer.specs["default"].scaling * layer.lora_B["default"].bias
    assert_close(layer.base_layer.bias, expected, rtol=1e-6, atol=1e-6)


def test_combining_adapters_refuses_lora_bias_and_a_grouped_conv_for_cat():
    model = nn.Sequential(nn.Conv2d(4, 4, 1, groups=2), nn.Flatten(), nn.Linear(4, 2))
    inject_lora(model, rank=2, target_modules=["0"])
    add_adapter(model, "other", rank=2, target_modules=["0"])
    with pytest.raises(ValueError, match=r"combine_adapters\(method='cat'\): '0' is a grouped convolution, whose B "
                                         r"splits the rank into groups.*use method='linear'"):
        combine_adapters(model, {"default": 1.0, "other": 1.0}, "both", method="cat")
    combine_adapters(model, {"default": 1.0, "other": 1.0}, "both", method="linear")
    add_adapter(model, "biased", rank=2, target_modules=["2"], lora_bias=True)
    with pytest.raises(ValueError, match=r"combine_adapters: source 'biased' has lora_bias=True; B's biases have no "
                                         "low-rank combination"):
        combine_adapters(model, {"biased": 1.0}, "copy")


def test_a_checkpoint_written_before_lora_bias_resumes_as_lora_bias_false():
    from lightning_peft.peft import LoRAAdapter

    plain = {"adapters": {"default": {"config": LoRAConfig().to_dict(), "targets": ["q"]}}, "modules_to_save": []}
    biased = copy.deepcopy(plain)
    biased["adapters"]["default"]["config"]["lora_bias"] = True
    older = copy.deepcopy(plain)
    del older["adapters"]["default"]["config"]["lora_bias"]
    fields = LoRAAdapter.resume_fields
    assert fields(older) == fields(plain) != fields(biased)  # resuming with lora_bias changed is refused
