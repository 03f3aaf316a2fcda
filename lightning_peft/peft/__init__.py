"""Parameter-efficient fine-tuning in pure PyTorch (no Lightning import): LoRA and its PEFT-format I/O."""

from .io import load_adapter, peft_config, save_adapter
from .layers import LoRAConv2d, LoRAEmbedding, LoRALayer, LoRALinear
from .lora import (
    LoRAConfig,
    ParameterReport,
    adapter_state_dict,
    inject_lora,
    lora_layers,
    merge_lora,
    merged_state_dict,
    trainable_parameters,
    unmerge_lora,
)

__all__ = [
    "LoRAConfig",
    "LoRAConv2d",
    "LoRAEmbedding",
    "LoRALayer",
    "LoRALinear",
    "ParameterReport",
    "adapter_state_dict",
    "inject_lora",
    "load_adapter",
    "lora_layers",
    "merge_lora",
    "merged_state_dict",
    "peft_config",
    "save_adapter",
    "trainable_parameters",
    "unmerge_lora",
]
