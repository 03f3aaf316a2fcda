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
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_peft._hardware import cpu_bf16_is_native
from lightning_peft.callbacks._checkpoint import (
    KEY,
    TRAINING_ONLY,
    check_same_adapters,
    fill_frozen,
    frozen_base,
    record_adapters,
)
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.peft.lora import as_config, inject_lora, lora_spec, trainable_parameters

_HOOKED = "_lightning_peft_load_hook"


class LoRA(Callback):
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
        if not getattr(pl_module, _HOOKED, False):
            pl_module.register_load_state_dict_pre_hook(_load_hook)
            setattr(pl_module, _HOOKED, True)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _, model = resolve_target(pl_module, self.model_attribute, "LoRA")
        _check_optimizer_holds_adapters(trainer, model)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        record_adapters(pl_module, checkpoint, self.adapter_only_checkpoint)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("config")
        now = self.config.to_dict()
        differing = [k for k in (saved or {}) if saved[k] != now.get(k) and k not in TRAINING_ONLY]
        if differing:
            raise ValueError(
                "LoRA: the checkpoint was trained with "
                + ", ".join(f"{k}={saved[k]!r}" for k in differing)
                + "; this run has " + ", ".join(f"{k}={self.config.to_dict()[k]!r}" for k in differing)
                + ". Resume with the checkpoint's settings, or start a new run without ckpt_path."
            )


def _check_optimizer_holds_adapters(trainer: pl.Trainer, model: nn.Module) -> None:
    """Raises if the optimizers hold the model's frozen parameters but none that trains.

    That is an optimizer built before LoRA injected its adapters: LightningCLI's ``optimizer:`` section builds it
    over ``model.parameters()`` before the Trainer starts, and such a run would train nothing. (Strategies that
    flatten parameters into their own buffers, as DeepSpeed's ZeRO does, hold none of the model's parameters and are
    not checked.)
    """
    held = {id(p) for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]}
    named = list(model.named_parameters())
    trained = [name for name, p in named if p.requires_grad]
    if not trained or any(id(p) in held for name, p in named if p.requires_grad):
        return
    if any(id(p) in held for _, p in named):
        raise RuntimeError(
            f"LoRA: the optimizer holds none of the {len(trained)} parameters that train ({trained[0]}, ...): it was "
            "built before LoRA injected its adapters, so this run would train nothing. LightningCLI's optimizer: "
            "section does that (it builds the optimizer over model.parameters() before the Trainer starts); build the "
            "optimizer in the LightningModule's configure_optimizers instead (HFSequenceClassifier has one: drop the "
            "optimizer: and lr_scheduler: sections)."
        )


def _warn_about_emulated_bf16(trainer: pl.Trainer) -> None:
    precision = str(trainer.precision)
    if precision.startswith("bf16") and isinstance(trainer.accelerator, CPUAccelerator) and not cpu_bf16_is_native():
        rank_zero_warn(
            f"LoRA: Trainer(precision={precision!r}) on a CPU without native bf16 (no AVX512-BF16 or AMX): PyTorch "
            "emulates it, and a LoRA training step runs many times slower than in float32 (17x measured on such a "
            "CPU). Use precision='32-true' on this machine; bf16 pays on GPUs and on CPUs with AVX512-BF16/AMX."
        )


def _load_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """Load-state-dict pre-hook on the LightningModule, run before Lightning copies a checkpoint's weights.

    It refuses a checkpoint whose adapters differ from this run's (naming both values, instead of torch's
    size-mismatch dump), and completes an adapter-only state dict with the parameters it recorded as left out,
    taken from the model as built. Outside a Trainer (a manual ``load_state_dict``) a state dict that holds none
    of the frozen base parameters is taken as adapter-only; a full one with a missing key still fails.
    """
    if prefix:
        return
    # Lightning keeps the checkpoint it is restoring on its checkpoint connector (the trainer is looked up
    # now, not kept: the module may meet another Trainer, and hooks are copied with the module).
    connector = getattr(getattr(module, "_trainer", None), "_checkpoint_connector", None)
    entry = (getattr(connector, "_loaded_checkpoint", None) or {}).get(KEY)
    if entry is not None:
        check_same_adapters(entry, module, "LoRA")
        if entry.get("adapter_only"):
            fill_frozen(module, state_dict, entry.get("dropped", []))
        return
    frozen = frozen_base(module)
    if frozen and not frozen.keys() & state_dict.keys():
        fill_frozen(module, state_dict, list(frozen))
