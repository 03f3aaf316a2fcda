"""The LoHa callback under a real Trainer: what trains, a resume from an adapter-only checkpoint (rank and module
dropout on: their draws resume too), the merged export that plain transformers loads and the PEFT adapter, LightningCLI
YAML."""

from __future__ import annotations

import functools
import logging

import pytest

from lightning_peft.callbacks import LoHa, MergeOnSave
from lightning_peft.peft import LoHaConfig, adapter_state_dict
from lightning_peft.peft.loha import loha_layers
from tests.callbacks import _technique as technique

transformers = pytest.importorskip("transformers")

ARGS = {"target_modules": ["query", "value"], "r": 2, "alpha": 4, "rank_dropout": 0.2, "module_dropout": 0.1,
        "rank_pattern": {r"layer\.1\.attention\.self\.value": 3}}


def fit(config, root, epochs, **kwargs):
    return technique.fit(LoHa(**ARGS, adapter_only_checkpoint=True), config, root, epochs, **kwargs)


def test_it_trains_the_factors_and_the_head_only_and_logs_what_it_injected(tiny_bert_config, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        module = fit(tiny_bert_config, tmp_path, 1)
    layers = loha_layers(module.model)
    assert sorted(layers) == [f"bert.encoder.layer.{i}.attention.self.{m}" for i in (0, 1) for m in ("query", "value")]
    assert [layer.r for layer in layers.values()] == [2, 2, 2, 3]  # rank_pattern
    # four factors of 16 * r each per layer (width 16), and the classifier (16 * 3 + 3)
    assert module.trainable_at_configure == 4 * 16 * (2 + 2 + 2 + 3) + (3 * 16 + 3)
    assert set(adapter_state_dict(module.model)) == {n.removeprefix("model.") for n in
                                                     module.trainable_names_at_configure}
    assert all(layer.hada_w2_b.abs().max() > 0 for layer in layers.values())  # trained away from zero
    assert "LoHa: 4 layers of BertForSequenceClassification (r=2, saving classifier in full)" in caplog.text


def test_an_adapter_only_checkpoint_resumes_bit_for_bit(tiny_bert_config, tmp_path):
    technique.assert_resumes_bit_for_bit(functools.partial(fit, tiny_bert_config), tmp_path)


def test_merge_on_save_writes_a_model_plain_transformers_loads_and_a_peft_adapter(tiny_bert_config, tmp_path):
    out = tmp_path / "out"
    technique.assert_merge_on_save_exports(
        tiny_bert_config, out, lambda: fit(tiny_bert_config, tmp_path, 1, callbacks=[MergeOnSave(dirpath=str(out))]),
        loha_layers)


def test_the_callback_is_built_from_lightning_cli_yaml():
    callback = technique.from_cli_yaml(LoHa, "target_modules: [query, value], r: 4, alpha: 8, rank_dropout: 0.1, "
                                             "use_effective_conv2d: true, rank_pattern: {value: 2}, "
                                             "modules_to_save: [classifier], adapter_only_checkpoint: true")
    assert callback.config == LoHaConfig(target_modules=["query", "value"], r=4, alpha=8, rank_dropout=0.1,
                                         use_effective_conv2d=True, rank_pattern={"value": 2},
                                         modules_to_save=["classifier"])
    assert callback.adapter_only_checkpoint


def test_a_resume_with_another_rank_is_refused():
    state = LoHa(**ARGS).state_dict()
    with pytest.raises(ValueError, match=r"LoHa: the checkpoint was trained with r=2; this run has r=4\. Resume with "
                                         r"the checkpoint's settings"):
        LoHa(**{**ARGS, "r": 4}).load_state_dict(state)
