"""What methods called on an adapted model do, when the model's own class (or Hugging Face PEFT's ``PeftModel``) would
do something else.

A Hugging Face model keeps its class's methods when [`inject_lora`][lightning_peft.peft.inject_lora] (or another
technique) replaces its layers; several of them would then do the wrong thing silently, or fail with advice about
another library. Registered with `lightning_peft.peft.adapter.model_method`, each stands on the instance while
adapters are attached (removing the last adapter takes it away):

| call on the adapted model | what it does |
| --- | --- |
| ``save_pretrained(directory, ...)`` | writes the merged model (every adapter folded in, as [`merged_state_dict`][lightning_peft.peft.merged_state_dict]; the live model is not changed), so ``from_pretrained(directory)`` computes what the adapted model computes. The class's own would write the adapted layers' keys (``base_layer``, ``lora_A.default``), which ``from_pretrained`` does not know: it re-initialises those layers without an error. Refused for a technique that cannot be merged. With ``state_dict=`` given, that is written |
| ``set_adapter(name)``, ``active_adapters()``, ``delete_adapter(name)`` | lightning-peft's [`set_adapter`][lightning_peft.peft.set_adapter], [`active_adapter`][lightning_peft.peft.active_adapter], [`delete_adapter`][lightning_peft.peft.delete_adapter] (transformers' PEFT integration knows only PEFT's layers and says "use peft >= 0.22") |
| ``disable_adapters()``, ``enable_adapters()`` | the adapters off (the base output) until ``enable_adapters()``, as in transformers; ``with model.disable_adapters():`` turns them back on at the end of the block, as [`disable_adapters`][lightning_peft.peft.disable_adapters] does |
| ``add_adapter``, ``load_adapter``, ``get_adapter_state_dict`` | refused, naming lightning-peft's function |
| ``generate(...)`` inside [`route_adapters`][lightning_peft.peft.route_adapters] | each sample keeps its adapter when ``generate`` repeats samples (``num_beams``, ``num_return_sequences``): the names are repeated as the inputs are |
| PEFT ``PeftModel``'s ``merge_and_unload``, ``unload``, ``merge_adapter``, ``unmerge_adapter`` (the model's class has none) | refused, naming lightning-peft's function |
"""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path
from typing import Any

from torch import nn

from ._export import save_pretrained_merged
from .adapter import attached, merged_state_dict, model_method
from .lora.layer import lora_spec, require_spec
from .lora.multi import active_adapter, delete_adapter, set_adapter, switch_off

log = logging.getLogger(__name__)


