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
