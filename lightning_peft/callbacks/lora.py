"""``LoRA`` callback: low-rank adapters on a LightningModule's model, injected before the optimizer exists.

The math lives in :mod:`lightning_peft.peft`; this callback decides when to call it:

- ``setup``: :func:`~lightning_peft.peft.inject_lora` on the model (before ``configure_optimizers``, so any
  optimizer sees only trainable parameters) and a log line with the trainable-parameter report. A model that
  already has this adapter (a later ``validate``/``test``, or ``inject_lora`` in the module's ``__init__``) is
  used as it is, if the config agrees;
- ``on_save_checkpoint``: every checkpoint records the adapters (``checkpoint["lightning_peft"]``, see
  :mod:`lightning_peft.callbacks._checkpoint`), so ``load_from_checkpoint`` can rebuild them; with
  ``adapter_only_checkpoint=True`` it drops the frozen base parameters (those no adapter owns) and keeps
  everything else: the adapters, trained biases, ``modules_to_save``, any other trainable parameter, and the
  buffers (cheap, and e.g. BatchNorm statistics keep changing while the base is frozen);
- loading (``Trainer.fit(ckpt_path=...)``, ``trainer.test(ckpt_path=...)``): before any weight is copied, the
  checkpoint's adapter config is compared with this run's (a different rank, alpha or target set is refused,
  naming both values); an adapter-only checkpoint takes the frozen parameters from the model as built.

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_peft.callbacks.LoRA
          init_args: {rank: 8, alpha: 16, target_modules: [query, value], modules_to_save: [classifier]}
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_peft._hardware import cpu_bf16_is_native
from lightning_peft.callbacks._checkpoint import (
    AdapterCallback,
    TRAINING_ONLY,
    refuse_changed_settings,
    watch_checkpoint_loads,
)
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.peft.lora import as_config, inject_lora, lora_spec, trainable_parameters



class LoRA(AdapterCallback):
    """Inject LoRA adapters into the model at ``setup`` and freeze the rest.

    Args:
        rank: Rank of the updates.
        alpha: Scale numerator (update scaled by ``alpha / rank``, or ``alpha / sqrt(rank)`` with ``use_rslora``).
        dropout: Dropout on the adapter input, in [0, 1).
        target_modules: Names or dotted suffixes (list), a regular expression (string), or ``"all-linear"``.
        exclude_modules: Modules never adapted (same rules).
        modules_to_save: Modules trained and saved in full, e.g. ``["classifier"]``. None: the task head of a
            Hugging Face task model (``*ForSequenceClassification``, ...); ``[]``: none.
        rank_pattern: Per-module rank overrides ``{regex: rank}``.
        alpha_pattern: Per-module alpha overrides ``{regex: alpha}``.
        bias: ``"none"``, ``"lora_only"`` or ``"all"``: which biases train.
        init: ``"kaiming"`` or ``"gaussian"`` initialisation of ``A`` (``B`` starts at zero).
        use_rslora: Rank-stabilised scaling.
        adapter_only_checkpoint: Checkpoints hold only what trains (and buffers); loading takes the frozen base
            from the model as constructed.
        model_attribute: Dotted path of the model inside the LightningModule; ``""`` for the LightningModule
            itself (then a head outside the Hugging Face model can be in ``modules_to_save``). Default: the one
            Hugging Face model inside the LightningModule, else the LightningModule itself. Adapter key paths
            are relative to this model.
    """

    who = "LoRA"

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
        **peft_names: Any,
    ) -> None:
        fields = {
            "rank": rank, "alpha": alpha, "dropout": dropout, "target_modules": target_modules,
            "exclude_modules": exclude_modules, "modules_to_save": modules_to_save,
            "rank_pattern": dict(rank_pattern or {}), "alpha_pattern": dict(alpha_pattern or {}),
            "bias": bias, "init": init, "use_rslora": use_rslora,
        }
        self.config = as_config(None, {**fields, **peft_names}, "LoRA")
        self.adapter_only_checkpoint = adapter_only_checkpoint
        self.model_attribute = model_attribute

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        _warn_about_emulated_bf16(trainer)
        _, model = resolve_target(pl_module, self.model_attribute, "LoRA")
        spec = lora_spec(model)
        if spec is None:
            layers = inject_lora(model, self.config)
            rank_zero_info(
                f"LoRA: adapted {len(layers)} modules of {type(model).__name__} "
                f"(rank {self.config.rank}, alpha {self.config.alpha}"
                f"{', saving ' + ', '.join(lora_spec(model).modules_to_save) + ' in full' if lora_spec(model).modules_to_save else ''}"
                f"); {trainable_parameters(pl_module)}"
            )
        elif spec.config != self.config:
            raise RuntimeError(
                f"LoRA: {type(model).__name__} already has a LoRA adapter with another config ({spec.config}); "
                "use one LoRA callback per model, with the config the model was adapted with."
            )
        watch_checkpoint_loads(pl_module, "LoRA")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse_changed_settings("LoRA", state_dict.get("config") or {}, self.config.to_dict(), TRAINING_ONLY)



def _warn_about_emulated_bf16(trainer: pl.Trainer) -> None:
    precision = str(trainer.precision)
    if precision.startswith("bf16") and isinstance(trainer.accelerator, CPUAccelerator) and not cpu_bf16_is_native():
        rank_zero_warn(
            f"LoRA: Trainer(precision={precision!r}) on a CPU without native bf16 (no AVX512-BF16 or AMX): PyTorch "
            "emulates it, and a LoRA training step runs many times slower than in float32 (17x measured on such a "
            "CPU). Use precision='32-true' on this machine; bf16 pays on GPUs and on CPUs with AVX512-BF16/AMX."
        )
