r"""Scaffolding every PEFT technique shares: name matching for ``target_modules``, the task heads of Hugging Face
task models, the wrapper that stands in for a base layer, and the checks every inject function makes.

Name matching follows Hugging Face PEFT, so a config means the same thing in both: a list entry matches a module
whose full name equals it or ends with ``"." + entry``; a string is a regular expression matched against the whole
name (``re.fullmatch``).

>>> name_matches("encoder.layer.0.attention.self.query", ["query"])
True
>>> name_matches("encoder.layer.0.attention.self.query", r".*\.0\..*query")
True
>>> unmatched(["query", "qeury"], ["layer.0.query"])
['qeury']
"""

from __future__ import annotations

import dataclasses
import re
import sys
import warnings
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .adapter import Adapter, attached, unwrap

Targets = list[str] | str

# Hugging Face task models and the heads from_pretrained creates for them (PEFT's task types save the same).
_TASK_HEADS = {
    "ForSequenceClassification": ("classifier", "score"),
    "ForTokenClassification": ("classifier", "score"),
    "ForQuestionAnswering": ("qa_outputs",),
    "ForMultipleChoice": ("classifier",),
}
HEAD_NAMES = frozenset(name for heads in _TASK_HEADS.values() for name in heads)
HALF = (torch.float16, torch.bfloat16)
BASE_LAYER = "base_layer"


def pattern_matches(key: str, name: str) -> bool:
    return re.match(rf"(.*\.)?({key})$", name) is not None


def name_matches(name: str, targets: Targets) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in targets)


def unmatched(targets: Targets, names: Iterable[str]) -> list[str]:
    """The entries of a ``target_modules`` list that match none of ``names`` (a regex string: none)."""
    if isinstance(targets, str):
        return []
    names = list(names)
    return [t for t in targets if not any(name_matches(n, [t]) for n in names)]


def matched(targets: Targets, names: Iterable[str]) -> Targets | None:
    """``targets`` less the list entries that match none of ``names``; a regular expression that matches none of
    them, or a list left empty: None."""
    names = list(names)
    if isinstance(targets, str):
        return targets if any(name_matches(n, targets) for n in names) else None
    return [t for t in targets if any(name_matches(n, [t]) for n in names)] or None


def exact_choice(chosen: list[str], names: Iterable[str], picks=name_matches) -> Targets:
    """``chosen`` (full module names) written as a config entry that picks exactly them among ``names`` under the
    rule ``picks(name, entries)`` (default: ``target_modules``'): the list when it does, else a regular expression
    (matched in full) of exactly them (a list entry ``"0"`` would also pick ``"1.0"``)."""
    entries = list(chosen)
    if all(name in entries for name in names if name and picks(name, entries)):
        return entries
    return "(?:" + "|".join(re.escape(name) for name in entries) + ")"


def refuse_unmatched(who: str, targets: Targets, names: Iterable[str], model: nn.Module, describe,
                     what: str = "target_modules") -> None:
    """Raise if an entry of a ``target_modules`` list (or of the ``what`` list) matches no module: a typo would
    silently adapt fewer modules (or, for ``exclude_modules``, more).

    ``describe(model)`` lists the modules the technique can adapt, for the message.
    """
    missing = unmatched(targets, names)
    if missing:
        raise ValueError(
            f"{who}({what}={targets!r}): {', '.join(repr(m) for m in missing)} matched no module of "
            f"{type(model).__name__} (an entry matches a module whose name equals it or ends with '.' + it). "
            f"Fix or remove {'it' if len(missing) == 1 else 'them'}; modules it can adapt: {describe(model)}."
        )


def chosen_by_name(who: str, targets: Targets, names: list[str], model: nn.Module, describe) -> list[str]:
    """The ``names`` that ``targets`` matches; raises (`refuse_unmatched`) if some match and a list entry
    matches none. An empty choice is left to `refuse_no_target`, after other exclusions."""
    chosen = [n for n in names if name_matches(n, targets)]
    if chosen:
        refuse_unmatched(who, targets, names, model, describe)
    return chosen


