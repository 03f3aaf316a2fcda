"""LoRA's settings: [`LoRAConfig`][lightning_peft.peft.LoRAConfig] (validated on construction), keyword arguments and
Hugging Face PEFT's ``LoraConfig`` translated to it (`as_config`, `config_from_peft`).

>>> LoRAConfig(rank=4, target_modules=["query"]).rank_for("encoder.query")
4
>>> LoRAConfig(rank=0)
Traceback (most recent call last):
ValueError: LoRA(rank=0): rank must be an integer >= 1, e.g. 8.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from ..._checks import boolean, choice, integer, positive, probability, real, regex
from ..._checks import names as name_list
from .._common import pattern_matches, usable_adapter_name
from .._limits import FLOAT32_MAX
from ..quantize import check_method
from ..trainable_tokens import Indices, check_indices
from .init import check_init
from .layer import Init

Bias = Literal["none", "lora_only", "all"]
Targets = list[str] | str

# Hugging Face PEFT's names for our arguments: a user who types them is told ours.
PEFT_NAMES = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "init_lora_weights": "init"}


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
        init: ``"kaiming"`` (Kaiming-uniform ``A``, ``B = 0``) or ``"gaussian"`` (``A ~ N(0, 1/r)``, ``B = 0``);
            or a start from the base weight that rewrites it (`lightning_peft.peft.lora.init`): ``"pissa"``,
            ``"pissa_niter_K"``, ``"olora"``, ``"loftq"`` / ``"loftq_iter_K"`` (with ``quantize``).
        use_rslora: Rank-stabilised scaling.
        quantize: Store the adapted ``nn.Linear`` layers' frozen weights quantized (QLoRA): ``"nf4"`` or
            ``"int8"`` (`lightning_peft.peft.quantize`); None: full precision. The adapters stay float32.
        use_dora: DoRA (Liu et al., arXiv:2402.09353): a trained magnitude per output feature on top of the LoRA
            update, as Hugging Face PEFT's ``use_dora`` (`lightning_peft.peft.lora.variants`); on every layer type.
        target_parameters: Parameters adapted in place (PEFT's ``target_parameters``, `lightning_peft.peft.lora.param`):
            full names or dotted suffixes, e.g. ``["mlp.experts.gate_up_proj"]`` (the 3-D experts of transformers 5
            MoE models); ``target_modules`` still applies, ``[]`` adapts the parameters only.
        trainable_token_indices: Train only these rows of an embedding (new special tokens), as PEFT's field of the
            same name (`lightning_peft.peft.trainable_tokens`): a list of token ids of the input embedding (and of
            the output head tied to it), or ``{embedding module name: ids}``.
        lora_bias: ``B`` gets a trained bias (starting at zero), merged into the base bias, as PEFT's ``lora_bias``:
            for an update extracted from a full fine-tune. Not on embeddings, with DoRA, or with ``init="gaussian"``.
        layers_to_transform: Adapt only the ``target_modules`` inside these layers (an index or a list), as PEFT's:
            a layer's index is the first number in a module's name after a ``layers_pattern`` entry (default: after
            any named part, ``model.layers.3.mlp`` -> 3); an entry naming a module in full is kept wherever it is.
            Needs a list ``target_modules``.
        layers_pattern: The name (a regular expression, or a list of them) of the ``nn.ModuleList`` holding the
            layers, e.g. ``"layers"`` or ``"h"``; None: any. Only with ``layers_to_transform``.
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
    quantize: Literal["nf4", "int8"] | None = None
    use_dora: bool = False
    target_parameters: list[str] | None = None
    trainable_token_indices: Indices | None = None
    lora_bias: bool = False
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None

    def __post_init__(self) -> None:
        # Frozen dataclass: normalised values are set with object.__setattr__; the caller's objects are not mutated.
        normal = object.__setattr__
        normal(self, "rank", _as_rank(self.rank, "rank"))
        normal(self, "alpha", _as_alpha(self.alpha, "alpha"))
        normal(self, "dropout", probability("LoRA", "dropout", self.dropout))
        if not (self.target_modules == [] and self.target_parameters):  # [] with parameters: those only, as PEFT
            normal(self, "target_modules", _as_targets(self.target_modules, "target_modules"))
        if self.exclude_modules is not None:
            normal(self, "exclude_modules", _as_targets(self.exclude_modules, "exclude_modules"))
        if self.modules_to_save is not None:
            normal(self, "modules_to_save", name_list("LoRA", "modules_to_save", self.modules_to_save))
        for what, patterns, check in (("rank_pattern", self.rank_pattern, _as_rank),
                                      ("alpha_pattern", self.alpha_pattern, _as_alpha)):
            if not isinstance(patterns, dict):
                raise TypeError(f"LoRA({what}={patterns!r}): give a dict {{regex: value}}, e.g. {{'query': 16}}.")
            for key in patterns:
                regex("LoRA", f"{what} key", key, of=(what, patterns))
            normal(self, what, {k: check(v, f"{what}[{k!r}]", (what, patterns)) for k, v in patterns.items()})
        choice("LoRA", "bias", self.bias, ("none", "lora_only", "all"))
        check_init(self.init)
        boolean("LoRA", "use_rslora", self.use_rslora)
        if self.quantize is not None:
            check_method(self.quantize, "LoRA")
        boolean("LoRA", "use_dora", self.use_dora)
        if self.trainable_token_indices is not None:
            normal(self, "trainable_token_indices", check_indices(self.trainable_token_indices))
        boolean("LoRA", "lora_bias", self.lora_bias)
        clash = "use_dora=True" if self.use_dora else "init='gaussian'" if self.init == "gaussian" else None
        if self.lora_bias and clash:  # PEFT's LoraConfig refuses both, so PEFT could not load the adapter
            raise ValueError(f"LoRA(lora_bias=True, {clash}): PEFT supports lora_bias only for plain LoRA initialised "
                             f"as init='kaiming'; drop {clash.split('=')[0]} or lora_bias.")
        _check_layers(self)
        if self.target_parameters is not None:
            normal(self, "target_parameters", _as_parameters(self))

    def rank_for(self, name: str) -> int:
        return _pattern_value(self.rank_pattern, name, self.rank)

    def alpha_for(self, name: str) -> float:
        return _pattern_value(self.alpha_pattern, name, self.alpha)

    def layer_settings(self, name: str) -> dict[str, Any]:
        """What a LoRA layer takes for module (or parameter) ``name``: ``LoRALayer.add_adapter``'s arguments, with
        ``rank_pattern`` and ``alpha_pattern`` applied."""
        return {"rank": self.rank_for(name), "alpha": self.alpha_for(name), "dropout": self.dropout,
                "use_rslora": self.use_rslora, "init": self.init, "use_dora": self.use_dora, "lora_bias": self.lora_bias}

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``LoRAConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_peft(cls, config: Any, source: str = "peft.LoraConfig") -> LoRAConfig:
        """Translate a Hugging Face PEFT ``LoraConfig`` (object or dict) to a
        [`LoRAConfig`][lightning_peft.peft.LoRAConfig].

        Raises:
            ValueError: If the config uses a PEFT feature lightning-peft does not implement (named in the message).
        """
        if not isinstance(config, dict):
            config = config.to_dict()
        return config_from_peft(config, source, who="inject_lora")


def _as_rank(value: object, what: str, of: tuple[str, object] | None = None) -> int:
    return integer("LoRA", what, value, minimum=1, example="8", of=of)


def _as_alpha(value: object, what: str, of: tuple[str, object] | None = None) -> float:
    # An alpha above float32's largest value makes every output inf or NaN (`_limits`); the scale's limit for a
    # half-precision base is checked at inject, where the dtype is known.
    alpha = positive("LoRA", what, value, example="16", of=of)
    real("LoRA", what, value, maximum=FLOAT32_MAX, example="16", of=of,
         meaning="float32's largest value; an alpha beyond it makes every output inf or NaN")
    return value if isinstance(value, int) else alpha  # an int alpha stays an int (PEFT's files write it so)


def _as_parameters(config: LoRAConfig) -> list[str]:
    chosen = name_list("LoRA", "target_parameters", config.target_parameters, example="['mlp.experts.gate_up_proj']")
    if not chosen or not all(chosen):
        raise ValueError(f"LoRA(target_parameters={config.target_parameters!r}): give parameter names, e.g. "
                         "['mlp.experts.gate_up_proj'], or leave it None.")
    # PEFT's ParamWrapper refuses these as well: the update is formed on the parameter, not on an input.
    for what, value in (("use_dora", config.use_dora), ("dropout", config.dropout), ("lora_bias", config.lora_bias),
                        ("init", config.init if config.init not in ("kaiming", "gaussian") else None)):
        if value:
            raise ValueError(
                f"LoRA(target_parameters={chosen!r}, {what}={value!r}): an adapted parameter is updated as a whole "
                f"(W + s B A) by one factor pair per expert, which {what} has no form for; PEFT refuses the pair "
                f"too. Leave {what} out, or adapt modules (target_modules) instead."
            )
    return chosen


def _check_layers(config: LoRAConfig) -> None:
    """PEFT's rules for ``layers_to_transform`` / ``layers_pattern``; it refuses the same combinations."""
    layers, pattern = config.layers_to_transform, config.layers_pattern
    for what, value in (("layers_to_transform", layers), ("layers_pattern", pattern)):
        if value is not None and isinstance(config.target_modules, str):
            raise ValueError(
                f"LoRA({what}={value!r}, target_modules={config.target_modules!r}): {what} needs target_modules as "
                "a list of names, e.g. ['q_proj', 'v_proj'] (PEFT refuses the same); a regular expression can name "
                r"the layers itself, e.g. r'.*\.layers\.(0|1)\.self_attn\.q_proj'."
            )
    if isinstance(layers, (list, tuple)) and layers:
        object.__setattr__(config, "layers_to_transform", [integer(
            "LoRA", f"layers_to_transform[{n}]", i, minimum=0, example="[0, 1]", of=("layers_to_transform", layers))
            for n, i in enumerate(layers)])
    elif layers is not None:
        integer("LoRA", "layers_to_transform", layers, minimum=0, example="[0, 1] or 0")
    if pattern is None:
        return
    if layers is None:
        raise ValueError(f"LoRA(layers_pattern={pattern!r}): layers_pattern only says where layers_to_transform "
                         "counts layers; give layers_to_transform too, e.g. [0, 1].")
    entries = [pattern] if isinstance(pattern, str) else name_list("LoRA", "layers_pattern", pattern,
                                                                   example="'layers'")
    if not entries or "" in entries:
        raise ValueError(f"LoRA(layers_pattern={pattern!r}): give the name of the ModuleList holding the layers, "
                         "e.g. 'layers' or 'h', or None for any.")
    for n, entry in enumerate(entries):
        regex("LoRA", "layers_pattern" if isinstance(pattern, str) else f"layers_pattern[{n}]", entry,
              of=None if isinstance(pattern, str) else ("layers_pattern", pattern))
    if not isinstance(pattern, str):
        object.__setattr__(config, "layers_pattern", entries)


