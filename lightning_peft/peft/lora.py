"""LoRA on a whole model: choose targets, wrap them, freeze the rest, merge, and read the adapter state.

Paper: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685
(the layer math and shapes are in :mod:`lightning_peft.peft.layers`).

Target selection follows Hugging Face PEFT so that configs mean the same thing in both:

- ``target_modules`` as a list: a module matches if its full name equals an entry or ends with ``"." + entry``;
- as a string: a regular expression that must match the full module name (``re.fullmatch``);
- ``"all-linear"``: every ``nn.Linear`` / ``Conv1D`` except the output head (the model's output embeddings when
  it has them, else its last linear layer) and ``modules_to_save``. This differs from PEFT, which keeps a
  classifier head or a pooler in when no ``task_type`` is given; adapters are saved with the exact module
  names, so PEFT still adapts the same modules when it loads them;
- the children of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` are never adapted: those
  modules read their children's weights directly (the fused inference fast path), so an adapter there would
  be silently ignored;
- ``exclude_modules`` uses the same rules and wins over ``target_modules``;
- ``rank_pattern`` / ``alpha_pattern`` keys are regular expressions matched against the end of the name
  (``(.*\\.)?(key)$``); the first key that matches wins.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_peft.peft import inject_lora, trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> sorted(inject_lora(model, rank=2, target_modules=["0"]))
    ['0']
    >>> trainable_parameters(model).trainable
    32
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from .layers import Init, LoRAConv2d, LoRAEmbedding, LoRALayer, LoRALinear, conv1d_type

log = logging.getLogger(__name__)

Bias = Literal["none", "lora_only", "all"]
Targets = list[str] | str

SPEC_ATTRIBUTE = "_lightning_peft_lora"
# Modules whose forward reads their children's weights directly instead of calling the children.
_READS_CHILD_WEIGHTS = (nn.MultiheadAttention, nn.TransformerEncoderLayer)


@dataclass(frozen=True)
class LoRAConfig:
    """What to adapt and how. Validated on construction.

    Args:
        rank: Rank ``r`` of every update (unless ``rank_pattern`` says otherwise).
        alpha: The update is scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``).
        dropout: Dropout probability on the adapter input, in [0, 1).
        target_modules: Which modules get an adapter (list of names/suffixes, a regex, or ``"all-linear"``).
        exclude_modules: Modules never adapted, same rules as ``target_modules``.
        modules_to_save: Modules trained and saved in full (e.g. a new classifier head), names or suffixes.
        rank_pattern: Per-module rank overrides, ``{regex: rank}``.
        alpha_pattern: Per-module alpha overrides, ``{regex: alpha}``.
        bias: Which biases train: ``"none"``, ``"lora_only"`` (those of adapted layers) or ``"all"``.
        init: ``"kaiming"`` (Kaiming-uniform ``A``, ``B = 0``) or ``"gaussian"`` (``A ~ N(0, 1/r)``, ``B = 0``).
        use_rslora: Rank-stabilised scaling.
    """

    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: Targets = "all-linear"
    exclude_modules: Targets | None = None
    modules_to_save: list[str] | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    bias: Bias = "none"
    init: Init = "kaiming"
    use_rslora: bool = False

    def __post_init__(self) -> None:
        _check_rank(self.rank, "rank")
        _check_alpha(self.alpha, "alpha")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA(dropout={self.dropout!r}): dropout must be a probability in [0, 1).")
        _check_targets(self.target_modules, "target_modules")
        if self.exclude_modules is not None:
            _check_targets(self.exclude_modules, "exclude_modules")
        if self.modules_to_save is not None and (
            isinstance(self.modules_to_save, str) or not all(isinstance(m, str) for m in self.modules_to_save)
        ):
            raise TypeError(
                f"LoRA(modules_to_save={self.modules_to_save!r}): give a list of module names, e.g. ['classifier']."
            )
        for key, value in self.rank_pattern.items():
            _check_pattern(key, "rank_pattern")
            _check_rank(value, f"rank_pattern[{key!r}]")
        for key, value in self.alpha_pattern.items():
            _check_pattern(key, "alpha_pattern")
            _check_alpha(value, f"alpha_pattern[{key!r}]")
        if self.bias not in ("none", "lora_only", "all"):
            raise ValueError(f"LoRA(bias={self.bias!r}): bias must be 'none', 'lora_only' or 'all'.")
        if self.init not in ("kaiming", "gaussian"):
            raise ValueError(f"LoRA(init={self.init!r}): init must be 'kaiming' or 'gaussian'.")
        # Frozen dataclass: normalise list-likes to lists without mutating the caller's objects.
        if not isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", list(self.target_modules))

    def rank_for(self, name: str) -> int:
        return _pattern_value(self.rank_pattern, name, self.rank)

    def alpha_for(self, name: str) -> float:
        return _pattern_value(self.alpha_pattern, name, self.alpha)


@dataclass(frozen=True)
class LoRASpec:
    """What :func:`inject_lora` did to a model: kept on the model so that saving knows the adapter's layout."""

    config: LoRAConfig
    targets: tuple[str, ...]
    modules_to_save: tuple[str, ...]


