"""`merge_problems`: which layers a merge would refuse, read without merging, is exactly where merging raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_peft.peft import add_adapter, attached, inject_lora, merged_state_dict

CASES = {
    "grouped Conv2d": (lambda: nn.Conv2d(4, 4, 3, groups=2), {}),
    "grouped Conv2d, DoRA": (lambda: nn.Conv2d(4, 4, 3, groups=2), {"use_dora": True}),
    "grouped Conv1d": (lambda: nn.Conv1d(4, 6, 3, groups=2), {}),
    "Conv2d": (lambda: nn.Conv2d(4, 4, 3), {}),
    "Linear without bias, lora_bias": (lambda: nn.Linear(4, 4, bias=False), {"lora_bias": True}),
    "Conv2d without bias, lora_bias": (lambda: nn.Conv2d(4, 4, 3, bias=False), {"lora_bias": True}),
    "Linear, lora_bias": (lambda: nn.Linear(4, 4), {"lora_bias": True}),
    "Linear without bias": (lambda: nn.Linear(4, 4, bias=False), {}),
}


@pytest.mark.filterwarnings("ignore:LoRA\\(lora_bias=True\\)")
@pytest.mark.parametrize("case", list(CASES))
def test_merge_problems_name_exactly_the_layers_a_merge_refuses(case):
    layer, settings = CASES[case]
    model = nn.Sequential(layer()).double()
    inject_lora(model, rank=2, target_modules=["0"], **settings)
    problems = attached(model)["lora"].merge_problems(model)
    try:
        merged_state_dict(model)
    except RuntimeError as err:
        assert len(problems) == 1 and problems[0].startswith("'0' "), (problems, err)
    else:
        assert problems == []


def test_merge_problems_are_those_of_the_adapter_a_merge_folds_in():
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv2d(4, 4, 3, groups=2)).double()
    inject_lora(model, rank=2, target_modules=["0"])
    add_adapter(model, "grouped", rank=2, target_modules=["1"])
    lora = attached(model)["lora"]
    assert lora.merge_problems(model) == []  # the active adapter, 'default', merges
    expected = ["'1' is a Conv2d with groups=2, whose weight cannot hold the update (it reads every input channel)"]
    assert lora.merge_problems(model, "grouped") == expected
    with pytest.raises(RuntimeError, match=r"merged_state_dict: layer '1': LoRAConv: the base Conv2d has groups=2"):
        merged_state_dict(model, "grouped")
    assert torch.equal(merged_state_dict(model)["1.weight"], model[1].base_layer.weight)
    with pytest.raises(ValueError, match=r"LoRA: no adapter named 'other'"):
        lora.merge_problems(model, "other")
