"""The ActivationCheckpointing callback: a fit with it equals one without (LoRA injected before or after it, dropout
on), the blocks are checkpointed during the fit and given back after it; resume and load_from_checkpoint are
unaffected; bad selections and prefix tuning are refused at setup. Under DDP and FSDP2: one 2-process launch."""

from __future__ import annotations


import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_peft.callbacks import ActivationCheckpointing, LoRA, PrefixTuning, load_from_checkpoint
from lightning_peft.nn import checkpointed_modules
from tests._models import LORA_ARGS, Classifier, ResumableLoader, bert_config, dataset, trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
DROPOUT = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}


class Probe(Callback):
    """Which modules are checkpointed when training starts."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen = list(checkpointed_modules(pl_module))


def fit(tmp_path, callbacks, **kwargs):
    torch.manual_seed(0)
    module = Classifier(bert_config(**DROPOUT))
    probe = Probe()
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer(tmp_path, max_steps=2, callbacks=[*callbacks, probe], **kwargs).fit(module, ResumableLoader(dataset(), 4), ckpt_path=ckpt_path)
    return module, probe.seen


def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_a_fit_with_checkpointing_equals_one_without_in_either_order_with_lora(tmp_path):
    plain, seen = fit(tmp_path / "plain", [LoRA(**LORA_ARGS, dropout=0.1)])
    assert seen == []
    expected = weights(plain)
    layers = ["model.bert.encoder.layer.0", "model.bert.encoder.layer.1"]
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    for name, callbacks in {
        "lora-first": [LoRA(**LORA_ARGS, dropout=0.1), ActivationCheckpointing()],
        "checkpointing-first": [ActivationCheckpointing(["BertLayer"]), LoRA(**LORA_ARGS, dropout=0.1), saver],
    }.items():
        module, seen = fit(tmp_path / name, callbacks, enable_checkpointing=name != "lora-first")
        assert seen == layers, name  # checkpointed during the fit ...
        assert checkpointed_modules(module) == {}, name  # ... and given back at teardown
        got = weights(module)
        assert got.keys() == expected.keys()
        for key in expected:  # LoRA factors, the classifier, the frozen base: after 2 steps with dropout
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-7, msg=f"{name}: {key}")
    # No state of its own: the checkpoint loads into a plain module, and a resume (with the callback) equals straight.
    saved = torch.load(tmp_path / "ckpt" / "step=1.ckpt", weights_only=False)
    assert not any("Checkpointing" in key for key in saved["callbacks"])
    loaded = load_from_checkpoint(Classifier, tmp_path / "ckpt" / "step=2.ckpt", config=bert_config(**DROPOUT))
    assert checkpointed_modules(loaded) == {}
    for key, value in expected.items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=1e-7, msg=key)
    resumed, seen = fit(tmp_path / "resumed", [LoRA(**LORA_ARGS, dropout=0.1), ActivationCheckpointing()],
                        ckpt_path=tmp_path / "ckpt" / "step=1.ckpt")
    assert seen == layers
    for key, value in expected.items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=1e-7, msg=key)


def test_bad_input_is_refused_before_training(tmp_path):
    with pytest.raises(TypeError, match=r"ActivationCheckpointing\(modules='BertLayer'\): modules must be None or"):
        ActivationCheckpointing("BertLayer")
    with pytest.raises(ValueError, match=r"ActivationCheckpointing\(modules=\['BertLayr'\]\): \['BertLayr'\] matched "
                                         r"no module of Classifier .*BertLayer \(x2\).* Blocks: "
                                         r"model.bert.encoder.layer.0, model.bert.encoder.layer.1\."):
        fit(tmp_path, [ActivationCheckpointing(["BertLayr"])])
    for callbacks, message in (
        ([PrefixTuning(num_virtual_tokens=2), ActivationCheckpointing()],
         r"ActivationCheckpointing: model.lightning_peft_prefix \(PrefixEncoder\) refuses activation checkpointing: "
         "prefix tuning passes its prefix as the attention cache"),
        ([ActivationCheckpointing(), PrefixTuning(num_virtual_tokens=2)],
         r"activation checkpointing is on in BertForSequenceClassification \(bert.encoder.layer.0, "
         r"bert.encoder.layer.1, lightning_peft.nn.apply_activation_checkpointing or the ActivationCheckpointing "
         r"callback\); prefix tuning passes its prefix as the attention cache"),
    ):
        with pytest.raises(RuntimeError, match=message):
            fit(tmp_path, callbacks)


@pytest.mark.multiprocess
def test_ddp_and_fsdp2_give_the_same_weights_with_and_without_checkpointing(two_ranks):
    out = two_ranks.path("checkpointing")  # checkpointing_script.py on 2 ranks (tests/_two_ranks.py)
    for rank in (0, 1):
        result = torch.load(out / f"rank{rank}.pt")
        for strategy in ("ddp", "native3"):
            plain, checkpointed = result[f"{strategy}/plain"], result[f"{strategy}/checkpointed"]
            assert result[f"{strategy}/seen"] == ["model.bert.encoder.layer.0", "model.bert.encoder.layer.1"]
            assert plain.keys() == checkpointed.keys() and plain
            for key in plain:
                torch.testing.assert_close(checkpointed[key], plain[key], rtol=0, atol=1e-7, msg=f"{strategy}: {key}")
        for key, value in result["ddp/plain"].items():  # and the two strategies agree with each other
            torch.testing.assert_close(result["native3/plain"][key], value, rtol=1e-5, atol=1e-6, msg=key)
