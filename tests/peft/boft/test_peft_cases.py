"""The 12 BOFT rows of Hugging Face PEFT 0.21's own ``tests/test_custom_models.py``, run on ours with PEFT as the
oracle (`tests.peft._oracle.assert_equal_to_peft`). Every row runs.

Rows with one butterfly factor run against PEFT as it is. On a CPU, PEFT computes the rows that ask for more with one
factor (its CUDA kernel is missing), so those run against PEFT with that kernel computed by ``torch.block_diag``
(`peft_with_kernel`): PEFT's own permutations, Cayley transform and merge, with every factor. PEFT's ``"Conv2d"``
model is ``"Conv2dPEFT"`` here (see tests/peft/oft/test_peft_cases.py).
"""

from __future__ import annotations

import pytest

from tests.peft._oracle import assert_equal_to_peft
from tests.peft.boft._oracle import BOFT, peft_with_kernel

pytestmark = [pytest.mark.filterwarnings("ignore:Already unmerged:UserWarning"),
              pytest.mark.filterwarnings("ignore:Failed to load the CUDA extension:UserWarning"),
              pytest.mark.filterwarnings("ignore:Setting boft_n_butterfly_factor to 1:UserWarning")]

CASES = [
    ("Vanilla MLP 1 BOFT", "MLP", {"target_modules": ["lin1"], "boft_block_size": 2}),
    ("Vanilla MLP 2 BOFT", "MLP", {"target_modules": ["lin1"], "modules_to_save": ["lin0"], "boft_block_size": 2}),
    ("Vanilla MLP 3 BOFT", "MLP", {"target_modules": ["lin1"], "boft_block_size": 2, "boft_dropout": 0.1}),
    ("Vanilla MLP 4 BOFT", "MLP",
     {"target_modules": ["lin1"], "boft_block_size": 2, "boft_block_num": 0, "boft_n_butterfly_factor": 1}),
    ("Vanilla MLP 5 BOFT", "MLP",
     {"target_modules": ["lin1"], "boft_block_size": 0, "boft_block_num": 2, "boft_n_butterfly_factor": 1}),
    ("Vanilla MLP 6 BOFT", "MLP",
     {"target_modules": ["lin1"], "boft_block_size": 10, "boft_block_num": 0, "boft_n_butterfly_factor": 2}),
    ("Conv2d 1 BOFT", "Conv2dPEFT",
     {"target_modules": ["conv2d"], "boft_block_size": 45, "boft_block_num": 0, "boft_n_butterfly_factor": 1}),
    ("Conv2d 2 BOFT", "Conv2dPEFT",
     {"target_modules": ["conv2d"], "boft_block_size": 0, "boft_block_num": 1, "boft_n_butterfly_factor": 1}),
    ("MLP2 1 BOFT", "MLP2",
     {"target_modules": ["lin1"], "boft_block_size": 2, "boft_block_num": 0, "boft_n_butterfly_factor": 3}),
    ("MLP2 2 BOFT", "MLP2",
     {"target_modules": ["lin1"], "boft_block_size": 0, "boft_block_num": 8, "boft_n_butterfly_factor": 3}),
    ("Conv2d2 1 BOFT", "Conv2d2",
     {"target_modules": ["conv2d"], "boft_block_size": 2, "boft_block_num": 0, "boft_n_butterfly_factor": 2}),
    ("Conv2d2 1 BOFT (3 factors)", "Conv2d2",  # PEFT's list names this row "Conv2d2 1 BOFT" too
     {"target_modules": ["conv2d"], "boft_block_size": 2, "boft_block_num": 0, "boft_n_butterfly_factor": 3}),
]


@pytest.mark.parametrize(("case", "model_id", "peft_kwargs"), CASES, ids=[c[0] for c in CASES])
def test_peft_custom_model_row_equals_peft(case, model_id, peft_kwargs, tmp_path, monkeypatch):
    if peft_kwargs.get("boft_n_butterfly_factor", 1) > 1:
        peft_with_kernel(monkeypatch)  # where PEFT is right: with its kernel
    assert_equal_to_peft(model_id, peft_kwargs, tmp_path, BOFT)
