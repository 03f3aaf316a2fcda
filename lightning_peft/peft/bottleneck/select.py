"""Where bottleneck adapters go: the modules ``placement`` picks by architecture, or ``target_modules`` by name, and
the checks that a module can take one (see `lightning_peft.peft.bottleneck.model`)."""

from __future__ import annotations

import re

from torch import nn

from .config import BottleneckConfig, Placement
from .layer import BottleneckLayer, output_size
from .._common import chosen_by_name, inside, refuse_no_target, wraps_a_layer
from ..adapter import attached
from ..modules_to_save import ModulesToSave, select_modules_to_save

_WHO = "BottleneckAdapters"

# (attention output, feed-forward output) of every layer, by family; full-name regular expressions.
_FAMILIES: dict[str, tuple[str, str]] = {
    "BERT": (r"(?:.*\.)?layer\.\d+\.attention\.output\.dense", r"(?:.*\.)?layer\.\d+\.output\.dense"),
    "GPT-2": (r"(?:.*\.)?h\.\d+\.attn\.c_proj", r"(?:.*\.)?h\.\d+\.mlp\.c_proj"),
    "Llama": (r"(?:.*\.)?layers\.\d+\.self_attn\.o_proj", r"(?:.*\.)?layers\.\d+\.mlp\.down_proj"),
}
_FAMILY_NAMES = ("BERT's layer.N.attention.output.dense / layer.N.output.dense, GPT-2's h.N.attn.c_proj / "
                 "h.N.mlp.c_proj, Llama's layers.N.self_attn.o_proj / layers.N.mlp.down_proj")


def describe_modules(model: nn.Module) -> str:
    """'query, key (x2), ...': leaf names of the modules an adapter can follow, for error messages."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if name and output_size(module) is not None and not isinstance(module, (ModulesToSave, BottleneckLayer)):
            leaf = name.rsplit(".", 1)[-1]
            counts[leaf] = counts.get(leaf, 0) + 1
    if not counts:
        return "none (it has no Linear, Conv1D or other module with an integer out_features)"
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items())


def _placement_targets(model: nn.Module, placement: Placement, names: list[str]) -> list[str]:
    found = {family: [[n for n in names if re.fullmatch(p, n)] for p in patterns]
             for family, patterns in _FAMILIES.items()}
    families = [f for f, (attention, feed_forward) in found.items() if attention and feed_forward]
    if not families:
        raise ValueError(
            f"BottleneckAdapters(placement={placement!r}): {type(model).__name__} is not a BERT-, GPT-2- or "
            f"Llama-style model (it lacks the sub-layer output projections: {_FAMILY_NAMES}), so placement cannot "
            "pick the modules. Name the output projections of its attention and feed-forward sub-layers with "
            f"target_modules instead. Modules it can take an adapter after: {describe_modules(model)}."
        )
    if len(families) > 1:
        raise ValueError(
            f"BottleneckAdapters(placement={placement!r}): {type(model).__name__} has the sub-layer names of "
            f"several families ({', '.join(families)}), so the placement is ambiguous. Name the modules with "
            "target_modules instead."
        )
    attention, feed_forward = found[families[0]]
    chosen = set(feed_forward) | (set(attention) if placement == "houlsby" else set())
    return [n for n in names if n in chosen]


def select(model: nn.Module, config: BottleneckConfig) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names; raises before anything is changed."""
    names = [n for n, _ in model.named_modules() if n]
    to_save = select_modules_to_save(model, config.modules_to_save, _WHO)
    if config.target_modules is None:
        chosen = _placement_targets(model, config.placement, names)
    else:
        chosen = chosen_by_name(_WHO, config.target_modules, names, model, describe_modules)
    chosen = [n for n in chosen if not inside(n, to_save)]
    if not chosen:
        refuse_no_target(_WHO, config.target_modules, model, "take an adapter after", describe_modules(model),
                         "bert.encoder.layer.0.output.dense")
    check_targets(model, chosen, "BottleneckAdapters")
    return chosen, to_save


def check_targets(model: nn.Module, chosen: list[str], who: str) -> None:
    """Raise if a module in ``chosen`` cannot take a bottleneck adapter (unknown output size, already wrapped)."""
    for name in chosen:
        module = model.get_submodule(name)
        if isinstance(module, ModulesToSave) or wraps_a_layer(module):
            owner = next((kind for kind, adapter in attached(model).items()
                          if any(t is p for t in adapter.state(model).values() for p in module.parameters())), None)
            wrapper = f"the {owner} adapter" if owner else "another technique"
            raise ValueError(
                f"{who}: {name!r} is already wrapped by {wrapper} "
                f"({type(module).__name__}); a bottleneck adapter around it would move that adapter's parameters. "
                "Inject the bottleneck adapters first (LoRA then adapts '<name>.base_layer'), or keep the other "
                "technique off this module."
            )
        if output_size(module) is None:
            raise TypeError(
                f"{who}: {name!r} is a {type(module).__name__}, whose output size is unknown; a bottleneck adapter "
                "follows a Linear, Conv1D or other module with an integer out_features (the output projection of a "
                f"sub-layer). {type(model).__name__} has: {describe_modules(model)}."
            )
