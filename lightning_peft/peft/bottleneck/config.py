"""The bottleneck adapters' settings: [`BottleneckConfig`][lightning_peft.peft.BottleneckConfig] and the
``adapter_config.json`` it is saved as (see `lightning_peft.peft.bottleneck.model` for the technique and the file format)."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Literal

from ..._checks import choice, integer, names, positive, probability, regex
from .._common import config_of
from .layer import NON_LINEARITIES

Placement = Literal["houlsby", "pfeiffer"]
Targets = list[str] | str

PEFT_TYPE = "LIGHTNING_PEFT_BOTTLENECK"
FORMAT_VERSION = 1
DEFAULT_REDUCTION_FACTOR = 16
DEFAULT_INIT_SCALE = 1e-2
_WHO = "BottleneckAdapters"


@dataclass(frozen=True)
class BottleneckConfig:
    """Where the adapters go and what they are. Validated on construction.

    Args:
        placement: ``"houlsby"`` (after the attention output and the feed-forward output of every layer) or
            ``"pfeiffer"`` (after the feed-forward output only) on BERT-, GPT-2- and Llama-style models.
            None: ``"houlsby"``, unless ``target_modules`` is given (giving both is refused).
        target_modules: For any other model: module names or dotted suffixes (list), or a regular expression
            matched against the full name (string).
        reduction_factor: The bottleneck is ``max(1, d // reduction_factor)`` for a module of output size ``d``.
            None: 16, unless ``bottleneck_size`` is given (giving both is refused).
        bottleneck_size: The bottleneck size ``m`` of every adapter, instead of a reduction factor.
        non_linearity: ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"`` (or ``"swish"``) or ``"tanh"``.
        dropout: Dropout probability on the adapter's output, before the residual add, in [0, 1).
        init_scale: Standard deviation of the (truncated) normal initialisation of ``W_down``; positive.
        modules_to_save: Modules trained and saved in full (e.g. a new classifier head), names or suffixes.
            None: a Hugging Face task model's head (``classifier`` / ``score`` / ``qa_outputs``, which
            ``from_pretrained`` creates at random), unless another adapter already saves it; ``[]``: none.
    """

    placement: Placement | None = None
    target_modules: Targets | None = None
    reduction_factor: float | None = None
    bottleneck_size: int | None = None
    non_linearity: str = "relu"
    dropout: float = 0.0
    init_scale: float = DEFAULT_INIT_SCALE
    modules_to_save: list[str] | None = None

    def __post_init__(self) -> None:
        normal = object.__setattr__  # frozen dataclass: normalised values; the caller's objects are not mutated
        normal(self, "placement", _as_placement(self.placement, self.target_modules))
        if self.target_modules is not None:
            normal(self, "target_modules", _as_targets(self.target_modules))
        normal(self, "reduction_factor", _as_reduction_factor(self.reduction_factor, self.bottleneck_size))
        if self.bottleneck_size is not None:
            normal(self, "bottleneck_size", integer(_WHO, "bottleneck_size", self.bottleneck_size, minimum=1,
                                                    example="24"))
        choice(_WHO, "non_linearity", self.non_linearity, NON_LINEARITIES)
        normal(self, "dropout", probability(_WHO, "dropout", self.dropout))
        normal(self, "init_scale", positive(_WHO, "init_scale", self.init_scale, example="0.01"))
        if self.modules_to_save is not None:
            normal(self, "modules_to_save", names(_WHO, "modules_to_save", self.modules_to_save))

    def size_for(self, d: int) -> int:
        """The bottleneck size of an adapter on a module of output size ``d``."""
        if self.bottleneck_size is not None:
            return self.bottleneck_size
        return max(1, int(d // self.reduction_factor))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``BottleneckConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)


def _as_placement(placement: object, target_modules: object) -> Placement | None:
    if placement is not None:
        choice(_WHO, "placement", placement, ("houlsby", "pfeiffer"))
    if placement is not None and target_modules is not None:
        raise ValueError(
            f"BottleneckAdapters(placement={placement!r}, target_modules={target_modules!r}): give one of them; "
            "placement picks the modules on BERT-, GPT-2- and Llama-style models, target_modules on any model."
        )
    return "houlsby" if target_modules is None and placement is None else placement


def _as_targets(value: object) -> Targets:
    if isinstance(value, str):
        return regex(_WHO, "target_modules", value)
    if isinstance(value, (list, tuple, set, frozenset)) and value and all(isinstance(v, str) for v in value):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    raise TypeError(
        f"BottleneckAdapters(target_modules={value!r}): give a non-empty list of module names or dotted suffixes "
        "(e.g. ['attention.output.dense', 'mlp.c_proj']) or a regular expression string."
    )


def _as_reduction_factor(value: object, bottleneck_size: object) -> float | None:
    if value is not None and bottleneck_size is not None:
        raise ValueError(
            f"BottleneckAdapters(reduction_factor={value!r}, bottleneck_size={bottleneck_size!r}): give one of them; "
            "the bottleneck is either d // reduction_factor or bottleneck_size."
        )
    if value is None:
        return DEFAULT_REDUCTION_FACTOR if bottleneck_size is None else None
    factor = positive(_WHO, "reduction_factor", value, example="16")
    return int(value) if isinstance(value, numbers.Integral) else factor  # 4 stays 4 in configs and messages


def as_config(config: object, kwargs: dict[str, Any], who: str) -> BottleneckConfig:
    """A [`BottleneckConfig`][lightning_peft.peft.BottleneckConfig] from a config object or keyword arguments (not
    both)."""
    return config_of(BottleneckConfig, config, kwargs, who, "bottleneck adapters")


FILE_FIELDS = frozenset({"peft_type", "format_version", "base_model_name_or_path", "placement", "target_modules",
                         "reduction_factor", "bottleneck_size", "non_linearity", "dropout", "init_scale",
                         "modules_to_save"})


def config_from_file(config: dict[str, Any], source: str) -> tuple[BottleneckConfig, list[str], list[str]]:
    """(config, exact target names, exact modules_to_save names) from our ``adapter_config.json`` content, whose
    version and fields [`load_adapter`][lightning_peft.peft.load_adapter] has checked (``FILE_FIELDS``)."""
    if config.get("peft_type") != PEFT_TYPE:
        raise ValueError(f"load_adapter: {source} has peft_type={config.get('peft_type')!r}, not {PEFT_TYPE!r}.")
    for key in ("target_modules", "modules_to_save"):
        names = config.get(key)
        listed = isinstance(names, list) and all(isinstance(n, str) for n in names)
        if not listed or (key == "target_modules" and not names):
            raise ValueError(f"load_adapter: {source} has {key}={names!r}; it must be a list of full module names.")
    if config.get("reduction_factor") is None and config.get("bottleneck_size") is None:
        raise ValueError(f"load_adapter: {source} has neither reduction_factor nor bottleneck_size; it is not a "
                         "complete bottleneck adapter config.")
    targets, to_save = list(config["target_modules"]), list(config["modules_to_save"])
    placement = config.get("placement")
    try:
        ours = BottleneckConfig(
            placement=placement,
            target_modules=None if placement else targets,
            reduction_factor=config.get("reduction_factor"),
            bottleneck_size=config.get("bottleneck_size"),
            non_linearity=config.get("non_linearity"),
            dropout=config.get("dropout", 0.0),
            init_scale=config.get("init_scale", DEFAULT_INIT_SCALE),
            modules_to_save=to_save,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"load_adapter: {source}: {err}") from None
    return ours, targets, to_save
