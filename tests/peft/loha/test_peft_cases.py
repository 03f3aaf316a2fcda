"""The LoHa rows of Hugging Face PEFT 0.21's own ``tests/test_custom_models.py``, run on ours with PEFT as the oracle
(`tests.peft._oracle.assert_equal_to_peft`: forward, disable, merge/unmerge and merged weights, files both ways, one
training step, its rank and module dropout draws included). Every row runs.
"""

from __future__ import annotations

import pytest

from tests.peft._oracle import assert_equal_to_peft
from tests.peft.loha._oracle import LOHA

CASES = [
    ("Vanilla MLP 1 LOHA", "MLP", {"target_modules": "lin0"}),
    ("Vanilla MLP 2 LOHA", "MLP", {"target_modules": ["lin0"]}),
    ("Vanilla MLP 3 LOHA", "MLP", {"target_modules": ["lin1"]}),
    ("Vanilla MLP 4 LOHA", "MLP", {"target_modules": ["lin0", "lin1"]}),
    ("Vanilla MLP 5 LOHA", "MLP", {"target_modules": ["lin0"], "modules_to_save": ["lin1"]}),
    ("Vanilla MLP 6 LOHA", "MLP", {"target_modules": ["lin0"], "alpha": 4, "module_dropout": 0.1}),
    ("Vanilla MLP 7 LOHA", "MLP", {"target_modules": "lin0", "rank_dropout": 0.5}),
    ("Conv2d 1 LOHA", "Conv2d", {"target_modules": ["conv2d"]}),
    ("Conv2d 2 LOHA", "Conv2d", {"target_modules": ["conv2d", "lin0"]}),
    ("Conv2d 3 LOHA", "Conv2d", {"target_modules": ["conv2d"], "use_effective_conv2d": True}),
    ("Conv2d 4 LOHA", "Conv2d", {"target_modules": ["conv2d", "lin0"], "use_effective_conv2d": True}),
    ("Conv1d LOHA", "Conv1d", {"target_modules": ["conv1d"]}),
    ("Conv1d LOHA 1", "Conv1d", {"target_modules": ["conv1d"]}),
    ("Conv1d LOHA 2", "Conv1d", {"target_modules": ["conv1d"], "r": 2}),
    ("Conv1d Groups LOHA", "Conv1dGroups", {"target_modules": ["conv1d"], "r": 4}),
    ("Conv1d LOHA 3", "Conv1dBigger", {"target_modules": ["conv1d"], "r": 2, "use_effective_conv2d": True}),
    ("Conv1d LOHA 4", "Conv1dBigger", {"target_modules": ["conv1d"], "r": 2, "use_effective_conv2d": False}),
    ("Conv2d 1x1 LOHA", "Conv2d1x1", {"target_modules": ["conv2d"]}),
    ("Conv2d Groups LOHA", "Conv2dGroups", {"target_modules": ["conv2d"]}),
    ("Conv2d Groups2 LOHA", "Conv2dGroups2", {"target_modules": ["conv2d"]}),
    # beyond PEFT's rows: per-module ranks and alphas, layers_to_transform and exclude_modules
    ("MLP LOHA rank_pattern alpha_pattern", "MLP",
     {"target_modules": ["lin0", "lin1"], "r": 3, "rank_pattern": {"lin1": 2}, "alpha_pattern": {"lin0": 5}}),
    ("MLP LOHA exclude_modules", "MLP", {"target_modules": "lin.", "exclude_modules": ["lin1"], "init_weights": False}),
]


@pytest.mark.parametrize(("case", "model_id", "peft_kwargs"), CASES, ids=[c[0] for c in CASES])
def test_peft_custom_model_row_equals_peft(case, model_id, peft_kwargs, tmp_path):
    assert_equal_to_peft(model_id, peft_kwargs, tmp_path, LOHA)
