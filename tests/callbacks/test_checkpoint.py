"""Checkpoints with adapters: load_from_checkpoint, resume checks, adapter-only edge cases, model resolution."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from safetensors.torch import load_file
from torch import nn
from torch.testing import assert_close

from lightning_peft.callbacks import LoRA, MergeOnSave, load_from_checkpoint
from lightning_peft.peft import adapter_state_dict, inject_lora
from lightning_peft.peft.lora import lora_spec

from tests._models import LORA_ARGS, Classifier, bert_config, loader, trainer


def fit(module, tmp_path, callbacks, ckpt_path=None, **kwargs):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last")
    run = trainer(tmp_path, callbacks=[*callbacks, checkpoint], enable_checkpointing=True, **kwargs)
    run.fit(module, loader(), ckpt_path=ckpt_path)
    return tmp_path / "last.ckpt"


def logits(module) -> torch.Tensor:
    ids, _ = next(iter(loader()))
    module.eval()
    with torch.no_grad():
        return module.model(input_ids=ids).logits


class FreezeHeadAfterFirstStep(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.model.classifier.requires_grad_(False)


def test_adapter_only_checkpoint_keeps_a_head_frozen_after_training(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    ckpt = fit(module, tmp_path, [LoRA(**LORA_ARGS, adapter_only_checkpoint=True), FreezeHeadAfterFirstStep()],
               max_steps=2)
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    assert "model.classifier.trained_module.weight" in saved  # owned by the adapter, whatever requires_grad says
    assert set(saved) == {f"model.{k}" for k in adapter_state_dict(module.model)}


class AdaptedInInit(Classifier):
    def __init__(self, config) -> None:
        super().__init__(config)
        inject_lora(self.model, **LORA_ARGS)


def test_a_model_adapted_in_init_resumes_from_an_adapter_only_checkpoint(tiny_bert_config, tmp_path):
    torch.manual_seed(0)
    first = AdaptedInInit(tiny_bert_config)
    ckpt = fit(first, tmp_path / "a", [LoRA(**LORA_ARGS, adapter_only_checkpoint=True)], max_steps=2)
    torch.manual_seed(0)
    resumed = AdaptedInInit(tiny_bert_config)
    fit(resumed, tmp_path / "b", [LoRA(**LORA_ARGS, adapter_only_checkpoint=True)], ckpt_path=ckpt, max_steps=2)
    for key, value in adapter_state_dict(first.model).items():
        assert torch.equal(adapter_state_dict(resumed.model)[key], value), key


def test_one_callback_instance_serves_several_modules(tiny_bert_config, tmp_path):
    callback = LoRA(**LORA_ARGS, adapter_only_checkpoint=True)
    fit(Classifier(tiny_bert_config), tmp_path / "a", [callback], max_steps=1)
    second = Classifier(tiny_bert_config)
    ckpt = fit(second, tmp_path / "b", [callback], max_steps=1)
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    second.load_state_dict(state)  # strict: the frozen base is filled in for this module too


class TwoModels(pl.LightningModule):
    def __init__(self, config) -> None:
        super().__init__()
        from transformers import BertForSequenceClassification

        self.student = BertForSequenceClassification(config)
        self.teacher = BertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.student(input_ids=ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_two_hugging_face_models_are_ambiguous(tiny_bert_config, tmp_path):
    with pytest.raises(ValueError, match=r"LoRA: TwoModels holds 2 Hugging Face models \('student', 'teacher'\), so "
                                         r"which one to adapt is ambiguous\. Set LoRA\(model_attribute=\.\.\.\) to one "
                                         r"of 'student', 'teacher', or to '' for the whole LightningModule"):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS)]).fit(TwoModels(tiny_bert_config), loader())


class Nested(Classifier):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.wrapper = nn.ModuleDict({"hf": self.model})
        del self.model

    @property
    def hf(self):
        return self.wrapper["hf"]

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.hf(input_ids=ids, labels=labels).loss


def test_a_nested_hugging_face_model_is_found_and_saved_with_its_own_key_paths(tiny_bert_config, tmp_path):
    module = Nested(tiny_bert_config)
    export = MergeOnSave(dirpath=str(tmp_path / "out"))
    trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS), export]).fit(module, loader())
    assert lora_spec(module.hf) is not None
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight" in keys


class Compiled(Classifier):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = torch.compile(self.model, backend="eager")


def test_a_compiled_inner_model_exports_plain_names(tiny_bert_config, tmp_path):
    from transformers import BertForSequenceClassification

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    module = Compiled(tiny_bert_config)
    export = MergeOnSave(dirpath=str(tmp_path / "out"))
    trainer(tmp_path, max_steps=2, callbacks=[LoRA(**LORA_ARGS), export]).fit(module, loader())
    ids, _ = next(iter(loader()))
    module.eval()
    with torch.no_grad():
        expected = module.model(input_ids=ids).logits
    merged = BertForSequenceClassification.from_pretrained(tmp_path / "out" / "merged").eval()
    with torch.no_grad():
        assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    base = BertForSequenceClassification(tiny_bert_config)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
    with torch.no_grad():
        assert_close(adapted(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


class BackboneAndHead(pl.LightningModule):
    def __init__(self, config) -> None:
        super().__init__()
        from transformers import BertModel

        self.backbone = BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(config.hidden_size, 3)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return nn.functional.cross_entropy(self.head(self.backbone(input_ids=ids).last_hidden_state[:, 0]), labels)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_a_head_outside_the_hugging_face_model_is_refused_before_training(tiny_bert_config, tmp_path):
    module = BackboneAndHead(tiny_bert_config)
    run = trainer(tmp_path, max_steps=1, callbacks=[LoRA(rank=2, target_modules=["query"]),
                                                    MergeOnSave(dirpath=str(tmp_path / "out"))])
    with pytest.raises(ValueError, match=r"MergeOnSave: BackboneAndHead trains parameters outside the exported model "
                                         r"'backbone' \(head\.weight, head\.bias\); the export would leave them out\. "
                                         r"Adapt and export the whole LightningModule instead: model_attribute=''"):
        run.fit(module, loader())
    assert run.global_step == 0


def test_the_whole_lightning_module_can_be_adapted_and_exported(tiny_bert_config, tmp_path):
    from safetensors.torch import load_file

    module = BackboneAndHead(tiny_bert_config)
    callbacks = [LoRA(rank=2, target_modules=["query"], modules_to_save=["head"], model_attribute=""),
                 MergeOnSave(dirpath=str(tmp_path / "out"), model_attribute="")]
    trainer(tmp_path, max_steps=2, callbacks=callbacks).fit(module, loader())
    merged = load_file(tmp_path / "out" / "merged" / "model.safetensors")
    plain = BackboneAndHead(tiny_bert_config)
    plain.load_state_dict(merged)  # strict: the plain module's keys, the head included
    ids, _ = next(iter(loader()))
    module.eval(), plain.eval()
    with torch.no_grad():
        assert_close(plain.head(plain.backbone(input_ids=ids).last_hidden_state[:, 0]),
                     module.head(module.backbone(input_ids=ids).last_hidden_state[:, 0]), rtol=1e-6, atol=1e-6)
    adapter = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert {"base_model.model.head.weight", "base_model.model.head.bias"} <= set(adapter)


@pytest.mark.parametrize("where", ["file", "proc"])
def test_an_unwritable_export_directory_fails_before_training(tiny_bert_config, tmp_path, where):
    if where == "file":
        dirpath = tmp_path / "taken"
        dirpath.write_text("a file, not a directory")
    else:
        dirpath = "/proc/lightning-peft-cannot-write-here"  # refused even to root
    run = trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS), MergeOnSave(dirpath=str(dirpath))])
    with pytest.raises(ValueError, match=r"MergeOnSave\(dirpath='.*'\): cannot write there \(.*Error: .*\)\. Choose a "
                                         r"writable directory; checked before training"):
        run.fit(Classifier(tiny_bert_config), loader())
    assert run.global_step == 0


def test_load_from_checkpoint_accepts_a_lightning_cli_checkpoint(tiny_bert_config, tmp_path):
    # LightningCLI in subclass mode records the class path; Lightning then insists on loading that very class.
    torch.manual_seed(0)
    module = Classifier(tiny_bert_config)
    ckpt = fit(module, tmp_path, [LoRA(**LORA_ARGS, adapter_only_checkpoint=True)], max_steps=1)
    checkpoint = torch.load(ckpt, weights_only=False)
    checkpoint["hyper_parameters"] = {"config": tiny_bert_config, "_class_path": f"{__name__}.Classifier",
                                      "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    torch.save(checkpoint, ckpt)
    torch.manual_seed(0)
    loaded = load_from_checkpoint(Classifier, ckpt, weights_only=False)  # the config object is pickled
    assert type(loaded) is Classifier and "on_load_checkpoint" not in Classifier.__dict__
    assert_close(logits(loaded), logits(module), rtol=0, atol=0)


def test_testing_a_checkpoint_with_another_trainer_still_checks_the_adapter(tiny_bert_config, tmp_path):
    ckpt = fit(Classifier(tiny_bert_config), tmp_path / "a", [LoRA(**LORA_ARGS)], max_steps=1)
    module = Classifier(tiny_bert_config)
    other = {**LORA_ARGS, "alpha": 16.0}
    fit(module, tmp_path / "b", [LoRA(**other)], max_steps=1)  # the module meets a first Trainer here...
    with pytest.raises(ValueError, match=r"trained with alpha=8\.0; this run has alpha=16\.0"):
        trainer(tmp_path, callbacks=[LoRA(**other)]).test(module, loader(), ckpt_path=ckpt)  # ...and a second here


class FreezeOutsideHead(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.head.requires_grad_(False)


def test_adapter_only_checkpoint_keeps_a_head_outside_the_adapted_model(tiny_bert_config, tmp_path):
    torch.manual_seed(0)
    module = BackboneAndHead(tiny_bert_config)
    ckpt = fit(module, tmp_path, [LoRA(rank=2, target_modules=["query"], adapter_only_checkpoint=True),
                                  FreezeOutsideHead()], max_steps=2)
    checkpoint = torch.load(ckpt, weights_only=False)
    assert {"head.weight", "head.bias"} <= set(checkpoint["state_dict"])  # trained, then frozen: still kept
    assert "backbone.embeddings.word_embeddings.weight" in checkpoint["lightning_peft"]["dropped"]
    torch.manual_seed(1)  # another random head: the checkpoint must bring the trained one back
    loaded = load_from_checkpoint(BackboneAndHead, ckpt, config=tiny_bert_config)
    assert torch.equal(loaded.head.weight, module.head.weight)
    assert not torch.equal(loaded.backbone.embeddings.word_embeddings.weight,
                           module.backbone.embeddings.word_embeddings.weight)  # the base came from the new module


def test_an_adapter_only_checkpoint_says_how_to_load_it(tiny_bert_config, tmp_path):
    """Lightning's own load_from_checkpoint cannot know the adapters; the checkpoint tells a reader what to call."""
    ckpt = fit(BackboneAndHead(tiny_bert_config), tmp_path,
               [LoRA(rank=2, target_modules=["query"], adapter_only_checkpoint=True)], max_steps=1)
    record = torch.load(ckpt, weights_only=False)["lightning_peft"]
    assert "lightning_peft.callbacks.load_from_checkpoint(MyModule, path)" in record["load_with"]
    with pytest.raises(RuntimeError, match="Missing key"):  # what the record explains
        BackboneAndHead.load_from_checkpoint(ckpt, config=tiny_bert_config)
    load_from_checkpoint(BackboneAndHead, ckpt, config=tiny_bert_config)


