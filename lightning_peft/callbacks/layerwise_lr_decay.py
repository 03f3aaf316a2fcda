"""``LayerwiseLRDecay`` callback: layer-wise learning-rate decay on the user's own optimizer and scheduler.

The math lives in `lightning_peft.training.layerwise_lr`. This callback wraps the LightningModule's
``configure_optimizers`` at ``setup`` (so after ``LoRA`` has frozen the base and injected adapters): while it runs,
every parameter group an optimizer receives is split by depth before the optimizer takes it, each part with the
group's learning rate times ``decay ** (L + 1 - depth)``. So the user's optimizer class and arguments (also from
LightningCLI's ``optimizer:`` section) build the decayed groups themselves, and the scheduler created next sees
them. Rebuilding an optimizer after the fact would leave any scheduler already made for the old groups with
stale per-group state (``LambdaLR.lr_lambdas``, ``base_lrs``, ``OneCycleLR``'s ``max_lr``).

A scheduler must scale each group's own learning rate. One that sets every group to one value (``OneCycleLR``
with a scalar ``max_lr``, a hand-written ``group["lr"] = ...`` loop) undoes the decay; the callback checks the
ratios before every optimizer step and stops with an error naming the scheduler the first time they break (for
``OneCycleLR``: before the first step). It logs each depth's learning rate as ``lr/embeddings``,
``lr/layer.<i>``, ``lr/head``.

YAML:

```yaml
- class_path: lightning_peft.callbacks.LayerwiseLRDecay
  init_args: {decay: 0.8}
```
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_peft._checks import real
from lightning_peft.callbacks._lightning import Patches, PatchingCallback, refuse_changed_settings
from lightning_peft.callbacks._regroup import regroup_configure_optimizers
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.training.layerwise_lr import (
    GROUP_KEY,
    broken_decay,
    check_decay,
    decayed_groups,
    layer_depths,
    scale_plateau_floors,
)

# Set on a ReduceLROnPlateau whose min_lrs the callback has scaled (saved with the scheduler's state: a resumed run
# must not scale them again).
_PLATEAU_FITTED = "_lightning_peft_llrd_fitted"


class LayerwiseLRDecay(PatchingCallback):
    """Give layer ``i`` of ``L`` the learning rate ``lr * decay ** (L - i)``, the embeddings ``decay ** (L + 1)``.

    Args:
        decay: The per-layer factor in (0, 1] (ELECTRA 0.8; BEiT and MAE 0.65 to 0.75).
        layer_patterns: Regular expressions with one group capturing the layer index; ``None`` finds the common
            layouts (``layer.N``, ``layers.N``, ``h.N``, ``blocks.N``, ``block.N``).
        embedding_patterns: Regular expressions marking embedding parameters; ``None`` uses the defaults.
        model_attribute: Where the layered model sits in the LightningModule, as for ``LoRA``; parameters outside
            it count as the head (full learning rate).
        bias_and_norm_weight_decay: Weight decay for 1-D parameters (biases, norm weights); ``None`` keeps what the
            optimizer gives them.
        log: Log each depth's learning rate (``lr/<depth>``) at every optimizer step.
    """

    def __init__(
        self,
        decay: float = 0.8,
        layer_patterns: list[str] | None = None,
        embedding_patterns: list[str] | None = None,
        model_attribute: str | None = None,
        bias_and_norm_weight_decay: float | None = 0.0,
        log: bool = True,
    ) -> None:
        check_decay(decay, "LayerwiseLRDecay")
        if bias_and_norm_weight_decay is not None:
            real("LayerwiseLRDecay", "bias_and_norm_weight_decay", bias_and_norm_weight_decay, minimum=0,
                 meaning="or None to keep the optimizer's")
        self.decay, self.layer_patterns, self.embedding_patterns = decay, layer_patterns, embedding_patterns
        self.model_attribute, self.bias_and_norm_weight_decay, self.log_lr = (
            model_attribute, bias_and_norm_weight_decay, log)
        self._patches = Patches()  # the LightningModule's configure_optimizers, for the fit

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        if stage != "fit":
            return
        self._depths(pl_module)  # wrong patterns fail now, before any optimizer exists
        self._patches.undo()  # an earlier fit's wrapper, if its teardown did not run: wrap the user's method
        regroup_configure_optimizers(pl_module, self._patches, lambda: self._split(pl_module), "LayerwiseLRDecay",
                                     "split by depth")

    def _depths(self, pl_module: pl.LightningModule) -> tuple[dict[int, str], dict[str, int], int]:
        prefix, model = resolve_target(pl_module, self.model_attribute, "LayerwiseLRDecay")
        depths, num_layers = layer_depths(model, self.layer_patterns, self.embedding_patterns, "LayerwiseLRDecay")
        names = {id(p): name for name, p in model.named_parameters()}
        return names, depths, num_layers

    def _split(self, pl_module: pl.LightningModule) -> Callable[[Optimizer, dict[str, Any], int], list[dict[str, Any]]]:
        """Each param group split by depth (`decayed_groups`)."""
        names, depths, num_layers = self._depths(pl_module)
        return functools.partial(_decayed, names=names, depths=depths, num_layers=num_layers, decay=self.decay,
                                 weight_decay=self.bias_and_norm_weight_decay)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not any(_was_split(optimizer) for optimizer in trainer.optimizers):
            raise RuntimeError(
                "LayerwiseLRDecay: no optimizer of this run was built inside the LightningModule's "
                "configure_optimizers, so no learning rate was decayed; build the optimizer there (or in "
                "LightningCLI's optimizer: section)."
            )
        self._fit_plateau_schedulers(trainer)
        self._check(trainer)

    def _fit_plateau_schedulers(self, trainer: pl.Trainer) -> None:
        """Makes each ``ReduceLROnPlateau`` keep the ratios (``training.layerwise_lr.scale_plateau_floors``), once:
        the scheduler remembers it in its state, so a resumed run (its restored ``min_lrs`` scaled already) does not
        scale them again."""
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                continue
            entries = [group.get(GROUP_KEY) for group in scheduler.optimizer.param_groups]
            if not any(entries) or getattr(scheduler, _PLATEAU_FITTED, False):
                continue
            scale_plateau_floors(scheduler, entries)
            setattr(scheduler, _PLATEAU_FITTED, True)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        self._check(trainer, [optimizer])
        if self.log_lr:
            logged: dict[str, float] = {}
            for group in optimizer.param_groups:
                entry = group.get(GROUP_KEY)
                if entry and f"lr/{entry['label']}" not in logged:
                    logged[f"lr/{entry['label']}"] = float(group["lr"])
            pl_module.log_dict(logged, on_step=True, on_epoch=False)

    def _check(self, trainer: pl.Trainer, optimizers: list[Optimizer] | None = None) -> None:
        """Raises if a scheduler broke the decay: within one user group, ``lr / scale`` must be one value."""
        for optimizer in optimizers or trainer.optimizers:
            broken = broken_decay(optimizer.param_groups)
            if broken is not None:
                raise RuntimeError(_broken_message(trainer, optimizer, *broken, self.decay))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "layer_patterns": self.layer_patterns,
                "embedding_patterns": self.embedding_patterns,
                "bias_and_norm_weight_decay": self.bias_and_norm_weight_decay}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Also because the restored optimizer state would bring back the old learning rates anyway.
        refuse_changed_settings("LayerwiseLRDecay", {k: state_dict.get(k) for k in self.state_dict()}, self.state_dict())


def _broken_message(trainer: pl.Trainer, optimizer: Optimizer, first: tuple[float, str], other: tuple[float, str],
                    decay: float) -> str:
    inner = getattr(optimizer, "optimizer", None)  # DeepSpeed's ZeRO optimizer wraps the one the scheduler holds
    schedulers = [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs
                  if c.scheduler.optimizer is optimizer or (inner is not None and c.scheduler.optimizer is inner)]
    who = f"the scheduler {', '.join(schedulers)}" if schedulers else "something outside LayerwiseLRDecay"
    return (
        f"LayerwiseLRDecay(decay={decay}): at step {trainer.global_step}, {who} set the learning rates of "
        f"{type(optimizer).__name__} so that {first[1]} and {other[1]} no longer differ by the decay (undecayed "
        f"rates {first[0]:.6g} and {other[0]:.6g}), which undoes layer-wise decay. A scheduler must scale each "
        "group's own lr (LambdaLR, LinearLR, CosineAnnealingLR do); for OneCycleLR pass "
        "max_lr=[group['lr'] for group in optimizer.param_groups]; ReduceLROnPlateau is adjusted by the callback "
        "unless given a per-group min_lr list that breaks the ratios."
    )


def _decayed(optimizer: Optimizer, group: dict[str, Any], origin: int, **how: Any) -> list[dict[str, Any]]:
    return decayed_groups(group, optimizer, how["names"], how["depths"], how["num_layers"], how["decay"],
                          how["weight_decay"], origin, "LayerwiseLRDecay")


def _was_split(optimizer: Any) -> bool:
    """Whether the callback split ``optimizer``'s groups (also through a strategy's wrapper of it)."""
    return any(GROUP_KEY in group for group in optimizer.param_groups)
