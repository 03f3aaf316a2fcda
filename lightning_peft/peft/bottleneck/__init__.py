"""Bottleneck adapters (Houlsby et al. 2019; Pfeiffer et al. 2020): the technique, its update rule and file format
in `model`; the settings in `config`; the adapter MLP and the wrapper in `layer`; where adapters go in `select`."""

from .config import BottleneckConfig
from .layer import Bottleneck, BottleneckLayer
from .model import (
           BottleneckAdapter,
           bottleneck_layers,
           inject_bottleneck_adapters,
           unload_bottleneck_adapters,
)

__all__ = ["Bottleneck", "BottleneckAdapter", "BottleneckConfig", "BottleneckLayer", "bottleneck_layers",
           "inject_bottleneck_adapters", "unload_bottleneck_adapters"]
