"""AdaLoRA's settings: [`AdaLoraConfig`][lightning_peft.peft.AdaLoraConfig], and its reading of a Hugging Face PEFT
``AdaLoraConfig`` (an object or an ``adapter_config.json``). See `lightning_peft.peft.adalora.model` for the technique
and `lightning_peft.peft.adalora.allocator` for the schedule these fields steer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..._checks import boolean, integer, module_fields, probability, real
from .._common import config_of
from .._wrapping import listed, peft_dict

Targets = list[str] | str

PEFT_TYPE = "ADALORA"
_EXAMPLE = "['query', 'value']"  # target_modules, for the messages
WHO = "AdaLoRA"
# peft 0.21.2's AdaLoraConfig fields (LoraConfig's and its own); load_adapter warns about any other
PEFT_FIELDS = frozenset((
    "alora_invocation_tokens", "alpha_pattern", "arrow_config", "auto_mapping", "base_model_name_or_path", "beta1",
    "beta2", "bias", "corda_config", "deltaT", "ensure_weight_tying", "eva_config", "exclude_modules",
    "fan_in_fan_out", "inference_mode", "init_lora_weights", "init_r", "kasa_config", "layer_replication",
    "layers_pattern", "layers_to_transform", "loftq_config", "lora_alpha", "lora_bias", "lora_dropout",
    "lora_ga_config", "megatron_config", "megatron_core", "modules_to_save", "monteclora_config", "orth_reg_weight",
    "peft_type", "peft_version", "qalora_group_size", "r", "rank_pattern", "revision", "target_modules",
    "target_parameters", "target_r", "task_type", "tfinal", "tinit", "total_step", "trainable_token_indices",
    "use_bdlora", "use_dora", "use_qalora", "use_rslora", "velora_config",
))
# LoraConfig fields AdaLoRA's layers would run differently from PEFT with: refused unless at PEFT's default
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "bias": "none", "layer_replication": None,
                "target_parameters": None, "trainable_token_indices": None, "use_qalora": False, "use_bdlora": None,
                "alora_invocation_tokens": None, "arrow_config": None, "kasa_config": None, "monteclora_config": None,
                "velora_config": None}


@dataclass(frozen=True)
class AdaLoraConfig:
    """Which modules AdaLoRA adapts, and its rank budget schedule. Field names are PEFT's.

    Args:
        target_modules: Names or dotted suffixes (list), or a regular expression matched against the full name
            (string). ``nn.Linear``, transformers ``Conv1D`` and ``nn.Conv2d`` (PEFT's AdaLoRA layers).
        init_r: Every layer's rank at the start (PEFT's ``init_r``; PEFT's ``r`` is not used by AdaLoRA).
        target_r: The average rank the budget shrinks to (the final budget is ``target_r`` times the layer count).
        lora_alpha: The update's scale numerator: ``ΔW = B (A ⊙ E) * lora_alpha / (init_r + 1e-5)`` (0: ``init_r``).
        lora_dropout: Dropout on the adapter's input.
        tinit: Optimizer steps of warm-up at the full budget.
        tfinal: Optimizer steps at the end with the final mask fixed.
        deltaT: Mask every ``deltaT`` steps while the budget shrinks.
        beta1: EMA factor of the sensitivity ``|p * grad|``.
        beta2: EMA factor of its uncertainty.
        orth_reg_weight: Weight of the orthogonal regularisation ``mean ||P^T P - I||_F`` of ``A`` and ``B``.
        total_step: Optimizer steps of the whole run; None: the ``AdaLoRA`` callback takes the trainer's
            ``estimated_stepping_batches`` (PEFT requires it).
        rank_pattern: Per layer (``"<module>.lora_E"``), which of the ``init_r`` triplets a finished allocation kept:
            the factors are then that many rows (PEFT's resized save). None: all ``init_r``.
        exclude_modules: Modules never adapted, matched as ``target_modules``.
        modules_to_save: Modules trained and saved in full. None: a Hugging Face task model's head; ``[]``: none.
        layers_to_transform: Only these layer indices (with ``layers_pattern``), as PEFT reads them.
        layers_pattern: The name of the layer list for ``layers_to_transform``.
        init_lora_weights: PEFT's start (``E = 0``, ``A``, ``B`` ~ N(0, 0.02²): the base's output); False: all from
            a standard normal (PEFT's, for tests).
    """

    target_modules: Targets
    init_r: int = 12
    target_r: int = 8
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    tinit: int = 0
    tfinal: int = 0
    deltaT: int = 1
    beta1: float = 0.85
    beta2: float = 0.85
    orth_reg_weight: float = 0.5
    total_step: int | None = None
    rank_pattern: dict[str, list[bool]] | None = None
    exclude_modules: Targets | None = None
    modules_to_save: list[str] | None = None
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    init_lora_weights: bool = True

    def __post_init__(self) -> None:
        normal = object.__setattr__  # frozen dataclass: normalised values; the caller's objects are not mutated
        module_fields(self, WHO, example=_EXAMPLE, all_linear=False)
        for field in ("init_r", "target_r"):
            normal(self, field, integer(WHO, field, getattr(self, field), minimum=0 if field == "target_r" else 1))
        for field in ("tinit", "tfinal"):
            normal(self, field, integer(WHO, field, getattr(self, field), minimum=0))
        normal(self, "deltaT", integer(WHO, "deltaT", self.deltaT, minimum=1))
        normal(self, "lora_alpha", real(WHO, "lora_alpha", self.lora_alpha, minimum=0))
        normal(self, "lora_dropout", probability(WHO, "lora_dropout", self.lora_dropout))
        for field in ("beta1", "beta2"):  # PEFT asserts 0 < beta < 1
            normal(self, field, real(WHO, field, getattr(self, field), minimum=0, maximum=1, open_low=True,
                                     open_high=True, example="0.85"))
        normal(self, "orth_reg_weight", real(WHO, "orth_reg_weight", self.orth_reg_weight, minimum=0))
        boolean(WHO, "init_lora_weights", self.init_lora_weights)
        if self.total_step is not None:
            normal(self, "total_step", integer(WHO, "total_step", self.total_step, minimum=1))
            check_schedule(self, self.total_step)
        if self.rank_pattern is not None:
            normal(self, "rank_pattern", _as_pattern(self.rank_pattern, self.init_r))
        if isinstance(self.target_modules, str) and self.layers_to_transform is not None:
            raise ValueError(f"{WHO}(layers_to_transform={self.layers_to_transform!r}): give target_modules as a "
                             "list; layers_to_transform cannot pick layers for a regular expression (PEFT refuses it "
                             "too).")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``AdaLoraConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_peft(cls, config: Any, source: str = "peft.AdaLoraConfig") -> AdaLoraConfig:
        """Translate a Hugging Face PEFT ``AdaLoraConfig`` (object or dict) to an
        [`AdaLoraConfig`][lightning_peft.peft.AdaLoraConfig]. ``fan_in_fan_out`` is set per layer (as PEFT does);
        a LoRA-only setting AdaLoRA's layers do not have (``use_dora``, ``lora_bias``, ...) is refused."""
        config = peft_dict(config, PEFT_TYPE, source)
        for field, default in _UNSUPPORTED.items():
            if config.get(field, default) not in (default, {}, []):
                raise ValueError(f"load_adapter: {source} has {field}={config[field]!r}; lightning-peft's AdaLoRA "
                                 f"supports only {field}={default!r} (PEFT's AdaLoRA layers do not use it either).")
        pattern = config.get("rank_pattern") or None
        if pattern is not None:  # PEFT writes the adapter name out of the keys; an in-memory config may hold it
            pattern = {k.replace(".lora_E.default", ".lora_E"): v for k, v in pattern.items()}
        fields = {f.name for f in dataclasses.fields(cls)} - {"rank_pattern", "target_modules"}
        try:
            return cls(target_modules=listed(config["target_modules"]), rank_pattern=pattern,
                       **{k: listed(config[k]) for k in fields if config.get(k) is not None})
        except (TypeError, ValueError) as err:  # a value AdaLoraConfig refuses: the message names the file
            raise type(err)(f"load_adapter: {source} holds a value AdaLoRA refuses: {err}") from None


def check_schedule(config: AdaLoraConfig, total_step: int) -> None:
    """Raise unless ``tinit`` and ``tfinal`` leave ``total_step`` a budgeting phase (PEFT's rule)."""
    if config.tinit >= total_step - config.tfinal:
        raise ValueError(f"{WHO}(tinit={config.tinit}, tfinal={config.tfinal}, total_step={total_step}): the schedule "
                         "leaves no step to shrink the budget in (tinit must be below total_step - tfinal). Decrease "
                         "tinit or tfinal, or train for more steps.")


def _as_pattern(pattern: object, init_r: int) -> dict[str, list[bool]]:
    if not isinstance(pattern, dict) or not all(isinstance(v, (list, tuple)) for v in pattern.values()):
        raise TypeError(f"{WHO}(rank_pattern={pattern!r}): rank_pattern must map '<module>.lora_E' to a list of "
                        f"{init_r} booleans (the triplets kept), as PEFT writes it.")
    bad = {k: v for k, v in pattern.items() if len(v) != init_r or not all(isinstance(b, bool) for b in v)}
    if bad:
        key = next(iter(bad))
        raise ValueError(f"{WHO}(rank_pattern={{{key!r}: {bad[key]!r}, ...}}): each entry must hold init_r={init_r} "
                         "booleans (which of the init_r triplets were kept).")
    return {k: list(v) for k, v in pattern.items()}


def as_config(config: object, kwargs: dict[str, Any], who: str) -> AdaLoraConfig:
    """An [`AdaLoraConfig`][lightning_peft.peft.AdaLoraConfig] from a config object or keyword arguments (not
    both)."""
    return config_of(AdaLoraConfig, config, kwargs, who, "AdaLoRA layers")
