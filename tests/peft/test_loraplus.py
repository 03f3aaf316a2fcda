"""LoRA+ grouping (`lightning_peft.peft.loraplus`) equals Hugging Face PEFT's ``create_loraplus_optimizer``."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, get_peft_model
from peft.optimizers import create_loraplus_optimizer

from lightning_peft.peft import inject_lora
from lightning_peft.peft.loraplus import loraplus_groups
from tests._models import bert_model

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

SETTINGS = {"r": 2, "target_modules": ["query", "value", "word_embeddings"], "bias": "lora_only",
            "modules_to_save": ["classifier", "LayerNorm"]}


def _model():
    torch.manual_seed(0)
    return bert_model()


def test_the_groups_are_peft_create_loraplus_optimizer_groups():
    """Each trainable parameter gets PEFT's lr: B factors, biases and norm weights lr * ratio, both factors of the
    embedding adapter loraplus_lr_embedding, A factors and the saved classifier's matrix lr."""
    peft_model = get_peft_model(_model(), LoraConfig(**SETTINGS))
    theirs = create_loraplus_optimizer(peft_model, torch.optim.AdamW, lr=1e-3, loraplus_lr_ratio=16.0,
                                       loraplus_lr_embedding=1e-5)
    by_id = {id(p): n for n, p in peft_model.named_parameters()}
    peft_lr = {by_id[id(p)].removeprefix("base_model.model.").replace("modules_to_save.default", "trained_module"):
               (g["lr"], g["weight_decay"]) for g in theirs.param_groups for p in g["params"]}

    ours = _model()
    inject_lora(ours, rank=2, target_modules=SETTINGS["target_modules"], bias="lora_only",
                modules_to_save=SETTINGS["modules_to_save"])
    groups = loraplus_groups(ours, lr=1e-3, ratio=16.0, lr_embedding=1e-5)
    by_id = {id(p): n for n, p in ours.named_parameters()}
    our_lr = {by_id[id(p)]: (g["lr"], 0.0) for g in groups for p in g["params"]}

    assert our_lr == peft_lr
    assert {lr for lr, _ in our_lr.values()} == {1e-3, 1.6e-2, 1e-5}  # every kind of group is there
    assert [g["role"] for g in groups] == ["A", "embedding", "B"]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"ratio": 0.0}, ValueError, r"loraplus_groups\(loraplus_lr_ratio=0\.0\): loraplus_lr_ratio must be"),
    ({"ratio": 16.0, "lr_embedding": -1.0}, ValueError, r"loraplus_groups\(loraplus_lr_embedding=-1\.0\)"),
    ({"ratio": "16"}, TypeError, r"loraplus_groups\(loraplus_lr_ratio='16'\)"),
])
def test_bad_settings_are_refused(kwargs, error, match):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    inject_lora(model, rank=2, target_modules=["0"])
    with pytest.raises(error, match=match):
        loraplus_groups(model, lr=1e-3, **kwargs)
