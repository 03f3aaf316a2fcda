"""Merging LoRA into the base weights in place, and back: [`merge_lora`][lightning_peft.peft.merge_lora],
[`unmerge_lora`][lightning_peft.peft.unmerge_lora].

([`merged_state_dict`][lightning_peft.peft.merged_state_dict] merges out of place, for exports; `merge_problems` says,
without computing a merge, which layers it would refuse.)
"""

from __future__ import annotations

from torch import nn

from ..adapter import unwrap
from ..trainable_tokens import merge_tokens, unmerge_tokens
from .layer import LoRALayer, lora_layers, require_spec


def merge_lora(model: nn.Module, adapter_name: str | None = None, dequantize: bool = False) -> list[str]:
    """Add one adapter's update (default: the active adapter) into the base weights, in place.

    Idempotent: layers that already hold this adapter merged are left alone; merging a second adapter while one is
    merged is refused. Each merge is computed in float32 (or wider) and cast back to the weight's dtype. If a merged
    weight would be non-finite, the layers merged by this call are unmerged again and a ``RuntimeError`` names the
    layer. A weight tied to another module (e.g. input and output embeddings) is refused before anything changes. A
    quantized base weight (`quantize`) is never requantized: merging into it is refused unless ``dequantize=True``,
    which writes the merged weight in full precision (the dtype the base had before quantization) in its place, for good
    ([`unmerge_lora`][lightning_peft.peft.unmerge_lora] then leaves it in full precision). To train again, call
    [`unmerge_lora`][lightning_peft.peft.unmerge_lora] first; to get plain modules back (e.g. for ``save_pretrained``),
    [`unload_lora`][lightning_peft.peft.unload_lora].

    Returns:
        Names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no LoRA adapter, another adapter is merged, a weight is tied or quantized
            (without ``dequantize``), or a merge is non-finite.
        ValueError: If ``adapter_name`` names no adapter.
    """
    spec = require_spec(model, "merge_lora")
    if adapter_name is None and spec.routing.active is None:
        raise RuntimeError("merge_lora: no adapter is active; name one, merge_lora(model, adapter_name=...).")
    name = spec._name(adapter_name)
    model = unwrap(model)
    layers = {n: layer for n, layer in lora_layers(model).items() if name in layer.specs}
    other = next((n for n, layer in lora_layers(model).items() if layer.merged and layer.merged_adapter != name), None)
    if other is not None:
        raise RuntimeError(
            f"merge_lora: adapter {lora_layers(model)[other].merged_adapter!r} is merged (e.g. at {other!r}); "
            f"call unmerge_lora(model) before merging {name!r}."
        )
    _refuse_tied(model, layers)
    done: list[str] = []
    for layer_name, layer in layers.items():
        if layer.merged:
            continue
        try:
            layer.merge(name, dequantize)
        except RuntimeError as err:
            for merged_name in reversed(done):
                model.get_submodule(merged_name).unmerge()
            raise RuntimeError(f"merge_lora: layer {layer_name!r}: {err}") from None
        done.append(layer_name)
    try:
        done += merge_tokens(model, name)  # the trained rows written into the embedding (and its tied head)
    except RuntimeError as err:
        for merged_name in reversed(done):
            model.get_submodule(merged_name).unmerge()
        raise RuntimeError(f"merge_lora: {err}") from None
    spec.routing.active = name
    return done


def merge_problems(model: nn.Module, name: str | None) -> list[str]:
    """Why a merge of adapter ``name`` would be refused, one line per layer, read from the layers' kinds and settings
    (no weight is touched, so `MergeOnSave` asks before training): a grouped convolution, whose weight cannot hold an
    update that reads every input channel, and ``lora_bias`` on a base without a bias (PEFT refuses both merges)."""
    problems = []
    for target, layer in lora_layers(model).items():
        if name not in layer.specs:
            continue
        base = layer.base_layer
        if isinstance(base, nn.modules.conv._ConvNd) and base.groups > 1:
            problems.append(f"{target!r} is a {type(base).__name__} with groups={base.groups}, whose weight cannot "
                            "hold the update (it reads every input channel)")
        if layer.specs[name].lora_bias and layer.bias is None:
            problems.append(f"{target!r} has lora_bias=True, but its {type(base).__name__} has no bias to merge B's "
                            "bias into")
    return problems


def _refuse_tied(model: nn.Module, layers: dict[str, LoRALayer]) -> None:
    """Merging in place into a weight shared with another module would change that module too."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for name, layer in layers.items():
        if layer.merged:
            continue
        others = [o for o in owners.get(id(layer._adapted()), []) if not o.startswith(f"{name}.")]
        if others:
            raise RuntimeError(
                f"merge_lora: the weight of {name!r} is tied to {others[0]!r}; merging in place would change both. "
                "Use merged_state_dict(model) for an export (it keeps them apart), or untie the weights first."
            )


def unmerge_lora(model: nn.Module) -> list[str]:
    """Subtract the merged adapter's update from the base weights, in place.

    Exact up to one rounding in the weight's dtype (so not bit-exact in bfloat16).

    Raises:
        RuntimeError: If no layer is merged.

    Returns:
        Names of the layers unmerged.
    """
    require_spec(model, "unmerge_lora")
    model = unwrap(model)
    merged = [name for name, layer in lora_layers(model).items() if layer.merged]
    for name in merged:
        model.get_submodule(name).unmerge()
    merged += unmerge_tokens(model)
    if not merged:
        raise RuntimeError(f"unmerge_lora: no LoRA layer of {type(model).__name__} is merged; call merge_lora first.")
    return merged

