"""What one rank holds, measured: bytes of parameters, gradients, optimizer state and other engine tensors.

The tensors are found, not computed from shapes: the model's parameters (a ``DTensor``'s local shard, a ZeRO-3
parameter's partition), their gradients, the optimizer's state and the master copies an engine keeps, then every
other tensor alive in the process (``gc``), each storage counted once at its allocated size. Call it on every rank
between steps (after the step for parameters and optimizer state; before it, e.g. in ``on_before_optimizer_step``,
for gradients, which engines free after the step).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["rank_bytes"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "master_weights", "other")


def rank_bytes(module: nn.Module, optimizers: Iterable[Any] = ()) -> dict[str, int]:
    """Bytes this rank holds, by category.

    ``parameters`` (the model's, local shards only), ``gradients``, ``optimizer_state`` (the optimizer's state:
    Adam's moments), ``master_weights`` (copies of the parameters an engine steps instead of the model's own:
    DeepSpeed's float32 partitions) and ``other``: every further tensor alive in the process (communication
    buckets, a batch, cached masks). The categories do not overlap, so their sum is all the tensor memory of the rank.
    """
    gc.collect()  # tensors of finished runs that only a reference cycle keeps
    seen: dict[int, tuple[str, int]] = {}

    def add(tensors: Iterable[Tensor | None], category: str) -> None:
        for tensor in tensors:
            storage = _storage(tensor)
            if storage is not None and storage.data_ptr() not in seen and storage.nbytes():
                seen[storage.data_ptr()] = (category, storage.nbytes())

    params = list(module.parameters())
    add(_local_parameters(params), "parameters")
    add((_local(p.grad) for p in params), "gradients")
    for optimizer in optimizers:
        for inner in _optimizers(optimizer):
            add((t for state in inner.state.values() for t in _tensors(state)), "optimizer_state")
            group_params = [p for g in inner.param_groups for p in g["params"]]
            add((_local(p.grad) for p in group_params), "gradients")
            add(group_params, "master_weights")  # the engine's own copies (already counted if the model's)
        add(_deepspeed_gradients(optimizer), "gradients")
    add(_live_tensors(), "other")
    totals = dict.fromkeys(CATEGORIES, 0)
    for category, size in seen.values():
        totals[category] += size
    return totals


def _storage(tensor: Tensor | None):
    if not isinstance(tensor, Tensor):
        return None
    tensor = _local(tensor)
    if tensor.device.type == "meta":
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, functional wrappers)
        return None


def _local(tensor: Tensor | None) -> Tensor | None:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _local_parameters(params: list[nn.Parameter]) -> Iterator[Tensor]:
    for p in params:
        yield _local(p)
        partition = getattr(p, "ds_tensor", None)  # DeepSpeed ZeRO-3 keeps the rank's partition here
        if partition is not None:
            yield partition


def _optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers that hold state: through Lightning's wrapper, ZeroRedundancyOptimizer, DeepSpeed."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    local = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer's local optimizer
    inner = getattr(optimizer, "optimizer", None)  # DeepSpeed's ZeRO optimizers wrap a torch optimizer
    if isinstance(local, torch.optim.Optimizer):
        yield local
    elif isinstance(inner, torch.optim.Optimizer):
        yield inner
    elif isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer


def _deepspeed_gradients(optimizer: Any) -> Iterator[Tensor]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    for name in ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
        yield from _tensors(getattr(optimizer, name, None))


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _live_tensors() -> Iterator[Tensor]:
    with warnings.catch_warnings():  # isinstance on some module-level objects warns of their deprecation
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    yield from objects


def _is_tensor(obj: object) -> bool:
    try:
        return isinstance(obj, Tensor)
    except ReferenceError:  # a dead weakref proxy
        return False
