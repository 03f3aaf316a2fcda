"""The BottleneckAdapters callback under a real Trainer: same result as the pure function, resume, checkpoints."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_peft.callbacks._checkpoint import load_from_checkpoint
from lightning_peft.callbacks.bottleneck import BottleneckAdapters
from lightning_peft.callbacks.lora import LoRA
from lightning_peft.modules.hf import HFSequenceClassifier
from lightning_peft.peft.adapter import adapter_state_dict, attached
from lightning_peft.peft.bottleneck.model import BottleneckConfig, bottleneck_layers, inject_bottleneck_adapters
from lightning_peft.peft.lora import lora_layers
from tests._models import Classifier, dict_loader, loader, save_tiny_bert, trainer

transformers = pytest.importorskip("transformers")

ARGS = {"placement": "houlsby", "reduction_factor": 4, "non_linearity": "gelu", "modules_to_save": ["classifier"]}


def fit(module, tmp_path, callbacks, ckpt_path=None, **kwargs):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last")
    run = trainer(tmp_path, callbacks=[*callbacks, checkpoint], enable_checkpointing=True, **kwargs)
    run.fit(module, loader(), ckpt_path=ckpt_path)
    return tmp_path / "last.ckpt"


class RecordInitialAdapter(Callback):
    def on_fit_start(self, trainer, pl_module):
        self.state = {k: v.clone() for k, v in adapter_state_dict(pl_module.model).items()}


def test_callback_trains_only_the_adapters_and_equals_the_pure_function_in_a_plain_loop(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    base_state = {k: v.clone() for k, v in module.model.state_dict().items()}
    record = RecordInitialAdapter()
    trainer(tmp_path, max_steps=6, callbacks=[BottleneckAdapters(**ARGS), record]).fit(module, loader())

    # Every adapter tensor and the head moved; nothing of the base did.
    ours = adapter_state_dict(module.model)
    assert all(not torch.equal(ours[k], record.state[k]) for k in ours)
    frozen = {k: v for k, v in module.model.named_parameters() if not v.requires_grad}
    assert all(torch.equal(v, base_state[k.replace(".base_layer", "").replace(".original_module", "")])
               for k, v in frozen.items())

    model = transformers.BertForSequenceClassification(tiny_bert_config)
    model.load_state_dict(base_state)
    inject_bottleneck_adapters(model, BottleneckConfig(**ARGS))
    model.load_state_dict(record.state, strict=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    batches = list(loader())
    for step in range(6):
        ids, labels = batches[step % len(batches)]
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    plain = adapter_state_dict(model)
    assert ours.keys() == plain.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-6, atol=1e-7)


def test_injects_before_configure_optimizers_and_logs_the_report(tiny_bert_config, tmp_path, caplog):
    module = Classifier(tiny_bert_config)
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, max_steps=1, callbacks=[BottleneckAdapters(**ARGS)]).fit(module, loader())
    expected = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert module.trainable_at_configure == expected
    assert expected == 4 * (4 * 16 + 4 + 16 * 4 + 16) + (3 * 16 + 3)
    assert ("BottleneckAdapters: 4 adapters in BertForSequenceClassification (houlsby, non-linearity gelu, saving "
            "classifier in full); trainable params: 643") in caplog.text


def test_later_stages_reuse_the_adapter_and_another_config_is_refused(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    run = trainer(tmp_path, max_steps=2, callbacks=[BottleneckAdapters(**ARGS)])
    run.fit(module, loader())
    layers = bottleneck_layers(module.model)
    run.test(module, loader())
    assert bottleneck_layers(module.model) == layers
    assert run.callback_metrics["test_loss"].isfinite()
    with pytest.raises(RuntimeError, match=r"BottleneckAdapters: BertForSequenceClassification already has bottleneck "
                                           r"adapters with another config \(BottleneckConfig\(placement='houlsby'.*\); "
                                           r"use one BottleneckAdapters callback per model"):
        trainer(tmp_path, max_steps=1, callbacks=[BottleneckAdapters(placement="pfeiffer")]).fit(module, loader())


def test_callback_state_refuses_a_changed_config_but_not_a_changed_dropout():
    state = BottleneckAdapters(**ARGS).state_dict()
    BottleneckAdapters(**ARGS, dropout=0.2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"BottleneckAdapters: the checkpoint was trained with reduction_factor=4; "
                                         r"this run has reduction_factor=8\. Resume with the checkpoint's settings, or "
                                         r"start a new run without ckpt_path\."):
        BottleneckAdapters(**{**ARGS, "reduction_factor": 8}).load_state_dict(state)


@pytest.fixture
def tiny_bert_dir(tmp_path) -> str:
    return save_tiny_bert(tmp_path / "tiny_bert")


def test_hf_sequence_classifier_trains_the_adapters_and_head_and_loads_an_adapter_only_checkpoint(
        tiny_bert_dir, tmp_path):
    torch.manual_seed(0)
    module = HFSequenceClassifier(tiny_bert_dir, num_labels=3, learning_rate=1e-2, warmup_ratio=0.0)
    before = {k: v.clone() for k, v in module.model.named_parameters()}
    callback = BottleneckAdapters(placement="pfeiffer", adapter_only_checkpoint=True)  # the head is saved by default
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="last")
    trainer(tmp_path, max_steps=3, callbacks=[callback, checkpoint], enable_checkpointing=True).fit(
        module, dict_loader())
    trained = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trained == set(adapter_state_dict(module.model))
    assert "classifier.trained_module.weight" in trained
    for name, param in module.model.named_parameters():
        old = before.get(name.replace(".base_layer", "").replace(".original_module", ""))
        if name in trained:
            assert old is None or not torch.equal(param, old), name
        else:
            assert torch.equal(param, old), name

    loaded = HFSequenceClassifier.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    batch = next(iter(dict_loader()))
    module.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(batch["input_ids"], batch["attention_mask"]),
                           module(batch["input_ids"], batch["attention_mask"]))


def test_together_with_lora_both_train_and_a_checkpoint_restores_both(tiny_bert_config, tmp_path):
    torch.manual_seed(0)
    module = Classifier(tiny_bert_config)
    # LoRA first: its on_save_checkpoint overwrites the checkpoint's adapter entry (and the keys an adapter-only
    # checkpoint dropped) that a PEFT callback before it wrote; BottleneckAdapters keeps what it finds.
    callbacks = [LoRA(rank=2, target_modules=["query", "value"], modules_to_save=[], adapter_only_checkpoint=True),
                 BottleneckAdapters(**ARGS, adapter_only_checkpoint=True)]
    ckpt = fit(module, tmp_path, callbacks, max_steps=3)
    assert list(attached(module.model)) == ["lora", "bottleneck"]
    trained = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trained == set(adapter_state_dict(module.model))
    assert any("lora_A" in n for n in trained) and any(".adapter.down." in n for n in trained)
    torch.manual_seed(0)
    loaded = load_from_checkpoint(Classifier, ckpt, config=tiny_bert_config)
    assert sorted(lora_layers(loaded.model)) == sorted(lora_layers(module.model))
    ids, _ = next(iter(loader()))
    module.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, module.model(input_ids=ids).logits)


class EarlyOptimizer(Classifier):
    """Builds its optimizer over the parameters it had in ``__init__``, as LightningCLI's optimizer: section does."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.early = list(self.parameters())

    def configure_optimizers(self):
        return torch.optim.SGD(self.early, lr=0.1)


