"""Annealed Gaussian gradient noise.

Paper: Neelakantan et al., "Adding Gradient Noise Improves Learning for Very Deep Networks", arXiv:1511.06807.

Update rule. At optimizer step ``t`` (counted from 0) every gradient gets independent Gaussian noise whose
**variance** decays with ``t``:

```text
g <- g + N(0, sigma_t^2),    sigma_t^2 = eta / (1 + t)^gamma
```

with ``gamma = 0.55`` and ``eta`` from {0.01, 0.3, 1.0} in the paper. (Several public implementations use that
expression as the standard deviation; here it is the variance, as in the paper, and a test checks it
statistically.)

Shapes: the noise of a parameter has the parameter's **full** shape, whatever part of its gradient this process holds (a
DTensor shard under FSDP2 or tensor parallelism, a DeepSpeed partition): it is drawn on the CPU, in float32, from the
given generator (or a fresh one seeded from ``seed`` and ``t``:
[`step_generator`][lightning_peft.training.step_generator]), one parameter after the other in the order given, and each
process adds the block of it that its gradient holds (`lightning_peft._grads`). So two processes, a run and its
resumption, and a sharded run and a replicated one that agree on the seed and the parameter order add the same noise to
every element.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from lightning_peft._checks import integer, positive, real
from lightning_peft._grads import add_to_grad


def noise_variance(step: int, eta: float, gamma: float = 0.55, who: str = "add_gradient_noise") -> float:
    """``eta / (1 + step) ** gamma``: the variance of the noise at optimizer step ``step``.

    Examples:
        >>> round(noise_variance(0, 0.3), 6), round(noise_variance(99, 0.3), 6)
        (0.3, 0.02383)
    """
    _check(step, eta, gamma, who)
    return eta / (1 + step) ** gamma


def step_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator for step ``step`` of a run seeded with ``seed``: the same on every process and on resume."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))


def parameter_generator(seed: int, step: int, index: int) -> torch.Generator:
    """A CPU generator for parameter ``index`` (its position among the model's trainable parameters) at ``step``:
    each parameter's noise depends on nothing else, so a process that holds only some parameters (a pipeline
    stage) draws for them what one process holding all of them draws."""
    return step_generator((seed * 1_000_003 + index) % (2**63), step)


@torch.no_grad()
def add_gradient_noise(
    parameters: Iterable[nn.Parameter] | Iterable[torch.Tensor],
    step: int,
    eta: float,
    gamma: float = 0.55,
    generator: torch.Generator | None = None,
    grad_scale: float = 1.0,
) -> float:
    """Add ``N(0, eta / (1 + step)^gamma)`` noise in place to the gradient of every parameter that has one.

    The gradient may live wherever a strategy keeps it (``p.grad``, a DTensor, DeepSpeed's partitions: see
    `lightning_peft._grads`); under a sharded strategy every process must call this with the same parameters in
    the same order (DeepSpeed's stages 1-2 assemble each gradient with a collective).

    Args:
        parameters: The parameters (their order fixes which noise each one gets); one without a gradient gets none
            and draws nothing.
        step: The optimizer step ``t``, counted from 0.
        eta: The noise scale (variance at step 0); the paper uses 0.01, 0.3 or 1.0.
        gamma: The decay exponent.
        generator: A CPU generator to draw from; None draws from ``torch``'s global CPU generator.
        grad_scale: The factor the gradients carry now and lose before the update (a ``GradScaler``'s scale, when
            the optimizer unscales inside its step): the noise is multiplied by it, so that it comes out unscaled.

    Returns:
        The standard deviation used, ``sqrt(eta / (1 + step)^gamma)``.

    Raises:
        ValueError: If ``step``, ``eta`` or ``gamma`` is out of range.
        TypeError: If a gradient is sparse.
    """
    std = math.sqrt(noise_variance(step, eta, gamma))
    positive("add_gradient_noise", "grad_scale", grad_scale, meaning="1 for unscaled gradients")

    def draw(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32)  # (*shape): the full parameter's

    for param in parameters:
        add_to_grad(param, draw, alpha=std * grad_scale, who="add_gradient_noise")
    return std


def _check(step: object, eta: object, gamma: object, who: str) -> None:
    integer(who, "step", step, minimum=0, meaning="the optimizer step")
    positive(who, "eta", eta, meaning="0.01, 0.3 or 1.0 in the paper")
    real(who, "gamma", gamma, minimum=0, meaning="0.55 in the paper")
