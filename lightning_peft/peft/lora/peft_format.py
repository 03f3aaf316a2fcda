"""LoRA in Hugging Face PEFT's format: the ``adapter_config.json`` a LoRA adapter writes, its tensors under PEFT's keys,
and the checks before loading PEFT's files.

`LoRAPeftFormat` answers the protocol's PEFT members; [`LoRAAdapter`][lightning_peft.peft.LoRAAdapter] is built on
it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, ClassVar

from torch import Tensor, nn

from .._base_identity import base_model_name, task_type
from .._common import exact_choice, matched, name_matches, pattern_matches, unmatched
from .._limits import factor_problem, scale_problem
from ..adapter import Adapter, clean_key, unwrap
from ..modules_to_save import plain_key, present_modules
from ..trainable_tokens import token_parameters
from . import init as starts
from .config import LoRAConfig, config_from_peft
from .conv import LoRAConv
from .layer import DEFAULT, Routing, lora_layers
from .mha import PEFT_CONTAINERS, PEFT_OUT_PROJ, warn_doubled_out_proj
from .param import LoRAParameter, plan_parameters
from .targets import adaptable_modules, adaptable_parameters, select_parameters, select_targets
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
    """A layer-relative key of one adapter without its adapter segment, in PEFT's layout: ``lora_A.x.weight`` ->
    ``lora_A.weight``, ``out_proj_lora_A.x.weight`` -> ``base_layer.out_proj.lora_A.weight``."""
    container, _, rest = key.partition(f".{adapter_name}")
    return PEFT_CONTAINERS.get(container, container) + rest


class LoRAPeftFormat(Adapter):
    """LoRA's answers to the protocol's PEFT members: its named adapters in Hugging Face PEFT's format. The base of
    [`LoRAAdapter`][lightning_peft.peft.LoRAAdapter] (`lightning_peft.peft.lora.model`), which holds the adapters and
    injects the ones PEFT's files describe (``from_peft``)."""

    peft_type: ClassVar[str] = "LORA"
    peft_fields: ClassVar[frozenset[str]] = PEFT_FIELDS
    converts_to_lora: ClassVar[bool] = True
    #: ``{adapter name: (config, full names of the modules it adapts)}`` (`LoRAAdapter`'s).
    adapters: dict[str, tuple[LoRAConfig, tuple[str, ...]]]
    modules_to_save: tuple[str, ...]
    routing: Routing
    targets: tuple[str, ...]  # every adapted module (`LoRAAdapter.targets`)

    def _name(self, adapter_name: str | None) -> str:
        name = adapter_name or self.routing.active or next(iter(self.adapters))
        if name not in self.adapters:
            raise ValueError(f"LoRA: no adapter named {name!r}; the model has {list(self.adapters)}.")
        return name

    def peft_state(self, model: nn.Module, adapter_name: str | None = None,
                   convert_to_lora: bool = False) -> dict[str, Tensor]:
        """Adapter ``adapter_name``'s (default: the active one) tensors (not detached) under the keys of PEFT's
        adapter files, without the prefix.

        The trained biases and ``modules_to_save`` are shared by every adapter, so each adapter's file has them.
        ``convert_to_lora``: an adapter whose start rewrote the base is written as a plain LoRA of rank ``2r`` on the
        original base (`lightning_peft.peft.lora.init`).
        """
        name = self._name(adapter_name)
        model = unwrap(model)
        state: dict[str, Tensor] = {}
        for target in self.adapters[name][1]:
            layer = model.get_submodule(target)
            state.update({f"{target}.{_peft_key(k, name)}": p for k, p in layer.adapter_parameters(name).items()})
            initial = layer.__dict__.get("initial_factors", {}).get(name)
            if convert_to_lora and initial is not None:
                keys = tuple(f"{target}.{_peft_key(k, name)}" for k in _factor_keys(layer, name))
                starts.converted(state, keys, initial)
        own = {id(p) for layer in lora_layers(model).values() for p in layer.adapter_parameters().values()}
        own |= {id(p) for p in token_parameters(model).values()}  # each adapter's own rows, under PEFT's key:
        state.update({k.removesuffix(f".{name}"): p for k, p in token_parameters(model, name).items()})
        shared = {k: v for k, v in self.state(model).items() if id(v) not in own}
        state.update(shared)
        return {clean_key(plain_key(k)): v for k, v in state.items()}

    def peft_config(self, model: nn.Module, adapter_name: str | None = None,
                    convert_to_lora: bool = False) -> dict[str, Any]:
        """Adapter ``adapter_name``'s ``adapter_config.json`` content (``convert_to_lora``: see `peft_state`)."""
        name = self._name(adapter_name)
        config, targets = self.adapters[name]
        every = {clean_key(_pattern_name(model, n)): unwrap(model).get_submodule(n) for n in targets}
        layers = {n: layer for n, layer in every.items() if not isinstance(layer, LoRAParameter)}
        parameters = sorted(set(every) - set(layers))  # PEFT's target_parameters: the full names
        specs = {n: layer.specs[name] for n, layer in every.items()}
        if starts.rewrites_base(config.init):
            config, specs = _converted_settings(config, specs, name, convert_to_lora)
        targets = exact_choice(list(layers), [n for n in adaptable_modules(unwrap(model))])
        return {
            "peft_type": "LORA",
            "task_type": task_type(model),
            "base_model_name_or_path": base_model_name(model),
            "inference_mode": True,
            "r": config.rank,
            "lora_alpha": config.alpha,
            "lora_dropout": config.dropout,
            "target_modules": targets,
            # the names are exact, so these change nothing PEFT adapts; PEFT refuses them beside a regular expression
            "layers_to_transform": config.layers_to_transform if isinstance(targets, list) else None,
            "layers_pattern": config.layers_pattern if isinstance(targets, list) else None,
            "exclude_modules": None,
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
            "rank_pattern": {re.escape(n): s.rank for n, s in specs.items() if s.rank != config.rank},
            "alpha_pattern": {re.escape(n): s.alpha for n, s in specs.items() if s.alpha != config.alpha},
            "bias": config.bias,
            "fan_in_fan_out": any(getattr(m, "fan_in_fan_out", False) for m in layers.values()),
            "init_lora_weights": "gaussian" if config.init == "gaussian" else True,  # (a converted start is plain)
            "use_rslora": config.use_rslora,
            "use_dora": config.use_dora,
            "trainable_token_indices": config.trainable_token_indices,
            "lora_bias": config.lora_bias,
            **({"target_parameters": parameters} if parameters else {}),
        }

    def peft_problems(self, model: nn.Module) -> list[str]:
        """Reasons PEFT would run the adapter differently (its convolution layers build ``A`` without the base's
        dilation and padding mode)."""
        problems = []
        for name in self.targets:
            layer = unwrap(model).get_submodule(name)
            if isinstance(layer, LoRAConv):
                base, kind = layer.base_layer, type(layer.base_layer).__name__
                if any(d != 1 for d in base.dilation):
                    problems.append(f"{name!r} is a {kind} with dilation={base.dilation}")
                if base.padding_mode != "zeros":
                    problems.append(f"{name!r} is a {kind} with padding_mode={base.padding_mode!r}")
        return problems

    def value_problems(self, model: nn.Module, state: dict[str, Tensor],
                       adapter_name: str | None = None) -> list[str]:
        """Why adapter ``adapter_name``'s scale, or its factors in ``state`` (PEFT's keys: the model's own tensors, or
        a file's), would overflow the dtype each adapted layer's base weight computes in (`peft._limits`)."""
        name = self._name(adapter_name)
        problems = []
        for target in self.adapters[name][1]:
            layer = unwrap(model).get_submodule(target)
            spec, dtype = layer.specs[name], layer._adapted().dtype
            problem = scale_problem(clean_key(target), spec.alpha, spec.rank, spec.use_rslora, dtype)
            if problem is None:
                a, b = (clean_key(plain_key(f"{target}.{_peft_key(k, name)}")) for k in _factor_keys(layer, name))
                if a in state and b in state:
                    problem = factor_problem(clean_key(target), state[a], state[b], spec.scaling, dtype)
            if problem is not None:
                problems.append(problem)
        return problems

    def check_peft_config(self, model: nn.Module, config: Any, source: str, adapter_name: str = DEFAULT) -> None:
        """Raise if PEFT ``config`` cannot be loaded into adapter ``adapter_name``, which ``model`` already has."""
        merged = [name for name, layer in lora_layers(model).items() if layer.merged]
        if merged:
            raise RuntimeError(f"load_adapter: layer {merged[0]!r} is merged; call unmerge_lora(model) before "
                               "loading.")
        ours = config_from_peft(config, source)
        have = self.adapters[adapter_name][0].trainable_token_indices
        if ours.trainable_token_indices != have:  # rows of other tokens would load into these silently
            raise ValueError(f"load_adapter: {source} sets trainable_token_indices={ours.trainable_token_indices!r}, "
                             f"but the model's LoRA adapter {adapter_name!r} trains {have!r}. Load it into a model "
                             "without LoRA layers, or inject with the file's trainable_token_indices.")
        for name in self.adapters[adapter_name][1]:
            spec = unwrap(model).get_submodule(name).specs[adapter_name]
            alpha = ours.alpha_for(_pattern_name(model, name))
            if (spec.alpha, spec.use_rslora) != (alpha, ours.use_rslora):
                raise ValueError(
                    f"load_adapter: {source} gives {name!r} alpha={alpha}, use_rslora={ours.use_rslora}, but the "
                    f"model's LoRA adapter {adapter_name!r} there has alpha={spec.alpha}, "
                    f"use_rslora={spec.use_rslora}; the adapter would be scaled differently. Load it into a model "
                    "without LoRA layers, or under another adapter_name."
                )
            for field, theirs, mine in (("use_dora", ours.use_dora, isinstance(spec.variant, DoRA)),
                                        ("lora_bias", ours.lora_bias, spec.lora_bias)):
                if theirs != mine:
                    raise ValueError(
                        f"load_adapter: {source} sets {field}={theirs}, but the model's LoRA adapter "
                        f"{adapter_name!r} at {name!r} has {field}={mine}. Load it into a model without LoRA layers, "
                        f"or inject with {field}={theirs}."
                    )

    @classmethod
    def check_peft_shapes(cls, model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], files,
                          inject: bool, adapter_name: str = DEFAULT) -> None:
        check_file_shapes(model, config, shapes, files, inject)
        warn_doubled_out_proj(config, shapes, str(files.config), adapter_name)


