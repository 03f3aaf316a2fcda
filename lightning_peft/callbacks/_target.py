"""Which submodule of a LightningModule a PEFT callback works on."""

from __future__ import annotations

from torch import nn


def is_hf_model(module: nn.Module) -> bool:
    """True for a Hugging Face ``PreTrainedModel`` (duck-typed: no ``transformers`` import)."""
    return callable(getattr(module, "save_pretrained", None)) and hasattr(module, "config")


def resolve_target(pl_module: nn.Module, model_attribute: str | None, who: str) -> tuple[str, nn.Module]:
    """``(name, module)``: the model a callback adapts or exports, and its name inside ``pl_module``.

    Args:
        pl_module: The LightningModule.
        model_attribute: Dotted attribute path of the model inside ``pl_module``. ``None`` picks the one
            Hugging Face model among ``pl_module``'s direct children if there is exactly one, else
            ``pl_module`` itself (name ``""``).
        who: The callback's name, for error messages.
    """
    if model_attribute:
        try:
            return model_attribute, pl_module.get_submodule(model_attribute)
        except AttributeError:
            children = ", ".join(n for n, _ in pl_module.named_children()) or "none"
            raise ValueError(
                f"{who}(model_attribute={model_attribute!r}): {type(pl_module).__name__} has no such submodule. "
                f"Its children: {children}."
            ) from None
    hf = [(n, m) for n, m in pl_module.named_children() if is_hf_model(m)]
    return hf[0] if len(hf) == 1 else ("", pl_module)

