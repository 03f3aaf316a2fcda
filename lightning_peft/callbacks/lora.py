"""``LoRA`` callback: low-rank adapters on a LightningModule's model, injected before the optimizer exists.

The math lives in :mod:`lightning_peft.peft`; this callback decides when to call it:

- ``setup``: :func:`~lightning_peft.peft.inject_lora` on the model (before ``configure_optimizers``, so any
  optimizer sees only trainable parameters) and a log line with the trainable-parameter report;
- ``on_save_checkpoint``: with ``adapter_only_checkpoint=True`` the checkpoint drops the frozen parameters and
  keeps everything else: the adapter, trained biases, ``modules_to_save``, any other trainable parameter, and
  the buffers (cheap, and e.g. BatchNorm statistics keep changing while the base is frozen);
- loading such a checkpoint (``Trainer.fit(ckpt_path=...)``, ``trainer.test(ckpt_path=...)``) takes the frozen
  parameters from the model as built, i.e. from its original source; any other missing key is still an error.

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_peft.callbacks.LoRA
          init_args: {rank: 8, alpha: 16, target_modules: [query, value], modules_to_save: [classifier]}
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_peft.callbacks._target import resolve_target
from lightning_peft.peft.lora import LoRAConfig, inject_lora, lora_spec, trainable_parameters


class LoRA(Callback):
    """Inject LoRA adapters into the model at ``setup`` and freeze the rest.

    Args:
        rank: Rank of the updates.
        alpha: Scale numerator (update scaled by ``alpha / rank``, or ``alpha / sqrt(rank)`` with ``use_rslora``).
        dropout: Dropout on the adapter input, in [0, 1).
        target_modules: Names or dotted suffixes (list), a regular expression (string), or ``"all-linear"``.
        exclude_modules: Modules never adapted (same rules).
        modules_to_save: Modules trained and saved in full, e.g. ``["classifier"]``.
        rank_pattern: Per-module rank overrides ``{regex: rank}``.
        alpha_pattern: Per-module alpha overrides ``{regex: alpha}``.
        bias: ``"none"``, ``"lora_only"`` or ``"all"``: which biases train.
        init: ``"kaiming"`` or ``"gaussian"`` initialisation of ``A`` (``B`` starts at zero).
        use_rslora: Rank-stabilised scaling.
        adapter_only_checkpoint: Checkpoints hold only trainable weights; resuming takes the base from the
            model as constructed.
        model_attribute: Dotted path of the model inside the LightningModule (default: its one Hugging Face
            model child, else the LightningModule itself). Adapter key paths are relative to this model.
    """

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
        init: Literal["kaiming", "gaussian"] = "kaiming",
        use_rslora: bool = False,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        self.config = LoRAConfig(
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            target_modules=target_modules,
            exclude_modules=exclude_modules,
            modules_to_save=modules_to_save,
            rank_pattern=dict(rank_pattern or {}),
            alpha_pattern=dict(alpha_pattern or {}),
            bias=bias,
            init=init,
            use_rslora=use_rslora,
        )
        self.adapter_only_checkpoint = adapter_only_checkpoint
        self.model_attribute = model_attribute
        self._hook = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _, model = resolve_target(pl_module, self.model_attribute, "LoRA")
        spec = lora_spec(model)
        if spec is not None:
            if spec.config != self.config:
                raise RuntimeError(
                    f"LoRA: {type(model).__name__} already has a LoRA adapter with another config ({spec.config}); "
                    "use one LoRA callback per model."
                )
            return  # a later stage (validate/test after fit) on the same, already adapted model
        layers = inject_lora(model, self.config)
        rank_zero_info(
            f"LoRA: adapted {len(layers)} modules of {type(model).__name__} "
            f"(rank {self.config.rank}, alpha {self.config.alpha}); {trainable_parameters(pl_module)}"
        )
        if self.adapter_only_checkpoint and self._hook is None:
            self._hook = pl_module.register_load_state_dict_pre_hook(_fill_frozen_from_model)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if not self.adapter_only_checkpoint:
            return
        frozen = _frozen_parameters(pl_module)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in frozen}


def _frozen_parameters(module) -> dict[str, Any]:
    return {k: p for k, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _fill_frozen_from_model(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """Load-state-dict pre-hook: an adapter-only state dict gets the frozen parameters from the model itself.

    Only a state dict that holds none of the frozen parameters is treated as adapter-only, so a full
    checkpoint with a missing key still fails strict loading; and only frozen parameters are filled, so
    a missing adapter key, trainable parameter or buffer fails too.
    """
    if prefix:
        return
    frozen = _frozen_parameters(module)
    if frozen and not frozen.keys() & state_dict.keys():
        for key, param in frozen.items():
            state_dict[key] = param.detach()
