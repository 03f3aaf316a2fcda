"""LyCORIS methods on a whole model, written once for LoHa and LoKr: target selection, inject, merge, unmerge,
disable, unload, and the side of the adapter protocol they share (with Hugging Face PEFT's file format: one
``<module>.<parameter>`` key per factor, ``adapter_config.json`` with PEFT's fields).

A method supplies a `lightning_peft.peft.lycoris.LycorisConfig` subclass, a
`lightning_peft.peft.lycoris.LycorisLayer` subclass and a registered
`lightning_peft.peft.lycoris.LycorisAdapter` subclass naming both (``kind``, ``peft_type``,
``config_class``, ``layer_class``); its public functions call the ones here with that adapter class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from torch import Tensor, nn

from .._base_identity import adapter_task_type, base_model_name
from .._common import (
    chosen_by_name,
    exact_choice,
    in_layers,
    inside,
    is_quantized,
    name_matches,
    output_head,
    refuse_absent,
    refuse_no_target,
    refuse_second_injection,
    refuse_unmatched,
    require,
    wraps_a_layer,
)
from .._in_place import Switch, folded, merge_layers, switched_off, unmerge_layers
from ..adapter import (
    Adapter,
    attach,
    attached,
    clean_key,
    detach,
    remove_adapter,
    trainable_parameters,
    unwrap,
)
from ..modules_to_save import (
    ModulesToSave,
    fold_modules_to_save,
    plain_key,
    present_modules,
    restore_modules,
    saved_state,
    select_modules_to_save,
    set_submodule,
    wrap_modules_to_save,
)
from .config import LycorisConfig
from .layer import KINDS_TEXT, LycorisLayer, supported

log = logging.getLogger("lightning_peft.peft.lycoris")


def layers_of(model: nn.Module, layer_class: type[LycorisLayer]) -> dict[str, LycorisLayer]:
    """The ``layer_class`` layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, layer_class)}


def describe_modules(model: nn.Module) -> str:
    """'lin0, conv (x2), ...': leaf names of the modules a LyCORIS layer can wrap, for messages."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if name and supported(module) and not name.endswith(".base_layer"):
            leaf = name.rsplit(".", 1)[-1]
            counts[leaf] = counts.get(leaf, 0) + 1
    if not counts:
        return f"none (LyCORIS layers wrap {KINDS_TEXT}, and {type(model).__name__} has no such module)"
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items())


def select(model: nn.Module, config: LycorisConfig) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names, as PEFT picks them; raises before anything is changed."""
    who = config.who
    names = [n for n, _ in model.named_modules() if n]
    to_save = select_modules_to_save(model, config.modules_to_save, who)
    if config.target_modules == "all-linear":
        view = dict(model.named_modules())
        linear = _linear_types()
        head = output_head(model, view, linear)
        chosen = [n for n in names if isinstance(view[n], linear) and n != head]
    else:
        chosen = chosen_by_name(who, config.target_modules, names, model, describe_modules)
    if config.layers_to_transform is not None and chosen:
        chosen = in_layers(who, chosen, config.target_modules, config.layers_to_transform, config.layers_pattern,
                           model)
    if config.exclude_modules is not None:
        refuse_unmatched(who, config.exclude_modules, names, model, describe_modules, "exclude_modules")
        chosen = [n for n in chosen if not name_matches(n, config.exclude_modules)]
    chosen = [n for n in chosen if not inside(n, to_save)]
    if not chosen:
        refuse_no_target(who, config.target_modules, model, "adapt", describe_modules(model),
                         "encoder.layer.0.attention.self.query")
    for name in chosen:
        module = model.get_submodule(name)
        if isinstance(module, ModulesToSave) or wraps_a_layer(module):
            raise ValueError(f"{who}: {name!r} is already wrapped by another technique ({type(module).__name__}); a "
                             f"{who} layer around it would move that technique's parameters. Keep {who} off it.")
        if not supported(module):
            raise TypeError(f"{who}(target_modules={config.target_modules!r}): {name!r} is a "
                            f"{type(module).__name__}; {who} adapts {KINDS_TEXT} (Hugging Face PEFT's {who} layers). "
                            f"{type(model).__name__} has: {describe_modules(model)}.")
    return chosen, to_save