def _as_targets(value: object, what: str) -> Targets:
    if isinstance(value, str):
        return regex("LoRA", what, value)
    if isinstance(value, (list, tuple, set, frozenset)) and value and all(isinstance(v, str) for v in value):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    raise TypeError(
        f"LoRA({what}={value!r}): give a non-empty list of module names (e.g. ['query', 'value']), "
        "a regular expression string, or 'all-linear'."
    )


def as_config(config: object, kwargs: dict[str, Any], who: str) -> LoRAConfig:
    """A [`LoRAConfig`][lightning_peft.peft.LoRAConfig] from a config object (ours or PEFT's ``LoraConfig``) or keyword
    arguments."""
    peft_names = {k: PEFT_NAMES[k] for k in kwargs if k in PEFT_NAMES}
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


def check_adapter_name(name: object, who: str) -> str:
    """``name`` if it can name an adapter (a non-empty string that is a valid module attribute name)."""
    return usable_adapter_name(name, who, "lora_A.<name>.weight")


# --- Hugging Face PEFT's LoraConfig ------------------------------------------------------------------------

# PEFT's LoftQ bits and the quantize method that stands for them here (torchao's NF4 / int8, not bitsandbytes').
_LOFTQ_BITS = {4: "nf4", 8: "int8"}
_REWRITING = ("corda", "lora_ga", "loftq")  # PEFT starts that rewrite the base (with pissa, olora: those we have)

