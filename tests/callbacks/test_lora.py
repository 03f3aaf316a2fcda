"""The LoRA callback under a real Trainer: same result as the pure function, resume, adapter-only checkpoints."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_peft.callbacks import GradientAccumulation, LoRA
from lightning_peft.peft import LoRAConfig, adapter_state_dict, inject_lora, lora_layers
from tests._models import LORA_ARGS, Classifier, ResumableLoader, llama_model, loader, tensors, trainer


class RecordInitialAdapter(Callback):
    def on_fit_start(self, trainer, pl_module):
        self.state = {k: v.clone() for k, v in adapter_state_dict(pl_module.model).items()}


def test_callback_under_trainer_equals_pure_function_in_plain_loop(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    base_state = {k: v.clone() for k, v in module.model.state_dict().items()}
    record = RecordInitialAdapter()
    trainer(tmp_path, max_steps=6, callbacks=[LoRA(**LORA_ARGS), record]).fit(module, loader())

    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification(tiny_bert_config)
    model.load_state_dict(base_state)
    inject_lora(model, LoRAConfig(**LORA_ARGS))
    model.load_state_dict(record.state, strict=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    batches = list(loader())
    for step in range(6):
        ids, labels = batches[step % len(batches)]
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()

    ours, plain = adapter_state_dict(module.model), adapter_state_dict(model)
    assert ours.keys() == plain.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-6, atol=1e-7)
    head = "classifier.trained_module.weight"
    assert not torch.equal(ours[head], record.state[head])  # it trained


def test_injects_before_configure_optimizers_and_logs_the_report(tiny_bert_config, tmp_path, caplog):
    module = Classifier(tiny_bert_config)
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS)]).fit(module, loader())
    expected = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert module.trainable_at_configure == expected
    assert expected == 2 * 2 * (4 * 16 + 16 * 4) + (3 * 16 + 3)
    assert ("LoRA: adapted 4 modules of BertForSequenceClassification (rank 4, alpha 8.0, saving classifier in full); "
            "trainable params: 563") in caplog.text


def test_later_stages_reuse_the_adapter(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    run = trainer(tmp_path, max_steps=2, callbacks=[LoRA(**LORA_ARGS)])
    run.fit(module, loader())
    layers = lora_layers(module.model)
    run.test(module, loader())
    assert lora_layers(module.model) == layers
    assert run.callback_metrics["test_loss"].isfinite()


def test_adapter_only_loading_still_rejects_a_full_state_dict_with_a_missing_key(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS, adapter_only_checkpoint=True)]).fit(module, loader())
    state = module.state_dict()
    del state["model.bert.embeddings.word_embeddings.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"model.bert.embeddings.word_embeddings"):
        module.load_state_dict(state)
    adapter_only = {k: v for k, v in state.items() if k in {f"model.{a}" for a in adapter_state_dict(module.model)}}
    module.load_state_dict(adapter_only)  # strict, and the base comes from the model itself
    del adapter_only["model.bert.encoder.layer.1.attention.self.value.lora_B.default.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"model.bert.encoder.layer.1.attention.self"
                                           r".value.lora_B.default.weight\""):
        module.load_state_dict(adapter_only)  # only frozen parameters are filled in, never adapter weights


class ConvNet(pl.LightningModule):
    """BatchNorm statistics keep moving while the base is frozen: adapter-only checkpoints must keep them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_adapter_only_checkpoint_keeps_buffers_and_drops_only_frozen_parameters(tmp_path):
    torch.manual_seed(0)
    module = ConvNet()
    data = DataLoader(TensorDataset(torch.randn(8, 2, 4, 4), torch.randint(0, 2, (8,))), batch_size=4)
    callbacks = [LoRA(rank=2, target_modules=["0"], model_attribute="net", adapter_only_checkpoint=True),
                 ModelCheckpoint(dirpath=tmp_path, filename="last")]
    trainer(tmp_path, max_steps=2, callbacks=callbacks, enable_checkpointing=True).fit(module, data)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert set(saved) == {
        "net.0.lora_A.default.weight", "net.0.lora_B.default.weight",
        "net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked",
    }
    assert saved["net.1.num_batches_tracked"] == 2


def test_a_second_lora_config_on_an_adapted_model_is_refused(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS)]).fit(module, loader())
    with pytest.raises(RuntimeError, match=r"LoRA: BertForSequenceClassification already has a LoRA adapter with "
                                           r"another config"):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(rank=2, target_modules=["key"])]).fit(module, loader())


