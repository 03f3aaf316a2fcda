"""``LycorisCallback``: what the LyCORIS callbacks (``LoHa``, ``LoKr``) share beyond `AdapterCallback`: one call of
`lightning_peft.peft.lycoris.inject` with the method's adapter class, and the method's own dropouts for the warning
about dropout left in eval mode. A subclass sets ``adapter_class`` and builds ``self.config`` in its constructor
(plain typed keyword arguments, for LightningCLI)."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
from torch import nn

from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.peft.lycoris import LycorisAdapter, LycorisConfig, inject


class LycorisCallback(AdapterCallback):
    """Base class of the LyCORIS callbacks (the module docstring)."""

    adapter_class: ClassVar[type[LycorisAdapter]]
    config: LycorisConfig

    def request(self) -> dict[str, Any]:  # the names are not resolved yet
        return {"config": self.config.to_dict()}

    def shown(self, adapter: LycorisAdapter) -> Any:
        return adapter.config

    def own_dropout(self) -> float:
        return max(self.config.rank_dropout, self.config.module_dropout)

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        layers = inject(model, self.config, self.adapter_class)
        return f"{len(layers)} layers of {type(model).__name__} (r={self.config.r}{self.saving(model)})"