# PEFT features this library does not implement: loading such an adapter would silently change its meaning.
_UNSUPPORTED = {
    "layer_replication": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "use_bdlora": None,
    "kasa_config": None,
    "monteclora_config": None,
    "arrow_config": None,
    "velora_config": None,
    "eva_config": None,
    "corda_config": None,
    "megatron_config": None,
}


def config_from_peft(config: dict, source: str = "adapter_config.json", who: str = "load_adapter") -> LoRAConfig:
    """Translate a PEFT ``LoraConfig`` dict to [`LoRAConfig`][lightning_peft.peft.LoRAConfig]; refuses features this
    library lacks."""
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
    init = _peft_init(config, source, who, instead)
    if config.get("target_parameters") and config.get("target_modules") is None:  # PEFT: the parameters only
        config = {**config, "target_modules": []}
    if who != "load_adapter" and config.get("target_modules") is None:
        raise ValueError(
            f"{who}: {source} has target_modules=None; lightning-peft does not guess PEFT's per-architecture "
            "defaults. Name them, e.g. target_modules=['query', 'value'] or 'all-linear'."
        )
    absent = [key for key in ("r", "target_modules") if config.get(key) is None]
    if absent:
        raise ValueError(f"{who}: {source} has no {absent[0]!r}; it is not a complete LoRA adapter config.")
    targets = config["target_modules"]
    try:
        return _from_fields(config, targets, init)
    except (TypeError, ValueError) as err:  # a file's value LoRAConfig refuses: the message names the file
        raise type(err)(f"{who}: {source} holds a value LoRA refuses: {err}") from None


