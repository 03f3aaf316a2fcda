"""LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685) and named multi-LoRA.

One module per concept, as Hugging Face PEFT's ``tuners/lora/``:

| module | what it holds |
| --- | --- |
| `config` | [`LoRAConfig`][lightning_peft.peft.LoRAConfig], keyword arguments and PEFT's ``LoraConfig`` translated to it |
| `layer` | the layers: the base class (adapters, merge, the forward) and the Linear / Conv1D and Embedding layers |
| `conv` | the convolution layer: ``nn.Conv1d``, ``Conv2d``, ``Conv3d``, grouped ones included |
| `mha` | the layer for ``nn.MultiheadAttention`` (its in- and out-projection, as PEFT adapts it) |
| `variants` | LoRA variants, objects a layer runs instead of plain LoRA: DoRA (a trained magnitude per output feature) |
| `routing` | which adapter each sample uses, and the per-sample (mixed-batch) update |
| `targets` | which modules a config adapts (PEFT's matching rules), checked before anything changes |
| `model` | inject, add, unload, and LoRA's side of the adapter protocol (`LoRAAdapter`) |
| `merge` | merging adapters into the base weights in place, and back |
| `peft_format` | PEFT's ``adapter_config.json`` and tensor names, both ways |
| `multi` | switching, disabling, deleting, routing and combining named adapters |
"""

from .config import LoRAConfig, as_config
from .conv import LoRAConv, LoRAConv2d
from .layer import DEFAULT, LoRAEmbedding, LoRALayer, LoRALinear, Routing, lora_layers, lora_spec
from .merge import merge_lora, unmerge_lora
from .mha import LoRAMultiheadAttention
from .model import LoRAAdapter, add_adapter, inject_lora, unload_lora
from .multi import (
    active_adapter,
    combine_adapters,
    delete_adapter,
    disable_adapters,
    route_adapters,
    set_adapter,
)

__all__ = [
    "DEFAULT",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRAConv",
    "LoRAConv2d",
    "LoRAEmbedding",
    "LoRALayer",
    "LoRALinear",
    "LoRAMultiheadAttention",
    "Routing",
    "active_adapter",
    "add_adapter",
    "as_config",
    "combine_adapters",
    "delete_adapter",
    "disable_adapters",
    "inject_lora",
    "lora_layers",
    "lora_spec",
    "merge_lora",
    "route_adapters",
    "set_adapter",
    "unload_lora",
    "unmerge_lora",
]
