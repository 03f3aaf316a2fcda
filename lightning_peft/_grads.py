"""Reading and changing the gradients of trainable parameters wherever a strategy keeps them.

After backward (and the data-parallel reduction) a parameter's gradient lives in one of four places:

- ``"plain"``: ``p.grad``, whole and replicated (one device, DDP, native ZeRO-1, the pipeline's stages, the device map);
- ``"dtensor"``: ``p.grad`` is a DTensor (FSDP2 = native ZeRO-2/3, tensor parallelism); each rank holds a block of
  the full gradient, located by the placements (``Shard(d)`` splits dim ``d`` as ``torch.chunk`` does, ``Replicate``
  keeps it whole);
- ``"deepspeed"``: DeepSpeed ZeRO stages 1 and 2 keep the reduced gradient in their flat partitions (``p.grad`` is
  None); ``deepspeed.utils.safe_get_full_grad`` assembles it (a collective) and ``safe_set_full_grad`` writes this
  rank's fragment back;
- ``"deepspeed3"``: DeepSpeed ZeRO stage 3 keeps a flat local partition of ``p.ds_tensor.numel()`` elements per rank
  (``safe_get_local_grad`` / ``safe_set_local_grad``): rank ``r`` of the parameter's group holds elements
  ``r * n .. (r + 1) * n`` of the flattened full gradient, the tail past ``p.ds_numel`` being padding.

Elementwise work must give each element the same value whatever the partitioning, or no sharded strategy can equal
DDP. So the caller computes a tensor of the parameter's **full** shape (`full_shape`; drawn from one generator
in one parameter order on every rank), and `local_part` cuts from it the block this rank holds, in the layout
`local_grad` returns (``(*shape)`` for plain and DeepSpeed 1-2, the DTensor's local shape, or ``(n,)`` flat
for DeepSpeed 3, padding zero). `add_to_grad` does both for the common case.

DeepSpeed is imported only when a parameter is DeepSpeed's. Pure PyTorch: no lightning import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

__all__ = ["Kind", "add_to_grad", "full_shape", "grad_kind", "local_grad", "local_part", "set_local_grad"]

Kind = Literal["plain", "dtensor", "deepspeed", "deepspeed3"]


def grad_kind(param: Tensor) -> Kind:
    """Where ``param``'s gradient lives (see the module docstring)."""
    if hasattr(param, "ds_id"):  # partitioned by DeepSpeed ZeRO-3 (deepspeed.zero.Init or the stage-3 engine)
        return "deepspeed3"
    if hasattr(param, "_hp_mapping"):  # linked to a DeepSpeed ZeRO-1/2 (or bf16) optimizer's flat partitions
        return "deepspeed"
    if _is_dtensor(param) or _is_dtensor(param.grad):
        return "dtensor"
    return "plain"


def full_shape(param: Tensor) -> torch.Size:
    """The shape of ``param`` as the model declares it, whatever this rank holds of it."""
    if hasattr(param, "ds_shape"):  # ZeRO-3 leaves an empty placeholder in param.data
        return torch.Size(param.ds_shape)
    return param.shape  # a DTensor's shape is the global one


def local_grad(param: Tensor) -> Tensor | None:
    """This rank's part of ``param``'s (reduced) gradient, or None if it has none.

    Plain and DeepSpeed stages 1-2: the whole gradient, ``(*shape)`` (DeepSpeed's is assembled by an all-reduce: every
    rank must call this for the same parameters in the same order); DTensor: the local block (``grad.to_local()``, a
    view; a ``Partial`` gradient, which tensor parallelism leaves on replicated parameters until the optimizer meets
    it, is reduced to ``Replicate`` first, as the optimizer would: a collective too); DeepSpeed stage 3: the flat local partition ``(n,)``. Change the first two in place, or write any of them
    back with `set_local_grad`.
    """
    kind = grad_kind(param)
    if kind == "plain":
        return param.grad
    if kind == "dtensor":
        if param.grad is None:
            return None
        _reduce_partial(param)
        return param.grad.to_local()
    from deepspeed.utils import safe_get_full_grad, safe_get_local_grad

    return safe_get_local_grad(param) if kind == "deepspeed3" else safe_get_full_grad(param)