def _pattern_name(model: nn.Module, target: str) -> str:
    """The name ``rank_pattern`` and ``alpha_pattern`` match for adapted ``target``: its path, or for a parameter
    wrapper the parameter's full name (PEFT's)."""
    layer = unwrap(model).get_submodule(target)
    return layer.target_name if isinstance(layer, LoRAParameter) else target


def _converted_settings(config: LoRAConfig, specs: dict, name: str, convert: bool) -> tuple[LoRAConfig, dict]:
    """The settings of the rank-2r conversion of an adapter whose start rewrote the base; refused unconverted."""
    if not convert or starts.loftq_iterations(config.init):
        fix = ("only its merged export (merged_state_dict, unload_lora(model, merge=True), "
               "MergeOnSave(save_adapter=False)) represents the trained model" if starts.loftq_iterations(config.init) else
               "pass save_adapter(..., convert_to_lora=True) to write it as a plain LoRA of rank 2r on the original "
               "base (PEFT's path_initial_model_for_weight_conversion), or export the merged model")
        raise ValueError(f"save_adapter: adapter {name!r} started with init={config.init!r}, which rewrote the base "
                         "weights; its factors mean the trained model only on that rewritten base, and a PEFT file is "
                         f"loaded onto the original one. Nothing was written; {fix}.")
    factor = math.sqrt(2) if config.use_rslora else 2  # rank 2r with the same scale
    doubled = {n: dataclasses.replace(s, rank=2 * s.rank, alpha=s.alpha * factor) for n, s in specs.items()}
    return dataclasses.replace(config, rank=2 * config.rank, alpha=config.alpha * factor, init="kaiming"), doubled


