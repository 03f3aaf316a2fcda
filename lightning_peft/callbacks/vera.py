"""``VeRA`` callback: shared random projections and two trained vectors per layer (arXiv:2310.11454) on a
LightningModule's model, injected before the optimizer exists.

The math lives in `lightning_peft.peft.vera`; `AdapterCallback` calls [`inject_vera`][lightning_peft.peft.inject_vera]
at ``setup`` (before ``configure_optimizers``, so the optimizer sees only what trains). The projections are drawn from
``projection_prng_key`` on every rank alike and are buffers, so checkpoints (adapter-only too) carry them. Resuming
with another rank or key is refused, naming both values. ``MergeOnSave`` folds the updates into the weights and writes
the adapter in Hugging Face PEFT's VeRA format. Tensor parallelism is refused at ``setup``.

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.VeRA
      init_args: {target_modules: [query, value], rank: 256, projection_prng_key: 0, d_initial: 0.1}
```
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from torch import nn

from lightning_peft._seams import refuse, tensor_parallel_size
from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.peft.vera import VeraAdapter, VeraConfig, inject_vera


class VeRA(AdapterCallback):
    """Inject VeRA into the model at ``setup`` and freeze the rest.

    Args:
        target_modules: The modules adapted: names or dotted suffixes (list), or a regular expression (string).
            ``nn.Linear`` and transformers ``Conv1D``, of any shapes.
        rank: The rows of the shared random ``A`` (PEFT's ``r``).
        projection_prng_key: The seed of the shared projections.
        save_projection: Write the projections into PEFT-format exports (else only the key).
        dropout: Dropout on the adapter branch's input (PEFT's ``vera_dropout``).
        d_initial: The start value of ``lambda_d`` (``lambda_b`` starts at zero: the base model's output).
        bias: Biases that train too: ``"none"``, ``"vera_only"`` or ``"all"``.
        modules_to_save: Modules trained and saved in full, e.g. ``["classifier"]``. None: the task head of a
            Hugging Face task model; ``[]``: none.
        init_weights: False: PEFT's test initialisation (``lambda_b = 1``, random ``lambda_d``).
        layers_to_transform: Adapt only the targets in these layers (an index or a list).
        layers_pattern: The name of the ``ModuleList`` of those layers; None: the first numbered one.
        adapter_only_checkpoint: Checkpoints keep only the vectors, the projections, trained biases and
            ``modules_to_save``.
        model_attribute: Where the model is in the LightningModule (`AdapterCallback`'s rule; ``""``: itself).
    """

    who, kind, what = "VeRA", "vera", "VeRA layers"

    def __init__(
        self,
        target_modules: list[str] | str,
        rank: int = 256,
        projection_prng_key: int = 0,
        save_projection: bool = True,
        dropout: float = 0.0,
        d_initial: float = 0.1,
        bias: Literal["none", "vera_only", "all"] = "none",
        modules_to_save: list[str] | None = None,
        init_weights: bool = True,
        layers_to_transform: list[int] | int | None = None,
        layers_pattern: list[str] | str | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = VeraConfig(
            target_modules=target_modules, rank=rank, projection_prng_key=projection_prng_key,
            save_projection=save_projection, dropout=dropout, d_initial=d_initial, bias=bias,
            modules_to_save=modules_to_save, init_weights=init_weights, layers_to_transform=layers_to_transform,
            layers_pattern=layers_pattern)

    def request(self) -> dict[str, Any]:  # the names are not resolved yet
        return {"config": self.config.to_dict()}

    def shown(self, adapter: VeraAdapter) -> Any:
        return adapter.config

    def check(self, trainer: pl.Trainer) -> None:
        if tensor_parallel_size(trainer.strategy) > 1:
            raise refuse("VeRA", trainer.strategy, "every VeRA layer multiplies by slices of the projections shared "
                         "by all layers, sized to the whole (unsharded) layers, while tensor parallelism gives each "
                         "rank a share of each layer's features", "use LoRA under tensor parallelism, or VeRA under "
                         "DDP, ZeRO or the pipeline")

    def own_dropout(self) -> float:
        return self.config.dropout

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        layers = inject_vera(model, self.config)
        return f"{len(layers)} layers of {type(model).__name__} (rank {self.config.rank}{self.saving(model)})"
