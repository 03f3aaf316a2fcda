"""LyCORIS methods on a whole model, written once for LoHa and LoKr: target selection, inject, merge, unmerge,
disable, unload, and the side of the adapter protocol they share (with Hugging Face PEFT's file format: one
``<module>.<parameter>`` key per factor, ``adapter_config.json`` with PEFT's fields).

A method supplies a `lightning_peft.peft.lycoris.LycorisConfig` subclass, a
`lightning_peft.peft.lycoris.LycorisLayer` subclass and a registered
`lightning_peft.peft.lycoris.LycorisAdapter` subclass naming both (``kind``, ``peft_type``,
``config_class``, ``layer_class``); its public functions call the ones here with that adapter class.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

from torch import Tensor, nn

from .. import _wrapping as wrapping
from .._common import refuse_absent
from ..adapter import (
    attach,
    attached,
    clean_key,
    trainable_parameters,
    unwrap,
)
from ..modules_to_save import (
    saved_state,
    set_submodule,
    wrap_modules_to_save,
)
from .config import LycorisConfig
from .layer import KINDS_TEXT, LycorisLayer, supported

log = logging.getLogger("lightning_peft.peft.lycoris")


def layers_of(model: nn.Module, layer_class: type[LycorisLayer]) -> dict[str, LycorisLayer]:
    """The ``layer_class`` layers of ``model`` by full module name."""
    return wrapping.layers_of(model, layer_class)


def targeting(who: str) -> wrapping.Targeting:
    """What method ``who`` (``"LoHa"``) can adapt, and its choice of targets."""
    return wrapping.Targeting(who, who, "adapt", KINDS_TEXT, supported, "encoder.layer.0.attention.self.query")


def select(model: nn.Module, config: LycorisConfig) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names, as PEFT picks them; raises before anything is changed."""
    return targeting(config.who).select(model, config)


def inject(model: nn.Module, config: LycorisConfig, adapter_class: type[LycorisAdapter],
           targets: list[str] | None = None, to_save: list[str] | None = None) -> dict[str, LycorisLayer]:
    """Wrap the targets of ``model`` (``targets``/``to_save`` given: exactly those, recorded names) in
    ``adapter_class.layer_class`` layers, in place, attach the adapter, and freeze everything else.

    Raises:
        RuntimeError: If ``model`` already has this method.
        ValueError, TypeError: As `select`, before anything changes.
    """
    model = unwrap(model)
    _refuse_second_injection(model, adapter_class)
    if targets is None:
        targets, to_save = select(model, config)
    else:
        refuse_absent(model, [*targets, *to_save], f"{config.who}: the recorded adapter")
    adapter = adapter_class(config, targets, to_save)
    for wrapper in wrap_modules_to_save(model, to_save).values():
        wrapper.routing = adapter.switch  # disabled, they run the original module
    layers = {}
    for name in targets:
        layers[name] = adapter_class.layer_class(model.get_submodule(name), config.rank_for(name),
                                                 config.alpha_for(name), config, adapter.switch)
        set_submodule(model, name, layers[name])
    attach(model, adapter)
    log.info("%s: %d layers of %s; %s", config.who, len(layers), type(model).__name__, trainable_parameters(model))
    return layers


def _refuse_second_injection(model: nn.Module, adapter_class: type[LycorisAdapter]) -> None:
    wrapping.refuse_second(model, adapter_class.layer_class, f"inject_{adapter_class.kind}",
                           adapter_class.config_class.who)


# a method's merge, unmerge, disable and unload: the shared ones, called with its adapter class
merge, unmerge, disable, unload = wrapping.merge, wrapping.unmerge, wrapping.disable, wrapping.unload


# --- the adapter protocol ------------------------------------------------------------------------------------


