"""IA³ on a whole model: inject, merge, disable, unload, and IA³'s side of the adapter protocol (with Hugging Face PEFT's
file format).

Paper: Liu et al., "Few-Shot Parameter-Efficient Fine-Tuning is Better and Cheaper than In-Context Learning",
arXiv:2205.05638 ((IA)³: Infused Adapter by Inhibiting and Amplifying Inner Activations). A learned vector rescales
the activations of chosen layers; it is the only thing that trains (besides ``modules_to_save``):

```text
h = l ⊙ (W x + b)        a target's output (the paper's keys and values: l_k, l_v)
h = W (l ⊙ x) + b        a feed-forward target's input (the paper's l_ff, on the second feed-forward layer)
```

``l`` starts at ones, so the adapted model starts equal to the base. Several named adapters on one model, as PEFT
keeps them: `add_ia3_adapter`, `set_ia3_adapter`, `delete_ia3_adapter` (one runs at a time; files in PEFT's
multi-adapter layout). Merged, ``l`` scales ``W``'s rows and ``b`` (output)
or ``W``'s columns (input; ``b`` is unchanged), as PEFT merges it. Shapes and the layer types: `lightning_peft.peft.ia3.layer`.

Equal to Hugging Face PEFT 0.21.2's IA³ (``peft_type: "IA3"``): the same targets for a config, the same outputs, merged
weights and files (``<module>.ia3_l``). Two deliberate differences: an in-place merge is divided back exactly (PEFT
divides by ``l + 1e-8``), and one with a zero in ``l`` is refused (PEFT's unmerge cannot restore that weight).

Examples:
    >>> from torch import nn
    >>> from lightning_peft.peft import inject_ia3, trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> sorted(inject_ia3(model, target_modules=["0", "2"], feedforward_modules=["2"]))
    ['0', '2']
    >>> trainable_parameters(model).trainable  # 16 output scales of '0', 16 input scales of '2'
    32
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .._base_identity import adapter_task_type, base_model_name
from .._common import (
    all_linear,
    chosen_by_name,
    exact_choice,
    inside,
    is_quantized,
    name_matches,
    refuse_absent,
    refuse_no_target,
    refuse_second_injection,
    refuse_unmatched,
    require,
    usable_adapter_name,
    wraps_a_layer,
)
from ..adapter import (
    DEFAULT,
    Adapter,
    attach,
    attached,
    clean_key,
    detach,
    register,
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
from .config import PEFT_FIELDS, PEFT_TYPE, WHO, IA3Config, as_config
from .layer import IA3Layer, Switch, linear_kinds, supported

log = logging.getLogger("lightning_peft.peft.ia3")
_KINDS = "nn.Linear, transformers Conv1D, nn.Conv2d, nn.Conv3d"
_KEY = "ia3_l.<name>"  # where an adapter name goes in the parameter names


def ia3_layers(model: nn.Module) -> dict[str, IA3Layer]:
    """All IA³ layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, IA3Layer)}


def inject_ia3(model: nn.Module, config: IA3Config | None = None, adapter_name: str = DEFAULT,
               **kwargs: Any) -> dict[str, IA3Layer]:
    """Wrap the ``target_modules`` of ``model`` in `IA3Layer`s (`lightning_peft.peft.ia3.layer`), in place, and
    freeze everything but the vectors (and ``modules_to_save``).

    Args:
        model: Any ``nn.Module`` (a Hugging Face model, the ``PreTrainedModel`` itself).
        config: An [`IA3Config`][lightning_peft.peft.IA3Config]; or its fields as keyword arguments.
        adapter_name: The adapter's name; it is the active one. More named adapters: `add_ia3_adapter`.

    Returns:
        The new layers by module name.

    Raises:
        RuntimeError: If ``model`` already has IA³.
        ValueError: If a name matches nothing, a target is wrapped by another technique, or a setting is invalid.
        TypeError: If a target is a layer IA³ cannot scale, or an argument has the wrong type.
    """
    config = as_config(config, kwargs, "inject_ia3")
    usable_adapter_name(adapter_name, "inject_ia3", _KEY)
    model = unwrap(model)
    _refuse_second_injection(model)
    targets, to_save = select(model, config)
    return _inject(model, config, adapter_name, targets, [n for n in targets if config.is_feedforward(n)], to_save)


