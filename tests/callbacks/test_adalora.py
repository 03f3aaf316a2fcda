"""The AdaLoRA callback under a real Trainer: the schedule against PEFT's AdaLoRA trained by hand on the same batches
(PEFT's documented loop: backward, step, ``update_and_allocate``, ``zero_grad``), with gradient accumulation;
``total_step`` from the trainer; the resized PEFT file; LightningCLI YAML."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.testing import assert_close

from lightning_peft.callbacks import AdaLoRA
from lightning_peft.peft import AdaLoraConfig, inject_adalora, save_adapter
from lightning_peft.peft.adapter import attached
from tests._models import Classifier, loader, trainer
from tests.callbacks import _technique as technique
from tests.peft.adalora._oracle import peft_name

peft = pytest.importorskip("peft")

ARGS = {"target_modules": ["query", "value"], "init_r": 4, "target_r": 2, "tinit": 1, "tfinal": 2, "lora_alpha": 4}


def adapted(config):
    torch.manual_seed(0)
    module = Classifier(config)
    inject_adalora(module.model, AdaLoraConfig(**ARGS))  # the callback goes on with it (its config agrees)
    return module


def peft_by_hand(config, start, epochs: int, accumulate: int, total_step: int):
    """PEFT's AdaLoRA from ``start``'s adapter values, trained in PEFT's documented loop on the same batches."""
    torch.manual_seed(0)
    theirs = peft.get_peft_model(Classifier(config).model, peft.AdaLoraConfig(
        **ARGS, total_step=total_step, modules_to_save=["classifier"]))
    params = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, p in start.model.named_parameters():
            if p.requires_grad:
                params["base_model.model." + peft_name(name)].copy_(p)
    trained = [p for p in theirs.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.05, weight_decay=0.01)
    step = 0
    for _ in range(epochs):
        for index, (ids, labels) in enumerate(loader()):
            (theirs.base_model(input_ids=ids, labels=labels).loss / accumulate).backward()  # + orth. regularisation
            if (index + 1) % accumulate == 0:
                optimizer.step()
                theirs.base_model.update_and_allocate(step)
                optimizer.zero_grad()
                step += 1
    return theirs


def test_the_schedule_under_a_trainer_equals_peft_s_loop_with_gradient_accumulation(tiny_bert_config, tmp_path):
    module = adapted(tiny_bert_config)
    start = copy.deepcopy(module)
    run = trainer(tmp_path, max_epochs=4, accumulate_grad_batches=2, callbacks=[AdaLoRA(**ARGS)])
    run.fit(module, loader())
    allocator = attached(module.model)["adalora"].allocator
    assert allocator.total_step == run.estimated_stepping_batches == 8  # total_step=None: the trainer's
    assert allocator.last_step == 7  # one allocation per optimizer step
    theirs = peft_by_hand(tiny_bert_config, start, 4, 2, 8)
    pattern = {k.replace(".default", ""): v for k, v in theirs.peft_config["default"].rank_pattern.items()}
    assert attached(module.model)["adalora"].rank_pattern() == pattern
    assert sum(sum(v) for v in pattern.values()) == 4 * 2 and len(set(map(tuple, pattern.values()))) > 1
    params = dict(theirs.named_parameters())
    for name, p in module.model.named_parameters():
        if p.requires_grad:
            assert_close(p, params["base_model.model." + peft_name(name)], rtol=1e-4, atol=1e-5, msg=name)
    save_adapter(module.model, tmp_path / "adapter")  # the allocation is in PEFT's file: factors cut to it
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["rank_pattern"] == pattern and written["total_step"] == 8


