"""BOFT (Liu et al. 2023, arXiv:2311.06243): orthogonal finetuning through butterfly-factorised rotations, with an
output scale. The technique, merging and PEFT's format in `model`; the settings in `config`; the layer in `layer`."""

from .config import BOFTConfig
from .layer import BOFTLayer
from .model import BOFTAdapter, boft_layers, disable_boft, inject_boft, merge_boft, unload_boft, unmerge_boft

__all__ = ["BOFTAdapter", "BOFTConfig", "BOFTLayer", "boft_layers", "disable_boft", "inject_boft", "merge_boft",
           "unload_boft", "unmerge_boft"]
