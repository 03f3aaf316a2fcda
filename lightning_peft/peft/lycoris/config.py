"""The settings LyCORIS methods (LoHa, LoKr) share: `lightning_peft.peft.lycoris.LycorisConfig`, the
fields of Hugging Face PEFT's ``LycorisConfig`` and of what its ``LoHaConfig`` / ``LoKrConfig`` have in common, under
PEFT's own names, and their reading of a PEFT config (an object or an ``adapter_config.json``). A method subclasses
it, adds its own fields and sets the class attributes ``who``, ``peft_type`` and ``example``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..._checks import boolean, integer, module_fields, names, positive, probability, real, regex
from .._common import config_of, pattern_matches
from .._wrapping import listed, peft_dict

Targets = list[str] | str

# peft 0.21.2's PeftConfig fields every LyCORIS config has besides its own (read or written as they are)
PEFT_BASE_FIELDS = frozenset(("auto_mapping", "base_model_name_or_path", "inference_mode", "peft_type", "peft_version",
                              "revision", "task_type"))
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class LycorisConfig:
    """Which modules a LyCORIS method adapts, and how: the fields LoHa and LoKr share (PEFT's names). Validated on
    construction; names are matched as Hugging Face PEFT matches them (`lightning_peft.peft._common`).

    Args:
        target_modules: The modules adapted: names or dotted suffixes (list), or a regular expression matched against
            the full name (string). ``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d`` (grouped too): PEFT's layers.
            ``"all-linear"``: every ``nn.Linear`` (and transformers ``Conv1D``, which is then refused, as PEFT refuses
            it) but the output head (the model's output embeddings, else its last linear layer) and
            ``modules_to_save``.
        exclude_modules: Modules never adapted, matched as ``target_modules``; it wins over them.
        r: The rank of the factors.
        alpha: The update is scaled by ``alpha / r``.
        rank_dropout: In training, the probability that a row (output channel) of the weight update is dropped for
            one forward (the kept rows rescaled as the method says).
        module_dropout: In training, the probability that a layer's whole update is skipped for one forward.
        use_effective_conv2d: For a convolution whose kernel is not 1: factor the kernel too (a Tucker core,
            FedPara's Proposition 3), instead of flattening the kernel into the input dimension.
        init_weights: Start with a zero update (the adapted model then equals the base); False draws every factor at
            random (PEFT's, for tests).
        layers_to_transform: Adapt only the targets inside these numbered layers (an index or a list), read as PEFT
            reads it; ``target_modules`` must then be a list.
        layers_pattern: The name of the ``nn.ModuleList`` ``layers_to_transform`` counts in (e.g. ``"layers"``);
            None: any.
        rank_pattern: Per-module ranks, ``{regex: r}``; a key matches the end of a module's name (PEFT's rule).
        alpha_pattern: Per-module alphas, ``{regex: alpha}``, as ``rank_pattern``.
        modules_to_save: Modules trained and saved in full (e.g. a new classifier head), names or suffixes. None: a
            Hugging Face task model's head (which ``from_pretrained`` creates at random); ``[]``: none.
    """

    who: ClassVar[str] = "Lycoris"  # the method's name in messages ("LoHa")
    peft_type: ClassVar[str] = ""  # PEFT's peft_type ("LOHA")
    example: ClassVar[str] = "['query', 'value']"

    target_modules: Targets
    exclude_modules: Targets | None = None
    r: int = 8
    alpha: float = 8
    rank_dropout: float = 0.0
    module_dropout: float = 0.0
    use_effective_conv2d: bool = False
    init_weights: bool = True
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    modules_to_save: list[str] | None = None

    def __post_init__(self) -> None:
        who, normal = self.who, object.__setattr__  # frozen: normalised values; the caller's objects are not mutated
        module_fields(self, who, example=self.example)
        normal(self, "r", _rank(who, "r", self.r))
        normal(self, "alpha", _alpha(who, "alpha", self.alpha))
        for name in ("rank_dropout", "module_dropout"):
            normal(self, name, probability(who, name, getattr(self, name)))
        boolean(who, "use_effective_conv2d", self.use_effective_conv2d)
        self.check_init_weights()
        for name, check in (("rank_pattern", _rank), ("alpha_pattern", _alpha)):
            patterns = getattr(self, name)
            if not isinstance(patterns, dict):
                raise TypeError(f"{who}({name}={patterns!r}): give a dict {{regex: value}}, e.g. {{'query': 16}}.")
            for key in patterns:
                regex(who, f"{name} key", key)
            normal(self, name, {k: check(who, f"{name}[{k!r}]", v) for k, v in patterns.items()})
        self._check_layers()

    def check_init_weights(self) -> None:
        """Refuse an ``init_weights`` the method does not know (LoHa: True or False)."""
        boolean(self.who, "init_weights", self.init_weights)

    def _check_layers(self) -> None:
        """PEFT's rules for ``layers_to_transform`` / ``layers_pattern``; it refuses the same combinations."""
        who, layers, pattern = self.who, self.layers_to_transform, self.layers_pattern
        if (layers is not None or pattern is not None) and isinstance(self.target_modules, str):
            raise ValueError(f"{who}(layers_to_transform={layers!r}, target_modules={self.target_modules!r}): "
                             "layers_to_transform needs target_modules as a list of names (PEFT refuses the same); a "
                             r"regular expression can name the layers itself, e.g. r'.*\.layers\.(0|1)\.q_proj'.")
        if isinstance(layers, (list, tuple)):
            object.__setattr__(self, "layers_to_transform", [
                integer(who, "layers_to_transform", i, minimum=0, example="[0, 1]") for i in layers])
        elif layers is not None:
            integer(who, "layers_to_transform", layers, minimum=0, example="[0, 1] or 0")
        if pattern is None:
            return
        if layers is None:
            raise ValueError(f"{who}(layers_pattern={pattern!r}): layers_pattern only says where layers_to_transform "
                             "counts layers; give layers_to_transform too, e.g. [0, 1].")
        entries = [pattern] if isinstance(pattern, str) else names(who, "layers_pattern", pattern, example="'layers'")
        if not entries or "" in entries:
            raise ValueError(f"{who}(layers_pattern={pattern!r}): give the name of the ModuleList holding the layers, "
                             "e.g. 'layers' or 'h'.")
        for entry in entries:
            regex(who, "layers_pattern", entry)
        if not isinstance(pattern, str):
            object.__setattr__(self, "layers_pattern", entries)

    def rank_for(self, name: str) -> int:
        """``r`` of module ``name`` (a full name): the first ``rank_pattern`` key matching its end, else ``r``."""
        return next((v for k, v in self.rank_pattern.items() if pattern_matches(k, name)), self.r)

    def alpha_for(self, name: str) -> float:
        """``alpha`` of module ``name``, as `rank_for`."""
        return next((v for k, v in self.alpha_pattern.items() if pattern_matches(k, name)), self.alpha)

    def rank_field(self, name: str) -> str:
        """The field that sets the rank of ``name``, for messages (``"r"`` or ``"rank_pattern['q']"``)."""
        return next((f"rank_pattern[{k!r}]" for k in self.rank_pattern if pattern_matches(k, name)), "r")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``type(config)(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)

    @classmethod
    def peft_fields(cls) -> frozenset[str]:
        """The fields of PEFT's config of this method (ours, under the same names, and PEFT's base fields)."""
        return PEFT_BASE_FIELDS | {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_peft(cls, config: Any, source: str | None = None) -> LycorisConfig:
        """Translate a Hugging Face PEFT config of this method (object or dict) to ours: the fields have PEFT's
        names, so each is read as it is (a set as a sorted list)."""
        source = source or f"peft.{cls.__name__}"
        config = peft_dict(config, cls.peft_type, source)
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: listed(v) for k, v in config.items() if k in fields and v is not None}
        for name in ("rank_pattern", "alpha_pattern"):
            values[name] = values.get(name) or {}
        try:
            return cls(**values)
        except (TypeError, ValueError) as err:  # a value the config refuses: the message names the file
            raise type(err)(f"load_adapter: {source} holds a value {cls.who} refuses: {err}") from None

    @classmethod
    def of(cls, config: object, kwargs: dict[str, Any], who: str) -> LycorisConfig:
        """A config of this class from a config object or keyword arguments (not both)."""
        return config_of(cls, config, kwargs, who, f"{cls.who} layers")


def _rank(who: str, name: str, value: object) -> int:
    return integer(who, name, value, minimum=1, example="8")


def _alpha(who: str, name: str, value: object) -> float:
    alpha = positive(who, name, value, example="8")
    real(who, name, value, maximum=FLOAT32_MAX, example="8",
         meaning="float32's largest value; an alpha beyond it makes every output inf or NaN")
    return value if isinstance(value, int) else alpha  # an int alpha stays an int (PEFT's files write it so)