@dataclass(frozen=True)
class ParameterReport:
    """Trainable-parameter count of a model (shared parameters counted once)."""

    trainable: int
    total: int

    @property
    def percent(self) -> float:
        return 100.0 * self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        return f"trainable params: {self.trainable:,} || all params: {self.total:,} || trainable: {self.percent:.4f}%"


def _check_rank(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"LoRA({what}={value!r}): rank must be a positive integer.")


def _check_alpha(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"LoRA({what}={value!r}): alpha must be a positive, finite number.")


def _check_pattern(key: object, what: str) -> None:
    if not isinstance(key, str):
        raise TypeError(f"LoRA({what}={{{key!r}: ...}}): keys must be strings (regular expressions).")
    try:
        re.compile(key)
    except re.error as err:
        raise ValueError(f"LoRA({what}={{{key!r}: ...}}): the key is not a valid regular expression: {err}.") from None


def _check_targets(value: object, what: str) -> None:
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"LoRA({what}={value!r}) is not a valid regular expression: {err}.") from None
        return
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
        raise TypeError(
            f"LoRA({what}={value!r}): give a non-empty list of module names (e.g. ['query', 'value']), "
            "a regular expression string, or 'all-linear'."
        )


def _pattern_value(patterns: dict, name: str, default):
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def name_matches(name: str, targets: Targets) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _linear_types() -> tuple[type, ...]:
    conv1d = conv1d_type()
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)


def supported_types() -> tuple[type, ...]:
    """Module types :func:`inject_lora` can adapt."""
    return (*_linear_types(), nn.Embedding, nn.Conv2d)


def _output_head(model: nn.Module) -> str | None:
    """Name of the output head that ``"all-linear"`` leaves alone."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(head, nn.Module) and id(head) in names:
        return names[id(head)]
    linears = [n for n, m in model.named_modules() if isinstance(m, _linear_types())]
    return linears[-1] if linears else None


def _describe_modules(model: nn.Module) -> str:
    """'query, key, value (x6 each), ...' for error messages: leaf names of the adaptable modules."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, supported_types()):
            leaf = name.rsplit(".", 1)[-1]
            counts[leaf] = counts.get(leaf, 0) + 1
    if not counts:
        return "none"
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items())


