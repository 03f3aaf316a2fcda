"""IA³ on a whole model: inject, merge, disable, unload, and IA³'s side of the adapter protocol (with Hugging Face PEFT's
file format).

Paper: Liu et al., "Few-Shot Parameter-Efficient Fine-Tuning is Better and Cheaper than In-Context Learning",
arXiv:2205.05638 ((IA)³: Infused Adapter by Inhibiting and Amplifying Inner Activations). A learned vector rescales
the activations of chosen layers; it is the only thing that trains (besides ``modules_to_save``):

```text
h = l ⊙ (W x + b)        a target's output (the paper's keys and values: l_k, l_v)
h = W (l ⊙ x) + b        a feed-forward target's input (the paper's l_ff, on the second feed-forward layer)
```

``l`` starts at ones, so the adapted model starts equal to the base. Merged, ``l`` scales ``W``'s rows and ``b`` (output)
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

from torch import Tensor, nn

from .._base_identity import base_model_name
from .._common import (
    chosen_by_name,
    exact_choice,
    inside,
    name_matches,
    refuse_absent,
    refuse_no_target,
    refuse_second_injection,
    refuse_unmatched,
    require,
    wraps_a_layer,
)
from .._in_place import (
    Switch,
    describe_leaves,
    fold_layers,
    merge_layers,
    switched_off,
    unload_layers,
    unmerge_layers,
)
from ..adapter import (
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
    plain_key,
    present_modules,
    saved_state,
    select_modules_to_save,
    set_submodule,
    wrap_modules_to_save,
)
from .config import PEFT_FIELDS, PEFT_TYPE, WHO, IA3Config, as_config
from .layer import IA3Layer, supported

log = logging.getLogger("lightning_peft.peft.ia3")
_KINDS = "nn.Linear, transformers Conv1D, nn.Conv2d, nn.Conv3d"


def ia3_layers(model: nn.Module) -> dict[str, IA3Layer]:
    """All IA³ layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, IA3Layer)}


def inject_ia3(model: nn.Module, config: IA3Config | None = None, **kwargs: Any) -> dict[str, IA3Layer]:
    """Wrap the ``target_modules`` of ``model`` in `IA3Layer`s (`lightning_peft.peft.ia3.layer`), in place, and
    freeze everything but the vectors (and ``modules_to_save``).

    Args:
        model: Any ``nn.Module`` (a Hugging Face model, the ``PreTrainedModel`` itself).
        config: An [`IA3Config`][lightning_peft.peft.IA3Config]; or its fields as keyword arguments.

    Returns:
        The new layers by module name.

    Raises:
        RuntimeError: If ``model`` already has IA³.
        ValueError: If a name matches nothing, a target is wrapped by another technique, or a setting is invalid.
        TypeError: If a target is a layer IA³ cannot scale, or an argument has the wrong type.
    """
    config = as_config(config, kwargs, "inject_ia3")
    model = unwrap(model)
    _refuse_second_injection(model)
    targets, to_save = select(model, config)
    return _inject(model, config, targets, [n for n in targets if config.is_feedforward(n)], to_save)


def describe_modules(model: nn.Module) -> str:
    """'k, v (x2 each), ...': leaf names of the modules IA³ can scale, for messages."""
    return describe_leaves(model, supported, _KINDS, "IA³ scales")


