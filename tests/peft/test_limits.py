"""A scale or factors that overflow the dtype the adapted layers compute in are refused at inject, load and save
(:mod:`lightning_peft.peft._limits`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_peft.callbacks import LoRA
from lightning_peft.peft import LoRAConfig, inject_lora, load_adapter, lora_layers, save_adapter
from tests._models import Tiny, randomise

TARGETS = ["query", "value"]
FLOAT32_MAX = r"3\.4028234663852886e\+38"


def _saved(directory: Path) -> Path:
    torch.manual_seed(0)
    model = Tiny()
    randomise(inject_lora(model, rank=4, alpha=8, target_modules=TARGETS))
    save_adapter(model, directory)
    return directory


def _edit_config(directory: Path, **fields) -> None:
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _edit_weights(directory: Path, edit) -> None:
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _refused_and_untouched(directory: Path, match: str, model: nn.Module | None = None) -> None:
    model = Tiny() if model is None else model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_adapter(model, directory)
    assert not lora_layers(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------------------------------- inject


@pytest.mark.parametrize("make", [
    lambda: LoRAConfig(alpha=1e39),
    lambda: LoRA(alpha=1e39),
    lambda: inject_lora(Tiny(), alpha=1e39, target_modules=TARGETS),
    lambda: LoRA(alpha_pattern={"query": 1e39}),
])
def test_an_alpha_above_float32s_largest_value_is_refused_up_front(make):
    with pytest.raises(ValueError, match=rf"LoRA\((alpha=1e\+39\): alpha|alpha_pattern=\{{'query': 1e\+39\}}\): "
                                         rf"alpha_pattern\['query'\]=1e\+39) must be a finite number <= {FLOAT32_MAX}, "
                                         r"e\.g\. 16 \(float32's largest"):
        make()


@pytest.mark.parametrize(("use_rslora", "how"), [(False, r"alpha/r = 2e\+05/2 = 1e\+05"),
                                                 (True, r"alpha/sqrt\(r\) = 2e\+05/sqrt\(2\) = 1\.414e\+05")])
def test_a_scale_above_float16s_largest_value_is_refused_at_inject_and_the_model_is_unchanged(use_rslora, how):
    model = Tiny().half()
    with pytest.raises(ValueError, match=rf"LoRA\(alpha=200000\.0\): module 'blocks\.0\.query' has the scale {how}, "
                                         r"above float16's largest value 6\.55e\+04, .* Lower alpha"):
        inject_lora(model, rank=2, alpha=2e5, use_rslora=use_rslora, target_modules=TARGETS)
    assert not lora_layers(model)
    inject_lora(Tiny().half(), rank=2, alpha=1e5, target_modules=TARGETS)  # the scale 5e4 fits: alpha may not


# ----------------------------------------------------------------------------------------------------- load


def test_a_file_with_lora_alpha_above_float32s_largest_value_is_refused(tmp_path):
    _edit_config(_saved(tmp_path), lora_alpha=1e39)
    _refused_and_untouched(tmp_path, rf"load_adapter: {tmp_path}/adapter_config\.json holds a value LoRA refuses: "
                                     rf"LoRA\(alpha=1e\+39\): alpha must be a finite number <= {FLOAT32_MAX}")


def test_a_file_whose_scale_overflows_a_float16_model_is_refused_naming_the_file(tmp_path):
    _edit_config(_saved(tmp_path), lora_alpha=1e6)
    _refused_and_untouched(tmp_path, rf"load_adapter: {tmp_path}/adapter_config\.json: LoRA\(alpha=1000000\.0\): module "
                                     r"'blocks\.0\.query' has the scale alpha/r = 1e\+06/4 = 2\.5e\+05, above float16's",
                           Tiny().half())
    load_adapter(Tiny(), tmp_path)  # a float32 model holds it


def test_factors_whose_product_overflows_are_refused_at_load(tmp_path):
    def huge(tensors):
        for key in tensors:
            if key.endswith(("blocks.1.value.lora_A.weight", "blocks.1.value.lora_B.weight")):
                tensors[key] = torch.full_like(tensors[key], 3e38)

    _edit_weights(_saved(tmp_path), huge)
    _refused_and_untouched(tmp_path, rf"load_adapter: {tmp_path}: module 'blocks\.1\.value': max\|lora_A\| = 3e\+38, "
                                     r"max\|lora_B\| = 3e\+38, so with the scale 2 and rank 4 the update's entries can "
                                     r"reach 7\.2e\+77, above float32's largest value 3\.403e\+38: every output .* "
                                     r"Nothing was loaded")


def test_a_value_beyond_the_dtype_it_is_copied_into_is_refused(tmp_path):
    def wide(tensors):
        key = next(k for k in tensors if k.endswith("blocks.0.query.lora_A.weight"))
        tensors[key] = tensors[key].double()
        tensors[key][0, 0] = 1e39  # finite in float64, inf in the model's float32

    _edit_weights(_saved(tmp_path), wide)
    _refused_and_untouched(tmp_path, r"key base_model\.model\.blocks\.0\.query\.lora_A\.weight holds 1e\+39, above the "
                                     r"largest value of float32 \(3\.403e\+38\), the dtype the model keeps it in")


# ----------------------------------------------------------------------------------------------------- save


def test_save_refuses_factors_whose_product_overflows_naming_the_module_and_writes_nothing(tmp_path):
    model = Tiny()
    inject_lora(model, rank=4, alpha=8, target_modules=TARGETS)
    with torch.no_grad():
        for param in model.blocks[0].query.adapter_parameters().values():
            param.fill_(3e38)  # finite in float32, but B @ A is not
    with pytest.raises(ValueError, match=r"save_adapter: module 'blocks\.0\.query': max\|lora_A\| = 3e\+38, .* "
                                         r"Nothing was written"):
        save_adapter(model, tmp_path)
    assert os.listdir(tmp_path) == []


def test_save_refuses_a_scale_the_model_was_cast_below(tmp_path):
    model = Tiny()
    inject_lora(model, rank=1, alpha=1e5, target_modules=TARGETS)  # fine in float32
    model.half()  # the base computes in float16 now; the adapters stay float32
    with pytest.raises(ValueError, match=r"save_adapter: module 'blocks\.0\.query' has the scale alpha/r = 1e\+05/1 = "
                                         r"1e\+05, above float16's largest value 6\.55e\+04, .* \(and 3 more modules\): every output"):
        save_adapter(model, tmp_path)
