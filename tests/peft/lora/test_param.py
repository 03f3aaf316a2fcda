"""LoRA on parameters (``target_parameters``, `lightning_peft.peft.lora.param`): the fused 3-D experts of transformers 5
MoE models equal to Hugging Face PEFT's ``ParamWrapper`` (both expert layouts), our own `MoE` against a float64
reference, named adapters, routing, checkpoints, and every refusal."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.testing import assert_close

from lightning_peft.nn import MoE
from lightning_peft.peft import (
    LoRAAdapter,
    LoRAConfig,
    add_adapter,
    combine_adapters,
    inject_lora,
    load_adapter,
    lora_layers,
    merge_lora,
    merged_state_dict,
    route_adapters,
    set_adapter,
    unload_lora,
    unmerge_lora,
)
from lightning_peft.peft.adapter import attached
from lightning_peft.peft.lora.param import LoRAParameter
from tests.peft.lora._oracle import adapted_pair, assert_equal_to_peft, base_model, close, inputs, trainable

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("model_id", ["Mixtral", "GptOss"])  # experts (E, out, in), and (E, in, out) transposed
def test_fused_experts_equal_peft(model_id, tmp_path):
    """Forward, disable, merge/unmerge and merged weights, files both ways, one step: as PEFT, rank_pattern included
    (it matches the parameter's full name, as in PEFT)."""
    assert_equal_to_peft(model_id, {"r": 2, "lora_alpha": 3, "target_modules": [], "target_parameters": EXPERTS,
                                    "rank_pattern": {"down_proj": 3}}, tmp_path)


def test_fused_experts_with_target_modules_equal_peft(tmp_path):
    assert_equal_to_peft("Mixtral", {"r": 2, "target_modules": ["q_proj", "embed"], "target_parameters": EXPERTS,
                                     "use_rslora": True}, tmp_path)


def test_experts_nest_as_peft_names_them():
    """The first parameter the module registers is wrapped innermost; the in-memory names are PEFT's."""
    ours, theirs, _ = adapted_pair("Mixtral", {"r": 2, "target_modules": [], "target_parameters": EXPERTS})
    experts = ours.model.layers[0].mlp.experts
    assert isinstance(experts, LoRAParameter) and experts.parameter_name == "down_proj"
    assert experts.base_layer.parameter_name == "gate_up_proj"
    assert experts.lora_A["default"].weight.shape == (3 * 2, 6) and experts.lora_B["default"].weight.shape == (8, 6)
    names = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert {f"base_model.model.{n}" for n in names} == {n for n, p in theirs.named_parameters() if p.requires_grad}


def test_the_default_grouped_experts_kernel_equals_peft():
    """transformers' default experts implementation (grouped_mm, float32 only) reads the substituted parameter too."""
    torch.manual_seed(0)
    from tests.peft.lora._oracle import MoE as HFMoE

    base = HFMoE("mixtral", experts="grouped_mm", intermediate=8).eval()  # its CPU kernel: rows of 16 bytes
    kwargs = {"r": 2, "init_lora_weights": False, "target_modules": [], "target_parameters": EXPERTS}
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kwargs))
    ours = copy.deepcopy(base)
    inject_lora(ours, config=LoRAConfig.from_peft(peft.LoraConfig(**{**kwargs, "init_lora_weights": True})))
    ours.load_state_dict({k.removeprefix("base_model.model."): v for k, v in theirs.state_dict().items()})
    x = torch.randn(3, 10)
    with torch.no_grad():
        assert (ours(x) - base(x)).abs().max() > 1e-3
        assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ our own MoE


def _moe() -> nn.Module:
    torch.manual_seed(0)
    return MoE(hidden_size=6, ffn_size=10, num_experts=3, top_k=2, dropless=True).double()


def _randomise(model: nn.Module) -> None:
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for p in layer.adapter_parameters().values():
                p.normal_(0, 0.3)


