"""PEFT's ``task_type`` in every export, so that ``peft.AutoPeftModelFor<Task>.from_pretrained("adapter/")`` loads what
``save_adapter`` (and ``MergeOnSave``, which writes through it) wrote, with its base, and computes what we compute.

The base is a tiny random model saved with ``save_pretrained`` in a local folder; ``base_model_name_or_path`` records
the folder's last component, so the loads run from the folder above it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from lightning_peft.peft import inject_ia3, inject_lora, save_adapter
from lightning_peft.peft._base_identity import task_type
from tests._models import VOCAB, bert_model, gpt2_model, llama_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

IDS = torch.arange(12).reshape(2, 6) % VOCAB

# (model, our method's keywords, PEFT's auto class); every adapter gets random values below
LLAMA_IA3 = {"target_modules": ["k_proj", "v_proj", "down_proj"], "feedforward_modules": ["down_proj"]}
CASES = {
    "llama-lora": (lambda: llama_model(), inject_lora, {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                   "AutoPeftModelForCausalLM"),
    "llama-ia3": (lambda: llama_model(), inject_ia3, LLAMA_IA3, "AutoPeftModelForCausalLM"),
    "gpt2-lora": (lambda: gpt2_model(), inject_lora, {"rank": 4, "alpha": 8, "target_modules": ["c_attn"]},
                  "AutoPeftModelForCausalLM"),
    "bert-lora": (lambda: bert_model("seq_cls"), inject_lora,
                  {"rank": 4, "alpha": 8, "target_modules": ["query", "value"]}, "AutoPeftModelForSequenceClassification"),
    "bert-ia3-head": (lambda: bert_model("seq_cls"), inject_ia3,
                      {"target_modules": ["query", "value", "output.dense"], "feedforward_modules": ["output.dense"],
                       "modules_to_save": ["classifier"]}, "AutoPeftModelForSequenceClassification"),
    "bert-base-lora": (lambda: bert_model("base"), inject_lora,
                       {"rank": 4, "alpha": 8, "target_modules": ["query", "value"]}, "AutoPeftModelForFeatureExtraction"),
}


def _outputs(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=IDS)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("case", list(CASES))
def test_auto_peft_model_loads_our_export_with_its_base_and_equal_outputs(case, tmp_path, monkeypatch):
    build, inject, kwargs, auto = CASES[case]
    torch.manual_seed(0)
    model = build().double().eval()
    model.save_pretrained(tmp_path / "base")
    model.config._name_or_path = str(tmp_path / "base")  # as from_pretrained("<dir>/base") leaves it
    inject(model, **kwargs)
    with torch.no_grad():  # every trained value away from its start, the saved head's too
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.5)
    save_adapter(model, tmp_path / "adapter")
    monkeypatch.chdir(tmp_path)  # base_model_name_or_path is "base"

    loaded = getattr(peft, auto).from_pretrained("adapter", dtype=torch.float64).eval()

    # (with task_type null it refuses: "Cannot infer the auto class from the config")
    assert_close(_outputs(loaded), _outputs(model), rtol=0, atol=1e-10)


class _OwnLlama(transformers.LlamaForCausalLM):
    """A user's subclass of a task head is that task."""


def _t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))


@pytest.mark.parametrize(("build", "expected"), [
    (lambda: llama_model(), "CAUSAL_LM"),
    (lambda: gpt2_model(), "CAUSAL_LM"),  # GPT2LMHeadModel: by transformers' causal-LM table
    (lambda: _OwnLlama(transformers.LlamaConfig(**llama_model().config.to_dict())), "CAUSAL_LM"),
    (lambda: llama_model("seq_cls"), "SEQ_CLS"),
    (lambda: bert_model("qa"), "QUESTION_ANS"),
    (lambda: transformers.BertForTokenClassification(bert_model().config), "TOKEN_CLS"),
    (_t5, "SEQ_2_SEQ_LM"),  # T5ForConditionalGeneration: by transformers' sequence-to-sequence table
    (lambda: bert_model("base"), "FEATURE_EXTRACTION"),
    (lambda: bert_model("masked_lm"), None),  # PEFT has no task type for a masked LM
    (lambda: nn.Sequential(nn.Linear(4, 4)), None),
])
def test_task_type_follows_the_model_class(build, expected):
    assert task_type(build()) == expected