class LycorisAdapter(wrapping.TargetsAdapter):
    """The side of the adapter protocol LyCORIS methods share: what an inject function did to a model. A method
    subclasses it (and registers the subclass) with ``kind``, ``peft_type``, ``config_class`` and ``layer_class``.

    Args:
        config: The config used.
        targets: Full names of the adapted modules.
        modules_to_save: Full names of the modules trained and saved in full.
    """

    config_class: ClassVar[type[LycorisConfig]]
    layer_class: ClassVar[type[LycorisLayer]]
    mergeable: ClassVar[bool] = True
    training_only: ClassVar[tuple[str, ...]] = ("init_weights",)

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        state = {f"{name}.{p}": getattr(layer, p) for name, layer in self.wrapped(model).items()
                 for p in layer.parameter_names if p in layer._parameters}
        return {**state, **saved_state(unwrap(model), self.modules_to_save)}

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> LycorisAdapter:
        """Inject at the recorded names (the same modules whatever the rules would pick today)."""
        inject(model, cls.config_class(**config["config"]), cls, list(config["targets"]),
               list(config["modules_to_save"]))
        return attached(model)[cls.kind]

    def merged_state(self, model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        own = [f"{name}.{p}" for name, layer in self.wrapped(model).items() for p in layer.parameter_names
               if p in layer._parameters]
        return wrapping.merged_state(model, state, self.targets, own)

    # --- Hugging Face PEFT's format ---

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        """PEFT's fields: ours as they are, but the targets written as exactly the adapted modules (so PEFT adapts
        the same ones whatever ``layers_to_transform`` or ``exclude_modules`` said)."""
        return {**self.config.to_dict(), **wrapping.peft_common(model, self.peft_type, self.targets, self.modules_to_save),
                "exclude_modules": None, "layers_to_transform": None, "layers_pattern": None}

    def peft_problems(self, model: nn.Module) -> list[str]:
        """A convolution padded other than with zeros: PEFT pads the update with zeros (``F.conv2d(padding=...)``),
        ours as the base is padded, so PEFT would compute other outputs from the same file."""
        return [f"{name!r} is a convolution with padding_mode={layer.base_layer.padding_mode!r}, and PEFT's "
                f"{self.config_class.who} pads the update with zeros" for name, layer in self.wrapped(model).items()
                if getattr(layer.base_layer, "padding_mode", "zeros") != "zeros"]

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        """A file loaded into this existing adapter must mean the same update: the same rank, alpha and settings per
        layer (a different alpha would load silently with this adapter's scale)."""
        who = self.config_class.who
        wrapping.refuse_merged_load(self.wrapped(model).values(), f"{who} updates", f"unmerge_{self.kind}")
        theirs = self.config_class.from_peft(config, source)
        for name in self.targets:
            key = clean_key(name)
            for what, mine, file in (("r", self.config.rank_for(name), theirs.rank_for(key)),
                                     ("alpha", self.config.alpha_for(name), theirs.alpha_for(key))):
                if mine != file:
                    raise ValueError(f"load_adapter: {source} gives {name!r} {what}={file!r}, but the model's {who} "
                                     f"adapter has {what}={mine!r}. Load it into a model without {who}.")
        for field in dataclasses.fields(self.config):
            if field.name in self.shape_fields and getattr(theirs, field.name) != getattr(self.config, field.name):
                raise ValueError(f"load_adapter: {source} has {field.name}={getattr(theirs, field.name)!r}, but the "
                                 f"model's {who} adapter has {getattr(self.config, field.name)!r}. Load it into a "
                                 f"model without {who}.")

    #: Config fields that decide the factors' layout (beside r): a file must agree with an existing adapter on them.
    shape_fields: ClassVar[tuple[str, ...]] = ("use_effective_conv2d",)

    @classmethod
    def check_peft_shapes(cls, model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                          files: Any, inject: bool) -> None:
        """Before anything is allocated (``inject``): every tensor the config would allocate on ``model`` is in the
        file, with the rank the file's own config gives its module."""
        if not inject:
            return  # the existing adapter's shapes are checked against the file's
        ours = cls.config_class.from_peft(config, str(files.config))
        model = unwrap(model)
        try:
            targets, _ = select(model, dataclasses.replace(ours, modules_to_save=[]))
        except (ValueError, TypeError):
            return  # from_peft raises the same, naming the file
        missing = []
        for name in targets:
            rank = ours.rank_for(clean_key(name))
            base = model.get_submodule(name)
            for parameter, shape in cls.layer_class.parameter_shapes(base, rank, ours).items():
                key = f"{clean_key(name)}.{parameter}"
                if key not in shapes:
                    missing.append(key)
                    continue
                _check_rank(files, key, shapes[key], shape, rank, ours.rank_field(clean_key(name)))
        if missing:
            raise files.lacking(missing, "its adapter config asks for", type(model).__name__)

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> LycorisAdapter:
        wrapping.inject_from_peft(model, cls.config_class.from_peft(config, source), source,
                                  lambda ours: inject(model, ours, cls))
        return attached(model)[cls.kind]


def _check_rank(files: Any, key: str, got: tuple[int, ...], planned: tuple[int, ...], rank: int, field: str) -> None:
    """Raise (``files.torn``) if the file's tensor differs from the planned one along a dimension that holds the
    rank; other differences (another model) are left to the shape check against the model."""
    for dim, size in enumerate(planned):
        if size == rank and (len(got) <= dim or got[dim] != size):
            raise files.torn(key, got, dim, field, rank)
