"""LoRA in Hugging Face PEFT's format: the ``adapter_config.json`` a LoRA adapter writes, its tensors under PEFT's keys,
and the checks before loading PEFT's files.

[`LoRAAdapter`][lightning_peft.peft.LoRAAdapter] answers the protocol's PEFT members with these functions.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

from torch import Tensor, nn

from .._common import matched, pattern_matches, unmatched
from .._limits import factor_problem, scale_problem
from ..adapter import base_model_name, clean_key, unwrap
from ..modules_to_save import plain_key, present_modules
from .config import LoRAConfig, config_from_peft
from .layer import DEFAULT, LoRAConv2d, lora_layers
from .targets import _adaptable_view, _select, exact_targets
from .variants import DoRA

PEFT_FIELDS = frozenset((  # peft 0.21.2's LoraConfig
    "alora_invocation_tokens", "alpha_pattern", "arrow_config", "auto_mapping", "base_model_name_or_path", "bias",
    "corda_config", "ensure_weight_tying", "eva_config", "exclude_modules", "fan_in_fan_out", "inference_mode",
    "init_lora_weights", "kasa_config", "layer_replication", "layers_pattern", "layers_to_transform",
    "loftq_config", "lora_alpha", "lora_bias", "lora_dropout", "lora_ga_config", "megatron_config",
    "megatron_core", "modules_to_save", "monteclora_config", "peft_type", "peft_version", "qalora_group_size",
    "r", "rank_pattern", "revision", "runtime_config", "target_modules", "target_parameters", "task_type",
    "trainable_token_indices", "use_bdlora", "use_dora", "use_qalora", "use_rslora", "velora_config",
))


def _peft_key(key: str, adapter_name: str) -> str:
    """A layer-relative key of one adapter without its adapter segment: ``lora_A.x.weight`` -> ``lora_A.weight``."""
    container, _, rest = key.partition(f".{adapter_name}")
    return container + rest


def peft_state(adapter, model: nn.Module, name: str) -> dict[str, Tensor]:
    """Adapter ``name``'s tensors (not detached) under the keys of PEFT's adapter files, without the prefix.

    The trained biases and ``modules_to_save`` are shared by every adapter, so each adapter's file has them.
    """
    model = unwrap(model)
    state: dict[str, Tensor] = {}
    for target in adapter.adapters[name][1]:
        layer = model.get_submodule(target)
        state.update({f"{target}.{_peft_key(k, name)}": p for k, p in layer.adapter_parameters(name).items()})
    own = {id(p) for layer in lora_layers(model).values() for p in layer.adapter_parameters().values()}
    shared = {k: v for k, v in adapter.state(model).items() if id(v) not in own}
    state.update(shared)
    return {clean_key(plain_key(k)): v for k, v in state.items()}


def peft_config(adapter, model: nn.Module, name: str) -> dict[str, Any]:
    """Adapter ``name``'s ``adapter_config.json`` content."""
    config, targets = adapter.adapters[name]
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
        "modules_to_save": [clean_key(n) for n in adapter.modules_to_save] or None,
        "rank_pattern": {re.escape(n): s.rank for n, s in specs.items() if s.rank != config.rank},
        "alpha_pattern": {re.escape(n): s.alpha for n, s in specs.items() if s.alpha != config.alpha},
        "bias": config.bias,
        "fan_in_fan_out": any(getattr(m, "fan_in_fan_out", False) for m in layers.values()),
        "init_lora_weights": "gaussian" if config.init == "gaussian" else True,
        "use_rslora": config.use_rslora,
        "use_dora": config.use_dora,
    }


def peft_problems(adapter, model: nn.Module) -> list[str]:
    """Reasons PEFT would run the adapter differently (its Conv2d layer knows no dilation or padding mode)."""
    problems = []
    for name in adapter.targets:
        layer = unwrap(model).get_submodule(name)
        if isinstance(layer, LoRAConv2d):
            base = layer.base_layer
            if any(d != 1 for d in base.dilation):
                problems.append(f"{name!r} is a Conv2d with dilation={base.dilation}")
            if base.padding_mode != "zeros":
                problems.append(f"{name!r} is a Conv2d with padding_mode={base.padding_mode!r}")
    return problems


def value_problems(adapter, model: nn.Module, state: dict[str, Tensor], name: str) -> list[str]:
    """Why adapter ``name``'s scale, or its factors in ``state`` (PEFT's keys: the model's own tensors, or a file's),
    would overflow the dtype each adapted layer's base weight computes in (`lightning_peft.peft._limits`)."""
    problems = []
    for target in adapter.adapters[name][1]:
        layer = unwrap(model).get_submodule(target)
        spec, dtype = layer.specs[name], layer.base_layer.weight.dtype
        problem = scale_problem(clean_key(target), spec.alpha, spec.rank, spec.use_rslora, dtype)
        if problem is None:
            a, b = (clean_key(plain_key(f"{target}.{_peft_key(key, name)}")) for key in _factor_keys(layer, name))
            if a in state and b in state:
                problem = factor_problem(clean_key(target), state[a], state[b], spec.scaling, dtype)
        if problem is not None:
            problems.append(problem)
    return problems


