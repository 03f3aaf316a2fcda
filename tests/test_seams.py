"""The seams contract: data-parallel size and rank, the gradient family and the refusal message, per strategy."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lightning_peft._seams import data_parallel, refuse, strategy_family
from lightning_peft.strategies import DeviceMapStrategy, PipelineStrategy, ZeROStrategy


def test_data_parallel_asks_the_strategy_not_the_world():
    assert data_parallel(SingleDeviceStrategy("cpu")) == (1, 0)
    assert data_parallel(DeviceMapStrategy(devices=["cpu", "cpu"])) == (1, 0)
    ddp = DDPStrategy(parallel_devices=[torch.device("cpu")] * 2)
    assert data_parallel(ddp) == (2, 0)  # (the 2-process runs of the matrix check rank 1)
    pipeline = PipelineStrategy(num_stages=2, num_microbatches=2)
    pipeline._global_rank, pipeline._world_size = 1, 2
    assert data_parallel(pipeline) == (1, 0)  # every stage reads the same batch


def test_data_parallel_rejects_an_inconsistent_answer():
    class Broken(SingleDeviceStrategy):
        @property
        def distributed_sampler_kwargs(self):
            return {"num_replicas": 2, "rank": 2}

    with pytest.raises(RuntimeError, match=r"Broken.distributed_sampler_kwargs = .*expected 0 <= rank < num_replicas"):
        data_parallel(Broken("cpu"))


def test_strategy_family_says_where_gradients_live():
    assert strategy_family(SingleDeviceStrategy("cpu")) == "plain"
    assert strategy_family(DDPStrategy()) == "plain"
    assert strategy_family(ZeROStrategy(stage=1, backend="native")) == "plain"
    assert strategy_family(ZeROStrategy(stage=2)) == "deepspeed"
    assert isinstance(ZeROStrategy(stage=3), DeepSpeedStrategy)
    assert strategy_family(ZeROStrategy(stage=3, backend="native")) == "dtensor"
    assert strategy_family(ModelParallelStrategy()) == "dtensor"


def test_refusal_names_callback_strategy_reason_and_fix():
    error = refuse("GradientNoise", ZeROStrategy(stage=2), "DeepSpeed fp16 scales the gradients", "use bf16-mixed")
    assert str(error) == (
        "GradientNoise under ZeROStrategy(stage=2, backend='deepspeed'): DeepSpeed fp16 scales the gradients. "
        "Use bf16-mixed."
    )
