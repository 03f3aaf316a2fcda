"""Regrouping the optimizers a LightningModule builds, for callbacks that give parts of a param group their own
learning rate (``LayerwiseLRDecay``; ``LoRA(loraplus_lr_ratio=...)``).

The LightningModule's ``configure_optimizers`` is wrapped for the fit: while it runs, every param group an optimizer
receives (``Optimizer.__init__`` and ``add_param_group`` both go through ``add_param_group``) is split before the
optimizer takes it. So the user's optimizer class and arguments (also LightningCLI's ``optimizer:`` section, fused
AdamW included) build the new groups themselves, and a scheduler created next (from ``estimated_stepping_batches``,
say) sees them all. Rebuilding an optimizer after the fact would leave a scheduler already made for the old groups
with stale per-group state (``LambdaLR.lr_lambdas``, ``base_lrs``, ``OneCycleLR``'s ``max_lr``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_peft.callbacks._lightning import Patches
from lightning_peft.training.layerwise_lr import optimizers_and_schedulers

# (optimizer, group, origin: how many of the user's groups this optimizer took before) -> the groups it takes instead
Split = Callable[[Optimizer, dict[str, Any], int], list[dict[str, Any]]]


def regroup_configure_optimizers(pl_module: pl.LightningModule, patches: Patches, make_split: Callable[[], Split],
                                 who: str, what: str) -> None:
    """Wrap ``pl_module.configure_optimizers`` (in ``patches``, undone at teardown) so that each optimizer's groups
    go through ``make_split()`` (called as ``configure_optimizers`` starts). ``what`` completes "its groups can no
    longer be ..." in the refusal of an optimizer built before the run and already tied to a scheduler."""
    original = pl_module.configure_optimizers

    @functools.wraps(original)
    def configure_optimizers(*args: Any, **kwargs: Any) -> Any:
        split, add_param_group = make_split(), Optimizer.add_param_group
        origins: dict[int, int] = {}  # id(optimizer) -> how many of the user's groups it has taken

        def split_add(optimizer: Optimizer, group: dict[str, Any]) -> None:
            origin = origins.setdefault(id(optimizer), 0)
            origins[id(optimizer)] += 1
            for part in split(optimizer, group, origin):
                add_param_group(optimizer, part)

        with Patches() as class_patches:
            class_patches.set(Optimizer, "add_param_group", split_add)
            result = original(*args, **kwargs)
            _split_prebuilt(result, origins, split_add, who, what)
        return result

    # An instance attribute, undone in teardown (one LightningCLI set on the instance comes back).
    patches.set(pl_module, "configure_optimizers", configure_optimizers)


def _split_prebuilt(result: Any, origins: dict[int, int], split_add: Callable[[Optimizer, dict[str, Any]], None],
                    who: str, what: str) -> None:
    """Splits, in place, an optimizer that ``configure_optimizers`` returned but did not build.

    LightningCLI's ``optimizer:`` section builds the optimizer before the Trainer exists. With no state and no
    scheduler attached yet, its groups can still be split; a scheduler made for the old groups cannot be mended (its
    per-group state is stale), which is an error.
    """
    optimizers, schedulers = optimizers_and_schedulers(result)
    for optimizer in optimizers:
        if id(optimizer) in origins:
            continue
        users = [type(s).__name__ for s in schedulers if getattr(s, "optimizer", None) is optimizer]
        if users or optimizer.state:
            made = f"with the scheduler {', '.join(users)} " if users else "and already stepped "
            raise RuntimeError(
                f"{who}: configure_optimizers returned a {type(optimizer).__name__} built before the run {made}"
                f"(LightningCLI's optimizer: and lr_scheduler: sections do that), so its groups can no longer be "
                f"{what}. Build the optimizer and scheduler in the LightningModule's configure_optimizers "
                "(HFSequenceClassifier has one: drop the optimizer: and lr_scheduler: sections), or use the "
                "optimizer: section without a scheduler."
            )
        groups, optimizer.param_groups = optimizer.param_groups, []
        for group in groups:
            split_add(optimizer, group)
