"""Layer-wise learning-rate decay (LLRD): lower layers of a pretrained network take smaller steps.

Papers: Clark et al., "ELECTRA: Pre-training Text Encoders as Discriminators Rather Than Generators",
arXiv:2003.10555 (decay 0.8 for fine-tuning); Bao et al., "BEiT: BERT Pre-Training of Image Transformers",
arXiv:2106.08254, whose convention is used here (MAE and BEiT recipes use 0.65 to 0.75).

Rule. A model with ``L`` layers numbers its parameters by depth ``d``: the embeddings ``d = 0``, layer ``i``
(0-based) ``d = i + 1``, everything above the last layer (pooler, head, final norm) ``d = L + 1``. A parameter
at depth ``d`` trains with:

```text
lr_d = lr * decay ** (L + 1 - d)
```

so layer ``i`` gets ``lr * decay ** (L - i)``, the embeddings ``lr * decay ** (L + 1)`` and the head ``lr``.

Depth comes from parameter names: the first match of a layer pattern (a regular expression whose one group is
the layer index, ``layer.N``, ``layers.N``, ``h.N``, ``blocks.N``, ``block.N`` by default) gives the layer; else an
embedding pattern (a name part containing ``embed``, or ``wte``, ``wpe``, ``cls_token``, ``mask_token``,
``shared``) gives ``d = 0``; else the parameter is above the layers. Prompt learning's parameters
(`lightning_peft.peft`) follow the same reading: the soft prompt (``lightning_peft_prompt``) stands in front of the
input embeddings, so ``d = 0``; the prefix (``lightning_peft_prefix``) is one table of every layer's keys and values,
so no layer's rate is its own and it takes the top rate (``d = L + 1``), as parameters outside the layers do. ``L``
is one more than the largest layer index among all parameters, frozen ones included, so freezing or adapting some layers (LoRA) does not change the
depth. Several stacks (an encoder and a decoder) share the numbering: layer ``i`` of each gets the same rate.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_peft._checks import fraction, positive, real

# Each group the split of an optimizer's groups makes (`decayed_groups`) carries, under this key, {"scale": the
# factor its lr must keep, "origin": which of the user's groups it came from, "label": its depth's name}. In the group
# itself, so that it survives what strategies do to optimizers (ZeroRedundancyOptimizer copies the groups into a new
# optimizer, DeepSpeed wraps the optimizer) and what a checkpoint does to them (loading replaces the group dicts with
# the saved ones, which carry it too).
GROUP_KEY = "layerwise_lr"

# The modules prompt and prefix tuning add (peft's PROMPT_MODULE and PREFIX_ATTRIBUTE; a test holds the names equal).
PROMPT_PATTERN = re.compile(r"(?:^|\.)lightning_peft_prompt\.")
ACROSS_LAYERS_PATTERN = re.compile(r"(?:^|\.)lightning_peft_prefix\.")

DEFAULT_LAYER_PATTERNS = (r"(?:^|\.)(?:layer|layers|h|blocks|block)\.(\d+)(?:\.|$)",)
DEFAULT_EMBEDDING_PATTERNS = (r"(?:^|\.)(?:[A-Za-z_]*embed[A-Za-z_]*|wte|wpe|cls_token|mask_token|shared)(?:\.|$)",)


def layer_depths(
    model: nn.Module,
    layer_patterns: Sequence[str] | None = None,
    embedding_patterns: Sequence[str] | None = None,
    who: str = "layerwise_lr_groups",
) -> tuple[dict[str, int], int]:
    """The depth of every parameter of ``model`` and its number of layers ``L``.

    Args:
        model: The model; every parameter, trainable or not, counts towards ``L``.
        layer_patterns: Regular expressions searched in parameter names, each with one group capturing the
            layer index; the first that matches wins. ``None`` uses the common layouts.
        embedding_patterns: Regular expressions marking embedding parameters (depth 0); ``None`` uses the
            defaults.
        who: The caller's name, for error messages.

    Returns:
        ``(depths, L)``: depth by parameter name (0 embeddings, ``i + 1`` layer ``i``, ``L + 1`` above) and ``L``.

    Raises:
        ValueError: If a pattern is not a valid regular expression, a layer pattern lacks its group or matches
            no parameter, or no parameter lies in a layer.

    Examples:
        >>> net = nn.ModuleDict({"embed": nn.Embedding(5, 2), "layers": nn.ModuleList([nn.Linear(2, 2)] * 1),
        ...                      "head": nn.Linear(2, 3)})
        >>> layer_depths(net)
        ({'embed.weight': 0, 'layers.0.weight': 1, 'layers.0.bias': 1, 'head.weight': 2, 'head.bias': 2}, 1)
    """
    layer_res = _compile(layer_patterns, DEFAULT_LAYER_PATTERNS, "layer_patterns", who, groups=1)
    embedding_res = _compile(embedding_patterns, DEFAULT_EMBEDDING_PATTERNS, "embedding_patterns", who, groups=0)
    names = [name for name, _ in model.named_parameters()]
    layers: dict[str, int] = {}
    used = [False] * len(layer_res)
    for name in names:
        for k, regex in enumerate(layer_res):
            match = regex.search(name)
            if match:
                layers[name], used[k] = int(match.group(1)), True
                break
    if layer_patterns is not None and not all(used):
        unused = [p for p, u in zip(layer_patterns, used) if not u]
        raise ValueError(
            f"{who}(layer_patterns={list(layer_patterns)!r}): {unused!r} matched no parameter of "
            f"{type(model).__name__}. Its parameter names look like: {_sample(names)}."
        )
    if not layers:
        raise ValueError(
            f"{who}: found no layers in {type(model).__name__}: no parameter name matches {_shown(layer_res)}. "
            f"Its parameter names look like: {_sample(names)}. Pass layer_patterns=[r'...\\.(\\d+)\\.'] with one "
            "group capturing the layer index."
        )
    num_layers = max(layers.values()) + 1
    depths = {
        name: layers[name] + 1 if name in layers
        else num_layers + 1 if ACROSS_LAYERS_PATTERN.search(name)
        else 0 if PROMPT_PATTERN.search(name) or any(regex.search(name) for regex in embedding_res)
        else num_layers + 1
        for name in names
    }
    return depths, num_layers


def lr_scale(depth: int, num_layers: int, decay: float) -> float:
    """``decay ** (num_layers + 1 - depth)``: the factor on the base learning rate at ``depth``."""
    return decay ** (num_layers + 1 - depth)


def depth_label(depth: int, num_layers: int) -> str:
    """``"embeddings"``, ``"layer.<i>"`` or ``"head"``: a readable name for a depth (used in logged keys)."""
    if depth == 0:
        return "embeddings"
    return "head" if depth > num_layers else f"layer.{depth - 1}"


def check_decay(decay: object, who: str) -> None:
    """Raises unless ``decay`` is a number in (0, 1] (a TypeError for a non-number, else a ValueError)."""
    fraction(who, "decay", decay, meaning="ELECTRA uses 0.8, BEiT and MAE 0.65 to 0.75, and 1 means no decay")


def split_by_depth(
    params: Iterable[nn.Parameter],
    names: dict[int, str],
    depths: dict[str, int],
    num_layers: int,
    decay: float,
    lr: float,
    options: dict[str, Any],
    bias_and_norm_weight_decay: float | None = 0.0,
) -> list[tuple[int | None, dict[str, Any]]]:
    """Splits one parameter group into groups of equal depth (and, optionally, decayed or not).

    Only parameters that train make groups: a parameter with ``requires_grad=False`` joins the group of its depth
    (and decay) if one trains, else the group's first; so no group holds only frozen parameters (DeepSpeed cannot
    take such a group once the frozen ones are dropped, and it would be one more group with nothing to train). A
    group with no parameter that trains stays one group, as given.

    Args:
        params: The group's parameters.
        names: Parameter name by ``id(param)``; a parameter not in it counts as above the layers.
        depths: Depth by parameter name (see `layer_depths`).
        num_layers: ``L``.
        decay: The decay factor.
        lr: The group's base learning rate.
        options: The group's other settings (weight decay, betas, ...), copied into every new group.
        bias_and_norm_weight_decay: Weight decay of 1-D parameters (biases, norm weights); ``None`` keeps the
            group's.

    Returns:
        ``(depth, group)`` pairs, groups ``{**options, "params", "lr", "names"}`` ordered by depth, each depth's
        decayed group first; ``depth`` is None for a group left whole (nothing in it trains; its ``lr`` is ``lr``).
    """
    params = list(params)
    buckets: dict[tuple[int, bool], list[nn.Parameter]] = {}
    frozen: list[tuple[tuple[int, bool], nn.Parameter]] = []
    for param in params:
        depth = depths.get(names.get(id(param), ""), num_layers + 1)
        key = (depth, bias_and_norm_weight_decay is not None and param.ndim < 2)
        if param.requires_grad:
            buckets.setdefault(key, []).append(param)
        else:
            frozen.append((key, param))
    if not buckets:  # nothing here trains: one group, as given
        return [(None, {**options, "params": params, "lr": lr, "names": [names.get(id(p), "") for p in params]})]
    keys = sorted(buckets)
    for key, param in frozen:
        buckets[key if key in buckets else keys[0]].append(param)
    groups = []
    for depth, exempt in keys:
        members = buckets[(depth, exempt)]
        group = {**options, "params": members, "lr": lr * lr_scale(depth, num_layers, decay),
                 "names": [names.get(id(p), "") for p in members]}
        if exempt:
            group["weight_decay"] = bias_and_norm_weight_decay
        groups.append((depth, group))
    return groups


def layerwise_lr_groups(
    model: nn.Module,
    lr: float,
    decay: float,
    weight_decay: float = 0.0,
    layer_patterns: Sequence[str] | None = None,
    embedding_patterns: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups with layer-wise decayed learning rates, for the trainable parameters.

    Args:
        model: The model (after freezing or adapter injection: only parameters that require gradients are
            grouped).
        lr: The learning rate of the top (head) group.
        decay: The per-layer factor, in (0, 1].
        weight_decay: Weight decay of matrices; biases and norm weights (1-D parameters) get 0.
        layer_patterns: See `layer_depths`.
        embedding_patterns: See `layer_depths`.

    Returns:
        Groups ``{"params", "lr", "weight_decay", "names"}``, embeddings first, head last; pass them to any
        optimizer (``torch.optim.AdamW(groups)``). A scheduler must scale each group's own ``lr``.

    Raises:
        ValueError: If ``decay``, ``lr`` or ``weight_decay`` is out of range, a pattern is wrong (see
            `layer_depths`), or no parameter requires gradients.

    Examples:
        >>> net = nn.ModuleDict({"embed": nn.Embedding(5, 2), "layers": nn.ModuleList([nn.Linear(2, 2)]),
        ...                      "head": nn.Linear(2, 3)})
        >>> [(g["names"], round(g["lr"], 4)) for g in layerwise_lr_groups(net, lr=1.0, decay=0.5)]
        [(['embed.weight'], 0.25), (['layers.0.weight'], 0.5), (['layers.0.bias'], 0.5), (['head.weight'], 1.0), (['head.bias'], 1.0)]
    """
    who = "layerwise_lr_groups"
    check_decay(decay, who)
    positive(who, "lr", lr)
    real(who, "weight_decay", weight_decay, minimum=0)
    depths, num_layers = layer_depths(model, layer_patterns, embedding_patterns, who)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"{who}: no parameter of {type(model).__name__} requires gradients, so there is nothing "
                         "to group; unfreeze some, or inject adapters first.")
    names = {id(p): name for name, p in trainable}
    return [group for _, group in split_by_depth([p for _, p in trainable], names, depths, num_layers, decay, lr,
                                                 {"weight_decay": weight_decay})]