def test_our_moe_experts_equal_a_reference_that_adds_the_update_to_each_weight():
    """Forward, gradients, merge and unload on lightning_peft.nn.MoE's expert weights against W + s B A per expert."""
    base = _moe()
    model = copy.deepcopy(base)
    layers = inject_lora(model, rank=2, alpha=5, target_modules=[], target_parameters=["up_proj.weight",
                                                                                       "down_proj.weight"])
    assert sorted(layers) == sorted(f"experts.{e}.{p}" for e in range(3) for p in ("up_proj", "down_proj"))
    _randomise(model)
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    factors = {f"{n}.weight": (layer.lora_A["default"].weight, layer.lora_B["default"].weight)
               for n, layer in layers.items()}

    def reference(x):  # the base MoE with every adapted weight replaced by W + (alpha / r) B A
        weights = {n: base.get_parameter(n) + 2.5 * b @ a for n, (a, b) in factors.items()}
        return functional_call(base, weights, (x,))

    y = model(x)
    expected = reference(x)
    assert (expected - base(x)).abs().max() > 1e-3
    assert_close(y, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(y.square().sum(), [t for pair in factors.values() for t in pair])
    expected_grads = torch.autograd.grad(expected.square().sum(), [t for pair in factors.values() for t in pair])
    for got, want in zip(grads, expected_grads):
        assert_close(got, want, rtol=1e-12, atol=1e-12)
    merged = merged_state_dict(model)
    with torch.no_grad():
        for name, (a, b) in factors.items():
            assert_close(merged[name], base.get_parameter(name) + 2.5 * b @ a, rtol=1e-12, atol=1e-12)
        merge_lora(model)
        assert_close(model(x), expected, rtol=1e-12, atol=1e-12)
        unmerge_lora(model)
        assert_close(model(x), y.detach(), rtol=1e-12, atol=1e-12)
        unload_lora(model)
        assert_close(model(x), expected, rtol=1e-12, atol=1e-12)
    assert type(model.experts[0].up_proj) is nn.Linear


# ------------------------------------------------------------------------------------------------ named adapters


def test_named_adapters_on_the_same_parameters_switch_as_in_peft():
    """A second adapter with the same target_parameters shares the wrappers (PEFT allows exactly that)."""
    kwargs = {"r": 2, "target_modules": [], "target_parameters": EXPERTS}
    ours, theirs, base = adapted_pair("Mixtral", kwargs)
    other = {**kwargs, "r": 3}
    add_adapter(ours, "other", LoRAConfig.from_peft(peft.LoraConfig(**other)))
    theirs.add_adapter("other", peft.LoraConfig(**other))
    _randomise(ours)
    theirs.load_state_dict({f"base_model.model.{k}": v for k, v in ours.state_dict().items()}, strict=False)
    x = inputs(base)
    with torch.no_grad():
        for name in ("other", "default"):
            set_adapter(ours, name)
            theirs.set_adapter(name)
            assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)
        theirs.set_adapter("other")
        with route_adapters(ours, ["other"] * 3):  # one adapter for the whole batch: as if it were active
            assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)


def test_an_adapter_on_other_parameters_is_refused_as_in_peft():
    model = base_model("Mixtral")
    inject_lora(model, rank=2, target_modules=[], target_parameters=EXPERTS)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"every named adapter that sets target_parameters must adapt the same"):
        add_adapter(model, "other", rank=2, target_modules=[], target_parameters=["gate_up_proj"])
    assert model.state_dict().keys() == before.keys()
    add_adapter(model, "plain", rank=2, target_modules=["q_proj"])  # an adapter without parameters is fine


