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
- ``modules_to_save`` left at None on a Hugging Face task model (``*ForSequenceClassification``,
  ``*ForTokenClassification``, ``*ForQuestionAnswering``, ``*ForMultipleChoice``) saves its task head
  (``classifier`` / ``score`` / ``qa_outputs``), which ``from_pretrained`` created at random, as PEFT's task
  types do; ``modules_to_save=[]`` keeps it frozen;
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

import dataclasses
import logging
import math
import numbers
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from torch import Tensor, nn

from ._common import name_matches, pattern_matches, refuse_unmatched, task_heads, unmatched  # noqa: F401
from .adapter import Adapter, ParameterReport, attach, attached, base_model_name, clean_key, detach, register, remove_adapter, trainable_parameters, unwrap  # noqa: F401
from .layers import DEFAULT, Init, LoRAConv2d, LoRAEmbedding, LoRALayer, LoRALinear, Routing, conv1d_type
from .modules_to_save import ModulesToSave, fold_modules_to_save, plain_key, set_submodule, wrap_modules_to_save

log = logging.getLogger(__name__)

Bias = Literal["none", "lora_only", "all"]
Targets = list[str] | str

# Modules whose forward reads their children's weights directly instead of calling the children.
_READS_CHILD_WEIGHTS = (nn.MultiheadAttention, nn.TransformerEncoderLayer)
# Hugging Face PEFT's names for our arguments: a user who types them is told ours.
_PEFT_NAMES = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "init_lora_weights": "init"}


@dataclass(frozen=True)
class LoRAConfig:
    """What to adapt and how. Validated on construction.

    Args:
        rank: Rank ``r`` of every update (unless ``rank_pattern`` says otherwise).
        alpha: The update is scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``).
        dropout: Dropout probability on the adapter input, in [0, 1).
        target_modules: Which modules get an adapter (list or set of names/suffixes, a regex, or ``"all-linear"``).
        exclude_modules: Modules never adapted, same rules as ``target_modules``.
        modules_to_save: Modules trained and saved in full (e.g. a new classifier head), names or suffixes.
            None: a Hugging Face task model's head (see the module docstring); ``[]``: none.
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
        # Frozen dataclass: normalised values are set with object.__setattr__; the caller's objects are not mutated.
        normal = object.__setattr__
        normal(self, "rank", _as_rank(self.rank, "rank"))
        normal(self, "alpha", _as_alpha(self.alpha, "alpha"))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real):
            raise TypeError(f"LoRA(dropout={self.dropout!r}): dropout must be a number in [0, 1), e.g. 0.1.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA(dropout={self.dropout!r}): dropout must be a probability in [0, 1).")
        normal(self, "dropout", float(self.dropout))
        normal(self, "target_modules", _as_targets(self.target_modules, "target_modules"))
        if self.exclude_modules is not None:
            normal(self, "exclude_modules", _as_targets(self.exclude_modules, "exclude_modules"))
        if self.modules_to_save is not None:
            names = self.modules_to_save
            if isinstance(names, str) or not isinstance(names, Iterable) or not all(isinstance(m, str) for m in names):
                raise TypeError(
                    f"LoRA(modules_to_save={names!r}): give a list of module names, e.g. ['classifier']."
                )
            normal(self, "modules_to_save", sorted(names) if isinstance(names, (set, frozenset)) else list(names))
        for what, patterns, check in (("rank_pattern", self.rank_pattern, _as_rank),
                                      ("alpha_pattern", self.alpha_pattern, _as_alpha)):
            if not isinstance(patterns, dict):
                raise TypeError(f"LoRA({what}={patterns!r}): give a dict {{regex: value}}, e.g. {{'query': 16}}.")
            for key in patterns:
                _check_pattern(key, what)
            normal(self, what, {k: check(v, f"{what}[{k!r}]") for k, v in patterns.items()})
        if self.bias not in ("none", "lora_only", "all"):
            raise ValueError(f"LoRA(bias={self.bias!r}): bias must be 'none', 'lora_only' or 'all'.")
        if self.init not in ("kaiming", "gaussian"):
            raise ValueError(f"LoRA(init={self.init!r}): init must be 'kaiming' or 'gaussian'.")
        if not isinstance(self.use_rslora, bool):
            raise TypeError(f"LoRA(use_rslora={self.use_rslora!r}): use_rslora must be True or False.")

    def rank_for(self, name: str) -> int:
        return _pattern_value(self.rank_pattern, name, self.rank)

    def alpha_for(self, name: str) -> float:
        return _pattern_value(self.alpha_pattern, name, self.alpha)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``LoRAConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_peft(cls, config: Any, source: str = "peft.LoraConfig") -> LoRAConfig:
        """Translate a Hugging Face PEFT ``LoraConfig`` (object or dict) to a :class:`LoRAConfig`.

        Raises:
            ValueError: If the config uses a PEFT feature lightning-peft does not implement (named in the message).
        """
        if not isinstance(config, dict):
            config = config.to_dict()
        return config_from_peft(config, source, who="inject_lora")


def _as_rank(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"LoRA({what}={value!r}): rank must be a positive integer, e.g. 8.")
    if value <= 0:
        raise ValueError(f"LoRA({what}={value!r}): rank must be a positive integer.")
    return int(value)


def _as_alpha(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"LoRA({what}={value!r}): alpha must be a positive, finite number, e.g. 16.")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"LoRA({what}={value!r}): alpha must be a positive, finite number.")
    return float(value) if not isinstance(value, int) else value


def _check_pattern(key: object, what: str) -> None:
    if not isinstance(key, str):
        raise TypeError(f"LoRA({what}={{{key!r}: ...}}): keys must be strings (regular expressions).")
    try:
        re.compile(key)
    except re.error as err:
        raise ValueError(f"LoRA({what}={{{key!r}: ...}}): the key is not a valid regular expression: {err}.") from None


def _as_targets(value: object, what: str) -> Targets:
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"LoRA({what}={value!r}) is not a valid regular expression: {err}.") from None
        return value
    if isinstance(value, (list, tuple, set, frozenset)) and value and all(isinstance(v, str) for v in value):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    raise TypeError(
        f"LoRA({what}={value!r}): give a non-empty list of module names (e.g. ['query', 'value']), "
        "a regular expression string, or 'all-linear'."
    )


def as_config(config: object, kwargs: dict[str, Any], who: str) -> LoRAConfig:
    """A :class:`LoRAConfig` from a config object (ours or PEFT's ``LoraConfig``) or keyword arguments."""
    peft_names = {k: _PEFT_NAMES[k] for k in kwargs if k in _PEFT_NAMES}
    if peft_names:
        key, ours = next(iter(peft_names.items()))
        raise TypeError(
            f"{who}({key}={kwargs[key]!r}): lightning-peft calls this argument {ours!r}; pass {ours}={kwargs[key]!r} "
            "(Hugging Face PEFT's names map as r -> rank, lora_alpha -> alpha, lora_dropout -> dropout, "
            f"init_lora_weights -> init){', or pass a peft.LoraConfig as config' if who == 'inject_lora' else ''}."
        )
    if config is None:
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(LoRAConfig)})
        if unknown:
            raise TypeError(
                f"{who}: unknown argument {unknown[0]!r}; LoRA takes "
                f"{', '.join(f.name for f in dataclasses.fields(LoRAConfig))}."
            )
        return LoRAConfig(**kwargs)
    if kwargs:
        raise TypeError(f"{who}: pass either config or keyword arguments, not both (got {sorted(kwargs)}).")
    if isinstance(config, LoRAConfig):
        return config
    if type(config).__name__ == "LoraConfig" and callable(getattr(config, "to_dict", None)):
        return LoRAConfig.from_peft(config)
    raise TypeError(
        f"{who}(config={type(config).__name__}): give a lightning_peft LoRAConfig or a peft.LoraConfig, "
        "or the fields as keyword arguments."
    )


