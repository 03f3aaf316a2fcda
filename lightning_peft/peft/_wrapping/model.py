"""What is done to a whole model's layers of one technique: merging all or nothing, unmerging, disabling, the
merged export and unloading."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .._common import is_quantized, require
from ..adapter import detach, remove_adapter, unwrap
from ..modules_to_save import fold_modules_to_save, restore_modules, set_submodule
from .layers import Switch
from .targets import layers_of


def merge_layers(model: nn.Module, layers: dict[str, Any], who: str) -> list[str]:
    """Merge the unmerged ``layers`` (by name in ``model``) in place, all or nothing: a weight tied to another module
    is refused before anything changes, and a layer whose merge fails unmerges the ones this call merged.

    Returns:
        The names of the layers merged.
    """
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


def unmerge_layers(model: nn.Module, layers: dict[str, Any], who: str, technique: str, merge: str) -> list[str]:
    """Unmerge the merged ``layers``; raises if none is (``technique``: its name in words, ``merge``: its merge
    function's name, for the message)."""
    merged = {n: layer for n, layer in layers.items() if layer.merged}
    if not merged:
        raise RuntimeError(f"{who}: no {technique} layer of {type(unwrap(model)).__name__} is merged; call {merge} "
                           "first.")
    for layer in merged.values():
        layer.unmerge()
    return list(merged)


@contextlib.contextmanager
def disabled(switch: Switch, layers: Iterable[Any], who: str, unmerge: str, what: str = "updates") -> Iterator[None]:
    """Context manager: ``switch`` off inside it (the layers and ``modules_to_save`` wrappers compute the base's
    output); refused while a layer is merged (``unmerge``: the function that undoes it; ``what``: the technique's
    tensors, in words)."""
    if any(layer.merged for layer in layers):
        raise RuntimeError(f"{who}: the {what} are merged into the base weights; call {unmerge}(model) first.")
    before, switch.disabled = switch.disabled, True
    try:
        yield
    finally:
        switch.disabled = before


def refuse_merged_load(layers: Iterable[Any], what: str, unmerge: str) -> None:
    """`load_adapter` into an existing adapter: refused while a layer is merged (the file's tensors would replace
    the merged ones, and no unmerge could restore the base)."""
    if any(layer.merged for layer in layers):
        raise RuntimeError(f"load_adapter: the {what} are merged; call {unmerge}(model) before loading.")


def folded(model: nn.Module, targets: Iterable[str], who: str,
           adapter_name: str | None = None) -> dict[str, dict[str, Tensor]]:
    """Every target's merged tensors (its layer's ``merged_weights()``; with named adapters, adapter
    ``adapter_name``'s, None: the active one); raises, naming the layer, if one is not finite."""
    named = () if adapter_name is None else (adapter_name,)
    tensors = {name: model.get_submodule(name).merged_weights(*named) for name in targets}
    for name, values in tensors.items():
        if not all(torch.isfinite(t).all() for t in values.values()):
            raise RuntimeError(f"{who}: layer {name!r}: the merged weight would hold inf or NaN; check the training "
                               "for divergence. Nothing was merged.")
    return tensors


def merged_state(model: nn.Module, state: dict[str, Tensor], targets: Iterable[str], own: Iterable[str],
                 adapter_name: str | None = None) -> dict[str, Tensor]:
    """``state`` (a full state dict of the adapted ``model``) as the plain model's: the technique's ``own`` keys
    dropped, each target's base layer's keys moved up with its merged tensors (adapter ``adapter_name``'s, as
    `folded`) in their place, and ``modules_to_save`` under the plain keys."""
    model = unwrap(model)
    merged = folded(model, targets, "merged_state_dict", adapter_name)
    for key in own:
        state.pop(key)
    for name in merged:
        prefix = f"{name}.base_layer."
        for key in [k for k in state if k.startswith(prefix)]:
            state[f"{name}.{key[len(prefix):]}"] = state.pop(key)
        state.update({f"{name}.{key}": value for key, value in merged[name].items()})
    return fold_modules_to_save(model, state)


def unload_layers(model: nn.Module, adapter: Any, merge: bool, who: str) -> None:
    """Put ``adapter``'s base layers back in place of its layers (with the updates folded in if ``merge``, else as
    they were), restore its ``modules_to_save`` (the trained copies if ``merge``) and detach it."""
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


# --- a technique's model functions, for an adapter class with ``kind``, ``layer_class`` and ``config_class.who`` ---


def required(model: nn.Module, adapter_class: Any, who: str) -> Any:
    """The model's ``adapter_class`` adapter; raises, naming ``who`` and the inject function, if it has none."""
    what = f"{adapter_class.config_class.who} adapter"
    return require(model, adapter_class.kind, who, what, f"inject_{adapter_class.kind}")


def merge(model: nn.Module, adapter_class: Any) -> list[str]:
    """Fold every layer's update of the model's ``adapter_class`` adapter into its base weight in place; layers
    already merged are left alone. All or nothing (`merge_layers`).

    Returns:
        The names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no such adapter, a weight is tied to another module or quantized, or a merged
            weight is not finite (the layers merged by this call are unmerged again).
    """
    who = f"merge_{adapter_class.kind}"
    required(model, adapter_class, who)
    return merge_layers(model, layers_of(model, adapter_class.layer_class), who)


def unmerge(model: nn.Module, adapter_class: Any) -> list[str]:
    """Take the merged updates of the model's ``adapter_class`` adapter out of the base weights, in place.

    Raises:
        RuntimeError: If no layer is merged.
    """
    kind = adapter_class.kind
    required(model, adapter_class, f"unmerge_{kind}")
    return unmerge_layers(model, layers_of(model, adapter_class.layer_class), f"unmerge_{kind}",
                          adapter_class.config_class.who, f"merge_{kind}")


@contextlib.contextmanager
def disable(model: nn.Module, adapter_class: Any, what: str = "updates") -> Iterator[None]:
    """Context manager: inside it every layer of the model's ``adapter_class`` adapter computes its base layer's
    output, and every ``modules_to_save`` wrapper its original module's (``what``: its tensors, in words).

    Raises:
        RuntimeError: If ``model`` has no such adapter, or a layer is merged (the base output is then not available).
    """
    kind = adapter_class.kind
    switch = required(model, adapter_class, f"disable_{kind}").switch
    with disabled(switch, layers_of(model, adapter_class.layer_class).values(), f"disable_{kind}", f"unmerge_{kind}",
                  what):
        yield


def unload(model: nn.Module, adapter_class: Any, merge: bool = True) -> nn.Module:
    """Remove the model's ``adapter_class`` adapter in place and return the plain model: with ``merge``, the updates
    folded into the base weights and the trained ``modules_to_save`` copies kept; without, the base as it was. Other
    techniques stay.

    Raises:
        RuntimeError: If ``model`` has no such adapter, or (``merge``) a merged weight would be quantized or not
            finite.
    """
    return remove_adapter(model, required(model, adapter_class, f"unload_{adapter_class.kind}"), merge)