def test_a_mixed_routed_batch_and_combining_are_refused():
    model = base_model("Mixtral")
    inject_lora(model, rank=2, target_modules=["q_proj"], target_parameters=EXPERTS)
    add_adapter(model, "other", rank=2, target_modules=["q_proj"], target_parameters=EXPERTS)
    with pytest.raises(ValueError, match=r"adapter 'default' adapts parameters \(target_parameters\).*cannot mix it "
                                         r"with \['other'\]"), route_adapters(model, ["default", "other", "default"]):
        pass
    with pytest.raises(ValueError, match=r"cannot mix it with \[None\]"), route_adapters(model, ["default", None]):
        pass
    with pytest.raises(ValueError, match=r"combine_adapters: source 'default' adapts parameters"):
        combine_adapters(model, {"default": 1.0, "other": 1.0}, "both")


# ------------------------------------------------------------------------------------------------ checkpoints


def test_a_checkpoint_record_restores_the_nested_wrappers():
    """LoRAAdapter.inject (resume) rebuilds the nested parameter wrappers from the record, and the state loads."""
    model = base_model("Mixtral")
    inject_lora(model, rank=2, target_modules=["q_proj"], target_parameters=EXPERTS)
    add_adapter(model, "other", rank=3, target_modules=[], target_parameters=EXPERTS)
    _randomise(model)
    spec = attached(model)["lora"]
    fresh = base_model("Mixtral")
    LoRAAdapter.inject(fresh, spec.config_dict())
    assert attached(fresh)["lora"].adapters.keys() == spec.adapters.keys()
    assert [t for _, (c, t) in attached(fresh)["lora"].adapters.items()] == [t for c, t in spec.adapters.values()]
    fresh.load_state_dict(model.state_dict())
    x = inputs(model)
    with torch.no_grad():
        assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_a_merged_layer_saves_its_unmerged_parameter():
    model = base_model("Mixtral")
    base = copy.deepcopy(model.state_dict())
    inject_lora(model, rank=2, target_modules=[], target_parameters=EXPERTS)
    _randomise(model)
    merge_lora(model)
    state = model.state_dict()
    experts = "model.layers.0.mlp.experts"
    assert_close(state[f"{experts}.base_layer.base_layer.gate_up_proj"], base[f"{experts}.gate_up_proj"])
    assert_close(state[f"{experts}.base_layer.base_layer.down_proj"], base[f"{experts}.down_proj"])


# ------------------------------------------------------------------------------------------------ refusals


def test_dora_and_dropout_with_parameters_are_refused():
    with pytest.raises(ValueError, match=r"LoRA\(target_parameters=\['w'\], use_dora=True\): .*PEFT refuses"):
        LoRAConfig(target_parameters=["w"], use_dora=True)
    with pytest.raises(ValueError, match=r"LoRA\(target_parameters=\[.w.\], dropout=0.1\): .*PEFT refuses the pair"):
        LoRAConfig(target_parameters=["w"], dropout=0.1)
    for other in ({"lora_bias": True}, {"init": "olora"}):
        with pytest.raises(ValueError, match=rf"LoRA\(target_parameters=\['w'\], {next(iter(other))}="):
            LoRAConfig(target_parameters=["w"], **other)
    with pytest.raises(TypeError, match=r"target_parameters must be a list of names"):
        LoRAConfig(target_parameters="mlp.experts.gate_up_proj")
    with pytest.raises(TypeError, match=r"target_modules="):  # [] alone adapts nothing
        LoRAConfig(target_modules=[])


def test_a_name_that_matches_no_parameter_lists_the_candidates():
    model = base_model("Mixtral")
    with pytest.raises(ValueError, match=r"'experts.gate_proj' matched no parameter of MoE .*Parameters it has: "
                                         r".*experts.gate_up_proj, experts.down_proj"):
        inject_lora(model, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.gate_proj"])
    assert not lora_layers(model)


def test_parameters_that_cannot_be_wrapped_are_refused():
    model = base_model("MLP")
    with pytest.raises(TypeError, match=r"'lin0.bias' has 1 dimension\(s\); LoRA adapts 2-D"):
        inject_lora(model, target_modules=[], target_parameters=["lin0.bias"])
    with pytest.raises(ValueError, match=r"'lin1' would be adapted twice, as a module and through its parameter"):
        inject_lora(model, target_modules=["lin1"], target_parameters=["lin1.weight"])
    top = nn.Module()
    top.weight = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"'weight' belongs to Module itself"):
        inject_lora(top, target_modules=[], target_parameters=["weight"])
    assert not lora_layers(model)


