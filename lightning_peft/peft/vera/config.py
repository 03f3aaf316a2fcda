"""VeRA's settings: [`VeraConfig`][lightning_peft.peft.VeraConfig], and its reading of a Hugging Face PEFT ``VeraConfig``
(an object or an ``adapter_config.json``). See `lightning_peft.peft.vera.model` for the technique."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from ..._checks import boolean, choice, integer, names, probability, real, regex, target_names
from .._common import config_of
from .._wrapping import listed, peft_dict

Targets = list[str] | str
Bias = Literal["none", "vera_only", "all"]

PEFT_TYPE = "VERA"
PEFT_FIELDS = frozenset((  # peft 0.21.2's VeraConfig
    "auto_mapping", "base_model_name_or_path", "bias", "d_initial", "fan_in_fan_out", "inference_mode",
    "init_weights", "layers_pattern", "layers_to_transform", "modules_to_save", "peft_type", "peft_version",
    "projection_prng_key", "r", "revision", "save_projection", "target_modules", "task_type", "vera_dropout",
))
_EXAMPLE = "['query', 'value']"  # target_modules, for the messages
WHO = "VeRA"
_SEEDS = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class VeraConfig:
    """Which modules VeRA adapts, and how. Validated on construction; names are matched as Hugging Face PEFT matches
    them (`lightning_peft.peft._common`).

    Args:
        target_modules: The modules that get scaling vectors: names or dotted suffixes (list), or a regular
            expression matched against the full name (string). ``nn.Linear`` and transformers' ``Conv1D`` (PEFT's
            VeRA layers); their weights may have different shapes (the shared projections are sized to the largest).
        rank: The rows of the shared random ``A`` (PEFT's ``r``); VeRA's ranks are larger than LoRA's (256).
        projection_prng_key: The seed the shared projections are drawn from (so a file without them is rebuilt).
        save_projection: Write the projections into PEFT-format files (``vera_A`` / ``vera_B``); False: only the
            seed, and the loader draws them again. Training checkpoints always hold them.
        dropout: Dropout on the adapter branch's input (PEFT's ``vera_dropout``).
        d_initial: The initial value of every ``vera_lambda_d`` entry (``vera_lambda_b`` starts at zero, so the
            adapted model starts equal to the base).
        bias: Which biases train as well: ``"none"``, ``"vera_only"`` (the adapted layers') or ``"all"``.
        modules_to_save: Modules trained and saved in full (e.g. a new classifier head), names or suffixes. None:
            a Hugging Face task model's head (which ``from_pretrained`` creates at random); ``[]``: none.
        init_weights: Start at ``lambda_b = 0``, ``lambda_d = d_initial``; False: ``lambda_b = 1`` and a standard
            normal ``lambda_d`` (PEFT's, for tests).
        layers_to_transform: Adapt only the targets inside these layers (an index or a list), as PEFT reads it.
        layers_pattern: The name of the ``ModuleList`` holding those layers (e.g. ``"layers"``, ``"h"``); None:
            the first numbered list. Only with ``layers_to_transform``.
    """

    target_modules: Targets
    rank: int = 256
    projection_prng_key: int = 0
    save_projection: bool = True
    dropout: float = 0.0
    d_initial: float = 0.1
    bias: Bias = "none"
    modules_to_save: list[str] | None = None
    init_weights: bool = True
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None

    def __post_init__(self) -> None:
        normal = object.__setattr__  # frozen dataclass: normalised values; the caller's objects are not mutated
        normal(self, "target_modules", target_names(WHO, "target_modules", self.target_modules, example=_EXAMPLE,
                                                    all_linear=False))
        normal(self, "rank", integer(WHO, "rank", self.rank, minimum=1, example="256"))
        normal(self, "projection_prng_key", integer(WHO, "projection_prng_key", self.projection_prng_key,
                                                    minimum=_SEEDS[0], maximum=_SEEDS[1], example="0"))
        boolean(WHO, "save_projection", self.save_projection)
        normal(self, "dropout", probability(WHO, "dropout", self.dropout))
        normal(self, "d_initial", real(WHO, "d_initial", self.d_initial, example="0.1"))
        choice(WHO, "bias", self.bias, ("none", "vera_only", "all"))
        if self.modules_to_save is not None:
            normal(self, "modules_to_save", names(WHO, "modules_to_save", self.modules_to_save))
        boolean(WHO, "init_weights", self.init_weights)
        self._check_layers()

    def _check_layers(self) -> None:
        layers, pattern = self.layers_to_transform, self.layers_pattern
        if pattern is not None and layers is None:  # PEFT refuses the same
            raise ValueError(f"VeRA(layers_pattern={pattern!r}): layers_pattern only says where layers_to_transform "
                             "counts layers; give layers_to_transform too, e.g. [0, 1].")
        if layers is None:
            return
        if isinstance(self.target_modules, str):  # PEFT would ignore the layers silently
            raise ValueError(  # noqa: TRY004 (two values that do not go together, not one of a wrong type)
                f"VeRA(layers_to_transform={layers!r}, target_modules={self.target_modules!r}): "
                "layers_to_transform needs target_modules as a list of names, e.g. ['query', 'value']; "
                r"a regular expression can name the layers itself, e.g. r'.*\.layer\.(0|1)\..*query'.")
        listed = layers if isinstance(layers, (list, tuple)) else [layers]
        valid = [integer(WHO, "layers_to_transform", i, minimum=0, example="[0, 1] or 0") for i in listed]
        object.__setattr__(self, "layers_to_transform", valid if isinstance(layers, (list, tuple)) else valid[0])
        if pattern is not None:
            entries = [pattern] if isinstance(pattern, str) else names(WHO, "layers_pattern", pattern,
                                                                         example="'layers'")
            if not entries or "" in entries:
                raise ValueError(f"VeRA(layers_pattern={pattern!r}): give the name of the ModuleList holding the "
                                 "layers, e.g. 'layers' or 'h', or None for any.")
            for entry in entries:
                regex(WHO, "layers_pattern", entry)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``VeraConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_peft(cls, config: Any, source: str = "peft.VeraConfig") -> VeraConfig:
        """Translate a Hugging Face PEFT ``VeraConfig`` (object or dict) to a
        [`VeraConfig`][lightning_peft.peft.VeraConfig] (``fan_in_fan_out`` is not read: PEFT sets it per layer, as
        lightning-peft does)."""
        config = peft_dict(config, PEFT_TYPE, source)
        ours = {"target_modules": "target_modules", "rank": "r", "projection_prng_key": "projection_prng_key",
                "save_projection": "save_projection", "dropout": "vera_dropout", "d_initial": "d_initial",
                "bias": "bias", "modules_to_save": "modules_to_save", "init_weights": "init_weights",
                "layers_to_transform": "layers_to_transform", "layers_pattern": "layers_pattern"}
        try:
            return cls(**{field: listed(config[key]) for field, key in ours.items() if key in config})
        except (TypeError, ValueError) as err:  # a value VeraConfig refuses: the message names the file
            raise type(err)(f"load_adapter: {source} holds a value VeRA refuses: {err}") from None


def as_config(config: object, kwargs: dict[str, Any], who: str) -> VeraConfig:
    """A [`VeraConfig`][lightning_peft.peft.VeraConfig] from a config object or keyword arguments (not both)."""
    return config_of(VeraConfig, config, kwargs, who, "VeRA layers")