@pytest.mark.parametrize(("how", "expected"), [
    ("empty", r"is empty \(0 bytes\), not a checkpoint: its save was cut off before it wrote anything"),
    ("truncated", r"is truncated: a checkpoint of \d+ bytes that stops before its end"),
])
def test_a_torn_checkpoint_file_is_named_with_its_cause(tiny_bert_config, tmp_path, how, expected):
    """torch says "PytorchStreamReader failed reading zip archive: failed finding central directory" or nothing."""
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": Classifier(tiny_bert_config).state_dict()}, ckpt)
    ckpt.write_bytes(b"" if how == "empty" else ckpt.read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"load_from_checkpoint: '.*last\.ckpt' {expected}.* Save the checkpoint "
                                         r"again, or use another one\."):
        load_from_checkpoint(Classifier, ckpt, config=tiny_bert_config)


@pytest.mark.parametrize("adapter_only", [True, False])
def test_a_checkpoint_of_another_model_size_names_the_tensor_both_shapes_and_the_cause(tmp_path, adapter_only):
    """The same adapter settings on a model of another hidden size: torch listed every mismatched key."""
    def lora():
        return LoRA(rank=2, target_modules=["query"], adapter_only_checkpoint=adapter_only)

    ckpt = fit(Classifier(bert_config()), tmp_path, [lora()], max_steps=1)
    wider = bert_config(hidden_size=32, intermediate_size=64)
    first = (r"model\.bert\.encoder\.layer\.0\.attention\.self\.query\.lora_A\.default\.weight' has shape \(2, 16\), "
             r"but this Classifier has \(2, 32\)" if adapter_only else  # the frozen base is not in the file
             r"model\.bert\.embeddings\.word_embeddings\.weight' has shape \(64, 16\), but this Classifier has \(64, 32\)")
    cause = (r" there \(and \d+ more tensors\): the checkpoint was written for a model of another size \(another config: "
             r"hidden size, vocabulary, number of labels, \.\.\.\)\. Build the module with the config it was trained with")
    with pytest.raises(ValueError, match=rf"LoRA: the checkpoint's '{first}{cause}"):
        fit(Classifier(wider), tmp_path / "resume", [lora()], ckpt_path=ckpt, max_steps=2)
    with pytest.raises(ValueError, match=rf"restore_adapters: the checkpoint's '{first}{cause}"):
        load_from_checkpoint(Classifier, ckpt, config=wider)