def _select(model: nn.Module, config: LoRAConfig) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names; raises before anything is changed."""
    modules = dict(model.named_modules(remove_duplicate=False))
    names = [n for n in modules if n]
    to_save = [n for n in names if config.modules_to_save and name_matches(n, config.modules_to_save)]
    if config.modules_to_save:
        missing = [m for m in config.modules_to_save if not any(name_matches(n, [m]) for n in to_save)]
        if missing:
            raise ValueError(
                f"LoRA(modules_to_save={config.modules_to_save!r}): {missing} matched no module of "
                f"{type(model).__name__}. Check the names with model.named_modules()."
            )

    def saved(name: str) -> bool:
        return any(name == s or name.startswith(f"{s}.") for s in to_save)

    inside_fused = {f"{n}.{c}" if n else c: type(m).__name__ for n, m in modules.items()
                    if isinstance(m, _READS_CHILD_WEIGHTS) for c, _ in m.named_children()}
    if config.target_modules == "all-linear":
        head = _output_head(model)
        linear = _linear_types()
        chosen = [n for n in names if isinstance(modules[n], linear) and n != head and n not in inside_fused]
    else:
        chosen = [n for n in names if name_matches(n, config.target_modules)]
    chosen = [n for n in chosen if not saved(n)]
    if config.exclude_modules is not None:
        chosen = [n for n in chosen if not name_matches(n, config.exclude_modules)]
    if not chosen:
        raise ValueError(
            f"LoRA(target_modules={config.target_modules!r}) matched no module of {type(model).__name__}. "
            f"Modules it can adapt: {_describe_modules(model)}."
        )
    unsupported = [n for n in chosen if not isinstance(modules[n], supported_types())]
    if unsupported:
        kinds = sorted({type(modules[n]).__name__ for n in unsupported})
        raise TypeError(
            f"LoRA(target_modules={config.target_modules!r}) matched {unsupported[0]!r} of type {kinds[0]}"
            f"{' and others' if len(unsupported) > 1 else ''}; LoRA supports "
            f"{', '.join(t.__name__ for t in supported_types())}. Name the linear layers inside it instead "
            f"(it can adapt: {_describe_modules(model)})."
        )
    _check_aliases(chosen, names, modules)
    for name in chosen:
        module = modules[name]
        if name in inside_fused:
            raise TypeError(
                f"LoRA: {name!r} belongs to an nn.{inside_fused[name]}, which reads its children's weights directly "
                "(fused fast path), so an adapter there would be silently ignored. Exclude it (exclude_modules), "
                "or build the block from separate Linear layers."
            )
        if isinstance(module, nn.Conv2d) and module.groups != 1:
            raise TypeError(f"LoRA: {name!r} is a grouped Conv2d (groups={module.groups}); only groups=1 is supported.")
    return chosen, to_save


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


def _make_layer(module: nn.Module, name: str, config: LoRAConfig) -> LoRALayer:
    kwargs = {
        "rank": config.rank_for(name),
        "alpha": config.alpha_for(name),
        "dropout": config.dropout,
        "use_rslora": config.use_rslora,
        "init": config.init,
    }
    if isinstance(module, nn.Embedding):
        return LoRAEmbedding(module, **kwargs)
    if isinstance(module, nn.Conv2d):
        return LoRAConv2d(module, **kwargs)
    return LoRALinear(module, **kwargs)


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, module)


def lora_layers(model: nn.Module) -> dict[str, LoRALayer]:
    """All LoRA layers of ``model`` by full module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALayer)}


def lora_spec(model: nn.Module) -> LoRASpec | None:
    """The :class:`LoRASpec` :func:`inject_lora` left on ``model``, or None."""
    return getattr(model, SPEC_ATTRIBUTE, None)


def inject_lora(model: nn.Module, config: LoRAConfig | None = None, **kwargs) -> dict[str, LoRALayer]:
    """Wrap the target modules of ``model`` in LoRA layers, in place, and freeze everything else.

    After the call only the adapters, the chosen biases and ``modules_to_save`` have ``requires_grad=True``.
    Nothing is changed if an error is raised.

    Args:
        model: The model to adapt (any ``nn.Module``; for a Hugging Face model pass the ``PreTrainedModel``).
        config: A :class:`LoRAConfig`; or give its fields as keyword arguments instead.

    Returns:
        The new LoRA layers by full module name.

    Raises:
        RuntimeError: If ``model`` already has LoRA layers.
        ValueError: If the targets match nothing or a setting is invalid.
        TypeError: If a target is of a type LoRA cannot adapt.
    """
    if config is None:
        config = LoRAConfig(**kwargs)
    elif kwargs:
        raise TypeError(f"inject_lora: pass either config or keyword arguments, not both (got {sorted(kwargs)}).")
    existing = lora_layers(model)
    if existing:
        raise RuntimeError(
            f"inject_lora: {type(model).__name__} already has {len(existing)} LoRA layers "
            f"(e.g. {next(iter(existing))!r}); LoRA was injected twice. Use the model as it is, or build a fresh one."
        )
    targets, to_save = _select(model, config)
    model.requires_grad_(False)
    replaced = {}
    for name in targets:
        base = model.get_submodule(name)
        layer = _make_layer(base, name, config).train(base.training)  # an eval model gets eval adapters
        set_submodule(model, name, layer)
        replaced[name] = layer
    for param in trainable_state(model, config.bias, to_save, replaced).values():
        param.requires_grad_(True)
    setattr(model, SPEC_ATTRIBUTE, LoRASpec(config, tuple(targets), tuple(to_save)))
    log.info("LoRA: adapted %d modules of %s; %s", len(replaced), type(model).__name__, trainable_parameters(model))
    return replaced