def layer_of(name: str, patterns: str | list[str] | None) -> tuple[str, int] | None:
    """(the layer list's path, the layer's index) of module ``name``, read as Hugging Face PEFT reads it for
    ``layers_to_transform``: the first number segment after an entry of ``patterns`` (regular expressions naming the
    ``nn.ModuleList``, first match wins), or, with no pattern, after any named segment but the first
    (``model.layers.3.mlp.up`` -> ``("model.layers", 3)``). None: not inside a numbered layer.

    >>> layer_of("model.layers.3.experts.0.up", None), layer_of("h.1.attn", "h"), layer_of("h.1.attn", None)
    (('model.layers', 3), ('h', 1), None)
    """
    if not patterns:  # lazy: the first index, not an expert's inside it (PEFT's rule)
        match = re.match(r"(?P<path>.*?\.[^.]*)\.(?P<idx>\d+)\.", name)
    else:
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?P<path>(?:^|.*?\.){pattern})\.(?P<idx>\d+)\.", name)
            if match is not None:
                break
    return None if match is None else (match["path"], int(match["idx"]))


def in_layers(who: str, chosen: list[str], targets: list[str], layers: int | list[int],
              patterns: str | list[str] | None, model: nn.Module) -> list[str]:
    """The ``chosen`` modules inside the layers ``layers`` (``layers_to_transform``; `layer_of` finds a module's
    layer), and those a ``targets`` entry names in full (PEFT keeps them wherever they are). Raises if a pattern or
    an index finds no layer among ``chosen``: a typo would adapt other layers, or none. Warns, once, naming the
    ``targets`` entries whose every module lies outside every layer list: PEFT drops them silently, and so does
    this (a PEFT file means the same here), but a listed target that gets no adapter is worth a word."""
    wanted = [layers] if isinstance(layers, int) else list(layers)
    given = f"{who}(layers_to_transform={layers!r}{'' if patterns is None else f', layers_pattern={patterns!r}'})"
    fix = "Give the name of the ModuleList holding the layers (e.g. 'layers', 'h'), or leave layers_pattern out."
    if patterns and all(layer_of(name, patterns) is None for name in chosen):  # a list: any entry may match
        _refuse_layers(given, f"layers_pattern {patterns!r} names no", chosen, targets, None, model, fix)
    index = {name: layer_of(name, patterns) for name in chosen}
    missing = [i for i in wanted if all(where is None or where[1] != i for where in index.values())]
    if missing:
        _refuse_layers(given, f"there is no layer {', '.join(map(str, missing))} in any", chosen, targets, patterns,
                       model, "Give indices of layers that exist.")
    kept = [n for n in chosen if n in targets or (index[n] is not None and index[n][1] in wanted)]
    outside = {t: found for t in targets if (found := [n for n in chosen if name_matches(n, [t])])
               and all(index[n] is None and n not in kept for n in found)}
    if outside:
        dropped = [n for found in outside.values() for n in found]
        warnings.warn(f"{given}: target_modules={targets!r} lists {', '.join(map(repr, outside))}, which matched only "
                      f"modules outside every numbered layer list ({', '.join(dropped[:4])}); "
                      "layers_to_transform keeps only the modules of its layers (as PEFT does), so these get no "
                      f"adapter. To adapt one, name it in full (e.g. {dropped[0]!r}: a full name is kept wherever it is); "
                      "else remove the entry.", UserWarning, stacklevel=4)
    return kept


