"""The adapter protocol: the one small contract every PEFT technique implements.

Generic machinery (the trainable-parameter report, freezing, adapter-only checkpoints, resume, re-applying an adapter
from a checkpoint, merged exports, PEFT-format save/load) talks to a technique only through
[`Adapter`][lightning_peft.peft.Adapter]; it never matches parameter names. A technique (LoRA today) is:

- an inject function that changes the model and ends with `attach`, which records the technique's
  [`Adapter`][lightning_peft.peft.Adapter] on the model and re-freezes the model for the union of every attached
  technique, so several techniques on one model work in either order;
- an [`Adapter`][lightning_peft.peft.Adapter] subclass registered with `register`, so a checkpoint or an adapter
  directory that names the technique (``kind`` / ``peft_type``) can be re-applied to a fresh model.

What an [`Adapter`][lightning_peft.peft.Adapter] answers:

| member | meaning |
| --- | --- |
| ``kind`` | registry key, stored in checkpoints (``"lora"``) |
| ``peft_type`` | Hugging Face PEFT's ``peft_type`` for the save format, or None if PEFT has no such format |
| ``state(model)`` | the tensors that make up the adapter (parameters and buffers), by the model's own state-dict keys, not detached: what adapter files and adapter-only checkpoints keep. Its parameters are the ones that train; everything else is frozen |
| ``config_dict()`` | a JSON-able config; ``inject(model, config_dict)`` re-applies it to a fresh model |
| ``mergeable`` | whether ``merged_state`` can fold the adapter into plain-model weights |
| ``merge_problems(model)`` | why ``merged_state`` would refuse this adapter on ``model`` (one line per layer; empty: it merges), from the layers' kinds and settings alone: asked before training so that an export cannot fail at its end |
| ``merged_state(model, s)`` | turn a full state dict ``s`` of the adapted model into the plain model's state dict (a technique with named adapters takes ``name``: the one to fold in) |
| ``unload(model, merge)`` | put the plain modules back (merged or not) and forget the adapter |
| ``peft_config(model)`` | the ``adapter_config.json`` content; ``peft_state(model)`` the tensors under PEFT's keys; ``from_peft(model, config, source)`` injects what a PEFT config describes |
| ``value_problems(model, state)`` | why the scale or the tensors ``state`` (PEFT's keys) would overflow the dtype the adapted layers compute in: [`save_adapter`][lightning_peft.peft.save_adapter] and [`load_adapter`][lightning_peft.peft.load_adapter] refuse them |
| ``check_peft_shapes(model, config, shapes, files, inject)`` | before anything is allocated, raise if the shapes of a file's tensors disagree with the sizes its own config fixes (a torn save; a 3 KB file asking for ``r=2**24``), or, when ``inject``, if injecting the config would allocate a tensor the file has none for |
| ``peft_key_prefix`` | what PEFT's files put before those keys (``base_model.model.``; prompt learning: none) |
| ``peft_fields`` | the ``adapter_config.json`` fields PEFT's config class has (None: any); [`load_adapter`][lightning_peft.peft.load_adapter] warns about any other field |
| ``format_version`` | set for a file format of lightning-peft's own (PEFT has none for the technique): [`load_adapter`][lightning_peft.peft.load_adapter] refuses a file of another version, and any field outside ``peft_fields``, before the technique reads it |
| ``training_only`` | config keys that only steer training (dropout, init): a resume may change them |
| ``resume_fields(config)`` | a config_dict as the flat fields that must agree to resume (less ``training_only``) |
| ``matches(config)`` | whether the adapter is what a config describes (a callback asking again goes on) |
| ``wrapped(model)`` | the wrapper modules it put in place of base layers (each has ``base_layer``) |
| ``remove(model, name)`` | delete one named adapter (techniques with several named adapters) |
| ``modules_to_save`` | full names of the modules it trains and saves in full (default: none) |
| ``named`` | whether the technique keeps several named adapters on one model (LoRA, IA³; default False). Such an adapter has ``names`` (them, in the order they were added); its ``merged_state`` takes ``name``, its ``peft_config`` / ``peft_state`` / ``check_peft_config`` / ``check_peft_shapes`` / ``from_peft`` take ``adapter_name``, and each adapter is saved in PEFT's multi-adapter layout. Generic code asks ``named``, never whether ``names`` exists |

Names: a model compiled with ``torch.compile`` keeps its modules under ``_orig_mod``; every name that is
written (adapter keys, targets, merged state dicts) has that segment removed (`clean_key`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

ADAPTERS_ATTRIBUTE = "_lightning_peft_adapters"
DEFAULT = "default"  # the name of a technique's first named adapter, as Hugging Face PEFT names it
_COMPILED = "_orig_mod"

_REGISTRY: dict[str, type[Adapter]] = {}


class Adapter(ABC):
    """One technique's adapter on one model; created by the technique's inject function."""

    kind: ClassVar[str]
    peft_type: ClassVar[str | None] = None
    mergeable: ClassVar[bool] = False
    peft_key_prefix: ClassVar[str] = "base_model.model."
    peft_fields: ClassVar[frozenset[str] | None] = None
    format_version: ClassVar[int | None] = None
    training_only: ClassVar[tuple[str, ...]] = ()  # config_dict() keys that only steer training: a resume may change them
    #: Several named adapters on one model: the instance then has ``names`` and its PEFT-format methods take
    #: ``adapter_name`` (see the module docstring).
    named: ClassVar[bool] = False
    #: Its PEFT-format methods take ``convert_to_lora`` (LoRA: a start that rewrote the base written as a plain LoRA).
    converts_to_lora: ClassVar[bool] = False
    modules_to_save: tuple[str, ...] = ()  # full names of the modules trained and saved in full

    @abstractmethod
    def state(self, model: nn.Module) -> dict[str, Tensor]:
        """Parameters and buffers of the adapter by ``model`` state-dict key (not detached).

        Its parameters are exactly the ones this technique trains.
        """

    @abstractmethod
    def config_dict(self) -> dict[str, Any]:
        """A JSON-able config from which [`inject`][lightning_peft.peft.Adapter.inject] rebuilds the same adapter on a
        fresh model."""

    @classmethod
    @abstractmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> Adapter:
        """Apply the technique described by ``config`` (from [`config_dict`][lightning_peft.peft.Adapter.config_dict])
        to ``model``."""

    def merged_state(self, model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Fold the adapter into ``state`` (a full state dict of ``model``), under the plain model's keys."""
        raise RuntimeError(f"{type(self).__name__}: the {self.kind} adapter cannot be merged into the base weights.")

    def merge_problems(self, model: nn.Module) -> list[str]:
        """Why [`merged_state`][lightning_peft.peft.Adapter.merged_state] would refuse this ``mergeable`` adapter on
        ``model``, one line per layer (empty: it merges), read from the layers' kinds and settings without computing a
        merge. A technique with named adapters takes ``name`` (the one ``merged_state`` would fold in)."""
        return []

    @abstractmethod
    def unload(self, model: nn.Module, merge: bool) -> None:
        """Restore the plain modules (with the update folded in if ``merge``) and forget the adapter."""

    @classmethod
    def resume_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` (a [`config_dict`][lightning_peft.peft.Adapter.config_dict]) as flat fields that must agree for a
        checkpoint to resume: the fields of its ``"config"`` entry and its other entries, without the `training_only`
        keys. Messages name them."""
        fields = {**config.get("config", {}), **{k: v for k, v in config.items() if k != "config"}}
        return {k: v for k, v in fields.items() if k not in cls.training_only}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether this adapter is the one ``config`` (a [`config_dict`][lightning_peft.peft.Adapter.config_dict])
        describes: a callback that asks again for an adapter the model already has goes on only if it matches."""
        return self.config_dict() == config

    def wrapped(self, model: nn.Module) -> dict[str, nn.Module]:
        """The modules this technique put in place of base layers, by ``model`` name; each has ``base_layer``
        (the frozen module it wraps). Strategies shard and plan the base layer through this, never by class."""
        return {}

    def remove(self, model: nn.Module, name: str) -> None:
        """Delete the named adapter ``name`` (techniques with several named adapters on one model)."""
        raise RuntimeError(f"{type(self).__name__}: the {self.kind} adapter has no named adapters to remove.")

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        """The adapter tensors (not detached) under the keys of PEFT's files, without ``base_model.model.``."""
        return {clean_key(k): v for k, v in self.state(model).items()}

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        """Raise if PEFT ``config`` cannot be loaded into this adapter, which already exists on ``model``."""

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        """The ``adapter_config.json`` content in Hugging Face PEFT's vocabulary."""
        raise RuntimeError(f"{type(self).__name__}: the {self.kind} adapter has no Hugging Face PEFT format.")

    def peft_problems(self, model: nn.Module) -> list[str]:
        """Reasons PEFT would run this adapter differently (empty if its format represents it faithfully)."""
        return []

    def value_problems(self, model: nn.Module, state: dict[str, Tensor]) -> list[str]:
        """Why ``state`` (this adapter's tensors under PEFT's keys: the model's own, or a file's about to be loaded)
        would overflow the dtype the adapted layers compute in, one line per module (empty: it would not)."""
        return []

    @classmethod
    def check_peft_shapes(cls, model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                          files: Any, inject: bool) -> None:
        """Raise, before [`from_peft`][lightning_peft.peft.Adapter.from_peft] allocates anything, if a size that
        ``config`` fixes is not the one the file's tensors have (``shapes``, by PEFT key without the prefix), or, when
        ``inject``, if injecting ``config`` into ``model`` would allocate a tensor the file has no counterpart for.
        ``files`` (an ``AdapterFiles``) builds the messages, naming the files. Default: nothing to check."""

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> Adapter:
        """Inject the adapter a PEFT ``adapter_config.json`` describes (weights are loaded by the caller)."""
        raise RuntimeError(f"{cls.__name__}: the {cls.kind} technique cannot load Hugging Face PEFT adapters.")


def register(cls: type[Adapter]) -> type[Adapter]:
    """Class decorator: make a technique known to checkpoints and adapter directories by its ``kind``."""
    _REGISTRY[cls.kind] = cls
    return cls


def technique(kind: str) -> type[Adapter]:
    """The registered [`Adapter`][lightning_peft.peft.Adapter] class of ``kind``."""
    if kind not in _REGISTRY:
        raise ValueError(f"Unknown adapter kind {kind!r}; known: {sorted(_REGISTRY)}.")
    return _REGISTRY[kind]


def technique_for_peft_type(peft_type: object, source: str) -> type[Adapter]:
    """The registered [`Adapter`][lightning_peft.peft.Adapter] class that reads PEFT adapters of ``peft_type``."""
    for cls in _REGISTRY.values():
        if cls.peft_type is not None and cls.peft_type == peft_type:
            return cls
    known = sorted(c.peft_type for c in _REGISTRY.values() if c.peft_type)
    raise ValueError(f"load_adapter: {source} has peft_type={peft_type!r}; lightning-peft reads {known}.")


def unwrap(model: nn.Module) -> nn.Module:
    """The original module behind ``torch.compile`` wrappers (``OptimizedModule``), else ``model``."""
    while isinstance(getattr(model, "_modules", {}).get(_COMPILED), nn.Module):
        model = model._modules[_COMPILED]
    return model


def clean_key(key: str) -> str:
    """``key`` without the ``_orig_mod`` segments that ``torch.compile`` wrappers add to names."""
    return ".".join(part for part in key.split(".") if part != _COMPILED)


def attached(model: nn.Module) -> dict[str, Adapter]:
    """The adapters on ``model`` by kind, in the order they were attached."""
    return getattr(unwrap(model), ADAPTERS_ATTRIBUTE, {})


def attach(model: nn.Module, adapter: Adapter) -> None:
    """Record ``adapter`` on ``model`` and re-freeze the model for every attached technique."""
    model = unwrap(model)
    adapters = dict(attached(model))
    adapters[adapter.kind] = adapter
    setattr(model, ADAPTERS_ATTRIBUTE, adapters)
    refreeze(model)
    _point_model_methods(model)


def detach(model: nn.Module, kind: str) -> None:
    """Forget the ``kind`` adapter of ``model`` (its modules are the technique's business)."""
    model = unwrap(model)
    adapters = {k: a for k, a in attached(model).items() if k != kind}
    if adapters:
        setattr(model, ADAPTERS_ATTRIBUTE, adapters)
    elif hasattr(model, ADAPTERS_ATTRIBUTE):
        delattr(model, ADAPTERS_ATTRIBUTE)
    _point_model_methods(model)


# Methods called on an adapted model that must not do what the model's class does (a Hugging Face model's
# save_pretrained would write keys from_pretrained does not know; PEFT's names the class lacks): name ->
# (what runs instead, ``function(model, *args, **kwargs)``; whether it applies to a model, asked at every attach and
# detach). Registered by `model_method` (`lightning_peft.peft._model_methods` holds them).
_MODEL_METHODS: dict[str, tuple[Callable[..., Any], Callable[[nn.Module], bool]]] = {}


def model_method(name: str, applies: Callable[[nn.Module], bool]) -> Callable[[Callable], Callable]:
    """Register ``function(model, *args, **kwargs)`` as what ``model.<name>(...)`` runs on a model with adapters for
    which ``applies(model)`` holds (a `_ModelMethod` in the instance's ``__dict__``, ahead of the class's method)."""
    def register_method(function: Callable) -> Callable:
        _MODEL_METHODS[name] = (function, applies)
        return function

    return register_method


class _ModelMethod:
    """Stands, on one adapted model, for its method ``name``: runs what `model_method` registered for it."""

    def __init__(self, model: nn.Module, name: str) -> None:
        self.model, self.name = model, name
        self.__doc__ = _MODEL_METHODS[name][0].__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _MODEL_METHODS[self.name][0](self.model, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<lightning-peft's {self.name} of an adapted {type(self.model).__name__}>"


def _point_model_methods(model: nn.Module) -> None:
    """Put the registered methods that apply on ``model`` (one with adapters) and take away the others."""
    for name, (_, applies) in _MODEL_METHODS.items():
        wanted = bool(attached(model)) and applies(model)
        present = isinstance(model.__dict__.get(name), _ModelMethod)
        if wanted and not present and name not in model.__dict__:
            model.__dict__[name] = _ModelMethod(model, name)
        elif present and not wanted:
            del model.__dict__[name]


def remove_adapter(model: nn.Module, adapter: Adapter, merge: bool) -> nn.Module:
    """Unload ``adapter`` (merged or not), re-freeze for the techniques left, and return the plain model."""
    adapter.unload(model, merge)
    if attached(model):  # other techniques remain: freeze for them
        refreeze(model)
    return unwrap(model)


def wrapped_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every attached technique's [`Adapter.wrapped`][lightning_peft.peft.Adapter.wrapped] modules of ``model``, by
    name."""
    layers: dict[str, nn.Module] = {}
    for adapter in attached(model).values():
        layers.update(adapter.wrapped(model))
    return layers


def adapter_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The union of every attached adapter's [`Adapter.state`][lightning_peft.peft.Adapter.state] (model keys, not
    detached)."""
    state: dict[str, Tensor] = {}
    for adapter in attached(model).values():
        state.update(adapter.state(model))
    return state


def refreeze(model: nn.Module) -> None:
    """Freeze ``model`` except the parameters of its attached adapters (freezing happens once, for all)."""
    model = unwrap(model)
    model.requires_grad_(False)
    for value in adapter_tensors(model).values():
        if isinstance(value, nn.Parameter):
            value.requires_grad_(True)


def require_adapters(model: nn.Module, who: str) -> dict[str, Adapter]:
    adapters = attached(model)
    if not adapters:
        raise RuntimeError(
            f"{who}: {type(unwrap(model)).__name__} has no adapter; call inject_lora(model, ...) (or another "
            "technique's inject function) first."
        )
    return adapters


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter of ``model``: every attached technique's tensors, detached, under clean model keys.

    Raises:
        RuntimeError: If ``model`` has no adapter.
    """
    require_adapters(model, "adapter_state_dict")
    return {clean_key(k): v.detach() for k, v in adapter_tensors(model).items()}


def merged_state_dict(model: nn.Module, adapter_name: str | None = None) -> dict[str, Tensor]:
    """The plain model's state dict with every adapter folded in, under the plain model's own keys.

    ``adapter_name``: of a technique with several named adapters, the one folded in (default: its active one).

    Does not change ``model``: merged weights are new tensors. Loading the result into a fresh copy of the
    original (un-adapted) model gives the merged model.

    Raises:
        RuntimeError: If ``model`` has no adapter, an adapter cannot be merged, or a merge is non-finite.
    """
    adapters = require_adapters(model, "merged_state_dict")
    model = unwrap(model)
    state = model.state_dict()
    for adapter in adapters.values():
        named = {"name": adapter_name} if adapter_name is not None and adapter.named else {}
        state = adapter.merged_state(model, state, **named)
    return {clean_key(k): v for k, v in state.items()}


@dataclass(frozen=True)
class ParameterReport:
    """Trainable-parameter count of a model (shared parameters counted once)."""

    trainable: int
    total: int

    @property
    def percent(self) -> float:
        return 100.0 * self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        return f"trainable params: {self.trainable:,} || all params: {self.total:,} || trainable: {self.percent:.4f}%"


def trainable_parameters(model: nn.Module) -> ParameterReport:
    """Count trainable and total parameters (each shared tensor once).

    The frozen originals kept beside ``modules_to_save`` copies count in the total, as PEFT counts them.
    """
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in seen.values())
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    return ParameterReport(trainable=trainable, total=total)
