"""The choice of targets, as PEFT chooses them, and its messages (`Targeting`); finding a technique's layers."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from .._common import (
    all_linear,
    chosen_by_name,
    in_layers,
    inside,
    name_matches,
    refuse_no_target,
    refuse_second_injection,
    refuse_unmatched,
    refuse_wrapped,
    wraps_a_layer,
)
from ..adapter import unwrap
from ..modules_to_save import ModulesToSave, select_modules_to_save


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
    note: str = ""  # said of PEFT's layers when a module of another kind is refused

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
                refuse_wrapped(self.who, technique, name, module)
            if not self.supported(module):
                raise TypeError(f"{self.who}(target_modules={targets!r}): {name!r} is a {type(module).__name__}; "
                                f"{technique} {self.verb}s {self.kinds} (Hugging Face PEFT's {technique} layers"
                                f"{self.note}). {type(model).__name__} has: {self.describe(model)}.")


def refuse_second(model: nn.Module, layer_class: type, who: str, technique: str) -> None:
    """Raise if ``model`` has ``layer_class`` layers already (``who``: the inject function)."""
    existing = layers_of(model, layer_class)
    found = f"{technique} layers (e.g. {next(iter(existing))!r})" if existing else None
    refuse_second_injection(who, model, found, technique)
