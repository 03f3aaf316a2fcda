"""``PrefixTuning`` callback: trained key/value prefixes on a LightningModule's Hugging Face model.

The technique lives in `lightning_peft.peft.prompt.prefix_tuning`; `AdapterCallback` calls
[`inject_prefix_tuning`][lightning_peft.peft.inject_prefix_tuning] at ``setup`` (before ``configure_optimizers``, so the
optimizer sees only what trains). A model that already has a prefix (a later ``validate``/``test``) is used as it is, if
the config agrees. Checkpoints record the adapters, with the projection MLP while training runs, so a resumed run
continues the same MLP (``adapter_only_checkpoint=True`` leaves the frozen base out); resuming with other settings is
refused, naming both. Tensor parallelism is refused at ``setup``.

``on_fit_end``: with ``prefix_projection=True`` the MLP is folded into the table it produces
([`fold_prefix_projection`][lightning_peft.peft.fold_prefix_projection]), so what is saved or exported afterwards is the
plain prefix (what PEFT saves as ``prompt_embeddings``).

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.PrefixTuning
      init_args: {num_virtual_tokens: 20, prefix_projection: true, modules_to_save: [classifier]}
```
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn
from typing_extensions import override

from lightning_peft._seams import refuse, tensor_parallel_size
from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.peft import PrefixTuningAdapter
from lightning_peft.peft.prompt.prefix_tuning import PrefixTuningConfig, fold_prefix_projection, inject_prefix_tuning


class PrefixTuning(AdapterCallback):
    """Give every attention layer of the model a trained prefix at ``setup`` and freeze the rest.

    Args:
        num_virtual_tokens: Number of prefix positions per layer.
        prefix_projection: Produce the prefix with the paper's MLP while training; folded into a table at fit end.
        encoder_hidden_size: Hidden size of that MLP; None: the model's key/value width.
        modules_to_save: Modules trained and saved in full, e.g. ``["classifier"]``. None: the task head of a
            Hugging Face task model (``*ForSequenceClassification``, ...); ``[]``: none.
        adapter_only_checkpoint: Checkpoints hold only what trains (and buffers); loading takes the frozen base
            from the model as constructed.
        model_attribute: Dotted path of the Hugging Face model inside the LightningModule. Default: the one
            Hugging Face model inside it.
    """

    who, kind, what = "PrefixTuning", "prefix_tuning", "a prefix"

    def __init__(
        self,
        num_virtual_tokens: int = 20,
        prefix_projection: bool = False,
        encoder_hidden_size: int | None = None,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = PrefixTuningConfig(num_virtual_tokens, prefix_projection, encoder_hidden_size, modules_to_save)

    def request(self) -> dict[str, Any]:  # a folded projection counts as the projection it came from
        return {"config": self.config.to_dict()}

    def shown(self, adapter: PrefixTuningAdapter) -> Any:
        return adapter.config

    def check(self, trainer: pl.Trainer) -> None:
        if tensor_parallel_size(trainer.strategy) > 1:
            raise refuse("PrefixTuning", trainer.strategy, "the prefix holds every attention head's keys and values, "
                         "while tensor parallelism gives each rank a share of the heads", "use LoRA or prompt tuning "
                         "under tensor parallelism, or prefix tuning under DDP or ZeRO")

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        inject_prefix_tuning(model, **self.config.to_dict())
        mlp = " through a projection MLP" if self.config.prefix_projection else ""
        return f"{self.config.num_virtual_tokens} virtual tokens on {type(model).__name__}{mlp}{self.saving(model)}"

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.prefix_projection:
            fold_prefix_projection(resolve_target(pl_module, self.model_attribute, self.who)[1])