def test_an_optimizer_built_before_injection_is_refused(tiny_bert_config, tmp_path):
    with pytest.raises(RuntimeError, match=r"BottleneckAdapters: the optimizer holds none of the 18 parameters that "
                                           r"train \(bert\.encoder\.layer\.0\.attention\.output\.dense\.adapter\.down\."
                                           r"weight, \.\.\.\): it was built before the adapters were injected"):
        trainer(tmp_path, max_steps=1, callbacks=[BottleneckAdapters(**ARGS)]).fit(
            EarlyOptimizer(tiny_bert_config), loader())


def test_static_arguments_are_checked_in_init():
    with pytest.raises(ValueError, match=r"BottleneckAdapters\(reduction_factor=-1\): reduction_factor must be a "
                                         r"finite number > 0"):
        BottleneckAdapters(reduction_factor=-1)
    with pytest.raises(ValueError, match=r"BottleneckAdapters\(placement='pfeiffer', target_modules=\['dense'\]\): "
                                         r"give one of them"):
        BottleneckAdapters(placement="pfeiffer", target_modules=["dense"])


def test_unknown_model_attribute_is_refused(tiny_bert_config, tmp_path):
    with pytest.raises(ValueError, match=r"BottleneckAdapters\(model_attribute='backbone'\): Classifier has no such "
                                         r"submodule\. Its children: model"):
        trainer(tmp_path, max_steps=1, callbacks=[BottleneckAdapters(model_attribute="backbone")]).fit(
            Classifier(tiny_bert_config), loader())