def _refuse_layers(given: str, problem: str, chosen: list[str], targets: list[str], patterns, model: nn.Module,
                   fix: str) -> None:
    found: dict[str, set[int]] = {}
    for where in filter(None, (layer_of(name, patterns) for name in chosen)):
        found.setdefault(where[0], set()).add(where[1])
    lists = "; ".join(f"{path!r} (layers {', '.join(map(str, sorted(i)))})" for path, i in found.items()) or "none"
    raise ValueError(f"{given}: {problem} layer list holding a module that target_modules={targets!r} matched in "
                     f"{type(model).__name__}. Numbered layer lists found there: {lists}. {fix}")


def inside(name: str, modules: Iterable[str]) -> bool:
    """Whether module ``name`` is one of ``modules`` or inside one of them (a ``modules_to_save`` entry)."""
    return any(name == m or name.startswith(f"{m}.") for m in modules)


def refuse_no_target(who: str, targets: Targets | None, model: nn.Module, can: str, described: str,
                     example: str) -> None:
    """Raise: ``target_modules`` left no module of ``model`` to adapt. ``can`` is what the technique does to a
    module ("adapt"), ``described`` the modules it can do it to, ``example`` a full module name for the hint that
    a string is a regular expression."""
    hint = ""
    if isinstance(targets, str) and re.sub(r"[\W_]", "", targets.lower()) == "alllinear":
        hint = (" Did you mean 'all-linear' (Hugging Face PEFT's spelling, with a hyphen)? It chooses every linear "
                "layer but the output head.")
    elif isinstance(targets, str) and targets != "all-linear":
        hint = (" A string is a regular expression that must match the full module name "
                f"(e.g. {example!r}); to match by name or suffix, give a list: [{targets!r}].")
    raise ValueError(
        f"{who}(target_modules={targets!r}) matched no module of {type(model).__name__}. "
        f"Modules it can {can}: {described}.{hint}"
    )


def task_heads(model: nn.Module) -> list[str]:
    """Names of the task head a Hugging Face task model creates at random (empty for other models)."""
    kind = next((suffix for suffix in _TASK_HEADS if type(model).__name__.endswith(suffix)), None)
    if kind is None:
        return []
    heads = _TASK_HEADS[kind]
    return [n for n, _ in model.named_children() if n in heads]


def config_of(cls: type, config: object, kwargs: dict, who: str, technique: str) -> object:
    """A technique's config (a frozen dataclass ``cls``) from a config object or keyword arguments (not both); the
    messages name the caller ``who`` and the ``technique`` (in words)."""
    if config is None:
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(f"{who}: unknown argument {unknown[0]!r}; {technique} take {', '.join(fields)}.")
        return cls(**kwargs)
    if kwargs:
        raise TypeError(f"{who}: pass either config or keyword arguments, not both (got {sorted(kwargs)}).")
    if not isinstance(config, cls):
        raise TypeError(f"{who}(config={type(config).__name__}): give a {cls.__name__}, or its fields as keyword "
                        "arguments.")
    return config


def refuse_second_injection(who: str, model: nn.Module, found: str | None, technique: str, more: str = "") -> None:
    """Raise if ``model`` already has what an inject function adds (``found`` describes it; None: nothing).
    ``more``: another way out, for the message (``"add another named adapter with ..."``)."""
    if found:
        fixes = f"Use the model as it is, build a fresh one, or {more}" if more else \
            "Use the model as it is, or build a fresh one"
        raise RuntimeError(f"{who}: {type(model).__name__} already has {found}; {technique} injected twice. {fixes}.")


def require(model: nn.Module, kind: str, who: str, what: str, inject: str) -> Adapter:
    """The ``kind`` adapter of ``model``; raises, naming ``what`` it lacks and the ``inject`` function, if none."""
    adapter = attached(model).get(kind)
    if adapter is None:
        raise RuntimeError(f"{who}: {type(unwrap(model)).__name__} has no {what}; call {inject}(model, ...) first.")
    return adapter