def _factor_keys(layer, name: str) -> tuple[str, str]:
    """The layer-relative keys of adapter ``name``'s ``A`` and ``B`` (``lora_A.<name>.weight``, ...)."""
    keys = {id(p): k for k, p in layer.adapter_parameters(name).items()}
    return tuple(keys[id(p)] for p in layer.factors(name))


def check_peft_config(adapter, model: nn.Module, config: Any, source: str, adapter_name: str = DEFAULT) -> None:
    """Raise if PEFT ``config`` cannot be loaded into adapter ``adapter_name``, which ``model`` already has."""
    merged = [name for name, layer in lora_layers(model).items() if layer.merged]
    if merged:
        raise RuntimeError(f"load_adapter: layer {merged[0]!r} is merged; call unmerge_lora(model) before loading.")
    ours = config_from_peft(config, source)
    for name in adapter.adapters[adapter_name][1]:
        spec = unwrap(model).get_submodule(name).specs[adapter_name]
        alpha = ours.alpha_for(name)
        if (spec.alpha, spec.use_rslora) != (alpha, ours.use_rslora):
            raise ValueError(
                f"load_adapter: {source} gives {name!r} alpha={alpha}, use_rslora={ours.use_rslora}, but the "
                f"model's LoRA adapter {adapter_name!r} there has alpha={spec.alpha}, use_rslora={spec.use_rslora}; "
                "the adapter would be scaled differently. Load it into a model without LoRA layers, or under "
                "another adapter_name."
            )
        dora = isinstance(spec.variant, DoRA)
        if dora != ours.use_dora:
            raise ValueError(
                f"load_adapter: {source} sets use_dora={ours.use_dora}, but the model's LoRA adapter {adapter_name!r} "
                f"at {name!r} has use_dora={dora}. Load it into a model without LoRA layers, or inject "
                f"with use_dora={ours.use_dora}."
            )


def config_for_model(model: nn.Module, config: dict[str, Any], source: str) -> LoRAConfig:
    """The [`LoRAConfig`][lightning_peft.peft.LoRAConfig] a PEFT ``adapter_config.json`` means on ``model``, read as
    PEFT reads it."""
    ours = config_from_peft(config, source)
    view = _adaptable_view(unwrap(model))
    names = [n for n in view if n]
    # PEFT's SEQ_CLS task writes ["classifier", "score"] whatever the model calls its head: drop the absent.
    ours = dataclasses.replace(ours, modules_to_save=present_modules(unwrap(model), ours.modules_to_save, source))
    missing = unmatched(ours.target_modules, names)
    if missing and len(missing) < len(ours.target_modules):
        # PEFT accepts entries that match nothing when others match; its files are read as it reads them.
        warnings.warn(f"load_adapter: {source} lists target_modules {missing} that match no module of "
                      f"{type(unwrap(model)).__name__}; they are ignored, as PEFT ignores them.",
                      UserWarning, stacklevel=4)
        ours = dataclasses.replace(ours, target_modules=[t for t in ours.target_modules if t not in missing])
    if ours.exclude_modules is not None:  # PEFT ignores exclusions that match nothing: they change nothing it adapts
        ours = dataclasses.replace(ours, exclude_modules=matched(ours.exclude_modules, names))
    return ours


# PEFT keys whose size along one dimension is the rank: lora_A (r, in, ...), lora_B (out, r, ...), as in PEFT.
_RANK_DIMS = {"lora_A.weight": 0, "lora_B.weight": 1, "lora_embedding_A": 0, "lora_embedding_B": 1}


def check_file_shapes(model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], files,
                      inject: bool) -> None:
    """LoRA's `Adapter.check_peft_shapes`: every factor in the file has the rank its own config gives its module,
    and (``inject``) every factor the config would allocate on ``model`` is in the file; raises before allocating."""
    ours = config_from_peft(config, str(files.config))
    for key, shape in shapes.items():
        path, _, leaf = key.rpartition(".lora_")
        dim = _RANK_DIMS.get(f"lora_{leaf}") if path else None
        if dim is None:
            continue
        rank = ours.rank_for(path)
        if len(shape) <= dim or shape[dim] != rank:
            field = next((f"rank_pattern[{k!r}]" for k in ours.rank_pattern if pattern_matches(k, path)), "r")
            raise files.torn(key, shape, dim, field, rank)
    if inject:
        model = unwrap(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # from_peft reads the config next and warns then
            targets, _ = _select(model, config_for_model(model, config, str(files.config)))
        view = _adaptable_view(model)
        required = []
        for target in targets:
            embedding = isinstance(view[target], nn.Embedding)
            required += [f"{clean_key(target)}.{k}" for k in (
                ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A.weight", "lora_B.weight"))]
        missing = [k for k in required if k not in shapes]
        if missing:
            raise files.lacking(missing, "its adapter config asks for", type(model).__name__)
