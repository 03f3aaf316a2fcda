"""Bottleneck adapters (:mod:`lightning_peft.peft.bottleneck`): placement, numerics, protocol, file format.

Tiny random BERT / GPT-2 / Llama models are built from configs (nothing is downloaded) and compared in float64.
Where outputs of an adapted model are compared with a reference, the adapters are first given random non-zero
weights (a zero up-projection is the identity and would make the comparison vacuous), and the test checks that
the adapted output differs from the base.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors_bytes
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_peft.peft.adapter import adapter_state_dict, attached, merged_state_dict  # noqa: E402
from lightning_peft.peft.bottleneck.model import (  # noqa: E402
    NON_LINEARITIES,
    Bottleneck,
    BottleneckAdapter,
    BottleneckConfig,
    BottleneckLayer,
    bottleneck_layers,
    config_from_file,
    inject_bottleneck_adapters,
    unload_bottleneck_adapters,
)
from lightning_peft.peft.io import load_adapter, save_adapter  # noqa: E402
from lightning_peft.peft import inject_lora, lora_layers, trainable_parameters  # noqa: E402
from tests._models import (  # noqa: E402
    bert_model,
    gpt2_model,
    llama_model,
    reloaded,
    run_with_lightning_blocked,
    seeded,
)

VOCAB = 64
PREFIX = "base_model.model."


# --------------------------------------------------------------------------------------------------- models


_gpt2 = partial(gpt2_model, bos_token_id=0, eos_token_id=0)
BUILDERS: dict[str, Callable[[], nn.Module]] = {"bert": bert_model, "gpt2": _gpt2, "llama": llama_model}

# The exact modules each placement picks (full names in the task model).
EXPECTED = {
    ("bert", "houlsby"): [f"bert.encoder.layer.{i}.{s}" for i in (0, 1)
                          for s in ("attention.output.dense", "output.dense")],
    ("bert", "pfeiffer"): [f"bert.encoder.layer.{i}.output.dense" for i in (0, 1)],
    ("gpt2", "houlsby"): [f"transformer.h.{i}.{s}" for i in (0, 1) for s in ("attn.c_proj", "mlp.c_proj")],
    ("gpt2", "pfeiffer"): [f"transformer.h.{i}.mlp.c_proj" for i in (0, 1)],
    ("llama", "houlsby"): [f"model.layers.{i}.{s}" for i in (0, 1) for s in ("self_attn.o_proj", "mlp.down_proj")],
    ("llama", "pfeiffer"): [f"model.layers.{i}.mlp.down_proj" for i in (0, 1)],
}


def _base(family: str, seed: int = 0) -> nn.Module:
    return seeded(BUILDERS[family], seed)


def _fresh(base: nn.Module, family: str) -> nn.Module:
    """A new, un-adapted instance with ``base``'s weights."""
    return reloaded(base, BUILDERS[family])


def _inputs() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(7))  # (B, T)


def _out(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_inputs()).logits


@torch.no_grad()
def _randomise(model: nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    state = adapter_state_dict(model)
    for key in sorted(state):
        state[key].copy_(0.3 * torch.randn(state[key].shape, generator=generator, dtype=state[key].dtype))


def _assert_differs(adapted: torch.Tensor, base: torch.Tensor) -> None:
    # Relative: a tiny random BERT's logits are ~1e-2.
    assert (adapted - base).abs().max() > 0.1 * base.abs().max(), "the adapter is a no-op: the comparison is vacuous"


def _reference_delta(h: torch.Tensor, adapter: Bottleneck) -> torch.Tensor:
    """The paper's formula, written out in float64: W_up f(W_down h + b_down) + b_up."""
    down_w, down_b = adapter.down.weight.detach().double(), adapter.down.bias.detach().double()
    up_w, up_b = adapter.up.weight.detach().double(), adapter.up.bias.detach().double()
    z = h.double() @ down_w.T + down_b  # (..., m)
    z = {
        "relu": lambda t: torch.clamp(t, min=0),
        "gelu": lambda t: 0.5 * t * (1 + torch.erf(t / 2 ** 0.5)),
        "gelu_tanh": lambda t: 0.5 * t * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (t + 0.044715 * t ** 3))),
        "silu": lambda t: t / (1 + torch.exp(-t)),
        "swish": lambda t: t / (1 + torch.exp(-t)),
        "tanh": lambda t: (torch.exp(t) - torch.exp(-t)) / (torch.exp(t) + torch.exp(-t)),
    }[adapter.non_linearity](z)
    return z @ up_w.T + up_b  # (..., d)


# ------------------------------------------------------------------------------------------ start = base


