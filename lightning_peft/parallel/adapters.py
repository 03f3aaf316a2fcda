"""Which modules of a model are adapter wrappers: the one question parallel code asks of PEFT.

A wrapper is a module a PEFT technique put in place of a base layer; it holds that layer as ``base_layer`` (LoRA's
layers, the bottleneck adapters' wrappers). Sharding and planning code treats a wrapper through its ``base_layer``,
never through one technique's class: FSDP2 makes each wrapper's frozen base its own unit, tensor parallelism plans the
wrapper by its base's shape. The answer comes from the adapter protocol alone
(`lightning_peft.peft.adapter.wrapped_layers`, asked of every adapted module inside the model): a technique lists its
wrappers in [`wrapped`][lightning_peft.peft.Adapter.wrapped].
"""

from __future__ import annotations

from torch import nn

from lightning_peft.peft.adapter import wrapped_layers

__all__ = ["adapter_wrappers", "frozen_base"]


def adapter_wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """The adapter wrappers inside ``model`` (``model`` included), by ``model.named_modules()`` name, in that order.

    Examples:
        >>> from lightning_peft.peft import inject_lora
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> _ = inject_lora(model, rank=2, target_modules=["0"])
        >>> list(adapter_wrappers(model))
        ['0']
    """
    listed: set[int] = set()
    for module in model.modules():
        listed.update(id(layer) for layer in wrapped_layers(module).values())
    return {name: module for name, module in model.named_modules() if id(module) in listed}


def frozen_base(wrapper: nn.Module) -> nn.Module:
    """The innermost base layer of ``wrapper`` (a wrapper may wrap another: LoRA inside a bottleneck's base)."""
    base = wrapper.base_layer
    while isinstance(getattr(base, "base_layer", None), nn.Module):
        base = base.base_layer
    return base
