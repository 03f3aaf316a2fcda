"""``OFT`` callback: orthogonal finetuning (arXiv:2306.07280, arXiv:2506.19847) on a LightningModule's model, injected
before the optimizer exists.

The math lives in `lightning_peft.peft.oft`; `AdapterCallback` calls [`inject_oft`][lightning_peft.peft.inject_oft] at
``setup`` (before ``configure_optimizers``). ``adapter_only_checkpoint=True`` keeps what trains (the rotations,
trained biases, ``modules_to_save``) and buffers; resuming with other settings is refused, naming both values.
``MergeOnSave`` folds the rotations into the weights and writes the adapter in Hugging Face PEFT's OFT format.

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.OFT
      init_args: {target_modules: [query, value], oft_block_size: 32, use_cayley_neumann: true}
```
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.peft.oft import OFTAdapter, OFTConfig, inject_oft


class OFT(AdapterCallback):
    """Inject OFT into the model at ``setup`` and freeze the rest. The arguments are
    [`OFTConfig`][lightning_peft.peft.OFTConfig]'s (PEFT's names and defaults), and:

    Args:
        adapter_only_checkpoint: Checkpoints keep only the rotations, trained biases, ``modules_to_save`` and buffers.
        model_attribute: Where the model is in the LightningModule (`AdapterCallback`'s rule; ``""``: itself).
    """

    who, kind, what = "OFT", "oft", "OFT rotations"

    def __init__(
        self,
        target_modules: list[str] | str,
        r: int = 0,
        oft_block_size: int = 32,
        module_dropout: float = 0.0,
        bias: str = "none",
        coft: bool = False,
        eps: float = 6e-5,
        block_share: bool = False,
        use_cayley_neumann: bool = True,
        num_cayley_neumann_terms: int = 5,
        init_weights: bool = True,
        layers_to_transform: list[int] | int | None = None,
        layers_pattern: list[str] | str | None = None,
        exclude_modules: list[str] | str | None = None,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = OFTConfig(
            target_modules=target_modules, r=r, oft_block_size=oft_block_size, module_dropout=module_dropout,
            bias=bias, coft=coft, eps=eps, block_share=block_share, use_cayley_neumann=use_cayley_neumann,
            num_cayley_neumann_terms=num_cayley_neumann_terms, init_weights=init_weights,
            layers_to_transform=layers_to_transform, layers_pattern=layers_pattern, exclude_modules=exclude_modules,
            modules_to_save=modules_to_save)

    def request(self) -> dict[str, Any]:  # the names are not resolved yet
        return {"config": self.config.to_dict()}

    def shown(self, adapter: OFTAdapter) -> Any:
        return adapter.config

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        layers = inject_oft(model, self.config)
        return f"{len(layers)} layers of {type(model).__name__}{self.saving(model)}"
