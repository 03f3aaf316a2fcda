"""The LoRA rows of Hugging Face PEFT 0.21's own ``tests/test_custom_models.py``, run on ours with PEFT as the
oracle (`tests.peft.lora._oracle.assert_equal_to_peft`: forward, disable, merge/unmerge, files both ways, one
training step). The research variants PEFT tests there (KaSA, MiCA, VeLoRA, MonteCLoRA, BD-LoRA) are not ours to
match and are not listed. Every other row runs.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.peft.lora._oracle import assert_equal_to_peft, fixed_peft_mha

pytestmark = [
    pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to:UserWarning"),  # PEFT fixes its flag per layer
    pytest.mark.filterwarnings("ignore:LoRA. the rank exceeds:UserWarning"),  # PEFT's rows keep r=8 on tiny layers
    pytest.mark.filterwarnings("ignore:(All adapters are already merged|Already unmerged):UserWarning"),  # MHA's
    pytest.mark.filterwarnings("ignore:load_adapter.*adapts the nn.MultiheadAttention layer:UserWarning"),  # #3774
]


CASES = [
    ("Vanilla MLP 1 LoRA", "MLP", {"target_modules": "lin0"}),
    ("Vanilla MLP 2 LoRA", "MLP", {"target_modules": ["lin0"]}),
    ("Vanilla MLP 3 LoRA", "MLP", {"target_modules": ["lin1"]}),
    ("Vanilla MLP 4 LoRA", "MLP", {"target_modules": ["lin0", "lin1"]}),
    ("Vanilla MLP 5 LoRA", "MLP", {"target_modules": ["lin0"], "modules_to_save": ["lin1"]}),
    ("Vanilla MLP 6 LoRA", "MLP", {"target_modules": ["lin0"], "lora_alpha": 4, "lora_dropout": 0.1}),
    ("Vanilla MLP 7 LoRA with DoRA", "MLP", {"target_modules": ["lin0"], "use_dora": True}),
    ("Vanilla MLP 8 LoRA with DoRA", "MLP", {"target_modules": ["lin0", "lin1"], "use_dora": True}),
    ("Vanilla MLP 9 LoRA with DoRA", "MLP", {"target_modules": "lin1", "use_dora": True, "lora_alpha": 32}),
    ("Embedding + transformers Conv1D 1 LoRA", "EmbConv1D", {"target_modules": ["conv1d"]}),
    ("Embedding + transformers Conv1D 2 LoRA", "EmbConv1D", {"target_modules": ["emb"]}),
    ("Embedding + transformers Conv1D 3 LoRA", "EmbConv1D", {"target_modules": ["emb", "conv1d"]}),
    ("Embedding + transformers Conv1D 1 DoRA", "EmbConv1D", {"target_modules": ["conv1d"], "use_dora": True}),
    ("Embedding + transformers Conv1D 2 DoRA", "EmbConv1D", {"target_modules": ["emb"], "use_dora": True}),
    ("Embedding + transformers Conv1D 3 DoRA", "EmbConv1D", {"target_modules": ["emb", "conv1d"], "use_dora": True}),
    ("Embedding + transformers Conv1D 1 LoRA trainable_tokens", "EmbConv1D",
     {"target_modules": ["conv1d"], "trainable_token_indices": {"emb": [0, 10]}}),
    ("Conv1d LoRA", "Conv1d", {"target_modules": ["conv1d"]}),
    ("Conv1d LoRA with DoRA", "Conv1d", {"target_modules": ["conv1d"], "use_dora": True}),
    ("Conv2d 1 LoRA", "Conv2d", {"target_modules": ["conv2d"]}),
    ("Conv2d 2 LoRA", "Conv2d", {"target_modules": ["conv2d", "lin0"]}),
    ("Conv2d 1 LoRA with DoRA", "Conv2d", {"target_modules": ["conv2d"], "use_dora": True}),
    ("Conv2d 2 LoRA with DoRA", "Conv2d", {"target_modules": ["conv2d", "lin0"], "use_dora": True}),
    ("Conv2d Groups LoRA", "Conv2dGroups", {"target_modules": ["conv2d"]}),
    ("Conv2d Groups2 LoRA", "Conv2dGroups2", {"target_modules": ["conv2d"]}),
    ("Conv2d Groups LoRA with DoRA", "Conv2dGroups", {"target_modules": ["conv2d"], "use_dora": True}),
    ("Conv2d Groups2 LoRA with DoRA", "Conv2dGroups2", {"target_modules": ["conv2d"], "use_dora": True}),
    ("Conv3d 1 LoRA", "Conv3d", {"target_modules": ["conv3d"]}),
    ("Conv3d 2 LoRA", "Conv3d", {"target_modules": ["conv3d", "lin0"]}),
    ("Conv3d 1 LoRA with DoRA", "Conv3d", {"target_modules": ["conv3d"], "use_dora": True}),
    ("Conv3d 2 LoRA with DoRA", "Conv3d", {"target_modules": ["conv3d", "lin0"], "use_dora": True}),
    ("Conv3d 1x1 LoRA", "Conv3d1x1", {"target_modules": ["conv3d"]}),
    ("Conv3d 1x1 LoRA with DoRA", "Conv3d1x1", {"target_modules": ["conv3d"], "use_dora": True}),
    ("Vanilla MLP 1 LoRA with lora_b bias", "MLP",
     {"target_modules": ["lin0", "lin1"], "lora_bias": True, "lora_alpha": 32}),
    ("Conv2d 1 LoRA with lora_b bias", "Conv2d",
     {"target_modules": ["conv2d"], "lora_bias": True, "lora_alpha": 32}),
    ("Conv3d 1 LoRA with lora_b bias", "Conv3d",
     {"target_modules": ["conv3d"], "lora_bias": True, "lora_alpha": 32}),
    ("MHA 1 LoRA", "MHA", {"target_modules": ["mha"]}),
    ("MHA 2 LoRA", "MHA", {"target_modules": ["mha", "lin0"]}),
    ("MLP 1 using nn.Parameter LoRA", "MlpUsingParameters", {"target_parameters": ["lin0.weight"]}),
    ("MLP 2 using nn.Parameter LoRA", "MLP", {"target_modules": ["lin0"], "target_parameters": ["lin1.weight"]}),
]


@pytest.mark.parametrize(("case", "model_id", "peft_kwargs"), CASES)
def test_peft_custom_model_row_equals_peft(case, model_id, peft_kwargs, tmp_path):
    # PEFT 0.21.2 adds an nn.MultiheadAttention's out-projection update twice; the oracle is PEFT with that fixed.
    with fixed_peft_mha() if model_id == "MHA" else contextlib.nullcontext():
        assert_equal_to_peft(model_id, peft_kwargs, tmp_path)
