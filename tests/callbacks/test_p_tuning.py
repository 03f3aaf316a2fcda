"""The PTuning callback under a real Trainer: what trains, same result as a plain loop, a resume from an adapter-only
checkpoint (the encoder kept), PEFT's file written at the end, a folded prompt from PEFT's file, LightningCLI YAML."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_peft.callbacks import MergeOnSave, PTuning
from lightning_peft.peft import (
    PTuningConfig,
    adapter_state_dict,
    attached,
    inject_p_tuning,
    load_adapter,
    save_adapter,
)
from lightning_peft.peft.prompt.embedding import PROMPT_MODULE
from tests._models import Classifier, loader, trainer

transformers = pytest.importorskip("transformers")

N = 3
LSTM = {"num_virtual_tokens": N, "encoder_reparameterization_type": "LSTM", "encoder_hidden_size": 4,
        "encoder_num_layers": 2, "encoder_dropout": 0.2}  # dropout draws: the resume must restore the RNG
HEAD = {"model.classifier.trained_module.weight", "model.classifier.trained_module.bias"}


class RecordStart(Callback):
    def on_fit_start(self, trainer, pl_module):
        self.adapter = {k: v.clone() for k, v in adapter_state_dict(pl_module.model).items()}
        self.everything = {k: v.clone() for k, v in pl_module.state_dict().items()}


def fit(config, root, epochs, ckpt_path=None, callbacks=(), **settings):
    torch.manual_seed(0)
    module = Classifier(config)
    checkpoint = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)
    run = trainer(root, max_epochs=epochs, callbacks=[PTuning(**(settings or LSTM), adapter_only_checkpoint=True),
                                                      checkpoint, *callbacks], enable_checkpointing=True)
    run.fit(module, loader(), ckpt_path=ckpt_path)
    return module


def test_it_trains_the_encoder_and_head_only_and_equals_a_plain_loop(tiny_bert_config, tmp_path, caplog):
    torch.manual_seed(0)
    module = Classifier(tiny_bert_config)
    base_state = {k: v.clone() for k, v in module.model.state_dict().items()}
    record = RecordStart()
    settings = {"num_virtual_tokens": N, "encoder_hidden_size": 4}
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, max_steps=4, callbacks=[PTuning(**settings), record]).fit(module, loader())
    assert "PTuning: 3 virtual tokens (MLP encoder) on BertForSequenceClassification, saving classifier" in caplog.text
    after = module.state_dict()
    changed = {k for k, v in record.everything.items() if not torch.equal(v, after[k])}
    assert changed == {f"model.{PROMPT_MODULE}.{name}" for name in (
        "embedding.weight", "mlp_head.0.weight", "mlp_head.0.bias", "mlp_head.2.weight", "mlp_head.2.bias",
        "mlp_head.4.weight", "mlp_head.4.bias")} | HEAD

    model = transformers.BertForSequenceClassification(tiny_bert_config)
    model.load_state_dict(base_state)
    inject_p_tuning(model, **settings)
    model.load_state_dict(record.adapter, strict=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.01)
    model.train()
    batches = list(loader())
    for step in range(4):
        ids, labels = batches[step % len(batches)]
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    ours, plain = adapter_state_dict(module.model), adapter_state_dict(model)
    assert ours.keys() == plain.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-6, atol=1e-7)


def test_an_adapter_only_checkpoint_keeps_the_encoder_and_resumes_bit_for_bit(tiny_bert_config, tmp_path):
    straight = fit(tiny_bert_config, tmp_path / "straight", 2)
    saved = torch.load(tmp_path / "straight" / "epoch=0.ckpt", weights_only=False)
    assert set(saved["state_dict"]) == straight.trainable_names_at_configure
    assert f"model.{PROMPT_MODULE}.lstm_head.weight_hh_l1_reverse" in saved["state_dict"]
    resumed = fit(tiny_bert_config, tmp_path / "resumed", 2, ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    reference = straight.state_dict()
    assert resumed.state_dict().keys() == reference.keys()
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in reference.items())


def test_the_exported_adapter_is_the_prompt_peft_loads(tiny_bert_config, tmp_path):
    from peft import PeftModel

    torch.manual_seed(0)
    base_state = {k: v.clone() for k, v in Classifier(tiny_bert_config).model.state_dict().items()}
    export = MergeOnSave(dirpath=str(tmp_path / "out"), save_merged=False)
    module = fit(tiny_bert_config, tmp_path, 1, callbacks=[export])
    ids = torch.randint(0, 64, (3, 8))
    module.model.eval()
    with torch.no_grad():
        expected = module.model(input_ids=ids).logits
    base = transformers.BertForSequenceClassification(tiny_bert_config)
    base.load_state_dict(base_state)
    theirs = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)


def test_a_prompt_loaded_from_peft_goes_on_folded_and_trains_its_table(tiny_bert_config, tmp_path):
    torch.manual_seed(0)
    source = Classifier(tiny_bert_config)
    inject_p_tuning(source.model, num_virtual_tokens=N)
    save_adapter(source.model, tmp_path / "peft")
    module = Classifier(tiny_bert_config)
    load_adapter(module.model, tmp_path / "peft")
    record = RecordStart()
    with pytest.warns(UserWarning, match="PTuning: the model's P-tuning prompt is folded .* trains as a table: the "
                                         "LSTM encoder asked for is not there"):
        trainer(tmp_path, max_steps=2, callbacks=[PTuning(**LSTM), record]).fit(module, loader())
    assert attached(module.model)["p_tuning"].folded
    after = module.state_dict()
    changed = {k for k, v in record.everything.items() if not torch.equal(v, after[k])}
    assert changed == {f"model.{PROMPT_MODULE}.embedding.weight"} | HEAD


def test_another_prompt_on_the_model_is_refused(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    inject_p_tuning(module.model, num_virtual_tokens=2)
    with pytest.raises(RuntimeError, match=r"PTuning: BertForSequenceClassification already has a P-tuning prompt "
                                           r"with another config \(PTuningAdapter\(PTuningConfig\(num_virtual_tokens=2"):
        trainer(tmp_path, max_steps=1, callbacks=[PTuning(num_virtual_tokens=N)]).fit(module, loader())


def test_a_resume_with_another_encoder_is_refused_and_another_dropout_is_not():
    state = PTuning(**LSTM).state_dict()
    with pytest.raises(ValueError, match=r"PTuning: the checkpoint was trained with encoder_hidden_size=4; this run "
                                         r"has encoder_hidden_size=8"):
        PTuning(**{**LSTM, "encoder_hidden_size": 8}).load_state_dict(state)
    PTuning(**{**LSTM, "encoder_dropout": 0.0}).load_state_dict(state)


def test_static_arguments_are_checked_in_init():
    with pytest.raises(ValueError, match=r"PTuning\(num_virtual_tokens=0\): num_virtual_tokens must be an integer"):
        PTuning(num_virtual_tokens=0)
    with pytest.raises(ValueError, match=r"the MLP encoder has exactly 2 hidden layers"):
        PTuning(encoder_num_layers=3)


def test_the_callback_is_built_from_lightning_cli_yaml():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callback", type=PTuning)
    yaml = ("callback:\n  class_path: lightning_peft.callbacks.PTuning\n  init_args: {num_virtual_tokens: 20, "
            "encoder_reparameterization_type: LSTM, encoder_hidden_size: 128, encoder_num_layers: 2, "
            "encoder_dropout: 0.1, modules_to_save: [classifier], adapter_only_checkpoint: true}\n")
    callback = parser.instantiate_classes(parser.parse_string(yaml)).callback
    assert callback.config == PTuningConfig(num_virtual_tokens=20, encoder_reparameterization_type="LSTM",
                                            encoder_hidden_size=128, encoder_num_layers=2, encoder_dropout=0.1,
                                            modules_to_save=["classifier"])
    assert callback.adapter_only_checkpoint and callback.own_dropout() == 0.1
