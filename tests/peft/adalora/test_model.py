"""Our own behaviour of AdaLoRA beyond PEFT's rows: refusals (each with its message), unload, the files a torn or
mismatched save makes, and where PEFT's AdaLoRA has a bug (``lora_alpha=0`` with a rank pattern), what we do
instead."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_peft.peft import (
    AdaLoraConfig,
    inject_adalora,
    load_adapter,
    save_adapter,
    unload_adalora,
    update_and_allocate,
)
from lightning_peft.peft.adalora import adalora_layers, disable_adalora, merge_adalora, unmerge_adalora
from tests.peft._oracle import adapted_pair, base_model, close, inputs, outputs, trainable
from tests.peft.adalora._oracle import ADALORA

peft = pytest.importorskip("peft")


def mlp(**kwargs):
    model = base_model("MLP")
    inject_adalora(model, AdaLoraConfig(**{"target_modules": ["lin0", "lin1"], "init_r": 4, "target_r": 2,
                                           "init_lora_weights": False, **kwargs}))
    return model


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"target_modules": ["lin0"], "beta1": 1.0}, ValueError,
     r"AdaLoRA\(beta1=1\.0\): beta1 must be a finite number in \(0, 1\), e\.g\. 0\.85"),
    ({"target_modules": ["lin0"], "deltaT": 0}, ValueError, r"AdaLoRA\(deltaT=0\): deltaT must be an integer >= 1"),
    ({"target_modules": ["lin0"], "tinit": 5, "tfinal": 5, "total_step": 10}, ValueError,
     r"AdaLoRA\(tinit=5, tfinal=5, total_step=10\): the schedule leaves no step to shrink the budget in"),
    ({"target_modules": ["lin0"], "init_r": 2, "rank_pattern": {"lin0.lora_E": [True]}}, ValueError,
     r"each entry must hold init_r=2 booleans"),
    ({"target_modules": "lin.*", "layers_to_transform": [0]}, ValueError, r"give target_modules as a list"),
    ({"target_modules": "all-linear"}, ValueError, r"AdaLoRA\(target_modules='all-linear'\): not supported"),
])
def test_invalid_settings_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        AdaLoraConfig(**kwargs)


def test_layers_adalora_cannot_adapt_and_a_second_injection_are_refused():
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.Conv2d(4, 4, 1, groups=2), nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"AdaLoRA\(target_modules=\['0'\]\): '0' is a Conv1d; AdaLoRA adapts nn\.Linear, "
                                        r"transformers Conv1D, ungrouped nn\.Conv2d .* Sequential has: 2"):
        inject_adalora(model, target_modules=["0"])
    with pytest.raises(TypeError, match=r"'1' is a Conv2d; AdaLoRA adapts"):
        inject_adalora(model, target_modules=["1"])
    inject_adalora(model, target_modules=["2"], init_r=2)
    with pytest.raises(RuntimeError, match=r"inject_adalora: Sequential already has AdaLoRA layers \(e\.g\. '2'\)"):
        inject_adalora(model, target_modules=["2"])


def test_a_peft_setting_adalora_does_not_run_is_refused_on_load():
    with pytest.raises(ValueError, match=r"load_adapter: x has use_dora=True; lightning-peft's AdaLoRA supports only "
                                         r"use_dora=False"):
        AdaLoraConfig.from_peft({"peft_type": "ADALORA", "target_modules": ["lin0"], "use_dora": True}, "x")
    with pytest.raises(ValueError, match=r"load_adapter: x has peft_type='LORA', not 'ADALORA'"):
        AdaLoraConfig.from_peft({"peft_type": "LORA", "target_modules": ["lin0"]}, "x")


def test_disable_merge_unmerge_and_unload():
    model = mlp()
    x = inputs(model)
    adapted, base = outputs(model, x), outputs(base_model("MLP"), x)
    with pytest.raises(RuntimeError, match=r"unmerge_adalora: no AdaLoRA layer of MLP is merged; call merge_adalora"):
        unmerge_adalora(model)
    assert merge_adalora(model) == ["lin0", "lin1"]
    close(outputs(model, x), adapted, "merged")
    with pytest.raises(RuntimeError, match=r"disable_adalora: the updates are merged .* call unmerge_adalora\(model\)"), \
            disable_adalora(model):
        pass
    unmerge_adalora(model)
    with disable_adalora(model):
        close(outputs(model, x), base, "disabled")
    merged = unload_adalora(copy.deepcopy(model), merge=True)
    assert not adalora_layers(merged) and type(merged.lin0) is nn.Linear
    close(outputs(merged, x), adapted, "unloaded, merged")
    close(outputs(unload_adalora(model, merge=False), x), base, "unloaded, not merged")


def test_allocation_needs_a_target_below_init_r_and_a_fresh_adapter(tmp_path):
    with pytest.raises(ValueError, match=r"AdaLoRA\(init_r=4, target_r=4\): target_r must be below init_r"):
        update_and_allocate(mlp(target_r=4, total_step=5), 0)
    loaded = base_model("MLP")
    inject_adalora(loaded, target_modules=["lin0"], init_r=2, target_r=1, total_step=5, rank_pattern={"lin0.lora_E": [True, False]})
    with pytest.raises(RuntimeError, match=r"AdaLoRA: layer 'lin0' has rank 1, not init_r=2: its budget was allocated "
                                           r"already"):
        update_and_allocate(loaded, 0)


def test_a_torn_file_and_a_file_for_other_ranks_are_refused_before_anything_changes(tmp_path):
    model = mlp()
    save_adapter(model, tmp_path)
    weights = load_file(tmp_path / "adapter_model.safetensors")
    weights["base_model.model.lin0.lora_E"] = weights["base_model.model.lin0.lora_E"][:3]
    save_file(weights, tmp_path / "adapter_model.safetensors")
    fresh = base_model("MLP")
    with pytest.raises(ValueError, match=r"key base_model\.model\.lin0\.lora_E has shape \(3, 1\) .* config .* says "
                                         r"init_r=4: the file's tensors disagree with its config"):
        load_adapter(fresh, tmp_path)
    assert not adalora_layers(fresh)
    save_adapter(model, tmp_path)
    other = base_model("MLP")
    inject_adalora(other, target_modules=["lin0", "lin1"], init_r=3)
    with pytest.raises(ValueError, match=r"gives layer 'lin0' rank 4 of init_r=4, but the model's AdaLoRA layer has "
                                         r"rank 3 of init_r=3\. Load it into a model without AdaLoRA"):
        load_adapter(other, tmp_path)


@pytest.mark.filterwarnings("ignore:The following rank_pattern keys did not match:RuntimeWarning")
def test_lora_alpha_zero_keeps_its_scale_when_loaded_resized_where_peft_s_changes(tmp_path):
    """PEFT scales by ``lora_alpha`` or, at 0, by the layer's rank, and its resize on load re-creates the layer at
    the kept rank: the loaded adapter then computes another update than the trained one. Ours keeps the scale it
    was trained with."""
    kwargs = {"target_modules": ["lin0", "lin1"], "init_r": 4, "target_r": 2, "lora_alpha": 0, "total_step": 3}
    ours, _, base = adapted_pair("MLP", kwargs, ADALORA)
    optimizer = torch.optim.SGD(trainable(ours).values(), lr=0.01)
    x = inputs(base)
    for step in range(3):
        ours(x).square().sum().backward()
        optimizer.step()
        update_and_allocate(ours, step)
        optimizer.zero_grad()
    save_adapter(ours, tmp_path)
    pattern = json.loads((tmp_path / "adapter_config.json").read_text())["rank_pattern"]
    assert any(not all(v) for v in pattern.values())  # resized
    trained = outputs(ours, x)
    close(outputs(load_adapter(copy.deepcopy(base), tmp_path), x), trained, "ours, loaded")
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    assert (outputs(theirs, x) - trained).abs().max() > 1e-3  # PEFT's loaded scale is the kept rank, not init_r
