"""TokenPruning under a real Trainer: installs the pruner, anneals its scale exactly, resumes exactly, logs."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_peft.callbacks.token_pruning import TokenPruning
from lightning_peft.nn.token_pruning import TokenPruner
from lightning_peft.nn.transformer import TransformerEncoder
from lightning_peft.training.token_pruning import anneal_scale

LENGTH, LAYERS = 12, 3


class TinyClassifier(pl.LightningModule):
    def __init__(self, **encoder_kwargs) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = TransformerEncoder(vocab_size=40, hidden_size=16, num_layers=LAYERS, num_heads=2, ffn_size=32,
                                          max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                                          **encoder_kwargs)
        self.head = nn.Linear(16, 3)
        self.steps_run = 0

    def forward(self, ids, mask):
        return self.head(self.encoder.pooled(self.encoder(ids, attention_mask=mask)))

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        ids, mask, labels = batch
        return nn.functional.cross_entropy(self(ids, mask), labels)

    def validation_step(self, batch, batch_idx):
        ids, mask, labels = batch
        self.log("val_loss", nn.functional.cross_entropy(self(ids, mask), labels))

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class NoEncoder(TinyClassifier):
    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.body = nn.Embedding(40, 3)
        self.steps_run = 0

    def forward(self, ids, mask):
        return self.body(ids).mean(1)


def loader(batches: int = 5, padded: bool = True, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    count = 4 * batches
    ids = torch.randint(1, 40, (count, LENGTH), generator=generator)
    lengths = torch.randint(2, LENGTH + 1, (count,), generator=generator) if padded else torch.full((count,), LENGTH)
    lengths[::4] = LENGTH
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    labels = torch.randint(0, 3, (count,), generator=generator)
    return DataLoader(TensorDataset(ids * mask, mask, labels), batch_size=4)


def trainer(tmp_path, callbacks, **kwargs) -> pl.Trainer:
    settings = {"accelerator": "cpu", "devices": 1, "max_epochs": 2, "logger": False, "enable_checkpointing": False,
                "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                "default_root_dir": tmp_path, "deterministic": True}
    return pl.Trainer(**{**settings, **kwargs}, callbacks=callbacks)


class Record(Callback):
    """After TokenPruning in the callback list: what the model ran each training batch with."""

    def __init__(self) -> None:
        self.steps, self.scales, self.ratios, self.kept = [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pruner = pl_module.encoder.token_pruner
        self.steps.append(trainer.global_step)
        self.scales.append(pruner.scale)
        self.ratios.append([pruner.keep_ratio_at(i, LAYERS) for i in range(LAYERS)])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.kept.append([c.clone() for c in pl_module.encoder.last_kept_tokens])


def test_the_scale_rises_linearly_over_the_anneal_fraction_of_the_optimizer_steps(tmp_path):
    record = Record()
    callback = TokenPruning(keep_ratio=0.5, start_layer=1, anneal_fraction=0.4)
    module = TinyClassifier()
    trainer(tmp_path, [callback, record], max_epochs=2).fit(module, loader(5))  # 10 optimizer steps
    assert callback.anneal_steps == 4.0
    assert record.steps == list(range(10))
    assert record.scales == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert record.ratios[2] == [1.0, 0.75, 0.75] and record.ratios[-1] == [1.0, 0.5, 0.5]
    assert record.kept[0] == []  # scale 0: nothing pruned, the encoder's unpruned path
    assert [int(c[0]) for c in record.kept[-1]] == [12, 6, 3]  # sample 0 is unpadded: ceil(0.5 * n) per layer
    assert module.encoder.token_pruner is callback.pruners["encoder"] and callback.scale == 1.0


def test_under_gradient_accumulation_the_scale_follows_the_optimizer_step(tmp_path):
    record = Record()
    callback = TokenPruning(keep_ratio=0.5, anneal_fraction=0.5)
    trainer(tmp_path, [callback, record], max_epochs=2, accumulate_grad_batches=2).fit(TinyClassifier(), loader(4))
    assert callback.anneal_steps == 2.0  # 2 epochs x 2 optimizer steps, half of them
    assert record.steps == [0, 0, 1, 1, 2, 2, 3, 3]
    assert record.scales == [anneal_scale(step, 2.0) for step in record.steps] == [0, 0, 0.5, 0.5, 1, 1, 1, 1]


def test_anneal_fraction_0_prunes_fully_from_the_first_step(tmp_path):
    record = Record()
    trainer(tmp_path, [TokenPruning(keep_ratio=[1.0, 0.5, 0.5], anneal_fraction=0.0), record],
            max_steps=3).fit(TinyClassifier(), loader(5))
    assert record.scales == [1.0, 1.0, 1.0] and record.ratios[0] == [1.0, 0.5, 0.5]


def fit(tmp_path, epochs, callback, ckpt_path=None, record=None):
    module = TinyClassifier()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1)
    callbacks = [callback, checkpoint, *([record] if record else [])]
    run = trainer(tmp_path, callbacks, max_epochs=epochs, enable_checkpointing=True)
    run.fit(module, loader(5), ckpt_path=ckpt_path)
    return module


def test_a_resumed_run_anneals_and_trains_exactly_as_the_straight_run(tmp_path):
    straight_record, resumed_record = Record(), Record()
    straight = fit(tmp_path / "straight", 3, TokenPruning(keep_ratio=0.5, anneal_fraction=0.6), record=straight_record)
    assert straight_record.scales == [anneal_scale(t, 9.0) for t in range(15)]  # 0.6 x 15 steps
    callback = TokenPruning(keep_ratio=0.5, anneal_fraction=0.6)
    resumed = fit(tmp_path / "resumed", 3, callback, ckpt_path=tmp_path / "straight" / "epoch=0.ckpt",
                  record=resumed_record)
    assert callback.anneal_steps == 9.0 and resumed_record.steps[0] == 5
    assert resumed_record.scales == straight_record.scales[5:]
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_the_callback_state_holds_the_settings_the_scale_and_the_annealing_length(tmp_path):
    fit(tmp_path, 1, TokenPruning(keep_ratio=[1.0, 0.5, 0.5], importance="cls", anneal_fraction=1.0))
    saved = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)["callbacks"]
    (state,) = [value for key, value in saved.items() if key.startswith("TokenPruning")]
    assert state == {"keep_ratio": [1.0, 0.5, 0.5], "start_layer": 1, "importance": "cls", "anneal_fraction": 1.0,
                     "scale": 0.8, "anneal_steps": 5.0}  # the last batch ran at step 4 of 5
    callback = TokenPruning(keep_ratio=[1.0, 0.5, 0.5], importance="cls", anneal_fraction=1.0)
    module = TinyClassifier()
    trainer(tmp_path, [callback]).test(module, loader(1), ckpt_path=tmp_path / "epoch=0.ckpt", verbose=False)
    assert callback.anneal_steps == 5.0 and module.encoder.token_pruner.scale == 0.8  # not 1.0: the scale reached


def test_the_checkpoint_keeps_the_annealing_length_when_resumed_with_more_epochs(tmp_path):
    fit(tmp_path / "first", 2, TokenPruning(keep_ratio=0.5, anneal_fraction=0.5))  # 10 steps: anneal over 5
    record = Record()
    callback = TokenPruning(keep_ratio=0.5, anneal_fraction=0.5)
    fit(tmp_path / "longer", 4, callback, ckpt_path=tmp_path / "first" / "epoch=0.ckpt", record=record)
    assert callback.anneal_steps == 5.0 and record.steps[0] == 5 and record.scales == [1.0] * 15


def test_resuming_with_other_settings_is_refused(tmp_path):
    fit(tmp_path / "first", 1, TokenPruning(keep_ratio=0.5))
    with pytest.raises(ValueError, match=r"TokenPruning: the checkpoint was trained with keep_ratio=0\.5; this run "
                                         r"has keep_ratio=0\.7\. Resume with the checkpoint's settings"):
        fit(tmp_path / "again", 2, TokenPruning(keep_ratio=0.7), ckpt_path=tmp_path / "first" / "epoch=0.ckpt")


def test_kept_token_share_is_logged_and_test_uses_the_scale_reached(tmp_path):
    callback = TokenPruning(keep_ratio=0.5, start_layer=1, anneal_fraction=0.2)
    module = TinyClassifier()
    run = trainer(tmp_path, [callback], max_epochs=1)
    run.fit(module, loader(5), val_dataloaders=loader(1, padded=False, seed=1))
    metrics = run.callback_metrics
    assert metrics["token_pruning_scale"] == 1.0
    assert metrics["val_kept_token_share"].item() == pytest.approx((12 + 6 + 3) / 36)  # unpadded: per-layer counts
    assert 0 < metrics["kept_token_share"].item() < 1
    (result,) = run.test(module, loader(2, padded=False, seed=2), verbose=False)
    assert result["test_kept_token_share"] == pytest.approx(21 / 36)
    assert module.encoder.token_pruner.scale == 1.0


def test_the_kept_share_counts_real_tokens_and_is_1_without_pruning(tmp_path):
    callback = TokenPruning(keep_ratio=0.5, anneal_fraction=0.0)
    module = TinyClassifier()
    callback.setup(None, module, "test")
    ids = torch.tensor([[5] * 12, [5] * 3 + [0] * 9])
    mask = (ids > 0).long()
    module(ids, mask)
    share, samples = callback.kept_token_share()
    # Sample 0 keeps 12, 6, 3; sample 1 keeps its 3 real tokens throughout (6 and 3 slots leave room for them).
    assert samples == 2 and share.item() == pytest.approx((12 + 6 + 3 + 3 * 3) / (3 * 15))
    callback.pruners["encoder"].scale = 0.0
    module(ids, mask)
    assert callback.kept_token_share()[0].item() == 1.0
    callback.teardown(None, module, "test")
    assert not module.encoder._forward_pre_hooks


def test_a_model_without_a_transformer_encoder_is_refused_before_training(tmp_path):
    module = NoEncoder()
    with pytest.raises(ValueError, match=r"TokenPruning: NoEncoder holds no lightning_peft\.nn\."
                                         r"TransformerEncoder, and token pruning runs inside that encoder"):
        trainer(tmp_path, [TokenPruning()]).fit(module, loader(2))
    assert module.steps_run == 0
    with pytest.raises(ValueError, match=r"TokenPruning\(model_attribute='backbone'\): TinyClassifier has no such "
                                         r"submodule\. Its children: encoder, head"):
        trainer(tmp_path, [TokenPruning(model_attribute="backbone")]).fit(TinyClassifier(), loader(2))
    with pytest.raises(ValueError, match=r"TokenPruning: TinyClassifier\.head \(Linear\) holds no"):
        trainer(tmp_path, [TokenPruning(model_attribute="head")]).fit(TinyClassifier(), loader(2))


def test_a_schedule_that_does_not_fit_the_encoder_is_refused_at_setup(tmp_path):
    module = TinyClassifier()
    with pytest.raises(ValueError, match=r"a schedule of 2 ratios for an encoder of 3 layers"):
        trainer(tmp_path, [TokenPruning(keep_ratio=[1.0, 0.5])]).fit(module, loader(2))
    assert module.steps_run == 0


def test_an_encoder_that_already_has_a_pruner_is_refused(tmp_path):
    module = TinyClassifier(token_pruner=TokenPruner(0.7))
    with pytest.raises(ValueError, match=r"TokenPruning: the TransformerEncoder at 'encoder' already has a "
                                         r"token_pruner \(keep_ratio=0\.7, start_layer=1, importance='mean', "
                                         r"scale=1\)\. Use one of the two"):
        trainer(tmp_path, [TokenPruning()]).fit(module, loader(2))


def test_the_anneal_needs_a_finite_run_length(tmp_path):
    with pytest.raises(ValueError, match=r"TokenPruning\(anneal_fraction=0\.3\): the trainer's "
                                         r"estimated_stepping_batches is inf"):
        trainer(tmp_path, [TokenPruning()], max_epochs=-1, max_steps=-1).fit(TinyClassifier(), loader(2))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"keep_ratio": 0.0}, ValueError, r"TokenPruner\(keep_ratio=0\.0\): keep_ratio must be a finite number in \(0, 1\]"),
    ({"keep_ratio": [0.5, 2.0]}, ValueError, r"keep_ratio\[1\]=2\.0\): keep_ratio\[1\] must be a finite number in \(0, 1\]"),
    ({"start_layer": -2}, ValueError, r"start_layer must be an integer >= 0"),
    ({"importance": "random"}, ValueError, r"importance must be one of 'mean', 'cls'"),
    ({"anneal_fraction": 1.5}, ValueError, r"TokenPruning\(anneal_fraction=1\.5\): anneal_fraction must be a finite number in \[0, 1\]"),
    ({"anneal_fraction": "0.3"}, TypeError, r"TokenPruning\(anneal_fraction='0\.3'\): anneal_fraction must be a finite number"),
    ({"model_attribute": 3}, TypeError, r"TokenPruning\(model_attribute=3\): give a dotted submodule path"),
])
def test_bad_settings_are_refused_when_the_callback_is_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        TokenPruning(**kwargs)
