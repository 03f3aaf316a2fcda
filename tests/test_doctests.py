"""The examples in docstrings run (the cheap ones: those not marked ``doctest: +SKIP``)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["lightning_peft.peft.lora", "lightning_peft.peft.multi_lora", "lightning_peft.peft.bottleneck",
           "lightning_peft.peft.prompt_tuning", "lightning_peft.peft.prefix_tuning", "lightning_peft.modules.hf",
           "lightning_peft.data.bbc_news", "lightning_peft.data.bbc_news_lm",
           "lightning_peft.nn.attention", "lightning_peft.nn.transformer", "lightning_peft.nn.token_pruning",
           "lightning_peft.nn.moe", "lightning_peft.nn.reversible",
           "lightning_peft.callbacks.token_pruning",
           "lightning_peft.modules.blocks", "lightning_peft._pretrained",
           "lightning_peft.training.gradient_noise", "lightning_peft.training.layerwise_lr",
           "lightning_peft.training.accumulation", "lightning_peft.training.curriculum",
           "lightning_peft.strategies.device_map", "lightning_peft.strategies.pipeline",
           "lightning_peft.strategies.tensor_parallel", "lightning_peft._seams", "lightning_peft.peft.lora_config"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
