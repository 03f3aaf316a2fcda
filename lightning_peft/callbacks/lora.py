"""``LoRA`` callback: low-rank adapters on a LightningModule's model, injected before the optimizer exists.

The math lives in :mod:`lightning_peft.peft`; this callback decides when to call it:

- ``setup``: :func:`~lightning_peft.peft.inject_lora` on the model (before ``configure_optimizers``, so any
  optimizer sees only trainable parameters) and a log line with the trainable-parameter report;
- ``on_save_checkpoint``: with ``adapter_only_checkpoint=True`` the checkpoint keeps only the adapter,
  trained biases and ``modules_to_save`` (plus any other trainable parameter);
- loading such a checkpoint (``Trainer.fit(ckpt_path=...)``, ``trainer.test(ckpt_path=...)``) takes the frozen
  base weights from the model as built, i.e. from its original source.

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

from lightning_peft.callbacks._target import prefixed, resolve_target
from lightning_peft.peft.lora import LoRAConfig, adapter_state_dict, inject_lora, lora_spec, trainable_parameters


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
        name, model = resolve_target(pl_module, self.model_attribute, "LoRA")
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

    def _kept_keys(self, pl_module: pl.LightningModule) -> set[str]:
        name, model = resolve_target(pl_module, self.model_attribute, "LoRA")
        kept = prefixed(name, adapter_state_dict(model))
        return kept | {k for k, p in pl_module.named_parameters() if p.requires_grad}

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if not self.adapter_only_checkpoint:
            return
        kept = self._kept_keys(pl_module)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in kept}


def _fill_frozen_from_model(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """Load-state-dict pre-hook: an adapter-only state dict gets the frozen weights from the model itself.

    Only a state dict that holds none of the frozen parameters is treated as adapter-only, so a full
    checkpoint with a missing key still fails strict loading.
    """
    if prefix:
        return
    current = module.state_dict()
    frozen = {k for k, p in module.named_parameters() if not p.requires_grad}
    if frozen and not frozen & state_dict.keys():
        for key, value in current.items():
            state_dict.setdefault(key, value)
