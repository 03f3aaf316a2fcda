"""LoRA on a whole model: inject, add named adapters, merge, unload, and LoRA's side of the adapter protocol.

Paper: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685 (the layer math and shapes are
in `lightning_peft.peft.lora.layer`). The settings are in `config`; which modules a config adapts (Hugging Face PEFT's
rules) in `targets`; merging in place in `merge`; PEFT's file format in `peft_format`; switching, routing and
combining named adapters in `multi`. Adding a named adapter ([`add_adapter`][lightning_peft.peft.add_adapter]) is
the same operation as injecting the first one, so both live here.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_peft.peft import inject_lora, trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> sorted(inject_lora(model, rank=2, target_modules=["0"]))
    ['0']
    >>> trainable_parameters(model).trainable
    32
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any, ClassVar

from torch import Tensor, nn

from .. import trainable_tokens as tokens
from .._common import refuse_absent, refuse_second_injection
from .._limits import refuse_overflowing_scales
from ..adapter import (
    attach,
    attached,
    detach,
    register,
    remove_adapter,
    trainable_parameters,
    unwrap,
)
from ..modules_to_save import fold_modules_to_save, set_submodule, wrap_modules_to_save
from ..quantize import drop_quantizer_entries, plain_state, quantize_layers
from . import init as starts
from .config import LoRAConfig, as_config, check_adapter_name
from .layer import DEFAULT, LoRALayer, Routing, linear_types, lora_layers, lora_spec, make_layer, require_spec
from .merge import merge_lora, merge_problems, unmerge_lora
from .param import plan_parameters, wrap_parameters
from .peft_format import LoRAPeftFormat, config_for_model
from .targets import select_parameters, select_targets, warn_about_settings

log = logging.getLogger("lightning_peft.peft.lora")  # the package, as targets.py logs
# LoRAConfig fields newer than some checkpoints: their old value
_ADDED_FIELDS = {"use_dora": False, "quantize": None, "lora_bias": False, "layers_to_transform": None,
                 "layers_pattern": None, "target_parameters": None, "trainable_token_indices": None}


@register
class LoRAAdapter(LoRAPeftFormat):
    """LoRA's side of the adapter protocol: the named LoRA adapters on a model.

    Args:
        adapters: ``{adapter name: (config, full names of the modules it adapts)}``, in the order they were added.
        modules_to_save: Full names of the modules trained and saved in full; shared by every named adapter.
        routing: The [`Routing`][lightning_peft.peft.Routing] object every LoRA layer of the model holds.
    """

    kind: ClassVar[str] = "lora"
    mergeable: ClassVar[bool] = True
    training_only: ClassVar[tuple[str, ...]] = ("dropout", "init")
    named: ClassVar[bool] = True

    def __init__(
        self,
        adapters: dict[str, tuple[LoRAConfig, Iterable[str]]],
        modules_to_save: Iterable[str],
        routing: Routing,
    ) -> None:
        self.adapters = {name: (config, tuple(targets)) for name, (config, targets) in adapters.items()}
        self.modules_to_save = tuple(modules_to_save)
        self.routing = routing

    def __repr__(self) -> str:
        names = ", ".join(f"{n}: rank {c.rank}, {len(t)} targets" for n, (c, t) in self.adapters.items())
        return f"LoRAAdapter({names}; active={self.routing.active!r}, modules_to_save={list(self.modules_to_save)})"

    @property
    def names(self) -> tuple[str, ...]:
        """The adapter names, in the order they were added."""
        return tuple(self.adapters)

    @property
    def config(self) -> LoRAConfig:
        """The first adapter's config (the one [`inject_lora`][lightning_peft.peft.inject_lora] used)."""
        return next(iter(self.adapters.values()))[0]

    @property
    def targets(self) -> tuple[str, ...]:
        """Every adapted module (the union over the named adapters), in order of first adaptation."""
        return tuple(dict.fromkeys(t for _, targets in self.adapters.values() for t in targets))

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state: dict[str, Tensor] = {}
        bias = self.config.bias
        for name in self.targets:
            layer = model.get_submodule(name)
            state.update({f"{name}.{k}": p for k, p in layer.adapter_parameters().items()})
            if bias == "lora_only" and getattr(layer.base_layer, "bias", None) is not None:
                state[f"{name}.base_layer.bias"] = layer.base_layer.bias
        if bias == "all":
            for name, module in model.named_modules():
                if module._parameters.get("bias") is not None and ".original_module" not in f".{name}":
                    state[f"{name}.bias" if name else "bias"] = module._parameters["bias"]
        for name in self.modules_to_save:
            trained = model.get_submodule(name).trained_module
            state.update(trained.state_dict(prefix=f"{name}.trained_module.", keep_vars=True))
        state.update(tokens.token_parameters(model))
        return state

    def config_dict(self) -> dict[str, Any]:
        return {
            "adapters": {n: {"config": c.to_dict(), "targets": list(t)} for n, (c, t) in self.adapters.items()},
            "modules_to_save": list(self.modules_to_save),
            "active": self.routing.active,
        }

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> LoRAAdapter:
        # The exact names recorded, not the rules: the same modules whatever the rules would pick today.
        model = unwrap(model)
        _refuse_second_injection(model)
        if "adapters" not in config:  # the single-adapter format of lightning-peft 0.1 checkpoints
            config = {"adapters": {DEFAULT: {"config": config["config"], "targets": config["targets"]}},
                      "modules_to_save": config["modules_to_save"], "active": DEFAULT}
        recorded = [t for entry in config["adapters"].values() for t in entry["targets"]]
        # A nested parameter wrapper's path (``<module>.base_layer``) exists once its config's rules wrap it again.
        refuse_absent(model, [n for n in [*recorded, *config["modules_to_save"]] if ".base_layer" not in n],
                      "LoRA: the recorded adapter")
        for i, (name, entry) in enumerate(config["adapters"].items()):
            to_save = list(config["modules_to_save"]) if i == 0 else []
            _inject(model, LoRAConfig(**entry["config"]), list(entry["targets"]), to_save, name)
        spec = attached(model)["lora"]
        spec.routing.active = config.get("active", spec.names[0])
        return spec

    def merged_state(self, model: nn.Module, state: dict[str, Tensor], name: str | None = None) -> dict[str, Tensor]:
        """Fold adapter ``name`` (default: the merged one, else the active one) into ``state``; layers without it
        keep their base weight."""
        model = unwrap(model)
        wanted = None if name is None else self._name(name)
        for name in self.targets:
            layer = model.get_submodule(name)
            for key in layer.adapter_parameters():
                state.pop(f"{name}.{key}")
            prefix = f"{name}.base_layer."
            for key in [k for k in state if k.startswith(prefix)]:
                state[f"{name}.{key[len(prefix):]}"] = state.pop(key)
            chosen = layer.merged_adapter or wanted or self.routing.active
            if chosen not in layer.specs:
                continue
            try:
                merged = {_plain(key): value for key, value in layer.merged_weights(chosen).items()}
            except RuntimeError as err:
                raise RuntimeError(f"merged_state_dict: layer {name!r}: {err}") from None
            if "weight" in merged:  # (an attention module's weights are never quantized)
                drop_quantizer_entries(state, name, layer.base_layer)
            state.update({f"{name}.{key}": weight for key, weight in merged.items()})
        state = tokens.merged_token_state(model, state, lambda owner: wanted or self.routing.active)
        return plain_state(fold_modules_to_save(model, state))

    def merge_problems(self, model: nn.Module, name: str | None = None) -> list[str]:
        """Why `merged_state` would refuse adapter ``name`` (default: the merged one, else the active one)."""
        chosen = (self.routing.merged_adapter or self.routing.active) if name is None else self._name(name)
        return merge_problems(unwrap(model), chosen)

    def unload(self, model: nn.Module, merge: bool) -> None:
        model = unwrap(model)
        if merge:
            merge_lora(model, dequantize=True)
        elif any(layer.merged for layer in lora_layers(model).values()):
            unmerge_lora(model)
        for name in self.targets:
            set_submodule(model, name, model.get_submodule(name).base_layer)
        tokens.unload_tokens(model)
        for name in self.modules_to_save:
            wrapper = model.get_submodule(name)
            set_submodule(model, name, wrapper.trained_module if merge else wrapper.original_module)
        detach(model, self.kind)

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether the named adapters' settings are those of ``config`` (``{"adapters": {name: {"config": fields}}}``,
        targets and the active adapter not compared); ``"first_only": True``: the first adapter's, whatever its name."""
        def settings(position: int, fields: dict) -> dict:  # adapters added later record the model's modules_to_save
            return fields if position == 0 else {k: v for k, v in fields.items() if k != "modules_to_save"}

        asked = {n: settings(i, e["config"]) for i, (n, e) in enumerate(config["adapters"].items())}
        have = {n: settings(i, c.to_dict()) for i, (n, (c, _)) in enumerate(self.adapters.items())}
        if config.get("first_only"):
            return list(asked.values())[:1] == list(have.values())[:1]
        return asked == have

    def wrapped(self, model: nn.Module) -> dict[str, nn.Module]:
        model = unwrap(model)
        return {name: model.get_submodule(name) for name in self.targets}

    @classmethod
    def resume_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Flat fields of every named adapter (``<name>.<field>``, ``default``'s bare), less the training-only ones
        and the active adapter; ``init`` as `lightning_peft.peft.lora.init.Start` compares it."""
        if "adapters" not in config:  # the single-adapter format of lightning-peft 0.1 checkpoints
            config = {"adapters": {DEFAULT: config}, "modules_to_save": config.get("modules_to_save", [])}
        fields: dict[str, Any] = {"modules_to_save": config.get("modules_to_save")}
        for name, entry in config["adapters"].items():
            prefix = "" if name == DEFAULT else f"{name}."
            flat = {**_ADDED_FIELDS, **entry.get("config", {}), **{k: v for k, v in entry.items() if k != "config"}}
            fields.update({f"{prefix}{k}": v for k, v in flat.items() if k not in cls.training_only})
            fields[f"{prefix}init"] = starts.Start(flat.get("init", "kaiming"))  # kaiming <-> gaussian only
        return fields

    def remove(self, model: nn.Module, name: str) -> None:
        """Delete named adapter ``name`` ([`delete_adapter`][lightning_peft.peft.delete_adapter], which documents
        it)."""
        if name not in self.adapters:
            raise ValueError(f"delete_adapter: no adapter named {name!r}; the model has {list(self.adapters)}.")
        if len(self.adapters) == 1:
            raise RuntimeError(f"delete_adapter({name!r}): it is the model's only LoRA adapter; use unload_lora(model) "
                               "to remove LoRA.")
        if self.routing.active == name:
            others = [n for n in self.adapters if n != name]
            raise RuntimeError(f"delete_adapter({name!r}): it is the active adapter; set_adapter(model, {others[0]!r}) "
                               "(or another) first.")
        if self.routing.merged_adapter == name:
            raise RuntimeError(f"delete_adapter({name!r}): it is merged; call unmerge_lora(model) first.")
        model = unwrap(model)
        for target in self.adapters[name][1]:
            layer = model.get_submodule(target)
            layer.delete_adapter(name)
            if not layer.specs:
                set_submodule(model, target, layer.base_layer)
        tokens.delete_tokens(model, name)
        del self.adapters[name]
        attach(model, self)

    @classmethod
    def from_peft(
        cls, model: nn.Module, config: dict[str, Any], source: str, adapter_name: str = DEFAULT
    ) -> LoRAAdapter:
        ours = config_for_model(model, config, source)
        try:
            if lora_spec(model) is None:
                inject_lora(model, ours, adapter_name=adapter_name)
            else:
                add_adapter(model, adapter_name, ours)
        except ValueError as err:  # the settings do not fit this model (e.g. a scale its dtype cannot hold)
            raise ValueError(f"load_adapter: {source}: {err}") from None
        return attached(model)["lora"]


def _plain(key: str) -> str:
    """A layer's state-dict key as a merged export names it: without the wrappers' ``base_layer.`` levels."""
    while key.startswith("base_layer."):
        key = key[len("base_layer."):]
    return key


def inject_lora(
    model: nn.Module, config: LoRAConfig | Any | None = None, adapter_name: str = DEFAULT, **kwargs
) -> dict[str, LoRALayer]:
    """Wrap the target modules of ``model`` in LoRA layers, in place, and freeze everything else.

    After the call only the parameters of the adapters attached to ``model`` (this one and any other technique's) have
    ``requires_grad=True``: the LoRA weights, the chosen biases and the trainable copies of ``modules_to_save``. Nothing
    is changed if an error is raised. More named adapters are added with
    [`add_adapter`][lightning_peft.peft.add_adapter].

    Args:
        model: The model to adapt (any ``nn.Module``; for a Hugging Face model pass the ``PreTrainedModel``;
            a ``torch.compile`` wrapper is looked through).
        config: A [`LoRAConfig`][lightning_peft.peft.LoRAConfig] or a Hugging Face PEFT ``LoraConfig``; or give the
            fields as keyword arguments instead.
        adapter_name: The adapter's name; it becomes the active adapter.

    Returns:
        The new LoRA layers by full module name.

    Raises:
        RuntimeError: If ``model`` already has LoRA layers.
        ValueError: If the targets match nothing or a setting is invalid.
        TypeError: If a target is of a type LoRA cannot adapt, or an argument has the wrong type.
    """
    config = as_config(config, kwargs, "inject_lora")
    check_adapter_name(adapter_name, "inject_lora")
    model = unwrap(model)
    _refuse_second_injection(model)
    targets, to_save = select_targets(model, config)
    warn_about_settings(model, config, targets)
    return _inject(model, config, targets, to_save, adapter_name)


def _refuse_second_injection(model: nn.Module) -> None:
    existing = lora_layers(model)
    found = f"{len(existing)} LoRA layers (e.g. {next(iter(existing))!r})" if existing else None
    refuse_second_injection("inject_lora", model, found, "LoRA was", "add another named adapter with add_adapter(model, name, "
                            "config)")


def _inject(
    model: nn.Module, config: LoRAConfig, targets: list[str], to_save: list[str], adapter_name: str
) -> dict[str, LoRALayer]:
    """Add adapter ``adapter_name`` to exactly ``targets`` and wrap ``to_save`` (full names, already checked); the
    parameters ``config.target_parameters`` names are found by its rules (`lora.param`)."""
    planned = plan_parameters(model, select_parameters(model, config))  # raises before any change
    targets = [t for t in targets if t not in planned]  # a checkpoint's record names the parameter layers too
    refuse_overflowing_scales(model, config, targets)  # before any change
    rows = {} if config.trainable_token_indices is None else \
        tokens.select_tokens(model, config.trainable_token_indices, [*targets, *to_save])
    starts.refuse(model, config, targets, linear_types(), "LoRA")
    rewrites = starts.rewrites_base(config.init)  # then the base is quantized after the start: its residual
    quantize_layers(model, targets, None if rewrites else config.quantize, "LoRA",
                    isinstance(config.target_modules, list))  # first
    spec = lora_spec(model)
    routing = spec.routing if spec is not None else Routing(adapter_name)
    for wrapper in wrap_modules_to_save(model, to_save).values():
        wrapper.routing = routing  # disabled adapters and base samples use the original module
    tokens.wrap_tokens(model, rows, adapter_name, routing)
    replaced = {}
    for name in targets:
        module, settings = model.get_submodule(name), config.layer_settings(name)
        if isinstance(module, LoRALayer):  # another named adapter's layer takes this one too
            module.add_adapter(adapter_name, **settings)
            replaced[name] = module
            continue
        layer = make_layer(module, adapter_name, **settings).train(module.training)  # eval model: eval adapters
        layer.routing = routing
        set_submodule(model, name, layer)
        replaced[name] = layer
    if rewrites and config.quantize is not None:
        if starts.loftq_iterations(config.init):
            for layer in replaced.values():
                starts.initialise(layer, adapter_name, config.init, starts.round_trip_for(config.quantize))
        quantize_layers(model, targets, config.quantize, "LoRA", isinstance(config.target_modules, list))
    replaced.update(wrap_parameters(model, planned, config, adapter_name, routing))
    if spec is None:
        spec = LoRAAdapter({}, to_save, routing)
    spec.adapters[adapter_name] = (config, (*targets, *planned))
    attach(model, spec)
    log.info("LoRA: adapter %r on %d modules of %s; %s", adapter_name, len(replaced), type(model).__name__,
             trainable_parameters(model))
    return replaced


def add_adapter(model: nn.Module, name: str, config: LoRAConfig | Any | None = None, **kwargs) -> dict[str, LoRALayer]:
    """Add LoRA adapter ``name`` to a model that already has LoRA ([`inject_lora`][lightning_peft.peft.inject_lora]);
    the active adapter stays.

    The new adapter has its own targets, rank, alpha and dropout; it starts at zero (the base output). Modules it
    shares with other adapters get a second pair of factors in the same LoRA layer.

    Returns:
        The LoRA layers that received the adapter, by full module name.

    Raises:
        RuntimeError: If ``model`` has no LoRA yet.
        ValueError: If ``name`` is taken or unusable, the targets match nothing, ``modules_to_save`` differs from
            the model's, or ``bias`` is not ``"none"``.
    """
    spec = require_spec(model, "add_adapter")
    config = as_config(config, kwargs, "add_adapter")
    check_adapter_name(name, "add_adapter")
    if name in spec.adapters:
        raise ValueError(f"add_adapter: the model already has an adapter named {name!r}; pick another name "
                         "or delete_adapter(model, name) first.")
    if config.bias != "none" or spec.config.bias != "none":
        raise ValueError(
            f"add_adapter({name!r}): bias={config.bias!r} (first adapter: {spec.config.bias!r}); trained biases would "
            "be shared by every adapter, so several adapters need bias='none' on all of them."
        )
    model = unwrap(model)
    if spec.routing.merged_adapter is not None:
        raise RuntimeError(f"add_adapter: adapter {spec.routing.merged_adapter!r} is merged; call unmerge_lora(model) "
                           "first.")
    targets, to_save = select_targets(model, config)
    if config.modules_to_save is not None and set(to_save) - set(spec.modules_to_save):
        raise ValueError(
            f"add_adapter({name!r}): modules_to_save={config.modules_to_save!r}, but the model trains "
            f"{list(spec.modules_to_save)} in full; modules_to_save is shared by every adapter of a model, so declare "
            "it once, with the first adapter (inject_lora)."
        )
    warn_about_settings(model, config, targets)
    return _inject(model, dataclasses.replace(config, modules_to_save=list(spec.modules_to_save)), targets, [], name)


def unload_lora(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove LoRA from ``model`` in place and return the plain model (Hugging Face PEFT's ``merge_and_unload``).

    Every LoRA layer is replaced by its base module, and every ``modules_to_save`` wrapper by its trained copy
    (``merge=True``: the fine-tuned model with the active adapter merged, which ``save_pretrained`` /
    ``from_pretrained`` round-trip) or by the untouched original (``merge=False``: the base model as it was before
    [`inject_lora`][lightning_peft.peft.inject_lora], except biases trained with ``bias="lora_only"`` / ``"all"``, which
    train in place and keep their trained values). Every named adapter goes.

    Raises:
        RuntimeError: If ``model`` has no LoRA adapter, or a merge is refused (tied or non-finite weights).
    """
    return remove_adapter(model, require_spec(model, "unload_lora"), merge)