def select(model: nn.Module, config: IA3Config) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names, as PEFT picks them; raises before anything is changed."""
    names = [n for n, _ in model.named_modules() if n]
    to_save = select_modules_to_save(model, config.modules_to_save, WHO)
    chosen = chosen_by_name(WHO, config.target_modules, names, model, describe_modules)
    if config.exclude_modules is not None:
        refuse_unmatched(WHO, config.exclude_modules, names, model, describe_modules, "exclude_modules")
        chosen = [n for n in chosen if not name_matches(n, config.exclude_modules)]
    chosen = [n for n in chosen if not inside(n, to_save)]
    if not chosen:
        refuse_no_target(WHO, config.target_modules, model, "scale", describe_modules(model),
                         "encoder.block.0.layer.0.SelfAttention.k")
    for name in chosen:
        module = model.get_submodule(name)
        if isinstance(module, ModulesToSave) or wraps_a_layer(module):
            raise ValueError(f"{WHO}: {name!r} is already wrapped by another technique ({type(module).__name__}); an "
                             "IA³ layer around it would move that technique's parameters. Keep IA³ off this module.")
        if not supported(module):
            raise TypeError(f"{WHO}(target_modules={config.target_modules!r}): {name!r} is a {type(module).__name__}; "
                            f"IA³ scales {_KINDS} (Hugging Face PEFT's IA³ layers). {type(model).__name__} has: "
                            f"{describe_modules(model)}.")
    return chosen, to_save


def _refuse_second_injection(model: nn.Module) -> None:
    existing = ia3_layers(model)
    found = f"IA³ layers (e.g. {next(iter(existing))!r})" if existing else None
    refuse_second_injection("inject_ia3", model, found, "IA³")


def _inject(model: nn.Module, config: IA3Config, targets: list[str], feedforward: list[str],
            to_save: list[str]) -> dict[str, IA3Layer]:
    """Wrap exactly ``targets`` (checked) and ``to_save``, and attach the adapter."""
    adapter = IA3Adapter(config, targets, feedforward, to_save)
    for wrapper in wrap_modules_to_save(model, to_save).values():
        wrapper.routing = adapter.switch  # disabled, they run the original module
    layers = {}
    for name in targets:
        layers[name] = IA3Layer(model.get_submodule(name), name in feedforward, config.init_ia3_weights, adapter.switch)
        set_submodule(model, name, layers[name])
    attach(model, adapter)
    log.info("IA³: %d layers of %s (%d scaled at the input); %s", len(layers), type(model).__name__,
             len(feedforward), trainable_parameters(model))
    return layers


def unload_ia3(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove IA³ from ``model`` in place and return the plain model: with ``merge``, the vectors folded into the base
    weights and the trained ``modules_to_save`` copies kept; without, the base as it was. Other techniques stay.

    Raises:
        RuntimeError: If ``model`` has no IA³, or (``merge``) a merged weight would be quantized or not finite.
    """
    return remove_adapter(model, require(model, IA3Adapter.kind, "unload_ia3", "IA³ adapter", "inject_ia3"), merge)


def merge_ia3(model: nn.Module) -> list[str]:
    """Fold every vector into its base weight in place (`unmerge_ia3` divides
    it out again); layers already merged are left alone. All or nothing.

    Returns:
        The names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no IA³, a weight is tied to another module or quantized, a vector has a zero,
            or a merged weight is not finite (the layers merged by this call are unmerged again).
    """
    require(model, IA3Adapter.kind, "merge_ia3", "IA³ adapter", "inject_ia3")
    return merge_layers(unwrap(model), ia3_layers(model), "merge_ia3")


def unmerge_ia3(model: nn.Module) -> list[str]:
    """Divide the merged vectors out of the base weights, in place (exact up to one rounding in the weight's dtype).

    Raises:
        RuntimeError: If no IA³ layer is merged.
    """
    require(model, IA3Adapter.kind, "unmerge_ia3", "IA³ adapter", "inject_ia3")
    return unmerge_layers(unwrap(model), ia3_layers(model), "unmerge_ia3", "IA³", "merge_ia3")


@contextlib.contextmanager
def disable_ia3(model: nn.Module) -> Iterator[None]:
    """Context manager: inside it every IA³ layer computes its base layer's output, and every ``modules_to_save``
    wrapper its original module's.

    Raises:
        RuntimeError: If ``model`` has no IA³, or a layer is merged (the base output is then not available).
    """
    switch = require(model, IA3Adapter.kind, "disable_ia3", "IA³ adapter", "inject_ia3").switch
    with switched_off(switch, ia3_layers(model), "disable_ia3", "vectors", "unmerge_ia3"):
        yield


# --- the adapter protocol ------------------------------------------------------------------------------------


