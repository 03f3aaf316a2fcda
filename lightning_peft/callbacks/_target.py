"""Which submodule of a LightningModule a PEFT callback works on."""

from __future__ import annotations

from torch import nn

from lightning_peft._submodule import submodule
from lightning_peft.peft.adapter import unwrap


def is_hf_model(module: nn.Module) -> bool:
    """True for a Hugging Face ``PreTrainedModel`` (duck-typed: no ``transformers`` import)."""
    return callable(getattr(module, "save_pretrained", None)) and hasattr(module, "config")


def hf_models(pl_module: nn.Module) -> dict[str, nn.Module]:
    """The outermost Hugging Face models inside ``pl_module`` by dotted path (models inside them not listed)."""
    found: dict[str, nn.Module] = {}
    for name, module in pl_module.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer in found):
            continue
        if is_hf_model(unwrap(module)):
            found[name] = unwrap(module)
    return found


def resolve_target(pl_module: nn.Module, model_attribute: str | None, who: str) -> tuple[str, nn.Module]:
    """``(name, module)``: the model a callback adapts or exports, and its path inside ``pl_module``.

    Args:
        pl_module: The LightningModule.
        model_attribute: Dotted path of the model inside ``pl_module``; ``""`` for ``pl_module`` itself.
            ``None`` picks the one Hugging Face model inside ``pl_module`` (at any depth) if there is exactly
            one, else ``pl_module`` itself when it holds none; several are refused as ambiguous. A
            ``torch.compile`` wrapper is looked through, so names never carry its ``_orig_mod`` prefix.
        who: The callback's name, for error messages.
    """
    if model_attribute == "":
        return "", pl_module
    if model_attribute:
        return model_attribute, unwrap(submodule(pl_module, model_attribute, who))
    found = hf_models(pl_module)
    if len(found) > 1:
        choices = ", ".join(repr(n) for n in found)
        raise ValueError(
            f"{who}: {type(pl_module).__name__} holds {len(found)} Hugging Face models ({choices}), so which one to "
            f"adapt is ambiguous. Set {who}(model_attribute=...) to one of {choices}, or to '' for the whole "
            "LightningModule (the same on every PEFT callback of the Trainer)."
        )
    return next(iter(found.items())) if found else ("", pl_module)


def refuse_two_callbacks_on_one_model(callbacks: list, callback, pl_module: nn.Module, model: nn.Module) -> None:
    """Raise if another callback of ``callback``'s technique (``kind``) in ``callbacks`` adapts the same ``model``.

    ``LoRA`` and ``MultiLoRA`` both put LoRA adapters on a model, and a model carries one set of them: the second
    callback would find the first's adapters with another config and refuse, naming only itself.
    """
    for other in callbacks:
        if other is callback or getattr(other, "kind", None) != callback.kind or not hasattr(other, "model_attribute"):
            continue
        path, theirs = resolve_target(pl_module, other.model_attribute, other.who)
        if theirs is not model:
            continue
        fix = "Keep one of them."
        named = [c for c in (callback, other) if c.takes_named_adapters]
        if len(named) == 1:
            single = other if named[0] is callback else callback
            fix = (f"Keep one: {named[0].who} alone, with {single.who}'s settings as one of its adapters (with one "
                   f"adapter, {named[0].who}(adapters={{'default': {{...}}}}) is {single.who} plus per-sample "
                   f"routing), or {single.who} alone.")
        where = type(model).__name__ + (f" ({path!r})" if path else "")
        raise ValueError(
            f"{callback.who} and {other.who} in one Trainer both adapt {where}, and a model carries one set of "
            f"{callback.kind} adapters: the second callback would find the first's and refuse. {fix}"
        )
