"""The IA3 callback under a real Trainer: what trains, a resume from an adapter-only checkpoint, the merged export
that plain transformers loads, LightningCLI YAML."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from lightning_peft.callbacks import IA3, MergeOnSave
from lightning_peft.peft import IA3Config, adapter_state_dict
from lightning_peft.peft.ia3 import ia3_layers
from tests._models import loader, trainer
from tests.callbacks import _technique as technique

transformers = pytest.importorskip("transformers")

ARGS = {"target_modules": ["key", "value", "intermediate.dense", "output.dense"],
        "feedforward_modules": r".*\.layer\.\d+\.output\.dense"}  # a regular expression: not the attention's


def fit(config, root, epochs, **kwargs):
    return technique.fit(IA3(**ARGS, adapter_only_checkpoint=True), config, root, epochs, **kwargs)


def test_it_trains_the_vectors_and_the_head_only_and_logs_what_it_injected(tiny_bert_config, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        module = fit(tiny_bert_config, tmp_path, 1)
    layers = ia3_layers(module.model)
    # per layer: key, value (16 each, output), intermediate.dense (32, output), output.dense (32 input), the
    # attention output's dense (16, output: "attention.output.dense" is not a feed-forward entry)
    assert sorted(n for n, layer in layers.items() if layer.feedforward) == [
        f"bert.encoder.layer.{i}.output.dense" for i in (0, 1)]
    assert module.trainable_at_configure == 2 * (16 + 16 + 32 + 32 + 16) + (3 * 16 + 3)
    assert set(adapter_state_dict(module.model)) == {n.removeprefix("model.") for n in
                                                     module.trainable_names_at_configure}
    assert all(not torch.equal(layer.ia3_l["default"], torch.ones(layer.ia3_l["default"].shape))
               for layer in layers.values())  # trained
    assert ("IA3: 10 layers of BertForSequenceClassification (2 scaled at the input, saving classifier in full)"
            in caplog.text)


def test_an_adapter_only_checkpoint_resumes_bit_for_bit(tiny_bert_config, tmp_path):
    technique.assert_resumes_bit_for_bit(functools.partial(fit, tiny_bert_config), tmp_path)


def test_merge_on_save_writes_a_model_plain_transformers_loads_and_a_peft_adapter(tiny_bert_config, tmp_path):
    out = tmp_path / "out"
    technique.assert_merge_on_save_exports(
        tiny_bert_config, out, lambda: fit(tiny_bert_config, tmp_path, 1, callbacks=[MergeOnSave(dirpath=str(out))]),
        ia3_layers)


def test_the_callback_is_built_from_lightning_cli_yaml():
    callback = technique.from_cli_yaml(IA3, "target_modules: [key, value, wo], feedforward_modules: [wo], "
                                            "modules_to_save: [classifier], adapter_only_checkpoint: true")
    assert callback.config == IA3Config(target_modules=["key", "value", "wo"], feedforward_modules=["wo"],
                                        modules_to_save=["classifier"])
    assert callback.adapter_only_checkpoint


def test_a_resume_with_other_feedforward_modules_is_refused(tiny_bert_config):
    state = IA3(**ARGS).state_dict()
    with pytest.raises(ValueError, match=r"IA3: the checkpoint was trained with feedforward_modules='\.\*.*'; this run "
                                         r"has feedforward_modules=None\. Resume with the checkpoint's settings"):
        IA3(target_modules=ARGS["target_modules"]).load_state_dict(state)


def test_merge_on_save_s_refusal_of_a_head_outside_the_export_names_the_ia3_callback(tiny_bert_config, tmp_path):
    from tests.callbacks.test_checkpoint import BackboneAndHead

    run = trainer(tmp_path, max_steps=1, callbacks=[IA3(target_modules=["key"]), MergeOnSave(dirpath=str(tmp_path))])
    with pytest.raises(ValueError, match=r"trains parameters outside the exported model 'backbone' .* "
                                         r"model_attribute='' on both IA3 and MergeOnSave, with the extra module"):
        run.fit(BackboneAndHead(tiny_bert_config), loader())
