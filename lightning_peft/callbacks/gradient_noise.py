"""``GradientNoise`` callback: annealed Gaussian noise on the gradients, once per optimizer step.

The math lives in :mod:`lightning_peft.training.gradient_noise`; this callback decides when to call it:
``on_before_optimizer_step``, which Lightning runs once per optimizer step (after the last micro-batch under
gradient accumulation), after AMP has unscaled the gradients and before gradient clipping. Only trainable
parameters get noise, with ``t`` = the optimizer step (``trainer.global_step``). The noise of step ``t`` comes from
a generator seeded with ``(seed, t)``, so every DDP rank adds the same noise (replicas stay identical) and a resumed
run draws what the straight run drew. The standard deviation is logged as ``grad_noise_std``.

YAML::

    - class_path: lightning_peft.callbacks.GradientNoise
      init_args: {eta: 0.01, gamma: 0.55}
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer
from typing_extensions import override

from lightning_peft.training.gradient_noise import add_gradient_noise, noise_variance, step_generator


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
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"GradientNoise(seed={seed!r}): seed must be an integer.")
        self.eta, self.gamma, self.seed, self.log_std = eta, gamma, seed, log

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        step = trainer.global_step
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        std = add_gradient_noise(params, step, self.eta, self.gamma, generator=step_generator(self.seed, step))
        if self.log_std:
            pl_module.log("grad_noise_std", std, on_step=True, on_epoch=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"eta": self.eta, "gamma": self.gamma, "seed": self.seed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {k: state_dict.get(k) for k in ("eta", "gamma", "seed")}
        now = self.state_dict()
        if saved != now:
            raise ValueError(
                f"GradientNoise: the checkpoint was trained with {saved}; this run has {now}. Resume with the "
                "checkpoint's settings, or start a new run without ckpt_path."
            )
