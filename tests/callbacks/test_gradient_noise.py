"""GradientNoise under a real Trainer: once per optimizer step, equal to the pure function in a plain loop, resumable."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_peft.callbacks import GradientNoise, LoRA
from lightning_peft.peft import adapter_state_dict
from lightning_peft.training import add_gradient_noise, step_generator

from .test_lora import LORA_ARGS, Classifier, loader, trainer


class RecordStart(Callback):
    def on_fit_start(self, trainer, pl_module):
        self.state = {k: v.clone() for k, v in adapter_state_dict(pl_module.model).items()}


def test_noise_once_per_optimizer_step_equals_the_pure_function_in_a_plain_loop(tiny_bert_config, tmp_path):
    torch.manual_seed(0)
    module = Classifier(tiny_bert_config, lr=0.01)
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    record = RecordStart()
    noise = GradientNoise(eta=0.3, seed=7)
    trainer(tmp_path, max_steps=3, accumulate_grad_batches=2, callbacks=[LoRA(**LORA_ARGS), noise, record]).fit(
        module, loader())

    from transformers import BertForSequenceClassification

    from lightning_peft.peft import inject_lora

    model = BertForSequenceClassification(tiny_bert_config)
    model.load_state_dict(base)
    inject_lora(model, **LORA_ARGS)
    model.load_state_dict(record.state, strict=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.01)
    model.train()
    batches = list(loader())
    for step in range(3):
        optimizer.zero_grad()
        for micro in range(2):  # Lightning divides each micro-batch loss by the accumulation count
            ids, labels = batches[(2 * step + micro) % len(batches)]
            (model(input_ids=ids, labels=labels).loss / 2).backward()
        add_gradient_noise(params, step, 0.3, generator=step_generator(7, step))
        optimizer.step()
    ours, plain = adapter_state_dict(module.model), adapter_state_dict(model)
    for key in plain:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-6, atol=1e-7)


def fit(config, tmp_path, epochs, noise, ckpt_path=None):
    torch.manual_seed(0)
    module = Classifier(config)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1)
    trainer(tmp_path, max_epochs=epochs, enable_checkpointing=True,
            callbacks=[LoRA(**LORA_ARGS), noise, checkpoint]).fit(module, loader(), ckpt_path=ckpt_path)
    return module


def test_a_resumed_run_draws_the_noise_of_the_straight_run(tiny_bert_config, tmp_path):
    straight = fit(tiny_bert_config, tmp_path / "straight", 2, GradientNoise(eta=0.3))
    fit(tiny_bert_config, tmp_path / "first", 1, GradientNoise(eta=0.3))
    resumed = fit(tiny_bert_config, tmp_path / "resumed", 2, GradientNoise(eta=0.3),
                  ckpt_path=tmp_path / "first" / "epoch=0.ckpt")
    for key, value in adapter_state_dict(straight.model).items():
        assert torch.equal(adapter_state_dict(resumed.model)[key], value), key
    quiet = fit(tiny_bert_config, tmp_path / "quiet", 2, GradientNoise(eta=1e-12))
    assert not torch.equal(adapter_state_dict(quiet.model)["classifier.trained_module.weight"],
                           adapter_state_dict(straight.model)["classifier.trained_module.weight"])  # noise acted


def test_resuming_with_other_noise_settings_is_refused(tiny_bert_config, tmp_path):
    fit(tiny_bert_config, tmp_path / "first", 1, GradientNoise(eta=0.3))
    with pytest.raises(ValueError, match=r"GradientNoise: the checkpoint was trained with \{'eta': 0\.3, 'gamma': 0\.55, "
                                         r"'seed': 0\}; this run has \{'eta': 0\.01, "):
        fit(tiny_bert_config, tmp_path / "again", 2, GradientNoise(eta=0.01), ckpt_path=tmp_path / "first" / "epoch=0.ckpt")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"eta": -1.0}, ValueError, r"GradientNoise\(eta=-1\.0\): eta must be a positive, finite number"),
    ({"gamma": -0.5}, ValueError, r"GradientNoise\(gamma=-0\.5\): gamma must be a finite number >= 0"),
    ({"seed": "0"}, TypeError, r"GradientNoise\(seed='0'\): seed must be an integer"),
])
def test_bad_settings_fail_when_the_callback_is_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientNoise(**kwargs)
