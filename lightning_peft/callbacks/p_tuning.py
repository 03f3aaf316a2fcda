"""``PTuning`` callback: a soft prompt produced by a trained encoder (arXiv:2103.10385) in front of a LightningModule's
model, injected at ``setup``.

The technique lives in `lightning_peft.peft.prompt.p_tuning`; `AdapterCallback` calls
[`inject_p_tuning`][lightning_peft.peft.inject_p_tuning] at ``setup`` (before ``configure_optimizers``, so the optimizer
sees only the encoder and the saved head). Checkpoints keep the whole encoder (``adapter_only_checkpoint=True`` leaves
the frozen base out), so a resumed run continues it bit for bit; resuming with other settings is refused, naming both
(``encoder_dropout`` may change). A model that already has a P-tuning prompt is used as it is if it agrees; a folded
one (loaded from PEFT's file, which holds the encoder's output only) agrees with any encoder and trains its table.
``MergeOnSave`` / ``save_adapter`` write PEFT's file: the prompt the encoder produces, for inference.

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.PTuning
      init_args: {num_virtual_tokens: 20, encoder_reparameterization_type: MLP, encoder_hidden_size: 128}
```
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.peft.adapter import attached
from lightning_peft.peft.prompt.p_tuning import PTuningAdapter, PTuningConfig, inject_p_tuning


class PTuning(AdapterCallback):
    """Prepend a soft prompt produced by a trained encoder to the model's input embeddings at ``setup``; freeze the
    rest.

    Args:
        num_virtual_tokens: Number of virtual tokens ``n``.
        encoder_reparameterization_type: ``"MLP"`` or ``"LSTM"`` (bidirectional, then an MLP).
        encoder_hidden_size: The encoder's hidden size; None: the embedding width.
        encoder_num_layers: LSTM layers (the MLP has 2).
        encoder_dropout: Dropout between LSTM layers (2+ layers).
        token_dim: The embedding width, checked against the model's; None: the model's.
        modules_to_save: Modules trained and saved in full, e.g. ``["classifier"]``. None: the task head of a
            Hugging Face task model; ``[]``: none.
        adapter_only_checkpoint: Checkpoints hold only what trains (and buffers).
        model_attribute: Dotted path of the Hugging Face model inside the LightningModule. Default: the one
            Hugging Face model inside it.
    """

    who, kind, what = "PTuning", "p_tuning", "a P-tuning prompt"

    def __init__(
        self,
        num_virtual_tokens: int = 20,
        encoder_reparameterization_type: Literal["MLP", "LSTM"] = "MLP",
        encoder_hidden_size: int | None = None,
        encoder_num_layers: int = 2,
        encoder_dropout: float = 0.0,
        token_dim: int | None = None,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = PTuningConfig(num_virtual_tokens, encoder_reparameterization_type, encoder_hidden_size,
                                    encoder_num_layers, encoder_dropout, token_dim, modules_to_save)

    def request(self) -> dict[str, Any]:  # a folded prompt counts as the encoder it came from
        return {"config": self.config.to_dict()}

    def shown(self, adapter: PTuningAdapter) -> Any:
        return adapter

    def own_dropout(self) -> float:
        return self.config.encoder_dropout

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        inject_p_tuning(model, self.config)
        encoder = f"{self.config.encoder_reparameterization_type} encoder"
        return f"{self.config.num_virtual_tokens} virtual tokens ({encoder}) on {type(model).__name__}{self.saving(model)}"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and attached(self.adapted_model)[self.kind].folded:
            rank_zero_warn(f"{self.who}: the model's P-tuning prompt is folded (loaded from PEFT's file, which holds "
                           "the encoder's output only, or folded by fold_prompt_encoder), so it trains as a table: "
                           f"the {self.config.encoder_reparameterization_type} encoder asked for is not there.")
