"""``LoKr`` callback: LoKr (LyCORIS' Kronecker product, arXiv:2309.14859) on a LightningModule's model, injected
before the optimizer exists.

The math lives in `lightning_peft.peft.lokr`; `AdapterCallback` calls [`inject_lokr`][lightning_peft.peft.inject_lokr]
at ``setup`` (refused under tensor parallelism, which splits the rows and columns that ``ΔW`` ties together).
``adapter_only_checkpoint=True`` keeps what trains (the factors, ``modules_to_save``) and buffers; a
resume with other settings is refused, naming both; ``MergeOnSave`` adds ``ΔW`` to the weights and writes the adapter
in Hugging Face PEFT's LoKr format.

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.LoKr
      init_args: {target_modules: [query, value], r: 4, alpha: 8, decompose_both: true}
```
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_peft._seams import refuse, tensor_parallel_size
from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.peft.lokr import LoKrAdapter, LoKrConfig, inject_lokr


class LoKr(AdapterCallback):
    """Inject LoKr into the model at ``setup`` and freeze the rest. The arguments are
    [`LoKrConfig`][lightning_peft.peft.LoKrConfig]'s (PEFT's names), and:

    Args:
        adapter_only_checkpoint: Checkpoints keep only the factors, ``modules_to_save`` and buffers.
        model_attribute: Where the model is in the LightningModule (`AdapterCallback`'s rule; ``""``: itself).
    """

    who, kind, what = "LoKr", "lokr", "LoKr factors"

    def __init__(
        self,
        target_modules: list[str] | str,
        r: int = 8,
        alpha: float = 8,
        exclude_modules: list[str] | str | None = None,
        rank_dropout: float = 0.0,
        module_dropout: float = 0.0,
        use_effective_conv2d: bool = False,
        decompose_both: bool = False,
        decompose_factor: int = -1,
        rank_dropout_scale: bool = False,
        init_weights: bool | str = True,
        layers_to_transform: list[int] | int | None = None,
        layers_pattern: list[str] | str | None = None,
        rank_pattern: dict[str, int] | None = None,
        alpha_pattern: dict[str, float] | None = None,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = LoKrConfig(
            target_modules=target_modules, r=r, alpha=alpha, exclude_modules=exclude_modules,
            rank_dropout=rank_dropout, module_dropout=module_dropout, use_effective_conv2d=use_effective_conv2d,
            decompose_both=decompose_both, decompose_factor=decompose_factor, rank_dropout_scale=rank_dropout_scale,
            init_weights=init_weights, layers_to_transform=layers_to_transform, layers_pattern=layers_pattern,
            rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {}, modules_to_save=modules_to_save)

    def request(self) -> dict[str, Any]:  # the names are not resolved yet
        return {"config": self.config.to_dict()}

    def shown(self, adapter: LoKrAdapter) -> Any:
        return adapter.config

    def own_dropout(self) -> float:
        return max(self.config.rank_dropout, self.config.module_dropout)

    def check(self, trainer: pl.Trainer) -> None:
        if tensor_parallel_size(trainer.strategy) > 1:
            raise refuse("LoKr", trainer.strategy, "ΔW = kron(W1, W2) ties every output row of a layer to every input "
                         "column, while tensor parallelism gives each rank a share of them", "use LoRA under tensor "
                         "parallelism, or LoKr under DDP, ZeRO, the pipeline or one process")

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        layers = inject_lokr(model, self.config)
        return f"{len(layers)} layers of {type(model).__name__} (r={self.config.r}{self.saving(model)})"
