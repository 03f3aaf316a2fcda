"""Parameter-efficient fine-tuning in pure PyTorch (no Lightning import): LoRA and named multi-LoRA, the adapter
protocol, PEFT-format I/O."""

from .adapter import Adapter, adapter_state_dict, attached, merged_state_dict
from .io import load_adapter, peft_config, save_adapter
from .layers import LoRAConv2d, LoRAEmbedding, LoRALayer, LoRALinear, Routing
from .lora import (
    LoRAAdapter,
    LoRAConfig,
    ParameterReport,
    inject_lora,
    lora_layers,
    merge_lora,
    trainable_parameters,
    unload_lora,
    unmerge_lora,
)
from .modules_to_save import ModulesToSave
from .multi_lora import (
    active_adapter,
    add_adapter,
    combine_adapters,
    delete_adapter,
    disable_adapters,
    route_adapters,
    set_adapter,
)

__all__ = [
    "Adapter",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRAConv2d",
    "LoRAEmbedding",
    "LoRALayer",
    "LoRALinear",
    "ModulesToSave",
    "ParameterReport",
    "Routing",
    "active_adapter",
    "adapter_state_dict",
    "add_adapter",
    "attached",
    "combine_adapters",
    "delete_adapter",
    "disable_adapters",
    "inject_lora",
    "load_adapter",
    "lora_layers",
    "merge_lora",
    "merged_state_dict",
    "peft_config",
    "route_adapters",
    "save_adapter",
    "set_adapter",
    "trainable_parameters",
    "unload_lora",
    "unmerge_lora",
]
