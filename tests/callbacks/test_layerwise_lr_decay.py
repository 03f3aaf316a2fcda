"""LayerwiseLRDecay under a real Trainer: the user's optimizer and scheduler with decayed groups, equal to the
pure groups in a plain loop; schedulers that flatten the rates are caught; resume."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_peft.callbacks import LayerwiseLRDecay, LoRA
from lightning_peft.peft import adapter_state_dict, inject_lora
from lightning_peft.training import layerwise_lr_groups

from tests._models import LORA_ARGS, Classifier, loader, trainer

LORA_ALL = {**LORA_ARGS, "target_modules": ["query", "value", "pooler.dense"]}


def warmup(step):
    return min(1.0, (step + 1) / 3)


class Scheduled(Classifier):
    """The user's own optimizer (AdamW, weight decay 0.01) and a per-step LambdaLR."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def plain_loop(config, base: dict) -> tuple[dict, torch.optim.Optimizer]:
    """The adapter after 4 steps of the pure groups (decay 0.5) and the warm-up scheduler in a plain loop, and the
    optimizer."""
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification(config)
    model.load_state_dict(base)
    torch.manual_seed(1)
    inject_lora(model, **LORA_ALL)
    optimizer = torch.optim.AdamW(layerwise_lr_groups(model, lr=0.01, decay=0.5, weight_decay=0.01), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    model.train()
    for _, (ids, labels) in zip(range(4), loader()):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return adapter_state_dict(model), optimizer


def test_the_callback_equals_the_pure_groups_in_a_plain_loop_with_the_same_scheduler(tiny_bert_config, tmp_path):
    torch.manual_seed(0)
    module = Scheduled(tiny_bert_config, lr=0.01)
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    torch.manual_seed(1)
    trainer(tmp_path, max_steps=4, callbacks=[LoRA(**LORA_ALL), LayerwiseLRDecay(decay=0.5)]).fit(module, loader())

    (plain, optimizer), ours = plain_loop(tiny_bert_config, base), adapter_state_dict(module.model)
    assert ours.keys() == plain.keys()
    for key in plain:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-6, atol=1e-7)
    # The optimizer Lightning stepped holds the decayed groups; the learning rates were logged per depth.
    groups = module.trainer.optimizers[0].param_groups
    assert [g["names"] for g in groups] == [g["names"] for g in optimizer.param_groups]
    metrics = module.trainer.callback_metrics
    assert set(k for k in metrics if k.startswith("lr/")) == {"lr/layer.0", "lr/layer.1", "lr/head"}
    assert metrics["lr/layer.0"].item() == pytest.approx(0.01 * 0.25 * warmup(3))  # L = 2: layer 0 gets decay^2
    assert metrics["lr/head"].item() == pytest.approx(0.01 * warmup(3))
    assert "configure_optimizers" not in module.__dict__  # the wrapper is gone after fit


class OneCycle(Classifier):
    def __init__(self, config, per_group: bool):
        super().__init__(config)
        self.per_group = per_group

    def configure_optimizers(self):
        optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)
        max_lr = [g["lr"] for g in optimizer.param_groups] if self.per_group else 0.1
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=10)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_one_cycle_with_a_scalar_max_lr_is_stopped_before_the_first_step(tiny_bert_config, tmp_path):
    module = OneCycle(tiny_bert_config, per_group=False)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"LayerwiseLRDecay\(decay=0\.5\): at step 0, the scheduler OneCycleLR set the "
                                           r"learning rates of SGD so that embeddings and layer\.0 no longer differ by "
                                           r"the decay .* for OneCycleLR pass max_lr=\[group\['lr'\] for group in "
                                           r"optimizer\.param_groups\]"):
        trainer(tmp_path, max_steps=3, callbacks=[LayerwiseLRDecay(decay=0.5)]).fit(module, loader())
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # nothing trained
    assert "configure_optimizers" not in module.__dict__  # the failed fit left no wrapper behind
    trainer(tmp_path, max_steps=3, callbacks=[LayerwiseLRDecay(decay=0.5)]).fit(
        OneCycle(tiny_bert_config, per_group=True), loader())  # the per-group form works


class Flattening(torch.optim.lr_scheduler.LRScheduler):
    """The common bug: one rate for every group from step 2 on."""

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups] if self.last_epoch < 2 else [0.05] * len(self.base_lrs)


class FlatteningModule(Classifier):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": Flattening(optimizer), "interval": "step"}}


def test_a_scheduler_that_flattens_the_rates_later_is_caught_at_that_step(tiny_bert_config, tmp_path):
    fit = trainer(tmp_path, max_steps=5, callbacks=[LayerwiseLRDecay(decay=0.5)])
    with pytest.raises(RuntimeError, match=r"at step 2, the scheduler Flattening set the learning rates of SGD so that "
                                           r"embeddings and layer\.0 no longer differ"):
        fit.fit(FlatteningModule(tiny_bert_config), loader())
    assert fit.global_step == 2


