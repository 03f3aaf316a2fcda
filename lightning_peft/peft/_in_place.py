"""In-place merging and switching off, for techniques with one adapter per layer (IA³, OFT): each layer has
``merged``, ``merge()`` (raising ``RuntimeError`` with the reason) and ``unmerge()``; the technique's layers and its
``modules_to_save`` wrappers share one `Switch`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn


class Switch:
    """Turns every layer of one technique on one model off (the base output), and its ``modules_to_save`` wrappers
    with them (a `lightning_peft.peft.modules_to_save.BaseSamples`: disabled, they run the original module, as PEFT's
    do)."""

    def __init__(self) -> None:
        self.disabled = False

    def base_samples(self) -> bool:
        return self.disabled


def merge_layers(model: nn.Module, layers: dict[str, nn.Module], who: str) -> list[str]:
    """Merge the unmerged ``layers`` (by name in ``model``) in place, all or nothing: a weight tied to another module
    is refused before anything changes, and a layer whose merge fails unmerges the ones merged before it.

    Returns:
        The names of the layers merged.
    """
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
    """Unmerge the merged ``layers``; raises if none is (``technique``: its name in words, ``merge``: its merge
    function's name, for the message)."""
    merged = {n: layer for n, layer in layers.items() if layer.merged}
    if not merged:
        raise RuntimeError(f"{who}: no {technique} layer of {type(model).__name__} is merged; call {merge} first.")
    for layer in merged.values():
        layer.unmerge()
    return list(merged)


@contextlib.contextmanager
def switched_off(switch: Switch, layers: dict[str, nn.Module], who: str, what: str, unmerge: str) -> Iterator[None]:
    """Context manager: ``switch`` off inside; refused while a layer is merged (``what`` is merged into the base
    weights; ``unmerge`` names the function that undoes it)."""
    if any(layer.merged for layer in layers.values()):
        raise RuntimeError(f"{who}: the {what} are merged into the base weights; call {unmerge}(model) first.")
    before, switch.disabled = switch.disabled, True
    try:
        yield
    finally:
        switch.disabled = before


def folded(model: nn.Module, targets: Iterable[str], who: str) -> dict[str, dict[str, Tensor]]:
    """Every target's merged tensors (its layer's ``merged_weights()``); raises, naming the layer, if one is not
    finite."""
    tensors = {name: model.get_submodule(name).merged_weights() for name in targets}
    for name, values in tensors.items():
        if not all(torch.isfinite(t).all() for t in values.values()):
            raise RuntimeError(f"{who}: layer {name!r}: the merged weight would hold inf or NaN; check the training "
                               "for divergence. Nothing was merged.")
    return tensors
