"""OFT's settings: [`OFTConfig`][lightning_peft.peft.OFTConfig], and its reading of a Hugging Face PEFT ``OFTConfig``
(an object or an ``adapter_config.json``). See `lightning_peft.peft.oft.model` for the technique."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..._checks import boolean, choice, integer, module_fields, names, positive, probability, regex
from .._common import config_of
from .._wrapping import listed, peft_dict

Targets = list[str] | str

PEFT_TYPE = "OFT"
PEFT_FIELDS = frozenset((  # peft 0.21.2's OFTConfig
    "auto_mapping", "base_model_name_or_path", "bias", "block_share", "coft", "eps", "exclude_modules",
    "fan_in_fan_out", "inference_mode", "init_weights", "layers_pattern", "layers_to_transform", "module_dropout",
    "modules_to_save", "num_cayley_neumann_terms", "oft_block_size", "peft_type", "peft_version", "r", "revision",
    "target_modules", "task_type", "use_cayley_neumann",
))
# PEFT 0.18 changed the Cayley-Neumann series; files written before (without peft_version, which 0.18 added) differ
NEUMANN_SINCE = (0, 18)
_EXAMPLE = "['q_proj', 'v_proj']"  # target_modules, for the messages
WHO = "OFT"


@dataclass(frozen=True)
class OFTConfig:
    """Which modules OFT rotates, and how. Validated on construction; names are matched as Hugging Face PEFT matches
    them (`lightning_peft.peft._common`). Give exactly one of ``r`` and ``oft_block_size`` (the other 0):
    ``r * oft_block_size`` is the rotated size of every target (its input features; a convolution's
    ``in_channels * k * k``).

    Args:
        target_modules: The modules whose input is rotated: names or dotted suffixes (list), or a regular expression
            matched against the full name (string). ``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding`` (PEFT's OFT
            layers; an embedding's output is rotated).
        r: The number of diagonal blocks of the rotation (0: from ``oft_block_size``).
        oft_block_size: The size of each block (0: from ``r``). PEFT's default, 32.
        module_dropout: Multiplicative dropout: in training, ``int(module_dropout * r)`` random blocks are the
            identity for a step.
        bias: Which biases train: ``"none"``, ``"oft_only"`` (those of the targets) or ``"all"``.
        coft: Constrained OFT: before each use, each block's skew-symmetric matrix is projected onto the ball of
            Frobenius radius ``eps / sqrt(blocks)``, in place (the rotation stays within ``eps`` of the identity).
        eps: COFT's radius.
        block_share: One block, shared by all blocks of a layer (``oft_block_size * (oft_block_size - 1) / 2``
            parameters a layer).
        use_cayley_neumann: The Cayley transform through a truncated Neumann series (PEFT's default; no matrix
            inverse, nearly orthogonal for small parameters) instead of an exact solve.
        num_cayley_neumann_terms: The terms of that series.
        init_weights: Start at the identity rotation (zeros; the adapted model then equals the base); False draws
            from a normal of standard deviation 0.1 (PEFT's, for tests).
        layers_to_transform: Only the targets in these layers (indices; PEFT's rule, `_common.layer_of`).
        layers_pattern: The name of the ``nn.ModuleList`` holding those layers (None: any).
        exclude_modules: Modules never adapted, matched as ``target_modules``; it wins over them.
        modules_to_save: Modules trained and saved in full (e.g. a new classifier head), names or suffixes. None:
            a Hugging Face task model's head; ``[]``: none.
    """

    target_modules: Targets
    r: int = 0
    oft_block_size: int = 32
    module_dropout: float = 0.0
    bias: str = "none"
    coft: bool = False
    eps: float = 6e-5
    block_share: bool = False
    use_cayley_neumann: bool = True
    num_cayley_neumann_terms: int = 5
    init_weights: bool = True
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    exclude_modules: Targets | None = None
    modules_to_save: list[str] | None = None

    who: ClassVar[str] = WHO  # its name in messages

    def __post_init__(self) -> None:
        module_fields(self, WHO, example=_EXAMPLE, all_linear=False)
        integer(WHO, "r", self.r, minimum=0, example="4")
        integer(WHO, "oft_block_size", self.oft_block_size, minimum=0, example="32")
        if (self.r == 0) == (self.oft_block_size == 0):
            raise ValueError(f"OFT(r={self.r}, oft_block_size={self.oft_block_size}): give exactly one of them and set "
                             "the other to 0 (r * oft_block_size is the rotated size), e.g. r=0, oft_block_size=32.")
        probability(WHO, "module_dropout", self.module_dropout)
        choice(WHO, "bias", self.bias, ("none", "oft_only", "all"))
        for field in ("coft", "block_share", "use_cayley_neumann", "init_weights"):
            boolean(WHO, field, getattr(self, field))
        positive(WHO, "eps", self.eps, example="6e-5")
        integer(WHO, "num_cayley_neumann_terms", self.num_cayley_neumann_terms, minimum=1, example="5")
        self._check_layers()

    def _check_layers(self) -> None:
        """PEFT's rules for ``layers_to_transform`` / ``layers_pattern`` (`_common.in_layers` applies them)."""
        layers, pattern = self.layers_to_transform, self.layers_pattern
        if layers is not None and isinstance(self.target_modules, str):
            raise ValueError(f"OFT(layers_to_transform={layers!r}, target_modules={self.target_modules!r}): "
                             "layers_to_transform needs target_modules as a list of names; a regular expression can "
                             r"name the layers itself, e.g. r'.*\.layers\.(0|1)\.self_attn\.q_proj'.")
        if isinstance(layers, (list, tuple)):
            object.__setattr__(self, "layers_to_transform", [
                integer(WHO, "layers_to_transform", i, minimum=0, example="[0, 1]") for i in layers])
        elif layers is not None:
            integer(WHO, "layers_to_transform", layers, minimum=0, example="[0, 1] or 0")
        if pattern is not None and layers is None:
            raise ValueError(f"OFT(layers_pattern={pattern!r}): layers_pattern only says where layers_to_transform "
                             "counts layers; give layers_to_transform too, e.g. [0, 1].")
        if pattern is not None:
            entries = [pattern] if isinstance(pattern, str) else names(WHO, "layers_pattern", pattern,
                                                                       example="'layers'")
            for entry in entries:
                regex(WHO, "layers_pattern", entry)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``OFTConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_peft(cls, config: Any, source: str = "peft.OFTConfig") -> OFTConfig:
        """Translate a Hugging Face PEFT ``OFTConfig`` (object or dict) to an
        [`OFTConfig`][lightning_peft.peft.OFTConfig]. Refused as PEFT refuses them: a file from before PEFT 0.14
        (no ``oft_block_size``: another OFT); and, where PEFT warns, a Cayley-Neumann file from before PEFT 0.18
        (another series: it would compute something else)."""
        installed = not isinstance(config, dict)  # an object: the installed PEFT's own math
        config = peft_dict(config, PEFT_TYPE, source)
        if installed:
            config = {**config, "peft_version": None}
        elif "oft_block_size" not in config:
            raise ValueError(f"load_adapter: {source} has no oft_block_size: it was written by PEFT before 0.14, "
                             "whose OFT is another parameterization. Retrain it with PEFT >= 0.14.")
        elif config.get("use_cayley_neumann") and _version(config.get("peft_version")) < NEUMANN_SINCE:
            raise ValueError(
                f"load_adapter: {source} has use_cayley_neumann=True and peft_version="
                f"{config.get('peft_version')!r}: PEFT before 0.18 used another Cayley-Neumann series, so the "
                "rotation would differ from the trained one. Retrain with PEFT >= 0.18 (or use_cayley_neumann=False)."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: listed(v) for k, v in config.items() if k in fields and v is not None}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as err:  # a value OFTConfig refuses: the message names the file
            raise type(err)(f"load_adapter: {source} holds a value OFT refuses: {err}") from None


def _version(text: object) -> tuple[int, ...]:
    """``"0.21.2"`` (or ``"0.18.0@abc"``) as ``(0, 21, 2)``; a missing one as ``(0,)``."""
    if not isinstance(text, str):
        return (0,)
    parts = []
    for part in text.partition("@")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or (0,)


def as_config(config: object, kwargs: dict[str, Any], who: str) -> OFTConfig:
    """An [`OFTConfig`][lightning_peft.peft.OFTConfig] from a config object or keyword arguments (not both)."""
    return config_of(OFTConfig, config, kwargs, who, "OFT layers")
