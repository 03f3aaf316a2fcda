"""The ``LoRA`` callback's LoRA+ option (``loraplus_lr_ratio``): the user's own optimizer, regrouped.

The math and the grouping (Hugging Face PEFT's ``create_loraplus_optimizer``) are in `lightning_peft.peft.loraplus`.
At ``setup``, after the adapters are injected, the LightningModule's ``configure_optimizers`` is wrapped
(`_regroup`): each param group the user's optimizer receives is split into its ``A`` part (the group's lr), its ``B``
part (lr times the ratio) and its embedding-adapter part (``loraplus_lr_embedding``), keeping the group's other
settings. So grouping parameters by name, ``AdamW(fused=True)`` and a scheduler built from
``estimated_stepping_batches`` work unchanged: the scheduler is made for the split groups and scales each. A scheduler
that sets every group to one rate (``OneCycleLR`` with a scalar ``max_lr``) would undo LoRA+: it is refused at the
first step that shows it. Resuming restores the split groups' rates from the checkpoint; a resume with other LoRA+
settings is refused (they are part of the callback's settings).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.optim import Optimizer
from typing_extensions import override

from lightning_peft.callbacks._lightning import Patches, PatchingCallback
from lightning_peft.callbacks._regroup import regroup_configure_optimizers
from lightning_peft.peft.loraplus import GROUP_KEY, broken_ratios, check_settings, roles, split_group


class LoRAPlusOption(PatchingCallback):
    """Mixin of the ``LoRA`` callback (before `AdapterCallback`): LoRA+ on the user's optimizer when
    ``loraplus_lr_ratio`` is set."""

    loraplus_lr_ratio: float | None = None
    loraplus_lr_embedding: float = 1e-6
    _patches: Patches

    def use_loraplus(self, ratio: float | None, lr_embedding: float) -> None:
        """Called by the constructor: checks and keeps the settings."""
        if ratio is not None:
            check_settings("LoRA", ratio, lr_embedding)
        self.loraplus_lr_ratio, self.loraplus_lr_embedding = ratio, lr_embedding
        self._patches = Patches()  # the LightningModule's configure_optimizers, with LoRA+

    def settings(self) -> dict[str, Any]:
        """The adapter's settings and LoRA+'s: a resume restores the split groups' rates, so other ones are refused."""
        return {**super().settings(), "loraplus_lr_ratio": self.loraplus_lr_ratio,  # type: ignore[misc]
                "loraplus_lr_embedding": self.loraplus_lr_embedding}

    def _given(self) -> str:
        return f"LoRA(loraplus_lr_ratio={self.loraplus_lr_ratio})"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]  (injects the adapters)
        if self.loraplus_lr_ratio is None or stage != "fit":
            return
        others = [type(c).__name__ for c in trainer.callbacks if type(c).__name__ == "LayerwiseLRDecay"]
        if others:
            raise ValueError(
                f"{self._given()} and {others[0]} both regroup the optimizer's learning rates, and combining them is "
                "not implemented (each would read the other's groups as the user's). Use one of them."
            )
        self._patches.undo()  # an earlier fit's wrapper, if its teardown did not run
        regroup_configure_optimizers(pl_module, self._patches, self._split, self._given(), "regrouped for LoRA+")

    def _split(self):  # called as configure_optimizers starts: the adapters exist
        found = roles(self.adapted_model)  # type: ignore[attr-defined]  (AdapterCallback.setup sets it)

        def split(optimizer: Optimizer, group: dict[str, Any], origin: int) -> list[dict[str, Any]]:
            return split_group(group, optimizer.defaults.get("lr"), found, self.loraplus_lr_ratio,
                               self.loraplus_lr_embedding, origin, self._given())

        return split

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]
        if self.loraplus_lr_ratio is None:
            return
        if not any(GROUP_KEY in group for optimizer in trainer.optimizers for group in optimizer.param_groups):
            raise RuntimeError(
                f"{self._given()}: no optimizer of this run was built inside the LightningModule's "
                "configure_optimizers (or LightningCLI's optimizer: section), so no B factor got the larger learning "
                "rate (an optimizer from a DeepSpeed config cannot be regrouped). Build the optimizer there."
            )
        self._check(trainer, trainer.optimizers)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        if self.loraplus_lr_ratio is not None:
            self._check(trainer, [optimizer])

    def _check(self, trainer: pl.Trainer, optimizers: list[Optimizer]) -> None:
        for optimizer in optimizers:
            broken = broken_ratios(optimizer.param_groups)
            if broken is not None:
                schedulers = [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs]
                who = f"the scheduler {', '.join(schedulers)}" if schedulers else "something outside LoRA"
                raise RuntimeError(
                    f"{self._given()}: at step {trainer.global_step}, {who} set the learning rates of "
                    f"{type(optimizer).__name__} so that its {broken[0]} part (lr {broken[1]:.6g}) and {broken[2]} "
                    f"part (lr {broken[3]:.6g}) no longer keep LoRA+'s ratio. A scheduler must scale each group's own "
                    "lr (LambdaLR, LinearLR, CosineAnnealingLR do); for OneCycleLR pass "
                    "max_lr=[group['lr'] for group in optimizer.param_groups]."
                )
