"""ZeRO helpers without Lightning: what the ``ZeROStrategy`` backends do to optimizers, FSDP2 units, DeepSpeed's
process-wide patches and partial distributed checkpoints (`lightning_peft.strategies.zero` is the glue).

The frozen base of a PEFT model holds no gradient and no optimizer state on any backend: `drop_frozen`
removes frozen parameters from the optimizer before the engine sees it. Under FSDP2 each adapter wrapper's frozen
base is its own unit and the repeated blocks (the children of every ``nn.ModuleList``) are units holding the
adapter's parameters (`fsdp_units`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_peft.parallel.adapters import adapter_wrappers, frozen_base
from lightning_peft.parallel.checkpoint import load_optimizer_states

__all__ = ["drop_empty_groups", "drop_frozen", "fsdp_units", "load_partial", "rebind_schedulers", "restore_torch_linear",
           "skip_shared_memory_op", "zero_config_fields"]


def drop_frozen(optimizers: list[Optimizer]) -> None:
    """Remove parameters that do not train from the optimizers' groups (before any step: no state moves).

    A ``configure_optimizers`` over ``self.parameters()`` hands the frozen base of a LoRA model to the optimizer;
    ZeroRedundancyOptimizer would partition (and balance) it, DeepSpeed would flatten it.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p.requires_grad]


# A torch scheduler's lists with one entry per parameter group (LambdaLR's lr_lambdas, ReduceLROnPlateau's min_lrs,
# CyclicLR's max_lrs and momenta, every scheduler's base_lrs and _last_lr).
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs", "base_momentums", "max_momentums")


def drop_empty_groups(optimizer: Optimizer, schedulers: list[Any]) -> list[int]:
    """Remove the parameter groups that hold no parameter (after `drop_frozen`), and their entries in the per-group
    lists of ``schedulers`` (and of the schedulers they chain); returns the removed groups' indices.

    The usual weight-decay / no-decay grouping over ``named_parameters()`` leaves the no-decay group (biases and
    norms) empty under LoRA; DeepSpeed cannot partition an empty group. The other groups keep their settings, and each
    scheduler keeps driving each remaining group as before.
    """
    groups = optimizer.param_groups
    empty = [i for i, group in enumerate(groups) if not group["params"]]
    if empty:
        optimizer.param_groups = [group for i, group in enumerate(groups) if i not in empty]
        for scheduler in schedulers:
            _drop_entries(scheduler, set(empty), len(groups))
    return empty


def _drop_entries(scheduler: Any, empty: set[int], count: int) -> None:
    for name in _PER_GROUP:
        values = getattr(scheduler, name, None)
        if isinstance(values, list) and len(values) == count:
            setattr(scheduler, name, [v for i, v in enumerate(values) if i not in empty])
    for child in getattr(scheduler, "_schedulers", []):  # SequentialLR, ChainedScheduler
        _drop_entries(child, empty, count)


def zero_config_fields() -> set[str]:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = set()
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        fields.add(name)
        if field.alias:
            fields.add(field.alias)
    return fields


def restore_torch_linear() -> None:
    """DeepSpeed's ZeRO-3 replaces ``torch.nn.functional.linear`` for the whole process ("This will persist unless
    manually reset"): every later ``F.linear`` would run DeepSpeed's autograd function, which fails on the DTensors
    of a native strategy run later in the same process. Put torch's own back when the fit ends."""
    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(module, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None and torch.nn.functional.linear is not original:
        torch.nn.functional.linear = original


def skip_shared_memory_op() -> None:
    """DeepSpeed compiles a shared-memory collective (about a minute) the first time it starts on the CPU; the
    gloo collectives it falls back to are the ones the rest of torch.distributed uses."""
    import deepspeed.comm.torch  # noqa: F401  (the module whose builder is replaced)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def rebind_schedulers(scheduler: Any, wrapped: dict[int, Optimizer]) -> None:
    """Point a scheduler, and the schedulers it chains (SequentialLR, ChainedScheduler), at the new optimizer."""
    if id(getattr(scheduler, "optimizer", None)) in wrapped:
        scheduler.optimizer = wrapped[id(scheduler.optimizer)]
    for child in getattr(scheduler, "_schedulers", []):
        rebind_schedulers(child, wrapped)


def load_partial(path: Path, module: nn.Module, optimizers: list[Optimizer], state: dict[str, Any],
                  metadata: dict[str, Any]) -> dict[str, Any]:
    """Load a distributed checkpoint that holds only ``state``'s keys of the model, and the optimizer states."""
    from torch.distributed.checkpoint import load

    load({"state_dict": state}, checkpoint_id=path)
    module.load_state_dict(state, strict=False)
    load_optimizer_states(path, module, optimizers)
    return metadata


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 units below the root, innermost first: each adapter wrapper's frozen base (unless the wrapper reads
    the base weight itself: ``reads_base_weight``), then each repeated block.

    A wrapper's base (LoRA's ``base_layer``, a bottleneck's) is found through
    `adapter_wrappers`, never by a technique's class.
    """
    units: list[nn.Module] = []
    seen: set[int] = set()
    for layer in adapter_wrappers(module).values():
        if getattr(layer, "reads_base_weight", False):
            continue  # DoRA reads W outside the base's forward: the base stays in the unit around the wrapper
        base = frozen_base(layer)
        if id(base) not in seen and any(True for _ in base.parameters()):
            units.append(base)
            seen.add(id(base))
    blocks = [(name.count("."), block) for name, container in module.named_modules()
              if isinstance(container, nn.ModuleList) for block in container]
    # Deepest first: an inner block list (MoE experts in a layer, T5's layer in a block) is sharded before the
    # block around it, as fully_shard needs.
    for _, block in sorted(blocks, key=lambda item: -item[0]):
        if id(block) not in seen and any(p.numel() for p in block.parameters()):
            units.append(block)
            seen.add(id(block))
    return units