@pytest.mark.parametrize("placement", ["houlsby", "pfeiffer"])
@pytest.mark.parametrize("family", list(BUILDERS))
def test_a_fresh_adapter_reproduces_the_base_model_exactly(family, placement):
    base = _base(family)
    adapted = _fresh(base, family)
    layers = inject_bottleneck_adapters(adapted, placement=placement, modules_to_save=[])
    for layer in layers.values():
        assert layer.adapter.down.weight.abs().sum() > 0  # not vacuous: only the up-projection is zero
        assert not layer.adapter.up.weight.any() and not layer.adapter.up.bias.any()
    assert torch.equal(_out(adapted), _out(base))


def test_a_fresh_adapter_on_a_bfloat16_base_is_float32_and_leaves_the_output_bit_exact():
    base = _base("llama").to(torch.bfloat16)
    adapted = copy.deepcopy(base)
    layers = inject_bottleneck_adapters(adapted, placement="houlsby")
    assert {p.dtype for layer in layers.values() for p in layer.adapter.parameters()} == {torch.float32}
    assert torch.equal(_out(adapted), _out(base))
    adapted.to(torch.bfloat16)  # a later cast to half precision reaches the base only
    assert {p.dtype for layer in layers.values() for p in layer.adapter.parameters()} == {torch.float32}
    assert layers["model.layers.0.mlp.down_proj"].base_layer.weight.dtype == torch.bfloat16


def test_down_projection_starts_from_a_truncated_normal_of_std_init_scale():
    layer = inject_bottleneck_adapters(nn.Sequential(nn.Linear(256, 256)), target_modules=["0"],
                                       bottleneck_size=256, init_scale=0.05)["0"]
    weight = layer.adapter.down.weight
    assert weight.abs().max() <= 0.1  # truncated at two standard deviations
    assert 0.8 * 0.05 < weight.std() < 0.05  # a normal truncated at 2 std has std 0.88 sigma
    assert not layer.adapter.down.bias.any()


# ----------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("non_linearity", list(NON_LINEARITIES))
def test_layer_output_equals_the_float64_formula(non_linearity):
    torch.manual_seed(0)
    base = nn.Linear(12, 16).double()
    model = nn.Sequential(base)
    layer = inject_bottleneck_adapters(model, target_modules=["0"], reduction_factor=4,
                                       non_linearity=non_linearity)["0"]
    _randomise(model)
    x = torch.randn(3, 5, 12, dtype=torch.float64)  # (B, T, in)
    h = x @ base.weight.detach().T + base.bias.detach()  # (B, T, d)
    torch.testing.assert_close(model(x), h + _reference_delta(h, layer.adapter), rtol=1e-12, atol=1e-12)
    assert layer.adapter.down.weight.shape == (4, 16) and layer.adapter.up.weight.shape == (16, 4)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_model_output_equals_the_formula_applied_after_each_target(family):
    """The adapter acts on the target's output, before the block's residual add and LayerNorm."""
    base = _base(family)
    adapted = _fresh(base, family)
    layers = inject_bottleneck_adapters(adapted, placement="houlsby", non_linearity="gelu", modules_to_save=[])
    _randomise(adapted)
    reference = _fresh(base, family)
    for name, layer in layers.items():
        reference.get_submodule(name).register_forward_hook(
            lambda module, args, out, adapter=layer.adapter: out + _reference_delta(out, adapter)
        )
    _assert_differs(_out(adapted), _out(base))
    torch.testing.assert_close(_out(adapted), _out(reference), rtol=1e-12, atol=1e-12)


def test_dropout_applies_to_the_adapter_output_in_training_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    layer = inject_bottleneck_adapters(model, target_modules=["0"], bottleneck_size=4, dropout=0.5)["0"]
    _randomise(model)
    x = torch.randn(64, 8)
    h = layer.base_layer(x)
    delta = layer.adapter.up(torch.relu(layer.adapter.down(h)))
    model.train()
    torch.manual_seed(3)
    y = model(x)
    torch.manual_seed(3)
    mask = nn.functional.dropout(torch.ones_like(delta), 0.5)
    torch.testing.assert_close(y, h + delta * mask)
    model.eval()
    torch.testing.assert_close(model(x), h + delta)


def test_only_adapter_parameters_and_the_saved_head_get_gradients():
    model = _base("bert").train()
    inject_bottleneck_adapters(model, placement="houlsby", reduction_factor=4, non_linearity="tanh")
    _randomise(model)  # a zero up-projection would leave the down-projection without gradient
    labels = torch.tensor([0, 2])
    model(input_ids=_inputs(), labels=labels).loss.backward()
    owned = {id(t) for t in attached(model)["bottleneck"].state(model).values()}
    params = dict(model.named_parameters())
    with_grad = {n for n, p in params.items() if p.grad is not None}
    assert with_grad == {n for n, p in params.items() if id(p) in owned}
    assert all(params[n].grad.abs().sum() > 0 for n in with_grad)
    assert {n for n, p in params.items() if p.requires_grad} == with_grad
    assert "classifier.trained_module.weight" in with_grad and "classifier.original_module.weight" not in with_grad


