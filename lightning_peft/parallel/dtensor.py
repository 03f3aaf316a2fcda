"""DTensor parameters next to plain ones, without Lightning: their local shards and bytes, the global gradient norm
over both, and data parallelism over a device mesh (a replica broadcast at start, gradients averaged as DDP does).
Tensor parallelism (`lightning_peft.parallel.tensor_parallel`) and its strategy use them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["average_gradients", "broadcast_module", "clip_grad_norm", "local_parameter_bytes", "local_tensor"]


def local_parameter_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local shard only)."""
    total = 0
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Scales the gradients so that their global norm is at most ``max_norm``; returns the norm before clipping.

    The global norm of DTensor gradients (a sharded gradient's norm reduced over its shards, a replicated one's
    counted once) and plain ones, as ``torch.nn.utils.clip_grad_norm_`` computes it on an unsplit model.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    squares = []
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, dtype=torch.promote_types(grad.dtype, torch.float32))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm.square())
    total = torch.stack(squares).sum().sqrt()
    coefficient = min(1.0, float(max_norm) / (float(total) + 1e-6))
    if coefficient < 1.0:
        with torch.no_grad():
            for grad in grads:
                grad.mul_(coefficient)
    return total


def local_tensor(tensor: Tensor) -> Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def broadcast_module(module: nn.Module, mesh: Any) -> None:
    """Every data-parallel replica starts from the first one's parameters and buffers (as DDP does)."""
    group = mesh.get_group()
    source = torch.distributed.get_global_rank(group, 0)
    for tensor in [*module.parameters(), *module.buffers()]:
        torch.distributed.broadcast(local_tensor(tensor.data), src=source, group=group)


@torch.no_grad()
def average_gradients(params: Iterable[nn.Parameter], mesh: Any) -> None:
    """Averages the gradients of the trainable parameters over the data-parallel group, as DDP does.

    Every rank puts every trainable parameter into the flat buffers, in the same order: its gradient, or zeros where
    this rank's batch did not reach it (``None``: a named adapter only another replica's batch used). A presence
    mask is reduced first, so that a parameter no replica reached keeps ``None`` (an optimizer then leaves it alone,
    as under DDP) and one that some replica reached gets the average, zeros counted, on every rank.
    """
    group = mesh.get_group()
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return
    present = torch.tensor([p.grad is not None for p in trainable], dtype=torch.int32,
                           device=local_tensor(trainable[0]).device)  # NCCL reduces device tensors only
    torch.distributed.all_reduce(present, group=group)
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param, count in zip(trainable, present.tolist(), strict=True):
        if count:
            by_dtype.setdefault(param.dtype, []).append(param)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        members = by_dtype[dtype]
        flat = torch.cat([(local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))).reshape(-1)
                          for p in members])
        torch.distributed.all_reduce(flat, group=group)
        flat /= mesh.size()
        offset = 0
        for param in members:
            local = local_tensor(param)
            average = flat[offset : offset + local.numel()].view_as(local)
            offset += local.numel()
            if param.grad is not None:
                local_tensor(param.grad).copy_(average)
            elif local is param:
                param.grad = average.clone()
            else:  # a DTensor parameter: its gradient is a DTensor of the same placement
                from torch.distributed.tensor import DTensor

                param.grad = DTensor.from_local(average.clone(), param.device_mesh, param.placements,
                                                shape=param.shape, stride=param.stride(), run_check=False)
