"""The LoKr rows of Hugging Face PEFT 0.21's own ``tests/test_custom_models.py`` (all 23, and three of ours), run on
ours with PEFT as the oracle (`tests.peft._oracle.assert_equal_to_peft`: forward, disable, merge/unmerge and merged
weights, files both ways, one training step with PEFT's dropout draws). Every row runs.
"""

from __future__ import annotations

import pytest

from tests.peft._oracle import assert_equal_to_peft
from tests.peft.lokr._oracle import LOKR

pytestmark = pytest.mark.filterwarnings("ignore:Already unmerged:UserWarning")

CASES = [
    ("Vanilla MLP 1 LOKR", "MLP", {"target_modules": "lin0"}),
    ("Vanilla MLP 2 LOKR", "MLP", {"target_modules": ["lin0"]}),
    ("Vanilla MLP 3 LOKR", "MLP", {"target_modules": ["lin1"]}),
    ("Vanilla MLP 4 LOKR", "MLP", {"target_modules": ["lin0", "lin1"]}),
    ("Vanilla MLP 5 LOKR", "MLP", {"target_modules": ["lin0"], "modules_to_save": ["lin1"]}),
    ("Vanilla MLP 6 LOKR", "MLP", {"target_modules": ["lin0"], "alpha": 4, "module_dropout": 0.1}),
    ("Vanilla MLP 7 LOKR", "MLP", {"target_modules": "lin0", "rank_dropout": 0.5}),
    ("Vanilla MLP 8 LOKR", "MLP", {"target_modules": "lin0", "decompose_both": True, "r": 1, "alpha": 1}),
    ("Conv1d LOKR 1", "Conv1d", {"target_modules": ["conv1d"]}),
    ("Conv1d LOKR 2", "Conv1d", {"target_modules": ["conv1d"], "r": 2}),
    ("Conv1d Groups LOKR", "Conv1dGroups", {"target_modules": ["conv1d"], "r": 4}),
    ("Conv1d LOKR 3", "Conv1dBigger", {"target_modules": ["conv1d"], "r": 2, "use_effective_conv2d": True}),
    ("Conv1d LOKR 4", "Conv1dBigger", {"target_modules": ["conv1d"], "r": 2, "use_effective_conv2d": False}),
    ("Conv2d 1 LOKR", "Conv2d", {"target_modules": ["conv2d"]}),
    ("Conv2d 2 LOKR", "Conv2d", {"target_modules": ["conv2d", "lin0"]}),
    ("Conv2d 3 LOKR", "Conv2d", {"target_modules": ["conv2d"], "use_effective_conv2d": True}),
    ("Conv2d 4 LOKR", "Conv2d", {"target_modules": ["conv2d", "lin0"], "use_effective_conv2d": True}),
    ("Conv2d 1x1 LOKR", "Conv2d1x1", {"target_modules": ["conv2d"]}),
    ("Conv2d 5 LOKR", "Conv2d",
     {"target_modules": ["conv2d", "lin0"], "use_effective_conv2d": True, "decompose_both": True}),
    ("Conv2d 6 LOKR", "Conv2d",
     {"target_modules": ["conv2d", "lin0"], "use_effective_conv2d": True, "decompose_factor": 4}),
    ("Conv2d 7 LOKR", "Conv2d",
     {"target_modules": ["conv2d", "lin0"], "use_effective_conv2d": True, "decompose_both": True,
      "decompose_factor": 4}),
    ("Conv2d Groups LOKR", "Conv2dGroups", {"target_modules": ["conv2d"]}),
    ("Conv2d Groups2 LOKR", "Conv2dGroups2", {"target_modules": ["conv2d"]}),
    # beyond PEFT's rows: per-module ranks and alphas, exclusion, LyCORIS' init, low-rank W1 with a Tucker W2
    ("MLP rank_pattern alpha_pattern LOKR", "MLP",
     {"target_modules": ["lin0", "lin1"], "r": 2, "rank_pattern": {"lin0": 1}, "alpha_pattern": {"lin1": 3},
      "decompose_both": True}),
    ("MLP exclude_modules lycoris init LOKR", "MLP",
     {"target_modules": "lin.", "exclude_modules": ["lin1"], "init_weights": "lycoris", "decompose_factor": 2}),
    ("Conv2d Groups2 Tucker decompose_both LOKR", "Conv2dGroups2",
     {"target_modules": ["conv2d"], "r": 1, "use_effective_conv2d": True, "decompose_both": True}),
]


@pytest.mark.parametrize(("case", "model_id", "peft_kwargs"), CASES, ids=[c[0] for c in CASES])
def test_peft_custom_model_row_equals_peft(case, model_id, peft_kwargs, tmp_path):
    assert_equal_to_peft(model_id, peft_kwargs, tmp_path, LOKR)
