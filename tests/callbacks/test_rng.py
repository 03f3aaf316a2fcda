"""Resume with dropout on: the random generators travel with the checkpoint (``lightning_peft.callbacks._rng``).

A tiny BERT with its own dropout (0.1) and LoRA's (0.1): a run resumed from a mid-epoch or an epoch-boundary
checkpoint ends with the same weights as the straight run, to the bit, because every rank's generators were saved
with the checkpoint and are restored before the first resumed batch.
"""

from __future__ import annotations

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_peft.callbacks import LoRA
from lightning_peft.callbacks._rng import RNGState, keep_rng
from lightning_peft.peft import adapter_state_dict
from tests._models import LORA_ARGS, Classifier, ResumableLoader, bert_config, dataset


class NumpyAndPythonDraws(Callback):
    """Draws of NumPy and Python's ``random`` mixed into the loss path (augmentation code does this)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.extra = float(np.random.rand() + random.random()) * 1e-3


class Noisy(Classifier):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + getattr(self, "extra", 0.0) * self.model.classifier.weight.sum()

    def validation_step(self, batch, batch_idx):
        ids, labels = batch
        self.log("val_loss", self.model(input_ids=ids, labels=labels).loss)


def fit(config, root, *, ckpt_path=None, max_epochs=3, extra_callbacks=()):
    torch.manual_seed(0)
    module = Noisy(config)
    steps = ModelCheckpoint(dirpath=root / "steps", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    epochs = ModelCheckpoint(dirpath=root / "epochs", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, val_check_interval=2, limit_val_batches=2,
        callbacks=[LoRA(**LORA_ARGS, dropout=0.1), NumpyAndPythonDraws(), steps, epochs, *extra_callbacks],
    )
    # Validation runs mid-epoch, after the step-2 checkpoint: its loader's seed is drawn from the global generator.
    trainer.fit(module, ResumableLoader(dataset(), batch_size=4), DataLoader(dataset(), batch_size=4),
                ckpt_path=ckpt_path)
    return module


@pytest.fixture(scope="module")
def dropout_config():
    return bert_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)  # the tiny BERT, dropout on


@pytest.fixture(scope="module")
def straight(dropout_config, tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    return fit(dropout_config, root), root


@pytest.mark.parametrize("checkpoint", [
    "steps/step=2.ckpt",  # mid-epoch 0
    "steps/step=6.ckpt",  # mid-epoch 1
    "steps/step=4.ckpt",  # after the last batch of epoch 0
    "epochs/epoch=0.ckpt",  # at the end of epoch 0, after its validation
])
def test_resumed_run_with_dropout_equals_straight_run_bit_for_bit(dropout_config, straight, tmp_path, checkpoint):
    module, root = straight
    resumed = fit(dropout_config, tmp_path, ckpt_path=root / checkpoint)
    ours, reference = adapter_state_dict(resumed.model), adapter_state_dict(module.model)
    assert ours.keys() == reference.keys()
    for key in reference:
        assert torch.equal(ours[key], reference[key]), (key, (ours[key] - reference[key]).abs().max())


def test_state_is_every_generator_and_loads_with_weights_only(tmp_path):
    state = RNGState().state_dict()
    torch.save(state, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)  # no pickled NumPy objects
    expected = (torch.rand(3), np.random.rand(3), random.random())
    from lightning_peft.callbacks._rng import _apply

    _apply(loaded["ranks"][0])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def test_a_checkpoint_from_another_number_of_processes_resumes_with_a_warning(dropout_config, straight, tmp_path):
    _, root = straight
    checkpoint = torch.load(root / "steps" / "step=2.ckpt", weights_only=False)
    ranks = checkpoint["callbacks"]["lightning_peft.RNGState"]["ranks"]
    checkpoint["callbacks"]["lightning_peft.RNGState"]["ranks"] = ranks * 2
    torch.save(checkpoint, tmp_path / "two.ckpt")
    with pytest.warns(UserWarning, match=r"RNGState: the checkpoint holds the random generators of 2 process\(es\); "
                                         r"this run has 1\. They are not restored"):
        fit(dropout_config, tmp_path / "run", ckpt_path=tmp_path / "two.ckpt", max_epochs=1)


def test_keep_rng_adds_one_state_callback_that_lightning_restores(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    first = keep_rng(trainer)
    assert keep_rng(trainer) is first
    assert sum(isinstance(c, RNGState) for c in trainer.callbacks) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generators_are_saved_and_restored(tmp_path):
    torch.cuda.init()
    torch.save(RNGState().state_dict(), tmp_path / "rng.pt")
    expected = torch.rand(4, device="cuda")
    from lightning_peft.callbacks._rng import _apply

    _apply(torch.load(tmp_path / "rng.pt", weights_only=True)["ranks"][0])
    assert torch.equal(torch.rand(4, device="cuda"), expected)
