"""modules_to_save: a trainable copy beside the frozen original, tied weights included, PEFT as the oracle."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from lightning_peft.peft import ModulesToSave, inject_lora, merged_state_dict, save_adapter, unload_lora
from tests._models import tied_gpt2

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


def train_one_step(model: nn.Module, ids: torch.Tensor) -> None:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


@pytest.mark.parametrize("saved", [["lm_head"], ["wte", "lm_head"]])
def test_tied_modules_to_save_train_a_copy_and_peft_reproduces_the_logits(saved, tmp_path):
    model = tied_gpt2()
    wte = model.transformer.wte.weight.detach().clone()
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2 ties them
    inject_lora(model, rank=2, target_modules=["c_attn"], modules_to_save=saved)
    ids = torch.randint(0, 32, (2, 6))
    train_one_step(model, ids)

    head = model.lm_head
    assert isinstance(head, ModulesToSave) and not head.original_module.weight.requires_grad
    assert torch.equal(head.original_module.weight, wte)  # the original is never trained
    assert not torch.equal(head.trained_module.weight, wte)  # the copy is
    if saved == ["lm_head"]:
        assert torch.equal(model.transformer.wte.weight, wte)  # the embeddings did not move with the head
    else:
        assert model.transformer.wte.trained_module.weight is head.trained_module.weight  # copies stay tied

    save_adapter(model, tmp_path)  # tied copies: each key written, no "tensors share memory"
    peft_model = peft.PeftModel.from_pretrained(tied_gpt2(), tmp_path).eval()
    with torch.no_grad():
        assert_close(peft_model(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_merged_export_of_a_saved_tied_head_loads_with_the_trained_head(tmp_path):
    from transformers import GPT2LMHeadModel

    model = tied_gpt2()
    inject_lora(model, rank=2, target_modules=["c_attn"], modules_to_save=["lm_head"])
    ids = torch.randint(0, 32, (2, 6))
    train_one_step(model, ids)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path, state_dict=merged_state_dict(model))
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_unload_gives_back_the_trained_or_the_original_module():
    for merge in (True, False):
        model = tied_gpt2()
        inject_lora(model, rank=2, target_modules=["c_attn"], modules_to_save=["lm_head"])
        trained, original = model.lm_head.trained_module, model.lm_head.original_module
        assert unload_lora(model, merge=merge) is model
        assert model.lm_head is (trained if merge else original)


def test_wrapper_reads_attributes_of_the_trained_copy():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    inject_lora(model, rank=2, target_modules=["0"], modules_to_save=["1"])
    assert model[1].out_features == 2 and model[1].weight is model[1].trained_module.weight


# ------------------------------------------------------- one selection for every technique (bottleneck, prompt, prefix)


def _families():
    from lightning_peft.peft import inject_bottleneck_adapters, inject_prefix_tuning, inject_prompt_tuning

    return {
        "bottleneck": lambda m, **kw: inject_bottleneck_adapters(m, reduction_factor=4, **kw),
        "prompt_tuning": lambda m, **kw: inject_prompt_tuning(m, num_virtual_tokens=2, **kw),
        "prefix_tuning": lambda m, **kw: inject_prefix_tuning(m, num_virtual_tokens=2, **kw),
    }


def _classifier(kind: str = "bert") -> nn.Module:
    import transformers

    torch.manual_seed(0)
    sizes = {"vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 16, "max_position_embeddings": 20}
    if kind == "roberta":  # its head is a block: classifier.dense -> classifier.out_proj
        return transformers.RobertaForSequenceClassification(transformers.RobertaConfig(**sizes, pad_token_id=1))
    return transformers.BertForSequenceClassification(transformers.BertConfig(**sizes))


@pytest.mark.parametrize("family", ["bottleneck", "prompt_tuning", "prefix_tuning"])
def test_a_head_another_technique_wraps_is_left_to_it(family):
    """The filter every technique shares: a task head that is a LoRA layer is neither copied nor trained twice
    (before, no technique checked for a wrapped layer, and bottleneck adapters only for a saved head itself)."""
    from lightning_peft.peft import attached

    inject = _families()[family]
    model = _classifier()
    inject_lora(model, rank=2, target_modules=["classifier"], modules_to_save=[])  # the head is a LoRALinear
    lora_head = model.classifier
    with pytest.raises(ValueError, match=r"modules_to_save=\['classifier'\]\): 'classifier' is a layer another "
                                         r"adapter wraps \(LoRALinear\); leave it out of modules_to_save here\."):
        inject(model, modules_to_save=["classifier"])
    assert list(attached(model)) == ["lora"]
    inject(model)  # default: the task head, unless another technique owns it
    assert model.classifier is lora_head and attached(model)[family].modules_to_save == ()
    assert {n for n, p in lora_head.named_parameters() if p.requires_grad} == {"lora_A.default.weight",
                                                                               "lora_B.default.weight"}


@pytest.mark.parametrize("family", ["bottleneck", "prompt_tuning", "prefix_tuning"])
def test_a_head_that_holds_a_module_another_technique_saves_is_left_to_it(family):
    from lightning_peft.peft import attached

    inject = _families()[family]
    model = _classifier("roberta")
    inject_lora(model, rank=2, target_modules=["query"], modules_to_save=["out_proj"])
    saved = model.classifier.out_proj
    with pytest.raises(ValueError, match=r"'classifier' holds 'classifier\.out_proj', which is already trained and "
                                         r"saved in full by another adapter on this model"):
        inject(model, modules_to_save=["classifier"])
    inject(model)
    assert model.classifier.out_proj is saved and attached(model)[family].modules_to_save == ()
    assert not any(isinstance(m, ModulesToSave) for m in saved.trained_module.modules())


def test_a_wrapper_follows_any_technique_that_says_which_samples_get_the_base():
    """The wrapper asks a neutral question (`BaseSamples.base_samples`), not LoRA's routing internals."""

    class Switch:
        def __init__(self, answer):
            self.answer = answer

        def base_samples(self):
            return self.answer

    torch.manual_seed(0)
    original = torch.nn.Linear(3, 2)
    wrapper = ModulesToSave(original, torch.nn.Linear(3, 2))
    x = torch.randn(3, 3)  # (B, 3)
    for answer, rows in ((True, [True] * 3), (False, [False] * 3), ([True, False, True], [True, False, True])):
        wrapper.routing = Switch(answer)
        expected = torch.where(torch.tensor(rows).view(3, 1), original(x), wrapper.trained_module(x))
        torch.testing.assert_close(wrapper(x), expected, rtol=0, atol=0)
