"""``PrefixTuning`` callback: trained key/value prefixes on a LightningModule's Hugging Face model.

The technique lives in :mod:`lightning_peft.peft.prefix_tuning`; this callback decides when to call it:

- ``setup``: :func:`~lightning_peft.peft.prefix_tuning.inject_prefix_tuning` on the model (before
  ``configure_optimizers``, so the optimizer sees only what trains) and a log line with the trainable-parameter
  report. A model that already has a prefix (a later ``validate``/``test``) is used as it is, if the config agrees;
- ``on_save_checkpoint``: every checkpoint records the adapters (see :mod:`lightning_peft.callbacks._checkpoint`),
  with the projection MLP while training runs, so a resumed run continues the same MLP; with
  ``adapter_only_checkpoint=True`` the frozen base parameters are left out;
- ``on_fit_end``: with ``prefix_projection=True`` the MLP is folded into the table it produces
  (:func:`~lightning_peft.peft.prefix_tuning.fold_prefix_projection`), so what is saved or exported afterwards is
  the plain prefix (what PEFT saves as ``prompt_embeddings``);
- loading (``Trainer.fit(ckpt_path=...)``): the checkpoint's adapter config is compared with this run's before any
  weight is copied; an adapter-only checkpoint takes the frozen parameters from the model as built.

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_peft.callbacks.PrefixTuning
          init_args: {num_virtual_tokens: 20, prefix_projection: true, modules_to_save: [classifier]}
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_peft._seams import refuse, tensor_parallel_size
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._checkpoint import (
    AdapterCallback,
    refuse_changed_settings,
    watch_checkpoint_loads,
)
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.peft.adapter import trainable_parameters
from lightning_peft.peft.prefix_tuning import (
    PrefixTuningConfig,
    fold_prefix_projection,
    inject_prefix_tuning,
    prefix_tuning_spec,
)



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

    who = "PrefixTuning"

    def __init__(
        self,
        num_virtual_tokens: int = 20,
        prefix_projection: bool = False,
        encoder_hidden_size: int | None = None,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        self.config = PrefixTuningConfig(num_virtual_tokens, prefix_projection, encoder_hidden_size, modules_to_save)
        self.adapter_only_checkpoint = adapter_only_checkpoint
        self.model_attribute = model_attribute

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if tensor_parallel_size(trainer.strategy) > 1:
            raise refuse("PrefixTuning", trainer.strategy, "the prefix holds every attention head's keys and values, "
                         "while tensor parallelism gives each rank a share of the heads", "use LoRA or prompt tuning "
                         "under tensor parallelism, or prefix tuning under DDP or ZeRO")
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        _, model = resolve_target(pl_module, self.model_attribute, "PrefixTuning")
        spec = prefix_tuning_spec(model)
        if spec is None:
            inject_prefix_tuning(model, **self.config.to_dict())
            spec = prefix_tuning_spec(model)
            saved = f", saving {', '.join(spec.modules_to_save)} in full" if spec.modules_to_save else ""
            rank_zero_info(
                f"PrefixTuning: {self.config.num_virtual_tokens} virtual tokens on {type(model).__name__}"
                f"{' through a projection MLP' if self.config.prefix_projection else ''}{saved}; "
                f"{trainable_parameters(pl_module)}"
            )
        elif not _agrees(spec.config, self.config):
            raise RuntimeError(
                f"PrefixTuning: {type(model).__name__} already has a prefix with another config ({spec.config}); "
                "use one PrefixTuning callback per model, with the config the model was adapted with."
            )
        watch_checkpoint_loads(pl_module, "PrefixTuning")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.prefix_projection:
            _, model = resolve_target(pl_module, self.model_attribute, "PrefixTuning")
            fold_prefix_projection(model)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse_changed_settings("PrefixTuning", state_dict.get("config") or {}, self.config.to_dict())


def _agrees(existing: PrefixTuningConfig, asked: PrefixTuningConfig) -> bool:
    """The model's prefix is the one asked for (a folded projection counts as the projection it came from)."""
    if existing.num_virtual_tokens != asked.num_virtual_tokens:
        return False
    if asked.modules_to_save is not None and existing.modules_to_save is not None:
        if list(existing.modules_to_save) != list(asked.modules_to_save):
            return False
    if existing.prefix_projection:
        return (asked.prefix_projection, asked.encoder_hidden_size) == (True, existing.encoder_hidden_size)
    return True  # a table: trained without projection, or folded at the end of a fit
