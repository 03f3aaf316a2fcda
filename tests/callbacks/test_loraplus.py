"""``LoRA(loraplus_lr_ratio=...)``: LoRA+ on the user's own optimizer (grouped by name, fused AdamW, a schedule from
``estimated_stepping_batches``), equal to a float64 AdamW reference with hand-made groups; resume; refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_peft.callbacks import LayerwiseLRDecay, LoRA
from tests._models import Classifier, loader, trainer

LORA = {"rank": 2, "alpha": 4.0, "target_modules": ["query", "value", "word_embeddings"],
        "modules_to_save": ["classifier"], "loraplus_lr_ratio": 4.0, "loraplus_lr_embedding": 3e-3}
LR = 1e-2


class ByName(Classifier):
    """Float64; the user's groups by name (decayed matrices, the rest without decay), fused AdamW and a linear
    schedule over ``estimated_stepping_batches``; ``one_cycle``: a OneCycleLR with one max_lr for every group."""

    def __init__(self, config, one_cycle: bool = False, total: int | None = None) -> None:
        super().__init__(config)
        self.model.double()
        self.one_cycle, self.total = one_cycle, total  # total: a fixed schedule length (a run cut short and resumed)

    def configure_optimizers(self):
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW([{"params": [p for n, p in named if p.ndim >= 2], "weight_decay": 0.1},
                                       {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}],
                                      lr=LR, fused=True)
        total = self.total or self.trainer.estimated_stepping_batches
        scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=total) if self.one_cycle
                     else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / (total + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Snapshot(Callback):
    """The model as training starts (adapters injected)."""

    def on_train_start(self, trainer, pl_module):
        self.model = copy.deepcopy(pl_module.model)


def _reference(model, steps: int) -> dict[str, torch.Tensor]:
    """``steps`` of float64 AdamW (the for-loop kernel) with LoRA+'s groups written out by name."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def rate(name, param):
        if "lora_embedding_" in name:
            return LORA["loraplus_lr_embedding"]
        return LR * LORA["loraplus_lr_ratio"] if "lora_B" in name or param.ndim == 1 else LR

    groups = [{"params": [p], "lr": rate(n, p), "weight_decay": 0.1 if p.ndim >= 2 else 0.0} for n, p in named]
    optimizer = torch.optim.AdamW(groups, foreach=False, fused=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / (steps + 1))
    model.train()
    for _, (ids, labels) in zip(range(steps), loader()):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {n: p.detach() for n, p in named}


def _trained(module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("model."): p.detach() for n, p in module.named_parameters() if p.requires_grad}


def test_b_factors_train_at_ratio_times_lr_as_a_float64_adamw_reference(tiny_bert_config, tmp_path):
    torch.manual_seed(0)
    module, snapshot = ByName(tiny_bert_config), Snapshot()
    trainer(tmp_path, max_steps=4, callbacks=[LoRA(**LORA), snapshot]).fit(module, loader())

    expected, ours = _reference(snapshot.model, 4), _trained(module)
    assert ours.keys() == expected.keys() and any("lora_embedding_B" in k for k in ours)
    for name in expected:
        torch.testing.assert_close(ours[name], expected[name], rtol=1e-12, atol=1e-12, msg=name)
    groups = module.trainer.optimizers[0].param_groups  # the user's 2 groups, each split; the schedule scaled all
    lrs = {(g["loraplus"]["origin"], g["loraplus"]["role"]): g["lr"] for g in groups}
    now = LR * (1 - 4 / 5)
    assert lrs == pytest.approx({(0, "A"): now, (0, "embedding"): 3e-3 * (1 - 4 / 5), (0, "B"): 4 * now,
                                 (1, "B"): 4 * now})
    assert "configure_optimizers" not in module.__dict__  # the wrapper is gone after fit


def _fit_epochs(config, tmp_path, epochs, ckpt_path=None, **settings):
    torch.manual_seed(0)
    module = ByName(config, total=8)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1)
    run = trainer(tmp_path, max_epochs=epochs, enable_checkpointing=True,
                  callbacks=[LoRA(**{**LORA, **settings}), checkpoint])
    run.fit(module, loader(), ckpt_path=ckpt_path)
    return module, run


def test_a_resumed_run_keeps_the_groups_and_equals_the_straight_run(tiny_bert_config, tmp_path):
    straight, run = _fit_epochs(tiny_bert_config, tmp_path / "straight", 2)
    _fit_epochs(tiny_bert_config, tmp_path / "first", 1)
    resumed, again = _fit_epochs(tiny_bert_config, tmp_path / "resumed", 2, tmp_path / "first" / "epoch=0.ckpt")

    for name, value in _trained(straight).items():
        assert torch.equal(_trained(resumed)[name], value), name
    assert [g["lr"] for g in again.optimizers[0].param_groups] == [g["lr"] for g in run.optimizers[0].param_groups]
    with pytest.raises(ValueError, match=r"LoRA: the checkpoint was trained with loraplus_lr_ratio=4\.0; this run has "
                                         r"loraplus_lr_ratio=8\.0"):
        _fit_epochs(tiny_bert_config, tmp_path / "other", 2, tmp_path / "first" / "epoch=0.ckpt", loraplus_lr_ratio=8.0)


def test_a_scheduler_that_sets_every_group_to_one_rate_is_refused(tiny_bert_config, tmp_path):
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match=r"LoRA\(loraplus_lr_ratio=4\.0\): at step 0, the scheduler OneCycleLR set "
                                           r"the learning rates of AdamW so that its A part .* and embedding part .* no longer "
                                           r"keep LoRA\+'s ratio\. .*for OneCycleLR pass max_lr="):
        trainer(tmp_path, max_steps=2, callbacks=[LoRA(**LORA)]).fit(ByName(tiny_bert_config, one_cycle=True), loader())


class Prebuilt(ByName):
    """An optimizer and scheduler built before the run (as LightningCLI's optimizer: and lr_scheduler: do)."""

    def configure_optimizers(self):
        return {"optimizer": self.optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(self.optimizer, 1)}


def test_what_cannot_be_regrouped_is_refused(tiny_bert_config, tmp_path):
    with pytest.raises(ValueError, match=r"LoRA\(loraplus_lr_ratio=4\.0\) and LayerwiseLRDecay both regroup"):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA), LayerwiseLRDecay()]).fit(
            ByName(tiny_bert_config), loader())

    module = Prebuilt(tiny_bert_config)
    module.optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    with pytest.raises(RuntimeError, match=r"LoRA\(loraplus_lr_ratio=4\.0\): configure_optimizers returned a SGD built "
                                           r"before the run with the scheduler StepLR .* can no longer be regrouped "
                                           r"for LoRA\+"):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA)]).fit(module, loader())

    with pytest.raises(ValueError, match=r"LoRA\(loraplus_lr_ratio=-1\): loraplus_lr_ratio must be"):
        LoRA(**{**LORA, "loraplus_lr_ratio": -1})
