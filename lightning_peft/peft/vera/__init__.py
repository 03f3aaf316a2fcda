"""VeRA (Kopiczko et al. 2023, arXiv:2310.11454): shared frozen random projections and two trained vectors per layer.
The technique, merging and PEFT's format in `model`; the settings in `config`; the layer and the projections in
`layer`."""

from .config import VeraConfig
from .layer import Projections, VeraLayer
from .model import VeraAdapter, disable_vera, inject_vera, merge_vera, unload_vera, unmerge_vera, vera_layers

__all__ = ["Projections", "VeraAdapter", "VeraConfig", "VeraLayer", "disable_vera", "inject_vera", "merge_vera",
           "unload_vera", "unmerge_vera", "vera_layers"]
