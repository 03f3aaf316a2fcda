"""Parameter-efficient fine-tuning in pure PyTorch (no Lightning import): LoRA and named multi-LoRA, bottleneck
adapters, prompt tuning, prefix tuning; a quantized frozen base (QLoRA: ``quantize_base``); the adapter protocol they
share; PEFT-format I/O."""

from . import _model_methods  # noqa: F401  (what save_pretrained, set_adapter, ... do on an adapted model)
from .adapter import Adapter, ParameterReport, adapter_state_dict, attached, merged_state_dict, trainable_parameters
from .bottleneck import (
    Bottleneck,
    BottleneckAdapter,
    BottleneckConfig,
    BottleneckLayer,
    bottleneck_layers,
    inject_bottleneck_adapters,
    unload_bottleneck_adapters,
)
from .._manifest import recover_export
from .io import load_adapter, peft_config, save_adapter
from .loraplus import loraplus_groups
from .lora import (
    LoRAAdapter,
    LoRAConfig,
    LoRAConv2d,
    LoRAEmbedding,
    LoRALayer,
    LoRALinear,
    Routing,
    active_adapter,
    add_adapter,
    combine_adapters,
    delete_adapter,
    disable_adapters,
    inject_lora,
    lora_layers,
    merge_lora,
    route_adapters,
    set_adapter,
    unload_lora,
    unmerge_lora,
)
from .modules_to_save import ModulesToSave
from .quantize import quantize_base
from .prefix_tuning import (
    PrefixEncoder,
    PrefixTuningAdapter,
    PrefixTuningConfig,
    fold_prefix_projection,
    inject_prefix_tuning,
    prefix_tuning_spec,
    unload_prefix_tuning,
)
from .prompt_tuning import (
    PromptEmbedding,
    PromptTuningAdapter,
    inject_prompt_tuning,
    prompt_embedding,
    unload_prompt_tuning,
)

__all__ = [
    "Adapter",
    "Bottleneck",
    "BottleneckAdapter",
    "BottleneckConfig",
    "BottleneckLayer",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRAConv2d",
    "LoRAEmbedding",
    "LoRALayer",
    "LoRALinear",
    "ModulesToSave",
    "ParameterReport",
    "PrefixEncoder",
    "PrefixTuningAdapter",
    "PrefixTuningConfig",
    "PromptEmbedding",
    "PromptTuningAdapter",
    "Routing",
    "active_adapter",
    "adapter_state_dict",
    "add_adapter",
    "attached",
    "bottleneck_layers",
    "combine_adapters",
    "delete_adapter",
    "disable_adapters",
    "fold_prefix_projection",
    "inject_bottleneck_adapters",
    "inject_lora",
    "inject_prefix_tuning",
    "inject_prompt_tuning",
    "load_adapter",
    "loraplus_groups",
    "lora_layers",
    "merge_lora",
    "merged_state_dict",
    "peft_config",
    "prefix_tuning_spec",
    "prompt_embedding",
    "quantize_base",
    "recover_export",
    "route_adapters",
    "save_adapter",
    "set_adapter",
    "trainable_parameters",
    "unload_bottleneck_adapters",
    "unload_lora",
    "unload_prefix_tuning",
    "unload_prompt_tuning",
    "unmerge_lora",
]