def _pattern_value(patterns: dict, name: str, default):
    for key, value in patterns.items():
        if pattern_matches(key, name):
            return value
    return default


def _linear_types() -> tuple[type, ...]:
    conv1d = conv1d_type()
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)


def supported_types() -> tuple[type, ...]:
    """Module types :func:`inject_lora` can adapt."""
    return (*_linear_types(), nn.Embedding, nn.Conv2d)


def _supported_names() -> str:
    return ", ".join(t.__name__ for t in supported_types())


def _output_head(model: nn.Module) -> str | None:
    """Name of the output head that ``"all-linear"`` leaves alone."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    view = _adaptable_view(model)
    names = {id(m): n for n, m in view.items()}
    if isinstance(head, nn.Module) and id(head) in names:
        return names[id(head)]
    linears = [n for n, m in view.items() if isinstance(m, _linear_types())]
    return linears[-1] if linears else None


def _describe_modules(model: nn.Module) -> str:
    """'query, key, value (x6 each), ...' for error messages: leaf names of the adaptable modules."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, supported_types()):
            leaf = name.rsplit(".", 1)[-1]
            counts[leaf] = counts.get(leaf, 0) + 1
    if not counts:
        return f"none (LoRA supports {_supported_names()}, and {type(model).__name__} has no such module)"
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items())


