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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_peft._checks import real
from lightning_peft.callbacks._lightning import Patches, PatchingCallback, refuse_changed_settings
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.training.layerwise_lr import GROUP_KEY, broken_decay, check_decay, decayed_groups, layer_depths
from lightning_peft.training.layerwise_lr import optimizers_and_schedulers, scale_plateau_floors

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
        original = pl_module.configure_optimizers

        @functools.wraps(original)
        def configure_optimizers(*args: Any, **kwargs: Any) -> Any:
            with self._splitting(pl_module) as split_add:
                result = original(*args, **kwargs)
                self._split_prebuilt(result, split_add)
            return result

        # An instance attribute, undone in teardown (one LightningCLI set on the instance comes back).
        self._patches.set(pl_module, "configure_optimizers", configure_optimizers)

    def _depths(self, pl_module: pl.LightningModule) -> tuple[dict[int, str], dict[str, int], int]:
        prefix, model = resolve_target(pl_module, self.model_attribute, "LayerwiseLRDecay")
        depths, num_layers = layer_depths(model, self.layer_patterns, self.embedding_patterns, "LayerwiseLRDecay")
        names = {id(p): name for name, p in model.named_parameters()}
        return names, depths, num_layers

    @contextmanager
    def _splitting(self, pl_module: pl.LightningModule) -> Iterator[Callable[[Optimizer, dict[str, Any]], None]]:
        """While active, ``Optimizer.add_param_group`` receives each group split by depth (``split_add.origins``:
        how many of the user's groups each optimizer, by id, has taken)."""
        names, depths, num_layers = self._depths(pl_module)
        add_param_group = Optimizer.add_param_group
        callback = self
        origins: dict[int, int] = {}  # id(optimizer) -> how many of the user's groups it has taken

        def split_add(optimizer: Optimizer, group: dict[str, Any]) -> None:
            origin = origins.setdefault(id(optimizer), 0)
            origins[id(optimizer)] += 1
            for part in decayed_groups(group, optimizer, names, depths, num_layers, callback.decay,
                                       callback.bias_and_norm_weight_decay, origin, "LayerwiseLRDecay"):
                add_param_group(optimizer, part)

        split_add.origins = origins  # type: ignore[attr-defined]
        with Patches() as patches:
            patches.set(Optimizer, "add_param_group", split_add)
            yield split_add

    def _split_prebuilt(self, result: Any, split_add: Callable[[Optimizer, dict[str, Any]], None]) -> None:
        """Splits, in place, an optimizer that ``configure_optimizers`` returned but did not build.

        LightningCLI's ``optimizer:`` section builds the optimizer before the Trainer exists. With no state and no
        scheduler attached yet, its groups can still be split; a scheduler made for the old groups cannot be
        mended (its per-group state is stale), which is an error.
        """
        optimizers, schedulers = optimizers_and_schedulers(result)
        for optimizer in optimizers:
            if id(optimizer) in split_add.origins:  # type: ignore[attr-defined]
                continue
            users = [type(s).__name__ for s in schedulers if getattr(s, "optimizer", None) is optimizer]
            if users or optimizer.state:
                made = f"with the scheduler {', '.join(users)} " if users else "and already stepped "
                raise RuntimeError(
                    f"LayerwiseLRDecay: configure_optimizers returned a {type(optimizer).__name__} built before the "
                    f"run {made}(LightningCLI's optimizer: and lr_scheduler: sections do that), so its groups can no "
                    "longer be split by depth. Build the optimizer and scheduler in the LightningModule's "
                    "configure_optimizers (HFSequenceClassifier has one: drop the optimizer: and lr_scheduler: "
                    "sections), or use the optimizer: section without a scheduler."
                )
            groups, optimizer.param_groups = optimizer.param_groups, []
            for group in groups:
                split_add(optimizer, group)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not any(_split(optimizer) for optimizer in trainer.optimizers):
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


def _split(optimizer: Any) -> bool:
    """Whether the callback split ``optimizer``'s groups (also through a strategy's wrapper of it)."""
    return any(GROUP_KEY in group for group in optimizer.param_groups)
