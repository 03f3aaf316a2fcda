"""IA³'s settings: [`IA3Config`][lightning_peft.peft.IA3Config], and its reading of a Hugging Face PEFT ``IA3Config``
(an object or an ``adapter_config.json``). See `lightning_peft.peft.ia3.model` for the technique."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from ..._checks import boolean, names, target_names
from .._common import config_of
from .._wrapping import listed, peft_dict

Targets = list[str] | str

PEFT_TYPE = "IA3"
PEFT_FIELDS = frozenset((  # peft 0.21.2's IA3Config
    "auto_mapping", "base_model_name_or_path", "exclude_modules", "fan_in_fan_out", "feedforward_modules",
    "inference_mode", "init_ia3_weights", "modules_to_save", "peft_type", "peft_version", "revision",
    "target_modules", "task_type",
))
_EXAMPLE = "['k', 'v', 'wo']"  # target_modules, for the messages
WHO = "IA3"


@dataclass(frozen=True)
class IA3Config:
    """Which modules IA³ scales, and how. Validated on construction; names are matched as Hugging Face PEFT matches
    them (`lightning_peft.peft._common`).

    Args:
        target_modules: The modules that get a learned vector: names or dotted suffixes (list), a regular
            expression matched against the full name (string), or ``"all-linear"`` (every ``nn.Linear`` and
            ``Conv1D`` but the output head and ``modules_to_save``, as LoRA resolves it). ``nn.Linear``,
            transformers' ``Conv1D``, ``nn.Conv2d`` and ``nn.Conv3d`` (PEFT's IA³ layers).
        feedforward_modules: The targets whose *input* is scaled (the paper's feed-forward rescaling, ``l_ff``);
            every other target's output is scaled. A list is matched as PEFT matches it, by plain suffix
            (``name.endswith(entry)``), and must be a subset of a ``target_modules`` list; a string is a regular
            expression matched against the full name. None: no feed-forward module.
        exclude_modules: Modules never adapted, matched as ``target_modules``; it wins over them.
        modules_to_save: Modules trained and saved in full (e.g. a new classifier head), names or suffixes. None:
            a Hugging Face task model's head (which ``from_pretrained`` creates at random); ``[]``: none.
        init_ia3_weights: Start every vector at ones (the adapted model then equals the base); False draws it from
            a standard normal (PEFT's, for tests).
    """

    target_modules: Targets
    feedforward_modules: Targets | None = None
    exclude_modules: Targets | None = None
    modules_to_save: list[str] | None = None
    init_ia3_weights: bool = True

    def __post_init__(self) -> None:
        normal = object.__setattr__  # frozen dataclass: normalised values; the caller's objects are not mutated
        for field in ("target_modules", "feedforward_modules", "exclude_modules"):
            value = getattr(self, field)
            if value is not None or field == "target_modules":
                normal(self, field, target_names(WHO, field, value, example=_EXAMPLE))
        ff, targets = self.feedforward_modules, self.target_modules
        if isinstance(ff, list) and isinstance(targets, list) and not set(ff) <= set(targets):
            raise ValueError(  # PEFT refuses the same ("`feedforward_modules` should be a subset of `target_modules`")
                f"IA3(feedforward_modules={ff!r}, target_modules={targets!r}): feedforward_modules must be a subset of "
                f"target_modules; {sorted(set(ff) - set(targets))} is not among them. Add it to target_modules or "
                "remove it."
            )
        if self.modules_to_save is not None:
            normal(self, "modules_to_save", names(WHO, "modules_to_save", self.modules_to_save))
        boolean(WHO, "init_ia3_weights", self.init_ia3_weights)

    def is_feedforward(self, name: str) -> bool:
        """Whether module ``name`` (a full name) is scaled at its input, read as PEFT reads ``feedforward_modules``."""
        ff = self.feedforward_modules
        if ff is None:
            return False
        return re.fullmatch(ff, name) is not None if isinstance(ff, str) else any(name.endswith(entry) for entry in ff)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``IA3Config(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_peft(cls, config: Any, source: str = "peft.IA3Config") -> IA3Config:
        """Translate a Hugging Face PEFT ``IA3Config`` (object or dict) to an
        [`IA3Config`][lightning_peft.peft.IA3Config] (``fan_in_fan_out`` is not read: PEFT sets it per layer, as
        lightning-peft does)."""
        config = peft_dict(config, PEFT_TYPE, source)
        try:
            return cls(target_modules=listed(config["target_modules"]),
                       feedforward_modules=listed(config.get("feedforward_modules")),
                       exclude_modules=listed(config.get("exclude_modules")),
                       modules_to_save=config.get("modules_to_save"),
                       init_ia3_weights=config.get("init_ia3_weights", True))
        except (TypeError, ValueError) as err:  # a value IA3Config refuses: the message names the file
            raise type(err)(f"load_adapter: {source} holds a value IA³ refuses: {err}") from None


def as_config(config: object, kwargs: dict[str, Any], who: str) -> IA3Config:
    """An [`IA3Config`][lightning_peft.peft.IA3Config] from a config object or keyword arguments (not both)."""
    return config_of(IA3Config, config, kwargs, who, "IA³ layers")