def usable_adapter_name(name: object, who: str, key: str) -> str:
    """``name`` if it can name an adapter (a non-empty identifier without dots); ``key`` shows where the name goes in
    the parameter names (``"lora_A.<name>.weight"``)."""
    if not isinstance(name, str) or not name or "." in name or not name.isidentifier():
        raise ValueError(
            f"{who}: adapter name {name!r} is not usable; give a non-empty identifier without dots, e.g. 'sports' "
            f"(it becomes part of the parameter names, {key})."
        )
    return name


def refuse_absent(model: nn.Module, names: Iterable[str], where: str) -> None:
    """Raise if a recorded module name (a checkpoint's, an adapter file's) is not a module of ``model``."""
    present = {n for n, _ in model.named_modules()}
    absent = [n for n in names if n not in present]
    if absent:
        raise ValueError(
            f"{where} names module {absent[0]!r}, which {type(model).__name__} does not have; it was written for "
            "another model."
        )


def adapter_dtype(base: nn.Module | Tensor | None) -> torch.dtype | None:
    """The dtype of adapter parameters for a base module (or its weight): float32, or the base's if wider (float64);
    None for a module without parameters (the default dtype). Half-precision bases get float32 adapters."""
    if isinstance(base, nn.Module):
        base = next(base.parameters(), None)
    if base is None:
        return None
    return torch.promote_types(base.dtype, torch.float32) if base.dtype.is_floating_point else torch.float32


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a merge or a norm of adapter tensors is computed in: at least float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def output_head(model: nn.Module, view: dict[str, nn.Module], linear: tuple[type, ...]) -> str | None:
    """The name in ``view`` (module names as a technique sees them) of the output head ``"all-linear"`` leaves
    alone: the model's output embeddings (``get_output_embeddings``) when ``view`` holds them, else the last module
    of a ``linear`` type."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    named = [n for n, m in view.items() if m is head]
    if isinstance(head, nn.Module) and named:
        return named[-1]
    linears = [n for n, m in view.items() if isinstance(m, linear)]
    return linears[-1] if linears else None


def all_linear(model: nn.Module, view: dict[str, nn.Module], linear: tuple[type, ...]) -> list[str]:
    """``target_modules="all-linear"``, resolved alike for every technique: the names in ``view`` (module names as a
    technique sees them, other techniques' insides hidden) of every module of a ``linear`` type but the output head
    (`output_head`). Hugging Face PEFT drops the head of a ``PreTrainedModel`` only (its output embeddings, or with
    ``task_type="SEQ_CLS"`` its classifier); here any model's last linear layer stays out when it has no output
    embeddings. Adapters are saved with the exact names, so PEFT loads them onto the same modules."""
    head = output_head(model, view, linear)
    return [n for n, m in view.items() if n and isinstance(m, linear) and n != head]


def dense_weight(weight: Tensor, module: nn.Module | None = None) -> Tensor:
    """A base weight as a plain tensor in its own layout: a quantized weight (a tensor subclass that can
    dequantize itself, such as torchao's ``NF4Tensor``) is dequantized; a plain tensor is returned as it is.

    Every reader of a frozen base weight that needs its values (DoRA's column norm, merging, exports) goes
    through here, so a quantized base is handled in one place. ``module``: the layer holding ``weight``, where
    a quantizer keeps some of its state on the layer (bitsandbytes' ``Linear8bitLt`` moves its scales there at the
    first forward).
    """
    method = _dequantizer(weight, module)
    return weight if method is None else method()


def _dequantizer(weight: Tensor | None, module: nn.Module | None = None):
    """The bound method that dequantizes ``weight``, if its class defines one (``Tensor.dequantize`` itself, which
    DTensor and other wrapper subclasses inherit, is for torch's own quantized tensors and does not count), or
    bitsandbytes' dequantization of its ``Params4bit`` / ``Int8Params``."""
    if weight is None or type(weight) in (Tensor, nn.Parameter):
        return None
    if type(weight).__module__.startswith("bitsandbytes"):
        return _bitsandbytes_dequantizer(weight, module)
    data = weight.data if isinstance(weight, nn.Parameter) else weight
    for name in ("get_original_weight", "dequantize"):
        own = getattr(type(data), name, None)
        if callable(own) and own is not getattr(Tensor, name, None):
            return getattr(data, name)
    return None


def _bitsandbytes_dequantizer(weight: Tensor, module: nn.Module | None):
    """bitsandbytes' functional dequantization of a weight (the package is imported: the weight is its own)."""
    functional = sys.modules["bitsandbytes.functional"]
    state = getattr(weight, "quant_state", None)
    if state is not None:  # Params4bit: packed 4-bit codes (n, 1) uint8 -> (out, in) in the dtype it had
        return lambda: functional.dequantize_4bit(weight.data, state)
    if weight.dtype != torch.int8:
        return None
    scales = getattr(weight, "SCB", None)
    if scales is None:
        scales = getattr(getattr(module, "state", None), "SCB", None)

    def dequantize() -> Tensor:  # Int8Params: (out, in) int8, one absmax per row (its SCB) -> float32
        if scales is None:
            raise RuntimeError("a bitsandbytes Int8Params weight without its scales (SCB): pass the layer that holds "
                               "it (dense_weight(weight, module)), which keeps them after its first forward.")
        return functional.int8_vectorwise_dequant(weight.data, scales)

    return dequantize


def is_quantized(weight: Tensor | None) -> bool:
    """Whether ``weight`` is a quantized tensor (a subclass that dequantizes itself, such as torchao's ``NF4Tensor``):
    its values must be read through `dense_weight`, and it cannot be written in place without requantizing."""
    return _dequantizer(weight) is not None


def wraps_a_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a technique's wrapper around a base layer (it holds it as ``base_layer``)."""
    return isinstance(module._modules.get(BASE_LAYER), nn.Module)


def refuse_wrapped(who: str, technique: str, name: str, module: nn.Module) -> None:
    """Raise (`ValueError`): ``name`` is ``module``, another technique's wrapper, which ``technique`` must not wrap."""
    article = "an" if technique[0] in "AEIOU" else "a"
    raise ValueError(f"{who}: {name!r} is already wrapped by another technique ({type(module).__name__}); {article} "
                     f"{technique} layer around it would move that technique's parameters. Keep {technique} off this "
                     "module.")


class LayerWrapper(nn.Module):
    """A module in place of a frozen ``base_layer``, adding a technique's parameters around it.

    Attributes the wrapper lacks (``weight``, ``in_features``, ``nf``, ``padding_idx``, ...) are read from the base
    layer, so code that inspects the module keeps working. Precision: a cast to half precision (``model.half()``,
    ``Trainer(precision="bf16-true")``) reaches the base layer only; the technique's own tensors follow device moves
    but keep their dtype (float32), so small updates are not rounded away. Any other cast (float64) reaches all.
    """

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer

    @property
    def reads_base_weight(self) -> bool:
        """Whether this wrapper's own forward reads the base layer's weight (DoRA's norm of ``W + s B A``), not only
        through the base layer's forward. A strategy that gathers a sharded weight around the base layer's forward
        alone (an FSDP2 unit of its own) must then gather it around the wrapper's."""
        return False

    def __getattr__(self, name: str):
        # nn.Module's lookup (parameters, buffers, submodules) first; then the base layer's attributes.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == BASE_LAYER:
                raise
            return getattr(self.base_layer, name)

    def _apply(self, fn, recurse: bool = True):
        probe = fn(torch.zeros((), dtype=torch.float32))
        if not (isinstance(probe, Tensor) and probe.dtype in HALF) or not recurse:
            return super()._apply(fn, recurse)
        device = probe.device

        def move(t: Tensor) -> Tensor:
            return t.to(device=device)

        for name, child in self.named_children():
            child._apply(fn if name == BASE_LAYER else move)
        return super()._apply(move, recurse=False)
