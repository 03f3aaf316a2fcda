"""Which modules LoRA adapts: target selection, checked before anything changes.

Target selection follows Hugging Face PEFT so that configs mean the same thing in both:

- ``target_modules`` as a list: a module matches if its full name equals an entry or ends with ``"." + entry``;
- as a string: a regular expression that must match the full module name (``re.fullmatch``);
- ``"all-linear"``: every ``nn.Linear`` / ``Conv1D`` except the output head (the model's output embeddings when
  it has them, else its last linear layer) and ``modules_to_save``. This differs from PEFT, which keeps a
  classifier head or a pooler in when no ``task_type`` is given; adapters are saved with the exact module
  names, so PEFT still adapts the same modules when it loads them;
- an ``nn.MultiheadAttention`` is adapted as a whole, as PEFT adapts it (`lightning_peft.peft.lora.mha`); the other
  children of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` are never adapted: those modules read
  their children's weights directly (the fused inference fast path), so an adapter there would be silently ignored;
- ``layers_to_transform`` (with ``layers_pattern``) keeps the list-matched modules of those layers
  (`lightning_peft.peft._common.layer_of` reads a module's layer as PEFT does);
- ``exclude_modules`` uses the same rules and wins over ``target_modules``;
- ``modules_to_save`` left at None on a Hugging Face task model (``*ForSequenceClassification``,
  ``*ForTokenClassification``, ``*ForQuestionAnswering``, ``*ForMultipleChoice``) saves its task head
  (``classifier`` / ``score`` / ``qa_outputs``), which ``from_pretrained`` created at random, as PEFT's task
  types do; ``modules_to_save=[]`` keeps it frozen;
- ``rank_pattern`` / ``alpha_pattern`` keys are regular expressions matched against the end of the name
  (``(.*\\.)?(key)$``); the first key that matches wins.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter

from torch import nn

from .._common import (
    Targets,
    all_linear,
    chosen_by_name,
    in_layers,
    inside,
    layer_of,
    matched,
    name_matches,
    pattern_matches,
    refuse_no_target,
    refuse_unmatched,
    refuse_wrapped,
    task_heads,
    unmatched,
    wraps_a_layer,
)
from ..adapter import attached
from ..modules_to_save import ModulesToSave
from ..trainable_tokens import TrainableTokensWrapper
from .config import LoRAConfig
from .conv import refuse_rank
from .layer import LAYER_TYPES, LoRALayer, linear_types, lora_layers
from .mha import refuse_unsupported as refuse_unsupported_attention
from .param import LoRAParameter
from .variants import refuse_unsupported as refuse_unsupported_dora

log = logging.getLogger("lightning_peft.peft.lora")

# Modules whose forward reads their children's weights directly instead of calling the children.
_READS_CHILD_WEIGHTS = (nn.MultiheadAttention, nn.TransformerEncoderLayer)
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def supported_types() -> tuple[type, ...]:
    """Module types [`inject_lora`][lightning_peft.peft.inject_lora] can adapt."""
    return (*linear_types(), nn.Embedding, *LAYER_TYPES)


def _supported_names() -> str:
    return ", ".join(t.__name__ for t in supported_types())


def _inside_fused(modules: dict[str, nn.Module]) -> dict[str, str]:
    """``{child name: parent type name}``: the children a fused module reads the weights of (an attention module
    inside a TransformerEncoderLayer is adapted as a whole, so it is not one of them)."""
    return {f"{n}.{c}" if n else c: type(m).__name__ for n, m in modules.items() if isinstance(m, _READS_CHILD_WEIGHTS)
            for c, child in m.named_children() if not isinstance(child, nn.MultiheadAttention)}


def _describe_modules(model: nn.Module) -> str:
    """'query, key, value (x6 each), ...' for error messages: leaf names of the adaptable modules."""
    modules = dict(model.named_modules())
    inside_fused = _inside_fused(modules)
    leaves = [n.rsplit(".", 1)[-1] for n, m in modules.items()
              if isinstance(m, supported_types()) and n not in inside_fused]
    if not leaves:
        return f"none (LoRA supports {_supported_names()}, and {type(model).__name__} has no such module)"
    return _tally(leaves)


def _tally(leaves: list[str], most: int | None = None) -> str:
    """'query, key (x6)': each name once, with its count (the first ``most`` names)."""
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in list(Counter(leaves).items())[:most])


def select_targets(model: nn.Module, config: LoRAConfig) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names; raises before anything is changed."""
    modules = adaptable_modules(model)
    names = [n for n in modules if n]
    to_save = _select_modules_to_save(model, config, names)
    inside_fused = _inside_fused(modules)
    if config.target_modules == "all-linear":
        chosen = [n for n in all_linear(model, modules, linear_types()) if n not in inside_fused]
    else:
        chosen = chosen_by_name("LoRA", config.target_modules, names, model, _describe_modules)
        if config.layers_to_transform is not None and chosen:
            chosen = in_layers("LoRA", chosen, config.target_modules, config.layers_to_transform,
                               config.layers_pattern, model)
    chosen = [n for n in chosen if not inside(n, to_save)]
    select_parameters(model, config, chosen)
    if not chosen and not config.target_parameters:
        refuse_no_target("LoRA", config.target_modules, model, "adapt", _describe_modules(model),
                         "bert.encoder.layer.0.attention.self.query")
    if config.exclude_modules is not None:
        _refuse_unmatched_exclusion(model, config.exclude_modules, names)
        kept = [n for n in chosen if not name_matches(n, config.exclude_modules)]
        if not kept:
            raise ValueError(
                f"LoRA(exclude_modules={config.exclude_modules!r}) excludes every module that "
                f"target_modules={config.target_modules!r} matched ({_preview(chosen)}), so nothing is left to "
                "adapt. Narrow exclude_modules."
            )
        chosen = kept
    _check_types(model, config, chosen, modules, inside_fused)
    _check_aliases(chosen, names, modules)
    return chosen, to_save


