"""Training dynamics in pure PyTorch (no Lightning import): curriculum learning, gradient noise, layer-wise
learning-rate decay, gradient-accumulation schedules, the annealing of token pruning."""

from .accumulation import AccumulationSchedule, shorten_window
from .curriculum import (
    CurriculumSampler,
    LengthScorer,
    LossScorer,
    compute_scores,
    pacing_fraction,
    truncate_batch,
    warmup_length,
)
from .gradient_noise import add_gradient_noise, noise_variance, parameter_generator, step_generator
from .layerwise_lr import layer_depths, layerwise_lr_groups, lr_scale
from .token_pruning import anneal_scale

__all__ = [
    "AccumulationSchedule", "CurriculumSampler", "LengthScorer", "LossScorer", "add_gradient_noise", "anneal_scale",
    "compute_scores",
    "layer_depths", "layerwise_lr_groups", "lr_scale", "noise_variance", "pacing_fraction", "shorten_window",
    "parameter_generator", "step_generator", "truncate_batch", "warmup_length",
]