def test_weight_averaging_before_the_adapter_callback_is_refused_and_after_it_averages_the_adapted_model(
        tiny_bert_config, tmp_path):
    # SWA and EMA copy the model in their setup: before LoRA injected, the copy has no adapters (SWA then failed at
    # its first epoch on mismatched shapes; EMA would average another model).
    for averaging in (StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1), EMAWeightAveraging()):
        module = Classifier(tiny_bert_config)
        name = type(averaging).__name__
        with pytest.raises(RuntimeError, match=rf"LoRA: {name} comes before LoRA in Trainer\(callbacks=\[\.\.\.\]\), "
                                               rf"so it copied the model .* Put LoRA before {name}"):
            trainer(tmp_path, max_steps=1, callbacks=[averaging, LoRA(**LORA_ARGS)]).fit(module, loader())
        assert not lora_layers(module.model)  # refused before the model changed
    module = Classifier(tiny_bert_config)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    trainer(tmp_path, max_epochs=2, limit_train_batches=2, callbacks=[LoRA(**LORA_ARGS), swa]).fit(module, loader())
    assert swa.n_averaged is not None and int(swa.n_averaged) >= 1 and lora_layers(module.model)


def test_a_model_built_in_configure_model_is_named_as_the_cause(tiny_bert_config, tmp_path):
    class Late(Classifier):
        def __init__(self, config):
            super().__init__(config)
            self.config, self.model = config, None

        def configure_model(self):
            from transformers import BertForSequenceClassification

            if self.model is None:
                self.model = BertForSequenceClassification(self.config)

    with pytest.raises(ValueError, match=r"LoRA\(modules_to_save=\['classifier'\]\): .* matched no module of Late\. "
                                         r".* Note: Late overrides "
                                         r"configure_model, which Lightning calls after the callbacks' setup, where "
                                         r"LoRA adds a LoRA adapter: .* Build the model in __init__"):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS)]).fit(Late(tiny_bert_config), loader())


def test_unknown_model_attribute_is_refused(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    with pytest.raises(ValueError, match=r"LoRA\(model_attribute='backbone'\): Classifier has no such submodule\. "
                                         r"Its children: model"):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(model_attribute="backbone", **LORA_ARGS)]).fit(module, loader())


def test_static_arguments_are_checked_in_init():
    with pytest.raises(ValueError, match=r"LoRA\(rank=-1\): rank must be an integer >= 1"):
        LoRA(rank=-1)


def test_lora_bias_reaches_the_config_from_yaml_and_trains_under_the_trainer(tiny_bert_config, tmp_path):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callback", type=LoRA)
    yaml = "callback:\n  class_path: lightning_peft.callbacks.LoRA\n  init_args: {rank: 2, lora_bias: true}\n"
    callback = parser.instantiate_classes(parser.parse_string(yaml)).callback
    assert callback.config == LoRAConfig(rank=2, lora_bias=True)
    module = Classifier(tiny_bert_config)
    trainer(tmp_path, max_steps=2, callbacks=[LoRA(lora_bias=True, **LORA_ARGS)]).fit(module, loader())
    biases = [layer.lora_B["default"].bias for layer in lora_layers(module.model).values()]
    assert biases and all(b.requires_grad and b.abs().sum() > 0 for b in biases)  # trained from zero


def test_what_adapter_callback_asks_of_each_technique_s_callback_is_declared():
    """``quantize`` and ``own_dropout`` are members of `AdapterCallback` (None and 0.0 by default); the LoRA callbacks
    answer from their configs (MultiLoRA: one quantize for all, the largest dropout), BottleneckAdapters its dropout."""
    from lightning_peft.callbacks import BottleneckAdapters, MultiLoRA, PrefixTuning, PromptTuning

    def asked(callback):
        return callback.quantize, callback.own_dropout()

    assert asked(LoRA(dropout=0.1, quantize="int8")) == ("int8", 0.1)
    assert asked(MultiLoRA(adapters={"a": {"dropout": 0.1}, "b": {"dropout": 0.3}}, quantize="nf4")) == ("nf4", 0.3)
    assert asked(BottleneckAdapters(dropout=0.2)) == (None, 0.2)
    assert asked(PrefixTuning()) == asked(PromptTuning()) == (None, 0.0)


def test_peft_argument_names_on_the_callback_are_answered_with_ours():
    with pytest.raises(TypeError, match=r"LoRA\(lora_alpha=16\): lightning-peft calls this argument 'alpha'; pass "
                                        r"alpha=16 \(Hugging Face PEFT's names map as r -> rank, .*init\)\.$"):
        LoRA(lora_alpha=16)


def test_a_model_left_in_eval_mode_is_named_with_the_adapter_s_dropout(tiny_bert_config, tmp_path):
    """from_pretrained returns eval-mode models and Lightning 2.6 keeps submodules' modes: every dropout is off."""
    module = Classifier(tiny_bert_config)
    module.model.eval()  # what from_pretrained in __init__ leaves
    with pytest.warns(UserWarning, match=r"LoRA: \d+ dropout module\(s\) of BertForSequenceClassification are in eval "
                      r"mode as training starts, so it trains with them off \(LoRA's own dropout=0\.1 included\)\. "
                      r".*call self\.model\.train\(\) in your LightningModule's __init__"):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS, dropout=0.1)]).fit(module, loader())
    trained = Classifier(tiny_bert_config)  # in train mode: nothing to say
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS, dropout=0.1)]).fit(trained, loader())
    assert not [w for w in caught if "dropout module" in str(w.message)]


