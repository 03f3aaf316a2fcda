"""The VeRA rows of Hugging Face PEFT 0.21's own ``tests/test_custom_models.py``, run on ours with PEFT as the oracle
(`tests.peft._oracle.assert_equal_to_peft`: forward, disable, merge/unmerge and merged weights, files both ways, one
training step). Every row runs; the rows beyond PEFT's cover the options its rows leave at their defaults (``bias``,
whose disabled model is not the base, is checked in ``test_model.py``).
"""

from __future__ import annotations

import pytest

from tests.peft._oracle import assert_equal_to_peft
from tests.peft.vera._oracle import VERA

pytestmark = [
    pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to:UserWarning"),  # PEFT fixes its flag per layer
    pytest.mark.filterwarnings("ignore:Specified to not (save|load) vera_A:UserWarning"),  # save_projection=False
]

CASES = [
    ("Vanilla MLP 1 VeRA", "MLP", {"target_modules": "lin0"}),
    ("Vanilla MLP 2 VeRA", "MLP", {"target_modules": ["lin0"]}),
    ("Vanilla MLP 3 VeRA", "MLP", {"target_modules": ["lin1"]}),
    ("Vanilla MLP 4 VeRA", "MLP", {"target_modules": ["lin0", "lin1"]}),
    ("Vanilla MLP 5 VeRA", "MLP", {"target_modules": ["lin0"], "modules_to_save": ["lin1"]}),
    ("Embedding + transformers Conv1D 1 VeRA", "EmbConv1D", {"target_modules": ["conv1d"]}),
    # beyond PEFT's rows: the options its rows leave at their defaults
    ("VeRA rank, key, d_initial, dropout", "MLP",
     {"target_modules": ["lin0", "lin1"], "r": 5, "projection_prng_key": 7, "d_initial": 0.5, "vera_dropout": 0.3}),
    ("VeRA save_projection=False", "MLP", {"target_modules": ["lin0", "lin1"], "r": 6, "save_projection": False}),
    ("VeRA init_weights=False", "MLP", {"target_modules": ["lin1"], "init_weights": False}),
]


@pytest.mark.parametrize(("case", "model_id", "peft_kwargs"), CASES, ids=[c[0] for c in CASES])
def test_peft_custom_model_row_equals_peft(case, model_id, peft_kwargs, tmp_path):
    assert_equal_to_peft(model_id, peft_kwargs, tmp_path, VERA)