@register
class IA3Adapter(Adapter):
    """IA³'s side of the adapter protocol: what [`inject_ia3`][lightning_peft.peft.inject_ia3] did to a model.

    Args:
        config: The config used.
        targets: Full names of the scaled modules.
        feedforward: The targets scaled at their input.
        modules_to_save: Full names of the modules trained and saved in full.
    """

    kind: ClassVar[str] = "ia3"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = PEFT_FIELDS
    mergeable: ClassVar[bool] = True
    training_only: ClassVar[tuple[str, ...]] = ("init_ia3_weights",)

    def __init__(self, config: IA3Config, targets: Iterable[str], feedforward: Iterable[str],
                 modules_to_save: Iterable[str]) -> None:
        self.config = config
        self.targets = tuple(targets)
        self.feedforward = tuple(feedforward)
        self.modules_to_save = tuple(modules_to_save)
        self.switch = Switch()  # shared by its layers and modules_to_save wrappers

    def __repr__(self) -> str:
        return (f"IA3Adapter({len(self.targets)} targets, {len(self.feedforward)} feed-forward, "
                f"modules_to_save={list(self.modules_to_save)})")

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state = {f"{name}.ia3_l": model.get_submodule(name).ia3_l for name in self.targets}
        return {**state, **saved_state(model, self.modules_to_save)}

    def config_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "targets": list(self.targets), "feedforward": list(self.feedforward),
                "modules_to_save": list(self.modules_to_save)}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether this is the adapter ``config`` describes (a `config_dict`, or a callback's request
        ``{"config": IA3Config.to_dict()}``, whose names are not resolved yet)."""
        if IA3Config(**config["config"]) != self.config:
            return False
        return all(list(config[key]) == list(getattr(self, key)) for key in ("targets", "feedforward",
                                                                             "modules_to_save") if key in config)

    def wrapped(self, model: nn.Module) -> dict[str, nn.Module]:
        model = unwrap(model)
        return {name: model.get_submodule(name) for name in self.targets}

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> IA3Adapter:
        """Inject at the recorded names (the same modules whatever the rules would pick today)."""
        model = unwrap(model)
        _refuse_second_injection(model)
        targets, to_save = list(config["targets"]), list(config["modules_to_save"])
        refuse_absent(model, [*targets, *to_save], "IA3: the recorded adapter")
        _inject(model, IA3Config(**config["config"]), targets, list(config["feedforward"]), to_save)
        return attached(model)[cls.kind]

    def merged_state(self, model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        model = unwrap(model)
        return fold_layers(model, self.targets, lambda name: [f"{name}.ia3_l"], state)

    def unload(self, model: nn.Module, merge: bool) -> None:
        unload_layers(unwrap(model), self.targets, self.modules_to_save, merge, "unload_ia3")
        detach(model, self.kind)

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        return {clean_key(plain_key(k)): v for k, v in self.state(model).items()}

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        names = [n for n, _ in unwrap(model).named_modules() if n]
        targets = [clean_key(n) for n in self.targets]
        return {
            "peft_type": PEFT_TYPE,
            "task_type": None,
            "base_model_name_or_path": base_model_name(model),
            "inference_mode": True,
            "target_modules": exact_choice(targets, [clean_key(n) for n in names]),
            # PEFT matches a feedforward list by plain suffix, among the targets only
            "feedforward_modules": exact_choice([clean_key(n) for n in self.feedforward], targets,
                                                lambda name, entries: any(name.endswith(e) for e in entries)),
            "exclude_modules": None,
            "fan_in_fan_out": any(layer.fan_in_fan_out for layer in self.wrapped(model).values()),
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
            "init_ia3_weights": self.config.init_ia3_weights,
        }

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        """The file's feed-forward choice must be this adapter's (a vector of the other kind may have the same shape
        when a layer is square, and would load silently into the wrong side)."""
        if any(layer.merged for layer in ia3_layers(model).values()):
            raise RuntimeError("load_adapter: the IA³ vectors are merged; call unmerge_ia3(model) before loading.")
        theirs = [n for n in self.targets if IA3Config.from_peft(config, source).is_feedforward(clean_key(n))]
        if theirs != list(self.feedforward):
            raise ValueError(f"load_adapter: {source} scales the input of {theirs}, but the model's IA³ adapter "
                             f"scales the input of {list(self.feedforward)}. Load it into a model without IA³.")

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> IA3Adapter:
        ours = IA3Config.from_peft(config, source)
        # PEFT's task types write ["classifier", "score"] whatever the model calls its head: the absent are dropped
        ours = dataclasses.replace(ours, modules_to_save=present_modules(unwrap(model), ours.modules_to_save, source))
        try:
            inject_ia3(model, ours)
        except ValueError as err:
            raise ValueError(f"load_adapter: {source}: {err}") from None
        return attached(model)[cls.kind]