def _from_fields(config: dict, targets: Any, init: Any) -> LoRAConfig:
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
        init=init,
        use_rslora=config.get("use_rslora", False),
        use_dora=config.get("use_dora") or False,
        target_parameters=config.get("target_parameters") or None,
        trainable_token_indices=config.get("trainable_token_indices"),
        lora_bias=config.get("lora_bias") or False,
        quantize=_LOFTQ_BITS.get((config.get("loftq_config") or {}).get("loftq_bits")) if init.startswith("loftq") else None,
        # PEFT reads an empty list or pattern as none given
        layers_to_transform=None if config.get("layers_to_transform") == [] else config.get("layers_to_transform"),
        layers_pattern=config.get("layers_pattern") or None,
    )


def _peft_init(config: dict, source: str, who: str, instead: str) -> str:
    """PEFT's ``init_lora_weights`` (and ``loftq_config``) as our ``init``; refuses what this library lacks."""
    init = config.get("init_lora_weights", True)
    ours = {True: "kaiming", "gaussian": "gaussian"}.get(init, init) if isinstance(init, (bool, str)) else init
    if who == "load_adapter":
        if str(init).lower().startswith(_REWRITING):
            raise ValueError(
                f"{who}: {source} sets init_lora_weights={init!r}, an initialisation that also rewrites the base "
                "weights (LoftQ: with bitsandbytes' quantizer, not lightning-peft's); lightning-peft cannot rebuild "
                f"that base, so the adapter would mean something else here; {instead}.")
        try:  # PiSSA and OLoRA rewrite the base as they did for training, as PEFT's load does
            return check_init(ours)
        except (TypeError, ValueError):
            return "kaiming"  # any other start is overwritten by the file's factors
    loftq = config.get("loftq_config") or {}
    if ours == "loftq" and loftq:
        if loftq.get("loftq_bits") not in _LOFTQ_BITS:
            raise ValueError(f"{who}: {source} sets loftq_config={loftq!r}; loftq_bits must be 4 (quantize='nf4') "
                             "or 8 (quantize='int8').")
        ours = "loftq" if loftq.get("loftq_iter", 1) == 1 else f"loftq_iter_{loftq['loftq_iter']}"
    try:
        check_init(ours, who)
    except (TypeError, ValueError):
        raise ValueError(
            f"{who}: {source} sets init_lora_weights={init!r}; lightning-peft starts LoRA as PEFT's True, 'gaussian', "
            "'pissa', 'pissa_niter_K', 'olora' or 'loftq' only, so this adapter would start elsewhere than asked; "
            f"pass one of those, or {instead}."
        ) from None
    return ours
