"""AdaLoRA (Zhang et al. 2023, arXiv:2303.10512): LoRA in SVD form whose rank budget is allocated during training by
importance. The technique, merging and PEFT's format in `model`; the schedule in `allocator`; the settings in
`config`; the layer in `layer`."""

from .allocator import RankAllocator, orthogonal_regularization
from .config import AdaLoraConfig
from .layer import SVDLayer
from .model import (
    AdaLoraAdapter,
    adalora_layers,
    add_orthogonal_gradient,
    disable_adalora,
    inject_adalora,
    merge_adalora,
    orthogonal_loss,
    start_allocation,
    unload_adalora,
    unmerge_adalora,
    update_and_allocate,
)

__all__ = ["AdaLoraAdapter", "AdaLoraConfig", "RankAllocator", "SVDLayer", "adalora_layers", "add_orthogonal_gradient",
           "disable_adalora", "inject_adalora", "merge_adalora", "orthogonal_loss", "orthogonal_regularization",
           "start_allocation", "unload_adalora", "unmerge_adalora", "update_and_allocate"]
