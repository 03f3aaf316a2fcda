"""The adapter-protocol side shared by OFT and BOFT: one rotation layer per target, recorded with its block size,
PEFT's trained biases (``bias="<method>_only"`` / ``"all"``) and ``modules_to_save``. A technique supplies its config
class, its layers' own tensors, how to inject recorded targets, and its ``adapter_config.json``."""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

from torch import Tensor, nn

from ._common import refuse_absent
from ._in_place import Switch, fold_layers, unload_layers
from .adapter import Adapter, attached, clean_key, detach, unwrap
from .modules_to_save import plain_key, present_modules, saved_state


def trained_biases(model: nn.Module, targets: Iterable[str], bias: str) -> dict[str, Tensor]:
    """The biases PEFT trains for ``bias``: ``"*_only"`` the targets' (on their base layers), ``"all"`` every one."""
    state: dict[str, Tensor] = {}
    if bias.endswith("_only"):
        for name in targets:
            base = model.get_submodule(name).base_layer
            if base._parameters.get("bias") is not None:
                state[f"{name}.base_layer.bias"] = base.bias
    elif bias == "all":
        for name, module in model.named_modules():
            if module._parameters.get("bias") is not None and ".original_module" not in f".{name}":
                state[f"{name}.bias" if name else "bias"] = module._parameters["bias"]
    return state


class BlockAdapter(Adapter):
    """An adapter of one layer per target (``targets``: full name -> block size).

    Class attributes a technique sets: ``config_type`` (its frozen config dataclass, with ``from_peft``), ``who``
    (its name in messages), ``compared`` (the config fields a PEFT file must share with an existing adapter).
    """

    mergeable: ClassVar[bool] = True
    config_type: ClassVar[type]
    who: ClassVar[str]
    compared: ClassVar[tuple[str, ...]]

    def __init__(self, config: Any, targets: dict[str, int], modules_to_save: Iterable[str]) -> None:
        self.config = config
        self.targets = tuple(targets)
        self.block_sizes = dict(targets)
        self.modules_to_save = tuple(modules_to_save)
        self.switch = Switch()  # shared by its layers and modules_to_save wrappers

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.targets)} targets, modules_to_save={list(self.modules_to_save)})"

    # --- what a technique supplies
    @abstractmethod
    def own(self, layer: nn.Module, name: str) -> dict[str, Tensor]:
        """The layer's own trained tensors by state key (``name`` is the layer's full name)."""

    @classmethod
    @abstractmethod
    def place(cls, model: nn.Module, config: Any, targets: dict[str, int], to_save: list[str]) -> None:
        """Wrap exactly ``targets`` (checked for their kind) and ``to_save``, and attach the adapter."""

    @classmethod
    @abstractmethod
    def inject_config(cls, model: nn.Module, config: Any) -> None:
        """Inject ``config`` by its rules (the technique's ``inject_*`` function)."""

    # --- the protocol
    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state: dict[str, Tensor] = {}
        for name in self.targets:
            state.update(self.own(model.get_submodule(name), name))
        state.update(trained_biases(model, self.targets, self.config.bias))
        return {**state, **saved_state(model, self.modules_to_save)}

    def config_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "targets": self.block_sizes,
                "modules_to_save": list(self.modules_to_save)}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether this is the adapter ``config`` describes (a `config_dict`, or a callback's request
        ``{"config": ...}``, whose names are not resolved yet)."""
        if self.config_type(**config["config"]) != self.config:
            return False
        mine = {"targets": self.block_sizes, "modules_to_save": list(self.modules_to_save)}
        return all(dict(config[key]) == value if key == "targets" else list(config[key]) == value
                   for key, value in mine.items() if key in config)

    def wrapped(self, model: nn.Module) -> dict[str, nn.Module]:
        model = unwrap(model)
        return {name: model.get_submodule(name) for name in self.targets}

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> BlockAdapter:
        """Inject at the recorded names (the same modules whatever the rules would pick today)."""
        model = unwrap(model)
        targets, to_save = dict(config["targets"]), list(config["modules_to_save"])
        refuse_absent(model, [*targets, *to_save], f"{cls.who}: the recorded adapter")
        cls.place(model, cls.config_type(**config["config"]), targets, to_save)
        return attached(model)[cls.kind]

    def merged_state(self, model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        model = unwrap(model)
        return fold_layers(model, self.targets, lambda name: list(self.own(model.get_submodule(name), name)), state)

    def unload(self, model: nn.Module, merge: bool) -> None:
        unload_layers(unwrap(model), self.targets, self.modules_to_save, merge, f"unload_{self.kind}")
        detach(model, self.kind)

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        return {clean_key(plain_key(k)): v for k, v in self.state(model).items()}

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        """The file must describe this adapter's rotation (another block size or variant would load into tensors of
        the same shape, or fail late)."""
        if any(layer.merged for layer in self.wrapped(model).values()):
            raise RuntimeError(f"load_adapter: the {self.who} rotations are merged; call unmerge_{self.kind}(model) "
                               "before loading.")
        theirs = self.config_type.from_peft(config, source)
        differ = [f"{f}={getattr(theirs, f)!r} (the model's: {getattr(self.config, f)!r})" for f in self.compared
                  if getattr(theirs, f) != getattr(self.config, f)]
        if differ:
            raise ValueError(f"load_adapter: {source} has {', '.join(differ)}. Load it into a model without "
                             f"{self.who}.")

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> BlockAdapter:
        ours = cls.config_type.from_peft(config, source)
        # PEFT's task types write ["classifier", "score"] whatever the model calls its head: the absent are dropped
        ours = dataclasses.replace(ours, modules_to_save=present_modules(unwrap(model), ours.modules_to_save, source))
        try:
            cls.inject_config(model, ours)
        except ValueError as err:
            raise ValueError(f"load_adapter: {source}: {err}") from None
        return attached(model)[cls.kind]

