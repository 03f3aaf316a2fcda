"""``LoRA(quantize=...)`` under a Trainer: adapter-only checkpoints leave the quantized base out, resume rebuilds it and
equals the straight run bit for bit (and ``load_from_checkpoint`` rebuilds it), ``MergeOnSave`` exports a
plain model from the quantized one, and the strategies that cannot hold a quantized base are refused at setup.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_peft.callbacks import LoRA, MergeOnSave, MultiLoRA, load_from_checkpoint
from lightning_peft.callbacks._quantize import check_quantized_strategy
from lightning_peft.peft import adapter_state_dict
from lightning_peft.peft._common import dense_weight
from lightning_peft.peft.quantize import quantized_layers
from tests._models import LORA_ARGS, Classifier, bert_config, loader
from tests._models import trainer as quiet_trainer

pytest.importorskip("torchao")
pytest.importorskip("transformers")


def fit(root, epochs, ckpt_path=None, extra=(), adapter_only=True):
    torch.manual_seed(0)
    module = Classifier(bert_config())
    callbacks = [LoRA(**LORA_ARGS, quantize="nf4", adapter_only_checkpoint=adapter_only), *extra,
                 ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)]
    quiet_trainer(root, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=True).fit(
        module, loader(), ckpt_path=ckpt_path)
    return module


def values(module) -> dict[str, torch.Tensor]:
    return {k: dense_weight(v) for k, v in module.state_dict().items()}


@pytest.mark.parametrize("adapter_only", [True, False], ids=["adapter_only", "full"])
def test_a_resume_equals_the_straight_run_and_load_from_checkpoint_rebuilds_it(tmp_path, adapter_only):
    """Adapter-only: the quantized base is left out and built again. Full: it is saved as its inner plain tensors
    (``<key>.quantized.<inner>``), since Lightning loads with a callable ``map_location``, which torch refuses for
    tensor subclasses: before, such a checkpoint could be written but neither resumed from nor loaded."""
    straight = fit(tmp_path / "straight", 2, extra=[MergeOnSave(dirpath=str(tmp_path / "export"))],
                   adapter_only=adapter_only)
    assert sorted(quantized_layers(straight.model)) == [f"bert.encoder.layer.{i}.attention.self.{n}.base_layer"
                                                        for i in (0, 1) for n in ("query", "value")]
    saved = torch.load(tmp_path / "straight" / "epoch=0.ckpt", weights_only=True)
    if adapter_only:
        assert set(saved["state_dict"]) == {f"model.{k}" for k in adapter_state_dict(straight.model)}  # no base
    else:
        assert all(type(v) is torch.Tensor for v in saved["state_dict"].values())  # no tensor subclass
        key = "model.bert.encoder.layer.0.attention.self.query.base_layer.weight"
        assert key not in saved["state_dict"]
        assert saved["state_dict"][f"{key}.quantized.quantized_data"].dtype == torch.uint8  # 4 bits a value
    resumed = fit(tmp_path / "resumed", 2, ckpt_path=tmp_path / "straight" / "epoch=0.ckpt",
                  adapter_only=adapter_only)
    reference, again = values(straight), values(resumed)
    assert reference.keys() == again.keys() and all(torch.equal(again[k], v) for k, v in reference.items())
    torch.manual_seed(0)  # the frozen base comes from the module as built, quantized again
    loaded = load_from_checkpoint(Classifier, tmp_path / "straight" / "epoch=1.ckpt", config=bert_config())
    ids = torch.randint(0, 64, (2, 8))
    straight.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, straight.model(input_ids=ids).logits)
    merged = load_file(tmp_path / "export" / "merged" / "model.safetensors")  # a plain float32 model
    key = "bert.encoder.layer.0.attention.self.query.weight"
    layer = straight.model.bert.encoder.layer[0].attention.self.query
    assert merged[key].dtype == torch.float32 and torch.equal(merged[key], layer.merged_weight())


def test_strategies_that_cannot_hold_a_quantized_base_are_refused_naming_both():
    from lightning_peft.strategies import ZeROStrategy

    with pytest.raises(RuntimeError, match=r"LoRA\(quantize='nf4'\) under ZeROStrategy\(stage=2, "
                                           r"backend='deepspeed'\): DeepSpeed flattens and partitions every parameter "
                                           r"as a plain tensor.*Train with quantize=None under it"):
        check_quantized_strategy("LoRA", "nf4", ZeROStrategy(stage=2))
    with pytest.raises(ValueError, match=r"MultiLoRA\(adapters\['a'\]\): quantize is shared by every adapter; set "
                                         r"MultiLoRA\(quantize=\.\.\.\)"):
        MultiLoRA(adapters={"a": {"quantize": "nf4"}})
    assert all(c.quantize == "int8" for c in MultiLoRA(adapters={"a": {}, "b": {}}, quantize="int8").configs.values())
    with pytest.raises(ValueError, match=r"LoRA\(quantize='int4'\): quantize must be one of 'nf4', 'int8'"):
        LoRA(quantize="int4")