def add_ia3_adapter(model: nn.Module, name: str, config: IA3Config | None = None, **kwargs: Any) -> dict[str, IA3Layer]:
    """Add IA³ adapter ``name`` to a model that has IA³ already (PEFT's ``add_adapter``); the active adapter stays.

    It has its own targets (its vectors start at ones, the base output); a module it shares with another adapter keeps
    one IA³ layer holding both vectors, and must be scaled at the same side (input or output) by both.
    ``modules_to_save`` is shared by every adapter of the model: declared with the first one.

    Returns:
        The IA³ layers that received a vector for ``name``, by module name.

    Raises:
        RuntimeError: If ``model`` has no IA³, or an adapter is merged.
        ValueError: If ``name`` is taken or unusable, the targets match nothing, a shared module would be scaled at
            the other side, or ``modules_to_save`` is not the model's.
    """
    adapter = require(model, IA3Adapter.kind, "add_ia3_adapter", "IA³ adapter", "inject_ia3")
    config = as_config(config, kwargs, "add_ia3_adapter")
    usable_adapter_name(name, "add_ia3_adapter", _KEY)
    if name in adapter.adapters:
        raise ValueError(f"add_ia3_adapter: the model already has an IA³ adapter named {name!r}; pick another name or "
                         "delete_ia3_adapter(model, name) first.")
    model = unwrap(model)
    _refuse_merged(model, "add_ia3_adapter")
    shared = list(adapter.modules_to_save)
    asked = config.modules_to_save
    if asked is not None and (len(asked) != len(shared) or not all(name_matches(n, asked) for n in shared)):
        raise ValueError(f"add_ia3_adapter({name!r}): modules_to_save={asked!r}, but the model trains "
                         f"{shared} in full; modules_to_save is shared by every adapter of a model, so declare it once, "
                         "with the first adapter (inject_ia3).")
    targets, _ = select(model, config, shared)
    feedforward = [n for n in targets if config.is_feedforward(n)]
    for target in targets:
        layer = model.get_submodule(target)
        if isinstance(layer, IA3Layer) and layer.feedforward != (target in feedforward):
            sides = {True: "input", False: "output"}
            raise ValueError(f"add_ia3_adapter({name!r}): {target!r} would be scaled at its "
                             f"{sides[target in feedforward]}, but the model's other IA³ adapters scale its "
                             f"{sides[layer.feedforward]}; one layer scales one side. Change feedforward_modules.")
    return _inject(model, config, name, targets, feedforward, shared)


def set_ia3_adapter(model: nn.Module, name: str) -> None:
    """Make IA³ adapter ``name`` the one every IA³ layer runs (PEFT's ``set_adapter``).

    Raises:
        ValueError: If ``name`` names no IA³ adapter.
        RuntimeError: If another adapter is merged.
    """
    adapter = require(model, IA3Adapter.kind, "set_ia3_adapter", "IA³ adapter", "inject_ia3")
    adapter.known(name, "set_ia3_adapter")
    if name != adapter.switch.active:
        _refuse_merged(model, f"set_ia3_adapter({name!r})")
    adapter.switch.active = name


def active_ia3_adapter(model: nn.Module) -> str:
    """The name of the IA³ adapter the model runs."""
    return require(model, IA3Adapter.kind, "active_ia3_adapter", "IA³ adapter", "inject_ia3").switch.active


def delete_ia3_adapter(model: nn.Module, name: str) -> None:
    """Remove IA³ adapter ``name``; layers left without a vector become plain modules again.

    Raises:
        ValueError: If ``name`` names no IA³ adapter.
        RuntimeError: If it is the active adapter or the only one, or an adapter is merged.
    """
    require(model, IA3Adapter.kind, "delete_ia3_adapter", "IA³ adapter", "inject_ia3").remove(model, name)


def _refuse_merged(model: nn.Module, who: str) -> None:
    merged = [n for n, layer in ia3_layers(model).items() if layer.merged]
    if merged:
        raise RuntimeError(f"{who}: layer {merged[0]!r} has an IA³ vector merged into its weight; call "
                           "unmerge_ia3(model) first.")