def test_total_step_is_the_fit_s_exact_step_count_under_a_changing_accumulation_schedule(tiny_bert_config, tmp_path):
    from lightning_peft.callbacks import GradientAccumulation

    callback = AdaLoRA(**ARGS)  # total_step=None: Lightning's estimate counts 12 steps (accumulation 1 throughout)
    run = trainer(tmp_path, max_epochs=3, callbacks=[callback, GradientAccumulation(schedule={0: 1, 4: 2})])
    run.fit(Classifier(tiny_bert_config), loader())
    assert run.global_step == callback.allocator.total_step == 8 and callback.allocator.last_step == 7
    pattern = callback.allocator.state_dict()["rank_pattern"]  # the final budget was reached: target_r per layer
    assert sum(sum(v) for v in pattern.values()) == 4 * ARGS["target_r"]


def test_the_callback_is_built_from_lightning_cli_yaml():
    callback = technique.from_cli_yaml(AdaLoRA, "target_modules: [query, value], init_r: 6, target_r: 2, tinit: 10, "
                                                "tfinal: 20, deltaT: 5, orth_reg_weight: 0.1, total_step: 200, "
                                                "adapter_only_checkpoint: true")
    assert callback.config == AdaLoraConfig(target_modules=["query", "value"], init_r=6, target_r=2, tinit=10,
                                            tfinal=20, deltaT=5, orth_reg_weight=0.1, total_step=200)
    assert callback.adapter_only_checkpoint


def test_a_schedule_without_a_budgeting_phase_is_refused_at_train_start(tiny_bert_config, tmp_path):
    run = trainer(tmp_path, max_epochs=1, callbacks=[AdaLoRA(target_modules=["query"], tinit=3, tfinal=1)])
    with pytest.raises(ValueError, match=r"AdaLoRA\(tinit=3, tfinal=1, total_step=4\): the schedule leaves no step"):
        run.fit(Classifier(tiny_bert_config), loader())


def test_a_resume_with_another_target_r_is_refused():
    state = AdaLoRA(**ARGS).state_dict()
    with pytest.raises(ValueError, match=r"AdaLoRA: the checkpoint was trained with target_r=2; this run has "
                                         r"target_r=3\. Resume with the checkpoint's settings"):
        AdaLoRA(**{**ARGS, "target_r": 3}).load_state_dict(state)


def test_a_strategy_that_keeps_gradients_out_of_p_grad_is_refused_at_setup(tiny_bert_config, tmp_path):
    from lightning.pytorch.strategies import ModelParallelStrategy

    run = trainer(tmp_path, max_epochs=1, callbacks=[AdaLoRA(**ARGS)],
                  strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    module = Classifier(tiny_bert_config)
    try:
        with pytest.raises(RuntimeError, match=r"AdaLoRA under ModelParallelStrategy: the rank allocation reads every "
                                               r"factor's whole gradient from p\.grad .* here they are DTensor "
                                               r"shards\. Train AdaLoRA on one device, under DDP or native ZeRO-1"):
            run.fit(module, loader())
    finally:  # the strategy started a one-rank process group before the callback's setup refused
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert not attached(module.model)  # refused before anything changed


def test_a_gradscaler_and_an_endless_run_without_total_step_are_refused(tiny_bert_config, tmp_path):
    from lightning.pytorch.plugins import MixedPrecision

    scaled = trainer(tmp_path, max_epochs=1, callbacks=[AdaLoRA(**ARGS)],
                     plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    with pytest.raises(RuntimeError, match=r"AdaLoRA under SingleDeviceStrategy: the rank allocation reads .* here a "
                                           r"GradScaler \(16-mixed\) may leave them scaled or inf\. Use "
                                           r"precision='bf16-mixed' or '32-true'"):
        scaled.fit(Classifier(tiny_bert_config), loader())
    endless = trainer(tmp_path, max_epochs=-1, max_steps=-1, limit_train_batches=None, callbacks=[AdaLoRA(**ARGS)])
    with pytest.raises(ValueError, match=r"AdaLoraConfig\(total_step=None\) and total_step=inf; give total_step"):
        endless.fit(Classifier(tiny_bert_config), loader())