# ----------------------------------------------------------------------------------------------- placement


@pytest.mark.parametrize("family, placement", list(EXPECTED))
def test_placement_picks_exactly_the_sub_layer_output_projections(family, placement):
    model = BUILDERS[family]()
    assert sorted(inject_bottleneck_adapters(model, placement=placement)) == sorted(EXPECTED[family, placement])
    assert sorted(bottleneck_layers(model)) == sorted(EXPECTED[family, placement])


def test_placement_defaults_to_houlsby_and_works_on_the_bare_backbone():
    model = bert_model("base")
    names = sorted(inject_bottleneck_adapters(model))
    assert names == sorted(n.removeprefix("bert.") for n in EXPECTED["bert", "houlsby"])
    assert attached(model)["bottleneck"].config.placement == "houlsby"


def test_target_modules_follow_lora_matching_rules():
    model = bert_model()
    by_suffix = sorted(inject_bottleneck_adapters(model, target_modules=["output.dense"], modules_to_save=[]))
    assert by_suffix == sorted(EXPECTED["bert", "houlsby"])  # a suffix matches attention.output.dense too
    model = bert_model()
    regex = r".*layer\.\d+\.output\.dense"
    assert sorted(inject_bottleneck_adapters(model, target_modules=regex, modules_to_save=[])) == sorted(
        EXPECTED["bert", "pfeiffer"])


def test_sizes_follow_reduction_factor_or_bottleneck_size():
    model = llama_model()
    layers = inject_bottleneck_adapters(model, target_modules=["o_proj", "v_proj"], reduction_factor=4)
    assert layers["model.layers.0.self_attn.o_proj"].adapter.down.weight.shape == (4, 16)
    assert layers["model.layers.0.self_attn.v_proj"].adapter.down.weight.shape == (2, 8)  # one kv head: d = 8
    tiny = inject_bottleneck_adapters(llama_model(), placement="pfeiffer", reduction_factor=64)
    assert tiny["model.layers.0.mlp.down_proj"].adapter.down.weight.shape == (1, 16)  # at least 1
    fixed = inject_bottleneck_adapters(_gpt2(), placement="pfeiffer", bottleneck_size=5)
    assert fixed["transformer.h.1.mlp.c_proj"].adapter.up.weight.shape == (16, 5)


def test_task_head_is_trained_and_saved_by_default():
    model = bert_model()
    inject_bottleneck_adapters(model)
    assert attached(model)["bottleneck"].modules_to_save == ("classifier",)
    model = bert_model()
    inject_bottleneck_adapters(model, modules_to_save=[])
    assert not any(p.requires_grad for p in model.classifier.parameters())


# --------------------------------------------------------------------------------------- protocol, unload


def test_protocol_members():
    model = bert_model()
    inject_bottleneck_adapters(model, placement="pfeiffer", reduction_factor=8, non_linearity="tanh")
    adapter = attached(model)["bottleneck"]
    assert isinstance(adapter, BottleneckAdapter)
    assert (adapter.kind, adapter.peft_type, adapter.mergeable) == ("bottleneck", "LIGHTNING_PEFT_BOTTLENECK", False)
    assert json.loads(json.dumps(adapter.config_dict())) == adapter.config_dict()
    assert sorted(adapter.state(model)) == sorted(
        [f"{n}.adapter.{p}.{w}" for n in EXPECTED["bert", "pfeiffer"]
         for p in ("down", "up") for w in ("weight", "bias")]
        + ["classifier.trained_module.weight", "classifier.trained_module.bias"]
    )
    assert trainable_parameters(model).trainable == 2 * (2 * 16 + 2 + 16 * 2 + 16) + (3 * 16 + 3)


def test_config_dict_rebuilds_the_same_adapter_on_a_fresh_model():
    base = _base("gpt2")
    adapted = _fresh(base, "gpt2")
    inject_bottleneck_adapters(adapted, placement="houlsby", non_linearity="silu", reduction_factor=4)
    _randomise(adapted)
    fresh = _fresh(base, "gpt2")
    rebuilt = BottleneckAdapter.inject(fresh, attached(adapted)["bottleneck"].config_dict())
    assert rebuilt.config == attached(adapted)["bottleneck"].config
    fresh.load_state_dict(adapted.state_dict())
    torch.testing.assert_close(_out(fresh), _out(adapted), rtol=0, atol=0)