class Regression(pl.LightningModule):
    """A float64 MLP (the same base whatever the global seed) fitted to a fixed target, without dropout."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8)).double()
        with torch.no_grad():
            for param in self.net.parameters():
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) / 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05)


def _regression_data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 16, generator=generator, dtype=torch.float64)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :8].sin()), batch_size=8)


def _start_fit(tmp_path, init: str, seed: int, adapter_only: bool, ckpt_path=None) -> Regression:
    torch.manual_seed(seed)  # the global generator at injection: another one for the resumed run
    module = Regression()
    lora = LoRA(rank=2, alpha=4, target_modules=["0", "2"], init=init, model_attribute="net",
                quantize="nf4" if init == "loftq" else None, adapter_only_checkpoint=adapter_only)
    epochs = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1)  # 2 steps an epoch
    trainer(tmp_path, max_epochs=2, callbacks=[lora, epochs], enable_checkpointing=True).fit(
        module, _regression_data(), ckpt_path=ckpt_path)
    return module


@pytest.mark.parametrize(("init", "adapter_only"), [
    ("pissa_niter_2", True), ("pissa_niter_2", False), ("pissa", True), ("olora", True), ("loftq", True)])
def test_a_start_that_rewrote_the_base_resumes_to_the_straight_run(tmp_path, init, adapter_only):
    """The resumed run rebuilds the rewritten base (and the conversion's first factors) by running the start on the
    original base again, with another global seed: its model, and its converted adapter, are the straight run's."""
    from lightning_peft.peft import save_adapter
    from lightning_peft.peft._common import dense_weight

    straight = _start_fit(tmp_path / "a", init, 1, adapter_only)
    resumed = _start_fit(tmp_path / "b", init, 2, adapter_only, ckpt_path=tmp_path / "a" / "epoch=0.ckpt")
    for key, value in straight.net.state_dict().items():  # (LoftQ's NF4 base: its values)
        assert torch.equal(dense_weight(resumed.net.state_dict()[key]), dense_weight(value)), key
    if init != "loftq":  # (LoftQ has no adapter file: only its merged export represents it)
        save_adapter(straight.net, tmp_path / "straight", convert_to_lora=True)
        save_adapter(resumed.net, tmp_path / "resumed", convert_to_lora=True)
        files = [load_file(tmp_path / side / "adapter_model.safetensors") for side in ("straight", "resumed")]
        assert files[0].keys() == files[1].keys() and all(torch.equal(v, files[1][k]) for k, v in files[0].items())


@pytest.mark.parametrize(("first", "then"), [("pissa", "kaiming"), ("gaussian", "olora"), ("pissa", "pissa_niter_2")])
def test_a_resume_with_another_start_where_one_rewrites_the_base_is_refused(tmp_path, first, then):
    """The resume rebuilds the base by running its own start: another one would put the trained factors on another
    base (adapter-only) or leave the conversion's first factors wrong (full)."""
    _start_fit(tmp_path / "a", first, 1, True)
    rewrote = first if first != "gaussian" else then
    with pytest.raises(ValueError, match=rf"LoRA: the checkpoint's lora adapter on 'net' was trained with init="
                                         rf"'{first}' \(.*\); this run has init='{then}' \(.*\)\. Resume with the "
                                         r"checkpoint's settings") as caught:
        _start_fit(tmp_path / "b", then, 1, True, ckpt_path=tmp_path / "a" / "epoch=0.ckpt")
    assert (f"init='{rewrote}' (a start that rewrote the base weights: resuming rebuilds them by running that same "
            "start on the original base, so another init would put the trained factors on another base)") in str(
        caught.value)


def test_kaiming_and_gaussian_may_follow_each_other_on_resume(tmp_path):
    straight = _start_fit(tmp_path / "a", "kaiming", 1, True)
    resumed = _start_fit(tmp_path / "b", "gaussian", 2, True, ckpt_path=tmp_path / "a" / "epoch=0.ckpt")
    for key, value in straight.net.state_dict().items():
        assert torch.equal(resumed.net.state_dict()[key], value), key
