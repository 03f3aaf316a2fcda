"""Scaffolding of the techniques that put a layer of their own around each target, with one on/off switch for all of
them and an in-place merge per layer (IA³, VeRA): written once here, each technique supplies its layer and its words.

A technique's layer (an `lightning_peft.peft._common.LayerWrapper`) has ``base_layer``, ``merged``, ``merge()``,
``unmerge()``, ``merged_weights()`` (the base layer's tensors with the update folded in, as new tensors) and
``_write(tensors)`` (those tensors into the base layer, in place).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ._common import is_quantized, wraps_a_layer
from .adapter import Adapter, unwrap
from .modules_to_save import ModulesToSave, fold_modules_to_save, restore_modules, set_submodule


class Switch:
    """Turns every layer of one technique on one model off (the base output), and its ``modules_to_save`` wrappers
    with them (a `lightning_peft.peft.modules_to_save.BaseSamples`: disabled, they run the original module, as PEFT's
    do)."""

    def __init__(self) -> None:
        self.disabled = False

    def base_samples(self) -> bool:
        return self.disabled


def conv1d_type() -> type | None:
    """transformers' ``Conv1D`` if ``transformers`` is imported (a model can only hold one then), else None."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def describe_modules(model: nn.Module, supported: Callable[[nn.Module], bool], does: str) -> str:
    """'k, v (x2 each), ...': leaf names of the modules of ``model`` that ``supported`` accepts, for messages;
    ``does`` says what the technique adapts (``"IA³ scales nn.Linear, ..."``)."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if name and supported(module) and not name.endswith(".base_layer"):
            counts[name.rsplit(".", 1)[-1]] = counts.get(name.rsplit(".", 1)[-1], 0) + 1
    if not counts:
        return f"none ({does}, and {type(model).__name__} has no such module)"
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items())


def check_targets(model: nn.Module, chosen: Iterable[str], targets: object, who: str, technique: str, layer: str,
                  does: str, supported: Callable[[nn.Module], bool]) -> None:
    """Raise if a chosen module is already a technique's wrapper or of a kind the technique cannot adapt. ``who``
    speaks in the messages, ``technique`` is its name in words (``"IA³"``), ``layer`` its layer (``"an IA³ layer"``),
    ``does`` what it adapts."""
    for name in chosen:
        module = model.get_submodule(name)
        if isinstance(module, ModulesToSave) or wraps_a_layer(module):
            raise ValueError(f"{who}: {name!r} is already wrapped by another technique ({type(module).__name__}); "
                             f"{layer} around it would move that technique's parameters. Keep {technique} off this module.")
        if not supported(module):
            raise TypeError(f"{who}(target_modules={targets!r}): {name!r} is a {type(module).__name__}; {does} "
                            f"(Hugging Face PEFT's {technique} layers). {type(model).__name__} has: "
                            f"{describe_modules(model, supported, does)}.")


def merge_layers(model: nn.Module, layers: dict[str, nn.Module], who: str) -> list[str]:
    """Merge the unmerged ``layers`` in place, all or nothing (a failure unmerges the ones this call merged); a
    weight tied to another module is refused first. Returns the names merged."""
    model = unwrap(model)
    layers = {n: layer for n, layer in layers.items() if not layer.merged}
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for name, layer in layers.items():
        others = [o for o in owners.get(id(layer.base_layer.weight), []) if not o.startswith(f"{name}.")]
        if others:
            raise RuntimeError(f"{who}: the weight of {name!r} is tied to {others[0]!r}; merging in place would "
                               "change both. Use merged_state_dict(model) for an export, or untie the weights first.")
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


def unmerge_layers(model: nn.Module, layers: dict[str, nn.Module], who: str, technique: str, merge: str) -> list[str]:
    """Unmerge the merged ``layers``; raises if none is (``merge``: the function to call first)."""
    merged = {n: layer for n, layer in layers.items() if layer.merged}
    if not merged:
        raise RuntimeError(f"{who}: no {technique} layer of {type(unwrap(model)).__name__} is merged; call {merge} "
                           "first.")
    for layer in merged.values():
        layer.unmerge()
    return list(merged)


@contextlib.contextmanager
def disabled(switch: Switch, layers: Iterable[nn.Module], who: str, what: str, unmerge: str) -> Iterator[None]:
    """Context manager: ``switch`` off inside it; refused while a layer is merged (``what`` is merged: the update in
    words; ``unmerge``: the function that takes it out)."""
    if any(layer.merged for layer in layers):
        raise RuntimeError(f"{who}: {what} merged into the base weights; call {unmerge}(model) first.")
    before, switch.disabled = switch.disabled, True
    try:
        yield
    finally:
        switch.disabled = before


def folded(layers: dict[str, nn.Module], who: str) -> dict[str, dict[str, Tensor]]:
    """Every layer's ``merged_weights()``; raises, naming the layer, if one is not finite."""
    tensors = {name: layer.merged_weights() for name, layer in layers.items()}
    for name, merged in tensors.items():
        if not all(torch.isfinite(t).all() for t in merged.values()):
            raise RuntimeError(f"{who}: layer {name!r}: the merged weight would hold inf or NaN; check the training "
                               "for divergence. Nothing was merged.")
    return tensors


