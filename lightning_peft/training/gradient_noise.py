"""Annealed Gaussian gradient noise.

Paper: Neelakantan et al., "Adding Gradient Noise Improves Learning for Very Deep Networks", arXiv:1511.06807.

Update rule. At optimizer step ``t`` (counted from 0) every gradient gets independent Gaussian noise whose
**variance** decays with ``t``::

    g <- g + N(0, sigma_t^2),    sigma_t^2 = eta / (1 + t)^gamma

with ``gamma = 0.55`` and ``eta`` from {0.01, 0.3, 1.0} in the paper. (Several public implementations use that
expression as the standard deviation; here it is the variance, as in the paper, and a test checks it
statistically.)

Shapes: the noise has each gradient's shape, dtype and device. It is drawn on the CPU from the given generator
(or a fresh one seeded from ``seed`` and ``t``: :func:`step_generator`), so that two processes, or a run and
its resumption, that agree on the seed draw the same noise.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
from torch import nn


def noise_variance(step: int, eta: float, gamma: float = 0.55, who: str = "add_gradient_noise") -> float:
    """``eta / (1 + step) ** gamma``: the variance of the noise at optimizer step ``step``.

    Example:
        >>> round(noise_variance(0, 0.3), 6), round(noise_variance(99, 0.3), 6)
        (0.3, 0.02383)
    """
    _check(step, eta, gamma, who)
    return eta / (1 + step) ** gamma


def step_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator for step ``step`` of a run seeded with ``seed``: the same on every process and on resume."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))


@torch.no_grad()
def add_gradient_noise(
    parameters: Iterable[nn.Parameter] | Iterable[torch.Tensor],
    step: int,
    eta: float,
    gamma: float = 0.55,
    generator: torch.Generator | None = None,
) -> float:
    """Add ``N(0, eta / (1 + step)^gamma)`` noise in place to the ``.grad`` of every parameter that has one.

    Args:
        parameters: The parameters (their order fixes which noise each one gets).
        step: The optimizer step ``t``, counted from 0.
        eta: The noise scale (variance at step 0); the paper uses 0.01, 0.3 or 1.0.
        gamma: The decay exponent.
        generator: A CPU generator to draw from; None draws from ``torch``'s global CPU generator.

    Returns:
        The standard deviation used, ``sqrt(eta / (1 + step)^gamma)``.

    Raises:
        ValueError: If ``step``, ``eta`` or ``gamma`` is out of range.
        TypeError: If a gradient is sparse.
    """
    std = math.sqrt(noise_variance(step, eta, gamma))
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse:
            raise TypeError("add_gradient_noise: a sparse gradient cannot take dense noise; use a dense gradient.")
        noise = torch.randn(grad.shape, generator=generator, dtype=torch.float32)  # (*grad.shape)
        grad.add_(noise.to(device=grad.device, dtype=grad.dtype), alpha=std)
    return std


def _check(step: object, eta: object, gamma: object, who: str) -> None:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"{who}(step={step!r}): step must be an integer >= 0 (the optimizer step).")
    if isinstance(eta, bool) or not isinstance(eta, numbers.Real) or not (eta > 0 and math.isfinite(eta)):
        raise ValueError(f"{who}(eta={eta!r}): eta must be a positive, finite number (0.01, 0.3 or 1.0 in the paper).")
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real) or not (gamma >= 0 and math.isfinite(gamma)):
        raise ValueError(f"{who}(gamma={gamma!r}): gamma must be a finite number >= 0 (0.55 in the paper).")