def _compile(patterns: Sequence[str] | None, default: Sequence[str], field: str, who: str,
             groups: int) -> list[re.Pattern]:
    if patterns is None:
        patterns = default
    elif isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{who}({field}={patterns!r}): {field} must be a list of regular expressions (strings).")
    compiled = []
    for pattern in patterns:
        try:
            regex = re.compile(pattern)
        except re.error as error:
            raise ValueError(f"{who}({field}=[..., {pattern!r}, ...]): not a regular expression ({error}).") from None
        if groups and regex.groups != groups:
            raise ValueError(
                f"{who}({field}=[..., {pattern!r}, ...]): a layer pattern needs exactly one group capturing the "
                rf"layer index, e.g. r'encoder\.stage\.(\d+)\.'; it has {regex.groups}."
            )
        compiled.append(regex)
    return compiled


def _shown(regexes: list[re.Pattern]) -> str:
    return ", ".join(repr(r.pattern) for r in regexes)


def _sample(names: list[str], count: int = 6) -> str:
    shown = ", ".join(names[:count])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > count else shown or "(none)"


def unpack_group(group: dict[str, Any]) -> tuple[list[Tensor], dict[int, str] | None]:
    """A group's parameters, and the names it was given by id (None if unnamed).

    ``AdamW(model.named_parameters())`` (torch >= 2.5) hands ``(name, tensor)`` pairs to ``add_param_group``; an
    optimizer built before the run holds its ``param_names`` beside the tensors.
    """
    given = group["params"]
    items = [given] if isinstance(given, Tensor) else list(given)
    if "param_names" in group:
        items = list(zip(group["param_names"], items))
    if items and all(isinstance(item, tuple) for item in items):
        return [p for _, p in items], {id(p): name for name, p in items}
    return items, None


