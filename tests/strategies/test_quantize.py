"""A quantized base (``LoRA(quantize=...)``) under DDP and native ZeRO stage 3 (FSDP2) on 2 ranks equals one process.

``quantize_script.py`` runs every case on 2 ranks (the job ``quantize`` of ``tests/_two_ranks.py``); the reference
here is the pure-function path in one process: the same model, ``inject_lora(quantize=...)`` (the same adapter the
runs started from), and 5 AdamW steps on the batches of both ranks together (each rank's batch is half of it, so
DDP's mean of the two gradients is this one).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.testing import assert_close

from lightning_peft.peft import LoRAConfig, adapter_state_dict, inject_lora
from tests.strategies.zero_script import BATCH, LORA, Classifier, data

pytest.importorskip("torchao")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def results(two_ranks) -> dict:
    # quantize_script.py on 2 ranks (the job quantize of tests/_two_ranks.py)
    return torch.load(two_ranks.path("quantize") / "results.pt", weights_only=False)


@functools.cache
def one_process(method: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the adapter as training starts, after 5 steps) in one process (every case starts from the same adapter)."""
    module = Classifier(lora=False)
    inject_lora(module.model, LoRAConfig(**LORA, quantize=method))
    first = {k: v.detach().clone() for k, v in adapter_state_dict(module.model).items()}
    optimizer = module.configure_optimizers()
    ids, labels = data().tensors
    for step in range(len(ids) // (2 * BATCH)):
        batch = slice(2 * BATCH * step, 2 * BATCH * (step + 1))
        optimizer.zero_grad()
        module.model(input_ids=ids[batch], labels=labels[batch]).loss.backward()
        optimizer.step()
    return first, adapter_state_dict(module.model)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["ddp-nf4", "ddp-int8", "native3-nf4"])
def test_two_ranks_equal_one_process(results, case):
    result = results[case]
    assert "error" not in result, result.get("error")
    if result["same_base"] is not None:
        assert result["same_base"]  # rank 1 built another base; it trained on rank 0's
    first, expected = one_process(case.split("-")[1])
    assert all(torch.equal(result["first"][k], v) for k, v in first.items())  # the same start
    assert result["adapter"].keys() == expected.keys()
    for key, value in expected.items():
        assert_close(result["adapter"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert not torch.equal(result["adapter"][key], result["first"][key])  # it trained


@pytest.mark.multiprocess
def test_an_int8_base_under_fsdp2_is_refused_at_setup(results):
    assert results["native3-int8"]["error"] == (
        "LoRA(quantize='int8') under ZeROStrategy(stage=3, backend='native'): FSDP2 shards every base weight, and "
        "torchao 0.18 has no FSDP2 support for its int8 weight-only tensor. Use quantize='nf4' (torchao shards NF4 "
        "weights), or DDP.")
