"""The strategies a quantized frozen base (``LoRA(quantize=...)``, ``MultiLoRA(quantize=...)``) runs under, checked
at setup, and what DDP needs for it.

- One process, DDP and native ZeRO stage 1 (DDP underneath): DDP broadcasts rank 0's parameters at start through
  views of them, which torchao's int8 tensor does not implement; the quantized weights are therefore kept out of
  DDP's broadcast and sent here, inner tensor by inner tensor, from rank 0 (they hold no gradient to reduce).
- Native ZeRO stages 2/3 (FSDP2): torchao shards NF4 weights (its FSDP2 hooks); each of their inner tensors must
  divide by the shard count (`shard_problems`), else refused naming the layer;
  int8 weights are refused.
- DeepSpeed, tensor parallelism and pipelines: refused (DeepSpeed flattens and partitions parameters as plain
  tensors; the tensor-parallel plan and the pipeline split move weights as plain tensors too).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_peft._seams import data_parallel, refuse, splits_layers, strategy_family, tensor_parallel_size
from lightning_peft.peft.quantize import quantized_layers, shard_problems

_FIX = "train with quantize=None under it, or use DDP, ZeROStrategy(stage=1, backend='native') or native stage 2/3"


def check_quantized_strategy(who: str, method: str | None, strategy: Any) -> None:
    """Refuse, before injection, a strategy that cannot hold a quantized base."""
    if method is None:
        return
    whom = f"{who}(quantize={method!r})"
    if strategy_family(strategy) == "deepspeed":
        raise refuse(whom, strategy, "DeepSpeed flattens and partitions every parameter as a plain tensor, which a "
                     "quantized weight (a tensor subclass) is not", _FIX)
    if tensor_parallel_size(strategy) > 1 or splits_layers(strategy):
        raise refuse(whom, strategy, "the tensor-parallel plan and the pipeline split move base weights as plain "
                     "tensors, which a quantized weight (a tensor subclass) is not", _FIX)
    if method == "int8" and strategy_family(strategy) == "dtensor" and data_parallel(strategy)[0] > 1:
        raise refuse(whom, strategy, "FSDP2 shards every base weight, and torchao 0.18 has no FSDP2 support for its "
                     "int8 weight-only tensor", "use quantize='nf4' (torchao shards NF4 weights), or DDP")


def check_quantized_shards(who: str, model: nn.Module, strategy: Any) -> None:
    """After injection: refuse quantized weights FSDP2 cannot shard; under DDP, broadcast them from rank 0.
    ``who`` names the callback and its setting (``"LoRA(quantize='nf4')"``)."""
    layers = quantized_layers(model)
    size = data_parallel(strategy)[0]
    if not layers or size == 1:
        return
    if strategy_family(strategy) == "dtensor":
        problems = shard_problems(model, size)
        if problems:
            raise refuse(who, strategy, f"FSDP2 shards each quantized weight over {size} ranks, and "
                         f"{len(problems)} cannot be: {'; '.join(problems[:3])}", "use another number of "
                         "processes, quantize='nf4' with layers whose sizes divide, or DDP")
    elif isinstance(strategy, DDPStrategy):
        broadcast_quantized(strategy.lightning_module, layers)


def broadcast_quantized(root: nn.Module, layers: dict[str, nn.Module]) -> None:
    """Rank 0's quantized weights on every rank, and kept out of DDP's own broadcast of ``root``."""
    weights = {id(m.weight) for m in layers.values()}
    names = [n for n, p in root.named_parameters(remove_duplicate=False) if id(p) in weights]
    ignored = set(getattr(root, "_ddp_params_and_buffers_to_ignore", ()))
    root._ddp_params_and_buffers_to_ignore = sorted(ignored | set(names))
    for module in layers.values():
        inner, _ = module.weight.__tensor_flatten__()
        for key in inner:
            torch.distributed.broadcast(getattr(module.weight, key), src=0)
