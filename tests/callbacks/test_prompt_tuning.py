"""The PromptTuning callback under a real Trainer: same result as the pure function, resume, checkpoints."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_peft.callbacks.prompt_tuning import PromptTuning
from lightning_peft.peft.adapter import adapter_state_dict, attached
from lightning_peft.peft.prompt.prompt_tuning import PROMPT_MODULE, inject_prompt_tuning, prompt_embedding
from tests._models import Classifier, loader, trainer

N = 4
HEAD = ["model.classifier.trained_module.weight", "model.classifier.trained_module.bias"]


class Data(pl.LightningDataModule):
    def __init__(self, tokenizer=None) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def train_dataloader(self) -> DataLoader:
        return loader()


class StubTokenizer:
    name_or_path = "stub-tokenizer"

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [2, 9, 11, 3]}


class RecordStart(Callback):
    def on_fit_start(self, trainer, pl_module):
        self.adapter = {k: v.clone() for k, v in adapter_state_dict(pl_module.model).items()}
        self.everything = {k: v.clone() for k, v in pl_module.state_dict().items()}


def test_callback_under_trainer_trains_only_the_prompt_and_head_and_equals_a_plain_loop(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    base_state = {k: v.clone() for k, v in module.model.state_dict().items()}
    record = RecordStart()
    trainer(tmp_path, max_steps=6, callbacks=[PromptTuning(num_virtual_tokens=N), record]).fit(module, loader())

    after = module.state_dict()
    changed = {k for k, v in record.everything.items() if not torch.equal(v, after[k])}
    assert changed == {f"model.{PROMPT_MODULE}.weight", *HEAD}  # only the prompt and the head trained

    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification(tiny_bert_config)
    model.load_state_dict(base_state)
    inject_prompt_tuning(model, num_virtual_tokens=N)
    model.load_state_dict(record.adapter, strict=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    batches = list(loader())
    for step in range(6):
        ids, labels = batches[step % len(batches)]
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    ours, plain = adapter_state_dict(module.model), adapter_state_dict(model)
    assert ours.keys() == plain.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-6, atol=1e-7)


def test_injects_before_configure_optimizers_and_logs_the_report(tiny_bert_config, tmp_path, caplog):
    module = Classifier(tiny_bert_config)
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, max_steps=1, callbacks=[PromptTuning(num_virtual_tokens=N)]).fit(module, loader())
    assert module.trainable_at_configure == N * 16 + (3 * 16 + 3)
    assert ("PromptTuning: 4 virtual tokens (random init) on BertForSequenceClassification, saving classifier in "
            "full; trainable params: 115") in caplog.text


def test_text_init_takes_the_datamodules_tokenizer(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    record = RecordStart()
    callback = PromptTuning(num_virtual_tokens=N, init="text", init_text="anything")
    trainer(tmp_path, max_steps=1, callbacks=[callback, record]).fit(module, datamodule=Data(StubTokenizer()))
    words = module.model.get_input_embeddings().weight
    assert torch.equal(record.adapter[f"{PROMPT_MODULE}.weight"], words[[2, 9, 11, 3]])
    assert attached(module.model)["prompt_tuning"].peft_config(module.model)["tokenizer_name_or_path"] == (
        "stub-tokenizer")


def test_later_stages_reuse_the_prompt(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    run = trainer(tmp_path, max_steps=2, callbacks=[PromptTuning(num_virtual_tokens=N)])
    run.fit(module, loader())
    prompt = prompt_embedding(module.model)
    run.test(module, loader())
    assert prompt_embedding(module.model) is prompt
    assert run.callback_metrics["test_loss"].isfinite()


def test_the_callback_state_refuses_another_length():
    callback = PromptTuning(num_virtual_tokens=6)
    with pytest.raises(ValueError, match=r"PromptTuning: the checkpoint was trained with num_virtual_tokens=4; this "
                                         r"run has num_virtual_tokens=6"):
        callback.load_state_dict(PromptTuning(num_virtual_tokens=N).state_dict())
    callback.load_state_dict(PromptTuning(num_virtual_tokens=6, init="vocab").state_dict())  # init only steers
    started = PromptTuning(num_virtual_tokens=6, init="text", init_text="Topic:", tokenizer="bert").state_dict()
    callback.load_state_dict(started)  # so do the init text and its tokenizer
    with pytest.raises(ValueError, match=r"with modules_to_save=\['classifier'\]; this run has modules_to_save=None"):
        callback.load_state_dict(PromptTuning(num_virtual_tokens=6, modules_to_save=["classifier"]).state_dict())


def test_a_prompt_of_another_length_on_the_model_is_refused(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    inject_prompt_tuning(module.model, num_virtual_tokens=2)
    with pytest.raises(RuntimeError, match=r"PromptTuning: BertForSequenceClassification already has a soft "
                                           r"prompt with another config \(PromptTuningAdapter\(num_virtual_tokens=2, "
                                           r".*; this callback asks for \{'num_virtual_tokens': 4, .*one PromptTuning"):
        trainer(tmp_path, max_steps=1, callbacks=[PromptTuning(num_virtual_tokens=N)]).fit(module, loader())


def test_text_init_without_any_tokenizer_is_refused(tiny_bert_config, tmp_path):
    callback = PromptTuning(num_virtual_tokens=N, init="text", init_text="hello")
    with pytest.raises(ValueError, match=r"PromptTuning\(init='text', tokenizer=None\): no tokenizer"):
        trainer(tmp_path, max_steps=1, callbacks=[callback]).fit(Classifier(tiny_bert_config), datamodule=Data())


def test_static_arguments_are_checked_in_init():
    with pytest.raises(ValueError, match=r"PromptTuning\(num_virtual_tokens=0\): num_virtual_tokens must be an integer >= 1"):
        PromptTuning(num_virtual_tokens=0)
    with pytest.raises(ValueError, match=r"PromptTuning\(init='text', init_text=None\)"):
        PromptTuning(init="text")
    with pytest.raises(TypeError, match=r"PromptTuning\(tokenizer=StubTokenizer\): give the tokenizer's name"):
        PromptTuning(init="text", init_text="x", tokenizer=StubTokenizer())
