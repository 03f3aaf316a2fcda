"""Training on from Hugging Face PEFT's adapter folder: ``load_adapter(model, folder)`` and then the technique's callback
with the user's natural settings (``modules_to_save`` left at None, the targets as the user spells them) goes on from
PEFT's values, whatever order or spelling PEFT's file gives the targets; other settings are refused, naming both."""

from __future__ import annotations

import peft
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.testing import assert_close

from lightning_peft.callbacks import IA3, AdaLoRA, LoHa, LoRA, PromptTuning, VeRA
from lightning_peft.peft import load_adapter
from tests._models import Classifier, bert_config, bert_model, loader, trainer

QV = ["query", "value"]
EXACT = [f"bert.encoder.layer.{i}.attention.self.{m}" for i in (1, 0) for m in ("value", "query")]
ADALORA = {"init_r": 4, "target_r": 2, "total_step": 4, "tinit": 1, "tfinal": 1}


def both(field: str, have: str, want: str) -> str:
    """The refusal's words (a regex) for ``field``: the model's value ``have``, the callback's ``want``."""
    return rf"{field}: the model's adapter has {have}, this callback's settings resolve to {want}"


# technique: (PEFT's config, the user's callback, callbacks that ask for something else with the difference they name)
CASES = {
    "lora": (lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=QV, task_type="SEQ_CLS"),
             lambda: LoRA(rank=4, alpha=8, target_modules=["value", "query"]),
             [(lambda: LoRA(rank=2, alpha=8, target_modules=QV), both("rank", "4", "2")),
              (lambda: LoRA(rank=4, alpha=8, target_modules=["key"]),
               both("targets", r"\[.*self\.query.*\]", r"\[.*self\.key'\]"))]),
    # PEFT's file may name the exact modules (as ours do), not the user's suffixes
    "lora_exact_names": (lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=EXACT, task_type="SEQ_CLS"),
                         lambda: LoRA(rank=4, alpha=8, target_modules=QV), []),
    "ia3": (lambda: peft.IA3Config(target_modules=["key", "value", "output.dense"], feedforward_modules=["output.dense"],
                                   task_type="SEQ_CLS"),
            lambda: IA3(target_modules=["key", "value", "output.dense"], feedforward_modules=["output.dense"]),
            [(lambda: IA3(target_modules=["key", "value"]),
              both("targets", r"\[.*output\.dense'\]", r"\[.*self\.value'\]"))]),
    "loha": (lambda: peft.LoHaConfig(r=4, alpha=8, target_modules=QV, task_type="SEQ_CLS"),
             lambda: LoHa(r=4, alpha=8, target_modules=QV),
             [(lambda: LoHa(r=4, alpha=8, target_modules=QV, modules_to_save=[]),
               both("modules_to_save", r"\['classifier'\]", r"\[\]"))]),
    "vera": (lambda: peft.VeraConfig(r=4, target_modules=QV, task_type="SEQ_CLS"),
             lambda: VeRA(rank=4, target_modules=QV),
             [(lambda: VeRA(rank=8, target_modules=QV), both("rank", "4", "8"))]),
    "adalora": (lambda: peft.AdaLoraConfig(**ADALORA, target_modules=QV, task_type="SEQ_CLS"),
                lambda: AdaLoRA(**ADALORA, target_modules=QV),
                [(lambda: AdaLoRA(**{**ADALORA, "target_r": 1}, target_modules=QV), both("target_r", "2", "1"))]),
    "prompt_tuning": (lambda: peft.PromptTuningConfig(num_virtual_tokens=4, task_type="SEQ_CLS"),
                      lambda: PromptTuning(num_virtual_tokens=4),
                      [(lambda: PromptTuning(num_virtual_tokens=3), both("num_virtual_tokens", "4", "3"))]),
}
IDS = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))


class FirstStep(Callback):
    """Records the model's logits on `IDS` and its trainable tensors as the run's first training step starts."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not hasattr(self, "logits"):
            with torch.no_grad():
                self.logits = pl_module.model(input_ids=IDS).logits
            self.trainable = {n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad}


def peft_folder(technique: str, tmp_path) -> torch.Tensor:
    """PEFT's ``get_peft_model`` on the seed-0 tiny BERT, its trainable tensors set at random (away from any init),
    saved with ``save_pretrained`` to ``tmp_path / "peft"``; returns its logits on `IDS`."""
    torch.manual_seed(0)
    model = peft.get_peft_model(bert_model(), CASES[technique][0]())
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        return model(input_ids=IDS).logits


def loaded(tmp_path) -> Classifier:
    torch.manual_seed(0)
    module = Classifier(bert_config())  # the same seed-0 base as PEFT's
    load_adapter(module.model, tmp_path / "peft")
    return module


@pytest.mark.parametrize("technique", list(CASES))
def test_the_callback_trains_on_from_peft_s_adapter_folder(technique, tmp_path):
    expected = peft_folder(technique, tmp_path)
    module, first = loaded(tmp_path), FirstStep()
    trainer(tmp_path, max_steps=2, callbacks=[CASES[technique][1](), first]).fit(module, loader())
    assert_close(first.logits, expected, rtol=1e-5, atol=1e-6)  # the first step starts from PEFT's values
    trained = dict(module.named_parameters())
    assert first.trainable and all(not torch.equal(trained[n], v) for n, v in first.trainable.items()
                                   if not n.endswith("ranknum"))


@pytest.mark.parametrize(("technique", "other"), [(t, i) for t, case in CASES.items() for i in range(len(case[2]))])
def test_a_callback_with_other_settings_is_refused_naming_both_values(technique, other, tmp_path):
    peft_folder(technique, tmp_path)
    callback, difference = CASES[technique][2][other]
    with pytest.raises(RuntimeError, match=rf"already has .* with another config .*{difference}"):
        trainer(tmp_path, max_steps=1, callbacks=[callback()]).fit(loaded(tmp_path), loader())



@pytest.mark.parametrize("technique", ["lora", "ia3"])
def test_a_checkpoint_of_that_run_resumes_with_the_callback_alone(technique, tmp_path):
    # The checkpoint records the adapter as PEFT's file spelled it; the resumed run's callback builds it from the
    # user's spelling (no load_adapter): the same adapter, so it resumes from the checkpoint's values.
    peft_folder(technique, tmp_path)
    saving = ModelCheckpoint(dirpath=tmp_path, filename="last")
    trainer(tmp_path, max_steps=2, callbacks=[CASES[technique][1](), saving], enable_checkpointing=True).fit(
        loaded(tmp_path), loader())
    torch.manual_seed(0)
    module, first = Classifier(bert_config()), FirstStep()
    trainer(tmp_path, max_steps=3, callbacks=[CASES[technique][1](), first]).fit(module, loader(),
                                                                                 ckpt_path=tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert first.trainable.keys() <= saved.keys()
    assert all(torch.equal(v, saved[n]) for n, v in first.trainable.items())