def adaptable_parameters(view: dict[str, nn.Module]) -> dict[str, tuple[str, str]]:
    """Every parameter of the modules of ``view`` (`adaptable_modules`): ``{full name: (module, parameter)}``."""
    return {f"{n}.{p}" if n else p: (n, p) for n, m in view.items() for p, v in m._parameters.items() if v is not None}


def select_parameters(model: nn.Module, config: LoRAConfig, modules: list[str] | None = None) -> list[tuple[str, str]]:
    """The ``(module, parameter)`` pairs ``config.target_parameters`` adapts, in the model's order (PEFT's rule: a
    parameter's full name equals an entry or ends with ``"." + entry``); raises before anything changes. ``modules``:
    the modules ``target_modules`` chose, which may not hold one of them."""
    wanted = config.target_parameters
    if not wanted:
        return []
    candidates = adaptable_parameters(adaptable_modules(model))
    chosen = {n: pair for n, pair in candidates.items() if name_matches(n, wanted)}
    missing = unmatched(wanted, chosen)
    if missing:
        listed = _tally([".".join(name.split(".")[-2:]) for name in candidates], 24)
        raise ValueError(
            f"LoRA(target_parameters={wanted!r}): {', '.join(map(repr, missing))} matched no parameter of "
            f"{type(model).__name__} (an entry matches a parameter whose full name equals it or ends with '.' + it). "
            f"Parameters it has: {listed or 'none'}."
        )
    for name, (module, _) in chosen.items():
        _check_parameter(model, config, name, module, modules or [])
    _refuse_narrowing(config, chosen)
    existing = {layer.target_name for layer in lora_layers(model).values() if isinstance(layer, LoRAParameter)}
    if existing and existing != set(chosen):
        raise ValueError(
            f"LoRA(target_parameters={wanted!r}) adapts {sorted(chosen)}, but the model's other adapters adapt "
            f"{sorted(existing)}; as in PEFT, every named adapter that sets target_parameters must adapt the same "
            "parameters (they share the wrappers). Give this adapter the same target_parameters."
        )
    return list(chosen.values())


def _check_parameter(model: nn.Module, config: LoRAConfig, name: str, module: str, modules: list[str]) -> None:
    holder = model.get_submodule(module) if module else model
    dims = getattr(holder, name.rpartition(".")[2]).dim()
    if not module:
        raise ValueError(f"LoRA(target_parameters={config.target_parameters!r}): {name!r} belongs to "
                         f"{type(model).__name__} itself; only a submodule's parameter can be wrapped (PEFT refuses "
                         "too). Move it into a submodule.")
    if dims not in (2, 3):
        raise TypeError(f"LoRA(target_parameters={config.target_parameters!r}): {name!r} has {dims} dimension(s); "
                        "LoRA adapts 2-D (out, in) and 3-D (experts, ...) parameters, as PEFT.")
    if module in modules or (isinstance(holder, LoRALayer) and not isinstance(holder, LoRAParameter)):
        raise ValueError(
            f"LoRA(target_modules={config.target_modules!r}, target_parameters={config.target_parameters!r}): "
            f"{module!r} would be adapted twice, as a module and through its parameter {name!r}. Adapt it one way: "
            "leave it out of target_modules (target_modules=[] adapts the parameters only) or of target_parameters."
        )


