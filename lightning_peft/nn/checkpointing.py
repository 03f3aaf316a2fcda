"""Activation checkpointing: chosen blocks keep only their inputs in forward and recompute their activations in
backward.

Paper: Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174.

Rule. A checkpointed block ``y = f(x)`` saves ``x`` (not ``f``'s intermediate activations) in forward; in backward
it runs ``f(x)`` again under autograd and backpropagates through that graph. Activation memory falls from
``sum_l A_l`` (every block's activations) to ``sum_l |x_l| + max_l A_l``; a step costs one more forward, so its
time floor is ``(2F + B) / (F + B)`` of a plain step.

How. [`apply_activation_checkpointing`][lightning_peft.nn.apply_activation_checkpointing] replaces the ``forward`` of
each chosen module (an instance attribute) by a call of ``torch.utils.checkpoint.checkpoint(forward, *args,
use_reentrant=False, preserve_rng_state=True, **kwargs)``, only in training with gradients on (evaluation and
``no_grad`` run the block as is):

- non-reentrant: the reentrant variant gives zero gradients to the parameters inside a block when no *input* of the
  block requires grad (a LoRA model over frozen embeddings: transformers issue 26221); the non-reentrant one
  tracks the parameters themselves, so no ``enable_input_require_grads`` is needed;
- ``preserve_rng_state``: the recomputation draws the dropout masks the forward drew;
- keyword arguments (Hugging Face layers get ``attention_mask``, ``position_embeddings``, ... as keywords) go to the
  block unchanged;
- the block's ``forward``, not its ``__call__``, is wrapped: module hooks (FSDP2's gathering, a device map's moves)
  stay outside the checkpoint and do not run twice; the state dict's keys do not change (no wrapper module).

A Hugging Face layer that would write into an attention cache (``cache``, ``past_key_values``, ``layer_past``,
``use_cache``) gets none while checkpointed, as transformers does under its own checkpointing: a recomputed layer
would write the cache a second time. The model's own ``gradient_checkpointing_enable`` /
``activation_checkpointing_enable`` is never called: the same wrapper runs for every model, and a model with
transformers' checkpointing already on is refused (the layers would be recomputed twice).

Choosing the blocks, ``modules``: None (the default) is every Hugging Face
``transformers.modeling_layers.GradientCheckpointingLayer`` and every
[`TransformerBlock`][lightning_peft.nn.TransformerBlock]; otherwise a list whose entries are each

- a class (``TransformerBlock``) or a class name: the name of the module's class or of one of its bases
  (``"BertLayer"``, ``"GradientCheckpointingLayer"``), or its dotted path (``"lightning_peft.nn.block.TransformerBlock"``);
- else a regular expression matched in full against module names (``"encoder\\.layer\\.[0-5]"``).

A string is read as a class name when some module of the model has a class (or base) of that name or path, and as
a regular expression otherwise. Every entry must select something. Only the outermost of nested selected modules is
wrapped. A module that refuses checkpointing declares it (an attribute ``refuses_activation_checkpointing``: the
reason), as prefix tuning's prefix does.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import re
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_peft._checks import regex
from lightning_peft.nn.block import TransformerBlock

__all__ = ["CheckpointedForward", "apply_activation_checkpointing", "check_modules", "check_release_memory",
           "checkpointed_modules",
           "is_checkpointed", "remove_activation_checkpointing"]

log = logging.getLogger(__name__)
_WHO = "apply_activation_checkpointing"
_CACHES = ("cache", "past_key_values", "layer_past")
_WARNED: set[type] = set()  # the layer classes warned about a dropped cache (once each)


class CheckpointedForward:
    """The ``forward`` of a checkpointed module: its own forward, under non-reentrant checkpointing in training.

    An object, not a closure, so that ``copy.deepcopy`` and pickling of the model carry it to the copy's module.

    Args:
        module: The module whose forward it replaces.
        inner: The instance ``forward`` it replaces, if the module had one (None: the class's).
        release_memory: After each checkpointed forward on the CPU, return the heap pages freed by the block's
            temporaries to the operating system (glibc ``malloc_trim(0)``; see `apply_activation_checkpointing`).
    """

    def __init__(self, module: nn.Module, inner: Any = None, release_memory: bool = False) -> None:
        self.module = module
        self.inner = inner
        self.release_memory = release_memory

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = self.inner if self.inner is not None else type(module).forward.__get__(module)
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if kwargs.get("between") is not None:
            raise RuntimeError(
                f"activation checkpointing: {type(module).__name__} was called with between= (token pruning), which "
                "changes state between its sublayers; recomputing the block in backward would do it twice. Leave "
                "token pruning's blocks out of modules=, or train without token pruning."
            )
        if _hf_layer(module) and not getattr(module, "_can_checkpoint_with_cache", False):
            kwargs = _without_cache(module, kwargs)
        output = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        if self.release_memory and _on_cpu(args, kwargs):
            _malloc_trim()
        return output


def is_checkpointed(module: nn.Module) -> bool:
    """Whether [`apply_activation_checkpointing`][lightning_peft.nn.apply_activation_checkpointing] wrapped this
    module's forward."""
    return isinstance(vars(module).get("forward"), CheckpointedForward)


def checkpointed_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` (by name) whose forward is checkpointed."""
    return {name: m for name, m in model.named_modules() if is_checkpointed(m)}


def apply_activation_checkpointing(
    model: nn.Module,
    modules: Sequence[str | type] | None = None,
    *,
    release_memory: bool | None = False,
    who: str = _WHO,
) -> dict[str, nn.Module]:
    """Checkpoint the forward of the chosen modules of ``model`` (see the module docstring for ``modules``).

    Args:
        model: The model; changed in place (instance ``forward`` attributes, nothing else).
        modules: None for the default blocks, or a list of classes, class names and module-name regexes.
        release_memory: Return the heap pages that a checkpointed block's forward freed to the operating system
            after each such forward on the CPU (glibc's ``malloc_trim(0)``, about 0.1-0.6 ms a call). Under glibc's
            default malloc, the freed temporaries of each block lie below the block's kept input in the heap, so
            they stay resident: measured at 24 blocks (``benchmarks/bench_checkpointing.py``), activation memory
            is 0.40 of the plain model's without the release and 0.24 with it, at 1.13x the step time. None: on
            where glibc provides ``malloc_trim``; True: there only; False (default): never. Numerics are unchanged.
            Off by default: it acts on the whole process's allocator, and one CI run that had used it crashed a
            gloo thread inside ``malloc`` later in the same process, which was not ruled out as its effect.
        who: Who asks, in error messages (the callback gives its name).

    Returns:
        The wrapped modules by name, outermost only, in the model's order.

    Raises:
        TypeError: ``modules`` is not a list of strings and classes.
        ValueError: an entry selects nothing, or no default block is in the model (the message lists its classes).
        RuntimeError: ``model`` is already checkpointed (by this function or by transformers), or a part of it
            refuses checkpointing (prefix tuning, a reversible stack, token pruning).

    Examples:
        >>> from lightning_peft.nn import TransformerDecoder
        >>> model = TransformerDecoder(vocab_size=32, hidden_size=8, num_layers=2, num_heads=2)
        >>> list(apply_activation_checkpointing(model))
        ['layers.0', 'layers.1']
        >>> list(remove_activation_checkpointing(model))
        ['layers.0', 'layers.1']
    """
    entries = check_modules(modules, who)
    release = check_release_memory(release_memory, who)
    _refuse_state(model, who)
    named = list(model.named_modules())
    if entries is None:
        selected = [(n, m) for n, m in named if _default_block(m)]
        if not selected:
            raise ValueError(
                f"{who}(modules=None): {type(model).__name__} has no default block (a Hugging Face "
                f"GradientCheckpointingLayer or lightning_peft.nn.TransformerBlock). {_inventory(named)} Name the "
                "blocks to checkpoint, e.g. modules=['BertLayer'] or modules=['layers\\.\\d+']."
            )
    else:
        known = set().union(*(_class_names(type(m)) for _, m in named))  # the class names this model has
        hits = {i: [(n, m) for n, m in named if _selects(entry, n, m, known)] for i, entry in enumerate(entries)}
        missing = [entries[i] for i, found in hits.items() if not found]
        if missing:
            raise ValueError(
                f"{who}(modules={_shown(entries)}): {_shown(missing)} matched no module of {type(model).__name__} "
                "(an entry is a class or class name of a module or of its bases, or a regular expression matched in "
                f"full against module names). {_inventory(named)}"
            )
        chosen = {id(m) for found in hits.values() for _, m in found}
        selected = [(n, m) for n, m in named if id(m) in chosen]
    outermost: list[tuple[str, nn.Module]] = []
    for name, module in selected:
        if not any(name.startswith(f"{outer}.") or outer == "" for outer, _ in outermost):
            outermost.append((name, module))
    _refuse_parts(model, named, outermost, who)
    for _, module in outermost:
        module.forward = CheckpointedForward(module, vars(module).get("forward"), release)
    return dict(outermost)


def remove_activation_checkpointing(model: nn.Module) -> dict[str, nn.Module]:
    """Undo [`apply_activation_checkpointing`][lightning_peft.nn.apply_activation_checkpointing]: each wrapped module
    gets its forward back.

    Returns:
        The modules unwrapped, by name (empty when none was checkpointed).
    """
    found = checkpointed_modules(model)
    for module in found.values():
        inner = vars(module)["forward"].inner
        if inner is None:
            del module.forward
        else:
            module.forward = inner
    return found


# ------------------------------------------------------------------------------------------------- memory release


def check_release_memory(release_memory: object, who: str) -> bool:
    """``release_memory`` resolved: None is whether glibc's ``malloc_trim`` is here; True must find it; False."""
    if release_memory is None:
        return _malloc_trim_function() is not None
    if not isinstance(release_memory, bool):
        raise TypeError(f"{who}(release_memory={release_memory!r}): release_memory must be True, False or None.")
    if release_memory and _malloc_trim_function() is None:
        raise ValueError(
            f"{who}(release_memory=True): this platform's C library has no malloc_trim (glibc's; found "
            f"{platform.libc_ver()[0] or 'another libc'} on {sys.platform}). Pass release_memory=None or False."
        )
    return release_memory


@functools.cache
def _malloc_trim_function() -> Any:
    """glibc's ``malloc_trim`` through ctypes, or None where the C library has none (macOS, Windows, musl)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        function = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


def _malloc_trim() -> None:
    function = _malloc_trim_function()
    if function is not None:
        function(0)  # 0: keep no padding at the top of the heap; free pages inside it are returned too


def _on_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether the first tensor among the block's inputs is on the CPU (CUDA's caching allocator keeps its own)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type == "cpu"
    return False


# ------------------------------------------------------------------------------------------------------ selection


def check_modules(modules: object, who: str = _WHO) -> list[str | type] | None:
    """``modules`` as a list, checked: None, or a non-empty list of classes and strings that compile as regexes."""
    if modules is None:
        return None
    if isinstance(modules, (str, type)) or not isinstance(modules, Sequence) or not modules:
        raise TypeError(
            f"{who}(modules={modules!r}): modules must be None or a non-empty list of class names, classes or "
            "module-name regexes, e.g. ['TransformerBlock'] or ['encoder\\.layer\\.\\d+']."
        )
    for entry in modules:
        if isinstance(entry, type):
            continue
        if not isinstance(entry, str):
            raise TypeError(f"{who}(modules={modules!r}): {entry!r} is neither a class nor a string.")
        regex(who, "modules", entry)
    return list(modules)


def _class_names(cls: type) -> set[str]:
    return {name for c in cls.__mro__ for name in (c.__name__, f"{c.__module__}.{c.__qualname__}")}


def _selects(entry: str | type, name: str, module: nn.Module, known: set[str]) -> bool:
    if isinstance(entry, type):
        return isinstance(module, entry)
    if entry in known:  # a class name of this model
        return entry in _class_names(type(module))
    return re.fullmatch(entry, name) is not None


def _hf_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``GradientCheckpointingLayer``. Transformers is optional and slow to
    import: when nothing has imported its layers, no module can be one."""
    layers = sys.modules.get("transformers.modeling_layers")
    return layers is not None and isinstance(module, layers.GradientCheckpointingLayer)


def _default_block(module: nn.Module) -> bool:
    return isinstance(module, TransformerBlock) or _hf_layer(module)


def _shown(entries: list[str | type]) -> str:
    return "[" + ", ".join(e.__name__ if isinstance(e, type) else repr(e) for e in entries) + "]"


def _inventory(named: list[tuple[str, nn.Module]]) -> str:
    """What the model has, for error messages: its module classes (with counts) and its repeated blocks' names (the
    children of its ``nn.ModuleList``s), else its first module names."""
    counts = Counter(type(m).__name__ for _, m in named)
    classes = ", ".join(f"{c} (x{k})" if k > 1 else c for c, k in counts.items())
    lists = {f"{n}." if n else "" for n, m in named if isinstance(m, nn.ModuleList)}
    blocks = [n for n, _ in named if any(n.startswith(p) and "." not in n[len(p):] for p in lists)]
    shown = blocks or [n for n, _ in named[1:]]
    more = ", ..." if len(shown) > 6 else ""
    return f"Its module classes: {classes}. {'Blocks' if blocks else 'Module names'}: {', '.join(shown[:6])}{more}."


# ---------------------------------------------------------------------------------------------------- refusals


def _refuse_state(model: nn.Module, who: str) -> None:
    done = checkpointed_modules(model)
    if done:
        raise RuntimeError(
            f"{who}: {type(model).__name__} is already checkpointed ({', '.join(done) or 'the model itself'}); "
            "checkpointing twice would recompute the blocks twice. Call remove_activation_checkpointing(model) "
            "first, or apply it once (one ActivationCheckpointing callback, or the function, not both)."
        )
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise RuntimeError(
            f"{who}: transformers' own gradient checkpointing is on in {type(model).__name__}; both together would "
            "recompute each layer twice. Call model.activation_checkpointing_disable() (lightning-peft's "
            "checkpointing is non-reentrant and does the same for every model), or do not apply this one."
        )


def _refuse_parts(model: nn.Module, named: list[tuple[str, nn.Module]], chosen: list[tuple[str, nn.Module]],
                  who: str) -> None:
    for name, module in named:
        reason = getattr(module, "refuses_activation_checkpointing", None)
        if isinstance(reason, str):
            raise RuntimeError(f"{who}: {name or type(model).__name__} ({type(module).__name__}) refuses "
                               f"activation checkpointing: {reason}")
        inside = [c for c, _ in chosen if c.startswith(f"{name}.") or name == ""]
        if not inside:
            continue
        if getattr(module, "reversible", False) is True:
            raise RuntimeError(
                f"{who}: {inside[0]} sits in a reversible stack ({name or 'the model'}: {type(module).__name__}, "
                "reversible=True), which never calls the blocks' forward and already recomputes their activations "
                "from the outputs. Use one of the two: reversible=True, or checkpointing with reversible=False."
            )
        if getattr(module, "token_pruner", None) is not None:
            raise RuntimeError(
                f"{who}: {inside[0]} is a block of {name or 'the model'} ({type(module).__name__}), which prunes "
                "tokens between its blocks' sublayers; recomputing a block would prune twice. Leave its blocks out "
                "of modules=, or train without token pruning."
            )


def _without_cache(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    dropped = [k for k in _CACHES if kwargs.get(k) is not None] + (["use_cache"] if kwargs.get("use_cache") else [])
    if not dropped:
        return kwargs
    if type(module) not in _WARNED:
        _WARNED.add(type(module))
        log.warning("activation checkpointing: %s got %s in training; a recomputed layer would write its cache "
                    "twice, so it runs without one (as under transformers' own checkpointing).",
                    type(module).__name__, dropped)
    return {**kwargs, **{k: None for k in _CACHES if k in kwargs}, **({"use_cache": False} if "use_cache" in kwargs else {})}