def _select(model: nn.Module, config: LoRAConfig) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names; raises before anything is changed."""
    modules = _adaptable_view(model)
    names = [n for n in modules if n]
    to_save = _select_modules_to_save(model, config, names)

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
        if chosen:
            refuse_unmatched("LoRA", config.target_modules, names, model, _describe_modules)
    chosen = [n for n in chosen if not saved(n)]
    if not chosen:
        hint = ""
        if isinstance(config.target_modules, str) and config.target_modules != "all-linear":
            hint = (f" A string is a regular expression that must match the full module name "
                    f"(e.g. 'bert.encoder.layer.0.attention.self.query'); to match by name, give a list: "
                    f"[{config.target_modules!r}].")
        raise ValueError(
            f"LoRA(target_modules={config.target_modules!r}) matched no module of {type(model).__name__}. "
            f"Modules it can adapt: {_describe_modules(model)}.{hint}"
        )
    if config.exclude_modules is not None:
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


def _adaptable_view(model: nn.Module) -> dict[str, nn.Module]:
    """``model.named_modules()`` as a new adapter sees it: a LoRA layer stands for its base module (so another
    adapter can target it) and the insides of LoRA layers and ``modules_to_save`` wrappers are hidden."""
    view: dict[str, nn.Module] = {}
    hidden: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if any(name.startswith(h) for h in hidden):
            continue
        if isinstance(module, LoRALayer):
            view[name] = module.base_layer
            hidden.append(f"{name}.")
        else:
            view[name] = module
            if isinstance(module, ModulesToSave):
                hidden.append(f"{name}.")
    return view


def _select_modules_to_save(model: nn.Module, config: LoRAConfig, names: list[str]) -> list[str]:
    spec = lora_spec(model)
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
            raise TypeError(
                f"LoRA: {name!r} belongs to an nn.{inside_fused[name]}, which reads its children's weights directly "
                "(fused fast path), so an adapter there would be silently ignored. Exclude it (exclude_modules), "
                "or build the block from separate Linear layers."
            )
        if isinstance(module, nn.Conv2d) and module.groups != 1:
            raise TypeError(f"LoRA: {name!r} is a grouped Conv2d (groups={module.groups}); only groups=1 is supported.")


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


def _warn_about_settings(model: nn.Module, config: LoRAConfig, targets: list[str]) -> None:
    """Settings that are valid but almost surely not what the user meant."""
    for what, patterns in (("rank_pattern", config.rank_pattern), ("alpha_pattern", config.alpha_pattern)):
        for key in patterns:
            if not any(pattern_matches(key, n) for n in targets):
                warnings.warn(
                    f"LoRA({what}={{{key!r}: ...}}) matches none of the {len(targets)} adapted modules "
                    f"(e.g. {_preview(targets)}), so it changes nothing. Keys match the end of a module name.",
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


def _max_rank(module: nn.Module) -> int:
    weight = module.weight  # Linear (out, in), Conv1D (in, out), Embedding (V, d), Conv2d (out, in, kh, kw)
    return min(weight.shape[0], weight[0].numel())


def _make_layer(module: nn.Module, name: str, config: LoRAConfig, adapter_name: str) -> LoRALayer:
    kwargs = {
        "rank": config.rank_for(name),
        "alpha": config.alpha_for(name),
        "dropout": config.dropout,
        "use_rslora": config.use_rslora,
        "init": config.init,
        "adapter_name": adapter_name,
    }
    if isinstance(module, nn.Embedding):
        return LoRAEmbedding(module, **kwargs)
    if isinstance(module, nn.Conv2d):
        return LoRAConv2d(module, **kwargs)
    return LoRALinear(module, **kwargs)


def lora_layers(model: nn.Module) -> dict[str, LoRALayer]:
    """All LoRA layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, LoRALayer)}


def _peft_key(key: str, adapter_name: str) -> str:
    """A layer-relative key of one adapter without its adapter segment: ``lora_A.x.weight`` -> ``lora_A.weight``."""
    container, _, rest = key.partition(f".{adapter_name}")
    return container + rest


