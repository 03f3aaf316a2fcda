"""GradientNoise under a real Trainer: once per optimizer step, equal to the pure function in a plain loop, resumable."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_peft.callbacks import GradientNoise, LoRA
from lightning_peft.peft import adapter_state_dict
from lightning_peft.training import add_gradient_noise, parameter_generator

from tests._models import LORA_ARGS, Classifier, loader, trainer


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
        for index, param in enumerate(params):  # each parameter its own draw (a pipeline stage holds only some)
            add_gradient_noise([param], step, 0.3, generator=parameter_generator(7, step, index))
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
    with pytest.raises(ValueError, match=r"GradientNoise: the checkpoint was trained with eta=0\.3; this run has "
                                         r"eta=0\.01\. Resume with the checkpoint's settings"):
        fit(tiny_bert_config, tmp_path / "again", 2, GradientNoise(eta=0.01), ckpt_path=tmp_path / "first" / "epoch=0.ckpt")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"eta": -1.0}, ValueError, r"GradientNoise\(eta=-1\.0\): eta must be a finite number > 0"),
    ({"gamma": -0.5}, ValueError, r"GradientNoise\(gamma=-0\.5\): gamma must be a finite number >= 0"),
    ({"seed": "0"}, TypeError, r"GradientNoise\(seed='0'\): seed must be an integer"),
])
def test_bad_settings_fail_when_the_callback_is_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientNoise(**kwargs)


class Fused(Classifier):
    def __init__(self, config, fused: bool):
        super().__init__(config, lr=0.01)
        self.fused = fused

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, fused=self.fused)


def scaled_fit(config, tmp_path, fused: bool, eta: float):
    """3 steps under an explicit CPU GradScaler (Lightning's own 16-mixed on the CPU is bf16, without a scaler)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    torch.manual_seed(0)
    module = Fused(config, fused)
    record = RecordStart()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))
    trainer(tmp_path, max_steps=3, plugins=[plugin],
            callbacks=[LoRA(**LORA_ARGS), GradientNoise(eta=eta, seed=7), record]).fit(module, loader())
    return module, record.state, plugin.scaler.get_scale()


def test_under_a_grad_scaler_the_noise_is_added_unscaled_also_when_the_optimizer_unscales(tiny_bert_config, tmp_path):
    """Lightning unscales before ``on_before_optimizer_step``, except for an optimizer that unscales inside its step
    (``fused=True``): there the gradients still carry the scale, and noise added as is would shrink by it (2^12).
    Both equal a plain loop that adds the noise to the unscaled gradients."""
    unfused, start, scale = scaled_fit(tiny_bert_config, tmp_path / "unfused", fused=False, eta=0.3)
    fused, _, _ = scaled_fit(tiny_bert_config, tmp_path / "fused", fused=True, eta=0.3)
    assert scale == 2.0**12  # no step was skipped: the scale never moved

    from transformers import BertForSequenceClassification

    from lightning_peft.peft import inject_lora

    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config)
    inject_lora(model, **LORA_ARGS)
    model.load_state_dict(start, strict=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    model.train()
    for step, (ids, labels) in zip(range(3), loader()):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=labels).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for index, param in enumerate(params):  # each parameter its own draw (a pipeline stage holds only some)
            add_gradient_noise([param], step, 0.3, generator=parameter_generator(7, step, index))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    plain = adapter_state_dict(model)
    for module in (unfused, fused):
        ours = adapter_state_dict(module.model)
        for key in plain:
            torch.testing.assert_close(ours[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)


class Probe(Callback):
    """Reads the (DeepSpeed-held) gradients at ``on_before_optimizer_step``; one before GradientNoise and one after
    it bracket what the noise added."""

    def __init__(self, records: list) -> None:
        self.records = records

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning_peft._grads import local_grad

        engine = trainer.strategy.model
        boundary = engine.is_gradient_accumulation_boundary()
        grads = ([local_grad(p).clone() for p in pl_module.parameters() if p.requires_grad] if boundary else None)
        self.records.append((trainer.global_step, boundary, grads))


@pytest.mark.slow
def test_under_deepspeed_the_noise_goes_in_once_per_optimizer_step_onto_the_gradient_it_steps_with(
        tiny_bert_config, tmp_path):
    """Lightning decides the accumulation windows under ``ZeROStrategy`` too, so ``on_before_optimizer_step`` runs
    once per optimizer step, at the engine's accumulation boundary, after its reduction; the noise goes onto the
    partitioned gradient the engine steps with (``p.grad`` is None at stage 2: it used to add nothing, and log as if
    it had)."""
    pytest.importorskip("deepspeed")
    from lightning_peft.strategies import ZeROStrategy
    from lightning_peft.training import noise_variance

    before, after = [], []
    torch.manual_seed(0)
    module = Classifier(tiny_bert_config, lr=0.01)
    trainer(tmp_path, max_steps=2, accumulate_grad_batches=2, strategy=ZeROStrategy(stage=2),
            callbacks=[LoRA(**LORA_ARGS), Probe(before), GradientNoise(eta=0.3, seed=7), Probe(after)]).fit(
        module, loader())
    assert [(step, boundary) for step, boundary, _ in before] == [(0, True), (1, True)]
    for (step, boundary, grads), (_, _, noised) in zip(before, after):
        if not boundary:
            continue
        std = noise_variance(step, 0.3) ** 0.5
        shapes = [p.shape for p in module.parameters() if p.requires_grad]
        assert len(grads) == len(shapes) and all(g.shape == s for g, s in zip(grads, shapes))  # full gradients
        for index, (grad, new, shape) in enumerate(zip(grads, noised, shapes)):
            noise = torch.randn(shape, generator=parameter_generator(7, step, index))
            torch.testing.assert_close(new - grad, std * noise, rtol=0, atol=1e-5)


def test_deepspeed_fp16_is_refused_at_setup():
    """DeepSpeed's fp16 keeps loss-scaled gradients until its step. fp16 does not run on CPUs (ZeROStrategy refuses
    it there before any callback's setup), so this checks the callback's own refusal on the strategy as configured."""
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    from lightning_peft.strategies import ZeROStrategy

    strategy = ZeROStrategy(stage=2)
    strategy.precision_plugin = DeepSpeedPrecision("16-mixed")
    with pytest.raises(RuntimeError, match=r"GradientNoise under ZeROStrategy\(stage=2, backend='deepspeed'\): "
                                           r"DeepSpeed's fp16 keeps the gradients multiplied by its dynamic loss scale .*"
                                           r"untested.*Use precision='bf16-mixed' or '32-true' with DeepSpeed"):
        GradientNoise().setup(SimpleNamespace(strategy=strategy), None, "fit")
    strategy.precision_plugin = DeepSpeedPrecision("bf16-mixed")
    GradientNoise().setup(SimpleNamespace(strategy=strategy, callbacks=[]), None, "fit")  # no loss scale: accepted
