"""``BottleneckAdapters`` callback: Houlsby / Pfeiffer bottleneck adapters on a LightningModule's model.

The math lives in `lightning_peft.peft.bottleneck.model`; `AdapterCallback` calls
[`inject_bottleneck_adapters`][lightning_peft.peft.inject_bottleneck_adapters] at ``setup`` (before
``configure_optimizers``, so the optimizer sees only what trains). A model that already has bottleneck adapters (a later
``validate``/``test``, or an injection in the module's ``__init__``) is used as it is if the config agrees, and refused
otherwise. Checkpoints record the adapters (``adapter_only_checkpoint=True`` leaves the frozen base out); resuming with
another placement, size or non-linearity is refused, naming both values (dropout and ``init_scale`` may change).

With the ``LoRA`` callback on the same model, list ``BottleneckAdapters`` first: callbacks set up in list order,
and LoRA then adapts the layers inside the bottleneck wrappers (the other order is refused with that advice when
both pick the same modules).

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.BottleneckAdapters
      init_args: {placement: pfeiffer, reduction_factor: 16, non_linearity: relu, modules_to_save: [classifier]}
```
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from torch import nn

from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.peft.bottleneck.model import BottleneckAdapter, BottleneckConfig, inject_bottleneck_adapters


class BottleneckAdapters(AdapterCallback):
    """Inject bottleneck adapters into the model at ``setup`` and freeze the rest.

    Args:
        placement: ``"houlsby"`` (after the attention and the feed-forward output of every layer) or
            ``"pfeiffer"`` (after the feed-forward output) on BERT-, GPT-2- and Llama-style models. None:
            ``"houlsby"`` unless ``target_modules`` is given.
        reduction_factor: Bottleneck ``max(1, d // reduction_factor)`` for output size ``d``. None: 16 unless
            ``bottleneck_size`` is given.
        bottleneck_size: The bottleneck size of every adapter, instead of a reduction factor.
        non_linearity: ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"`` / ``"swish"`` or ``"tanh"``.
        target_modules: For other models: names or dotted suffixes (list) or a regular expression (string).
        dropout: Dropout on the adapter output, in [0, 1).
        init_scale: Standard deviation of the truncated-normal initialisation of the down-projection.
        modules_to_save: Modules trained and saved in full, e.g. ``["classifier"]``. None: the task head of a
            Hugging Face task model; ``[]``: none.
        adapter_only_checkpoint: Checkpoints hold only what trains (and buffers); loading takes the frozen base
            from the model as constructed.
        model_attribute: Dotted path of the model inside the LightningModule; ``""`` for the LightningModule
            itself. Default: the one Hugging Face model inside the LightningModule, else the LightningModule.
    """

    who, kind, what = "BottleneckAdapters", "bottleneck", "bottleneck adapters"

    def __init__(
        self,
        placement: Literal["houlsby", "pfeiffer"] | None = None,
        reduction_factor: float | None = None,
        bottleneck_size: int | None = None,
        non_linearity: str = "relu",
        target_modules: list[str] | str | None = None,
        dropout: float = 0.0,
        init_scale: float = 1e-2,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = BottleneckConfig(
            placement=placement, target_modules=target_modules, reduction_factor=reduction_factor,
            bottleneck_size=bottleneck_size, non_linearity=non_linearity, dropout=dropout, init_scale=init_scale,
            modules_to_save=modules_to_save,
        )

    def request(self) -> dict[str, Any]:  # targets and modules_to_save are not resolved yet
        return {"config": self.config.to_dict()}

    def shown(self, adapter: BottleneckAdapter) -> Any:
        return adapter.config

    def own_dropout(self) -> float:
        return float(self.config.dropout)

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        layers = inject_bottleneck_adapters(model, self.config)
        return (f"{len(layers)} adapters in {type(model).__name__} ({self.config.placement or 'target_modules'}, "
                f"non-linearity {self.config.non_linearity}{self.saving(model)})")
