"""``LycorisCallback``: what the LyCORIS callbacks (``LoHa``, ``LoKr``) share beyond `AdapterCallback`: one call of
`lightning_peft.peft.lycoris.inject` with the method's adapter class, the method's own dropouts for the warning
about dropout left in eval mode, and the refusal of tensor parallelism. A subclass sets ``adapter_class`` and builds ``self.config`` in its constructor
(plain typed keyword arguments, for LightningCLI)."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
from torch import nn

from lightning_peft._seams import refuse, tensor_parallel_size
from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.peft.lycoris import LycorisAdapter, LycorisConfig, inject


class LycorisCallback(AdapterCallback):
    """Base class of the LyCORIS callbacks (the module docstring)."""

    adapter_class: ClassVar[type[LycorisAdapter]]
    config: LycorisConfig

    def check(self, trainer: pl.Trainer) -> None:
        if tensor_parallel_size(trainer.strategy) > 1:
            raise refuse(self.who, trainer.strategy, "the tensor-parallel plan splits a base weight together with the "
                         "one adapter factor that splits with it (LoRA's lora_B or lora_A), while a LyCORIS update is "
                         "formed from several factors (LoHa's Hadamard and LoKr's Kronecker products) that the plan does "
                         "not split",
                         f"train {self.who} under data parallelism (DDP, ZeRO), the pipeline or the device map, or "
                         "use LoRA under tensor parallelism")

    def request(self) -> dict[str, Any]:  # the names are not resolved yet
        return {"config": self.config.to_dict()}

    def shown(self, adapter: LycorisAdapter) -> Any:
        return adapter.config

    def own_dropout(self) -> float:
        return max(self.config.rank_dropout, self.config.module_dropout)

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        layers = inject(model, self.config, self.adapter_class)
        return f"{len(layers)} layers of {type(model).__name__} (r={self.config.r}{self.saving(model)})"