def optimizers_and_schedulers(result: Any) -> tuple[list[Optimizer], list[Any]]:
    """The optimizers and schedulers in anything ``configure_optimizers`` may return."""
    optimizers: list[Optimizer] = []
    schedulers: list[Any] = []

    def visit(item: Any) -> None:
        if isinstance(item, Optimizer):
            optimizers.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                visit(value)
        elif isinstance(item, list | tuple):
            for value in item:
                visit(value)
        elif hasattr(item, "optimizer") and hasattr(item, "step"):
            schedulers.append(item)

    visit(result)
    return optimizers, schedulers


def scale_plateau_floors(scheduler: Any, entries: list[dict[str, Any] | None]) -> None:
    """Makes ``ReduceLROnPlateau`` keep the ratios: per-group ``min_lr`` scaled, and ``eps = 0``.

    Plateau clamps every group at ``min_lr`` (one value unless given per group) and skips a group's cut when it
    is below ``eps``; both hit the decayed groups earlier than the top one. A scaled ``min_lr`` clamps all
    groups at the same moment, and without ``eps`` no group skips a cut the others make.

    ``entries``: for each group of the scheduler's optimizer, ``{"scale", "origin"}`` (None for a group not split):
    its decay factor and which of the user's groups it came from.
    """
    scheduler.eps = 0.0
    for origin in {entry["origin"] for entry in entries if entry}:
        members = [(i, entry["scale"]) for i, entry in enumerate(entries) if entry and entry["origin"] == origin]
        floors = [scheduler.min_lrs[i] for i, _ in members]
        if all(math.isclose(f, floors[0], rel_tol=1e-9, abs_tol=0.0) for f in floors):  # one min_lr: scale it
            for i, scale in members:
                scheduler.min_lrs[i] = floors[0] * scale