class WarmUp(Classifier):
    """AdamW with a linear warm-up and decay over the fit's steps, counted as users do in configure_optimizers
    (``estimated_stepping_batches``, or ``GradientAccumulation.total_steps``): asking loads the train loader before
    the checkpoint's loader position is restored."""

    def __init__(self, config, total: str) -> None:
        super().__init__(config)
        self.total = total

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        total = (GradientAccumulation.total_steps(self.trainer) if self.total == "total_steps"
                 else self.trainer.estimated_stepping_batches)
        warm_up = 3
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min((step + 1) / warm_up, (total - step) / (total - warm_up)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@pytest.mark.parametrize(("total", "accumulate"), [
    ("estimated_stepping_batches", False), ("estimated_stepping_batches", True), ("total_steps", True)])
def test_a_mid_epoch_resume_with_the_warm_up_total_equals_the_straight_run(tiny_bert_config, tmp_path, total,
                                                                             accumulate):
    def fit(root, ckpt_path=None):
        torch.manual_seed(0)
        module = WarmUp(tiny_bert_config, total)
        every_5 = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=5, save_top_k=-1)
        callbacks = [LoRA(**LORA_ARGS, dropout=0.1), every_5]  # only LoRA: it brings the resume callback
        if accumulate:
            callbacks.append(GradientAccumulation(global_batch_size=8))
        data = ResumableLoader(TensorDataset(*tensors(24)), batch_size=4)  # 6 batches an epoch
        trainer(root, max_epochs=4, callbacks=callbacks, enable_checkpointing=True).fit(module, data,
                                                                                         ckpt_path=ckpt_path)
        return adapter_state_dict(module.model)

    straight = fit(tmp_path / "straight")
    # Step 10 is mid-epoch: batch 4 of 6 of epoch 1, or micro-batch 2 of 6 of epoch 3 with 2 per step.
    resumed = fit(tmp_path / "resumed", ckpt_path=tmp_path / "straight" / "step=10.ckpt")
    assert resumed.keys() == straight.keys()
    for key in straight:
        assert torch.equal(resumed[key], straight[key]), (key, (resumed[key] - straight[key]).abs().max())


class TokenLM(pl.LightningModule):
    """A tiny tied Llama whose optimizer groups every parameter by name (decay / no decay), as recipes do: the
    trainable-token rows must reach it as trainable."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama_model(tie_word_embeddings=True)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        self.grouped = {n for n, _ in named}
        return torch.optim.AdamW([{"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
                                  {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0}], lr=0.05)


def test_trainable_token_rows_train_under_a_trainer_and_export_merged_into_the_tied_embedding(tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from lightning_peft.callbacks import MergeOnSave

    torch.manual_seed(0)
    module, ids = TokenLM(), torch.randint(0, 64, (8, 6))
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    callbacks = [LoRA(rank=2, target_modules=["q_proj"], trainable_token_indices=[3, 7]),
                 MergeOnSave(dirpath=str(tmp_path / "out"))]
    trainer(tmp_path, max_steps=3, callbacks=callbacks).fit(module, DataLoader(TensorDataset(ids), batch_size=4))
    assert "model.model.embed_tokens.token_adapter.trainable_tokens_delta.default" in module.grouped

    merged = LlamaForCausalLM.from_pretrained(tmp_path / "out" / "merged").eval()
    rows, before = merged.model.embed_tokens.weight, base["model.embed_tokens.weight"]
    others = [i for i in range(64) if i not in (3, 7)]
    assert torch.equal(rows[others], before[others]) and (rows[[3, 7]] - before[[3, 7]]).abs().amin(1).gt(0).all()
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    module.model.eval()
    with torch.no_grad():
        expected = module.model(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        plain = LlamaForCausalLM(module.model.config)
        plain.load_state_dict(base)
        loaded = PeftModel.from_pretrained(plain, tmp_path / "out" / "adapter").eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_trainable_token_indices_reach_the_callback_from_yaml():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(LoRA, "lora")
    config = parser.parse_string("lora: {target_modules: [q_proj], trainable_token_indices: {embed_tokens: [3, 7]}}")
    assert parser.instantiate(config).lora.config.trainable_token_indices == {"embed_tokens": [3, 7]}


def test_target_parameters_from_the_callback_and_a_yaml_config():
    """LightningCLI builds the callback through jsonargparse from the typed signature: target_parameters reaches the
    config, which adapts the named parameter."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(LoRA, "lora")
    parsed = parser.parse_string("lora: {rank: 2, target_modules: [], target_parameters: [lin0.weight]}")
    callback = parser.instantiate_classes(parsed).lora
    assert callback.config == LoRAConfig(rank=2, target_modules=[], target_parameters=["lin0.weight"])
    model = nn.Sequential()
    model.lin0 = nn.Linear(4, 3)
    assert list(inject_lora(model, callback.config)) == ["lin0"]
