"""`TargetsAdapter`: the adapter protocol's bookkeeping for an adapter made of a config, its targets and its
``modules_to_save``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from torch import Tensor, nn

from ..adapter import Adapter, clean_key, unwrap
from ..modules_to_save import plain_key
from .layers import Switch
from .model import unload_layers


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

    def unload(self, model: nn.Module, merge: bool) -> None:
        unload_layers(model, self, merge, f"unload_{self.kind}")

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        """`state` under PEFT's keys."""
        return {clean_key(plain_key(k)): v for k, v in self.state(model).items()}
