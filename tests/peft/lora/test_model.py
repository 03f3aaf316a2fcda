"""LoRA layers and model surgery against a float64 reference written here, plus exact properties and errors."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from lightning_peft.peft import (
    add_adapter,
    LoRAConfig,
    LoRAConv2d,
    LoRAEmbedding,
    LoRALinear,
    adapter_state_dict,
    inject_lora,
    lora_layers,
    merge_lora,
    merged_state_dict,
    trainable_parameters,
    unmerge_lora,
)
from lightning_peft.peft.adapter import attached
from tests._models import Tiny, conv1d, randomise, tied_gpt2


# ----------------------------------------------------------------------------- layers against a reference


@pytest.mark.parametrize("use_rslora", [False, True])
def test_linear_matches_reference_float64(use_rslora):
    base = nn.Linear(5, 7).double()
    layer = LoRALinear(base, rank=3, alpha=6.0, use_rslora=use_rslora)
    randomise([layer])
    x = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    a = layer.lora_A["default"].weight.detach().clone().requires_grad_(True)  # (r, in)
    b = layer.lora_B["default"].weight.detach().clone().requires_grad_(True)  # (out, r)
    s = 6.0 / (math.sqrt(3) if use_rslora else 3)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = x_ref @ base.weight.T + base.bias + s * (x_ref @ a.T) @ b.T  # (2, 4, 7)
    out = layer(x)
    assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    assert_close(layer.lora_A["default"].weight.grad, a.grad, rtol=1e-12, atol=1e-12)
    assert_close(layer.lora_B["default"].weight.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert layer.scaling == pytest.approx(s)


def test_conv1d_matches_reference_float64():
    base = conv1d(5, 7).double()  # weight (in, out)
    layer = LoRALinear(base, rank=2, alpha=4.0)
    randomise([layer])
    x = torch.randn(3, 5, dtype=torch.float64)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    ref = x @ base.weight + base.bias + 2.0 * (x @ a.T) @ b.T
    assert_close(layer(x), ref, rtol=1e-12, atol=1e-12)
    assert layer.fan_in_fan_out
    assert layer.delta_weight().shape == base.weight.shape


def test_embedding_matches_reference_float64():
    base = nn.Embedding(11, 4, padding_idx=0).double()
    layer = LoRAEmbedding(base, rank=3, alpha=3.0)
    randomise([layer])
    ids = torch.tensor([[0, 3, 10], [5, 5, 1]])
    a, b = layer.lora_embedding_A["default"], layer.lora_embedding_B["default"]  # (r, V), (d, r)
    ref = base.weight[ids] + (a.T[ids] @ b.T)
    assert_close(layer(ids), ref, rtol=1e-12, atol=1e-12)
    layer(ids).sum().backward()
    assert torch.all(layer.lora_embedding_A["default"].grad[:, 0] == 0)  # padding row gets no gradient, as in the base


def test_conv2d_matches_reference_float64():
    base = nn.Conv2d(3, 4, kernel_size=3, stride=2, padding=1).double()
    layer = LoRAConv2d(base, rank=2, alpha=2.0)
    randomise([layer])
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # (r, in, 3, 3), (out, r, 1, 1)
    ref = base(x) + F.conv2d(F.conv2d(x, a, stride=2, padding=1), b)
    assert_close(layer(x), ref, rtol=1e-12, atol=1e-12)
    merge_weight = base.weight + layer.delta_weight()
    assert_close(F.conv2d(x, merge_weight, base.bias, stride=2, padding=1), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d"])
def test_dropout_in_training_mode_masks_the_adapter_input_only(kind):
    base = {"linear": lambda: nn.Linear(5, 7), "conv1d": lambda: conv1d(5, 7),
            "conv2d": lambda: nn.Conv2d(5, 7, 3, padding=1)}[kind]().double()
    layer = (LoRAConv2d if kind == "conv2d" else LoRALinear)(base, rank=2, alpha=4.0, dropout=0.5).train()
    randomise([layer])
    x = torch.randn(4, 5, 6, 6, dtype=torch.float64) if kind == "conv2d" else torch.randn(4, 3, 5, dtype=torch.float64)
    torch.manual_seed(7)
    out = layer(x)
    torch.manual_seed(7)
    mask = F.dropout(torch.ones_like(x), p=0.5, training=True)  # the same draw: 0 or 1 / (1 - p) per element
    assert set(mask.unique().tolist()) == {0.0, 2.0}
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    if kind == "conv2d":
        ref = base(x) + 2.0 * F.conv2d(F.conv2d(x * mask, a, padding=1), b)
    else:
        ref = base(x) + 2.0 * ((x * mask) @ a.T) @ b.T
    assert_close(out, ref, rtol=1e-12, atol=1e-12)
    layer.eval()
    assert_close(layer(x), base(x) + (layer.delta_weight() * 0).sum() + _unmasked(layer, x, kind), rtol=1e-12, atol=1e-12)


def _unmasked(layer, x, kind):
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    if kind == "conv2d":
        return 2.0 * F.conv2d(F.conv2d(x, a, padding=1), b)
    return 2.0 * (x @ a.T) @ b.T


def test_embedding_adapter_ignores_dropout_even_in_training_mode():
    # Dropout on token ids has no meaning (PEFT skips it too): the training-mode output is the exact reference.
    base = nn.Embedding(9, 5).double()
    layer = LoRAEmbedding(base, rank=2, alpha=2.0, dropout=0.5).train()
    randomise([layer])
    ids = torch.randint(0, 9, (4, 3))
    ref = base.weight[ids] + (layer.lora_embedding_A["default"].T[ids] @ layer.lora_embedding_B["default"].T)
    assert_close(layer(ids), ref, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- exact properties


def test_zero_initialised_adapter_reproduces_base_exactly():
    model = Tiny().double()
    ids = torch.randint(0, 10, (3, 5))
    expected = model(ids)
    inject_lora(model, rank=2, target_modules=["query", "value", "embed"])
    assert torch.equal(model(ids), expected)


def test_zero_initialised_adapter_reproduces_hf_bert_exactly(tiny_bert_config):
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification(tiny_bert_config).eval()
    ids = torch.randint(0, 64, (2, 9))
    expected = model(input_ids=ids).logits
    inject_lora(model, rank=4, target_modules="all-linear", init="gaussian")
    assert torch.equal(model(input_ids=ids).logits, expected)


def test_merge_equals_unmerged_and_is_idempotent_and_reversible():
    model = Tiny().double().eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    randomise(inject_lora(model, rank=3, alpha=5, target_modules=["query", "value", "embed"]))
    ids = torch.randint(0, 10, (4, 6))
    unmerged = model(ids)
    assert sorted(merge_lora(model)) == ["blocks.0.query", "blocks.0.value", "blocks.1.query", "blocks.1.value", "embed"]
    assert_close(model(ids), unmerged, rtol=1e-12, atol=1e-12)
    once = {k: v.clone() for k, v in model.named_parameters()}  # the live (merged) weights, not the state view
    assert not torch.equal(once["blocks.0.query.base_layer.weight"], original["blocks.0.query.weight"])
    assert merge_lora(model) == []
    assert all(torch.equal(once[k], v) for k, v in model.named_parameters())  # merge twice == merge once
    unmerge_lora(model)
    restored = {k.replace("base_layer.", ""): v for k, v in model.state_dict().items()}
    for key, value in original.items():
        assert_close(restored[key], value, rtol=1e-13, atol=1e-13)
    assert_close(model(ids), unmerged, rtol=1e-12, atol=1e-12)


def test_merge_in_float32_restores_within_one_rounding():
    model = Tiny()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    randomise(inject_lora(model, rank=2, target_modules=["query"]))
    merge_lora(model)
    unmerge_lora(model)
    assert_close(model.blocks[0]["query"].base_layer.weight, weights["blocks.0.query.weight"], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_merge_is_computed_in_float32(dtype):
    base = nn.Linear(16, 8).to(dtype)
    layer = LoRALinear(base, rank=4, alpha=8.0)
    assert layer.lora_A["default"].weight.dtype == torch.float32  # half-precision bases get float32 adapters
    randomise([layer])
    expected = (base.weight.float() + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight).to(dtype)
    layer.eval()
    layer.merge()
    assert torch.equal(base.weight, expected)
    x = torch.randn(3, 16).to(dtype)
    assert layer(x).dtype == dtype


def test_non_finite_merge_is_refused_and_rolled_back():
    model = Tiny()
    layers = inject_lora(model, rank=2, target_modules=["query"])
    randomise(layers)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        layers["blocks.1.query"].lora_B["default"].weight.fill_(float("inf"))
    with pytest.raises(RuntimeError, match=r"merge_lora: layer 'blocks.1.query'.*would write inf or NaN"):
        merge_lora(model)
    assert not any(layer.merged for layer in layers.values())  # blocks.0 was merged, then rolled back
    assert_close(model.blocks[0]["query"].base_layer.weight, before["blocks.0.query.base_layer.weight"])
    assert torch.equal(model.blocks[1]["query"].base_layer.weight, before["blocks.1.query.base_layer.weight"])
    with pytest.raises(RuntimeError, match="merged_state_dict: layer 'blocks.1.query'"):
        merged_state_dict(model)


def test_only_adapter_parameters_get_gradients():
    model = Tiny()
    randomise(inject_lora(model, rank=2, target_modules=["query", "embed"], modules_to_save=["head"]))
    model(torch.randint(0, 10, (2, 4))).sum().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in model.named_parameters() if p.requires_grad}
    assert with_grad == {
        "embed.lora_embedding_A.default", "embed.lora_embedding_B.default", "head.trained_module.weight",
        "head.trained_module.bias", *(f"blocks.{i}.query.lora_{m}.default.weight" for i in range(2) for m in "AB"),
    }


def test_merged_state_dict_loads_into_the_original_model_and_leaves_training_weights_alone():
    model = Tiny().double()
    fresh = Tiny().double()
    fresh.load_state_dict(model.state_dict())
    randomise(inject_lora(model, rank=2, target_modules=["query", "value", "embed"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fresh.load_state_dict(merged_state_dict(model))  # strict: same keys as the un-adapted model
    ids = torch.randint(0, 10, (3, 4))
    assert_close(fresh(ids), model(ids), rtol=1e-12, atol=1e-12)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------- selection and freezing


def test_inject_returns_the_replaced_modules_and_freezes_the_rest():
    model = Tiny()
    original = model.blocks[0]["query"]
    layers = inject_lora(model, rank=2, target_modules=["query"])
    assert list(layers) == ["blocks.0.query", "blocks.1.query"]
    assert layers["blocks.0.query"].base_layer is original  # wrapped, not copied
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"blocks.{i}.query.lora_{m}.default.weight" for i in range(2) for m in "AB"}
    report = trainable_parameters(model)
    assert report.trainable == 2 * (2 * 6 + 6 * 2)
    assert report.total == sum(p.numel() for p in model.parameters())
    assert report.percent == pytest.approx(100 * report.trainable / report.total)
    assert "trainable params: 48" in str(report)


def test_target_rules_list_suffix_regex_exclude_and_all_linear():
    names = lambda **kw: sorted(inject_lora(Tiny(), rank=1, **kw))  # noqa: E731
    assert names(target_modules=["0.query"]) == ["blocks.0.query"]
    assert names(target_modules=r"blocks\.\d\.(query|value)", exclude_modules=["1.value"]) == [
        "blocks.0.query", "blocks.0.value", "blocks.1.query"
    ]
    # all-linear: every linear layer but the output head (here the last linear, there being no output embeddings)
    assert names(target_modules="all-linear") == ["blocks.0.query", "blocks.0.value", "blocks.1.query", "blocks.1.value"]
    assert names(target_modules=["query", "head"], modules_to_save=["head"]) == ["blocks.0.query", "blocks.1.query"]


def test_all_linear_skips_the_lm_head_of_gpt2():
    model = tied_gpt2()
    chosen = inject_lora(model, rank=2, target_modules="all-linear")
    assert "lm_head" not in chosen
    assert sorted(chosen) == [f"transformer.h.0.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert all(layer.fan_in_fan_out for layer in chosen.values())  # Conv1D


def test_rank_and_alpha_patterns_override_per_module():
    layers = inject_lora(Tiny(), rank=4, alpha=8, target_modules=["query", "value"],
                         rank_pattern={r"1\.query": 2}, alpha_pattern={"value": 1.0})
    assert layers["blocks.1.query"].rank == 2 and layers["blocks.1.query"].scaling == 4.0
    assert layers["blocks.0.query"].rank == 4 and layers["blocks.0.query"].scaling == 2.0
    assert layers["blocks.0.value"].rank == 4 and layers["blocks.0.value"].scaling == 0.25


@pytest.mark.parametrize(("bias", "expected"), [
    ("none", set()),
    ("lora_only", {"blocks.0.query.base_layer.bias", "blocks.1.query.base_layer.bias"}),
    ("all", {"blocks.0.query.base_layer.bias", "blocks.1.query.base_layer.bias", "blocks.0.value.bias",
             "blocks.1.value.bias", "blocks.0.norm.bias", "blocks.1.norm.bias", "head.bias"}),
])
def test_bias_modes(bias, expected):
    model = Tiny()
    inject_lora(model, rank=1, target_modules=["query"], bias=bias)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert trainable == expected
    assert expected <= set(adapter_state_dict(model))


def test_gaussian_and_kaiming_init_start_at_zero_update():
    for init in ("kaiming", "gaussian"):
        layer = LoRALinear(nn.Linear(64, 64), rank=8, alpha=8.0, init=init)
        assert torch.count_nonzero(layer.lora_B["default"].weight) == 0
        assert torch.count_nonzero(layer.delta_weight()) == 0
        assert layer.lora_A["default"].weight.std() > 0
    gaussian = LoRALinear(nn.Linear(512, 512), rank=4, alpha=1.0, init="gaussian")
    assert gaussian.lora_A["default"].weight.std().item() == pytest.approx(1 / 4, rel=0.05)


def test_inject_does_not_mutate_the_config_or_its_lists():
    targets = ["query"]
    config = LoRAConfig(rank=2, target_modules=targets)
    inject_lora(Tiny(), config)
    assert targets == ["query"] and config.target_modules == ["query"]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"rank": 0}, ValueError, r"LoRA\(rank=0\): rank must be an integer >= 1, e\.g\. 8"),
    ({"rank": 2.5}, TypeError, r"LoRA\(rank=2.5\): rank must be an integer >= 1"),
    ({"alpha": 0}, ValueError, r"LoRA\(alpha=0\): alpha must be a finite number > 0"),
    ({"alpha": -1.0}, ValueError, r"LoRA\(alpha=-1.0\): alpha must be a finite number > 0"),
    ({"dropout": 1.0}, ValueError, r"LoRA\(dropout=1.0\): dropout must be a number in \[0, 1\)"),
    ({"dropout": -0.1}, ValueError, r"LoRA\(dropout=-0.1\): dropout must be a number in \[0, 1\)"),
    ({"target_modules": []}, TypeError, r"LoRA\(target_modules=\[\]\): give a non-empty list"),
    ({"target_modules": "query("}, ValueError, r"is not a valid regular expression"),
    ({"modules_to_save": "head"}, TypeError, r"LoRA\(modules_to_save='head'\): modules_to_save must be a list of names"),
    # an element's refusal names the argument as given, then the element
    ({"rank_pattern": {"q": 4, "v": 0}}, ValueError,
     r"LoRA\(rank_pattern=\{'q': 4, 'v': 0\}\): rank_pattern\['v'\]=0 must be an integer >= 1, e\.g\. 8\."),
    ({"alpha_pattern": {"q": -2}}, ValueError,
     r"LoRA\(alpha_pattern=\{'q': -2\}\): alpha_pattern\['q'\]=-2 must be a finite number > 0, e\.g\. 16\."),
    ({"bias": "some"}, ValueError, r"LoRA\(bias='some'\): bias must be one of 'none', 'lora_only', 'all'"),
    ({"init": "pissa_2"}, ValueError, r"LoRA\(init='pissa_2'\): init must be one of 'kaiming', 'gaussian', 'pissa'"),
])
def test_config_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        LoRAConfig(**kwargs)


def test_targets_that_match_nothing_list_the_modules_the_model_has(tiny_bert_config):
    from transformers import BertModel

    with pytest.raises(ValueError, match=r"LoRA\(target_modules=\['q_proj'\]\) matched no module of BertModel\. "
                       r"Modules it can adapt: word_embeddings, .*query \(x2\), key \(x2\), value \(x2\), dense \(x7\)"):
        inject_lora(BertModel(tiny_bert_config), target_modules=["q_proj"])


def test_a_target_entry_that_matches_nothing_is_an_error_naming_it(tiny_bert_config):
    """A typo must not silently adapt fewer modules (12 of 18 on MiniLM with 'vaule')."""
    from transformers import BertModel

    model = BertModel(tiny_bert_config)
    before = dict(model.named_modules())
    with pytest.raises(ValueError, match=r"LoRA\(target_modules=\['query', 'key', 'vaule'\]\): 'vaule' matched no "
                       r"module of BertModel .*modules it can adapt: .*value \(x2\)"):
        inject_lora(model, target_modules=["query", "key", "vaule"])
    assert dict(model.named_modules()) == before
    inject_lora(model, adapter_name="a", target_modules=["query"])
    with pytest.raises(ValueError, match=r"LoRA\(target_modules=\['value', 'kye'\]\): 'kye' matched no module"):
        add_adapter(model, "b", target_modules=["value", "kye"])


def test_a_regex_string_keeps_matching_as_peft_does(tiny_bert_config):
    from transformers import BertModel

    layers = inject_lora(BertModel(tiny_bert_config), target_modules=r".*\.(query|vaule)")
    assert sorted(layers) == [f"encoder.layer.{i}.attention.self.query" for i in range(2)]


def test_unsupported_target_type_is_refused_and_nothing_changes():
    model = Tiny()
    before = dict(model.named_modules())
    with pytest.raises(TypeError, match=r"matched 'blocks.0.norm' of type LayerNorm and others; LoRA supports Linear"):
        inject_lora(model, target_modules=["norm", "query"])
    assert dict(model.named_modules()) == before
    assert all(p.requires_grad for p in model.parameters())


def test_modules_to_save_that_match_nothing():
    with pytest.raises(ValueError, match=r"LoRA\(modules_to_save=\['classifier'\]\): \['classifier'\] matched no module"):
        inject_lora(Tiny(), target_modules=["query"], modules_to_save=["classifier"])


def test_injecting_twice_is_refused():
    model = Tiny()
    inject_lora(model, target_modules=["query"])
    with pytest.raises(RuntimeError, match=r"already has 2 LoRA layers .*'blocks.0.query'.*injected twice"):
        inject_lora(model, target_modules=["value"])


def test_config_and_keywords_together_are_refused():
    with pytest.raises(TypeError, match=r"pass either config or keyword arguments, not both \(got \['rank'\]\)"):
        inject_lora(Tiny(), LoRAConfig(target_modules=["query"]), rank=2)


def test_unmerge_when_not_merged_is_refused():
    model = Tiny()
    layers = inject_lora(model, target_modules=["query"])
    with pytest.raises(RuntimeError, match=r"unmerge_lora: no LoRA layer of Tiny is merged; call merge_lora first"):
        unmerge_lora(model)
    with pytest.raises(RuntimeError, match=r"LoRALinear.unmerge\(\): the layer is not merged"):
        layers["blocks.0.query"].unmerge()


def test_adapter_state_dict_without_adapter_is_refused():
    with pytest.raises(RuntimeError, match=r"adapter_state_dict: Tiny has no adapter; call inject_lora"):
        adapter_state_dict(Tiny())


def test_lora_layers_lists_every_layer():
    model = Tiny()
    inject_lora(model, target_modules=["query", "embed"])
    assert sorted(lora_layers(model)) == ["blocks.0.query", "blocks.1.query", "embed"]


# ----------------------------------------------------------------------------- models that need care


def test_adapters_injected_into_an_eval_model_are_in_eval_mode():
    model = Tiny().eval()
    layers = inject_lora(model, rank=2, target_modules=["query"], dropout=0.5)
    randomise(layers)
    assert not any(layer.training for layer in layers.values())
    ids = torch.randint(0, 10, (2, 5))
    assert torch.equal(model(ids), model(ids))  # no dropout at inference


def test_half_precision_merge_rounds_once_and_unmerge_is_close_but_not_exact():
    torch.manual_seed(0)
    base = nn.Linear(16, 16).to(torch.bfloat16)
    original = base.weight.detach().clone()
    layer = LoRALinear(base, rank=2, alpha=2.0)
    randomise([layer])
    x = torch.randn(3, 16).to(torch.bfloat16)
    layer.eval()
    unmerged = layer(x)
    exact = original.double() + layer.delta_weight().double()  # float64 reference of W + s B A
    layer.merge()
    # One rounding to bfloat16 (relative step 2**-8) of the float32 sum: at most one bf16 ulp from the exact value.
    assert_close(base.weight.double(), exact, rtol=2**-8, atol=1e-30)
    merged = layer(x)
    # The layer output itself (no normalisation after it to hide drift): merged and unmerged differ by
    # bfloat16 rounding of the sum only.
    assert_close(merged.double(), unmerged.double(), rtol=2**-7, atol=2**-7 * unmerged.abs().max().item())
    layer.unmerge()
    # Two roundings, each at most half a bf16 step of the larger magnitude |W + s B A|.
    assert_close(base.weight.double(), original.double(), rtol=0, atol=2**-8 * exact.abs().max().item())
    assert not torch.equal(base.weight, original)  # bf16 merge -> unmerge is not exact; the docs say so


def test_a_module_registered_under_two_names_is_refused():
    model = Tiny()
    model.alias = model.blocks[0]["query"]
    for targets in (["query"], ["alias"]):
        with pytest.raises(ValueError, match=r"the module at '(blocks.0.query|alias)' is also registered as "
                                             r"\['(alias|blocks.0.query)'\]; an adapter would apply under one name only"):
            inject_lora(model, target_modules=targets)


@pytest.mark.parametrize(("target", "tied_to"), [("lm_head", "transformer.wte.weight"), ("wte", "lm_head.weight")])
def test_merging_into_a_tied_weight_is_refused_before_anything_changes(target, tied_to):
    model = tied_gpt2()
    randomise(inject_lora(model, rank=2, target_modules=[target, "c_attn"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=rf"merge_lora: the weight of '.*{target}' is tied to '{tied_to}'"):
        merge_lora(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_merged_state_dict_keeps_tied_weights_apart():
    model = tied_gpt2()
    layers = inject_lora(model, rank=2, target_modules=["wte"])
    randomise(layers)
    state = merged_state_dict(model)
    assert_close(state["transformer.wte.weight"], model.transformer.wte.base_layer.weight + layers["transformer.wte"].delta_weight())
    assert torch.equal(state["lm_head.weight"], model.lm_head.weight)  # the output head never saw the adapter


def test_layers_pass_weight_and_bias_through_for_code_that_reads_them():
    from transformers import T5Config, T5EncoderModel

    model = T5EncoderModel(T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)).eval()
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():  # (freezing alone may switch attention kernels; no_grad keeps both runs on one)
        expected = model(input_ids=ids).last_hidden_state
        layers = inject_lora(model, rank=2, target_modules=["wo"])  # T5 reads self.wo.weight.dtype in forward
        assert torch.equal(model(input_ids=ids).last_hidden_state, expected)
    layer = next(iter(layers.values()))
    assert layer.weight is layer.base_layer.weight and layer.bias is None


def test_modules_that_read_their_childrens_weights_are_not_adapted():
    # nn.TransformerEncoderLayer's fused fast path and nn.MultiheadAttention read child weights directly:
    # an adapter there would be silently skipped, so all-linear leaves them out and naming them is refused.
    model = nn.Sequential(nn.TransformerEncoderLayer(d_model=8, nhead=2, batch_first=True), nn.Linear(8, 8), nn.Linear(8, 2))
    assert sorted(inject_lora(model, rank=2, target_modules="all-linear")) == ["1"]
    for target, owner in (["out_proj", "MultiheadAttention"], ["linear1", "TransformerEncoderLayer"]):
        with pytest.raises(TypeError, match=rf"LoRA\(target_modules=\['{target}'\]\) matched '0.*{target}', which "
                                            rf"belongs to an nn.{owner}: that module reads its children's weights "
                                            r"directly \(fused fast path\), so an adapter there would be silently"):
            inject_lora(nn.Sequential(nn.TransformerEncoderLayer(d_model=8, nhead=2, batch_first=True)), target_modules=[target])


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"rank_pattern": {"q(": 2}}, ValueError, r"LoRA\(rank_pattern=\{'q\(': 2\}\): rank_pattern key='q\(' is not a valid regular"),
    ({"alpha_pattern": {3: 2.0}}, TypeError,
     r"LoRA\(alpha_pattern=\{3: 2.0\}\): alpha_pattern key=3 must be a regular expression string"),
    ({"alpha": float("inf")}, ValueError, r"LoRA\(alpha=inf\): alpha must be a finite number > 0"),
])
def test_pattern_and_alpha_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        LoRAConfig(**kwargs)


@pytest.mark.parametrize("target", ["wte", "lm_head"])
def test_merged_export_of_a_tied_gpt2_loads_untied_with_the_adapted_outputs(target, tmp_path):
    from transformers import GPT2LMHeadModel

    model = tied_gpt2()
    randomise(inject_lora(model, rank=2, target_modules=[target]))
    ids = torch.randint(0, 32, (2, 6))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path, state_dict=merged_state_dict(model))
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is not loaded.transformer.wte.weight
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- hardening


def test_state_dict_of_a_merged_model_reloads_without_applying_the_update_twice():
    model = Tiny().double().eval()
    randomise(inject_lora(model, rank=2, target_modules=["query", "value", "embed"]))
    ids = torch.randint(0, 10, (3, 4))
    expected = model(ids)
    merge_lora(model)
    state = model.state_dict()
    fresh = Tiny().double().eval()
    inject_lora(fresh, rank=2, target_modules=["query", "value", "embed"])
    fresh.load_state_dict(state)  # into an unmerged model
    assert_close(fresh(ids), expected, rtol=1e-12, atol=1e-12)
    model.load_state_dict(state)  # into the merged model itself: it stays merged, once
    assert all(layer.merged for layer in lora_layers(model).values())
    assert_close(model(ids), expected, rtol=1e-12, atol=1e-12)
    unmerge_lora(model)
    assert_close(model(ids), expected, rtol=1e-12, atol=1e-12)


def test_embedding_adapter_honours_the_base_options_like_peft():
    base = nn.Embedding(11, 4, padding_idx=0, scale_grad_by_freq=True).double()
    layer = LoRAEmbedding(base, rank=3, alpha=3.0)
    randomise([layer])
    ids = torch.tensor([[1, 3, 3], [3, 5, 1]])
    a = layer.lora_embedding_A["default"].detach().clone().requires_grad_(True)
    ref = base.weight[ids] + F.embedding(ids, a.T, padding_idx=0, scale_grad_by_freq=True) @ layer.lora_embedding_B["default"].T
    out = layer(ids)
    assert_close(out, ref, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    ref.sum().backward()
    assert_close(layer.lora_embedding_A["default"].grad, a.grad, rtol=1e-12, atol=1e-12)  # frequency-scaled, as the base

    normed = LoRAEmbedding(nn.Embedding(11, 4, max_norm=0.5).double(), rank=3, alpha=3.0)
    randomise([normed])
    normed(ids)
    rows = normed.lora_embedding_A["default"].T[ids.unique()]  # the looked-up rows of A^T were renormalised, as PEFT does
    assert (rows.norm(dim=1) <= 0.5 + 1e-12).all()


def test_sparse_embedding_trains_its_adapter_with_a_dense_gradient():
    layer = LoRAEmbedding(nn.Embedding(11, 4, sparse=True).double(), rank=2, alpha=2.0)
    randomise([layer])
    ids = torch.tensor([[1, 2, 2]])
    a = layer.lora_embedding_A["default"].detach().clone().requires_grad_(True)
    (a.T[ids] @ layer.lora_embedding_B["default"].detach().T).sum().backward()
    layer(ids).sum().backward()
    assert not layer.lora_embedding_A["default"].grad.is_sparse
    assert_close(layer.lora_embedding_A["default"].grad, a.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("init", ["kaiming", "gaussian"])
def test_embedding_init_starts_at_zero_and_follows_the_init_option(init):
    layer = LoRAEmbedding(nn.Embedding(50, 8), rank=4, alpha=4.0, init=init)
    assert torch.count_nonzero(layer.delta_weight()) == 0
    zero, random = ("lora_embedding_A", "lora_embedding_B") if init == "kaiming" else ("lora_embedding_B", "lora_embedding_A")
    assert torch.count_nonzero(getattr(layer, zero)["default"]) == 0
    spread = getattr(layer, random)["default"].std().item()
    assert spread == pytest.approx(1.0 if init == "kaiming" else 1 / 4, rel=0.3)


def test_layers_expose_the_base_layers_attributes():
    linear = LoRALinear(nn.Linear(5, 7), rank=2, alpha=2.0)
    assert (linear.in_features, linear.out_features) == (5, 7)
    assert (LoRALinear(conv1d(5, 7), rank=2, alpha=2.0).nf) == 7
    embedding = LoRAEmbedding(nn.Embedding(9, 3, padding_idx=1), rank=2, alpha=2.0)
    assert (embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx) == (9, 3, 1)
    conv = LoRAConv2d(nn.Conv2d(3, 4, 5), rank=2, alpha=2.0)
    assert (conv.in_channels, conv.out_channels, conv.kernel_size) == (3, 4, (5, 5))
    with pytest.raises(AttributeError, match="no_such_thing"):
        linear.no_such_thing


def test_unload_lora_gives_back_plain_modules_that_save_pretrained_round_trips(tiny_bert_config, tmp_path):
    from transformers import BertForSequenceClassification

    from lightning_peft.peft import unload_lora

    model = BertForSequenceClassification(tiny_bert_config).eval()
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    randomise(inject_lora(model, rank=2, target_modules=["query", "value"]))
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    plain = unload_lora(model, merge=True)
    assert lora_layers(plain) == {} and set(plain.state_dict()) == set(base_state)
    plain.save_pretrained(tmp_path)
    loaded = BertForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)

    again = BertForSequenceClassification(tiny_bert_config).eval()
    again.load_state_dict(base_state)
    randomise(inject_lora(again, rank=2, target_modules=["query"]))
    unload_lora(again, merge=False)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in base_state.items())  # the base as it was


def test_training_a_merged_model_warns_to_unmerge_first():
    model = Tiny()
    randomise(inject_lora(model, rank=2, target_modules=["query"]))
    merge_lora(model)
    with pytest.warns(UserWarning, match=r"LoRALinear: the layer is merged, so its adapter gets no gradient from this "
                                         r"forward\. To train, call unmerge_lora\(model\) first"):
        model(torch.randint(0, 10, (2, 3)))


def test_merge_and_unmerge_on_a_model_without_lora_both_raise():
    for function in (merge_lora, unmerge_lora):
        with pytest.raises(RuntimeError, match=rf"{function.__name__}: Tiny has no LoRA adapter; call inject_lora"):
            function(Tiny())


def test_numpy_integers_and_floats_are_accepted():
    np = pytest.importorskip("numpy")
    config = LoRAConfig(rank=np.int64(8), alpha=np.float32(16.0), rank_pattern={"q": np.int32(2)})
    assert (config.rank, config.alpha, config.rank_pattern) == (8, 16.0, {"q": 2})
    assert type(config.rank) is int and type(config.rank_pattern["q"]) is int


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"rank": "8"}, TypeError, r"LoRA\(rank='8'\): rank must be an integer >= 1, e\.g\. 8"),
    ({"alpha": "16"}, TypeError, r"LoRA\(alpha='16'\): alpha must be a finite number > 0, e\.g\. 16"),
    ({"dropout": "0.1"}, TypeError, r"LoRA\(dropout='0\.1'\): dropout must be a number in \[0, 1\)"),
    ({"use_rslora": "yes"}, TypeError, r"LoRA\(use_rslora='yes'\): use_rslora must be True or False"),
    ({"rank_pattern": ["q"]}, TypeError, r"LoRA\(rank_pattern=\['q'\]\): give a dict \{regex: value\}"),
    ({"rank": 0}, ValueError, r"LoRA\(rank=0\): rank must be an integer >= 1, e\.g\. 8"),
])
def test_wrong_types_raise_type_error_and_bad_values_value_error(kwargs, error, match):
    with pytest.raises(error, match=match):
        LoRAConfig(**kwargs)


def test_a_set_of_target_names_is_accepted():
    assert sorted(inject_lora(Tiny(), rank=2, target_modules={"value", "query"})) == [
        "blocks.0.query", "blocks.0.value", "blocks.1.query", "blocks.1.value"]


@pytest.mark.parametrize(("kwargs", "name", "ours"), [
    ({"r": 8}, "r", "rank"), ({"lora_alpha": 16}, "lora_alpha", "alpha"), ({"lora_dropout": 0.1}, "lora_dropout", "dropout"),
])
def test_peft_argument_names_are_answered_with_ours(kwargs, name, ours):
    with pytest.raises(TypeError, match=rf"inject_lora\({name}=.*\): lightning-peft calls this argument '{ours}'; "
                                        rf"pass {ours}="):
        inject_lora(Tiny(), **kwargs)


def test_an_unknown_argument_lists_the_valid_ones():
    with pytest.raises(TypeError, match=r"inject_lora: unknown argument 'rnak'; LoRA takes rank, alpha, dropout"):
        inject_lora(Tiny(), rnak=8)


def test_a_target_string_is_a_regex_and_the_error_says_to_use_a_list():
    with pytest.raises(ValueError, match=r"LoRA\(target_modules='query'\) matched no module of Tiny\. .* A string is a "
                                         r"regular expression that must match the full module name .* give a list: "
                                         r"\['query'\]"):
        inject_lora(Tiny(), target_modules="query")


@pytest.mark.parametrize("spelling", ["all_linear", "All Linear", "alllinear"])
def test_a_misspelled_all_linear_suggests_peft_spelling_not_a_list(spelling):
    match = (rf"LoRA\(target_modules='{spelling}'\) matched no module of Tiny\. .* Did you mean 'all-linear' "
             r"\(Hugging Face PEFT's spelling, with a hyphen\)\?")
    with pytest.raises(ValueError, match=match) as error:
        inject_lora(Tiny(), target_modules=spelling)
    assert "give a list" not in str(error.value)


@pytest.mark.parametrize("exclude, message", [
    (["qery"], r"LoRA\(exclude_modules=\['qery'\]\): 'qery' matched no module of Tiny .* Fix or remove it"),
    (r"blocks\.9\..*", re.escape(r"LoRA(exclude_modules='blocks\\.9\\..*'): the regular expression matches no "
                                 "module name of Tiny")),
])
def test_an_exclusion_that_matches_nothing_is_refused_as_a_typo(exclude, message):
    model = Tiny()
    with pytest.raises(ValueError, match=message):
        inject_lora(model, target_modules="all-linear", exclude_modules=exclude)
    assert not attached(model)


def test_an_exclusion_that_removes_every_target_blames_exclude_modules():
    with pytest.raises(ValueError, match=r"LoRA\(exclude_modules=\['query'\]\) excludes every module that "
                                         r"target_modules=\['query'\] matched \('blocks\.0\.query', 'blocks\.1\.query'\)"):
        inject_lora(Tiny(), target_modules=["query"], exclude_modules=["query"])


def test_a_model_without_adaptable_modules_says_what_lora_supports():
    model = nn.Sequential(nn.LayerNorm(2), nn.ReLU())
    with pytest.raises(TypeError, match=r"LoRA\(target_modules=\['0'\]\) matched '0' of type LayerNorm; LoRA supports "
                                        r"Linear, .*Embedding, Conv1d, Conv2d, Conv3d, MultiheadAttention\. Name modules of those types instead; Sequential "
                                        r"has: none \(LoRA supports .*, and Sequential has no such module\)"):
        inject_lora(model, target_modules=["0"])


def test_a_rank_above_the_layer_dimensions_warns():
    with pytest.warns(UserWarning, match=r"LoRA: the rank exceeds what 2 layer\(s\) can use: 'blocks\.0\.query' "
                                         r"\(rank 8 > 6\), 'blocks\.1\.query' \(rank 8 > 6\)\. An update of such"):
        inject_lora(Tiny(), rank=8, target_modules=["query"])


def test_a_pattern_that_matches_no_adapted_module_warns():
    with pytest.warns(UserWarning, match=r"LoRA\(rank_pattern=\{'qeury': \.\.\.\}\) matches none of the 4 adapted "
                                         r"modules"):
        inject_lora(Tiny(), rank=2, target_modules=["query", "value"], rank_pattern={"qeury": 4})


def test_a_fresh_task_head_is_saved_by_default_and_kept_frozen_with_an_empty_list(tiny_bert_config):
    from transformers import BertForSequenceClassification

    from lightning_peft.peft.lora import lora_spec

    model = BertForSequenceClassification(tiny_bert_config)
    inject_lora(model, rank=2, target_modules=["query"])
    assert lora_spec(model).modules_to_save == ("classifier",)
    assert model.classifier.trained_module.weight.requires_grad
    frozen = BertForSequenceClassification(tiny_bert_config)
    inject_lora(frozen, rank=2, target_modules=["query"], modules_to_save=[])
    assert lora_spec(frozen).modules_to_save == () and not frozen.classifier.weight.requires_grad


def test_peft_s_merge_and_unload_on_our_model_points_to_unload_lora(tiny_bert_config):
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification(tiny_bert_config)
    inject_lora(model, target_modules=["query"])
    with pytest.raises(AttributeError, match=r"BertForSequenceClassification\.merge_and_unload\(\) is a method of "
                       r"Hugging Face PEFT's PeftModel; .*lightning_peft\.peft\.unload_lora\(model\) returns the plain "
                       "model"):
        model.merge_and_unload()
    with pytest.raises(AttributeError, match=r"unload_lora\(model, merge=False\)"):
        model.unload()
    from lightning_peft.peft import unload_lora

    plain = unload_lora(model)
    assert not hasattr(plain, "merge_and_unload")  # the plain model is plain again
