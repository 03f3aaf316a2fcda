"""``AdaLoRA`` callback: AdaLoRA (arXiv:2303.10512) on a LightningModule's model, and its rank-allocation schedule.

The math lives in `lightning_peft.peft.adalora`; `AdapterCallback` injects at ``setup``. At train start the allocator
is built over ``total_step`` steps (None: the fit's optimizer steps, `GradientAccumulation.total_steps`: exact under a
changing schedule, where ``estimated_stepping_batches`` is an upper bound). Before each optimizer step (after unscaling,
before clipping) the orthogonal regularisation's gradient is added, as if in the loss. After each optimizer step (its
gradients still in ``p.grad``) the allocator runs once, with PEFT's 0-based step; its state is the checkpoint's.

YAML (LightningCLI):

```yaml
trainer:
  callbacks: [{class_path: lightning_peft.callbacks.AdaLoRA, init_args: {target_modules: [query, value]}}]
```
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn
from typing_extensions import override

from lightning_peft._seams import refuse, splits_layers, strategy_family
from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.callbacks.gradient_accumulation import GradientAccumulation
from lightning_peft.peft.adalora import AdaLoraConfig, RankAllocator, inject_adalora
from lightning_peft.peft.adalora.model import add_orthogonal_gradient, start_allocation


class AdaLoRA(AdapterCallback):
    """Inject AdaLoRA into the model at ``setup``, freeze the rest, and run the rank allocation.

    Its arguments are the fields of [`AdaLoraConfig`][lightning_peft.peft.AdaLoraConfig] (PEFT's names),
    ``adapter_only_checkpoint`` (checkpoints keep the factors and ``modules_to_save``) and ``model_attribute``.
    """

    who, kind, what = "AdaLoRA", "adalora", "AdaLoRA factors"

    def __init__(self, target_modules: list[str] | str, init_r: int = 12, target_r: int = 8, lora_alpha: float = 8.0,
                 lora_dropout: float = 0.0, tinit: int = 0, tfinal: int = 0, deltaT: int = 1,
                 beta1: float = 0.85, beta2: float = 0.85, orth_reg_weight: float = 0.5, total_step: int | None = None,
                 exclude_modules: list[str] | str | None = None, modules_to_save: list[str] | None = None,
                 init_lora_weights: bool = True, adapter_only_checkpoint: bool = False,
                 model_attribute: str | None = None) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = AdaLoraConfig(
            target_modules=target_modules, init_r=init_r, target_r=target_r, lora_alpha=lora_alpha,
            lora_dropout=lora_dropout, tinit=tinit, tfinal=tfinal, deltaT=deltaT, beta1=beta1, beta2=beta2,
            orth_reg_weight=orth_reg_weight, total_step=total_step, exclude_modules=exclude_modules,
            modules_to_save=modules_to_save, init_lora_weights=init_lora_weights)
        self.allocator: RankAllocator | None = None
        self._restored: dict[str, Any] | None = None

    def request(self) -> dict[str, Any]:  # the names are not resolved yet
        return {"config": self.config.to_dict()}

    def check(self, trainer: pl.Trainer) -> None:
        fix = "train AdaLoRA on one device, under DDP or native ZeRO-1 (ZeROStrategy(stage=1, backend='native'))"
        where = {"deepspeed": "DeepSpeed keeps them in its own partitions", "dtensor": "they are DTensor shards"}.get(
            strategy_family(trainer.strategy), "each rank holds some layers" if splits_layers(trainer.strategy) else None)
        if getattr(trainer.precision_plugin, "scaler", None) is not None:  # a skipped step leaves inf in p.grad
            where, fix = "a GradScaler (16-mixed) may leave them scaled or inf", "use precision='bf16-mixed' or '32-true'"
        if where:
            raise refuse(self.who, trainer.strategy, "the rank allocation reads every factor's whole gradient from "
                         f"p.grad after the optimizer step, and here {where}", fix)

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        layers = inject_adalora(model, self.config)
        return f"{len(layers)} layers of {type(model).__name__} at rank {self.config.init_r}{self.saving(model)}"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        total = self.config.total_step or GradientAccumulation.total_steps(trainer)  # the estimate, or the exact count
        self.allocator = start_allocation(self.adapted_model, total)
        if self._restored is not None:
            self.allocator.load_state_dict(self._restored)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        add_orthogonal_gradient(self.adapted_model)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step - 1  # the optimizer step just taken, 0-based as in PEFT's loop
        if self.allocator is not None and step >= 0 and step != self.allocator.last_step:
            self.allocator.step(step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "allocator": self.allocator and self.allocator.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._restored = state_dict.get("allocator")