def test_peft_configs_with_target_parameters_translate():
    ours = LoRAConfig.from_peft(peft.LoraConfig(r=4, target_parameters=EXPERTS))
    assert (ours.target_modules, ours.target_parameters) == ([], EXPERTS)


class _TwoLayers(nn.Module):
    """Two layers, each a Linear and a module holding a bare (out, in) parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.proj, layer.experts = nn.Linear(4, 4), nn.Module()
            layer.experts.weight = nn.Parameter(torch.randn(4, 4))
            self.layers.append(layer)


def test_layers_and_exclusions_that_would_not_narrow_target_parameters_are_refused():
    """PEFT applies layers_to_transform / exclude_modules to target_modules only: a suffix entry of target_parameters
    still adapts every layer's parameter. Adapting a parameter the user left out is refused; a full name is kept."""
    kwargs = {"target_modules": ["proj"], "layers_to_transform": [0], "layers_pattern": "layers"}
    theirs = peft.get_peft_model(_TwoLayers(), peft.LoraConfig(r=2, target_parameters=["experts.weight"], **kwargs))
    assert {n for n, m in theirs.named_modules() if type(m).__name__ == "ParamWrapper"} == {
        f"base_model.model.layers.{i}.experts" for i in (0, 1)}  # PEFT: layer 1's too
    model = _TwoLayers()
    with pytest.raises(ValueError, match=(
            r"LoRA\(target_parameters=\['experts.weight'\], layers_to_transform=\[0\], layers_pattern='layers'\): "
            r"'layers.1.experts.weight' is outside what layers_to_transform keeps, but layers_to_transform narrows "
            r"target_modules only: PEFT adapts target_parameters regardless of it, so this would adapt it anyway\. "
            r"Name the parameters to adapt in full in target_parameters, e.g\. \['layers.1.experts.weight'\]")):
        inject_lora(model, rank=2, target_parameters=["experts.weight"], **kwargs)
    assert not lora_layers(model)
    chosen = inject_lora(model, rank=2, target_parameters=["layers.0.experts.weight"], **kwargs)
    assert sorted(chosen) == ["layers.0.experts", "layers.0.proj"]
    with pytest.raises(ValueError, match=r"LoRA\(target_parameters=\['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'\], "
                                         r"exclude_modules=\['experts'\]\): 'model.layers.0.mlp.experts.gate_up_proj' is "
                                         r"outside what exclude_modules keeps"):
        inject_lora(base_model("Mixtral"), target_modules=["q_proj"], exclude_modules=["experts"],
                    target_parameters=EXPERTS)


def test_a_peft_file_whose_exclusion_does_not_narrow_target_parameters_loads_as_peft_reads_it(tmp_path):
    kwargs = {"r": 2, "target_modules": ["q_proj"], "exclude_modules": ["experts"], "target_parameters": EXPERTS}
    torch.manual_seed(0)
    theirs = peft.get_peft_model(base_model("Mixtral"), peft.LoraConfig(init_lora_weights=False, **kwargs))
    theirs.save_pretrained(tmp_path)
    ours = base_model("Mixtral")
    load_adapter(ours, tmp_path)
    assert {f"base_model.model.{n}" for n in trainable(ours)} == set(trainable(theirs))
    x = inputs("Mixtral")
    with torch.no_grad():
        assert (ours(x) - base_model("Mixtral")(x)).abs().max() > 1e-3  # not a vacuous comparison
        close(ours(x), theirs.eval()(x), "PEFT's file with exclude_modules beside target_parameters")
