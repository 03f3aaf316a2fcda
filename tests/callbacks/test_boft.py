"""The BOFT callback under a real Trainer (what trains, the merged export plain transformers loads) and from
LightningCLI YAML. Resume and adapter-only checkpoints: tests/test_conformance.py's BOFT row."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lightning_peft.callbacks import BOFT, MergeOnSave
from lightning_peft.peft import BOFTConfig, adapter_state_dict
from lightning_peft.peft.boft import boft_layers
from tests.callbacks import _technique as technique

transformers = pytest.importorskip("transformers")

ARGS = {"target_modules": ["query", "value"], "boft_block_size": 4, "boft_n_butterfly_factor": 2}


def test_it_trains_every_factor_and_the_merged_export_is_a_plain_model(tiny_bert_config, tmp_path):
    module = technique.fit(BOFT(**ARGS), tiny_bert_config, tmp_path,
                           callbacks=[MergeOnSave(dirpath=str(tmp_path / "out"))])
    layers = boft_layers(module.model)
    hidden = tiny_bert_config.hidden_size
    assert len(layers) == 4 and all(layer.boft_R.shape == (2, hidden // 4, 4, 4) for layer in layers.values())
    assert all(layer.boft_R[1].abs().max() > 0 for layer in layers.values())  # the second factor trained too
    assert set(adapter_state_dict(module.model)) == {n.removeprefix("model.") for n in
                                                     module.trainable_names_at_configure}
    ids = torch.randint(0, 64, (3, 8))
    module.model.eval()
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "merged").eval()
    assert not boft_layers(merged)
    assert_close(merged(input_ids=ids).logits, module.model(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def test_the_callback_is_built_from_lightning_cli_yaml():
    callback = technique.from_cli_yaml(BOFT, "target_modules: [query, value], boft_block_size: 0, boft_block_num: 4, "
                                             "boft_n_butterfly_factor: 3, boft_dropout: 0.1, bias: boft_only, "
                                             "adapter_only_checkpoint: true")
    assert callback.config == BOFTConfig(target_modules=["query", "value"], boft_block_size=0, boft_block_num=4,
                                         boft_n_butterfly_factor=3, boft_dropout=0.1, bias="boft_only")
    assert callback.adapter_only_checkpoint
