"""``GradientNoise`` callback: annealed Gaussian noise on the gradients, once per optimizer step.

The math lives in `lightning_peft.training.gradient_noise`; this callback decides when to call it:
``on_before_optimizer_step``, which Lightning runs once per optimizer step (after the last micro-batch under
gradient accumulation), after AMP has unscaled the gradients and before gradient clipping. Only trainable
parameters get noise, with ``t`` = the optimizer step (``trainer.global_step``). The noise of step ``t`` comes from
a generator seeded with ``(seed, t)`` and is drawn for each parameter's full shape in the LightningModule's
parameter order, so every rank adds the same noise to every element, a resumed run draws what the straight run
drew, and the strategies agree: the gradient is changed where the strategy keeps it (``p.grad``, DTensor shards
under FSDP2 and tensor parallelism, DeepSpeed's partitions at every ZeRO stage; `lightning_peft._grads`),
so a sharded run adds what DDP adds. The standard deviation is logged as ``grad_noise_std``.

Under DeepSpeed, Lightning calls the hook at every micro-batch when accumulating; the noise goes in only at the
engine's accumulation boundary, after the reduction, onto the reduced gradient (as under DDP), before the engine
clips and steps. With a ``GradScaler`` and an optimizer that unscales inside its step (``fused=True``), Lightning
does not unscale before the hook: the noise is multiplied by the current scale, so it comes out unscaled. DeepSpeed's
own fp16 loss scaling is refused at setup (untested: fp16 does not run on CPUs).

YAML:

```yaml
- class_path: lightning_peft.callbacks.GradientNoise
  init_args: {eta: 0.01, gamma: 0.55}
```
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_peft._checks import integer
from lightning_peft._seams import refuse, strategy_family
from lightning_peft.callbacks._lightning import refuse_changed_settings
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.training.gradient_noise import add_gradient_noise, noise_variance, parameter_generator


class GradientNoise(Callback):
    """Add ``N(0, eta / (1 + t)^gamma)`` to every trainable gradient at optimizer step ``t``.

    Args:
        eta: Noise variance at step 0 (0.01, 0.3 or 1.0 in the paper).
        gamma: Decay exponent of the variance.
        seed: Seed of the noise; with the step it fixes each step's draw.
        log: Log the standard deviation as ``grad_noise_std``.
    """

    def __init__(self, eta: float = 0.01, gamma: float = 0.55, seed: int = 0, log: bool = True) -> None:
        noise_variance(0, eta, gamma, who="GradientNoise")  # checks eta and gamma now, not at the first step
        integer("GradientNoise", "seed", seed)
        self.eta, self.gamma, self.seed, self.log_std = eta, gamma, seed, log

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if stage == "fit" and strategy_family(strategy) == "deepspeed" and _deepspeed_fp16(strategy):
            raise refuse(
                "GradientNoise", strategy,
                "DeepSpeed's fp16 keeps the gradients multiplied by its dynamic loss scale until the engine's step, "
                "so noise added before it would shrink by that scale (this pair is untested: fp16 does not run on "
                "CPUs)", "use precision='bf16-mixed' or '32-true' with DeepSpeed, or GradientNoise under DDP or native "
                "ZeRO (ZeROStrategy(backend='native'))",
            )
        keep_rng(trainer)  # resume draws what the straight run drew (dropout; the noise has its own generators)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        family = strategy_family(trainer.strategy)
        if family == "deepspeed" and not trainer.strategy.model.is_gradient_accumulation_boundary():
            return  # Lightning's own DeepSpeedStrategy lets the engine accumulate and calls the hook every micro-batch
        step, scale = trainer.global_step, _grad_scale(trainer, optimizer)
        std = math.sqrt(noise_variance(step, self.eta, self.gamma))
        for index, param in _noised(pl_module, optimizer, family):
            add_gradient_noise([param], step, self.eta, self.gamma, grad_scale=scale,
                               generator=parameter_generator(self.seed, step, index))
        if self.log_std:
            pl_module.log("grad_noise_std", std, on_step=True, on_epoch=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"eta": self.eta, "gamma": self.gamma, "seed": self.seed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse_changed_settings("GradientNoise", {k: state_dict.get(k) for k in self.state_dict()}, self.state_dict())


def _noised(pl_module: nn.Module, optimizer: Optimizer, family: str) -> list[tuple[int, nn.Parameter]]:
    """The trainable parameters ``optimizer`` steps with their positions among the LightningModule's trainable
    parameters: the same under every strategy (the groups' order is not: layer-wise decay regroups them; a pipeline
    stage's optimizer holds only its stage's), so each parameter draws its own noise wherever it lives."""
    trainable = [p for p in pl_module.parameters() if p.requires_grad]
    if family == "deepspeed":  # the engine's optimizer holds flat copies; DeepSpeed runs one optimizer
        return list(enumerate(trainable))
    held = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    ids = {id(p) for p in held}
    ordered = [(i, p) for i, p in enumerate(trainable) if id(p) in ids]
    inside = {id(p) for _, p in ordered}
    outside = [p for p in held if id(p) not in inside]  # any the optimizer holds outside the module
    return ordered + list(enumerate(outside, start=len(trainable)))


def _grad_scale(trainer: pl.Trainer, optimizer: Optimizer) -> float:
    """The scale the gradients still carry at the hook: a GradScaler's, when the optimizer unscales inside its step
    (Lightning unscales before the hook otherwise)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled() or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return 1.0
    return float(scaler.get_scale())


def _deepspeed_fp16(strategy: Any) -> bool:
    """Whether DeepSpeed runs with fp16 (and so with its own loss scaler)."""
    precision = str(getattr(strategy.precision_plugin, "precision", ""))
    fp16 = (getattr(strategy, "config", None) or {}).get("fp16") or {}
    return precision.startswith("16") or bool(fp16.get("enabled"))