def _refuse_narrowing(config: LoRAConfig, chosen: dict[str, tuple[str, str]]) -> None:
    """``layers_to_transform`` / ``layers_pattern`` and ``exclude_modules`` narrow ``target_modules`` only (PEFT adapts
    ``target_parameters`` regardless): a parameter a suffix entry matched that they leave out is refused, not adapted
    against the user's word; a full name is a choice made on purpose."""
    layers, pattern, exclude = config.layers_to_transform, config.layers_pattern, config.exclude_modules
    wanted = [layers] if isinstance(layers, int) else layers
    for name, (module, _) in ((n, pair) for n, pair in chosen.items() if n not in config.target_parameters):
        where = layer_of(name, pattern) if wanted is not None else None
        given = (f"layers_to_transform={layers!r}" + ("" if pattern is None else f", layers_pattern={pattern!r}")
                 if wanted is not None and (where is None or where[1] not in wanted) else f"exclude_modules={exclude!r}"
                 if exclude and (name_matches(module, exclude) or name_matches(name, exclude)) else "")
        if given:
            arg = given.partition("=")[0]
            raise ValueError(
                f"LoRA(target_parameters={config.target_parameters!r}, {given}): {name!r} is outside what {arg} keeps, "
                f"but {arg} narrows target_modules only: PEFT adapts target_parameters regardless of it, so this would "
                f"adapt it anyway. Name the parameters to adapt in full in target_parameters, e.g. [{name!r}] (a full "
                f"name is adapted as given), or drop {arg}.")


def _refuse_unmatched_exclusion(model: nn.Module, exclude: Targets, names: list[str]) -> None:
    """A typo in ``exclude_modules`` would silently adapt what it meant to keep out: every list entry, and a regular
    expression, must match some module."""
    refuse_unmatched("LoRA", exclude, names, model, _describe_modules, what="exclude_modules")
    if isinstance(exclude, str) and matched(exclude, names) is None:
        raise ValueError(
            f"LoRA(exclude_modules={exclude!r}): the regular expression matches no module name of "
            f"{type(model).__name__} (it must match a full name, e.g. {_preview(names)}). Fix it, or leave "
            "exclude_modules out."
        )


