"""OFT (Qiu et al. 2023, arXiv:2306.07280; PEFT 0.21's revision, arXiv:2506.19847): a learned block-diagonal orthogonal
rotation of chosen layers' inputs. The technique, merging and PEFT's format in `model`; the settings in `config`; the
layer and the rotation in `layer`."""

from .config import OFTConfig
from .layer import OFTLayer
from .model import OFTAdapter, disable_oft, inject_oft, merge_oft, oft_layers, unload_oft, unmerge_oft

__all__ = ["OFTAdapter", "OFTConfig", "OFTLayer", "disable_oft", "inject_oft", "merge_oft", "oft_layers",
           "unload_oft", "unmerge_oft"]