def _linear_types() -> tuple[type, ...]:
    """What ``"all-linear"`` picks, as PEFT: ``nn.Linear`` and, once transformers is imported, its ``Conv1D``."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)


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
    existing = layers_of(model, adapter_class.layer_class)
    who = adapter_class.config_class.who
    found = f"{who} layers (e.g. {next(iter(existing))!r})" if existing else None
    refuse_second_injection(f"inject_{adapter_class.kind}", model, found, who)


def _required(model: nn.Module, adapter_class: type[LycorisAdapter], who: str) -> LycorisAdapter:
    what = f"{adapter_class.config_class.who} adapter"
    return require(model, adapter_class.kind, who, what, f"inject_{adapter_class.kind}")


def merge(model: nn.Module, adapter_class: type[LycorisAdapter]) -> list[str]:
    """Add every layer's ``ΔW`` to its base weight in place; layers already merged are left alone. All or nothing.

    Returns:
        The names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no such adapter, a weight is tied to another module or quantized, or a merged
            weight is not finite (the layers merged by this call are unmerged again).
    """
    who = f"merge_{adapter_class.kind}"
    _required(model, adapter_class, who)
    return merge_layers(unwrap(model), layers_of(model, adapter_class.layer_class), who)


def unmerge(model: nn.Module, adapter_class: type[LycorisAdapter]) -> list[str]:
    """Subtract the merged ``ΔW`` from the base weights, in place.

    Raises:
        RuntimeError: If no layer is merged.
    """
    kind = adapter_class.kind
    _required(model, adapter_class, f"unmerge_{kind}")
    return unmerge_layers(unwrap(model), layers_of(model, adapter_class.layer_class), f"unmerge_{kind}",
                          adapter_class.config_class.who, f"merge_{kind}")


@contextlib.contextmanager
def disable(model: nn.Module, adapter_class: type[LycorisAdapter]) -> Iterator[None]:
    """Context manager: inside it every layer of the adapter computes its base layer's output, and every
    ``modules_to_save`` wrapper its original module's.

    Raises:
        RuntimeError: If ``model`` has no such adapter, or a layer is merged (the base output is then not available).
    """
    kind = adapter_class.kind
    switch = _required(model, adapter_class, f"disable_{kind}").switch
    with switched_off(switch, layers_of(model, adapter_class.layer_class), f"disable_{kind}", "updates",
                      f"unmerge_{kind}"):
        yield


def unload(model: nn.Module, adapter_class: type[LycorisAdapter], merge: bool = True) -> nn.Module:
    """Remove the adapter from ``model`` in place and return the plain model: with ``merge``, the updates added to the
    base weights and the trained ``modules_to_save`` copies kept; without, the base as it was. Other techniques stay.

    Raises:
        RuntimeError: If ``model`` has no such adapter, or (``merge``) a merged weight would be quantized or not
            finite.
    """
    return remove_adapter(model, _required(model, adapter_class, f"unload_{adapter_class.kind}"), merge)


# --- the adapter protocol ------------------------------------------------------------------------------------


class LycorisAdapter(Adapter):
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

    def __init__(self, config: LycorisConfig, targets: Iterable[str], modules_to_save: Iterable[str]) -> None:
        self.config = config
        self.targets = tuple(targets)
        self.modules_to_save = tuple(modules_to_save)
        self.switch = Switch()  # shared by its layers and modules_to_save wrappers

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.targets)} targets, modules_to_save={list(self.modules_to_save)})"

    def layers(self, model: nn.Module) -> dict[str, LycorisLayer]:
        model = unwrap(model)
        return {name: model.get_submodule(name) for name in self.targets}

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        state = {f"{name}.{p}": getattr(layer, p) for name, layer in self.layers(model).items()
                 for p in layer.parameter_names if p in layer._parameters}
        return {**state, **saved_state(unwrap(model), self.modules_to_save)}

    def config_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "targets": list(self.targets),
                "modules_to_save": list(self.modules_to_save)}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether this is the adapter ``config`` describes (a `config_dict`, or a callback's request
        ``{"config": ...}``, whose names are not resolved yet)."""
        if self.config_class(**config["config"]) != self.config:
            return False
        return all(list(config[key]) == list(getattr(self, key)) for key in ("targets", "modules_to_save")
                   if key in config)

    def wrapped(self, model: nn.Module) -> dict[str, nn.Module]:
        return dict(self.layers(model))

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> LycorisAdapter:
        """Inject at the recorded names (the same modules whatever the rules would pick today)."""
        inject(model, cls.config_class(**config["config"]), cls, list(config["targets"]),
               list(config["modules_to_save"]))
        return attached(model)[cls.kind]

    def merged_state(self, model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        model = unwrap(model)
        merged = folded(model, self.targets, "merged_state_dict")
        for name, layer in self.layers(model).items():
            for p in layer.parameter_names:
                state.pop(f"{name}.{p}", None)
            prefix = f"{name}.base_layer."
            for key in [k for k in state if k.startswith(prefix)]:
                state[f"{name}.{key[len(prefix):]}"] = state.pop(key)
            state.update({f"{name}.{key}": value for key, value in merged[name].items()})
        return fold_modules_to_save(model, state)

    def unload(self, model: nn.Module, merge: bool) -> None:
        model = unwrap(model)
        layers = self.layers(model)
        who = f"unload_{self.kind}(merge=True)"
        if merge:
            quantized = [n for n, layer in layers.items() if is_quantized(layer.base_layer.weight)]
            if quantized:
                raise RuntimeError(f"{who}: the base weight of {quantized[0]!r} is quantized; merging would have to "
                                   "requantize it. Export merged_state_dict(model) instead.")
            merged = folded(model, [n for n, layer in layers.items() if not layer.merged], who)
            for name, tensors in merged.items():
                layers[name].write(tensors["weight"])
        for name, layer in layers.items():
            if not merge:
                layer.unmerge()
            set_submodule(model, name, layer.base_layer)
        restore_modules(model, self.modules_to_save, trained=merge)
        detach(model, self.kind)

    # --- Hugging Face PEFT's format ---

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        return {clean_key(plain_key(k)): v for k, v in self.state(model).items()}

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        """PEFT's fields: ours as they are, but the targets written as exactly the adapted modules (so PEFT adapts
        the same ones whatever ``layers_to_transform`` or ``exclude_modules`` said)."""
        names = [clean_key(n) for n, _ in unwrap(model).named_modules() if n]
        fields = self.config.to_dict()
        fields.update({
            "peft_type": self.peft_type,
            "task_type": adapter_task_type(model, self.targets, self.modules_to_save),
            "base_model_name_or_path": base_model_name(model),
            "inference_mode": True,
            "target_modules": exact_choice([clean_key(n) for n in self.targets], names),
            "exclude_modules": None,
            "layers_to_transform": None,
            "layers_pattern": None,
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
        })
        return fields

    def peft_problems(self, model: nn.Module) -> list[str]:
        """A convolution padded other than with zeros: PEFT pads the update with zeros (``F.conv2d(padding=...)``),
        ours as the base is padded, so PEFT would compute other outputs from the same file."""
        return [f"{name!r} is a convolution with padding_mode={layer.base_layer.padding_mode!r}, and PEFT's "
                f"{self.config_class.who} pads the update with zeros" for name, layer in self.layers(model).items()
                if getattr(layer.base_layer, "padding_mode", "zeros") != "zeros"]

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        """A file loaded into this existing adapter must mean the same update: the same rank, alpha and settings per
        layer (a different alpha would load silently with this adapter's scale)."""
        who = self.config_class.who
        if any(layer.merged for layer in self.layers(model).values()):
            raise RuntimeError(f"load_adapter: the {who} updates are merged; call unmerge_{self.kind}(model) before "
                               "loading.")
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
        ours = cls.config_class.from_peft(config, source)
        # PEFT's task types write ["classifier", "score"] whatever the model calls its head: the absent are dropped
        ours = dataclasses.replace(ours, modules_to_save=present_modules(unwrap(model), ours.modules_to_save, source))
        try:
            inject(model, ours, cls)
        except ValueError as err:
            raise ValueError(f"load_adapter: {source}: {err}") from None
        return attached(model)[cls.kind]


def _check_rank(files: Any, key: str, got: tuple[int, ...], planned: tuple[int, ...], rank: int, field: str) -> None:
    """Raise (``files.torn``) if the file's tensor differs from the planned one along a dimension that holds the
    rank; other differences (another model) are left to the shape check against the model."""
    for dim, size in enumerate(planned):
        if size == rank and (len(got) <= dim or got[dim] != size):
            raise files.torn(key, got, dim, field, rank)
