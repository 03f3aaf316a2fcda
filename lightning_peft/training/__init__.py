"""Training dynamics in pure PyTorch (no Lightning import): gradient noise, layer-wise learning-rate decay,
gradient-accumulation schedules."""

from .accumulation import AccumulationSchedule, shorten_window
from .gradient_noise import add_gradient_noise, noise_variance, step_generator
from .layerwise_lr import layer_depths, layerwise_lr_groups, lr_scale

__all__ = [
    "AccumulationSchedule", "add_gradient_noise", "layer_depths", "layerwise_lr_groups", "lr_scale", "noise_variance",
    "shorten_window", "step_generator",
]
