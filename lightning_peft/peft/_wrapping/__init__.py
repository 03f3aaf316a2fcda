"""What every technique that wraps its targets in layers of its own and merges them in place (IA³, VeRA, AdaLoRA, the
LyCORIS methods LoHa and LoKr, OFT and BOFT) does around those layers, written once: the on/off `Switch` and the layers
(`layers`), the choice of targets and its messages (`Targeting`, in `targets`), merging all or nothing, unmerging,
disabling, the merged export and unloading (`model`), reading and writing a PEFT config (`peft_config`), and the
adapter's bookkeeping (`TargetsAdapter`, in `adapter`). A technique supplies its layer and its words. Import the names
from here (``from .._wrapping import Switch``): the modules are its concepts, not its interface.

Its layer (an `InPlaceLayer`) has ``base_layer``, ``merged``, ``merge()`` / ``unmerge()`` (in place, raising
``RuntimeError`` with the reason) and ``merged_weights()`` (the base layer's tensors with the update folded in, as new
tensors by attribute name: ``{"weight": ...}``, and ``"bias"`` where it changes); with named adapters (IA³),
``merged_weights(name)``, and its `Switch` says which one runs.
"""

from .adapter import TargetsAdapter
from .layers import AdditiveLayer, InPlaceLayer, Switch
from .model import (
    disable,
    disabled,
    folded,
    merge,
    merge_layers,
    merged_state,
    refuse_merged_load,
    required,
    unload,
    unload_layers,
    unmerge,
    unmerge_layers,
)
from .peft_config import inject_from_peft, listed, peft_common, peft_dict
from .targets import Targeting, conv1d_type, layers_of, linear_kinds, refuse_second

__all__ = ["AdditiveLayer", "InPlaceLayer", "Switch", "Targeting", "TargetsAdapter", "conv1d_type", "disable",
           "disabled", "folded", "inject_from_peft", "layers_of", "linear_kinds", "listed", "merge",
           "merge_layers", "merged_state", "peft_common", "peft_dict", "refuse_merged_load", "refuse_second",
           "required", "unload", "unload_layers", "unmerge", "unmerge_layers"]
