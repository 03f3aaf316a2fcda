"""What every technique that wraps its targets in layers of its own and merges them in place (IA³, VeRA, AdaLoRA, the
LyCORIS methods LoHa and LoKr) does around those layers, written once: the on/off `Switch`, the choice of targets and
its messages (`Targeting`), merging all or nothing, unmerging, disabling, the merged export, unloading, reading a PEFT
config, and the adapter's bookkeeping (`TargetsAdapter`). A technique supplies its layer and its words.

Its layer (an `InPlaceLayer`) has ``base_layer``, ``merged``, ``merge()`` / ``unmerge()`` (in place, raising
``RuntimeError`` with the reason) and ``merged_weights()`` (the base layer's tensors with the update folded in, as new
tensors by attribute name: ``{"weight": ...}``, and ``"bias"`` where it changes); with named adapters (IA³),
``merged_weights(name)``, and its `Switch` says which one runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ._base_identity import base_model_name, task_type
from ._common import (
    LayerWrapper,
    all_linear,
    chosen_by_name,
    dense_weight,
    exact_choice,
    in_layers,
    inside,
    is_quantized,
    name_matches,
    refuse_no_target,
    refuse_second_injection,
    refuse_unmatched,
    wraps_a_layer,
)
from .adapter import DEFAULT, Adapter, clean_key, detach, unwrap
from .modules_to_save import (
    ModulesToSave,
    fold_modules_to_save,
    present_modules,
    restore_modules,
    select_modules_to_save,
    set_submodule,
)


class Switch:
    """Turns every layer of one technique on one model off (the base output), and its ``modules_to_save`` wrappers
    with them (a `lightning_peft.peft.modules_to_save.BaseSamples`: disabled, they run the original module, as PEFT's
    do); with named adapters (IA³), ``active`` is the one every layer runs."""

    def __init__(self, active: str = DEFAULT) -> None:
        self.disabled = False
        self.active = active

    def base_samples(self) -> bool:
        return self.disabled


def conv1d_type() -> type | None:
    """transformers' ``Conv1D`` if ``transformers`` is imported (a model can only hold one then), else None."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def linear_kinds() -> tuple[type, ...]:
    """The layer types ``target_modules="all-linear"`` chooses, as PEFT: ``nn.Linear`` and (if imported) ``Conv1D``."""
    conv1d = conv1d_type()
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)


