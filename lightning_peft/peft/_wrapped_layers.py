"""What a technique that wraps base layers in layers of its own (IA³, AdaLoRA) does around them, written once: which
modules it can take (for messages), the checks on its chosen targets, the on/off `Switch`, merging all or nothing,
disabling, the merged export and unloading.

A technique supplies its layers, each with ``base_layer``, ``merged`` (bool), ``merge()`` / ``unmerge()`` (in place,
raising ``RuntimeError`` with the reason), ``merged_weights()`` (the base layer's tensors with the update folded in,
by attribute name: ``{"weight": ...}``, and ``"bias"`` where the technique changes it) and ``_write(tensors)``; its
adapter has ``targets``, ``modules_to_save``, ``kind`` and a `Switch` its layers share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ._common import is_quantized, wraps_a_layer
from .adapter import detach, unwrap
from .modules_to_save import ModulesToSave, fold_modules_to_save, restore_modules, set_submodule


class Switch:
    """Turns every layer of one technique on one model off (the base output), and its ``modules_to_save`` wrappers
    with them (a `lightning_peft.peft.modules_to_save.BaseSamples`: disabled, they run the original module, as PEFT's
    do)."""

    def __init__(self) -> None:
        self.disabled = False

    def base_samples(self) -> bool:
        return self.disabled


def describe_adaptable(model: nn.Module, supported: Callable[[nn.Module], bool], kinds: str, technique: str,
                       can: str = "adapts") -> str:
    """'k, v (x2 each), ...': leaf names of the modules of ``model`` that ``supported`` accepts, for messages
    (``can``: what the technique does to them, ``kinds`` in words)."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if name and supported(module) and not name.endswith(".base_layer"):
            counts[name.rsplit(".", 1)[-1]] = counts.get(name.rsplit(".", 1)[-1], 0) + 1
    if not counts:
        return f"none ({technique} {can} {kinds}, and {type(model).__name__} has no such module)"
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items())


def check_targets(who: str, model: nn.Module, chosen: Iterable[str], targets: Any,
                  supported: Callable[[nn.Module], bool], kinds: str, technique: str, can: str = "adapts") -> None:
    """Raise if a chosen module is wrapped by another technique already (`ValueError`) or is not a kind the technique
    adapts (`TypeError`), naming it and what ``model`` has."""
    for name in chosen:
        module = model.get_submodule(name)
        if isinstance(module, ModulesToSave) or wraps_a_layer(module):
            raise ValueError(f"{who}: {name!r} is already wrapped by another technique ({type(module).__name__}); an "
                             f"{technique} layer around it would move that technique's parameters. Keep {technique} "
                             "off this module.")
        if not supported(module):
            raise TypeError(f"{who}(target_modules={targets!r}): {name!r} is a {type(module).__name__}; {technique} "
                            f"{can} {kinds} (Hugging Face PEFT's {technique} layers). {type(model).__name__} has: "
                            f"{describe_adaptable(model, supported, kinds, technique, can)}.")


def merge_layers(model: nn.Module, layers: dict[str, Any], who: str) -> list[str]:
    """Merge every unmerged layer of ``layers`` in place, all or nothing; returns the names merged. Refuses a base
    weight tied to another module (both would change)."""
    model = unwrap(model)
    layers = {n: layer for n, layer in layers.items() if not layer.merged}
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for name, layer in layers.items():
        others = [o for o in owners.get(id(layer.base_layer.weight), []) if not o.startswith(f"{name}.")]
        if others:
            raise RuntimeError(f"{who}: the weight of {name!r} is tied to {others[0]!r}; merging in place would change "
                               "both. Use merged_state_dict(model) for an export, or untie the weights first.")
    done: list[str] = []
    for name, layer in layers.items():
        try:
            layer.merge()
        except RuntimeError as err:
            for merged in reversed(done):
                layers[merged].unmerge()
            raise RuntimeError(f"{who}: layer {name!r}: {err}") from None
        done.append(name)
    return done


def unmerge_layers(model: nn.Module, layers: dict[str, Any], who: str, technique: str, merge: str) -> list[str]:
    """Unmerge the merged layers of ``layers``; raises if none is merged (``merge``: the function to call first)."""
    merged = {n: layer for n, layer in layers.items() if layer.merged}
    if not merged:
        raise RuntimeError(f"{who}: no {technique} layer of {type(unwrap(model)).__name__} is merged; call {merge} "
                           "first.")
    for layer in merged.values():
        layer.unmerge()
    return list(merged)


@contextlib.contextmanager
def disabled(switch: Any, layers: Iterable[Any], who: str, unmerge: str, what: str = "updates") -> Iterator[None]:
    """Turn ``switch`` off inside the block (the layers and ``modules_to_save`` wrappers compute the base's output);
    refused while a layer is merged (``unmerge``: the function that undoes it; ``what``: the technique's tensors)."""
    if any(layer.merged for layer in layers):
        raise RuntimeError(f"{who}: the {what} are merged into the base weights; call {unmerge}(model) first.")
    before, switch.disabled = switch.disabled, True
    try:
        yield
    finally:
        switch.disabled = before


def folded(model: nn.Module, targets: Iterable[str], who: str) -> dict[str, dict[str, Tensor]]:
    """Every target's merged tensors (its layer's ``merged_weights``); raises, naming the layer, if one is not
    finite."""
    tensors = {name: model.get_submodule(name).merged_weights() for name in targets}
    for name, merged in tensors.items():
        if not all(torch.isfinite(t).all() for t in merged.values()):
            raise RuntimeError(f"{who}: layer {name!r}: the merged weight would hold inf or NaN; check the training "
                               "for divergence. Nothing was merged.")
    return tensors


def merged_state(model: nn.Module, targets: Iterable[str], own: Iterable[str], state: dict[str, Tensor]
                 ) -> dict[str, Tensor]:
    """``state`` (a full state dict of the adapted ``model``) as the plain model's: each target's ``own`` tensors
    (the technique's) dropped, its base layer's keys moved up, its merged tensors in their place."""
    model = unwrap(model)
    merged = folded(model, targets, "merged_state_dict")
    for name in merged:
        for key in own:
            state.pop(f"{name}.{key}")
        prefix = f"{name}.base_layer."
        for key in [k for k in state if k.startswith(prefix)]:
            state[f"{name}.{key[len(prefix):]}"] = state.pop(key)
        state.update({f"{name}.{key}": value for key, value in merged[name].items()})
    return fold_modules_to_save(model, state)


def unload_layers(model: nn.Module, adapter: Any, merge: bool, who: str) -> None:
    """Put ``adapter``'s base layers back in place of its layers (with the updates folded in if ``merge``), restore
    its ``modules_to_save`` (the trained copies if ``merge``) and detach it."""
    model = unwrap(model)
    layers = {name: model.get_submodule(name) for name in adapter.targets}
    if merge:
        quantized = [n for n, layer in layers.items() if is_quantized(layer.base_layer.weight)]
        if quantized:
            raise RuntimeError(f"{who}(merge=True): the base weight of {quantized[0]!r} is quantized; merging would "
                               "have to requantize it. Export merged_state_dict(model) instead.")
        for name, tensors in folded(model, [n for n, layer in layers.items() if not layer.merged], who).items():
            layers[name]._write(tensors)  # no check that it could be undone: nothing undoes it
    for name, layer in layers.items():
        if not merge:
            layer.unmerge()
        set_submodule(model, name, layer.base_layer)
    restore_modules(model, adapter.modules_to_save, trained=merge)
    detach(model, adapter.kind)
