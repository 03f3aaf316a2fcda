"""What OFT and BOFT share beyond `lightning_peft.peft._wrapping`: rotations of a target's input in blocks, so a target
is recorded with its block size; the refusal of the convolutions PEFT's formats cannot describe; injecting; PEFT's
trained biases (``bias="<method>_only"`` / ``"all"``) and the adapter-protocol side (`BlockAdapter`). A technique
supplies its config class (with ``who`` and ``from_peft``), its layer class, its `Targeting`, the block size of a
target, its layers' own tensors and the fields of its ``adapter_config.json``."""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

from torch import Tensor, nn

from . import _wrapping as wrapping
from ._common import refuse_absent
from .adapter import attach, attached, trainable_parameters, unwrap
from .modules_to_save import saved_state, set_submodule, wrap_modules_to_save


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


class BlockAdapter(wrapping.TargetsAdapter):
    """An adapter of one rotation layer per target (``targets``: full name -> block size).

    Class attributes a technique sets: ``config_class`` (its frozen config dataclass, with ``who`` and
    ``from_peft``), ``layer_class`` (its layer: ``(base_layer, block_size, config, switch)``), ``targeting``,
    ``compared`` (the config fields a PEFT file must share with an existing adapter) and ``written`` (the config
    fields its ``adapter_config.json`` holds).
    """

    mergeable: ClassVar[bool] = True
    config_class: ClassVar[type]
    layer_class: ClassVar[type]
    targeting: ClassVar[wrapping.Targeting]
    compared: ClassVar[tuple[str, ...]]
    written: ClassVar[tuple[str, ...]]

    def __init__(self, config: Any, targets: dict[str, int], modules_to_save: Iterable[str]) -> None:
        super().__init__(config, targets, modules_to_save)
        self.block_sizes = dict(targets)

    # --- what a technique supplies
    @abstractmethod
    def own(self, layer: nn.Module, name: str) -> dict[str, Tensor]:
        """The layer's own trained tensors by state key (``name`` is the layer's full name)."""

    @staticmethod
    @abstractmethod
    def block_size(name: str, module: nn.Module, config: Any) -> int:
        """The block size of target ``name``; raises, with the values that fit, if the config's does not fit it."""

    # --- choosing and injecting
    @classmethod
    def select(cls, model: nn.Module, config: Any) -> tuple[dict[str, int], list[str]]:
        """({target: block size}, modules_to_save) by full name, as PEFT picks them; raises before anything
        changes."""
        chosen, to_save = cls.targeting.select(model, config)
        cls._refuse_odd_convs(model, chosen)
        return {name: cls.block_size(name, model.get_submodule(name), config) for name in chosen}, to_save

    @classmethod
    def _refuse_odd_convs(cls, model: nn.Module, names: Iterable[str]) -> None:
        for name in names:
            if isinstance(model.get_submodule(name), nn.Conv2d):
                refuse_odd_conv(cls.config_class.who, name, model.get_submodule(name))

    @classmethod
    def place(cls, model: nn.Module, config: Any, targets: dict[str, int] | None = None,
              to_save: list[str] | None = None) -> dict[str, nn.Module]:
        """Wrap the targets ``config`` picks in ``model`` (``targets`` / ``to_save`` given: exactly those, checked
        for their kind) in ``layer_class`` layers, in place, attach the adapter, and freeze everything else.

        Raises:
            RuntimeError: If ``model`` already has this technique.
            ValueError, TypeError: As `select`, before anything changes.
        """
        model, who = unwrap(model), cls.config_class.who
        wrapping.refuse_second(model, cls.layer_class, f"inject_{cls.kind}", who)
        if targets is None:
            targets, to_save = cls.select(model, config)
        else:
            cls.targeting.check(model, targets, config.target_modules)
            cls._refuse_odd_convs(model, targets)
        adapter = cls(config, targets, to_save)
        for wrapper in wrap_modules_to_save(model, to_save).values():
            wrapper.routing = adapter.switch  # disabled, they run the original module
        layers = {}
        for name, size in targets.items():
            layers[name] = cls.layer_class(model.get_submodule(name), size, config, adapter.switch)
            set_submodule(model, name, layers[name])
        attach(model, adapter)
        logging.getLogger(f"lightning_peft.peft.{cls.kind}").info(
            "%s: %d layers of %s; %s", who, len(layers), type(model).__name__, trainable_parameters(model))
        return layers

    # --- the protocol
    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state: dict[str, Tensor] = {}
        for name, layer in self.wrapped(model).items():
            state.update(self.own(layer, name))
        state.update(trained_biases(model, self.targets, self.config.bias))
        return {**state, **saved_state(model, self.modules_to_save)}

    def config_dict(self) -> dict[str, Any]:
        return {**super().config_dict(), "targets": self.block_sizes}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether this is the adapter ``config`` describes (`TargetsAdapter.matches`, the block sizes too)."""
        return super().matches(config) and ("targets" not in config or dict(config["targets"]) == self.block_sizes)

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> BlockAdapter:
        """Inject at the recorded names (the same modules whatever the rules would pick today)."""
        model = unwrap(model)
        targets, to_save = dict(config["targets"]), list(config["modules_to_save"])
        refuse_absent(model, [*targets, *to_save], f"{cls.config_class.who}: the recorded adapter")
        cls.place(model, cls.config_class(**config["config"]), targets, to_save)
        return attached(model)[cls.kind]

    def merged_state(self, model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        own = [key for name, layer in self.wrapped(model).items() for key in self.own(layer, name)]
        return wrapping.merged_state(model, state, self.targets, own)

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        """PEFT's fields, the targets written as exactly the adapted modules."""
        return {**wrapping.peft_common(model, self.peft_type, self.targets, self.modules_to_save),
                "exclude_modules": None, "layers_to_transform": None, "layers_pattern": None, "fan_in_fan_out": False,
                **{key: getattr(self.config, key) for key in self.written}}

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        """The file must describe this adapter's rotation (another block size or variant would load into tensors of
        the same shape, or fail late)."""
        who = self.config_class.who
        wrapping.refuse_merged_load(self.wrapped(model).values(), f"{who} rotations", f"unmerge_{self.kind}")
        theirs = self.config_class.from_peft(config, source)
        differ = [f"{f}={getattr(theirs, f)!r} (the model's: {getattr(self.config, f)!r})" for f in self.compared
                  if getattr(theirs, f) != getattr(self.config, f)]
        if differ:
            raise ValueError(f"load_adapter: {source} has {', '.join(differ)}. Load it into a model without {who}.")

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> BlockAdapter:
        wrapping.inject_from_peft(model, cls.config_class.from_peft(config, source), source,
                                  lambda ours: cls.place(model, ours))
        return attached(model)[cls.kind]
