"""The PrefixTuning callback under a real Trainer: what trains, the fold at fit end, resume, checkpoints."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_peft.callbacks.prefix_tuning import PrefixTuning
from lightning_peft.peft.adapter import adapter_state_dict
from lightning_peft.peft.prompt.prefix_tuning import PREFIX_ATTRIBUTE, inject_prefix_tuning
from tests._models import Classifier, padded_loader, trainer

ARGS = {"num_virtual_tokens": 3, "modules_to_save": ["classifier"]}


def loader():
    """Padded batches ``(ids, mask, labels)``: the last two tokens of every other row are padding."""
    return padded_loader()


class RecordInitialAdapter(Callback):
    def on_fit_start(self, trainer, pl_module):
        self.state = {k: v.clone() for k, v in adapter_state_dict(pl_module.model).items()}


def test_only_the_prefix_and_the_head_train(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    record = RecordInitialAdapter()
    trainer(tmp_path, max_steps=4, callbacks=[PrefixTuning(**ARGS), record]).fit(module, loader())
    assert module.trainable_names_at_configure == {
        f"model.{PREFIX_ATTRIBUTE}.embedding.weight", "model.classifier.trained_module.weight",
        "model.classifier.trained_module.bias",
    }
    after = module.model.state_dict()
    for key, value in base.items():
        if key.startswith("classifier."):
            key = key.replace("classifier.", "classifier.original_module.")
        assert torch.equal(after[key], value), key  # the base, and the original head, are untouched
    for key, value in record.state.items():
        assert not torch.equal(adapter_state_dict(module.model)[key], value), key  # what trains has moved


def test_callback_under_trainer_equals_pure_function_in_plain_loop(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    base_state = {k: v.clone() for k, v in module.model.state_dict().items()}
    record = RecordInitialAdapter()
    trainer(tmp_path, max_steps=6, callbacks=[PrefixTuning(**ARGS), record]).fit(module, loader())

    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification(tiny_bert_config)
    model.load_state_dict(base_state)
    inject_prefix_tuning(model, **ARGS)
    model.load_state_dict(record.state, strict=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    batches = list(loader())
    for step in range(6):
        ids, mask, labels = batches[step % len(batches)]
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    ours, reference = adapter_state_dict(module.model), adapter_state_dict(model)
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], rtol=0, atol=0)


def test_the_projection_trains_and_is_folded_at_fit_end(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    callback = PrefixTuning(**ARGS, prefix_projection=True, encoder_hidden_size=5)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last")

    class BeforeFold(Callback):
        def on_train_end(self, trainer, pl_module):
            self.logits = pl_module.model(input_ids=batch[0], attention_mask=batch[1]).logits

    batch = next(iter(loader()))
    before = BeforeFold()
    trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[callback, checkpoint, before]).fit(
        module, loader()
    )
    assert f"model.{PREFIX_ATTRIBUTE}.transform.0.weight" in module.trainable_names_at_configure
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert f"model.{PREFIX_ATTRIBUTE}.transform.2.weight" in saved["state_dict"]  # checkpoints keep the MLP
    encoder = getattr(module.model, PREFIX_ATTRIBUTE)
    assert encoder.transform is None  # folded at fit end
    assert torch.equal(module.model(input_ids=batch[0], attention_mask=batch[1]).logits, before.logits)


def test_later_stages_reuse_the_folded_adapter(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    run = trainer(tmp_path, max_steps=2, callbacks=[PrefixTuning(**ARGS, prefix_projection=True)])
    run.fit(module, loader())
    table = getattr(module.model, PREFIX_ATTRIBUTE).embedding.weight.clone()
    run.test(module, loader(), verbose=False)
    assert torch.equal(getattr(module.model, PREFIX_ATTRIBUTE).embedding.weight, table)


def test_the_callback_state_refuses_another_config():
    saved = PrefixTuning(**ARGS).state_dict()  # the callback's own record, checked when Lightning restores callbacks
    callback = PrefixTuning(num_virtual_tokens=4, modules_to_save=["classifier"])
    with pytest.raises(ValueError, match=r"PrefixTuning: the checkpoint was trained with num_virtual_tokens=3; "
                                         r"this run has num_virtual_tokens=4\. Resume with the checkpoint's settings"):
        callback.load_state_dict(saved)


def test_a_second_config_on_an_adapted_model_is_refused(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    inject_prefix_tuning(module.model, num_virtual_tokens=5)
    with pytest.raises(RuntimeError, match="already has a prefix with another config .* one PrefixTuning callback"):
        trainer(tmp_path, max_steps=1, callbacks=[PrefixTuning(**ARGS)]).fit(module, loader())


def test_static_arguments_are_checked_in_init():
    with pytest.raises(ValueError, match=r"PrefixTuning\(num_virtual_tokens=0\)"):
        PrefixTuning(num_virtual_tokens=0)
    with pytest.raises(ValueError, match="prefix_projection=False has none"):
        PrefixTuning(encoder_hidden_size=32)