def describe_modules(model: nn.Module) -> str:
    """'k, v (x2 each), ...': leaf names of the modules IA³ can scale, for messages."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if name and supported(module) and not name.endswith(".base_layer"):
            counts[name.rsplit(".", 1)[-1]] = counts.get(name.rsplit(".", 1)[-1], 0) + 1
    if not counts:
        return f"none (IA³ scales {_KINDS}, and {type(model).__name__} has no such module)"
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items())


def select(model: nn.Module, config: IA3Config, to_save: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names, as PEFT picks them; raises before anything is changed. An IA³ layer
    stands for its base layer (another named adapter may scale it too); ``to_save``: the model's already."""
    view = _view(model)
    inner = [f"{n}." for n, m in model.named_modules() if isinstance(m, IA3Layer)]
    names = [n for n, _ in model.named_modules() if n and not any(n.startswith(i) for i in inner)]
    if to_save is None:
        to_save = select_modules_to_save(model, config.modules_to_save, WHO)
    if config.target_modules == "all-linear":
        chosen = all_linear(model, view, linear_kinds())
    else:
        chosen = chosen_by_name(WHO, config.target_modules, names, model, describe_modules)
    if config.exclude_modules is not None:
        refuse_unmatched(WHO, config.exclude_modules, names, model, describe_modules, "exclude_modules")
        chosen = [n for n in chosen if not name_matches(n, config.exclude_modules)]
    chosen = [n for n in chosen if not inside(n, to_save)]
    if not chosen:
        refuse_no_target(WHO, config.target_modules, model, "scale", describe_modules(model),
                         "encoder.block.0.layer.0.SelfAttention.k")
    for name in chosen:
        module = view[name] if name in view else model.get_submodule(name)
        if isinstance(module, ModulesToSave) or wraps_a_layer(module):
            raise ValueError(f"{WHO}: {name!r} is already wrapped by another technique ({type(module).__name__}); an "
                             "IA³ layer around it would move that technique's parameters. Keep IA³ off this module.")
        if not supported(module):
            raise TypeError(f"{WHO}(target_modules={config.target_modules!r}): {name!r} is a {type(module).__name__}; "
                            f"IA³ scales {_KINDS} (Hugging Face PEFT's IA³ layers). {type(model).__name__} has: "
                            f"{describe_modules(model)}.")
    return chosen, to_save


def _view(model: nn.Module) -> dict[str, nn.Module]:
    """``named_modules`` with an IA³ layer standing for its base layer and the insides of wrappers and
    ``modules_to_save`` hidden (their linear layers "all-linear" must not reach; other techniques' wrappers are not
    linear layers, so they stay out too)."""
    view: dict[str, nn.Module] = {}
    hidden: list[str] = []
    for name, module in model.named_modules():
        if not any(name.startswith(h) for h in hidden):
            view[name] = module.base_layer if isinstance(module, IA3Layer) else module
            if name and (isinstance(module, ModulesToSave) or wraps_a_layer(module)):
                hidden.append(f"{name}.")
    return view


def _refuse_second_injection(model: nn.Module) -> None:
    existing = ia3_layers(model)
    found = f"IA³ layers (e.g. {next(iter(existing))!r})" if existing else None
    refuse_second_injection("inject_ia3", model, found, "IA³")


def _inject(model: nn.Module, config: IA3Config, adapter_name: str, targets: list[str], feedforward: list[str],
            to_save: list[str]) -> dict[str, IA3Layer]:
    """Give adapter ``adapter_name`` a vector at exactly ``targets`` (checked), wrap ``to_save`` (the first adapter),
    and attach."""
    adapter = attached(model).get(IA3Adapter.kind)
    if adapter is None:
        adapter = IA3Adapter({}, to_save, Switch(adapter_name))
        for wrapper in wrap_modules_to_save(model, to_save).values():
            wrapper.routing = adapter.switch  # disabled, they run the original module
    layers = {}
    for name in targets:
        layer = model.get_submodule(name)
        if isinstance(layer, IA3Layer):  # another named adapter's layer: a second vector
            layer.add_adapter(adapter_name, config.init_ia3_weights)
        else:
            layer = IA3Layer(layer, name in feedforward, config.init_ia3_weights, adapter.switch, adapter_name)
            set_submodule(model, name, layer)
        layers[name] = layer
    adapter.adapters[adapter_name] = Named(config, tuple(targets), tuple(feedforward))
    attach(model, adapter)
    log.info("IA³: adapter %r on %d layers of %s (%d scaled at the input); %s", adapter_name, len(layers),
             type(model).__name__, len(feedforward), trainable_parameters(model))
    return layers