def fit_epochs(config, tmp_path, epochs, decay=0.5, ckpt_path=None):
    torch.manual_seed(0)
    module = Scheduled(config)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1)
    trainer(tmp_path, max_epochs=epochs, enable_checkpointing=True,
            callbacks=[LoRA(**LORA_ARGS), LayerwiseLRDecay(decay=decay), checkpoint]).fit(module, loader(),
                                                                                           ckpt_path=ckpt_path)
    return module


def test_a_resumed_run_equals_the_straight_run_and_other_settings_are_refused(tiny_bert_config, tmp_path):
    straight = fit_epochs(tiny_bert_config, tmp_path / "straight", 2)
    fit_epochs(tiny_bert_config, tmp_path / "first", 1)
    resumed = fit_epochs(tiny_bert_config, tmp_path / "resumed", 2, ckpt_path=tmp_path / "first" / "epoch=0.ckpt")
    for key, value in adapter_state_dict(straight.model).items():
        assert torch.equal(adapter_state_dict(resumed.model)[key], value), key
    with pytest.raises(ValueError, match=r"LayerwiseLRDecay: the checkpoint was trained with decay=0\.5; this run has "
                                         r"decay=0\.8\. Resume with the checkpoint's settings"):
        fit_epochs(tiny_bert_config, tmp_path / "other", 2, decay=0.8, ckpt_path=tmp_path / "first" / "epoch=0.ckpt")


class WithTeacher(Classifier):
    """A frozen 4-layer teacher beside the 2-layer student: the student's depth must not come from the teacher."""

    def __init__(self, config):
        super().__init__(config)
        from transformers import BertForSequenceClassification

        self.teacher = BertForSequenceClassification(config.__class__(**{**config.to_dict(), "num_hidden_layers": 4}))
        self.teacher.requires_grad_(False)


def test_model_attribute_picks_the_layered_model_and_the_rest_counts_as_head(tiny_bert_config, tmp_path):
    module = WithTeacher(tiny_bert_config)
    with pytest.raises(ValueError, match=r"LayerwiseLRDecay: WithTeacher holds 2 Hugging Face models"):
        trainer(tmp_path, max_steps=1, callbacks=[LayerwiseLRDecay(decay=0.5)]).fit(module, loader())
    trainer(tmp_path, max_steps=1, callbacks=[LayerwiseLRDecay(decay=0.5, model_attribute="model")]).fit(module, loader())
    lrs = {g["names"][0]: g["lr"] for g in module.trainer.optimizers[0].param_groups}
    assert lrs["bert.embeddings.word_embeddings.weight"] == pytest.approx(0.05 * 0.5**3)  # L = 2, not 4


def cli_style(module, scheduler: bool):
    """What LightningCLI's optimizer: / lr_scheduler: sections do: build both before the Trainer exists, over every
    parameter, and set configure_optimizers on the instance to return them."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.2)
    schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, 1)] if scheduler else []

    def configure_optimizers():
        return ([optimizer], schedulers) if scheduler else optimizer

    module.configure_optimizers = configure_optimizers
    return configure_optimizers


def test_an_optimizer_built_before_the_run_is_split_and_the_instance_method_put_back(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    configure_optimizers = cli_style(module, scheduler=False)
    trainer(tmp_path, max_steps=1, callbacks=[LayerwiseLRDecay(decay=0.5)]).fit(module, loader())
    lrs = {name: g["lr"] for g in module.trainer.optimizers[0].param_groups for name in g["names"]}
    assert lrs["bert.encoder.layer.0.attention.self.query.weight"] == pytest.approx(0.2 * 0.25)
    assert lrs["classifier.weight"] == pytest.approx(0.2)
    assert module.configure_optimizers is configure_optimizers


def test_an_optimizer_built_before_the_run_with_its_scheduler_is_refused(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    cli_style(module, scheduler=True)
    with pytest.raises(RuntimeError, match=r"LayerwiseLRDecay: configure_optimizers returned a SGD built before the run "
                                           r"with the scheduler StepLR \(LightningCLI's optimizer: and lr_scheduler: "
                                           r"sections do that\).*drop the optimizer: and lr_scheduler: sections"):
        trainer(tmp_path, max_steps=1, callbacks=[LayerwiseLRDecay(decay=0.5)]).fit(module, loader())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"decay": 0}, r"LayerwiseLRDecay\(decay=0\): decay must be a finite number in \(0, 1\]"),
    ({"bias_and_norm_weight_decay": -0.1}, r"LayerwiseLRDecay\(bias_and_norm_weight_decay=-0\.1\): bias_and_norm_weight_decay must be a finite "
                                         r"number >= 0 \(or None to keep the optimizer's\)"),
])
def test_bad_settings_fail_when_the_callback_is_made(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerwiseLRDecay(**kwargs)


def test_a_layer_pattern_that_matches_nothing_fails_at_setup(tiny_bert_config, tmp_path):
    with pytest.raises(ValueError, match=r"LayerwiseLRDecay\(layer_patterns=\['\^blocks\\\\\.\(\\\\d\+\)'\]\): .*matched "
                                         r"no parameter of BertForSequenceClassification"):
        trainer(tmp_path, max_steps=1, callbacks=[LayerwiseLRDecay(layer_patterns=[r"^blocks\.(\d+)"])]).fit(
            Classifier(tiny_bert_config), loader())


def test_lora_refuses_an_optimizer_built_before_its_adapters(tiny_bert_config, tmp_path):
    """LightningCLI's optimizer: section with LoRA: the optimizer holds the frozen base only; nothing would train."""
    module = Classifier(tiny_bert_config)
    cli_style(module, scheduler=False)
    with pytest.raises(RuntimeError, match=r"LoRA: the optimizer holds none of the \d+ parameters that train "
                                           r"\(bert\.encoder\.layer\.0\.attention\.self\.query\.lora_A\.default\.weight, \.\.\.\)"
                                           r": it was built before the adapters were injected"):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS)]).fit(module, loader())


