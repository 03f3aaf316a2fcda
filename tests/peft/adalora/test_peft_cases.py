"""The AdaLoRA rows of Hugging Face PEFT 0.21's own ``tests/test_custom_models.py`` (all four), run on ours with PEFT as
the oracle (`tests.peft._oracle.assert_equal_to_peft`: forward, disable, merge/unmerge and merged weights, files both
ways, one training step). PEFT's rows give ``total_step=1``, which its config requires."""

from __future__ import annotations

import pytest

from tests.peft._oracle import assert_equal_to_peft
from tests.peft.adalora._oracle import ADALORA

pytestmark = pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to:UserWarning")  # PEFT fixes its flag per layer

CASES = [
    ("Vanilla MLP 1 AdaLoRA", "MLP",
     {"target_modules": ["lin0"], "init_lora_weights": False, "total_step": 1, "orth_reg_weight": 0}),
    ("Vanilla MLP 2 AdaLoRA", "MLP", {"target_modules": ["lin0", "lin1"], "init_lora_weights": False, "total_step": 1}),
    ("Conv2d 1 AdaLoRA", "Conv2d", {"target_modules": ["conv2d"], "init_lora_weights": False, "total_step": 1}),
    ("Conv2d 2 AdaLoRA", "Conv2d",
     {"target_modules": ["conv2d", "lin0"], "init_lora_weights": False, "total_step": 1}),
    # beyond PEFT's rows: transformers Conv1D (merged transposed), a regular expression, modules_to_save
    ("transformers Conv1D AdaLoRA", "EmbConv1D", {"target_modules": ["conv1d"], "total_step": 1}),
    ("Vanilla MLP AdaLoRA regex + modules_to_save", "MLP",
     {"target_modules": "lin0", "modules_to_save": ["lin1"], "lora_alpha": 4, "init_r": 3, "total_step": 1}),
]


@pytest.mark.parametrize(("case", "model_id", "peft_kwargs"), CASES, ids=[c[0] for c in CASES])
def test_peft_custom_model_row_equals_peft(case, model_id, peft_kwargs, tmp_path):
    assert_equal_to_peft(model_id, peft_kwargs, tmp_path, ADALORA)
