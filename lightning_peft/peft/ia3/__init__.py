"""IA³ (Liu et al. 2022, arXiv:2205.05638): learned vectors that rescale chosen layers' outputs or inputs. The
technique, merging, named adapters and PEFT's format in `model`; the settings in `config`; the layer in `layer`."""

from .config import IA3Config
from .layer import IA3Layer
from .model import (
    IA3Adapter,
    active_ia3_adapter,
    add_ia3_adapter,
    delete_ia3_adapter,
    disable_ia3,
    ia3_layers,
    inject_ia3,
    merge_ia3,
    set_ia3_adapter,
    unload_ia3,
    unmerge_ia3,
)

__all__ = ["IA3Adapter", "IA3Config", "IA3Layer", "active_ia3_adapter", "add_ia3_adapter", "delete_ia3_adapter",
           "disable_ia3", "ia3_layers", "inject_ia3", "merge_ia3", "set_ia3_adapter", "unload_ia3", "unmerge_ia3"]
