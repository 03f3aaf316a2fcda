"""The OFT callback under a real Trainer: what trains, a resume from an adapter-only checkpoint, the merged export
that plain transformers and PEFT load, LightningCLI YAML."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.testing import assert_close

from lightning_peft.callbacks import OFT, MergeOnSave
from lightning_peft.peft import OFTConfig, adapter_state_dict
from lightning_peft.peft.oft import oft_layers
from tests._models import Classifier, loader, trainer

transformers = pytest.importorskip("transformers")

ARGS = {"target_modules": ["query", "value", "output.dense"], "oft_block_size": 4, "bias": "oft_only"}


def fit(config, root, epochs, ckpt_path=None, callbacks=()):
    torch.manual_seed(0)
    module = Classifier(config)
    checkpoint = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)
    run = trainer(root, max_epochs=epochs, callbacks=[OFT(**ARGS, adapter_only_checkpoint=True), checkpoint,
                                                      *callbacks], enable_checkpointing=True)
    run.fit(module, loader(), ckpt_path=ckpt_path)
    return module


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
    straight = fit(tiny_bert_config, tmp_path / "straight", 2)
    saved = torch.load(tmp_path / "straight" / "epoch=0.ckpt", weights_only=False)
    assert set(saved["state_dict"]) == straight.trainable_names_at_configure
    resumed = fit(tiny_bert_config, tmp_path / "resumed", 2, ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    reference = straight.state_dict()
    assert resumed.state_dict().keys() == reference.keys()
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in reference.items())


def test_merge_on_save_writes_a_model_plain_transformers_loads_and_a_peft_adapter(tiny_bert_config, tmp_path):
    from peft import PeftModel

    torch.manual_seed(0)
    base_state = {k: v.clone() for k, v in Classifier(tiny_bert_config).model.state_dict().items()}
    module = fit(tiny_bert_config, tmp_path, 1, callbacks=[MergeOnSave(dirpath=str(tmp_path / "out"))])
    ids = torch.randint(0, 64, (3, 8))
    module.model.eval()
    expected = module.model(input_ids=ids).logits
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "merged").eval()
    assert type(merged) is transformers.BertForSequenceClassification and not oft_layers(merged)
    assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)
    base = transformers.BertForSequenceClassification(tiny_bert_config)
    base.load_state_dict(base_state)
    theirs = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
    assert_close(theirs(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)


def test_the_callback_is_built_from_lightning_cli_yaml():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callback", type=OFT)
    yaml = ("callback:\n  class_path: lightning_peft.callbacks.OFT\n  init_args: {target_modules: [query, value], "
            "r: 4, oft_block_size: 0, coft: true, eps: 1.0e-3, block_share: true, use_cayley_neumann: false, "
            "module_dropout: 0.1, layers_to_transform: [0], modules_to_save: [classifier], "
            "adapter_only_checkpoint: true}\n")
    callback = parser.instantiate_classes(parser.parse_string(yaml)).callback
    assert callback.config == OFTConfig(target_modules=["query", "value"], r=4, oft_block_size=0, coft=True, eps=1e-3,
                                        block_share=True, use_cayley_neumann=False, module_dropout=0.1,
                                        layers_to_transform=[0], modules_to_save=["classifier"])
    assert callback.adapter_only_checkpoint


def test_a_resume_with_another_block_size_is_refused():
    state = OFT(**ARGS).state_dict()
    with pytest.raises(ValueError, match=r"OFT: the checkpoint was trained with oft_block_size=4; this run has "
                                         r"oft_block_size=8\. Resume with the checkpoint's settings"):
        OFT(**{**ARGS, "oft_block_size": 8}).load_state_dict(state)
