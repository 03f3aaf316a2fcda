"""``IA3`` callback: IA³ vectors (arXiv:2205.05638) on a LightningModule's model, injected before the optimizer exists.

The math lives in `lightning_peft.peft.ia3`; `AdapterCallback` calls [`inject_ia3`][lightning_peft.peft.inject_ia3] at
``setup`` (before ``configure_optimizers``, so the optimizer sees only what trains). A model that already has IA³ is
used as it is if the config agrees. ``adapter_only_checkpoint=True`` keeps what trains (the vectors,
``modules_to_save``) and buffers. Resuming with other targets is refused, naming both values. ``MergeOnSave`` folds
the vectors into the weights and writes the adapter in Hugging Face PEFT's IA³ format.

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.IA3
      init_args: {target_modules: [key, value, output.dense], feedforward_modules: [output.dense]}
```
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.peft.ia3 import IA3Adapter, IA3Config, inject_ia3


class IA3(AdapterCallback):
    """Inject IA³ into the model at ``setup`` and freeze the rest.

    Args:
        target_modules: The modules that get a learned vector: names or dotted suffixes (list), a regular
            expression (string), or ``"all-linear"``. ``nn.Linear``, transformers ``Conv1D``, ``nn.Conv2d``,
            ``nn.Conv3d``.
        feedforward_modules: The targets whose input is scaled (the paper's ``l_ff``, PEFT's matching: plain suffix
            for a list, which must be a subset of a ``target_modules`` list); the others' output is scaled.
        exclude_modules: Modules never adapted (the ``target_modules`` rules).
        modules_to_save: Modules trained and saved in full, e.g. ``["classifier"]``. None: the task head of a
            Hugging Face task model; ``[]``: none.
        init_ia3_weights: Start the vectors at ones (the base model's output).
        adapter_only_checkpoint: Checkpoints keep only the vectors, ``modules_to_save`` and buffers.
        model_attribute: Where the model is in the LightningModule (`AdapterCallback`'s rule; ``""``: itself).
    """

    who, kind, what = "IA3", "ia3", "IA³ vectors"

    def __init__(
        self,
        target_modules: list[str] | str,
        feedforward_modules: list[str] | str | None = None,
        exclude_modules: list[str] | str | None = None,
        modules_to_save: list[str] | None = None,
        init_ia3_weights: bool = True,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = IA3Config(target_modules=target_modules, feedforward_modules=feedforward_modules,
                                exclude_modules=exclude_modules, modules_to_save=modules_to_save,
                                init_ia3_weights=init_ia3_weights)

    def request(self) -> dict[str, Any]:  # the names are not resolved yet
        return {"config": self.config.to_dict()}

    def shown(self, adapter: IA3Adapter) -> Any:
        return adapter.config

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        layers = inject_ia3(model, self.config)
        inputs = sum(layer.feedforward for layer in layers.values())
        return f"{len(layers)} layers of {type(model).__name__} ({inputs} scaled at the input{self.saving(model)})"
