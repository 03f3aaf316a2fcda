"""Modules trained and saved in full next to an adapter (``modules_to_save``), e.g. a new classifier head.

As in Hugging Face PEFT, the module is replaced by a wrapper holding the frozen original and a trainable copy;
the forward runs the copy. The original is never changed, so the base model stays recoverable
(:func:`~lightning_peft.peft.unload_lora` with ``merge=False``), and a weight the module shares with another
one (GPT-2's ``lm_head`` and ``wte``) is not trained through the other module: the copy has its own tensor.
Modules saved together are copied together, so weights tied among them stay tied among the copies.

State-dict keys: ``<name>.original_module.<param>`` and ``<name>.trained_module.<param>``; adapter files and
merged exports use ``<name>.<param>`` (the trained copy), as PEFT does.

A wrapper may follow a technique's routing (LoRA's :class:`~lightning_peft.peft.layers.Routing`): with the adapters
disabled it runs the original, and in a routed batch a sample routed to the base (``None``) gets the original's
output, as PEFT's ``disable_adapter()`` and ``adapter_names=["__base__", ...]`` do.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import Tensor, nn

ORIGINAL = "original_module"
TRAINED = "trained_module"


class ModulesToSave(nn.Module):
    """A frozen ``original_module`` and its trainable copy ``trained_module``; the forward runs the copy.

    Attributes the wrapper lacks (``weight``, ``out_features``, ...) are read from the trained copy.
    """

    def __init__(self, original: nn.Module, trained: nn.Module) -> None:
        super().__init__()
        self.original_module = original
        self.trained_module = trained
        self.routing = None  # set by a technique whose "base output" must use the original (LoRA)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in (ORIGINAL, TRAINED):
                raise
            return getattr(self.trained_module, name)

    def forward(self, *args, **kwargs):
        routing = self.__dict__.get("routing")
        if routing is None:
            return self.trained_module(*args, **kwargs)
        if routing.disabled:
            return self.original_module(*args, **kwargs)
        names = routing.names
        if names is None or all(n is not None for n in names):
            return self.trained_module(*args, **kwargs)
        return self._mixed(names, *args, **kwargs)

    def _mixed(self, names, *args, **kwargs) -> Tensor:
        """A routed batch with base samples: rows routed to ``None`` from the original, the others from the copy."""
        trained = self.trained_module(*args, **kwargs)
        original = self.original_module(*args, **kwargs)
        if not (isinstance(trained, Tensor) and isinstance(original, Tensor) and trained.dim() > 0
                and trained.shape[0] == len(names)):
            raise TypeError(
                f"route_adapters: modules_to_save {type(self.trained_module).__name__} returned "
                f"{type(trained).__name__}{tuple(trained.shape) if isinstance(trained, Tensor) else ''}, not one "
                f"tensor with the batch of {len(names)} samples first, so samples routed to the base (None) cannot "
                "get the original module's output. Route every sample to an adapter, or save a module whose output "
                "is batch-first."
            )
        base = torch.tensor([n is None for n in names], device=trained.device)  # (B,)
        return torch.where(base.view(-1, *([1] * (trained.dim() - 1))), original.to(trained.dtype), trained)


def wrap_modules_to_save(model: nn.Module, names: Iterable[str]) -> dict[str, ModulesToSave]:
    """Replace each named module of ``model`` with a :class:`ModulesToSave` wrapper; returns the wrappers.

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
    """The :class:`ModulesToSave` wrappers of ``model`` by full module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, ModulesToSave)}


def saved_elsewhere(model: nn.Module, name: str) -> bool:
    """Whether module ``name`` of ``model`` is (or holds) a :class:`ModulesToSave` wrapper: another technique already
    trains and saves it in full, so a second technique must leave it out of its own ``modules_to_save``."""
    return any(isinstance(m, ModulesToSave) for m in model.get_submodule(name).modules())


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


def select_named(model: nn.Module, names: list[str], who: str) -> list[str]:
    """The full names of the modules ``names`` gives (full names or dotted suffixes) for ``modules_to_save``:
    outermost ones only (a module inside another is saved with it).

    Raises:
        ValueError: If an entry matches no module, or a chosen module is already saved by another technique.
    """
    modules = [n for n, _ in model.named_modules() if n]

    def matches(name: str, entry: str) -> bool:
        return name == entry or name.endswith(f".{entry}")

    chosen = [n for n in modules if any(matches(n, entry) for entry in names)]
    missing = [entry for entry in names if not any(matches(n, entry) for n in chosen)]
    if missing:
        raise ValueError(
            f"{who}(modules_to_save={names!r}): {missing} matched no module of {type(model).__name__}. "
            "Check the names with model.named_modules()."
        )
    chosen = [n for n in chosen if not any(n.startswith(f"{o}.") for o in chosen)]
    wrapped = [n for n in chosen if saved_elsewhere(model, n)]
    if wrapped:
        raise ValueError(
            f"{who}(modules_to_save={names!r}): {wrapped[0]!r} is already trained and saved in full by another "
            "adapter on this model (its modules_to_save); leave it out here, it trains and is saved once."
        )
    return chosen