def test_merging_is_refused_and_unload_drops_the_adapters():
    base = _base("bert")
    adapted = _fresh(base, "bert")
    inject_bottleneck_adapters(adapted)
    _randomise(adapted)
    with pytest.raises(RuntimeError, match=r"BottleneckAdapter: the bottleneck adapter cannot be merged into the base "
                                           r"weights\."):
        merged_state_dict(adapted)
    with pytest.raises(RuntimeError, match=r"BottleneckAdapter\.unload\(merge=True\): a bottleneck adapter cannot be "
                                           r"merged into the base weights \(its non-linearity does not fold into a "
                                           r"linear layer\)\. unload_bottleneck_adapters\(model\) drops"):
        attached(adapted)["bottleneck"].unload(adapted, merge=True)
    assert bottleneck_layers(adapted)  # the refused unload changed nothing
    assert unload_bottleneck_adapters(adapted) is adapted
    assert not bottleneck_layers(adapted) and not attached(adapted)
    assert type(adapted.bert.encoder.layer[0].output.dense) is nn.Linear
    assert type(adapted.classifier) is nn.Linear
    assert adapted.state_dict().keys() == base.state_dict().keys()
    assert torch.equal(_out(adapted), _out(base))
    with pytest.raises(RuntimeError, match=r"unload_bottleneck_adapters: BertForSequenceClassification has no "
                                           r"bottleneck adapter; call inject_bottleneck_adapters\(model, \.\.\.\) "
                                           r"first"):
        unload_bottleneck_adapters(adapted)


# ------------------------------------------------------------------------------------------- with LoRA


def test_bottleneck_then_lora_all_linear_trains_both_and_round_trips(tmp_path):
    base = _base("bert")
    adapted = _fresh(base, "bert")
    inject_bottleneck_adapters(adapted, placement="houlsby", modules_to_save=[])
    inject_lora(adapted, rank=2, target_modules="all-linear", modules_to_save=["classifier"])
    # LoRA adapts the layer inside the bottleneck wrapper, never the adapter's own projections.
    assert "bert.encoder.layer.0.output.dense.base_layer" in lora_layers(adapted)
    assert not any(".adapter." in name for name in lora_layers(adapted))
    _randomise(adapted)
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_state_dict(adapted))
    assert any(".adapter.down." in n for n in trainable) and any("lora_A" in n for n in trainable)
    _assert_differs(_out(adapted), _out(base))

    save_adapter(adapted, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bottleneck", "lora"]
    assert json.loads((tmp_path / "bottleneck" / "adapter_config.json").read_text())["peft_type"] == (
        "LIGHTNING_PEFT_BOTTLENECK")
    fresh = _fresh(base, "bert")
    load_adapter(fresh, tmp_path)
    assert torch.equal(_out(fresh), _out(adapted))


def test_lora_elsewhere_then_bottleneck_works_in_either_order():
    base = _base("llama")
    outputs = []
    for order in ("lora first", "bottleneck first"):
        model = _fresh(base, "llama")
        steps = [lambda m: inject_lora(m, rank=2, target_modules=["q_proj", "v_proj"]),
                 lambda m: inject_bottleneck_adapters(m, placement="houlsby")]
        for step in steps if order == "lora first" else steps[::-1]:
            step(model)
        _randomise(model)
        assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapter_state_dict(model))
        outputs.append(_out(model))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)  # same values in the same sorted keys


def test_a_bottleneck_around_a_lora_layer_is_refused():
    model = bert_model()
    inject_lora(model, rank=2, target_modules=["dense"], modules_to_save=[])
    with pytest.raises(ValueError, match=r"BottleneckAdapters: 'bert\.encoder\.layer\.0\.attention\.output\.dense' is "
                                         r"already wrapped by the lora adapter \(LoRALinear\); a bottleneck adapter "
                                         r"around it would move that adapter's parameters\. Inject the bottleneck "
                                         r"adapters first"):
        inject_bottleneck_adapters(model, modules_to_save=[])
    assert not bottleneck_layers(model) and list(attached(model)) == ["lora"]


def test_a_head_saved_by_lora_stays_with_lora():
    model = bert_model()
    inject_lora(model, rank=2, target_modules=["query"])  # saves the classifier head
    inject_bottleneck_adapters(model)
    assert attached(model)["bottleneck"].modules_to_save == ()
    with pytest.raises(ValueError, match=r"BottleneckAdapters\(modules_to_save=\['classifier'\]\): 'classifier' is "
                                         r"already trained and saved in full by another adapter on this model; leave "
                                         r"it out of modules_to_save here\."):
        inject_bottleneck_adapters(_with_lora_head(), modules_to_save=["classifier"])


def _with_lora_head() -> nn.Module:
    model = bert_model()
    inject_lora(model, rank=2, target_modules=["query"])
    return model


# ------------------------------------------------------------------------------------------ save / load


