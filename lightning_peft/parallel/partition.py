"""Cutting a model into consecutive, balanced parts: the units a device map places, the stages a pipeline runs.

A model's *units* are, walking from the model down to its list of layers (the ``nn.ModuleList`` / ``nn.Sequential``
holding most of the parameters in modules of one class: ``layers`` of this package's blocks, ``encoder.layer`` of
BERT, ``model.layers`` of Llama), the children with parameters before that path, each layer, then the children
after it. `balanced_cuts` is the partition both the device map and the pipeline use: ``k`` consecutive,
non-empty groups of a sequence of sizes with the smallest possible largest group (exact, by dynamic programming
over the prefix sums: ``O(k n^2)`` for ``n`` items). Sizes are parameter counts, each tensor counted once (tied
weights), LoRA's included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["balanced_cuts", "balanced_groups", "balanced_starts", "layer_units", "unique_numel"]


def _numel(module: nn.Module, seen: set[int] | None = None) -> int:
    """Parameters of ``module``; with ``seen``, each tensor counted once across calls (tied weights)."""
    total = 0
    for param in module.parameters():
        if seen is not None:
            if id(param) in seen:
                continue
            seen.add(id(param))
        total += param.numel()
    return total


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _layer_list(model: nn.Module) -> str | None:
    """Name of the ``nn.ModuleList`` / ``nn.Sequential`` holding the model's layers, or None.

    The score of a list is the parameter count of its children of its most common class (the repeated block),
    counted only if that class repeats; the highest score wins, then the larger list, then the one with more
    children (so ``Sequential(embed, Sequential(*blocks), head)`` picks the inner list of blocks).
    """
    best: tuple[int, int, int] | None = None
    found = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        by_class: dict[type, tuple[int, int]] = {}
        for child in module:
            count, size = by_class.get(type(child), (0, 0))
            by_class[type(child)] = (count + 1, size + _numel(child))
        count, size = max(by_class.values())  # most common class, then the larger one
        if size == 0:
            continue
        key = (size if count > 1 else 0, size, len(module))  # a repeated block beats a list of unlike modules
        if best is None or key > best:
            best, found = key, name
    return found


def layer_units(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(units, layers)``: the modules ``device_map="auto"`` places, in order, and the layers among them.

    Units: walking from ``model`` down to its list of layers, the children with parameters or buffers before the
    path, each layer, then those after it (registration order, which is the order of the forward in the models
    here, BERT and Llama).

    Raises:
        ValueError: If the model has no list of layers.

    Examples:
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
        >>> layer_units(model)
        (['0', '1.0', '1.1', '2'], ['1.0', '1.1'])
    """
    path = _layer_list(model)
    if path is None:
        raise ValueError(
            f"DeviceMapStrategy(device_map='auto'): found no list of layers (an nn.ModuleList or nn.Sequential of "
            f"modules with parameters) in {type(model).__name__}. Set model_attribute to the model inside the "
            "LightningModule, or give device_map as a dict {module name: device}."
        )
    parts = path.split(".") if path else []
    units: list[str] = []

    def walk(module: nn.Module, prefix: str, depth: int) -> None:
        if depth == len(parts):  # the layer list itself
            units.extend(_join(prefix, name) for name, child in module.named_children() if _has_state(child))
            return
        for name, child in module.named_children():
            if name == parts[depth]:
                walk(child, _join(prefix, name), depth + 1)
            elif _has_state(child):
                units.append(_join(prefix, name))

    walk(model, "", 0)
    list_module = model.get_submodule(path)
    layers = [_join(path, name) for name, child in list_module.named_children() if _has_state(child)]
    return units, layers


def balanced_cuts(sizes: list[int], groups: int) -> list[int]:
    """Group index of each item: ``groups`` consecutive non-empty groups with the smallest largest sum (DP)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[g][i]: smallest largest sum splitting the first i items into g groups; start[g][i]: where group g begins
    best = [[inf] * (n + 1) for _ in range(groups + 1)]
    start = [[0] * (n + 1) for _ in range(groups + 1)]
    best[0][0] = 0
    for g in range(1, groups + 1):
        for i in range(g, n + 1):
            for s in range(g - 1, i):
                cost = max(best[g - 1][s], prefix[i] - prefix[s])
                if cost < best[g][i]:
                    best[g][i], start[g][i] = cost, s
    owner = [0] * n
    i = n
    for g in range(groups, 0, -1):
        s = start[g][i]
        owner[s:i] = [g - 1] * (i - s)
        i = s
    return owner


def balanced_groups(model: nn.Module, count: int) -> dict[str, int]:
    """``{unit name: group}``: ``model``'s units cut into ``count`` consecutive groups, each holding at least one
    layer, with the smallest possible largest group in parameters (each tensor counted once).

    The units before the first layer (embeddings) join the first group and those after the last layer (final norm,
    head) the last group. A unit sharing a parameter with an earlier unit (a tied head) joins that unit's group.

    Raises:
        ValueError: If the model has no list of layers or fewer layers than ``count``.

    Examples:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 40))
        >>> balanced_groups(model, 2)
        {'0': 0, '1': 0, '2': 1}
    """
    units, layers = layer_units(model)
    if count > len(layers):
        raise ValueError(
            f"DeviceMapStrategy(device_map='auto'): {count} devices but {type(model).__name__} has {len(layers)} "
            f"layers ({layers[0]} to {layers[-1]}); each device needs at least one layer. Use at most {len(layers)} "
            f"devices (Trainer(devices={len(layers)}) or devices=[...]), or a model with more layers."
        )
    seen: set[int] = set()
    sizes = [_numel(model.get_submodule(name), seen) for name in units]
    first, last = units.index(layers[0]), units.index(layers[-1])
    owner = balanced_cuts(_fold(sizes, first, last), count)
    owner = [owner[0]] * first + owner + [owner[-1]] * (len(units) - 1 - last)
    return _follow_ties(model, dict(zip(units, owner)))


def _fold(sizes: list[int], first: int, last: int) -> list[int]:
    """The layers' sizes, with the units before the first layer added to it and those after the last to it."""
    inner = sizes[first : last + 1]
    inner[0] += sum(sizes[:first])
    inner[-1] += sum(sizes[last + 1 :])
    return inner


def _follow_ties(model: nn.Module, placed: dict[str, Any]) -> dict[str, Any]:
    """A unit sharing a parameter with an earlier unit goes where that unit goes (its device or group)."""
    owner_device: dict[int, Any] = {}
    result = {}
    for name, device in placed.items():
        params = list(model.get_submodule(name).parameters())
        earlier = next((owner_device[id(p)] for p in params if id(p) in owner_device), None)
        device = earlier if earlier is not None else device
        for param in params:
            owner_device.setdefault(id(param), device)
        result[name] = device
    return result


def unique_numel(modules: Sequence[nn.Module]) -> int:
    seen: dict[int, int] = {}
    for module in modules:
        for p in module.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def balanced_starts(sizes: list[int], num_stages: int) -> list[int]:
    """Start indices of stages 1..k-1 minimising the largest stage's total size (the device map's partition)."""
    owner = balanced_cuts(sizes, num_stages)  # stage of each piece
    return [i for i in range(1, len(owner)) if owner[i] != owner[i - 1]]