def decayed_groups(group: dict[str, Any], optimizer: Any, names: dict[int, str], depths: dict[str, int],
                   num_layers: int, decay: float, bias_and_norm_weight_decay: float | None, origin: int,
                   who: str) -> list[dict[str, Any]]:
    """One of ``optimizer``'s param groups split by depth (`split_by_depth`), each part tagged under
    `GROUP_KEY` with its scale, ``origin`` (the index of the user's group) and depth label.

    The group's lr (else the optimizer's default) is the top one; a group given as ``(name, tensor)`` pairs keeps
    its names (``AdamW(model.named_parameters())``).

    Raises:
        TypeError: If there is no numeric learning rate to decay.
    """
    params, given_names = unpack_group(group)
    options = {k: v for k, v in group.items() if k not in ("params", "param_names", GROUP_KEY)}
    lr = options.pop("lr", optimizer.defaults.get("lr"))
    if not isinstance(lr, float | int | Tensor) or isinstance(lr, bool):
        raise TypeError(f"{who}: {type(optimizer).__name__} has no numeric learning rate (lr={lr!r}) to decay; give "
                        "the optimizer an lr.")
    parts = []
    for depth, part in split_by_depth(params, names, depths, num_layers, decay, lr, options,
                                      bias_and_norm_weight_decay):
        if given_names is not None:  # the optimizer keeps the names it was given
            part["params"] = [(given_names[id(p)], p) for p in part["params"]]
        if depth is not None:
            part[GROUP_KEY] = {"scale": lr_scale(depth, num_layers, decay), "origin": origin,
                               "label": depth_label(depth, num_layers)}
        parts.append(part)
    return parts


def broken_decay(param_groups: list[dict[str, Any]]) -> tuple[tuple[float, str], tuple[float, str]] | None:
    """The first two groups split from one user group whose ``lr / scale`` differ (``(undecayed lr, label)`` each):
    something set the learning rates without keeping the decay; None if every ratio holds."""
    base: dict[int, tuple[float, str]] = {}
    for group in param_groups:
        entry = group.get(GROUP_KEY)
        if not entry:
            continue
        unscaled = float(group["lr"]) / entry["scale"]
        first = base.setdefault(entry["origin"], (unscaled, entry["label"]))
        if not math.isclose(unscaled, first[0], rel_tol=1e-6, abs_tol=1e-30):
            return first, (unscaled, entry["label"])
    return None
