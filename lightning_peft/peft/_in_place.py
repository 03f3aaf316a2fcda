"""In-place merging, switching off, merged exports and unloading, for techniques with one adapter per layer (IA³,
OFT): each layer has ``merged``, ``merge()`` (raising ``RuntimeError`` with the reason), ``unmerge()``,
``merged_weights()`` (its base tensors with the adapter folded in) and ``write(tensors)``; the technique's layers and its
``modules_to_save`` wrappers share one `Switch`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from ._common import (
    chosen_by_name,
    in_layers,
    inside,
    is_quantized,
    name_matches,
    refuse_no_target,
    refuse_unmatched,
    wraps_a_layer,
)
from .modules_to_save import (
    ModulesToSave,
    fold_modules_to_save,
    restore_modules,
    select_modules_to_save,
    set_submodule,
)


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


def fold_layers(model: nn.Module, targets: Iterable[str], own: Callable[[str], list[str]],
                state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (a full state dict of ``model``) with each target layer replaced by its merged base: the layer's
    own tensors (keys ``own(name)``) dropped, ``<name>.base_layer.<key>`` renamed ``<name>.<key>``, the merged tensors in."""
    merged = folded(model, targets, "merged_state_dict")
    for name, tensors in merged.items():
        for key in own(name):
            state.pop(key)
        prefix = f"{name}.base_layer."
        for key in [k for k in state if k.startswith(prefix)]:
            state[f"{name}.{key[len(prefix):]}"] = state.pop(key)
        state.update({f"{name}.{key}": value for key, value in tensors.items()})
    return fold_modules_to_save(model, state)


def unload_layers(model: nn.Module, targets: Iterable[str], modules_to_save: Iterable[str], merge: bool,
                  who: str) -> None:
    """Put each target's base layer back (with ``merge``, its merged tensors written in, and the trained
    ``modules_to_save`` copies kept; without, unmerged first). Refused before anything changes if a merge would write
    a quantized weight or a non-finite one."""
    layers = {name: model.get_submodule(name) for name in targets}
    if merge:
        quantized = [n for n, layer in layers.items() if is_quantized(layer.base_layer.weight)]
        if quantized:
            raise RuntimeError(f"{who}(merge=True): the base weight of {quantized[0]!r} is quantized; merging would "
                               "have to requantize it. Export merged_state_dict(model) instead.")
        for name, tensors in folded(model, [n for n, layer in layers.items() if not layer.merged], who).items():
            layers[name].write(tensors)  # no unmerge follows: nothing needs to be invertible
    for name, layer in layers.items():
        if not merge:
            layer.unmerge()
        set_submodule(model, name, layer.base_layer)
    restore_modules(model, modules_to_save, trained=merge)


def describe_leaves(model: nn.Module, accepts: Callable[[nn.Module], bool], kinds: str, does: str) -> str:
    """'k, v (x2 each), ...': leaf names of the modules of ``model`` that ``accepts`` takes, for messages (none:
    what the technique ``does`` to which ``kinds``)."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if name and accepts(module) and not name.endswith(".base_layer"):
            counts[name.rsplit(".", 1)[-1]] = counts.get(name.rsplit(".", 1)[-1], 0) + 1
    if not counts:
        return f"none ({does} {kinds}, and {type(model).__name__} has no such module)"
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items())


def choose_targets(who: str, model: nn.Module, config, describe: Callable[[nn.Module], str], does: str,
                   example: str) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names that ``config`` (``target_modules``, ``layers_to_transform``,
    ``layers_pattern``, ``exclude_modules``, ``modules_to_save``) picks in ``model``, as PEFT picks them; raises,
    before anything changes, if a name matches nothing. ``describe(model)`` lists what the technique can adapt,
    ``does`` is what it does ("rotate"), ``example`` a full module name for the messages."""
    names = [n for n, _ in model.named_modules() if n]
    to_save = select_modules_to_save(model, config.modules_to_save, who)
    chosen = chosen_by_name(who, config.target_modules, names, model, describe)
    if config.layers_to_transform is not None and chosen:
        chosen = in_layers(who, chosen, config.target_modules, config.layers_to_transform, config.layers_pattern,
                           model)
    if config.exclude_modules is not None:
        refuse_unmatched(who, config.exclude_modules, names, model, describe, "exclude_modules")
        chosen = [n for n in chosen if not name_matches(n, config.exclude_modules)]
    chosen = [n for n in chosen if not inside(n, to_save)]
    if not chosen:
        refuse_no_target(who, config.target_modules, model, does, describe(model), example)
    for name in chosen:
        module = model.get_submodule(name)
        if isinstance(module, ModulesToSave) or wraps_a_layer(module):
            raise ValueError(f"{who}: {name!r} is already wrapped by another technique ({type(module).__name__}); "
                             f"wrapping it again would move that technique's parameters. Keep {who} off this module.")
    return chosen, to_save


def refuse_odd_conv(who: str, name: str, module: nn.Module) -> None:
    """Raise if the Conv2d ``module`` is grouped, dilated or has a non-square kernel: PEFT's OFT and BOFT formats
    rotate ``in_channels * k * k`` features, which says nothing true of those."""
    odd = [f"{k}={v}" for k, v, plain in (("groups", module.groups, 1), ("dilation", module.dilation, (1, 1)))
           if v != plain]
    if module.kernel_size[0] != module.kernel_size[1]:
        odd.append(f"kernel_size={module.kernel_size}")
    if odd:
        raise ValueError(f"{who}: the Conv2d {name!r} has {', '.join(odd)}; PEFT's {who} format has square, "
                         "ungrouped, undilated convolutions only (its files could not say what this rotates). "
                         "Leave it out of target_modules.")