def _factor_keys(layer, name: str) -> tuple[str, str]:
    """The layer-relative keys of adapter ``name``'s ``A`` and ``B`` (``lora_A.<name>.weight``, ...)."""
    keys = {id(p): k for k, p in layer.adapter_parameters(name).items()}
    return tuple(keys[id(p)] for p in layer.factors(name))


def config_for_model(model: nn.Module, config: dict[str, Any], source: str) -> LoRAConfig:
    """The [`LoRAConfig`][lightning_peft.peft.LoRAConfig] a PEFT ``adapter_config.json`` means on ``model``, read as
    PEFT reads it."""
    ours = config_from_peft(config, source)
    view = adaptable_modules(unwrap(model))
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
    if ours.target_parameters:  # so are parameter entries, while one matches
        found = matched(ours.target_parameters, parameters := adaptable_parameters(view))
        if found and (ours.layers_to_transform is not None or ours.exclude_modules):  # they narrow no parameter
            found = [n for n in parameters if name_matches(n, found)]  # in PEFT: each by its full name, as given
        ours = dataclasses.replace(ours, target_parameters=found or ours.target_parameters)
    return ours


# PEFT keys whose size along one dimension is the rank: lora_A (r, in, ...), lora_B (out, r, ...), as in PEFT.
_RANK_DIMS = {"lora_A.weight": 0, "lora_B.weight": 1, "lora_embedding_A": 0, "lora_embedding_B": 1}


