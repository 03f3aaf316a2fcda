"""Training dynamics in pure PyTorch (no Lightning import): gradient noise."""

from .gradient_noise import add_gradient_noise, noise_variance, step_generator

__all__ = ["add_gradient_noise", "noise_variance", "step_generator"]