@register
class LoRAAdapter(Adapter):
    """LoRA's side of the adapter protocol: the named LoRA adapters on a model.

    Args:
        adapters: ``{adapter name: (config, full names of the modules it adapts)}``, in the order they were added.
        modules_to_save: Full names of the modules trained and saved in full; shared by every named adapter.
        routing: The :class:`~lightning_peft.peft.layers.Routing` object every LoRA layer of the model holds.
    """

    kind: ClassVar[str] = "lora"
    peft_type: ClassVar[str] = "LORA"
    peft_fields: ClassVar[frozenset[str]] = frozenset((  # peft 0.21.2's LoraConfig
        "alora_invocation_tokens", "alpha_pattern", "arrow_config", "auto_mapping", "base_model_name_or_path", "bias",
        "corda_config", "ensure_weight_tying", "eva_config", "exclude_modules", "fan_in_fan_out", "inference_mode",
        "init_lora_weights", "kasa_config", "layer_replication", "layers_pattern", "layers_to_transform",
        "loftq_config", "lora_alpha", "lora_bias", "lora_dropout", "lora_ga_config", "megatron_config",
        "megatron_core", "modules_to_save", "monteclora_config", "peft_type", "peft_version", "qalora_group_size",
        "r", "rank_pattern", "revision", "runtime_config", "target_modules", "target_parameters", "task_type",
        "trainable_token_indices", "use_bdlora", "use_dora", "use_qalora", "use_rslora", "velora_config",
    ))
    mergeable: ClassVar[bool] = True

    def __init__(
        self,
        adapters: dict[str, tuple[LoRAConfig, Iterable[str]]],
        modules_to_save: Iterable[str],
        routing: Routing,
    ) -> None:
        self.adapters = {name: (config, tuple(targets)) for name, (config, targets) in adapters.items()}
        self.modules_to_save = tuple(modules_to_save)
        self.routing = routing

    def __repr__(self) -> str:
        names = ", ".join(f"{n}: rank {c.rank}, {len(t)} targets" for n, (c, t) in self.adapters.items())
        return f"LoRAAdapter({names}; active={self.routing.active!r}, modules_to_save={list(self.modules_to_save)})"

    @property
    def names(self) -> tuple[str, ...]:
        """The adapter names, in the order they were added."""
        return tuple(self.adapters)

    @property
    def config(self) -> LoRAConfig:
        """The first adapter's config (the one :func:`inject_lora` used)."""
        return next(iter(self.adapters.values()))[0]

    @property
    def targets(self) -> tuple[str, ...]:
        """Every adapted module (the union over the named adapters), in order of first adaptation."""
        return tuple(dict.fromkeys(t for _, targets in self.adapters.values() for t in targets))

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state: dict[str, Tensor] = {}
        bias = self.config.bias
        for name in self.targets:
            layer = model.get_submodule(name)
            state.update({f"{name}.{k}": p for k, p in layer.adapter_parameters().items()})
            if bias == "lora_only" and getattr(layer.base_layer, "bias", None) is not None:
                state[f"{name}.base_layer.bias"] = layer.base_layer.bias
        if bias == "all":
            for name, module in model.named_modules():
                if module._parameters.get("bias") is not None and ".original_module" not in f".{name}":
                    state[f"{name}.bias" if name else "bias"] = module._parameters["bias"]
        for name in self.modules_to_save:
            trained = model.get_submodule(name).trained_module
            state.update(trained.state_dict(prefix=f"{name}.trained_module.", keep_vars=True))
        return state

    def config_dict(self) -> dict[str, Any]:
        return {
            "adapters": {n: {"config": c.to_dict(), "targets": list(t)} for n, (c, t) in self.adapters.items()},
            "modules_to_save": list(self.modules_to_save),
            "active": self.routing.active,
        }

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> LoRAAdapter:
        # The exact names recorded, not the rules: the same modules whatever the rules would pick today.
        model = unwrap(model)
        _refuse_second_injection(model)
        if "adapters" not in config:  # the single-adapter format of lightning-peft 0.1 checkpoints
            config = {"adapters": {DEFAULT: {"config": config["config"], "targets": config["targets"]}},
                      "modules_to_save": config["modules_to_save"], "active": DEFAULT}
        names = {n for n, _ in model.named_modules()}
        recorded = [t for entry in config["adapters"].values() for t in entry["targets"]]
        absent = [n for n in [*recorded, *config["modules_to_save"]] if n not in names]
        if absent:
            raise ValueError(
                f"LoRA: the recorded adapter names module {absent[0]!r}, which {type(model).__name__} does not have; "
                "the checkpoint was written for another model."
            )
        for i, (name, entry) in enumerate(config["adapters"].items()):
            to_save = list(config["modules_to_save"]) if i == 0 else []
            _inject(model, LoRAConfig(**entry["config"]), list(entry["targets"]), to_save, name)
        spec = attached(model)["lora"]
        spec.routing.active = config.get("active", spec.names[0])
        return spec

    def merged_state(self, model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Fold the active adapter (or the merged one) into ``state``; layers without it keep their base weight."""
        model = unwrap(model)
        for name in self.targets:
            layer = model.get_submodule(name)
            for key in layer.adapter_parameters():
                state.pop(f"{name}.{key}")
            prefix = f"{name}.base_layer."
            for key in [k for k in state if k.startswith(prefix)]:
                state[f"{name}.{key[len(prefix):]}"] = state.pop(key)
            chosen = layer.merged_adapter or self.routing.active
            if chosen not in layer.specs:
                continue
            try:
                state[f"{name}.weight"] = layer.merged_weight(chosen)
            except RuntimeError as err:
                raise RuntimeError(f"merged_state_dict: layer {name!r}: {err}") from None
        return fold_modules_to_save(model, state)

    def unload(self, model: nn.Module, merge: bool) -> None:
        model = unwrap(model)
        if merge:
            merge_lora(model)
        elif any(layer.merged for layer in lora_layers(model).values()):
            unmerge_lora(model)
        for name in self.targets:
            set_submodule(model, name, model.get_submodule(name).base_layer)
        for name in self.modules_to_save:
            wrapper = model.get_submodule(name)
            set_submodule(model, name, wrapper.trained_module if merge else wrapper.original_module)
        detach(model, self.kind)
        _point_peft_methods(model, present=False)

    def _name(self, adapter_name: str | None) -> str:
        name = adapter_name or self.routing.active or self.names[0]
        if name not in self.adapters:
            raise ValueError(f"LoRA: no adapter named {name!r}; the model has {list(self.adapters)}.")
        return name

    def peft_state(self, model: nn.Module, adapter_name: str | None = None) -> dict[str, Tensor]:
        """One adapter's tensors (not detached) under the keys of PEFT's adapter files, without the prefix.

        The trained biases and ``modules_to_save`` are shared by every adapter, so each adapter's file has them.
        """
        name = self._name(adapter_name)
        model = unwrap(model)
        state: dict[str, Tensor] = {}
        for target in self.adapters[name][1]:
            layer = model.get_submodule(target)
            state.update({f"{target}.{_peft_key(k, name)}": p for k, p in layer.adapter_parameters(name).items()})
        own = {id(p) for layer in lora_layers(model).values() for p in layer.adapter_parameters().values()}
        shared = {k: v for k, v in self.state(model).items() if id(v) not in own}
        state.update(shared)
        return {clean_key(plain_key(k)): v for k, v in state.items()}

    def peft_config(self, model: nn.Module, adapter_name: str | None = None) -> dict[str, Any]:
        name = self._name(adapter_name)
        config, targets = self.adapters[name]
        layers = {clean_key(n): unwrap(model).get_submodule(n) for n in targets}
        specs = {n: layer.specs[name] for n, layer in layers.items()}
        return {
            "peft_type": "LORA",
            "task_type": None,
            "base_model_name_or_path": base_model_name(model),
            "inference_mode": True,
            "r": config.rank,
            "lora_alpha": config.alpha,
            "lora_dropout": config.dropout,
            "target_modules": exact_targets(list(layers), [n for n in _adaptable_view(unwrap(model))]),
            "exclude_modules": None,
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
            "rank_pattern": {re.escape(n): s.rank for n, s in specs.items() if s.rank != config.rank},
            "alpha_pattern": {re.escape(n): s.alpha for n, s in specs.items() if s.alpha != config.alpha},
            "bias": config.bias,
            "fan_in_fan_out": any(getattr(m, "fan_in_fan_out", False) for m in layers.values()),
            "init_lora_weights": "gaussian" if config.init == "gaussian" else True,
            "use_rslora": config.use_rslora,
            "use_dora": False,
        }

    def peft_problems(self, model: nn.Module) -> list[str]:
        problems = []
        for name in self.targets:
            layer = unwrap(model).get_submodule(name)
            if isinstance(layer, LoRAConv2d):
                base = layer.base_layer
                if any(d != 1 for d in base.dilation):
                    problems.append(f"{name!r} is a Conv2d with dilation={base.dilation}")
                if base.padding_mode != "zeros":
                    problems.append(f"{name!r} is a Conv2d with padding_mode={base.padding_mode!r}")
        return problems

    def check_peft_config(self, model: nn.Module, config: Any, source: str, adapter_name: str = DEFAULT) -> None:
        merged = [name for name, layer in lora_layers(model).items() if layer.merged]
        if merged:
            raise RuntimeError(f"load_adapter: layer {merged[0]!r} is merged; call unmerge_lora(model) before loading.")
        ours = config_from_peft(config, source)
        for name in self.adapters[adapter_name][1]:
            spec = unwrap(model).get_submodule(name).specs[adapter_name]
            alpha = ours.alpha_for(name)
            if (spec.alpha, spec.use_rslora) != (alpha, ours.use_rslora):
                raise ValueError(
                    f"load_adapter: {source} gives {name!r} alpha={alpha}, use_rslora={ours.use_rslora}, but the "
                    f"model's LoRA adapter {adapter_name!r} there has alpha={spec.alpha}, use_rslora={spec.use_rslora}; "
                    "the adapter would be scaled differently. Load it into a model without LoRA layers, or under "
                    "another adapter_name."
                )

    @classmethod
    def from_peft(
        cls, model: nn.Module, config: dict[str, Any], source: str, adapter_name: str = DEFAULT
    ) -> LoRAAdapter:
        ours = config_from_peft(config, source)
        view = _adaptable_view(unwrap(model))
        names = [n for n in view if n]
        # PEFT's SEQ_CLS task writes ["classifier", "score"] whatever the model calls its head: drop the absent.
        present = [m for m in dict.fromkeys(ours.modules_to_save or []) if any(name_matches(n, [m]) for n in names)]
        ours = dataclasses.replace(ours, modules_to_save=present)
        missing = unmatched(ours.target_modules, names)
        if missing and len(missing) < len(ours.target_modules):
            # PEFT accepts entries that match nothing when others match; its files are read as it reads them.
            warnings.warn(f"load_adapter: {source} lists target_modules {missing} that match no module of "
                          f"{type(unwrap(model)).__name__}; they are ignored, as PEFT ignores them.",
                          UserWarning, stacklevel=4)
            ours = dataclasses.replace(ours, target_modules=[t for t in ours.target_modules if t not in missing])
        if lora_spec(model) is None:
            inject_lora(model, ours, adapter_name=adapter_name)
        else:
            from .multi_lora import add_adapter

            add_adapter(model, adapter_name, ours)
        return attached(model)["lora"]


def exact_targets(targets: list[str], names: list[str]) -> list[str] | str:
    """``targets`` as PEFT's ``target_modules``: the list of names when suffix matching picks exactly them, else
    a regular expression that matches exactly them (a list entry ``"0"`` would also match ``"1.0"``)."""
    chosen = set(targets)
    if all(name in chosen for name in names if name and name_matches(name, targets)):
        return list(targets)
    return "(?:" + "|".join(re.escape(t) for t in targets) + ")"


def lora_spec(model: nn.Module) -> LoRAAdapter | None:
    """The :class:`LoRAAdapter` :func:`inject_lora` left on ``model``, or None."""
    return attached(model).get("lora")


def require_spec(model: nn.Module, who: str) -> LoRAAdapter:
    spec = lora_spec(model)
    if spec is None:
        raise RuntimeError(
            f"{who}: {type(unwrap(model)).__name__} has no LoRA adapter; call inject_lora(model, ...) first."
        )
    return spec


def check_adapter_name(name: object, who: str) -> str:
    """``name`` if it can name an adapter (a non-empty string that is a valid module attribute name)."""
    if not isinstance(name, str) or not name or "." in name or not name.isidentifier():
        raise ValueError(
            f"{who}: adapter name {name!r} is not usable; give a non-empty identifier without dots, e.g. 'sports' "
            "(it becomes part of the parameter names, lora_A.<name>.weight)."
        )
    return name


def inject_lora(
    model: nn.Module, config: LoRAConfig | Any | None = None, adapter_name: str = DEFAULT, **kwargs
) -> dict[str, LoRALayer]:
    """Wrap the target modules of ``model`` in LoRA layers, in place, and freeze everything else.

    After the call only the parameters of the adapters attached to ``model`` (this one and any other
    technique's) have ``requires_grad=True``: the LoRA weights, the chosen biases and the trainable copies of
    ``modules_to_save``. Nothing is changed if an error is raised. More named adapters are added with
    :func:`~lightning_peft.peft.add_adapter`.

    Args:
        model: The model to adapt (any ``nn.Module``; for a Hugging Face model pass the ``PreTrainedModel``;
            a ``torch.compile`` wrapper is looked through).
        config: A :class:`LoRAConfig` or a Hugging Face PEFT ``LoraConfig``; or give the fields as keyword
            arguments instead.
        adapter_name: The adapter's name; it becomes the active adapter.

    Returns:
        The new LoRA layers by full module name.

    Raises:
        RuntimeError: If ``model`` already has LoRA layers.
        ValueError: If the targets match nothing or a setting is invalid.
        TypeError: If a target is of a type LoRA cannot adapt, or an argument has the wrong type.
    """
    config = as_config(config, kwargs, "inject_lora")
    check_adapter_name(adapter_name, "inject_lora")
    model = unwrap(model)
    _refuse_second_injection(model)
    targets, to_save = _select(model, config)
    _warn_about_settings(model, config, targets)
    return _inject(model, config, targets, to_save, adapter_name)


def _refuse_second_injection(model: nn.Module) -> None:
    existing = lora_layers(model)
    if existing:
        raise RuntimeError(
            f"inject_lora: {type(model).__name__} already has {len(existing)} LoRA layers "
            f"(e.g. {next(iter(existing))!r}); LoRA was injected twice. Use the model as it is, build a fresh one, "
            "or add another named adapter with add_adapter(model, name, config)."
        )


def _inject(
    model: nn.Module, config: LoRAConfig, targets: list[str], to_save: list[str], adapter_name: str
) -> dict[str, LoRALayer]:
    """Add adapter ``adapter_name`` to exactly ``targets`` and wrap ``to_save`` (full names, already checked)."""
    spec = lora_spec(model)
    routing = spec.routing if spec is not None else Routing(adapter_name)
    for wrapper in wrap_modules_to_save(model, to_save).values():
        wrapper.routing = routing  # disabled adapters and base samples use the original module
    replaced = {}
    for name in targets:
        module = model.get_submodule(name)
        if isinstance(module, LoRALayer):
            module.add_adapter(
                adapter_name, config.rank_for(name), config.alpha_for(name), config.dropout, config.use_rslora,
                config.init,
            )
            replaced[name] = module
            continue
        layer = _make_layer(module, name, config, adapter_name).train(module.training)  # eval model: eval adapters
        layer.routing = routing
        set_submodule(model, name, layer)
        replaced[name] = layer
    if spec is None:
        spec = LoRAAdapter({}, to_save, routing)
    spec.adapters[adapter_name] = (config, tuple(targets))
    attach(model, spec)
    _point_peft_methods(model, present=True)
    log.info("LoRA: adapter %r on %d modules of %s; %s", adapter_name, len(replaced), type(model).__name__,
             trainable_parameters(model))
    return replaced


# Hugging Face PEFT's PeftModel methods a user may call on a model adapted here, and what does it in lightning-peft.
_PEFT_METHODS = {
    "merge_and_unload": "lightning_peft.peft.unload_lora(model) returns the plain model with the active adapter "
                        "merged (merge_lora(model) merges in place and keeps the LoRA layers)",
    "unload": "lightning_peft.peft.unload_lora(model, merge=False) returns the plain model without the adapter",
    "merge_adapter": "lightning_peft.peft.merge_lora(model) merges the active adapter in place",
    "unmerge_adapter": "lightning_peft.peft.unmerge_lora(model) subtracts it again",
}


class _PeftMethod:
    """Stands, on an adapted model, for a PEFT ``PeftModel`` method the model's class lacks: says what to call."""

    def __init__(self, owner: str, name: str) -> None:
        self.owner, self.name = owner, name

    def __call__(self, *args, **kwargs):
        raise AttributeError(
            f"{self.owner}.{self.name}() is a method of Hugging Face PEFT's PeftModel; this {self.owner} carries "
            f"lightning-peft LoRA layers instead: {_PEFT_METHODS[self.name]}."
        )


def _point_peft_methods(model: nn.Module, present: bool) -> None:
    """Add (or remove) the :class:`_PeftMethod` pointers on ``model``, for names its class does not define."""
    for name in _PEFT_METHODS:
        if hasattr(type(model), name):
            continue
        if present and name not in model.__dict__:
            model.__dict__[name] = _PeftMethod(type(model).__name__, name)
        elif not present and isinstance(model.__dict__.get(name), _PeftMethod):
            del model.__dict__[name]


def merge_lora(model: nn.Module, adapter_name: str | None = None) -> list[str]:
    """Add one adapter's update (default: the active adapter) into the base weights, in place.

    Idempotent: layers that already hold this adapter merged are left alone; merging a second adapter while one is
    merged is refused. Each merge is computed in float32 (or wider) and cast back to the weight's dtype. If a merged
    weight would be non-finite, the layers merged by this call are unmerged again and a ``RuntimeError`` names the
    layer. A weight tied to another module (e.g. input and output embeddings) is refused before anything changes.
    To train again, call :func:`unmerge_lora` first; to get plain modules back (e.g. for ``save_pretrained``),
    :func:`unload_lora`.

    Returns:
        Names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no LoRA adapter, another adapter is merged, a weight is tied, or a merge is
            non-finite.
        ValueError: If ``adapter_name`` names no adapter.
    """
    spec = require_spec(model, "merge_lora")
    if adapter_name is None and spec.routing.active is None:
        raise RuntimeError("merge_lora: no adapter is active; name one, merge_lora(model, adapter_name=...).")
    name = spec._name(adapter_name)
    model = unwrap(model)
    layers = {n: layer for n, layer in lora_layers(model).items() if name in layer.specs}
    other = next((n for n, layer in lora_layers(model).items() if layer.merged and layer.merged_adapter != name), None)
    if other is not None:
        raise RuntimeError(
            f"merge_lora: adapter {lora_layers(model)[other].merged_adapter!r} is merged (e.g. at {other!r}); "
            f"call unmerge_lora(model) before merging {name!r}."
        )
    _refuse_tied(model, layers)
    done: list[str] = []
    for layer_name, layer in layers.items():
        if layer.merged:
            continue
        try:
            layer.merge(name)
        except RuntimeError as err:
            for merged_name in reversed(done):
                model.get_submodule(merged_name).unmerge()
            raise RuntimeError(f"merge_lora: layer {layer_name!r}: {err}") from None
        done.append(layer_name)
    spec.routing.active = name
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
    """Subtract the merged adapter's update from the base weights, in place.

    Exact up to one rounding in the weight's dtype (so not bit-exact in bfloat16).

    Raises:
        RuntimeError: If no layer is merged.

    Returns:
        Names of the layers unmerged.
    """
    require_spec(model, "unmerge_lora")
    model = unwrap(model)
    merged = [name for name, layer in lora_layers(model).items() if layer.merged]
    if not merged:
        raise RuntimeError(f"unmerge_lora: no LoRA layer of {type(model).__name__} is merged; call merge_lora first.")
    for name in merged:
        model.get_submodule(name).unmerge()
    return merged


def unload_lora(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove LoRA from ``model`` in place and return the plain model (Hugging Face PEFT's ``merge_and_unload``).

    Every LoRA layer is replaced by its base module, and every ``modules_to_save`` wrapper by its trained copy
    (``merge=True``: the fine-tuned model with the active adapter merged, which ``save_pretrained`` /
    ``from_pretrained`` round-trip) or by the untouched original (``merge=False``: the base model as it was before
    :func:`inject_lora`, except biases trained with ``bias="lora_only"`` / ``"all"``, which train in place and keep
    their trained values). Every named adapter goes.

    Raises:
        RuntimeError: If ``model`` has no LoRA adapter, or a merge is refused (tied or non-finite weights).
    """
    return remove_adapter(model, require_spec(model, "unload_lora"), merge)


# --- Hugging Face PEFT's LoraConfig ------------------------------------------------------------------------

# PEFT initialisations that rewrite the base weights as well (PEFT re-runs them when it loads the adapter).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "eva")

# PEFT features this library does not implement: loading such an adapter would silently change its meaning.
_UNSUPPORTED = {
    "use_dora": False,
    "layers_to_transform": None,
    "layers_pattern": None,
    "target_parameters": None,
    "lora_bias": False,
    "layer_replication": None,
    "trainable_token_indices": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "use_bdlora": None,
    "kasa_config": None,
    "monteclora_config": None,
    "arrow_config": None,
    "velora_config": None,
    "loftq_config": {},
    "eva_config": None,
    "corda_config": None,
    "megatron_config": None,
}


def config_from_peft(config: dict, source: str = "adapter_config.json", who: str = "load_adapter") -> LoRAConfig:
    """Translate a PEFT ``LoraConfig`` dict to :class:`LoRAConfig`; refuses features this library lacks."""
    instead = ("load this adapter with Hugging Face PEFT instead" if who == "load_adapter"
               else "use Hugging Face PEFT for it, or leave the option out")
    if not isinstance(config, dict):
        raise ValueError(f"{who}: {source} holds a JSON {type(config).__name__}, not an object; "
                         "it is not a PEFT adapter config.")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{who}: {source} has peft_type={config.get('peft_type')!r}; only 'LORA' is supported.")
    for key, neutral in _UNSUPPORTED.items():
        value = config.get(key, neutral)
        if value not in (neutral, None, False, [], {}):
            raise ValueError(f"{who}: {source} sets {key}={value!r}, which lightning-peft does not support; {instead}.")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(
            f"{who}: {source} sets init_lora_weights={init!r}, an initialisation that also rewrites the base "
            f"weights; lightning-peft does not implement it, so the adapter would mean something else here; {instead}."
        )
    if who != "load_adapter" and config.get("target_modules") is None:
        raise ValueError(
            f"{who}: {source} has target_modules=None; lightning-peft does not guess PEFT's per-architecture "
            "defaults. Name them, e.g. target_modules=['query', 'value'] or 'all-linear'."
        )
    absent = [key for key in ("r", "target_modules") if config.get(key) is None]
    if absent:
        raise ValueError(f"{who}: {source} has no {absent[0]!r}; it is not a complete LoRA adapter config.")
    targets = config["target_modules"]
    return LoRAConfig(
        rank=config["r"],
        alpha=config.get("lora_alpha", 8),
        dropout=config.get("lora_dropout", 0.0),
        target_modules=sorted(targets) if isinstance(targets, (set, frozenset)) else targets,
        exclude_modules=config.get("exclude_modules"),
        modules_to_save=config.get("modules_to_save"),
        rank_pattern=config.get("rank_pattern") or {},
        alpha_pattern=config.get("alpha_pattern") or {},
        bias=config.get("bias", "none"),
        init="gaussian" if init == "gaussian" else "kaiming",
        use_rslora=config.get("use_rslora", False),
    )
