"""``LoRA`` callback: low-rank adapters on a LightningModule's model, injected before the optimizer exists.

`AdapterCallback` calls [`inject_lora`][lightning_peft.peft.inject_lora] at ``setup`` (before ``configure_optimizers``);
a model that has this adapter is used as it is if the config agrees. ``adapter_only_checkpoint=True`` keeps what
trains (adapters, biases, ``modules_to_save``) and buffers. Resuming with another rank, alpha or targets is refused.

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.LoRA
      init_args: {rank: 8, alpha: 16, target_modules: [query, value], modules_to_save: [classifier]}
```
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from torch import nn

from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.callbacks._lightning import warn_emulated_bf16
from lightning_peft.callbacks._lora_settings import LoRASettings, refuse_attention_under_deepspeed_zero3
from lightning_peft.callbacks._loraplus import LoRAPlusOption
from lightning_peft.peft.adapter import DEFAULT
from lightning_peft.peft.lora import as_config, inject_lora


class LoRA(LoRASettings, LoRAPlusOption, AdapterCallback):
    """Inject LoRA adapters into the model at ``setup`` and freeze the rest.

    The adapter's settings, ``rank`` to ``layers_pattern``, are the fields of
    [`LoRAConfig`][lightning_peft.peft.LoRAConfig], with its names, defaults and meanings (documented there once);
    Hugging Face PEFT's names for them (``r``, ``lora_alpha``, ...) are refused with ours in the message.

    Args:
        loraplus_lr_ratio: LoRA+ (arXiv:2402.12354, `lightning_peft.callbacks._loraplus`): ``B`` trains at this many
            times each optimizer group's lr, embedding adapters at ``loraplus_lr_embedding`` (PEFT's). None: off.
        adapter_only_checkpoint: Checkpoints hold only what trains (and buffers); loading takes the frozen base
            from the model as constructed.
        model_attribute: Dotted path of the model inside the LightningModule (adapter key paths are relative to it);
            ``""``: the LightningModule itself (a head beside the Hugging Face model can then be saved in full).
            Default: the one Hugging Face model inside the LightningModule, else the LightningModule itself.
    """

    who, kind, what = "LoRA", "lora", "a LoRA adapter"

    def __init__(
        self,
        rank: int = 8,
        alpha: float = 8.0,
        dropout: float = 0.0,
        target_modules: list[str] | str = "all-linear",
        exclude_modules: list[str] | str | None = None,
        modules_to_save: list[str] | None = None,
        rank_pattern: dict[str, int] | None = None,
        alpha_pattern: dict[str, float] | None = None,
        bias: Literal["none", "lora_only", "all"] = "none",
        init: str = "kaiming",
        use_rslora: bool = False,
        quantize: Literal["nf4", "int8"] | None = None,
        use_dora: bool = False,
        target_parameters: list[str] | None = None,
        trainable_token_indices: list[int] | dict[str, list[int]] | None = None,
        lora_bias: bool = False,
        layers_to_transform: list[int] | int | None = None, layers_pattern: list[str] | str | None = None,
        loraplus_lr_ratio: float | None = None, loraplus_lr_embedding: float = 1e-6,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
        **peft_names: Any,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = as_config(None, {
            "rank": rank, "alpha": alpha, "dropout": dropout, "target_modules": target_modules,
            "exclude_modules": exclude_modules, "modules_to_save": modules_to_save,
            "rank_pattern": dict(rank_pattern or {}), "alpha_pattern": dict(alpha_pattern or {}),
            "bias": bias, "init": init, "use_rslora": use_rslora, "quantize": quantize, "use_dora": use_dora,
            "target_parameters": target_parameters, "lora_bias": lora_bias,
            "trainable_token_indices": trainable_token_indices,
            "layers_to_transform": layers_to_transform, "layers_pattern": layers_pattern, **peft_names}, "LoRA")
        self.use_loraplus(loraplus_lr_ratio, loraplus_lr_embedding)

    def request(self) -> dict[str, Any]:  # the model's first adapter must be this one, whatever its name
        return {"adapters": {DEFAULT: {"config": self.config.to_dict()}}, "first_only": True}

    def check(self, trainer: pl.Trainer) -> None:
        warn_emulated_bf16("LoRA", trainer)

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        refuse_attention_under_deepspeed_zero3(model, self.config, trainer.strategy)
        layers, dora = inject_lora(model, self.config), "DoRA, " if self.config.use_dora else ""
        return (f"adapted {len(layers)} modules of {type(model).__name__} ({dora}rank {self.config.rank}, alpha "
                f"{self.config.alpha}{self.saving(model)})")

