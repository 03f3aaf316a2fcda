"""Full parameter values of a sharded model, for exports: ``with gathered(model, params): ...``.

Under ZeRO-3 (DeepSpeed) a parameter's ``.data`` is an empty placeholder and its values are spread over the
ranks; under FSDP2 and DTensor tensor parallelism a parameter is a ``DTensor`` holding one shard. Exports
(``MergeOnSave``, ``save_adapter``) need the full values. Inside `gathered` every chosen parameter of the
module is a plain tensor holding its full values, on every rank; on exit the sharded parameters are put back
unchanged (do not write to them inside: values written are discarded, and DeepSpeed refuses it). Only the chosen
parameters are gathered, so exporting an adapter never gathers the frozen base.

Every rank must enter the context (it runs collectives, in the same order on every rank). Parameters that are
neither partitioned nor ``DTensor`` (plain DDP, one process) are left as they are: then the context costs nothing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator

from torch import nn

__all__ = ["gathered", "reshard"]


@contextlib.contextmanager
def gathered(module: nn.Module, params: Iterable[nn.Parameter] | None = None) -> Iterator[nn.Module]:
    """Inside, the chosen parameters of ``module`` (default: all) hold their full values on every rank.

    Args:
        module: The model whose parameters to gather.
        params: The parameters to gather (a subset of ``module``'s); the others stay as they are.

    Yields:
        ``module``.
    """
    chosen = None if params is None else {id(p) for p in params}
    reshard(module)
    wanted = [p for p in module.parameters() if chosen is None or id(p) in chosen]
    with _deepspeed_gathered([p for p in wanted if hasattr(p, "ds_id")]), _dtensors_gathered(module, chosen):
        yield module


def reshard(module: nn.Module) -> None:
    """FSDP2 units left gathered (stage 2 after an evaluation forward) hold plain parameters whose state dict hooks
    would put the shards back mid-export: reshard them first, so every FSDP2 parameter is the DTensor swapped below.

    Call it on the outermost sharded module (the LightningModule, FSDP2's root unit) *before* choosing the
    parameters to gather: resharding replaces the gathered parameter objects by their DTensor shards.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


@contextlib.contextmanager
def _deepspeed_gathered(params: list[nn.Parameter]) -> Iterator[None]:
    """DeepSpeed ZeRO-3: ``GatheredParameters`` (all ranks take part; ``modifier_rank=None``: read-only)."""
    if not params:
        yield
        return
    zero = sys.modules["deepspeed"].zero  # parameters carry ds_id only once deepspeed has partitioned them
    with zero.GatheredParameters(params, modifier_rank=None):
        yield


@contextlib.contextmanager
def _dtensors_gathered(module: nn.Module, chosen: set[int] | None) -> Iterator[None]:
    """FSDP2 / tensor parallelism: swap each ``DTensor`` parameter for a plain one with its ``full_tensor()``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support has no DTensor parameters either
        yield
        return
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    full: dict[int, nn.Parameter] = {}  # a tied parameter stays one tensor
    try:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if not isinstance(param, DTensor) or (chosen is not None and id(param) not in chosen):
                    continue
                if id(param) not in full:
                    # A shard offloaded to CPU memory travels to the mesh's device for the collective.
                    mesh_device = param.device_mesh.device_type
                    local = param if param.device.type == mesh_device else param.to(mesh_device)
                    full[id(param)] = nn.Parameter(local.full_tensor().detach(), requires_grad=param.requires_grad)
                swapped.append((owner, name, param))
                owner._parameters[name] = full[id(param)]
        yield
    finally:
        for owner, name, param in reversed(swapped):
            owner._parameters[name] = param