def trainable_state(
    model: nn.Module, bias: Bias, modules_to_save: Iterable[str], layers: dict[str, LoRALayer]
) -> dict[str, Tensor]:
    """Parameters (and ``modules_to_save`` buffers) that make up the adapter, by state-dict key."""
    state: dict[str, Tensor] = {}
    for name, layer in layers.items():
        state.update({f"{name}.{k}": p for k, p in layer.adapter_parameters().items()})
        if bias == "lora_only" and getattr(layer.base_layer, "bias", None) is not None:
            state[f"{name}.base_layer.bias"] = layer.base_layer.bias
    if bias == "all":
        for name, module in model.named_modules():
            if module._parameters.get("bias") is not None:
                state[f"{name}.bias" if name else "bias"] = module._parameters["bias"]
    for name in modules_to_save:
        state.update(model.get_submodule(name).state_dict(prefix=f"{name}.", keep_vars=True))
    return state


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter of a model adapted by :func:`inject_lora`: LoRA weights, chosen biases, ``modules_to_save``.

    Keys are the model's own state-dict keys (``encoder.0.query.lora_A.weight``); values are detached.

    Raises:
        RuntimeError: If ``model`` has no LoRA adapter.
    """
    spec = require_spec(model, "adapter_state_dict")
    state = trainable_state(model, spec.config.bias, spec.modules_to_save, lora_layers(model))
    return {k: v.detach() for k, v in state.items()}


def require_spec(model: nn.Module, who: str) -> LoRASpec:
    spec = lora_spec(model)
    if spec is None:
        raise RuntimeError(f"{who}: {type(model).__name__} has no LoRA adapter; call inject_lora(model, ...) first.")
    return spec


def merge_lora(model: nn.Module) -> list[str]:
    """Add every adapter's update into its base weight, in place.

    Idempotent: layers already merged are left alone. Each merge is computed in float32 (or wider) and
    cast back to the weight's dtype. If a merged weight would be non-finite, the layers merged by this
    call are unmerged again and a ``RuntimeError`` names the layer. A weight tied to another module
    (e.g. input and output embeddings) is refused before anything changes.

    Returns:
        Names of the layers this call merged.
    """
    layers = lora_layers(model)
    _refuse_tied(model, layers)
    done: list[str] = []
    for name, layer in layers.items():
        if layer.merged:
            continue
        try:
            layer.merge()
        except RuntimeError as err:
            for merged_name in reversed(done):
                model.get_submodule(merged_name).unmerge()
            raise RuntimeError(f"merge_lora: layer {name!r}: {err}") from None
        done.append(name)
    return done


def _refuse_tied(model: nn.Module, layers: dict[str, LoRALayer]) -> None:
    """Merging in place into a weight shared with another module would change that module too."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for name, layer in layers.items():
        if layer.merged:
            continue
        others = [o for o in owners.get(id(layer.base_layer.weight), []) if not o.startswith(f"{name}.")]
        if others:
            raise RuntimeError(
                f"merge_lora: the weight of {name!r} is tied to {others[0]!r}; merging in place would change both. "
                "Use merged_state_dict(model) for an export (it keeps them apart), or untie the weights first."
            )


def unmerge_lora(model: nn.Module) -> list[str]:
    """Subtract every merged adapter's update from its base weight, in place.

    Raises:
        RuntimeError: If no layer is merged.

    Returns:
        Names of the layers unmerged.
    """
    merged = [name for name, layer in lora_layers(model).items() if layer.merged]
    if not merged:
        raise RuntimeError(f"unmerge_lora: no LoRA layer of {type(model).__name__} is merged; call merge_lora first.")
    for name in merged:
        model.get_submodule(name).unmerge()
    return merged


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of the base model with every adapter merged in, under the base model's own key names.

    Does not change ``model``: the merged weights are new tensors. Loading the result into a fresh copy of
    the original (un-adapted) model gives the merged model. A weight tied to another module gets the merged
    value under the adapted module's key only, as the adapted model computes.

    Raises:
        RuntimeError: If a merged weight would be non-finite.
    """
    state = model.state_dict()
    for name, layer in lora_layers(model).items():
        for key in layer.adapter_parameters():
            state.pop(f"{name}.{key}")
        prefix = f"{name}.base_layer."
        for key in [k for k in state if k.startswith(prefix)]:
            state[f"{name}.{key[len(prefix):]}"] = state.pop(key)
        try:
            state[f"{name}.weight"] = layer.merged_weight()
        except RuntimeError as err:
            raise RuntimeError(f"merged_state_dict: layer {name!r}: {err}") from None
    return state


def trainable_parameters(model: nn.Module) -> ParameterReport:
    """Count trainable and total parameters (each shared tensor once)."""
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in seen.values())
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    return ParameterReport(trainable=trainable, total=total)