def _saved(tmp_path: Path, family: str = "bert", **kwargs) -> tuple[nn.Module, nn.Module]:
    base = _base(family)
    adapted = _fresh(base, family)
    inject_bottleneck_adapters(adapted, **kwargs)
    _randomise(adapted)
    save_adapter(adapted, tmp_path)
    return base, adapted


@pytest.mark.parametrize("family", list(BUILDERS))
def test_save_then_load_into_a_fresh_model_is_exact(family, tmp_path):
    base, adapted = _saved(tmp_path, family, placement="houlsby", non_linearity="gelu_tanh", reduction_factor=4)
    fresh = _fresh(base, family)
    load_adapter(fresh, tmp_path)
    _assert_differs(_out(adapted), _out(base))
    assert torch.equal(_out(fresh), _out(adapted))
    # The file records the exact modules saved, so the rule None (the task head) comes back as their names.
    saved = attached(adapted)["bottleneck"]
    assert attached(fresh)["bottleneck"].config == dataclasses.replace(
        saved.config, modules_to_save=list(saved.modules_to_save))
    assert {n for n, p in fresh.named_parameters() if p.requires_grad} == set(adapter_state_dict(fresh))


def test_saved_files_are_as_documented(tmp_path):
    _, adapted = _saved(tmp_path, placement="pfeiffer", non_linearity="relu", dropout=0.1, init_scale=0.02)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config == {
        "peft_type": "LIGHTNING_PEFT_BOTTLENECK",
        "format_version": 1,
        "base_model_name_or_path": None,
        "placement": "pfeiffer",
        "target_modules": EXPECTED["bert", "pfeiffer"],
        "reduction_factor": 16,
        "bottleneck_size": None,
        "non_linearity": "relu",
        "dropout": 0.1,
        "init_scale": 0.02,
        "modules_to_save": ["classifier"],
    }
    tensors = load_safetensors_bytes((tmp_path / "adapter_model.safetensors").read_bytes())
    shapes = {f"{PREFIX}{n}.adapter.{p}": s for n in EXPECTED["bert", "pfeiffer"] for p, s in (
        ("down.weight", (1, 16)), ("down.bias", (1,)), ("up.weight", (16, 1)), ("up.bias", (16,)))}
    shapes.update({f"{PREFIX}classifier.weight": (3, 16), f"{PREFIX}classifier.bias": (3,)})
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    state = adapted.state_dict()
    assert torch.equal(tensors[f"{PREFIX}classifier.weight"], state["classifier.trained_module.weight"])
    name = EXPECTED["bert", "pfeiffer"][1]
    assert torch.equal(tensors[f"{PREFIX}{name}.adapter.up.weight"], state[f"{name}.adapter.up.weight"])


def test_target_modules_config_round_trips_with_exact_names(tmp_path):
    base, adapted = _saved(tmp_path, "llama", target_modules=r".*\.(o_proj|up_proj)", bottleneck_size=3)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["placement"] is None and config["bottleneck_size"] == 3 and config["reduction_factor"] is None
    assert config["target_modules"] == [f"model.layers.{i}.{s}" for i in (0, 1)
                                        for s in ("self_attn.o_proj", "mlp.up_proj")]
    fresh = _fresh(base, "llama")
    load_adapter(fresh, tmp_path)
    assert torch.equal(_out(fresh), _out(adapted))


def test_a_bottleneck_size_its_own_weights_do_not_have_is_refused_before_allocating(tmp_path):
    base, _ = _saved(tmp_path, "llama", target_modules=["layers.0.mlp.up_proj"], bottleneck_size=3)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "bottleneck_size": 16777216}))  # 2**24
    fresh = _fresh(base, "llama")
    key = r"base_model\.model\.model\.layers\.0\.mlp\.up_proj\.adapter\.down\.weight"
    with pytest.raises(ValueError, match=rf"key {key} has shape \(3, 32\) .*says bottleneck_size=16777216: the file's "
                                         "tensors disagree with its config"):
        load_adapter(fresh, tmp_path)
    assert not attached(fresh)


def test_loading_into_a_model_with_the_same_adapter_copies_the_weights(tmp_path):
    base, adapted = _saved(tmp_path, placement="houlsby")
    fresh = _fresh(base, "bert")
    inject_bottleneck_adapters(fresh, placement="houlsby")
    load_adapter(fresh, tmp_path)
    assert torch.equal(_out(fresh), _out(adapted))


