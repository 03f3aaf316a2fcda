"""``BottleneckAdapters`` callback: Houlsby / Pfeiffer bottleneck adapters on a LightningModule's model.

The math lives in :mod:`lightning_peft.peft.bottleneck`; this callback decides when to call it:

- ``setup``: :func:`~lightning_peft.peft.bottleneck.inject_bottleneck_adapters` on the model (before
  ``configure_optimizers``, so the optimizer sees only what trains) and a log line with the trainable-parameter
  report. A model that already has bottleneck adapters (a later ``validate``/``test``, or an injection in the
  module's ``__init__``) is used as it is if the config agrees, and refused otherwise;
- ``on_save_checkpoint``: every checkpoint records the adapters (``checkpoint["lightning_peft"]``, see
  :mod:`lightning_peft.callbacks._checkpoint`), so ``load_from_checkpoint`` and ``Trainer.fit(ckpt_path=...)``
  rebuild them; with ``adapter_only_checkpoint=True`` the frozen base parameters are left out;
- loading: the checkpoint's adapter config is compared with this run's before any weight is copied (a different
  placement, size or non-linearity is refused, naming both values); an adapter-only checkpoint takes the frozen
  parameters from the model as built.

With the ``LoRA`` callback on the same model, list ``BottleneckAdapters`` first: callbacks set up in list order,
and LoRA then adapts the layers inside the bottleneck wrappers (the other order is refused with that advice when
both pick the same modules).

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_peft.callbacks.BottleneckAdapters
          init_args: {placement: pfeiffer, reduction_factor: 16, non_linearity: relu, modules_to_save: [classifier]}
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._checkpoint import (
    AdapterCallback,
    refuse_changed_settings,
    watch_checkpoint_loads,
)
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.peft.adapter import attached
from lightning_peft.peft.bottleneck import BottleneckConfig, inject_bottleneck_adapters
from lightning_peft.peft.adapter import trainable_parameters

# Settings that only steer training: a resumed run may change them.
_TRAINING_ONLY = ("dropout", "init_scale")


class BottleneckAdapters(AdapterCallback):
    """Inject bottleneck adapters into the model at ``setup`` and freeze the rest.

    Args:
        placement: ``"houlsby"`` (after the attention and the feed-forward output of every layer) or
            ``"pfeiffer"`` (after the feed-forward output) on BERT-, GPT-2- and Llama-style models. None:
            ``"houlsby"`` unless ``target_modules`` is given.
        reduction_factor: Bottleneck ``max(1, d // reduction_factor)`` for output size ``d``. None: 16 unless
            ``bottleneck_size`` is given.
        bottleneck_size: The bottleneck size of every adapter, instead of a reduction factor.
        non_linearity: ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"`` / ``"swish"`` or ``"tanh"``.
        target_modules: For other models: names or dotted suffixes (list) or a regular expression (string).
        dropout: Dropout on the adapter output, in [0, 1).
        init_scale: Standard deviation of the truncated-normal initialisation of the down-projection.
        modules_to_save: Modules trained and saved in full, e.g. ``["classifier"]``. None: the task head of a
            Hugging Face task model; ``[]``: none.
        adapter_only_checkpoint: Checkpoints hold only what trains (and buffers); loading takes the frozen base
            from the model as constructed.
        model_attribute: Dotted path of the model inside the LightningModule; ``""`` for the LightningModule
            itself. Default: the one Hugging Face model inside the LightningModule, else the LightningModule.
    """

    who = "BottleneckAdapters"

    def __init__(
        self,
        placement: Literal["houlsby", "pfeiffer"] | None = None,
        reduction_factor: float | None = None,
        bottleneck_size: int | None = None,
        non_linearity: str = "relu",
        target_modules: list[str] | str | None = None,
        dropout: float = 0.0,
        init_scale: float = 1e-2,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        self.config = BottleneckConfig(
            placement=placement, target_modules=target_modules, reduction_factor=reduction_factor,
            bottleneck_size=bottleneck_size, non_linearity=non_linearity, dropout=dropout, init_scale=init_scale,
            modules_to_save=modules_to_save,
        )
        self.adapter_only_checkpoint = adapter_only_checkpoint
        self.model_attribute = model_attribute

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        _, model = resolve_target(pl_module, self.model_attribute, "BottleneckAdapters")
        spec = attached(model).get("bottleneck")
        if spec is None:
            layers = inject_bottleneck_adapters(model, self.config)
            saved = attached(model)["bottleneck"].modules_to_save
            rank_zero_info(
                f"BottleneckAdapters: {len(layers)} adapters in {type(model).__name__} "
                f"({self.config.placement or 'target_modules'}, non-linearity {self.config.non_linearity}"
                f"{', saving ' + ', '.join(saved) + ' in full' if saved else ''}); {trainable_parameters(pl_module)}"
            )
        elif spec.config != self.config:
            raise RuntimeError(
                f"BottleneckAdapters: {type(model).__name__} already has bottleneck adapters with another config "
                f"({spec.config}); use one BottleneckAdapters callback per model, with the config the model was "
                "adapted with."
            )
        watch_checkpoint_loads(pl_module, "BottleneckAdapters")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse_changed_settings("BottleneckAdapters", state_dict.get("config") or {}, self.config.to_dict(),
                                _TRAINING_ONLY)

