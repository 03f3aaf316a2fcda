"""The model a ``model_attribute`` setting names inside a LightningModule: one lookup and one message for the callbacks
([`lightning_peft.callbacks`][lightning_peft.callbacks]) and strategies
([`DeviceMapStrategy`][lightning_peft.strategies.DeviceMapStrategy]) that work on one submodule. Pure torch."""

from __future__ import annotations

from torch import nn

__all__ = ["submodule"]


def submodule(root: nn.Module, path: str, who: str) -> nn.Module:
    """``root.get_submodule(path)``, refusing a path that ``root`` lacks with a message that lists its children.

    Args:
        root: The LightningModule (or any module).
        path: The dotted path, e.g. ``"model"`` or ``"backbone.encoder"``.
        who: The callback or strategy whose ``model_attribute`` it is, for the message.

    Examples:
        >>> submodule(nn.Sequential(nn.Linear(2, 2)), "encoder", "LoRA")
        Traceback (most recent call last):
        ValueError: LoRA(model_attribute='encoder'): Sequential has no such submodule. Its children: 0.
    """
    try:
        return root.get_submodule(path)
    except AttributeError:
        children = ", ".join(n for n, _ in root.named_children()) or "none"
        raise ValueError(
            f"{who}(model_attribute={path!r}): {type(root).__name__} has no such submodule. Its children: {children}."
        ) from None