class Plateau(Classifier):
    """ReduceLROnPlateau on a metric that never improves: a cut at every step, down to min_lr."""

    def training_step(self, batch, batch_idx):
        self.log("flat", 1.0)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.1, patience=0, min_lr=1e-4)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "flat", "interval": "step"}}


def test_reduce_on_plateau_keeps_the_ratios_down_to_a_scaled_min_lr(tiny_bert_config, tmp_path):
    module = Plateau(tiny_bert_config)
    trainer(tmp_path, max_steps=6, callbacks=[LayerwiseLRDecay(decay=0.5)]).fit(module, loader())
    groups = module.trainer.optimizers[0].param_groups
    lrs = {name: g["lr"] for g in groups for name in g["names"]}
    # L = 2: embeddings x 1/8, layer 0 x 1/4, layer 1 x 1/2, head x 1; 0.1 cut to 1e-4 after three steps, then held.
    assert lrs["classifier.weight"] == pytest.approx(1e-4)
    assert lrs["bert.encoder.layer.0.output.dense.weight"] == pytest.approx(1e-4 / 4)
    assert lrs["bert.embeddings.word_embeddings.weight"] == pytest.approx(1e-4 / 8)


class Named(Classifier):
    """``AdamW(self.named_parameters())`` (torch >= 2.5), frozen base included, under a per-step LambdaLR."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.named_parameters(), lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_named_parameters_are_split_by_depth_and_keep_their_names(tiny_bert_config, tmp_path):
    """Defect 6: the (name, tensor) pairs used to reach the split as tuples ('tuple' object has no attribute
    'ndim'); they are split by depth as plain tensors are, and the optimizer keeps the names it was given."""
    torch.manual_seed(0)
    module = Named(tiny_bert_config, lr=0.01)
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    torch.manual_seed(1)
    trainer(tmp_path, max_steps=4, callbacks=[LoRA(**LORA_ALL), LayerwiseLRDecay(decay=0.5)]).fit(module, loader())

    (plain, _), ours = plain_loop(tiny_bert_config, base), adapter_state_dict(module.model)
    for key in plain:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-6, atol=1e-7)
    for group in module.trainer.optimizers[0].param_groups:
        assert group["param_names"] == [f"model.{n}" for n in group["names"]]  # the names AdamW was given
        assert any(p.requires_grad for p in group["params"])  # no group of frozen parameters only


class TwoGroupPlateau(Plateau):
    """The embeddings in a group of their own (one depth), the rest in another; a cut at every step."""

    def configure_optimizers(self):
        embeddings = list(self.model.bert.embeddings.parameters())
        rest = [p for p in self.parameters() if all(p is not e for e in embeddings)]
        optimizer = torch.optim.SGD([{"params": embeddings}, {"params": rest}], lr=0.1)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.1, patience=0, min_lr=1e-4)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "flat", "interval": "step"}}


def test_reduce_on_plateau_resumed_scales_min_lr_once(tiny_bert_config, tmp_path):
    """Suspected defect 17, confirmed: a user group at one depth (the embeddings) had its restored, already scaled
    min_lr scaled again on resume (1e-4 / 8 / 8), so the resumed run cut its rate below the straight run's."""

    def fit(epochs, path, ckpt_path=None):
        torch.manual_seed(0)
        module = TwoGroupPlateau(tiny_bert_config)
        checkpoint = ModelCheckpoint(dirpath=path, filename="{epoch}", save_top_k=-1)
        trainer(path, max_epochs=epochs, enable_checkpointing=True,
                callbacks=[LayerwiseLRDecay(decay=0.5), checkpoint]).fit(module, loader(), ckpt_path=ckpt_path)
        return module

    straight = fit(2, tmp_path / "straight")
    fit(1, tmp_path / "first")
    resumed = fit(2, tmp_path / "resumed", ckpt_path=tmp_path / "first" / "epoch=0.ckpt")
    expected = [g["lr"] for g in straight.trainer.optimizers[0].param_groups]
    assert expected[0] == pytest.approx(1e-4 / 8)  # L = 2: the embeddings' floor, scaled once
    assert [g["lr"] for g in resumed.trainer.optimizers[0].param_groups] == pytest.approx(expected, rel=1e-12)
    plateau = resumed.trainer.lr_scheduler_configs[0].scheduler
    assert plateau.min_lrs == pytest.approx(straight.trainer.lr_scheduler_configs[0].scheduler.min_lrs, rel=1e-12)
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