def test_a_compiled_model_saves_clean_names(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4))
    compiled = torch.compile(model)
    inject_bottleneck_adapters(compiled, target_modules=["0"], bottleneck_size=2)
    save_adapter(compiled, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"] == ["0"]


# ----------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, error, message", [
    ({"placement": "parallel"}, ValueError,
     r"BottleneckAdapters\(placement='parallel'\): placement must be one of 'houlsby', 'pfeiffer'\."),
    ({"placement": "houlsby", "target_modules": ["dense"]}, ValueError,
     r"BottleneckAdapters\(placement='houlsby', target_modules=\['dense'\]\): give one of them; placement picks"),
    ({"target_modules": []}, TypeError,
     r"BottleneckAdapters\(target_modules=\[\]\): give a non-empty list of module names or dotted suffixes"),
    ({"target_modules": "(dense"}, ValueError,
     r"BottleneckAdapters\(target_modules='\(dense'\): target_modules is not a valid regular expression"),
    ({"reduction_factor": 0}, ValueError,
     r"BottleneckAdapters\(reduction_factor=0\): reduction_factor must be a finite number > 0, e\.g\. 16\."),
    ({"reduction_factor": "16"}, TypeError,
     r"BottleneckAdapters\(reduction_factor='16'\): reduction_factor must be a finite number > 0"),
    ({"reduction_factor": 8, "bottleneck_size": 4}, ValueError,
     r"BottleneckAdapters\(reduction_factor=8, bottleneck_size=4\): give one of them"),
    ({"bottleneck_size": 0}, ValueError,
     r"BottleneckAdapters\(bottleneck_size=0\): bottleneck_size must be an integer >= 1, e\.g\. 24\."),
    ({"bottleneck_size": 2.5}, TypeError,
     r"BottleneckAdapters\(bottleneck_size=2\.5\): bottleneck_size must be an integer >= 1"),
    ({"non_linearity": "softmax"}, ValueError,
     r"BottleneckAdapters\(non_linearity='softmax'\): non_linearity must be one of 'relu', 'gelu', 'gelu_tanh', "
     r"'silu', 'swish', "
     r"'tanh'\."),
    ({"dropout": 1.0}, ValueError,
     r"BottleneckAdapters\(dropout=1\.0\): dropout must be a number in \[0, 1\), e\.g\. 0\.1\."),
    ({"dropout": True}, TypeError, r"BottleneckAdapters\(dropout=True\): dropout must be a number in \[0, 1\)"),
    ({"init_scale": 0.0}, ValueError,
     r"BottleneckAdapters\(init_scale=0\.0\): init_scale must be a finite number > 0, e\.g\. 0\.01\."),
    ({"init_scale": float("inf")}, ValueError,
     r"BottleneckAdapters\(init_scale=inf\): init_scale must be a finite number > 0"),
    ({"modules_to_save": "classifier"}, TypeError,
     r"BottleneckAdapters\(modules_to_save='classifier'\): modules_to_save must be a list of names, e\.g\. "
     r"\['classifier'\]\."),
])
def test_invalid_settings_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        BottleneckConfig(**kwargs)


def test_argument_errors_of_the_inject_function():
    with pytest.raises(TypeError, match=r"inject_bottleneck_adapters: unknown argument 'rank'; bottleneck adapters "
                                        r"take placement, target_modules, reduction_factor, bottleneck_size, "
                                        r"non_linearity, dropout, init_scale, modules_to_save\."):
        inject_bottleneck_adapters(bert_model(), rank=8)
    with pytest.raises(TypeError, match=r"inject_bottleneck_adapters: pass either config or keyword arguments, not "
                                        r"both \(got \['dropout'\]\)\."):
        inject_bottleneck_adapters(bert_model(), BottleneckConfig(), dropout=0.1)
    with pytest.raises(TypeError, match=r"inject_bottleneck_adapters\(config=dict\): give a BottleneckConfig, or its "
                                        r"fields as keyword arguments\."):
        inject_bottleneck_adapters(bert_model(), {"placement": "houlsby"})


def test_an_unknown_architecture_without_target_modules_is_refused_listing_candidates():
    model = nn.ModuleDict({"encoder": nn.ModuleList([nn.ModuleDict({"fc1": nn.Linear(4, 8), "fc2": nn.Linear(8, 4)})
                                                     for _ in range(2)])})
    with pytest.raises(ValueError, match=r"BottleneckAdapters\(placement='houlsby'\): ModuleDict is not a BERT-, "
                                         r"GPT-2- or Llama-style model \(it lacks the sub-layer output projections: "
                                         r"BERT's layer\.N\.attention\.output\.dense / .*\), so placement cannot pick "
                                         r"the modules\. Name the output projections of its attention and "
                                         r"feed-forward sub-layers with target_modules instead\. Modules it can take "
                                         r"an adapter after: fc1 \(x2\), fc2 \(x2\)\.$"):
        inject_bottleneck_adapters(model)
    assert sorted(inject_bottleneck_adapters(model, target_modules=["fc2"])) == ["encoder.0.fc2", "encoder.1.fc2"]


