"""LoRA+: a larger learning rate for the ``B`` factors, as Hugging Face PEFT's ``create_loraplus_optimizer`` groups it.

Paper: Hayou, Ghosh and Yu, "LoRA+: Efficient Low Rank Adaptation of Large Models", arXiv:2402.12354. For a layer
``W + s B A`` (``A`` (r, in), ``B`` (out, r)) trained with Adam, ``A`` and ``B`` at one learning rate learn features
inefficiently at large width; LoRA+ sets ``lr_B = ratio * lr_A`` (the paper suggests a ratio of about 16).

The groups, parameter by parameter (PEFT 0.21's rules, so the same model trains the same in both):

- both factors of an embedding's adapter (``lora_embedding_A`` / ``_B``): ``lr = lr_embedding`` (PEFT's
  ``loraplus_lr_embedding``, an absolute rate, 1e-6 by default);
- the ``B`` factor of every other adapted layer, and every other trained 1-D parameter (biases, norm weights, DoRA
  magnitudes): ``lr * ratio``;
- everything else (``A`` factors, ``modules_to_save`` matrices): ``lr``.

`split_group` splits one optimizer parameter group so (its other settings, weight decay included, are kept); each part
carries ``{"scale", "origin", "role"}`` under `GROUP_KEY`, so that a scheduler that breaks the ratios can be found
(`broken_ratios`). [`loraplus_groups`][lightning_peft.peft.loraplus.loraplus_groups] groups a whole model for a plain
training loop; the ``LoRA`` callback's ``loraplus_lr_ratio`` splits the groups of the user's own optimizer.

>>> import torch
>>> from lightning_peft.peft import inject_lora
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
>>> _ = inject_lora(model, rank=2, target_modules=["0"])
>>> [(g["role"], g["lr"]) for g in loraplus_groups(model, lr=1e-3, ratio=16.0)]
[('A', 0.001), ('B', 0.016)]
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from .._checks import positive
from .lora.layer import LoRAEmbedding, lora_layers

# The key under which each part of a split group records how its lr relates to the group's (kept in the group, so
# it survives a checkpoint and strategies that copy the groups).
GROUP_KEY = "loraplus"
_ORDER = ("A", "embedding", "B")  # PEFT's group order


def roles(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): "B" | "embedding"}`` for the LoRA factors of ``model`` that do not train at ``lr``."""
    found: dict[int, str] = {}
    for layer in lora_layers(model).values():
        embedding = isinstance(layer, LoRAEmbedding)
        for name in layer.specs:
            a, b = layer.factors(name)
            found[id(b)] = "embedding" if embedding else "B"
            if embedding:
                found[id(a)] = "embedding"
        if not embedding:  # every B by name, as PEFT's rule: an attention layer's out_proj_lora_B too
            found.update({id(p): "B" for n, p in layer.named_parameters() if n.split(".")[0].endswith("lora_B")})
    return found


def check_settings(who: str, ratio: object, lr_embedding: object) -> None:
    positive(who, "loraplus_lr_ratio", ratio, example="16", meaning="lr of B / lr of A; the paper uses 2 to 32")
    positive(who, "loraplus_lr_embedding", lr_embedding, example="1e-6",
             meaning="the absolute lr of embedding adapters, as PEFT's")


def split_group(group: dict[str, Any], default_lr: Any, found: dict[int, str], ratio: float, lr_embedding: float,
                origin: int, who: str) -> list[dict[str, Any]]:
    """One optimizer parameter group as LoRA+'s parts (the module docstring), in PEFT's order, each with the group's
    other settings; ``found``: `roles`. A group given as ``(name, tensor)`` pairs keeps its names.

    Raises:
        TypeError: If the group has no numeric learning rate (``default_lr``: the optimizer's).
    """
    given = group["params"]
    items = [given] if isinstance(given, Tensor) else list(given)
    if "param_names" in group:  # an optimizer built before: its names beside the tensors
        items = list(zip(group["param_names"], items))
    options = {k: v for k, v in group.items() if k not in ("params", "param_names", GROUP_KEY)}
    lr = options.pop("lr", default_lr)
    if isinstance(lr, bool) or not isinstance(lr, (int, float, Tensor)):
        raise TypeError(f"{who}: the optimizer has no numeric learning rate (lr={lr!r}) for LoRA+ to scale; give it "
                        "an lr.")
    parts: dict[str, list] = {}
    for item in items:
        param = item[1] if isinstance(item, tuple) else item
        role = found.get(id(param)) or ("B" if param.requires_grad and param.ndim == 1 else "A")
        parts.setdefault(role, []).append(item)
    groups = []
    for role in (r for r in _ORDER if r in parts):
        rate = lr_embedding if role == "embedding" else lr * ratio if role == "B" else lr
        scale = rate / lr if float(lr) else None  # None: nothing to check against
        groups.append({**options, "params": parts[role], "lr": rate,
                       GROUP_KEY: {"scale": None if scale is None else float(scale), "origin": origin, "role": role}})
    return groups


def loraplus_groups(model: nn.Module, lr: float, ratio: float, lr_embedding: float = 1e-6) -> list[dict[str, Any]]:
    """The trainable parameters of ``model`` (with LoRA injected) as LoRA+ optimizer groups, PEFT's
    ``create_loraplus_optimizer`` grouping; pass them to any optimizer. Each group also holds ``"role"``."""
    check_settings("loraplus_groups", ratio, lr_embedding)
    positive("loraplus_groups", "lr", lr)
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = split_group({"params": trainable, "lr": lr}, lr, roles(model), ratio, lr_embedding, 0, "loraplus_groups")
    return [{**{k: v for k, v in g.items() if k != GROUP_KEY}, "role": g[GROUP_KEY]["role"]} for g in groups]


def broken_ratios(param_groups: list[dict[str, Any]]) -> tuple[str, float, str, float] | None:
    """(role, lr, role, lr) of the first two parts of one split group whose rates no longer keep LoRA+'s ratio
    (``lr / scale`` differs): something set the groups' rates without scaling each group's own; None if all hold."""
    first: dict[int, tuple[str, float, float]] = {}
    for group in param_groups:
        entry = group.get(GROUP_KEY)
        if not entry or entry["scale"] is None:
            continue
        lr = float(group["lr"])
        role, seen, unscaled = first.setdefault(entry["origin"], (entry["role"], lr, lr / entry["scale"]))
        if not math.isclose(lr / entry["scale"], unscaled, rel_tol=1e-6, abs_tol=1e-30):
            return role, seen, entry["role"], lr
    return None