def layers_of(model: nn.Module, layer_class: type) -> dict[str, Any]:
    """The ``layer_class`` layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, layer_class)}


@dataclasses.dataclass(frozen=True)
class Targeting:
    """What a technique can adapt, how its messages name it, and its choice of targets, as PEFT chooses them."""

    who: str  # who speaks in the messages (the config's name: "IA3")
    technique: str  # its name in words ("IA³")
    verb: str  # what it does to a target ("scale", "adapt")
    kinds: str  # the layer types it can adapt, in words
    supported: Callable[[nn.Module], bool]  # whether it can adapt a module
    example: str  # a full module name, for the message when nothing matches

    def describe(self, model: nn.Module) -> str:
        """'query, value (x2 each), ...': leaf names of the modules of ``model`` it can adapt, for messages."""
        counts: dict[str, int] = {}
        for name, module in model.named_modules():
            if name and self.supported(module) and not name.endswith(".base_layer"):
                counts[name.rsplit(".", 1)[-1]] = counts.get(name.rsplit(".", 1)[-1], 0) + 1
        if not counts:
            return f"none ({self.technique} {self.verb}s {self.kinds}, and {type(model).__name__} has no such module)"
        return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items())

    def select(self, model: nn.Module, config: Any, names: list[str] | None = None,
               view: dict[str, nn.Module] | None = None,
               to_save: list[str] | None = None) -> tuple[list[str], list[str]]:
        """(targets, modules_to_save) full names for ``config`` (its ``target_modules``, ``modules_to_save`` and,
        where it has them, ``layers_to_transform`` / ``layers_pattern`` and ``exclude_modules``), as PEFT picks them;
        raises before anything is changed. ``names``: the module names it may pick (default: all); ``view``: the
        modules as it sees them (`check`); ``to_save``: the model's ``modules_to_save`` already."""
        who = self.who
        names = [n for n, _ in model.named_modules() if n] if names is None else names
        if to_save is None:
            to_save = select_modules_to_save(model, config.modules_to_save, who)
        if config.target_modules == "all-linear":
            chosen = all_linear(model, view or dict(model.named_modules()), linear_kinds())
        else:
            chosen = chosen_by_name(who, config.target_modules, names, model, self.describe)
        if getattr(config, "layers_to_transform", None) is not None and chosen:
            chosen = in_layers(who, chosen, config.target_modules, config.layers_to_transform, config.layers_pattern,
                               model)
        if getattr(config, "exclude_modules", None) is not None:
            refuse_unmatched(who, config.exclude_modules, names, model, self.describe, "exclude_modules")
            chosen = [n for n in chosen if not name_matches(n, config.exclude_modules)]
        chosen = [n for n in chosen if not inside(n, to_save)]
        if not chosen:
            refuse_no_target(who, config.target_modules, model, self.verb, self.describe(model), self.example)
        self.check(model, chosen, config.target_modules, view)
        return chosen, to_save

    def check(self, model: nn.Module, chosen: Iterable[str], targets: object,
              view: dict[str, nn.Module] | None = None) -> None:
        """Raise if a chosen module is already another technique's wrapper (`ValueError`) or of a kind the technique
        cannot adapt (`TypeError`); ``view``: modules standing for others (a named adapter's layer for its base
        layer)."""
        view, technique = view or {}, self.technique
        for name in chosen:
            module = view[name] if name in view else model.get_submodule(name)
            if isinstance(module, ModulesToSave) or wraps_a_layer(module):
                article = "an" if technique[0] in "AEIOU" else "a"
                raise ValueError(f"{self.who}: {name!r} is already wrapped by another technique "
                                 f"({type(module).__name__}); {article} {technique} layer around it would move that "
                                 f"technique's parameters. Keep {technique} off this module.")
            if not self.supported(module):
                raise TypeError(f"{self.who}(target_modules={targets!r}): {name!r} is a {type(module).__name__}; "
                                f"{technique} {self.verb}s {self.kinds} (Hugging Face PEFT's {technique} layers). "
                                f"{type(model).__name__} has: {self.describe(model)}.")


def refuse_second(model: nn.Module, layer_class: type, who: str, technique: str) -> None:
    """Raise if ``model`` has ``layer_class`` layers already (``who``: the inject function)."""
    existing = layers_of(model, layer_class)
    found = f"{technique} layers (e.g. {next(iter(existing))!r})" if existing else None
    refuse_second_injection(who, model, found, technique)