def test_a_model_with_the_names_of_two_families_is_ambiguous():
    block = lambda: nn.ModuleDict({"attn": nn.ModuleDict({"c_proj": nn.Linear(4, 4)}),  # noqa: E731
                                   "mlp": nn.ModuleDict({"c_proj": nn.Linear(4, 4), "down_proj": nn.Linear(4, 4)}),
                                   "self_attn": nn.ModuleDict({"o_proj": nn.Linear(4, 4)})})
    model = nn.ModuleDict({"h": nn.ModuleList([block()]), "layers": nn.ModuleList([block()])})
    with pytest.raises(ValueError, match=r"BottleneckAdapters\(placement='pfeiffer'\): ModuleDict has the sub-layer "
                                         r"names of several families \(GPT-2, Llama\), so the placement is ambiguous\. "
                                         r"Name the modules with target_modules instead\."):
        inject_bottleneck_adapters(model, placement="pfeiffer")


def test_target_modules_matching_nothing_is_refused():
    with pytest.raises(ValueError, match=r"BottleneckAdapters\(target_modules=\['o_proj'\]\) matched no module of "
                                         r"BertForSequenceClassification\. Modules it can take an adapter after: "
                                         r"query \(x2\), key \(x2\), value \(x2\), dense \(x7\), classifier\.$"):
        inject_bottleneck_adapters(bert_model(), target_modules=["o_proj"])
    with pytest.raises(ValueError, match=r"matched no module of BertForSequenceClassification\..* A string is a "
                                         r"regular expression that must match the full module name .*; to match by "
                                         r"name or suffix, give a list: \['dense'\]\."):
        inject_bottleneck_adapters(bert_model(), target_modules="dense")


def test_a_target_without_an_output_size_is_refused():
    with pytest.raises(TypeError, match=r"BottleneckAdapters: 'bert\.encoder\.layer\.0\.output' is a BertOutput, "
                                        r"whose output size is unknown; a bottleneck adapter follows a Linear, Conv1D "
                                        r"or other module with an integer out_features"):
        inject_bottleneck_adapters(bert_model(), target_modules=r"bert\.encoder\.layer\.0\.output")


def test_modules_to_save_matching_nothing_is_refused():
    with pytest.raises(ValueError, match=r"BottleneckAdapters\(modules_to_save=\['head'\]\): \['head'\] matched no "
                                         r"module of BertForSequenceClassification\. Check the names with "
                                         r"model\.named_modules\(\)\."):
        inject_bottleneck_adapters(bert_model(), modules_to_save=["head"])


def test_injecting_twice_is_refused():
    model = bert_model()
    inject_bottleneck_adapters(model)
    with pytest.raises(RuntimeError, match=r"inject_bottleneck_adapters: BertForSequenceClassification already has 4 "
                                           r"bottleneck adapters \(e\.g\. after 'bert\.encoder\.layer\.0\.attention\."
                                           r"output\.dense'\); they were injected twice\."):
        inject_bottleneck_adapters(model)


def test_a_recorded_adapter_for_another_model_is_refused():
    model = bert_model()
    inject_bottleneck_adapters(model)
    config = attached(model)["bottleneck"].config_dict()
    with pytest.raises(ValueError, match=r"BottleneckAdapters: the recorded adapter names module "
                                         r"'bert\.encoder\.layer\.0\.attention\.output\.dense', which LlamaForCausalLM "
                                         r"does not have; it was written for another model\."):
        BottleneckAdapter.inject(llama_model(), config)


def _edit_config(tmp_path: Path, **changes) -> None:
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is ...]:
        del config[key]
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    ({"format_version": 2}, r"has format_version=2; this version of lightning-peft reads bottleneck adapters of "
                            r"format_version 1\. Upgrade lightning-peft\."),
    ({"format_version": ...}, r"has format_version=None; this version"),
    ({"format_version": 2, "fusion": True}, r"has format_version=2; .* Upgrade"),  # a newer file: its version first
    ({"adapter_fusion": True}, r"has field 'adapter_fusion', which a bottleneck adapter config does not have; "
                               r"loading it would ignore what it means\. Fields: base_model_name_or_path, bottleneck_size, "
                               r"dropout, format_version, init_scale, modules_to_save, non_linearity, peft_type, placement, "
                               r"reduction_factor, target_modules\.$"),
    ({"target_modules": ...}, r"has target_modules=None; it must be a list of full module names\."),
    ({"target_modules": []}, r"has target_modules=\[\]; it must be a list of full module names\."),
    ({"modules_to_save": "classifier"}, r"has modules_to_save='classifier'; it must be a list of full module names\."),
    ({"reduction_factor": None}, r"has neither reduction_factor nor bottleneck_size; it is not a complete bottleneck "
                                 r"adapter config\."),
    ({"non_linearity": "softmax"},
     r"adapter_config\.json: BottleneckAdapters\(non_linearity='softmax'\): non_linearity must be one of"),
    ({"target_modules": ["bert.encoder.layer.0.output.dense", "bert.pooler.gone"]},
     r"adapter_config\.json names module 'bert\.pooler\.gone', which BertForSequenceClassification does not have; "
     r"it was written for another model\."),
])
def test_a_bad_adapter_config_is_refused_and_leaves_the_model_unchanged(tmp_path, changes, message):
    base, _ = _saved(tmp_path, placement="pfeiffer")
    _edit_config(tmp_path, **changes)
    fresh = _fresh(base, "bert")
    with pytest.raises(ValueError, match=r"load_adapter: .*" + message):
        load_adapter(fresh, tmp_path)
    assert not attached(fresh) and not bottleneck_layers(fresh)