def adaptable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``model.named_modules()`` as a new adapter sees it: a LoRA layer stands for its base module (so another
    adapter can target it) and the insides of LoRA layers, ``modules_to_save`` and trainable-tokens wrappers are
    hidden."""
    view: dict[str, nn.Module] = {}
    hidden: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if any(name.startswith(h) for h in hidden):
            continue
        if isinstance(module, LoRALayer):
            while isinstance(module, LoRALayer):  # parameter wrappers nest (lora.param)
                module = module.base_layer
            view[name] = module
            hidden.append(f"{name}.")
        else:
            view[name] = module
            if isinstance(module, (ModulesToSave, TrainableTokensWrapper)):
                hidden.append(f"{name}.")
    return view


def _select_modules_to_save(model: nn.Module, config: LoRAConfig, names: list[str]) -> list[str]:
    spec = attached(model).get("lora")
    ours = set(spec.modules_to_save) if spec is not None else set()
    if config.modules_to_save is None:
        # A head another technique already trains in full (a ModulesToSave wrapper) stays that technique's.
        heads = [h for h in task_heads(model) if h in ours or not isinstance(model.get_submodule(h), ModulesToSave)]
        if heads:
            log.info(
                "LoRA: %s's task head %s is trained and saved in full (modules_to_save); from_pretrained creates "
                "it at random. Pass modules_to_save=[] to keep it frozen.", type(model).__name__, heads,
            )
        return heads
    to_save = [n for n in names if name_matches(n, config.modules_to_save)]
    missing = [m for m in config.modules_to_save if not any(name_matches(n, [m]) for n in to_save)]
    if missing:
        raise ValueError(
            f"LoRA(modules_to_save={config.modules_to_save!r}): {missing} matched no module of "
            f"{type(model).__name__}. Check the names with model.named_modules()."
        )
    taken = [n for n in to_save if n not in ours and isinstance(model.get_submodule(n), ModulesToSave)]
    if taken:
        raise ValueError(
            f"LoRA(modules_to_save={config.modules_to_save!r}): {taken[0]!r} is already trained in full by another "
            "technique on this model (its modules_to_save); leave it out here, it trains and is saved once."
        )
    # A module inside another saved module is saved with it.
    return [n for n in to_save if not any(n.startswith(f"{o}.") for o in to_save)]


def _preview(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _check_types(model, config, chosen, modules, inside_fused) -> None:
    for name in chosen:  # another technique's layer (IA³'s, VeRA's, ...): not a type problem, a refusal of its own
        if wraps_a_layer(modules[name]):
            refuse_wrapped("LoRA", "LoRA", name, modules[name])
    unsupported = [n for n in chosen if not isinstance(modules[n], supported_types())]
    if unsupported:
        kinds = sorted({type(modules[n]).__name__ for n in unsupported})
        raise TypeError(
            f"LoRA(target_modules={config.target_modules!r}) matched {unsupported[0]!r} of type {kinds[0]}"
            f"{' and others' if len(unsupported) > 1 else ''}; LoRA supports {_supported_names()}. "
            f"Name modules of those types instead; {type(model).__name__} has: {_describe_modules(model)}."
        )
    for name in chosen:
        module = modules[name]
        if name in inside_fused:
            parent = name.rpartition(".")[0]
            fix = (f"Target the attention module itself ({parent!r}): LoRA adapts its in- "
                   "and out-projections together, as PEFT does" if inside_fused[name] == "MultiheadAttention" else
                   "Exclude it (exclude_modules), or build the block from separate Linear layers")
            raise TypeError(
                f"LoRA(target_modules={config.target_modules!r}) matched {name!r}, which belongs to an "
                f"nn.{inside_fused[name]}: that module reads its children's weights directly (fused fast path), so "
                f"an adapter there would be silently ignored. {fix}."
            )
        if getattr(module, "groups", 1) > 1:
            refuse_rank("LoRA", name, module, config.rank_for(name))
        if config.lora_bias and isinstance(module, nn.Embedding):
            raise TypeError(f"LoRA(lora_bias=True): {name!r} is an Embedding, which PEFT's lora_bias does not "
                            f"support; exclude it (exclude_modules=[{name!r}]) or set lora_bias=False.")
    refuse_unsupported_attention(chosen, modules, config)
    if config.use_dora:
        refuse_unsupported_dora("LoRA", chosen, modules, (*linear_types(), nn.Embedding, *_CONVOLUTIONS))


def _check_aliases(chosen: list[str], names: list[str], modules: dict[str, nn.Module]) -> None:
    """A module registered under two names would be adapted under one and called bare under the other."""
    paths: dict[int, list[str]] = {}
    for name in names:
        paths.setdefault(id(modules[name]), []).append(name)
    for name in chosen:
        aliases = paths[id(modules[name])]
        if len(aliases) > 1:
            raise ValueError(
                f"LoRA: the module at {name!r} is also registered as {[a for a in aliases if a != name]}; "
                "an adapter would apply under one name only. Register the module once, or untie it first."
            )


def warn_about_settings(model: nn.Module, config: LoRAConfig, targets: list[str]) -> None:
    """Settings that are valid but almost surely not what the user meant."""
    named = targets + [f"{m}.{p}" for m, p in select_parameters(model, config)]  # patterns match parameters' names
    for what, patterns in (("rank_pattern", config.rank_pattern), ("alpha_pattern", config.alpha_pattern)):
        for key in patterns:
            if not any(pattern_matches(key, n) for n in named):
                warnings.warn(
                    f"LoRA({what}={{{key!r}: ...}}) matches none of the {len(named)} adapted modules "
                    f"(e.g. {_preview(named)}), so it changes nothing. Keys match the end of a module name.",
                    UserWarning, stacklevel=4,
                )
    too_big = []
    for name in targets:
        limit = _max_rank(model.get_submodule(name))
        if config.rank_for(name) > limit:
            too_big.append(f"{name!r} (rank {config.rank_for(name)} > {limit})")
    if too_big:
        warnings.warn(
            f"LoRA: the rank exceeds what {len(too_big)} layer(s) can use: {', '.join(too_big[:3])}"
            f"{' ...' if len(too_big) > 3 else ''}. An update of such a layer has rank at most min(in, out), so the "
            "extra rank costs memory and time for nothing; lower rank or use rank_pattern.",
            UserWarning, stacklevel=4,
        )
    biasless = [n for n in targets if config.lora_bias and _base(model.get_submodule(n)).bias is None]
    if biasless:  # as PEFT warns
        warnings.warn(f"LoRA(lora_bias=True): {_preview(biasless)} have no bias, so merging this adapter into them "
                      "will be refused (the base has no bias to take B's).", UserWarning, stacklevel=4)


def _base(module: nn.Module) -> nn.Module:
    return module.base_layer if isinstance(module, LoRALayer) else module


def _max_rank(module: nn.Module) -> int:
    module = _base(module)
    if isinstance(module, nn.MultiheadAttention):  # both projections take (E,) inputs
        return module.embed_dim
    if isinstance(module, nn.Linear):  # its sizes: a quantized weight may be packed (bitsandbytes' 4-bit)
        return min(module.in_features, module.out_features)
    weight = module.weight  # Conv1D (in, out), Embedding (V, d), ConvNd (out, in / groups, *kernel)
    return min(weight.shape[0], weight[0].numel())