def set_local_grad(param: Tensor, value: Tensor) -> None:
    """Write ``value``, in the layout `local_grad` returns, as this rank's part of ``param``'s gradient."""
    kind = grad_kind(param)
    if kind in ("plain", "dtensor"):
        if param.grad is None:
            raise RuntimeError(f"set_local_grad: the parameter of shape {tuple(full_shape(param))} has no gradient "
                               "to write into; call it after backward, for parameters that have one.")
        target = param.grad.to_local() if kind == "dtensor" else param.grad
        target.copy_(value)
        return
    from deepspeed.utils import safe_set_full_grad, safe_set_local_grad

    if kind == "deepspeed3":
        safe_set_local_grad(param, value)
    else:
        safe_set_full_grad(param, value)


def local_part(param: Tensor, full: Tensor) -> Tensor:
    """The block of ``full`` (a tensor of ``param``'s full shape) that this rank's `local_grad` holds.

    Raises:
        ValueError: If ``full`` does not have the parameter's full shape.
        RuntimeError: If the gradient is a DTensor whose placements do not locate a block of the full tensor
            (``Partial``: not reduced yet; a strided shard).
    """
    shape = full_shape(param)
    if full.shape != shape:
        raise ValueError(f"local_part: got a tensor of shape {tuple(full.shape)} for a parameter of shape "
                         f"{tuple(shape)}; pass one of the parameter's full shape.")
    kind = grad_kind(param)
    if kind in ("plain", "deepspeed"):
        return full
    if kind == "deepspeed3":
        return _partition(param, full)
    return _block(param.grad if _is_dtensor(param.grad) else param, full)


@torch.no_grad()
def add_to_grad(
    param: Tensor,
    full: Tensor | Callable[[torch.Size], Tensor],
    alpha: float = 1.0,
    who: str = "add_to_grad",
) -> bool:
    """``grad += alpha * full`` on this rank's part of ``param``'s gradient.

    Args:
        param: The parameter.
        full: A tensor of the parameter's full shape, or a function making one from that shape (called only when
            the parameter has a gradient: a generator is drawn from exactly when something is added).
        alpha: The factor on ``full``.
        who: The caller's name, for error messages.

    Returns:
        Whether there was a gradient to add to (False leaves everything as it was).

    Raises:
        TypeError: If the gradient is sparse.
    """
    grad = local_grad(param)
    if grad is None:
        return False
    if grad.is_sparse:
        raise TypeError(f"{who}: a sparse gradient cannot take a dense update; use a dense gradient.")
    if callable(full):
        full = full(full_shape(param))
    part = local_part(param, full).to(device=grad.device, dtype=grad.dtype)
    if grad_kind(param) in ("plain", "dtensor"):
        grad.add_(part, alpha=alpha)  # in place: a DTensor's local tensor is a view of its gradient
    else:
        set_local_grad(param, grad + alpha * part)
    return True


def _is_dtensor(tensor: object) -> bool:
    if tensor is None:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _reduce_partial(param: Tensor) -> None:
    """Replaces a DTensor gradient with pending sums (``Partial``) by its reduced, replicated value."""
    from torch.distributed.tensor import Replicate

    grad = param.grad
    if any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])


def _block(dtensor: Tensor, full: Tensor) -> Tensor:
    """The block of ``full`` at ``dtensor``'s local shape and global offset."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(dtensor.placements)
    odd = [p for p in placements if not (type(p) is Shard or isinstance(p, Replicate))]
    if odd:
        raise RuntimeError(
            f"local_part: a DTensor gradient placed as {placements} does not hold one block of the full tensor "
            f"({odd[0]}); only Shard(d) and Replicate placements are supported (a Partial gradient is not reduced yet)."
        )
    local_shape, offset = compute_local_shape_and_global_offset(full.shape, dtensor.device_mesh, placements)
    index = tuple(slice(start, start + size) for start, size in zip(offset, local_shape))
    return full[index]  # (*local_shape)


def _partition(param: Tensor, full: Tensor) -> Tensor:
    """DeepSpeed ZeRO-3: this rank's flat range of the flattened, zero-padded full tensor, ``(n,)``."""
    import torch.distributed as dist

    size = param.ds_tensor.numel()  # the padded partition: ds_numel rounded up to a multiple of the group size
    rank = dist.get_rank(group=getattr(param, "ds_process_group", None))
    flat = full.reshape(-1)  # (ds_numel,)
    start = size * rank
    stop = min(start + size, flat.numel())
    part = flat[start:stop] if start < flat.numel() else flat[:0]
    if part.numel() < size:  # padding: nothing to add there
        part = torch.cat([part, part.new_zeros(size - part.numel())])
    return part  # (n,)