def merged_layers_state(model: nn.Module, state: dict[str, Tensor], targets: Iterable[str],
                        own: Iterable[str]) -> dict[str, Tensor]:
    """``state`` (a full state dict of ``model``) with the technique's ``own`` keys dropped, each target's base layer
    under the target's name with its update folded in, and ``modules_to_save`` under the plain keys."""
    model = unwrap(model)
    targets = list(targets)
    merged = folded({name: model.get_submodule(name) for name in targets}, "merged_state_dict")
    for key in own:
        state.pop(key)
    for name in targets:
        prefix = f"{name}.base_layer."
        for key in [k for k in state if k.startswith(prefix)]:
            state[f"{name}.{key[len(prefix):]}"] = state.pop(key)
        state.update({f"{name}.{key}": value for key, value in merged[name].items()})
    return fold_modules_to_save(model, state)


def unload_layers(model: nn.Module, targets: Iterable[str], modules_to_save: Iterable[str], merge: bool,
                  who: str) -> None:
    """Put the base layers back (with the updates folded in if ``merge``, else as they were) and the
    ``modules_to_save`` (the trained copies if ``merge``)."""
    model = unwrap(model)
    layers = {name: model.get_submodule(name) for name in targets}
    if merge:
        quantized = [n for n, layer in layers.items() if is_quantized(layer.base_layer.weight)]
        if quantized:
            raise RuntimeError(f"{who}(merge=True): the base weight of {quantized[0]!r} is quantized; merging would "
                               "have to requantize it. Export merged_state_dict(model) instead.")
        for name, tensors in folded({n: layer for n, layer in layers.items() if not layer.merged}, who).items():
            layers[name]._write(tensors)  # no check that it can be undone: nothing undoes it
    for name, layer in layers.items():
        if not merge:
            layer.unmerge()
        set_submodule(model, name, layer.base_layer)
    restore_modules(model, modules_to_save, trained=merge)


def peft_dict(config: Any, peft_type: str, source: str) -> dict[str, Any]:
    """A Hugging Face PEFT config (object or dict) as a dict, refused if it is another method's or names no
    ``target_modules`` (PEFT's per-architecture defaults are not guessed)."""
    if not isinstance(config, dict):
        config = config.to_dict()
    if config.get("peft_type") not in (peft_type, None):
        raise ValueError(f"load_adapter: {source} has peft_type={config.get('peft_type')!r}, not {peft_type!r}.")
    if config.get("target_modules") is None:
        raise ValueError(f"load_adapter: {source} has target_modules=None; lightning-peft does not guess PEFT's "
                         "per-architecture defaults. Name them in the config.")
    return config


def listed(value: object) -> object:
    """A PEFT config's set (its in-memory form) as a sorted list; anything else as it is."""
    return sorted(value) if isinstance(value, (set, frozenset)) else value


class TargetsAdapter(Adapter):
    """An adapter made of a frozen-dataclass ``config``, the wrapped ``targets`` and the ``modules_to_save`` (full
    names), with the other names it resolved at injection in `resolved`."""

    resolved: ClassVar[tuple[str, ...]] = ("targets", "modules_to_save")
    config: Any
    targets: tuple[str, ...]

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether this is the adapter ``config`` describes (a `config_dict`, or a callback's request
        ``{"config": <config>.to_dict()}``, whose names are not resolved yet)."""
        if type(self.config)(**config["config"]) != self.config:
            return False
        return all(list(config[key]) == list(getattr(self, key)) for key in self.resolved if key in config)

    def wrapped(self, model: nn.Module) -> dict[str, nn.Module]:
        model = unwrap(model)
        return {name: model.get_submodule(name) for name in self.targets}
