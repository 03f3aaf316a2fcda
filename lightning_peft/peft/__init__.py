"""Parameter-efficient fine-tuning in pure PyTorch (no Lightning import): LoRA, the adapter protocol, PEFT-format I/O."""

from .adapter import Adapter, adapter_state_dict, attached, merged_state_dict
from .io import load_adapter, peft_config, save_adapter
from .layers import LoRAConv2d, LoRAEmbedding, LoRALayer, LoRALinear
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
    "adapter_state_dict",
    "attached",
    "inject_lora",
    "load_adapter",
    "lora_layers",
    "merge_lora",
    "merged_state_dict",
    "peft_config",
    "save_adapter",
    "trainable_parameters",
    "unload_lora",
    "unmerge_lora",
]
