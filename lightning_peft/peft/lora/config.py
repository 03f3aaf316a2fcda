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
from .._common import pattern_matches
from .._limits import FLOAT32_MAX
from ..quantize import check_method
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
        init: ``"kaiming"`` (Kaiming-uniform ``A``, ``B = 0``) or ``"gaussian"`` (``A ~ N(0, 1/r)``, ``B = 0``).
        use_rslora: Rank-stabilised scaling.
        quantize: Store the adapted ``nn.Linear`` layers' frozen weights quantized (QLoRA): ``"nf4"`` or
            ``"int8"`` (`lightning_peft.peft.quantize`); None: full precision. The adapters stay float32.
        use_dora: DoRA (Liu et al., arXiv:2402.09353): a trained magnitude per output feature on top of the LoRA
            update, as Hugging Face PEFT's ``use_dora`` (`lightning_peft.peft.lora.variants`); on every layer type.
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

    def __post_init__(self) -> None:
        # Frozen dataclass: normalised values are set with object.__setattr__; the caller's objects are not mutated.
        normal = object.__setattr__
        normal(self, "rank", _as_rank(self.rank, "rank"))
        normal(self, "alpha", _as_alpha(self.alpha, "alpha"))
        normal(self, "dropout", probability("LoRA", "dropout", self.dropout))
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
                _check_pattern(key, what)
            normal(self, what, {k: check(v, f"{what}[{k!r}]") for k, v in patterns.items()})
        choice("LoRA", "bias", self.bias, ("none", "lora_only", "all"))
        choice("LoRA", "init", self.init, ("kaiming", "gaussian"))
        boolean("LoRA", "use_rslora", self.use_rslora)
        if self.quantize is not None:
            check_method(self.quantize, "LoRA")
        boolean("LoRA", "use_dora", self.use_dora)

    def rank_for(self, name: str) -> int:
        return _pattern_value(self.rank_pattern, name, self.rank)

    def alpha_for(self, name: str) -> float:
        return _pattern_value(self.alpha_pattern, name, self.alpha)

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


def _as_rank(value: object, what: str) -> int:
    return integer("LoRA", what, value, minimum=1, example="8")


def _as_alpha(value: object, what: str) -> float:
    # An alpha above float32's largest value makes every output inf or NaN (`_limits`); the scale's limit for a
    # half-precision base is checked at inject, where the dtype is known.
    alpha = positive("LoRA", what, value, example="16")
    real("LoRA", what, value, maximum=FLOAT32_MAX, example="16",
         meaning="float32's largest value; an alpha beyond it makes every output inf or NaN")
    return value if isinstance(value, int) else alpha  # an int alpha stays an int (PEFT's files write it so)


def _check_pattern(key: object, what: str) -> None:
    regex("LoRA", f"{what} key", key)


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
    if not isinstance(name, str) or not name or "." in name or not name.isidentifier():
        raise ValueError(
            f"{who}: adapter name {name!r} is not usable; give a non-empty identifier without dots, e.g. 'sports' "
            "(it becomes part of the parameter names, lora_A.<name>.weight)."
        )
    return name


# --- Hugging Face PEFT's LoraConfig ------------------------------------------------------------------------

# PEFT initialisations that rewrite the base weights as well (PEFT re-runs them when it loads the adapter).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "eva")

# PEFT features this library does not implement: loading such an adapter would silently change its meaning.
_UNSUPPORTED = {
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
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(
            f"{who}: {source} sets init_lora_weights={init!r}, an initialisation that also rewrites the base "
            f"weights; lightning-peft does not implement it, so the adapter would mean something else here; {instead}."
        )
    if who != "load_adapter" and init not in (True, "gaussian"):  # a loaded adapter's init is overwritten anyway
        raise ValueError(
            f"{who}: {source} sets init_lora_weights={init!r}; lightning-peft starts LoRA as PEFT's True (B = 0, A "
            "Kaiming-uniform) or 'gaussian' (A normal) only, so this adapter would start elsewhere than asked; pass "
            "init_lora_weights=True or 'gaussian', or use Hugging Face PEFT for it."
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
        init="gaussian" if init == "gaussian" else "kaiming",
        use_rslora=config.get("use_rslora", False),
        use_dora=config.get("use_dora") or False,
    )
