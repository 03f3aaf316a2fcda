"""What the LyCORIS methods (LoHa, LoKr; Hugging Face PEFT's ``LycorisConfig`` / ``LycorisLayer`` /
``LycorisTuner``) share: the config fields in `config`, the layer around a base layer (``y = base(x) + ΔW x``, rank
and module dropout, merging ``ΔW``) in `layer`, target selection, inject and the adapter protocol in `model`. A
method's package holds only its own factors and fields (`lightning_peft.peft.loha`)."""

from .config import LycorisConfig
from .layer import LycorisLayer, Switch, effective_conv, flat_shape, supported
from .model import (
           LycorisAdapter,
           disable,
           inject,
           layers_of,
           merge,
           select,
           targeting,
           unload,
           unmerge,
)

__all__ = ["LycorisAdapter", "LycorisConfig", "LycorisLayer", "Switch", "disable",
           "effective_conv", "flat_shape", "inject", "layers_of", "merge", "select", "supported", "targeting", "unload", "unmerge"]
