"""Modules trained and saved in full next to an adapter (``modules_to_save``), e.g. a new classifier head.

As in Hugging Face PEFT, the module is replaced by a wrapper holding the frozen original and a trainable copy; the
forward runs the copy. The original is never changed, so the base model stays recoverable
([`unload_lora`][lightning_peft.peft.unload_lora] with ``merge=False``), and a weight the module shares with another one
(GPT-2's ``lm_head`` and ``wte``) is not trained through the other module: the copy has its own tensor. Modules saved
together are copied together, so weights tied among them stay tied among the copies.

State-dict keys: ``<name>.original_module.<param>`` and ``<name>.trained_module.<param>``; adapter files and
merged exports use ``<name>.<param>`` (the trained copy), as PEFT does.

Every technique takes ``modules_to_save`` the same way (`select_modules_to_save`): None picks a Hugging Face
task model's head (``from_pretrained`` creates it at random), a list picks modules by name or dotted suffix, and a
module another technique already owns (saves in full, or wraps a layer of) is left to that technique.

A wrapper may follow a technique's switch (`BaseSamples`: LoRA's [`Routing`][lightning_peft.peft.Routing] is one):
with the adapters disabled it runs the original, and in a routed batch a sample routed to the base gets the
original's output, as PEFT's ``disable_adapter()`` and ``adapter_names=["__base__", ...]`` do.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from ._common import HEAD_NAMES, name_matches, task_heads, unmatched, wraps_a_layer
from .adapter import clean_key

log = logging.getLogger(__name__)

ORIGINAL = "original_module"
TRAINED = "trained_module"


class BaseSamples(Protocol):
    """What a wrapper asks the technique it follows: which samples get the base (the original module's) output."""

    def base_samples(self) -> bool | Sequence[bool] | Tensor:
        """True: every sample (adapters disabled); False: none; else one flag per sample of the batch (a packed
        batch: one per token)."""


class ModulesToSave(nn.Module):
    """A frozen ``original_module`` and its trainable copy ``trained_module``; the forward runs the copy.

    Attributes the wrapper lacks (``weight``, ``out_features``, ...) are read from the trained copy.
    """

    def __init__(self, original: nn.Module, trained: nn.Module) -> None:
        super().__init__()
        self.original_module = original
        self.trained_module = trained
        self.routing: BaseSamples | None = None  # set by a technique whose "base output" uses the original (LoRA)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in (ORIGINAL, TRAINED):
                raise
            return getattr(self.trained_module, name)

    def forward(self, *args, **kwargs):
        routing = self.__dict__.get("routing")
        base = False if routing is None else routing.base_samples()
        if base is True:
            return self.original_module(*args, **kwargs)
        if base is False:
            return self.trained_module(*args, **kwargs)
        return self._mixed(base, *args, **kwargs)

    def _mixed(self, base: Sequence[bool] | Tensor, *args, **kwargs) -> Tensor:
        """A routed batch with base samples: rows flagged in ``base`` from the original, the others from the copy
        (flags per token of a packed batch: the output's first two dimensions are ``(1, T)``)."""
        trained = self.trained_module(*args, **kwargs)
        original = self.original_module(*args, **kwargs)
        n = len(base)
        lead = 0
        if isinstance(trained, Tensor) and isinstance(original, Tensor) and trained.dim() > 0:
            lead = 1 if trained.shape[0] == n else 2 if tuple(trained.shape[:2]) == (1, n) else 0
        if not lead:
            raise TypeError(
                f"route_adapters: modules_to_save {type(self.trained_module).__name__} returned "
                f"{type(trained).__name__}{tuple(trained.shape) if isinstance(trained, Tensor) else ''}, not one "
                f"tensor with the batch of {n} samples first (or the {n} tokens of a packed batch, (1, {n}, ...)), so "
                "samples routed to the base (None) cannot get the original module's output. Route every sample to an "
                "adapter, or save a module whose output is batch-first."
            )
        rows = torch.as_tensor(base, device=trained.device)  # (B,), or (T,) per token
        rows = rows.view(*([1] * (lead - 1)), -1, *([1] * (trained.dim() - lead)))
        return torch.where(rows, original.to(trained.dtype), trained)


def wrap_modules_to_save(model: nn.Module, names: Iterable[str]) -> dict[str, ModulesToSave]:
    """Replace each named module of ``model`` with a [`ModulesToSave`][lightning_peft.peft.ModulesToSave] wrapper;
    returns the wrappers.

    The copies are made in one ``deepcopy``, so parameters shared among the named modules stay shared.
    """
    names = list(names)
    originals = [model.get_submodule(n) for n in names]
    copies = copy.deepcopy(originals)
    wrappers = {}
    for name, original, trained in zip(names, originals, copies):
        wrappers[name] = ModulesToSave(original, trained)
        set_submodule(model, name, wrappers[name])
    return wrappers


def saved_modules(model: nn.Module) -> dict[str, ModulesToSave]:
    """The [`ModulesToSave`][lightning_peft.peft.ModulesToSave] wrappers of ``model`` by full module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, ModulesToSave)}


def claimed(model: nn.Module, name: str) -> str | None:
    """Why module ``name`` of ``model`` belongs to another technique, or None: it is or holds a
    [`ModulesToSave`][lightning_peft.peft.ModulesToSave] wrapper (another technique trains and saves it in full) or a
    wrapper around a base layer (copying it would move that technique's parameters)."""
    for inner, module in model.get_submodule(name).named_modules(prefix=name):
        if isinstance(module, ModulesToSave):
            what = "already trained and saved in full by another adapter on this model"
        elif wraps_a_layer(module):
            what = f"a layer another adapter wraps ({type(module).__name__})"
        else:
            continue
        return ("is " if inner == name else f"holds {inner!r}, which is ") + what
    return None


def select_modules_to_save(model: nn.Module, asked: list[str] | None, who: str,
                           ours: Iterable[str] = ()) -> list[str]:
    """Full names of the modules to train and save in full; raises before anything is changed.

    Args:
        asked: Names or dotted suffixes; only the outermost module of a nested pair is taken (the inner one is saved
            with it). None: the task head of a Hugging Face task model, unless another technique owns it.
        who: The caller, for messages (``"LoRA"``).
        ours: Modules the caller's own technique already saves (they are not another technique's).

    Raises:
        ValueError: If an entry matches no module, or a chosen module belongs to another technique
            (`claimed`).
    """
    ours = set(ours)
    if asked is None:
        heads = [h for h in task_heads(model) if h in ours or claimed(model, h) is None]
        if heads:
            log.info("%s: %s's task head %s is trained and saved in full (modules_to_save); from_pretrained creates "
                     "it at random. Pass modules_to_save=[] to keep it frozen.", who, type(model).__name__, heads)
        return heads
    chosen = [n for n, _ in model.named_modules() if n and name_matches(n, asked)]
    missing = unmatched(asked, chosen)
    if missing:
        raise ValueError(
            f"{who}(modules_to_save={asked!r}): {missing} matched no module of {type(model).__name__}. "
            "Check the names with model.named_modules()."
        )
    chosen = [n for n in chosen if not any(n.startswith(f"{o}.") for o in chosen)]  # saved with the outer one
    for name in chosen:
        reason = None if name in ours else claimed(model, name)
        if reason:
            raise ValueError(
                f"{who}(modules_to_save={asked!r}): {name!r} {reason}; leave it out of modules_to_save here."
            )
    return chosen


def present_modules(model: nn.Module, asked: object, source: str = "adapter_config.json") -> list[str]:
    """The entries of a PEFT config's ``modules_to_save`` (read from ``source``) that match a module of ``model``.

    PEFT's task types write ``["classifier", "score"]`` whatever the model calls its head, so an entry that matches
    nothing is dropped, as PEFT drops it; with a warning unless it is one of those head names. An entry that cannot
    be a module path (``"../x"``, ``""``, ``"a..b"``) is refused, naming it: it is not a name PEFT's task types write.
    """
    if asked is None:
        return []
    if isinstance(asked, str) or not isinstance(asked, (list, tuple)):
        raise TypeError(f"load_adapter: {source} has modules_to_save={asked!r}; it must be a list of module names, "
                        "e.g. ['classifier'].")
    entries = list(dict.fromkeys(asked))
    for entry in entries:
        _check_module_path(entry, source)
    names = [n for n, _ in model.named_modules() if n]
    present = [m for m in entries if any(name_matches(n, [m]) for n in names)]
    absent = [m for m in entries if m not in present and m not in HEAD_NAMES]
    if absent:
        warnings.warn(f"load_adapter: {source} lists modules_to_save {absent} that match no module of "
                      f"{type(model).__name__}; they are ignored, as PEFT ignores them.", UserWarning, stacklevel=5)
    return present


def _check_module_path(entry: object, source: str) -> None:
    """A module path is dot-separated module names: none empty, none with a path separator or white space."""
    parts = entry.split(".") if isinstance(entry, str) else [""]
    if not all(part and not any(c in part for c in "/\\") and not any(c.isspace() for c in part) for part in parts):
        raise ValueError(
            f"load_adapter: {source} lists modules_to_save entry {entry!r}, which cannot be a module path (module "
            "names joined by dots, e.g. 'classifier' or 'bert.pooler.dense'); it would match nothing and be ignored "
            "silently. Fix or remove the entry."
        )


def saved_state(model: nn.Module, names: Iterable[str]) -> dict[str, Tensor]:
    """The trained copies' tensors of the wrappers at ``names``, by ``model`` state-dict key (not detached)."""
    state: dict[str, Tensor] = {}
    for name in names:
        trained = model.get_submodule(name).trained_module
        state.update(trained.state_dict(prefix=f"{name}.{TRAINED}.", keep_vars=True))
    return state


def peft_saved_state(model: nn.Module, names: Iterable[str], prefix: str = "") -> dict[str, Tensor]:
    """`saved_state` under the plain module's keys (``<name>.<param>``), after ``prefix``, as PEFT saves it."""
    return {prefix + clean_key(plain_key(k)): v for k, v in saved_state(model, names).items()}


def restore_modules(model: nn.Module, names: Iterable[str], trained: bool = False) -> None:
    """Put the untouched originals (or, with ``trained``, the trained copies) back in place of the wrappers."""
    for name in names:
        wrapper = model.get_submodule(name)
        set_submodule(model, name, wrapper.trained_module if trained else wrapper.original_module)


def plain_key(key: str) -> str:
    """The plain model's key for a state-dict key of a wrapped model (``x.trained_module.w`` -> ``x.w``)."""
    return key.replace(f".{TRAINED}.", ".") if f".{TRAINED}." in key else key


def fold_modules_to_save(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with every wrapper's original dropped and its trained copy under the plain module's keys."""
    wrappers = saved_modules(model)
    out = {}
    for key, value in state.items():
        if any(key.startswith(f"{n}.{ORIGINAL}.") for n in wrappers):
            continue
        out[plain_key(key)] = value
    return out


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path ``name`` with ``module``."""
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, module)