def _hugging_face(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` ``PreTrainedModel`` (never imports ``transformers``)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _hf_method(name: str):
    """`model_method` for a method of Hugging Face models."""
    return model_method(name, lambda model: _hugging_face(model) and callable(getattr(type(model), name, None)))


def _own(model: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    """The model's class's own ``name`` method, called."""
    return getattr(type(model), name)(model, *args, **kwargs)


def _who(model: nn.Module, name: str) -> str:
    return f"{type(model).__name__}.{name}()"


# --- save_pretrained --------------------------------------------------------------------------------------------


@_hf_method("save_pretrained")
def _save_pretrained(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    """Writes the merged model (lightning-peft adapters folded in) in the Hugging Face layout, so that
    ``from_pretrained`` of the folder computes what this model computes; the model itself is not changed. The adapter
    alone, in PEFT's layout: ``lightning_peft.peft.save_adapter(model, directory)``."""
    options = _arguments(type(model).save_pretrained, model, args, kwargs)
    if options.get("state_dict") is not None:  # the caller chose the weights (MergeOnSave passes merged ones)
        return _own(model, "save_pretrained", *args, **kwargs)
    who = _who(model, "save_pretrained")
    kinds = [kind for kind, adapter in attached(model).items() if not adapter.mergeable]
    if kinds:
        raise RuntimeError(
            f"{who}: the model carries lightning-peft's {kinds[0]} adapter, which cannot be folded into the base "
            "weights, so no plain model computes what it computes; save_pretrained would write keys from_pretrained "
            "does not know (it re-initialises those layers without an error). Save the adapter with "
            "lightning_peft.peft.save_adapter(model, directory) and load it onto the base model with "
            "load_adapter(model, directory)."
        )
    spec = lora_spec(model)
    if spec is not None and spec.routing.disabled:
        raise RuntimeError(
            f"{who}: the adapters are disabled, so the model computes its base output, but the merged model would hold "
            f"the active adapter {spec.routing.active!r}. Call enable_adapters() first, or save the base with "
            "unload_lora(model, merge=False).save_pretrained(directory) (which removes the adapters from the model)."
        )
    options.pop("state_dict", None)
    directory = options.pop("save_directory")
    save_pretrained_merged(model, merged_state_dict(model), Path(directory), **options)
    log.info("%s: wrote the merged model (adapters folded in) to %s; the adapter alone: save_adapter(model, directory).",
             who, directory)
    return None


def _arguments(method: Any, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by name (``**kwargs`` spread), less ``self``."""
    bound = inspect.signature(method).bind(model, *args, **kwargs)
    options: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            options.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            options[name] = value
    return options


# --- transformers' PEFT integration -----------------------------------------------------------------------------


@_hf_method("set_adapter")
def _set_adapter(model: nn.Module, adapter_name: str | list[str]) -> None:
    """``lightning_peft.peft.set_adapter(model, adapter_name)``: the LoRA adapter every sample uses."""
    if isinstance(adapter_name, (list, tuple)):
        if len(adapter_name) != 1:
            raise ValueError(
                f"{_who(model, 'set_adapter')}: got {list(adapter_name)}; lightning-peft runs one adapter at a time. "
                "For one adapter per sample use route_adapters(model, names); to mix adapters into a new one, "
                "combine_adapters(model, weights, name)."
            )
        adapter_name = adapter_name[0]
    require_spec(model, _who(model, "set_adapter"))
    set_adapter(model, adapter_name)


@_hf_method("active_adapters")
def _active_adapters(model: nn.Module) -> list[str]:
    """``[lightning_peft.peft.active_adapter(model)]``."""
    require_spec(model, _who(model, "active_adapters"))
    return [active_adapter(model)]


@_hf_method("delete_adapter")
def _delete_adapter(model: nn.Module, adapter_names: str | list[str]) -> None:
    """``lightning_peft.peft.delete_adapter(model, name)`` for each name."""
    require_spec(model, _who(model, "delete_adapter"))
    for name in [adapter_names] if isinstance(adapter_names, str) else adapter_names:
        delete_adapter(model, name)


class _AdaptersOff:
    """What ``model.disable_adapters()`` returns: the adapters stay off until ``model.enable_adapters()``, or, used
    as ``with model.disable_adapters():``, until the block ends (then as they were before)."""

    def __init__(self, routing: Any, before: bool) -> None:
        self.routing, self.before = routing, before

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.routing.disabled = self.before


@_hf_method("disable_adapters")
def _disable_adapters(model: nn.Module) -> _AdaptersOff:
    """Every LoRA adapter off (the base output) until ``enable_adapters()``, or to the end of a ``with`` block."""
    return _AdaptersOff(*switch_off(model, _who(model, "disable_adapters")))


@_hf_method("enable_adapters")
def _enable_adapters(model: nn.Module) -> None:
    """The LoRA adapters on again after ``disable_adapters()``."""
    require_spec(model, _who(model, "enable_adapters")).routing.disabled = False


_REFUSED = {
    "add_adapter": "lightning_peft.peft.add_adapter(model, name, config) adds a named LoRA adapter (a peft.LoraConfig "
                   "is accepted as config) and set_adapter(model, name) makes it the active one",
    "load_adapter": "lightning_peft.peft.load_adapter(model, directory, adapter_name=...) loads a PEFT adapter folder",
    "get_adapter_state_dict": "lightning_peft.peft.adapter_state_dict(model) returns the adapters' tensors "
                              "(save_adapter(model, directory) writes them in PEFT's layout)",
}


def _refusal(name: str, what: str, fix: str, error: type[Exception] = RuntimeError):
    """What ``model.<name>()`` runs when lightning-peft cannot do it that way: raises ``error`` saying what the method
    is (``what``) and what to call instead (``fix``)."""
    def refused(model: nn.Module, *args: Any, **kwargs: Any) -> None:
        raise error(f"{_who(model, name)} is {what}; this {type(model).__name__} carries lightning-peft adapters "
                    f"instead: {fix}.")

    refused.__doc__ = f"Not on a model with lightning-peft adapters: {fix}."
    return refused


for _name, _fix in _REFUSED.items():
    _hf_method(_name)(_refusal(_name, "transformers' PEFT integration, which works on Hugging Face PEFT's layers", _fix))


# --- generate inside route_adapters -----------------------------------------------------------------------------


@_hf_method("generate")
def _generate(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The model's ``generate``; inside ``route_adapters``, each sample's adapter name is repeated as ``generate``
    repeats the sample (``num_beams``, ``num_return_sequences``: ``repeat_interleave``, sample by sample)."""
    spec = lora_spec(model)
    expand = getattr(model, "_expand_inputs_for_generation", None)  # the class's (transformers 4.4x and 5)
    if spec is None or spec.routing.names is None or expand is None:
        return _own(model, "generate", *args, **kwargs)
    routing, names = spec.routing, spec.routing.names

    def expanded(*inner: Any, expand_size: int = 1, **options: Any) -> Any:
        routing.route_to([name for name in names for _ in range(expand_size)])  # (B * expand_size,)
        return expand(*inner, expand_size=expand_size, **options)

    model.__dict__["_expand_inputs_for_generation"] = expanded
    try:
        return _own(model, "generate", *args, **kwargs)
    finally:
        del model.__dict__["_expand_inputs_for_generation"]
        routing.route_to(names)


# --- PEFT's PeftModel methods ---------------------------------------------------------------------------------------


_PEFT_METHODS = {
    "merge_and_unload": "lightning_peft.peft.unload_lora(model) returns the plain model with the active adapter "
                        "merged (merge_lora(model) merges in place and keeps the LoRA layers)",
    "unload": "lightning_peft.peft.unload_lora(model, merge=False) returns the plain model without the adapter",
    "merge_adapter": "lightning_peft.peft.merge_lora(model) merges the active adapter in place",
    "unmerge_adapter": "lightning_peft.peft.unmerge_lora(model) subtracts it again",
}


for _name, _fix in _PEFT_METHODS.items():
    model_method(_name, lambda model, name=_name: lora_spec(model) is not None and not hasattr(type(model), name))(
        _refusal(_name, "a method of Hugging Face PEFT's PeftModel", _fix, AttributeError))
