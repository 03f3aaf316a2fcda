"""``BOFT`` callback: butterfly orthogonal finetuning (arXiv:2311.06243) on a LightningModule's model, injected
before the optimizer exists.

The math lives in `lightning_peft.peft.boft`; `AdapterCallback` calls [`inject_boft`][lightning_peft.peft.inject_boft]
at ``setup``. ``adapter_only_checkpoint=True`` keeps what trains (rotations, scales, trained biases,
``modules_to_save``) and buffers; resuming with other settings is refused. ``MergeOnSave`` folds the rotations into
the weights and writes the adapter in Hugging Face PEFT's BOFT format.

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.BOFT
      init_args: {target_modules: [query, value], boft_block_size: 8, boft_n_butterfly_factor: 2}
```
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.peft.boft import BOFTAdapter, BOFTConfig, inject_boft


class BOFT(AdapterCallback):
    """Inject BOFT into the model at ``setup`` and freeze the rest. The arguments are
    [`BOFTConfig`][lightning_peft.peft.BOFTConfig]'s (PEFT's names and defaults), and:

    Args:
        adapter_only_checkpoint: Checkpoints keep only what trains and buffers.
        model_attribute: Where the model is in the LightningModule (`AdapterCallback`'s rule; ``""``: itself).
    """

    who, kind, what = "BOFT", "boft", "BOFT rotations"

    def __init__(
        self,
        target_modules: list[str] | str,
        boft_block_size: int = 4,
        boft_block_num: int = 0,
        boft_n_butterfly_factor: int = 1,
        boft_dropout: float = 0.0,
        bias: str = "none",
        init_weights: bool = True,
        layers_to_transform: list[int] | int | None = None,
        layers_pattern: list[str] | str | None = None,
        exclude_modules: list[str] | str | None = None,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = BOFTConfig(
            target_modules=target_modules, boft_block_size=boft_block_size, boft_block_num=boft_block_num,
            boft_n_butterfly_factor=boft_n_butterfly_factor, boft_dropout=boft_dropout, bias=bias,
            init_weights=init_weights, layers_to_transform=layers_to_transform, layers_pattern=layers_pattern,
            exclude_modules=exclude_modules, modules_to_save=modules_to_save)

    def request(self) -> dict[str, Any]:  # the names are not resolved yet
        return {"config": self.config.to_dict()}

    def shown(self, adapter: BOFTAdapter) -> Any:
        return adapter.config

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        layers = inject_boft(model, self.config)
        return f"{len(layers)} layers of {type(model).__name__}{self.saving(model)}"
