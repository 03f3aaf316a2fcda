"""All four training-dynamics callbacks with LoRA in one Trainer: each acts, and a resumed run equals the straight
run bit for bit."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_peft.callbacks import Curriculum, GradientAccumulation, GradientNoise, LayerwiseLRDecay, LoRA
from lightning_peft.peft import adapter_state_dict

from tests._models import LORA_ARGS, Indexed, indexed_data, token_sum, trainer


class Metrics(Callback):
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def fit(config, tmp_path, epochs, ckpt_path=None):
    torch.manual_seed(0)
    module = Indexed(config)
    metrics = Metrics()
    callbacks = [
        LoRA(**LORA_ARGS),
        Curriculum(duration=4, scorer=token_sum, start_fraction=0.25, seed=1),
        GradientNoise(eta=0.01, seed=2),
        LayerwiseLRDecay(decay=0.5),
        GradientAccumulation(global_batch_size=8),  # 2 micro-batches of 4
        ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1),
        ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, every_n_train_steps=1),
        metrics,
    ]
    trainer(tmp_path, max_epochs=epochs, enable_checkpointing=True, callbacks=callbacks).fit(
        module, DataLoader(indexed_data(), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return module, metrics.logged


def test_all_four_with_lora_act_and_resume_exactly(tiny_bert_config, tmp_path):
    straight, logged = fit(tiny_bert_config, tmp_path / "straight", 2)
    assert straight.trainer.global_step == 4  # 16 samples / (4 x 2) per step, 2 epochs
    assert [entry["curriculum_fraction"] for entry in logged] == [0.25, 0.25, 0.4375, 0.4375, 0.625, 0.625, 0.8125, 0.8125]
    assert {entry["grad_accumulation"] for entry in logged if "grad_accumulation" in entry} == {2.0}
    assert logged[-1]["lr/layer.0"] == pytest.approx(0.05 * 0.25) and logged[-1]["lr/head"] == pytest.approx(0.05)
    assert logged[-1]["grad_noise_std"] == pytest.approx((0.01 / 4**0.55) ** 0.5)  # step t = 3
    easiest = set(sorted(range(16), key=lambda i: token_sum(indexed_data()[i]))[:4])
    assert set(straight.seen[0]) == set(straight.seen[1]) == easiest  # both micro-batches of step 0: the easiest 4
    fit(tiny_bert_config, tmp_path / "first", 1)
    reference = adapter_state_dict(straight.model)
    # From an epoch's end, and from inside an epoch (after step 1 of 2; the Curriculum is listed before
    # GradientAccumulation, so the count is derived inside the curriculum's loader request).
    for checkpoint, skipped in (("epoch=0.ckpt", 4), ("step=1.ckpt", 2)):
        resumed, _ = fit(tiny_bert_config, tmp_path / f"resumed-{checkpoint}", 2, ckpt_path=tmp_path / "first" / checkpoint)
        assert resumed.seen == straight.seen[skipped:], checkpoint  # the rest of the run drew the same samples
        ours = adapter_state_dict(resumed.model)
        assert ours.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(ours[key], value), (checkpoint, key)