class InPlaceLayer(LayerWrapper):
    """A technique's layer around ``base_layer`` whose update can be folded into the base tensors in place (the
    module docstring lists what a subclass supplies)."""

    def mergeable_weights(self, *adapter: str) -> dict[str, Tensor]:
        """``merged_weights(*adapter)``, refused (``RuntimeError``, the reason) if the base weight is quantized or a
        merged tensor would not be finite."""
        if is_quantized(self.base_layer.weight):
            raise RuntimeError("its base weight is quantized; merging in place would have to requantize it. Use "
                               "merged_state_dict(model) for an export.")
        merged = self.merged_weights(*adapter)
        if not all(torch.isfinite(t).all() for t in merged.values()):
            raise RuntimeError("the merged weight would hold inf or NaN; nothing was merged.")
        return merged

    def _write(self, tensors: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for key, value in tensors.items():
                getattr(self.base_layer, key).copy_(value)


class AdditiveLayer(InPlaceLayer):
    """An `InPlaceLayer` whose update is added to the base weight, ``W + ΔW``; a subclass supplies ``merged`` (False
    at first) and ``delta_weight()`` (``ΔW`` in the base weight's layout)."""

    merged: bool

    def merged_weights(self) -> dict[str, Tensor]:
        """The base weight with ``ΔW`` added: a new tensor, computed in the wider of the two dtypes (the update's is
        float32 or wider) and cast to the weight's. A layer merged in place returns its weight as it is."""
        weight = dense_weight(self.base_layer.weight, self.base_layer).detach()
        if self.merged:
            return {"weight": weight}
        return {"weight": self._shifted(weight, 1)}

    def merge(self) -> None:
        """Add ``ΔW`` to the base weight in place (`unmerge` subtracts it again).

        Raises:
            RuntimeError: If the weight is quantized or the merged weight is not finite; nothing changes then.
        """
        if not self.merged:
            self._write(self.mergeable_weights())
            self.merged = True

    def unmerge(self) -> None:
        """Subtract ``ΔW`` from the merged base weight (exact up to one rounding in the weight's dtype)."""
        if self.merged:
            self._write({"weight": self._shifted(self.base_layer.weight.detach(), -1)})
            self.merged = False

    def _shifted(self, weight: Tensor, sign: int) -> Tensor:
        with torch.no_grad():
            delta = self.delta_weight()
        wide = torch.promote_types(weight.dtype, delta.dtype)
        return (weight.to(wide) + sign * delta.to(wide)).to(weight.dtype)


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


def peft_dict(config: Any, peft_type: str, source: str) -> dict[str, Any]:
    """A Hugging Face PEFT config (object or dict) as a dict, refused if it is another method's or names no
    ``target_modules`` (PEFT's per-architecture defaults are not guessed)."""
    if not isinstance(config, dict):
        config = config.to_dict()
    given = getattr(config.get("peft_type"), "value", config.get("peft_type"))  # PEFT's enum, or its string
    if given not in (peft_type, None):
        raise ValueError(f"load_adapter: {source} has peft_type={given!r}, not {peft_type!r}.")
    if config.get("target_modules") is None:
        raise ValueError(f"load_adapter: {source} has target_modules=None; lightning-peft does not guess PEFT's "
                         "per-architecture defaults. Name them in the config.")
    return config


def listed(value: object) -> object:
    """A PEFT config's set (its in-memory form) as a sorted list; anything else as it is."""
    return sorted(value) if isinstance(value, (set, frozenset)) else value


def peft_common(model: nn.Module, peft_type: str, targets: Iterable[str],
                modules_to_save: Iterable[str]) -> dict[str, Any]:
    """The fields every written ``adapter_config.json`` has, the targets written out as exactly the adapted modules
    (so PEFT adapts the same ones whatever the rules that chose them said)."""
    names = [clean_key(n) for n, _ in unwrap(model).named_modules() if n]
    return {
        "peft_type": peft_type,
        "task_type": task_type(model),
        "base_model_name_or_path": base_model_name(model),
        "inference_mode": True,
        "target_modules": exact_choice([clean_key(n) for n in targets], names),
        "modules_to_save": [clean_key(n) for n in modules_to_save] or None,
    }


def inject_from_peft(model: nn.Module, config: Any, source: str, inject: Callable[[Any], object]) -> None:
    """``inject(config)``, ``config`` read from PEFT's ``source``: the ``modules_to_save`` ``model`` lacks dropped
    (PEFT's task types write ["classifier", "score"] whatever the model calls its head), and a refusal naming the
    file."""
    config = dataclasses.replace(config, modules_to_save=present_modules(unwrap(model), config.modules_to_save,
                                                                         source))
    try:
        inject(config)
    except ValueError as err:
        raise ValueError(f"load_adapter: {source}: {err}") from None


class TargetsAdapter(Adapter):
    """The adapter protocol's bookkeeping for an adapter made of a frozen-dataclass ``config`` (the one used), its
    ``targets`` and ``modules_to_save`` (full names), whose layers and ``modules_to_save`` wrappers share its `Switch`."""

    #: The names it resolved at injection (recorded in `config_dict`, compared by `matches`).
    resolved: ClassVar[tuple[str, ...]] = ("targets", "modules_to_save")

    def __init__(self, config: Any, targets: Iterable[str], modules_to_save: Iterable[str]) -> None:
        self.config = config
        self.targets = tuple(targets)
        self.modules_to_save = tuple(modules_to_save)
        self.switch = Switch()  # shared by its layers and modules_to_save wrappers

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.targets)} targets, modules_to_save={list(self.modules_to_save)})"

    def config_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), **{key: list(getattr(self, key)) for key in self.resolved}}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether this is the adapter ``config`` describes (a `config_dict`, or a callback's request
        ``{"config": <config>.to_dict()}``, whose names are not resolved yet)."""
        if type(self.config)(**config["config"]) != self.config:
            return False
        return all(list(config[key]) == list(getattr(self, key)) for key in self.resolved if key in config)

    def wrapped(self, model: nn.Module) -> dict[str, nn.Module]:
        model = unwrap(model)
        return {name: model.get_submodule(name) for name in self.targets}
