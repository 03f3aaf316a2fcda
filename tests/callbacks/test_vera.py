"""The VeRA callback under a real Trainer: what trains, a resume from an adapter-only checkpoint (which carries the
shared projections), the merged export that plain transformers loads, LightningCLI YAML."""

from __future__ import annotations

import functools
import logging

import pytest

from lightning_peft.callbacks import MergeOnSave, VeRA
from lightning_peft.peft import VeraConfig, adapter_state_dict
from lightning_peft.peft.vera import vera_layers
from tests.callbacks import _technique as technique

transformers = pytest.importorskip("transformers")

ARGS = {"target_modules": ["query", "value", "intermediate.dense"], "rank": 8, "projection_prng_key": 5}
PROJECTIONS = {f"model.bert.encoder.layer.0.attention.self.query.vera_projections.vera_{m}" for m in "AB"}


def fit(config, root, epochs, ckpt_path=None, callbacks=(), **kwargs):
    callback = VeRA(**{**ARGS, **kwargs}, adapter_only_checkpoint=True)
    return technique.fit(callback, config, root, epochs, ckpt_path, callbacks)


def test_it_trains_the_vectors_and_the_head_only_and_logs_what_it_injected(tiny_bert_config, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        module = fit(tiny_bert_config, tmp_path, 1)
    layers = vera_layers(module.model)
    # per layer: query, value (lambda_b 16, lambda_d 8), intermediate.dense (32, 8); the head (3 x 16 + 3)
    assert module.trainable_at_configure == 2 * (24 + 24 + 40) + (3 * 16 + 3)
    assert set(adapter_state_dict(module.model)) == {n.removeprefix("model.") for n in
                                                     module.trainable_names_at_configure | PROJECTIONS}
    shared = module.model.bert.encoder.layer[0].attention.self.query.vera_projections
    assert shared.vera_A.shape == (8, 16) and shared.vera_B.shape == (32, 8)  # the largest in and out sizes
    assert all(layer.projections is shared for layer in layers.values())
    assert all(layer.vera_lambda_b.abs().max() > 0 for layer in layers.values())  # trained from zero
    assert "VeRA: 6 layers of BertForSequenceClassification (rank 8, saving classifier in full)" in caplog.text


def test_an_adapter_only_checkpoint_carries_the_projections_and_resumes_bit_for_bit(tiny_bert_config, tmp_path):
    technique.assert_resumes_bit_for_bit(functools.partial(fit, tiny_bert_config), tmp_path, PROJECTIONS)


def test_merge_on_save_writes_a_model_plain_transformers_loads_and_a_peft_adapter(tiny_bert_config, tmp_path):
    out = tmp_path / "out"
    technique.assert_merge_on_save_exports(
        tiny_bert_config, out,
        lambda: fit(tiny_bert_config, tmp_path, 1, callbacks=[MergeOnSave(dirpath=str(out))], save_projection=False),
        vera_layers, peft_warns="Specified to not load vera_A and vera_B")  # PEFT draws them from the key


def test_the_callback_is_built_from_lightning_cli_yaml():
    callback = technique.from_cli_yaml(VeRA, "target_modules: [query, value], rank: 64, projection_prng_key: 3, "
                                             "save_projection: false, dropout: 0.1, d_initial: 0.05, bias: vera_only, "
                                             "modules_to_save: [classifier], layers_to_transform: [0, 1], "
                                             "layers_pattern: layer, adapter_only_checkpoint: true")
    assert callback.config == VeraConfig(target_modules=["query", "value"], rank=64, projection_prng_key=3,
                                         save_projection=False, dropout=0.1, d_initial=0.05, bias="vera_only",
                                         modules_to_save=["classifier"], layers_to_transform=[0, 1],
                                         layers_pattern="layer")
    assert callback.adapter_only_checkpoint


def test_a_resume_with_another_key_is_refused():
    state = VeRA(**ARGS).state_dict()
    with pytest.raises(ValueError, match=r"VeRA: the checkpoint was trained with projection_prng_key=5; this run has "
                                         r"projection_prng_key=0\. Resume with the checkpoint's settings"):
        VeRA(**{**ARGS, "projection_prng_key": 0}).load_state_dict(state)