def unload_ia3(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove IA³ from ``model`` in place and return the plain model: with ``merge``, the vectors folded into the base
    weights and the trained ``modules_to_save`` copies kept; without, the base as it was. Other techniques stay.

    Raises:
        RuntimeError: If ``model`` has no IA³, or (``merge``) a merged weight would be quantized or not finite.
    """
    return remove_adapter(model, require(model, IA3Adapter.kind, "unload_ia3", "IA³ adapter", "inject_ia3"), merge)


def merge_ia3(model: nn.Module) -> list[str]:
    """Fold the active adapter's vectors into their base weights in place (`unmerge_ia3` divides
    them out again); layers already merged are left alone. All or nothing.

    Returns:
        The names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no IA³, a weight is tied to another module or quantized, a vector has a zero,
            or a merged weight is not finite (the layers merged by this call are unmerged again).
    """
    require(model, IA3Adapter.kind, "merge_ia3", "IA³ adapter", "inject_ia3")
    model = unwrap(model)
    layers = {n: layer for n, layer in ia3_layers(model).items() if not layer.merged and layer.vector() is not None}
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for name, layer in layers.items():
        others = [o for o in owners.get(id(layer.base_layer.weight), []) if not o.startswith(f"{name}.")]
        if others:
            raise RuntimeError(f"merge_ia3: the weight of {name!r} is tied to {others[0]!r}; merging in place would "
                               "change both. Use merged_state_dict(model) for an export, or untie the weights first.")
    done: list[str] = []
    for name, layer in layers.items():
        try:
            layer.merge()
        except RuntimeError as err:
            for merged in reversed(done):
                layers[merged].unmerge()
            raise RuntimeError(f"merge_ia3: layer {name!r}: {err}") from None
        done.append(name)
    return done


def unmerge_ia3(model: nn.Module) -> list[str]:
    """Divide the merged vectors out of the base weights, in place (exact up to one rounding in the weight's dtype).

    Raises:
        RuntimeError: If no IA³ layer is merged.
    """
    require(model, IA3Adapter.kind, "unmerge_ia3", "IA³ adapter", "inject_ia3")
    merged = {n: layer for n, layer in ia3_layers(model).items() if layer.merged}
    if not merged:
        raise RuntimeError(f"unmerge_ia3: no IA³ layer of {type(unwrap(model)).__name__} is merged; call merge_ia3 "
                           "first.")
    for layer in merged.values():
        layer.unmerge()
    return list(merged)


@contextlib.contextmanager
def disable_ia3(model: nn.Module) -> Iterator[None]:
    """Context manager: inside it every IA³ layer computes its base layer's output, and every ``modules_to_save``
    wrapper its original module's.

    Raises:
        RuntimeError: If ``model`` has no IA³, or a layer is merged (the base output is then not available).
    """
    switch = require(model, IA3Adapter.kind, "disable_ia3", "IA³ adapter", "inject_ia3").switch
    if any(layer.merged for layer in ia3_layers(model).values()):
        raise RuntimeError("disable_ia3: the vectors are merged into the base weights; call unmerge_ia3(model) first.")
    before, switch.disabled = switch.disabled, True
    try:
        yield
    finally:
        switch.disabled = before


def _folded(model: nn.Module, targets: Iterable[str], who: str,
            adapter_name: str | None = None) -> dict[str, dict[str, Tensor]]:
    """Every target's merged weights (`IA3Layer.merged_weights`) with adapter ``adapter_name`` (default: the active
    one); raises, naming the layer, if one is not finite."""
    folded = {name: model.get_submodule(name).merged_weights(adapter_name) for name in targets}
    for name, tensors in folded.items():
        if not all(torch.isfinite(t).all() for t in tensors.values()):
            raise RuntimeError(f"{who}: layer {name!r}: the merged weight would hold inf or NaN; check the training "
                               "for divergence. Nothing was merged.")
    return folded


# --- the adapter protocol ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Named:
    """One named IA³ adapter: its config, the modules it scales and those of them scaled at the input."""

    config: IA3Config
    targets: tuple[str, ...]
    feedforward: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "targets": list(self.targets), "feedforward": list(self.feedforward)}


@register
class IA3Adapter(Adapter):
    """IA³'s side of the adapter protocol: the named IA³ adapters [`inject_ia3`][lightning_peft.peft.inject_ia3] and
    `add_ia3_adapter` put on a model.

    Args:
        adapters: ``{adapter name: Named}``, in the order they were added.
        modules_to_save: Full names of the modules trained and saved in full; shared by every named adapter.
        switch: The `Switch` every IA³ layer of the model holds (the active adapter, disabled or not).
    """

    kind: ClassVar[str] = "ia3"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = PEFT_FIELDS
    mergeable: ClassVar[bool] = True
    named: ClassVar[bool] = True
    training_only: ClassVar[tuple[str, ...]] = ("init_ia3_weights",)

    def __init__(self, adapters: dict[str, Named], modules_to_save: Iterable[str], switch: Switch) -> None:
        self.adapters = dict(adapters)
        self.modules_to_save = tuple(modules_to_save)
        self.switch = switch  # shared by its layers and modules_to_save wrappers

    def __repr__(self) -> str:
        names = ", ".join(f"{n}: {len(a.targets)} targets, {len(a.feedforward)} feed-forward"
                          for n, a in self.adapters.items())
        return f"IA3Adapter({names}; active={self.switch.active!r}, modules_to_save={list(self.modules_to_save)})"

    @property
    def names(self) -> tuple[str, ...]:
        """The adapter names, in the order they were added."""
        return tuple(self.adapters)

    @property
    def config(self) -> IA3Config:
        """The first adapter's config (the one [`inject_ia3`][lightning_peft.peft.inject_ia3] used)."""
        return next(iter(self.adapters.values())).config

    @property
    def targets(self) -> tuple[str, ...]:
        """Every scaled module (the union over the named adapters), in order of first adaptation."""
        return tuple(dict.fromkeys(t for a in self.adapters.values() for t in a.targets))

    def known(self, name: object, who: str) -> str:
        if name not in self.adapters:
            raise ValueError(f"{who}: no IA³ adapter named {name!r}; the model has {list(self.adapters)}.")
        return name

    def _name(self, adapter_name: str | None, who: str = "IA3") -> str:
        return self.known(self.switch.active if adapter_name is None else adapter_name, who)

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state = {f"{t}.ia3_l.{n}": v for t in self.targets for n, v in model.get_submodule(t).ia3_l.items()}
        return {**state, **saved_state(model, self.modules_to_save)}

    def config_dict(self) -> dict[str, Any]:
        return {"adapters": {n: a.to_dict() for n, a in self.adapters.items()},
                "modules_to_save": list(self.modules_to_save), "active": self.switch.active}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether this is the adapter ``config`` describes (a `config_dict`, the active adapter not compared; or a
        callback's request ``{"config": IA3Config.to_dict()}``, whose names are not resolved yet: the first adapter)."""
        if "adapters" not in config:
            first = next(iter(self.adapters.values()))
            return IA3Config(**config["config"]) == first.config and all(
                list(config[k]) == list(getattr(first, k)) for k in ("targets", "feedforward") if k in config)
        mine = self.config_dict()
        return config["adapters"] == mine["adapters"] and config["modules_to_save"] == mine["modules_to_save"]

    @classmethod
    def resume_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Flat fields of every named adapter (``<name>.<field>``, ``default``'s bare), less the training-only ones
        and the active adapter."""
        config = _named_form(config)
        fields: dict[str, Any] = {"modules_to_save": config["modules_to_save"]}
        for name, entry in config["adapters"].items():
            prefix = "" if name == DEFAULT else f"{name}."
            flat = {**entry["config"], **{k: v for k, v in entry.items() if k != "config"}}
            fields.update({f"{prefix}{k}": v for k, v in flat.items() if k not in cls.training_only})
        return fields

    def wrapped(self, model: nn.Module) -> dict[str, nn.Module]:
        model = unwrap(model)
        return {name: model.get_submodule(name) for name in self.targets}

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> IA3Adapter:
        """Inject at the recorded names (the same modules whatever the rules would pick today)."""
        model = unwrap(model)
        _refuse_second_injection(model)
        config = _named_form(config)
        recorded = [t for entry in config["adapters"].values() for t in entry["targets"]]
        refuse_absent(model, [*recorded, *config["modules_to_save"]], "IA3: the recorded adapter")
        for name, entry in config["adapters"].items():
            _inject(model, IA3Config(**entry["config"]), name, list(entry["targets"]), list(entry["feedforward"]),
                    list(config["modules_to_save"]))
        adapter = attached(model)[cls.kind]
        adapter.switch.active = config.get("active", adapter.names[0])
        return adapter

    def remove(self, model: nn.Module, name: str) -> None:
        """Delete named adapter ``name`` (`delete_ia3_adapter`, which documents it)."""
        who = f"delete_ia3_adapter({name!r})"
        self.known(name, "delete_ia3_adapter")
        if len(self.adapters) == 1:
            raise RuntimeError(f"{who}: it is the model's only IA³ adapter; use unload_ia3(model) to remove IA³.")
        if self.switch.active == name:
            other = next(n for n in self.adapters if n != name)
            raise RuntimeError(f"{who}: it is the active adapter; set_ia3_adapter(model, {other!r}) (or another) "
                               "first.")
        _refuse_merged(model, who)
        model = unwrap(model)
        for target in self.adapters.pop(name).targets:
            layer = model.get_submodule(target)
            del layer.ia3_l[name]
            if not len(layer.ia3_l):
                set_submodule(model, target, layer.base_layer)
        attach(model, self)

    def merged_state(self, model: nn.Module, state: dict[str, Tensor], name: str | None = None) -> dict[str, Tensor]:
        """Fold adapter ``name`` (default: the merged one, else the active one) into ``state``."""
        model = unwrap(model)
        merged = {layer.merged_adapter for layer in ia3_layers(model).values()} - {None}
        chosen = self._name(name, "merged_state_dict")
        if merged and merged != {chosen}:
            raise RuntimeError(f"merged_state_dict: adapter {min(merged)!r} is merged into the base weights, not "
                               f"{chosen!r}; call unmerge_ia3(model) first.")
        folded = _folded(model, self.targets, "merged_state_dict", chosen)
        for target in self.targets:
            for key in [k for k in state if k.startswith(f"{target}.ia3_l.")]:
                state.pop(key)
            prefix = f"{target}.base_layer."
            for key in [k for k in state if k.startswith(prefix)]:
                state[f"{target}.{key[len(prefix):]}"] = state.pop(key)
            state.update({f"{target}.{key}": value for key, value in folded[target].items()})
        return fold_modules_to_save(model, state)

    def merge_problems(self, model: nn.Module, name: str | None = None) -> list[str]:
        if name is not None:
            self.known(name, "merged_state_dict")
        return []

    def unload(self, model: nn.Module, merge: bool) -> None:
        model = unwrap(model)
        layers = {name: model.get_submodule(name) for name in self.targets}
        if merge:
            quantized = [n for n, layer in layers.items() if is_quantized(layer.base_layer.weight)]
            if quantized:
                raise RuntimeError(f"unload_ia3(merge=True): the base weight of {quantized[0]!r} is quantized; "
                                   "merging would have to requantize it. Export merged_state_dict(model) instead.")
            folded = _folded(model, [n for n, layer in layers.items() if not layer.merged], "unload_ia3")
            for name, tensors in folded.items():
                layers[name]._write(tensors)  # no zero check: nothing divides it back
        for name, layer in layers.items():
            if not merge:
                layer.unmerge()
            set_submodule(model, name, layer.base_layer)
        restore_modules(model, self.modules_to_save, trained=merge)
        detach(model, self.kind)

    def peft_state(self, model: nn.Module, adapter_name: str | None = None) -> dict[str, Tensor]:
        """Adapter ``adapter_name``'s (default: the active one) tensors under PEFT's file keys; ``modules_to_save`` is
        shared, so each adapter's file has it."""
        name = self._name(adapter_name, "save_adapter")
        model = unwrap(model)
        state = {f"{t}.ia3_l": model.get_submodule(t).ia3_l[name] for t in self.adapters[name].targets}
        return {clean_key(plain_key(k)): v for k, v in {**state, **saved_state(model, self.modules_to_save)}.items()}

    def value_problems(self, model: nn.Module, state: dict[str, Tensor],
                       adapter_name: str | None = None) -> list[str]:
        return []

    def peft_config(self, model: nn.Module, adapter_name: str | None = None) -> dict[str, Any]:
        entry = self.adapters[self._name(adapter_name, "save_adapter")]
        names = [n for n, _ in unwrap(model).named_modules() if n]
        targets = [clean_key(n) for n in entry.targets]
        return {
            "peft_type": PEFT_TYPE,
            "task_type": adapter_task_type(model, targets, self.modules_to_save),
            "base_model_name_or_path": base_model_name(model),
            "inference_mode": True,
            "target_modules": exact_choice(targets, [clean_key(n) for n in names]),
            # PEFT matches a feedforward list by plain suffix, among the targets only
            "feedforward_modules": exact_choice([clean_key(n) for n in entry.feedforward], targets,
                                                lambda name, entries: any(name.endswith(e) for e in entries)),
            "exclude_modules": None,
            "fan_in_fan_out": any(model.get_submodule(n).fan_in_fan_out for n in entry.targets),
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
            "init_ia3_weights": entry.config.init_ia3_weights,
        }

    def check_peft_config(self, model: nn.Module, config: Any, source: str, adapter_name: str = DEFAULT) -> None:
        """The file's feed-forward choice must be this adapter's (a vector of the other kind may have the same shape
        when a layer is square, and would load silently into the wrong side)."""
        if any(layer.merged for layer in ia3_layers(model).values()):
            raise RuntimeError("load_adapter: the IA³ vectors are merged; call unmerge_ia3(model) before loading.")
        entry = self.adapters[adapter_name]
        theirs = [n for n in entry.targets if IA3Config.from_peft(config, source).is_feedforward(clean_key(n))]
        if theirs != list(entry.feedforward):
            raise ValueError(f"load_adapter: {source} scales the input of {theirs}, but the model's IA³ adapter "
                             f"{adapter_name!r} scales the input of {list(entry.feedforward)}. Load it into a model "
                             "without IA³, or under another adapter_name.")

    @classmethod
    def check_peft_shapes(cls, model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                          files: Any, inject: bool, adapter_name: str = DEFAULT) -> None:
        """Nothing to check: an IA³ vector's size is its layer's, which `load_adapter` compares with the file's."""

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str,
                  adapter_name: str = DEFAULT) -> IA3Adapter:
        ours = IA3Config.from_peft(config, source)
        # PEFT's task types write ["classifier", "score"] whatever the model calls its head: the absent are dropped
        ours = dataclasses.replace(ours, modules_to_save=present_modules(unwrap(model), ours.modules_to_save, source))
        try:
            if attached(model).get(cls.kind) is None:
                inject_ia3(model, ours, adapter_name)
            else:
                add_ia3_adapter(model, adapter_name, ours)
        except ValueError as err:
            raise ValueError(f"load_adapter: {source}: {err}") from None
        return attached(model)[cls.kind]


def _named_form(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded `IA3Adapter.config_dict`; one of lightning-peft before named IA³ adapters (a single ``config``,
    ``targets``, ``feedforward``) as its ``default`` adapter."""
    if "adapters" in config:
        return config
    entry = {k: config[k] for k in ("config", "targets", "feedforward") if k in config}
    return {"adapters": {DEFAULT: entry}, "modules_to_save": config.get("modules_to_save", []), "active": DEFAULT}
