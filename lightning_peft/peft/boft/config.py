"""BOFT's settings: [`BOFTConfig`][lightning_peft.peft.BOFTConfig], and its reading of a Hugging Face PEFT
``BOFTConfig`` (an object or an ``adapter_config.json``). See `lightning_peft.peft.boft.model` for the technique."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..._checks import boolean, choice, integer, probability
from .._common import config_of
from .._wrapping import listed, peft_dict
from ..oft.config import OFTConfig

Targets = list[str] | str

PEFT_TYPE = "BOFT"
PEFT_FIELDS = frozenset((  # peft 0.21.2's BOFTConfig
    "auto_mapping", "base_model_name_or_path", "bias", "boft_block_num", "boft_block_size", "boft_dropout",
    "boft_n_butterfly_factor", "exclude_modules", "fan_in_fan_out", "inference_mode", "init_weights",
    "layers_pattern", "layers_to_transform", "modules_to_save", "peft_type", "peft_version", "revision",
    "target_modules", "task_type",
))
WHO = "BOFT"


@dataclass(frozen=True)
class BOFTConfig:
    """Which modules BOFT rotates, and how. Give exactly one of ``boft_block_size`` and ``boft_block_num`` (the other
    0): their product is the rotated size of every target (a Linear's input features, a Conv2d's
    ``in_channels * k * k``).

    Args:
        target_modules: ``nn.Linear`` / ``nn.Conv2d`` modules: names or dotted suffixes (list), or a regular
            expression matched against the full name (string).
        boft_block_size: The size of each block (0: from ``boft_block_num``). PEFT's default, 4.
        boft_block_num: The number of blocks (0: from ``boft_block_size``).
        boft_n_butterfly_factor: The number of butterfly factors (block-diagonal rotations, each between butterfly
            permutations); 1 is OFT with a scale. Every factor needs ``block_size * 2**(factor - 1)`` to divide the
            size, and even block sizes and counts when above 1.
        boft_dropout: Multiplicative dropout: in training, ``int(boft_dropout * blocks)`` random blocks of one random
            factor are the identity for a step (PEFT's).
        bias: Which biases train: ``"none"``, ``"boft_only"`` (the targets') or ``"all"``.
        init_weights: Start at the identity and unit scales; False draws both from normals (PEFT's, for tests).
        layers_to_transform: Only the targets in these layers (indices), as `OFTConfig`'s.
        layers_pattern: The name of the ``nn.ModuleList`` holding those layers (None: any).
        exclude_modules: Modules never adapted, matched as ``target_modules``; it wins over them.
        modules_to_save: Modules trained and saved in full, as [`OFTConfig`][lightning_peft.peft.OFTConfig]'s.
    """

    target_modules: Targets
    boft_block_size: int = 4
    boft_block_num: int = 0
    boft_n_butterfly_factor: int = 1
    boft_dropout: float = 0.0
    bias: str = "none"
    init_weights: bool = True
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    exclude_modules: Targets | None = None
    modules_to_save: list[str] | None = None

    who: ClassVar[str] = WHO  # its name in messages

    def __post_init__(self) -> None:
        # the name rules are OFT's: validate them through its config (messages say BOFT)
        try:
            checked = OFTConfig(target_modules=self.target_modules, exclude_modules=self.exclude_modules,
                                modules_to_save=self.modules_to_save, layers_to_transform=self.layers_to_transform,
                                layers_pattern=self.layers_pattern)
        except (TypeError, ValueError) as err:
            raise type(err)(str(err).replace("OFT(", "BOFT(", 1)) from None
        for field in ("target_modules", "exclude_modules", "modules_to_save", "layers_to_transform"):
            object.__setattr__(self, field, getattr(checked, field))
        integer(WHO, "boft_block_size", self.boft_block_size, minimum=0, example="4")
        integer(WHO, "boft_block_num", self.boft_block_num, minimum=0, example="8")
        if (self.boft_block_size == 0) == (self.boft_block_num == 0):
            raise ValueError(f"BOFT(boft_block_size={self.boft_block_size}, boft_block_num={self.boft_block_num}): "
                             "give exactly one of them and set the other to 0 (their product is the rotated size).")
        integer(WHO, "boft_n_butterfly_factor", self.boft_n_butterfly_factor, minimum=1, example="2")
        probability(WHO, "boft_dropout", self.boft_dropout)
        choice(WHO, "bias", self.bias, ("none", "boft_only", "all"))
        boolean(WHO, "init_weights", self.init_weights)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``BOFTConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_peft(cls, config: Any, source: str = "peft.BOFTConfig") -> BOFTConfig:
        """Translate a Hugging Face PEFT ``BOFTConfig`` (object or dict) to a
        [`BOFTConfig`][lightning_peft.peft.BOFTConfig]."""
        config = peft_dict(config, PEFT_TYPE, source)
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: listed(v) for k, v in config.items() if k in fields and v is not None}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as err:
            raise type(err)(f"load_adapter: {source} holds a value BOFT refuses: {err}") from None


def as_config(config: object, kwargs: dict[str, Any], who: str) -> BOFTConfig:
    """A [`BOFTConfig`][lightning_peft.peft.BOFTConfig] from a config object or keyword arguments (not both)."""
    return config_of(BOFTConfig, config, kwargs, who, "BOFT layers")
