"""The state-dict hooks of a LoRA layer: a merged layer saves its unmerged base weight, and loads into the unmerged
layout before merging again (also reading the single-adapter layout of lightning-peft before named adapters).

``LoRALayer`` registers them; they use only its methods, so this module imports nothing of it.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import dense_weight


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # as the layer merges: at least float32


def unmerged_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: a merged layer reports its unmerged base weight, so no state holds ``W + delta``."""
    key = f"{prefix}base_layer.weight"
    if module.merged and key in state_dict:
        weight = module.base_layer.weight
        with torch.no_grad():
            restored = module._without_update(dense_weight(weight).to(_compute_dtype(weight.dtype)),
                                              module.merged_adapter)
            state_dict[key] = restored.to(weight.dtype)


_LEGACY_KEYS = ("lora_A.weight", "lora_B.weight", "lora_embedding_A", "lora_embedding_B")


def unmerge_before_load(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    # Load-state-dict pre-hook. A state dict of the single-adapter layout (lightning-peft before named adapters:
    # ``lora_A.weight``) loads into the first adapter. Then: load into the unmerged layout, and merge the loaded
    # adapter again afterwards.
    first = next(iter(module.specs))
    for key in _LEGACY_KEYS:
        if f"{prefix}{key}" in state_dict:
            container, _, rest = key.partition(".")
            state_dict[f"{prefix}{container}.{first}" + (f".{rest}" if rest else "")] = state_dict.pop(f"{prefix}{key}")
    if module.merged:
        module._remerge_after_load = module.merged_adapter
        module.unmerge()


def remerge_after_load(module: nn.Module, incompatible_keys) -> None:
    module._forget_cached_tensors()
    if module._remerge_after_load is not None:
        name, module._remerge_after_load = module._remerge_after_load, None
        module.merge(name)
