"""The OFT callback under a real Trainer: what trains, a resume from an adapter-only checkpoint, the merged export
that plain transformers and PEFT load, LightningCLI YAML."""

from __future__ import annotations

import functools
import logging

import pytest

from lightning_peft.callbacks import OFT, MergeOnSave
from lightning_peft.peft import OFTConfig, adapter_state_dict
from lightning_peft.peft.oft import oft_layers
from tests.callbacks import _technique as technique

transformers = pytest.importorskip("transformers")

ARGS = {"target_modules": ["query", "value", "output.dense"], "oft_block_size": 4, "bias": "oft_only"}


def fit(config, root, epochs, **kwargs):
    return technique.fit(OFT(**ARGS, adapter_only_checkpoint=True), config, root, epochs, **kwargs)


def test_it_trains_the_rotations_biases_and_head_only_and_logs_what_it_injected(tiny_bert_config, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        module = fit(tiny_bert_config, tmp_path, 1)
    layers = oft_layers(module.model)
    assert len(layers) == 2 * 4  # per layer: query, value, attention.output.dense, output.dense
    sizes = {name.split("layer.0.")[-1]: layer.rotation.weight.shape for name, layer in layers.items()
             if ".layer.0." in name}
    hidden, inner = tiny_bert_config.hidden_size, tiny_bert_config.intermediate_size
    assert sizes == {"attention.self.query": (hidden // 4, 6), "attention.self.value": (hidden // 4, 6),
                     "attention.output.dense": (hidden // 4, 6), "output.dense": (inner // 4, 6)}
    biases = 2 * 4 * hidden
    assert module.trainable_at_configure == 2 * 6 * (3 * hidden + inner) // 4 + biases + (3 * hidden + 3)
    assert set(adapter_state_dict(module.model)) == {n.removeprefix("model.") for n in
                                                     module.trainable_names_at_configure}
    assert all(layer.rotation.weight.abs().max() > 0 for layer in layers.values())  # trained away from I
    assert "OFT: 8 layers of BertForSequenceClassification, saving classifier in full" in caplog.text


def test_an_adapter_only_checkpoint_resumes_bit_for_bit(tiny_bert_config, tmp_path):
    technique.assert_resumes_bit_for_bit(functools.partial(fit, tiny_bert_config), tmp_path)


def test_merge_on_save_writes_a_model_plain_transformers_loads_and_a_peft_adapter(tiny_bert_config, tmp_path):
    out = tmp_path / "out"
    technique.assert_merge_on_save_exports(
        tiny_bert_config, out, lambda: fit(tiny_bert_config, tmp_path, 1, callbacks=[MergeOnSave(dirpath=str(out))]),
        oft_layers)


def test_the_callback_is_built_from_lightning_cli_yaml():
    callback = technique.from_cli_yaml(OFT, "target_modules: [query, value], r: 4, oft_block_size: 0, coft: true, "
                                            "eps: 1.0e-3, block_share: true, use_cayley_neumann: false, "
                                            "module_dropout: 0.1, layers_to_transform: [0], "
                                            "modules_to_save: [classifier], adapter_only_checkpoint: true")
    assert callback.config == OFTConfig(target_modules=["query", "value"], r=4, oft_block_size=0, coft=True, eps=1e-3,
                                        block_share=True, use_cayley_neumann=False, module_dropout=0.1,
                                        layers_to_transform=[0], modules_to_save=["classifier"])
    assert callback.adapter_only_checkpoint


def test_a_resume_with_another_block_size_is_refused():
    state = OFT(**ARGS).state_dict()
    with pytest.raises(ValueError, match=r"OFT: the checkpoint was trained with oft_block_size=4; this run has "
                                         r"oft_block_size=8\. Resume with the checkpoint's settings"):
        OFT(**{**ARGS, "oft_block_size": 8}).load_state_dict(state)
