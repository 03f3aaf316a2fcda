"""What the LightningModules built from `lightning_peft.nn` share: argument checks, AdamW with a per-step linear
warm-up and decay, and the `MoE` auxiliary losses."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_peft.modules.hf import adamw_with_warmup
from lightning_peft.nn.transformer import moe_aux_loss, moe_layers

__all__ = ["add_moe_losses"]


def _check_args(who: str, learning_rate: float, weight_decay: float, warmup_fraction: float) -> None:
    """Validates the optimisation arguments shared by both modules."""
    if not learning_rate > 0:
        raise ValueError(
            f"{who}(learning_rate={learning_rate!r}): learning_rate must be positive, e.g. 1e-3."
        )
    if not weight_decay >= 0:
        raise ValueError(f"{who}(weight_decay={weight_decay!r}): weight_decay must be >= 0, e.g. 0.01.")
    if not 0 <= warmup_fraction < 1:
        raise ValueError(
            f"{who}(warmup_fraction={warmup_fraction!r}): warmup_fraction must be in [0, 1), e.g. 0.06."
        )


def _check_options(who: str, name: str, options: object) -> dict[str, Any]:
    """A copy of the ``encoder`` / ``decoder`` keyword dict (never the caller's object)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(
            f"{who}({name}={options!r}): {name} must be a dict of constructor arguments, e.g. "
            "{'hidden_size': 256, 'num_layers': 4}, got " + type(options).__name__ + "."
        )
    return dict(options)


def _adamw_with_schedule(module: LightningModule, who: str) -> dict[str, Any]:
    """AdamW over the trainable parameters (matrices decayed) with a per-step linear warm-up and decay."""
    hparams = module.hparams
    return adamw_with_warmup(module, who, hparams.learning_rate, hparams.weight_decay, hparams.warmup_fraction)


def add_moe_losses(module: LightningModule, model: nn.Module, loss: Tensor, batch_size: int) -> Tensor:
    """``loss`` plus the auxiliary losses of the `MoE` layers in ``model`` (their last forward), logged with expert
    utilisation: ``train_moe_aux_loss``, ``train_moe_max_load`` (the busiest expert's share of assignments times the
    number of experts, averaged over layers: 1.0 is a perfect balance) and ``train_moe_dropped`` (share of assignments
    over capacity). ``loss`` unchanged for a dense model."""
    aux = moe_aux_loss(model)
    if aux is None:
        return loss
    stats = [layer.last_stats for layer in moe_layers(model).values() if layer.last_stats]
    max_load = sum(float(s["load"].max()) * s["load"].numel() for s in stats) / max(1, len(stats))
    dropped = sum(float(s["dropped_fraction"]) for s in stats) / max(1, len(stats))
    module.log("train_moe_aux_loss", aux, batch_size=batch_size)
    module.log("train_moe_max_load", max_load, batch_size=batch_size)
    module.log("train_moe_dropped", dropped, batch_size=batch_size)
    return loss + aux
