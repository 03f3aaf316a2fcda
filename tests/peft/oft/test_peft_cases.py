"""The 17 OFT rows of Hugging Face PEFT 0.21's own ``tests/test_custom_models.py``, run on ours with PEFT as the oracle
(`tests.peft._oracle.assert_equal_to_peft`: forward, disable, merge/unmerge and merged weights, files both ways, one
training step). Every row runs.

PEFT's ``"Conv2d"`` model (5 -> 10 channels, a 3x3 input) is ``"Conv2dPEFT"`` here (our ``"Conv2d"`` has 2 input
channels, which ``r=5`` does not divide). On it each image is one patch, where PEFT's unfold-rotate-fold forward is
right. The same rows on a 5x5 input (``"Conv2dPEFT5x5"``: overlapping patches, where PEFT's unmerged forward differs
from its own merge) run against PEFT with its forward as its merge computes it (`peft_conv2d_as_merged`).
"""

from __future__ import annotations

import pytest

from tests.peft._oracle import assert_equal_to_peft
from tests.peft.oft._oracle import OFT, peft_conv2d_as_merged

pytestmark = [
    pytest.mark.filterwarnings("ignore:Already unmerged:UserWarning"),
]

CASES = [
    ("Vanilla MLP 1 OFT", "MLP", {"r": 2, "oft_block_size": 0, "target_modules": "lin0", "use_cayley_neumann": False}),
    ("Vanilla MLP 2 OFT", "MLP",
     {"r": 2, "oft_block_size": 0, "target_modules": ["lin0"], "use_cayley_neumann": False}),
    ("Vanilla MLP 5 OFT", "MLP",
     {"r": 2, "oft_block_size": 0, "target_modules": ["lin0"], "modules_to_save": ["lin1"],
      "use_cayley_neumann": False}),
    ("Vanilla MLP 6 OFT", "MLP",
     {"r": 2, "oft_block_size": 0, "target_modules": ["lin0"], "module_dropout": 0.1, "use_cayley_neumann": False}),
    ("Vanilla MLP 7 OFT", "MLP", {"r": 2, "oft_block_size": 0, "target_modules": ["lin0"], "coft": True, "eps": 1e-2}),
    ("Vanilla MLP 8 OFT", "MLP",
     {"r": 2, "oft_block_size": 0, "target_modules": ["lin0"], "block_share": True, "use_cayley_neumann": False}),
    ("Vanilla MLP 9 OFT", "MLP",
     {"r": 2, "oft_block_size": 0, "target_modules": ["lin0"], "coft": True, "eps": 1e-2, "block_share": True}),
    ("Vanilla MLP 10 OFT", "MLP",
     {"r": 0, "oft_block_size": 2, "target_modules": ["lin0"], "use_cayley_neumann": True}),
    ("Vanilla MLP 11 OFT", "MLP",
     {"r": 0, "oft_block_size": 2, "target_modules": ["lin0"], "use_cayley_neumann": False}),
    ("Vanilla MLP 12 OFT", "MLP",
     {"r": 0, "oft_block_size": 2, "target_modules": ["lin0"], "coft": True, "eps": 1e-2, "block_share": True,
      "use_cayley_neumann": True}),
    ("Vanilla MLP 13 OFT", "MLP",
     {"r": 0, "oft_block_size": 2, "target_modules": ["lin0"], "coft": True, "eps": 1e-2, "block_share": True,
      "use_cayley_neumann": False}),
    ("Embedding + transformers Conv1D 1 OFT", "EmbConv1D", {"r": 1, "oft_block_size": 0, "target_modules": ["emb"]}),
    ("Embedding + transformers Conv1D 2 OFT", "EmbConv1D",
     {"r": 1, "oft_block_size": 0, "target_modules": ["emb"], "block_share": True}),
    ("Conv2d 1 OFT", "Conv2dPEFT", {"r": 5, "oft_block_size": 0, "target_modules": ["conv2d"]}),
    ("Conv2d 3 OFT", "Conv2dPEFT", {"r": 5, "oft_block_size": 0, "target_modules": ["conv2d"], "coft": True}),
    ("Conv2d 4 OFT", "Conv2dPEFT", {"r": 5, "oft_block_size": 0, "target_modules": ["conv2d"], "block_share": True}),
    ("Conv2d 5 OFT", "Conv2dPEFT",
     {"r": 5, "oft_block_size": 0, "target_modules": ["conv2d"], "coft": True, "block_share": True}),
]
OVERLAPPING = [(f"{case} (5x5 input)", "Conv2dPEFT5x5", kwargs) for case, model, kwargs in CASES
               if model == "Conv2dPEFT"]


@pytest.mark.parametrize(("case", "model_id", "peft_kwargs"), CASES, ids=[c[0] for c in CASES])
def test_peft_custom_model_row_equals_peft(case, model_id, peft_kwargs, tmp_path):
    assert_equal_to_peft(model_id, peft_kwargs, tmp_path, OFT)


@pytest.mark.parametrize(("case", "model_id", "peft_kwargs"), OVERLAPPING, ids=[c[0] for c in OVERLAPPING])
def test_conv2d_rows_with_overlapping_patches_equal_peft_merged(case, model_id, peft_kwargs, tmp_path, monkeypatch):
    peft_conv2d_as_merged(monkeypatch)
    assert_equal_to_peft(model_id, peft_kwargs, tmp_path, OFT)
