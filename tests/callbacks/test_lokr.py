"""The LoKr callback under a real Trainer: what trains, the merged export that plain transformers loads and the adapter
PEFT loads, LightningCLI YAML. (Resume, adapter-only checkpoints and refusals: its row in tests/test_conformance.py.)"""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_peft.callbacks import LoKr, MergeOnSave
from lightning_peft.peft import LoKrConfig, adapter_state_dict
from lightning_peft.peft.lokr import lokr_layers
from tests._models import Classifier, loader, trainer
from tests.callbacks import _technique as technique

transformers = pytest.importorskip("transformers")

# BERT's query/value (16, 16): 16 = 4 * 4 both ways; r=1 < 4 / 2: W2 low-rank, and (decompose_both) W1 too
ARGS = {"target_modules": ["query", "value"], "r": 1, "alpha": 2, "decompose_both": True}


def fit(config, root, callbacks=()):
    torch.manual_seed(0)
    module = Classifier(config)
    trainer(root, max_epochs=1, callbacks=[LoKr(**ARGS), *callbacks]).fit(module, loader())
    return module


def test_it_trains_the_factors_and_the_head_only_and_logs_what_it_injected(tiny_bert_config, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        module = fit(tiny_bert_config, tmp_path)
    layers = lokr_layers(module.model)
    assert sorted(layers) == [f"bert.encoder.layer.{i}.attention.self.{m}" for i in (0, 1) for m in ("query", "value")]
    # per layer: lokr_w1_a (4, 1) + lokr_w1_b (1, 4) + lokr_w2_a (4, 1) + lokr_w2_b (1, 4); the head 3 * 16 + 3
    assert module.trainable_at_configure == 4 * 16 + (3 * 16 + 3)
    assert set(adapter_state_dict(module.model)) == {n.removeprefix("model.") for n in
                                                     module.trainable_names_at_configure}
    assert all(layer.lokr_w1_a.abs().sum() > 0 for layer in layers.values())  # trained away from its zero start
    assert "LoKr: 4 layers of BertForSequenceClassification (r=1, saving classifier in full)" in caplog.text


def test_merge_on_save_writes_a_model_plain_transformers_loads_and_a_peft_adapter(tiny_bert_config, tmp_path):
    out = tmp_path / "out"
    technique.assert_merge_on_save_exports(
        tiny_bert_config, out, lambda: fit(tiny_bert_config, tmp_path, callbacks=[MergeOnSave(dirpath=str(out))]),
        lokr_layers)


def test_the_callback_is_built_from_lightning_cli_yaml():
    callback = technique.from_cli_yaml(LoKr, "target_modules: [query, value], r: 4, alpha: 8, decompose_both: true, "
                                             "decompose_factor: 4, init_weights: lycoris, rank_pattern: {value: 2}, "
                                             "rank_dropout: 0.1, module_dropout: 0.2, modules_to_save: [classifier], "
                                             "adapter_only_checkpoint: true")
    assert callback.config == LoKrConfig(target_modules=["query", "value"], r=4, alpha=8, decompose_both=True,
                                         decompose_factor=4, init_weights="lycoris", rank_pattern={"value": 2},
                                         rank_dropout=0.1, module_dropout=0.2, modules_to_save=["classifier"])
    assert callback.adapter_only_checkpoint
    assert callback.own_dropout() == 0.2  # the larger of its two dropouts, for the eval-mode warning


def test_tensor_parallelism_is_refused_at_setup_naming_both():
    from lightning.pytorch import Trainer

    from lightning_peft.strategies import TensorParallelStrategy

    run = Trainer(accelerator="cpu", devices=2, strategy=TensorParallelStrategy(tensor_parallel_size=2), logger=False)
    with pytest.raises(RuntimeError, match=r"LoKr under TensorParallelStrategy: the tensor-parallel plan splits a base "
                                           r"weight .* Train LoKr under data parallelism"):
        LoKr(**ARGS).check(run)
