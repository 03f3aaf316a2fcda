"""Training dynamics in pure PyTorch (no Lightning import): gradient noise, layer-wise learning-rate decay."""

from .gradient_noise import add_gradient_noise, noise_variance, step_generator
from .layerwise_lr import layer_depths, layerwise_lr_groups, lr_scale

__all__ = ["add_gradient_noise", "layer_depths", "layerwise_lr_groups", "lr_scale", "noise_variance", "step_generator"]