def test_the_fields_load_adapter_accepts_are_the_ones_save_adapter_writes(tmp_path):
    _saved(tmp_path, placement="pfeiffer")
    assert set(json.loads((tmp_path / "adapter_config.json").read_text())) == BottleneckAdapter.peft_fields


def test_a_config_that_is_not_ours_is_refused():
    with pytest.raises(ValueError, match=r"load_adapter: x\.json has peft_type='LORA', not "
                                         r"'LIGHTNING_PEFT_BOTTLENECK'\."):
        config_from_file({"peft_type": "LORA"}, "x.json")


def test_weights_that_do_not_fit_are_refused_and_the_model_is_restored(tmp_path):
    base, _ = _saved(tmp_path, placement="pfeiffer")
    _edit_config(tmp_path, reduction_factor=4)  # the config now asks for bottleneck 4, the file holds 1
    fresh = _fresh(base, "bert")
    with pytest.raises(ValueError, match=r"load_adapter: .* key base_model\.model\.bert\.encoder\.layer\.0\.output\."
                                         r"dense\.adapter\.down\.bias has shape \(1,\), but the model needs \(4,\)\. "
                                         r"The adapter does not fit this model\."):
        load_adapter(fresh, tmp_path)
    assert not attached(fresh) and type(fresh.bert.encoder.layer[0].output.dense) is nn.Linear
    assert all(p.requires_grad for p in fresh.parameters())  # requires_grad as before the load


def test_loading_into_a_different_existing_adapter_is_refused(tmp_path):
    base, _ = _saved(tmp_path, placement="pfeiffer", non_linearity="relu")
    fresh = _fresh(base, "bert")
    inject_bottleneck_adapters(fresh, placement="houlsby", non_linearity="tanh")
    with pytest.raises(ValueError, match=r"load_adapter: .*adapter_config\.json has target_modules=\[.*\], "
                                         r"non_linearity='relu', but the model's existing bottleneck adapter has "
                                         r"target_modules=\[.*\], non_linearity='tanh'\. Load it into a model without "
                                         r"bottleneck adapters\."):
        load_adapter(fresh, tmp_path)


def test_the_technique_imports_and_runs_with_lightning_blocked():
    code = """
import torch
from lightning_peft.peft.bottleneck.model import inject_bottleneck_adapters
model = torch.nn.Sequential(torch.nn.Linear(4, 4))
inject_bottleneck_adapters(model, target_modules=['0'], bottleneck_size=2)
model(torch.zeros(1, 4)).sum().backward()
assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules)
print('ok')
"""
    result = run_with_lightning_blocked(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_layer_forwards_attributes_to_its_base():
    layer = BottleneckLayer(nn.Linear(3, 5), Bottleneck(5, 2, "relu", 0.0, 0.01))
    assert layer.out_features == 5 and layer.weight is layer.base_layer.weight


def test_a_target_entry_that_matches_nothing_is_an_error_naming_it():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"BottleneckAdapters\(target_modules=\['0', '7'\]\): '7' matched no module "
                       r"of Sequential"):
        inject_bottleneck_adapters(model, target_modules=["0", "7"], reduction_factor=4)


def test_protocol_members_training_only_matches_and_wrapped():
    from lightning_peft.peft.adapter import wrapped_layers

    model = bert_model()
    layers = inject_bottleneck_adapters(model, dropout=0.1)
    adapter = attached(model)["bottleneck"]
    assert BottleneckAdapter.training_only == ("dropout", "init_scale")
    assert adapter.wrapped(model) == layers == wrapped_layers(model)  # strategies see the base layers through it
    assert all(isinstance(layer.base_layer, nn.Linear) for layer in adapter.wrapped(model).values())
    assert adapter.matches(adapter.config_dict())
    assert adapter.matches({"config": BottleneckConfig(dropout=0.1).to_dict()})  # a callback's request
    assert not adapter.matches({"config": BottleneckConfig(placement="pfeiffer", dropout=0.1).to_dict()})
    assert not adapter.matches({**adapter.config_dict(), "targets": adapter.config_dict()["targets"][:1]})
