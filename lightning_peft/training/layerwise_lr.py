"""Layer-wise learning-rate decay (LLRD): lower layers of a pretrained network take smaller steps.

Papers: Clark et al., "ELECTRA: Pre-training Text Encoders as Discriminators Rather Than Generators",
arXiv:2003.10555 (decay 0.8 for fine-tuning); Bao et al., "BEiT: BERT Pre-Training of Image Transformers",
arXiv:2106.08254, whose convention is used here (MAE and BEiT recipes use 0.65 to 0.75).

Rule. A model with ``L`` layers numbers its parameters by depth ``d``: the embeddings ``d = 0``, layer ``i``
(0-based) ``d = i + 1``, everything above the last layer (pooler, head, final norm) ``d = L + 1``. A parameter
at depth ``d`` trains with::

    lr_d = lr * decay ** (L + 1 - d)

so layer ``i`` gets ``lr * decay ** (L - i)``, the embeddings ``lr * decay ** (L + 1)`` and the head ``lr``.

Depth comes from parameter names: the first match of a layer pattern (a regular expression whose one group is
the layer index, ``layer.N``, ``layers.N``, ``h.N``, ``blocks.N``, ``block.N`` by default) gives the layer; else an
embedding pattern (a name part containing ``embed``, or ``wte``, ``wpe``, ``cls_token``, ``mask_token``,
``shared``) gives ``d = 0``; else the parameter is above the layers. ``L`` is one more than the largest layer index
among all parameters, frozen ones included, so freezing or adapting some layers (LoRA) does not change the
depth. Several stacks (an encoder and a decoder) share the numbering: layer ``i`` of each gets the same rate.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

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

    Example:
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
        else 0 if any(regex.search(name) for regex in embedding_res)
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
    """Raises a ValueError unless ``decay`` is a number in (0, 1]."""
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 < decay <= 1:
        raise ValueError(
            f"{who}(decay={decay!r}): decay must be a number in (0, 1]; ELECTRA uses 0.8, BEiT and MAE 0.65 to "
            "0.75, and 1 means no decay."
        )


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

    Example:
        >>> net = nn.ModuleDict({"embed": nn.Embedding(5, 2), "layers": nn.ModuleList([nn.Linear(2, 2)]),
        ...                      "head": nn.Linear(2, 3)})
        >>> [(g["names"], round(g["lr"], 4)) for g in layerwise_lr_groups(net, lr=1.0, decay=0.5)]
        [(['embed.weight'], 0.25), (['layers.0.weight'], 0.5), (['layers.0.bias'], 0.5), (['head.weight'], 1.0), (['head.bias'], 1.0)]
    """
    who = "layerwise_lr_groups"
    check_decay(decay, who)
    for name, value in (("lr", lr), ("weight_decay", weight_decay)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0 or (
            name == "lr" and value == 0
        ):
            raise ValueError(f"{who}({name}={value!r}): {name} must be a finite number, "
                             f"{'> 0' if name == 'lr' else '>= 0'}.")
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
