"""VeRA's own behaviour beyond PEFT's rows (tests/peft/vera/test_peft_cases.py): the projections as PEFT draws them,
targets of unequal shapes, save_projection both ways, trained biases against PEFT, refusals, merges and unloads."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_peft.peft import (
    VeraAdapter,
    VeraConfig,
    adapter_state_dict,
    inject_vera,
    load_adapter,
    merged_state_dict,
    save_adapter,
    unload_vera,
)
from lightning_peft.peft.vera import disable_vera, merge_vera, unmerge_vera, vera_layers
from tests.peft._oracle import MODELS, adapted_pair, close, inputs, one_step, outputs, peft, peft_weights
from tests.peft.vera._oracle import VERA, peft_name

pytestmark = pytest.mark.filterwarnings("ignore:Specified to not (save|load) vera_A:UserWarning")


class Block(nn.Module):
    def __init__(self, inp: int, out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(inp, out)

    def forward(self, x):
        return self.lin(x).tanh()


class Layers(nn.Module):
    """Three numbered layers of different sizes: which of them VeRA adapts decides the projections' size."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(10, 12), Block(12, 14), Block(14, 10)])
        self.head = nn.Linear(10, 2)

    def forward(self, x):  # (B, 10) -> (B, 2)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def mlp(**config) -> tuple[nn.Module, nn.Module]:
    """(the float64 base MLP of PEFT's rows, a copy with VeRA ``config`` and random vectors)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)).double().eval()
    model = copy.deepcopy(base)
    inject_vera(model, **config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in vera_layers(model).values():
            for p in (layer.vera_lambda_b, layer.vera_lambda_d):
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return base, model


@pytest.mark.parametrize("default", [torch.float32, torch.float64])
@pytest.mark.parametrize(("key", "rank"), [(0, 4), (12345, 7), (2**40, 3)])
def test_the_projections_are_drawn_as_peft_draws_them_for_a_key(key, rank, default):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))
    torch.set_default_dtype(default)  # PEFT draws in the default dtype
    try:
        theirs = peft.get_peft_model(copy.deepcopy(base), peft.VeraConfig(target_modules=["0", "2"], r=rank,
                                                                          projection_prng_key=key)).base_model
        ours = copy.deepcopy(base)
        inject_vera(ours, target_modules=["0", "2"], rank=rank, projection_prng_key=key)
    finally:
        torch.set_default_dtype(torch.float32)
    assert ours[0].vera_projections.vera_A.shape == (rank, 20) and ours[0].vera_projections.vera_B.shape == (20, rank)
    assert torch.equal(ours[0].vera_projections.vera_A, theirs.vera_A["default"])
    assert torch.equal(ours[0].vera_projections.vera_B, theirs.vera_B["default"])


def test_layers_to_transform_picks_the_layers_and_sizes_the_projections_as_peft(tmp_path, monkeypatch):
    monkeypatch.setitem(MODELS, "Layers", Layers)
    kwargs = {"target_modules": ["lin"], "layers_to_transform": [0, 2], "layers_pattern": "layers", "r": 4}
    from tests.peft._oracle import assert_equal_to_peft

    assert_equal_to_peft("Layers", kwargs, tmp_path, VERA)  # A's columns depend on in_max: 14, not 12 or 10
    ours = adapted_pair("Layers", kwargs, VERA)[0]
    assert sorted(vera_layers(ours)) == ["layers.0.lin", "layers.2.lin"]
    shared = ours.layers[0].lin.vera_projections
    assert shared.vera_A.shape == (4, 14) and shared.vera_B.shape == (12, 4)


@pytest.mark.parametrize(("model_id", "kwargs"), [
    ("MLP", {"target_modules": ["lin0"], "bias": "vera_only"}),
    ("EmbConv1D", {"target_modules": ["conv1d"], "bias": "all"}),
])
def test_trained_biases_equal_peft_and_stay_when_disabled(model_id, kwargs, tmp_path):
    # the generic check's "disabled equals the base" does not hold here: the biases train (PEFT warns the same)
    ours, theirs, base = adapted_pair(model_id, kwargs, VERA)
    x = inputs(base)
    adapted = outputs(ours, x)
    close(adapted, outputs(theirs, x), "forward")
    with disable_vera(ours), theirs.disable_adapter():
        close(outputs(ours, x), outputs(theirs, x), "disabled")
        assert (outputs(ours, x) - outputs(base, x)).abs().max() > 1e-3  # the trained biases are still there
    merged = merged_state_dict(ours)
    theirs.merge_adapter()
    expected = peft_weights(theirs.base_model.model, VERA.markers)
    assert set(merged) == set(expected)
    for key, value in expected.items():
        close(merged[key], value, key)
    theirs.unmerge_adapter()
    save_adapter(ours, tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    close(outputs(peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours"), x), adapted, "PEFT loads")
    close(outputs(load_adapter(copy.deepcopy(base), tmp_path / "theirs"), x), adapted, "we load")
    one_step(ours, theirs, x, peft_name, 0.1)


def test_save_projection_false_writes_only_the_key_and_the_loader_draws_them_again(tmp_path):
    base, model = mlp(target_modules=["0", "2"], rank=4, projection_prng_key=3, save_projection=False)
    save_adapter(model, tmp_path)
    assert sorted(load_file(tmp_path / "adapter_model.safetensors")) == [
        f"base_model.model.{n}.vera_lambda_{v}" for n in ("0", "2") for v in "bd"]
    assert json.loads((tmp_path / "adapter_config.json").read_text())["save_projection"] is False
    x = inputs(nn.Linear(10, 2))
    loaded = load_adapter(copy.deepcopy(base), tmp_path)
    close(outputs(loaded, x), outputs(model, x), "drawn again from the key")
    assert torch.equal(loaded[0].vera_projections.vera_A, model[0].vera_projections.vera_A)


def test_a_file_with_projections_uses_them_not_a_new_draw(tmp_path):
    base, model = mlp(target_modules=["0", "2"], rank=4)
    with torch.no_grad():  # projections no draw from the key gives (a file from another machine, say)
        model[0].vera_projections.vera_A.mul_(-2)
        model[0].vera_projections.vera_B.add_(0.5)
    save_adapter(model, tmp_path)
    assert {"base_model.vera_A", "base_model.vera_B"} <= set(load_file(tmp_path / "adapter_model.safetensors"))
    x = inputs(nn.Linear(10, 2))
    close(outputs(load_adapter(copy.deepcopy(base), tmp_path), x), outputs(model, x), "ours")
    close(outputs(peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path), x), outputs(model, x), "PEFT")


def test_projections_in_a_file_that_says_it_has_none_or_of_another_size_are_refused(tmp_path):
    base, model = mlp(target_modules=["0", "2"], rank=4)
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "save_projection": False}))
    fresh = copy.deepcopy(base)
    with pytest.raises(ValueError, match=r"holds the projections \(vera_A, vera_B\), but its config .* says "
                                         r"save_projection=false, so Hugging Face PEFT ignores them"):
        load_adapter(fresh, tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "r": 4096}))
    with pytest.raises(ValueError, match=r"key base_model\.(vera_A|model\.0\.vera_lambda_d) has shape \(4, ?\d*\) .* "
                                         r"says r=4096"):
        load_adapter(fresh, tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    save_file({**tensors, "base_model.vera_A": tensors["base_model.vera_A"][:, :12].contiguous()},
              tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"key base_model\.vera_A has shape \(4, 12\), but the model needs \(4, 20\)"):
        load_adapter(fresh, tmp_path)
    assert type(fresh[0]) is nn.Linear and type(fresh[2]) is nn.Linear  # left as it was


def test_the_projections_are_one_pair_of_buffers_that_checkpoints_carry():
    base, model = mlp(target_modules=["0", "2"], rank=4)
    state = model.state_dict()
    assert [k for k in state if "vera_A" in k or "vera_B" in k] == ["0.vera_projections.vera_A",
                                                                    "0.vera_projections.vera_B"]
    assert {"0.vera_projections.vera_A", "0.vera_projections.vera_B"} <= set(adapter_state_dict(model))
    with torch.no_grad():
        model[0].vera_projections.vera_A.mul_(3)  # loaded from a file: not what the key draws
    fresh = copy.deepcopy(base)
    VeraAdapter.inject(fresh, VeraAdapter(model._lightning_peft_adapters["vera"].config, ["0", "2"], []).config_dict())
    fresh.load_state_dict(model.state_dict())
    x = inputs(nn.Linear(10, 2))
    close(outputs(fresh, x), outputs(model, x), "restored from a state dict")
    twin = copy.deepcopy(model)  # a copy shares its own projections between its layers
    assert twin[0].projections is twin[0].vera_projections is twin[2].projections
    model.to(torch.bfloat16)
    assert model[0].vera_projections.vera_A.dtype == torch.float64 and model[0].vera_lambda_b.dtype == torch.float64


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"target_modules": "all-linear"}, ValueError, r"VeRA\(target_modules='all-linear'\): not supported"),
    ({"target_modules": ["0"], "rank": 0}, ValueError, r"VeRA\(rank=0\): rank must be an integer >= 1"),
    ({"target_modules": ["0"], "bias": "lora_only"}, ValueError, r"VeRA\(bias='lora_only'\): bias must be one of"),
    ({"target_modules": ["0"], "dropout": 1.0}, ValueError, r"VeRA\(dropout=1\.0\): dropout must be a number in"),
    ({"target_modules": ["0"], "layers_pattern": "h"}, ValueError,
     r"VeRA\(layers_pattern='h'\): layers_pattern only says where layers_to_transform counts layers"),
    ({"target_modules": "0", "layers_to_transform": 0}, ValueError,
     r"VeRA\(layers_to_transform=0, target_modules='0'\): layers_to_transform needs target_modules as a list"),
    ({"target_modules": []}, TypeError, r"VeRA\(target_modules=\[\]\): give a non-empty list"),
    ({"target_modules": ["0"], "r": 4}, TypeError, r"inject_vera: unknown argument 'r'; VeRA layers take target_modules"),
])
def test_bad_settings_are_refused_naming_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        inject_vera(nn.Sequential(nn.Linear(2, 2)), **kwargs)


def test_a_layer_peft_has_no_vera_for_and_a_second_injection_are_refused_before_anything_changes():
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.Linear(3, 3), nn.Linear(3, 5))
    with pytest.raises(TypeError, match=r"VeRA\(target_modules=\['0', '1'\]\): '0' is a Conv2d; VeRA adapts nn\.Linear "
                                        r"and transformers Conv1D .* Sequential has: 1, 2"):
        inject_vera(model, target_modules=["0", "1"])
    assert isinstance(model[1], nn.Linear)
    inject_vera(model, target_modules=["1", "2"], rank=2)  # unequal shapes: sized to the largest, as PEFT
    assert model[1].vera_projections.vera_A.shape == (2, 3) and model[1].vera_projections.vera_B.shape == (5, 2)
    with pytest.raises(RuntimeError, match=r"inject_vera: Sequential already has VeRA layers \(e\.g\. '1'\); VeRA "
                                           r"injected twice"):
        inject_vera(model, target_modules=["1"])


def test_merge_unmerge_unload_and_the_merged_export_all_give_the_adapted_outputs():
    base, model = mlp(target_modules=["0", "2"], rank=4)
    x = inputs(nn.Linear(10, 2))
    adapted = outputs(model, x)
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged_state_dict(model))
    close(outputs(plain, x), adapted, "merged export")
    assert merge_vera(model) == ["0", "2"] and merge_vera(model) == []  # idempotent
    close(outputs(model, x), adapted, "merged")
    with pytest.raises(RuntimeError, match=r"disable_vera: the updates are merged .* unmerge_vera\(model\) first"), \
            disable_vera(model):
        pass
    unmerge_vera(model)
    close(model[0].base_layer.weight, base[0].weight, "unmerged weight", 1e-14)
    with pytest.raises(RuntimeError, match=r"unmerge_vera: no VeRA layer of Sequential is merged; call merge_vera"):
        unmerge_vera(model)
    unloaded = unload_vera(copy.deepcopy(model), merge=False)
    assert all(torch.allclose(a, b, rtol=1e-14, atol=1e-15) for a, b in zip(unloaded.parameters(), base.parameters()))
    assert not any("vera" in key for key in unloaded.state_dict())
    merged = unload_vera(model)
    assert type(merged[0]) is nn.Linear and type(merged[2]) is nn.Linear
    close(outputs(merged, x), adapted, "unloaded merged")


def test_a_tied_weight_is_not_merged_in_place():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    inject_vera(model, target_modules=["0"], rank=2)
    with pytest.raises(RuntimeError, match=r"merge_vera: the weight of '0' is tied to '1\.weight'"):
        merge_vera(model)


def test_loading_into_a_model_with_vera_checks_rank_and_projections(tmp_path):
    base, model = mlp(target_modules=["0", "2"], rank=4)
    save_adapter(model, tmp_path)
    other = copy.deepcopy(base)
    inject_vera(other, target_modules=["0", "2"], rank=4, projection_prng_key=1)
    with pytest.raises(ValueError, match=r"adapter_config\.json has projection_prng_key=0, but the model's VeRA adapter "
                                         r"has projection_prng_key=1\. Load it into a model without VeRA"):
        load_adapter(other, tmp_path)
    same = copy.deepcopy(base)
    inject_vera(same, VeraConfig(target_modules=["0", "2"], rank=4))
    x = inputs(nn.Linear(10, 2))
    close(outputs(load_adapter(same, tmp_path), x), outputs(model, x), "loaded into the existing adapter")


def test_the_file_records_the_adapted_base_layers_though_its_keys_start_one_level_higher(tmp_path):
    from safetensors import safe_open

    from lightning_peft.peft._base_identity import fingerprint

    base, model = mlp(target_modules=["0", "2"], rank=4)
    save_adapter(model, tmp_path)
    with safe_open(tmp_path / "adapter_model.safetensors", framework="pt") as file:
        record = json.loads(file.metadata()["lightning_peft"])
    assert record["base_model"]["fingerprint"] == fingerprint({"0": base[0], "2": base[2]})
