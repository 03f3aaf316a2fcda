"""The IA³ rows of Hugging Face PEFT 0.21's own ``tests/test_custom_models.py``, run on ours with PEFT as the oracle
(`tests.peft._oracle.assert_equal_to_peft`: forward, disable, merge/unmerge and merged weights, files both ways, one
training step). Every row runs.
"""

from __future__ import annotations

import pytest

from tests.peft._oracle import assert_equal_to_peft
from tests.peft.ia3._oracle import IA3

pytestmark = [
    pytest.mark.filterwarnings("ignore:Unmerge result can be inaccurate:UserWarning"),  # PEFT's, at every unmerge
    pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to:UserWarning"),  # PEFT fixes its flag per layer
]

CASES = [
    ("Vanilla MLP 1 IA3", "MLP", {"target_modules": "lin0", "feedforward_modules": []}),
    ("Vanilla MLP 2 IA3", "MLP", {"target_modules": "lin0", "feedforward_modules": "lin0"}),
    ("Vanilla MLP 3 IA3", "MLP", {"target_modules": ["lin0"], "feedforward_modules": []}),
    ("Vanilla MLP 4 IA3", "MLP", {"target_modules": ["lin0"], "feedforward_modules": ["lin0"]}),
    ("Vanilla MLP 5 IA3", "MLP", {"target_modules": ["lin1"], "feedforward_modules": []}),
    ("Vanilla MLP 6 IA3", "MLP", {"target_modules": ["lin1"], "feedforward_modules": ["lin1"]}),
    ("Vanilla MLP 7 IA3", "MLP", {"target_modules": ["lin0", "lin1"], "feedforward_modules": []}),
    ("Vanilla MLP 8 IA3", "MLP", {"target_modules": ["lin0", "lin1"], "feedforward_modules": ["lin0", "lin1"]}),
    ("Vanilla MLP 9 IA3", "MLP",
     {"target_modules": ["lin0"], "modules_to_save": ["lin1"], "feedforward_modules": ["lin0"]}),
    ("transformers Conv1D 1 IA3", "EmbConv1D", {"target_modules": ["conv1d"], "feedforward_modules": ["conv1d"]}),
    ("transformers Conv1D 2 IA3", "EmbConv1D",
     {"target_modules": ["conv1d", "lin0"], "feedforward_modules": ["conv1d", "lin0"]}),
    ("transformers Conv1D 1 IA3 (modules_to_save)", "EmbConv1D",
     {"target_modules": ["conv1d"], "feedforward_modules": ["conv1d"], "modules_to_save": ["lin0"]}),
    ("Conv2d 1 IA3", "Conv2d", {"target_modules": ["conv2d"], "feedforward_modules": []}),
    ("Conv2d 2 IA3", "Conv2d", {"target_modules": ["conv2d"], "feedforward_modules": ["conv2d"]}),
    ("Conv2d 3 IA3", "Conv2d", {"target_modules": ["conv2d", "lin0"], "feedforward_modules": []}),
    ("Conv2d 4 IA3", "Conv2d", {"target_modules": ["conv2d", "lin0"], "feedforward_modules": ["conv2d"]}),
    ("Conv2d 5 IA3", "Conv2d", {"target_modules": ["conv2d", "lin0"], "feedforward_modules": ["conv2d", "lin0"]}),
    ("Conv3d 1 IA3", "Conv3d", {"target_modules": ["conv3d"], "feedforward_modules": []}),
    ("Conv3d 2 IA3", "Conv3d", {"target_modules": ["conv3d"], "feedforward_modules": ["conv3d"]}),
    ("Conv3d 3 IA3", "Conv3d", {"target_modules": ["conv3d", "lin0"], "feedforward_modules": []}),
    ("Conv3d 4 IA3", "Conv3d", {"target_modules": ["conv3d", "lin0"], "feedforward_modules": ["conv3d"]}),
    ("Conv3d 5 IA3", "Conv3d", {"target_modules": ["conv3d", "lin0"], "feedforward_modules": ["conv3d", "lin0"]}),
    # beyond PEFT's rows: grouped convolutions scaled at the input (PEFT expands the vector per group to merge)
    ("Conv2d Groups IA3 feed-forward", "Conv2dGroups", {"target_modules": ["conv2d"], "feedforward_modules": ["conv2d"]}),
    ("Conv2d Groups2 IA3", "Conv2dGroups2", {"target_modules": ["conv2d"], "feedforward_modules": []}),
]


@pytest.mark.parametrize(("case", "model_id", "peft_kwargs"), CASES, ids=[c[0] for c in CASES])
def test_peft_custom_model_row_equals_peft(case, model_id, peft_kwargs, tmp_path):
    assert_equal_to_peft(model_id, peft_kwargs, tmp_path, IA3)