def check_file_shapes(model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], files,
                      inject: bool) -> None:
    """LoRA's `Adapter.check_peft_shapes`: every factor in the file has the rank its own config gives its module,
    and (``inject``) every factor the config would allocate on ``model`` is in the file; raises before allocating."""
    ours = config_from_peft(config, str(files.config))
    model = unwrap(model)
    planned = {} if not ours.target_parameters else plan_parameters(
        model, select_parameters(model, config_for_model(model, config, str(files.config))))
    view = adaptable_modules(model)
    for key, shape in shapes.items():
        path, _, leaf = key.rpartition(".lora_")
        path = path.removesuffix(PEFT_OUT_PROJ)  # an attention module's out-projection has the module's rank
        dim = _RANK_DIMS.get(f"lora_{leaf}") if path else None
        if dim is None:
            continue
        rank = ours.rank_for(path)
        if path in planned:  # an expert stack's factors hold the rank once per expert
            module, parameter = planned[path]
            weight = getattr(model.get_submodule(module), parameter)
            rank = ours.rank_for(f"{module}.{parameter}") * (weight.shape[0] if weight.dim() == 3 else 1)
        groups = getattr(view.get(path), "groups", 1) if leaf == "B.weight" else 1  # a grouped B: (out, r / g, ...)
        if len(shape) <= dim or shape[dim] * groups != rank:
            field = next((f"rank_pattern[{k!r}]" for k in ours.rank_pattern if pattern_matches(k, path)), "r")
            raise files.torn(key, shape, dim, field, rank)
    if inject:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # from_peft reads the config next and warns then
            targets, _ = select_targets(model, config_for_model(model, config, str(files.config)))
        required = []
        for target in targets:
            embedding = isinstance(view[target], nn.Embedding)
            keys = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A.weight", "lora_B.weight")
            if isinstance(view[target], nn.MultiheadAttention):
                keys += tuple(f"{path}.weight" for path in PEFT_CONTAINERS.values())
            required += [f"{clean_key(target)}.{k}" for k in keys]
            required += [f"{clean_key(target)}.lora_B.bias"] if ours.lora_bias else []
        required += [f"{clean_key(path)}.lora_{k}.weight" for path in planned for k in "AB"]
        missing = [k for k in required if k not in shapes]
        if missing:
            raise files.lacking(missing, "its adapter config asks for", type(model).__name__)
