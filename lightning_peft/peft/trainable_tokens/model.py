"""Trainable tokens on a whole model: which modules (the input embedding, tied heads; PEFT's rules), wrapping them,
their parameters, merging and unloading. LoRA calls these for ``trainable_token_indices``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .._common import inside, name_matches
from ..modules_to_save import set_submodule
from .config import FIELD as _FIELD
from .config import Indices
from .layer import INNER, TrainableTokensLayer, TrainableTokensWrapper

DELTA = "trainable_tokens_delta"


def token_wrappers(model: nn.Module) -> dict[str, TrainableTokensWrapper]:
    """The [`TrainableTokensWrapper`][lightning_peft.peft.trainable_tokens.TrainableTokensWrapper]s of ``model`` by
    full module name (the owners and the tied heads)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, TrainableTokensWrapper)}


def token_parameters(model: nn.Module, name: str | None = None) -> dict[str, nn.Parameter]:
    """The trained rows of adapter ``name`` (None: of every adapter) by ``model`` state-dict key."""
    return {f"{n}.{INNER}.{DELTA}.{a}": p for n, w in token_wrappers(model).items() if not w.token_adapter._tied_to
            for a, p in w.token_adapter.trainable_tokens_delta.items() if name in (None, a)}


# --- which modules -----------------------------------------------------------------------------------------------


def select_tokens(model: nn.Module, indices: Indices, taken: Iterable[str], who: str = "LoRA"
                  ) -> dict[str, tuple[list[int], list[str]]]:
    """``{embedding name: (ids, names of the modules tied to it)}`` for ``indices`` (a list: the input embedding);
    raises before anything is changed.

    Args:
        taken: Modules another part of the adapter wraps (LoRA's targets, ``modules_to_save``): refused here.
    """
    base = _base_view(model)
    if isinstance(indices, list):
        asked = {_input_embedding(model, base, indices, who): indices}
    else:
        asked = {}
        for key, ids in indices.items():
            found = [n for n in base if n and name_matches(n, [key])]
            if not found:
                raise ValueError(f"{who}({_FIELD}={indices!r}): {key!r} matches no module of {type(model).__name__}; "
                                 "name the embedding as model.named_modules() does, e.g. 'embed_tokens'.")
            asked.update(dict.fromkeys(found, ids))
    sharing = _sharing(base)
    chosen: dict[str, tuple[list[int], list[str]]] = {}
    followers: dict[str, str] = {}
    for name, ids in asked.items():
        _check_module(model, base, name, ids, indices, who)
        if name in followers:  # the head tied to an embedding named too: the same rows, or refused
            if ids != chosen[followers[name]][0]:
                raise ValueError(f"{who}({_FIELD}={indices!r}): {name!r} shares its weight with "
                                 f"{followers[name]!r} (tied), so both get the same rows; give them the same ids.")
            continue
        tied = _tied(model, base, sharing, name, indices, who)
        chosen[name] = (ids, tied)
        followers.update(dict.fromkeys(tied, name))
    for name in [n for n, (_, tied) in chosen.items() for n in (n, *tied)]:
        if name in taken or inside(name, taken) or any(inside(t, [name]) for t in taken):
            raise ValueError(f"{who}({_FIELD}={indices!r}): {name!r} is also adapted or saved in full by this adapter "
                             "(target_modules / modules_to_save); train its rows or the whole module, not both.")
    return chosen


def _base_view(model: nn.Module) -> dict[str, nn.Module]:
    """``named_modules`` with each trainable-tokens wrapper standing for its base layer (insides hidden)."""
    view: dict[str, nn.Module] = {}
    hidden: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if any(name.startswith(h) for h in hidden):
            continue
        view[name] = _unwrapped(module)
        if isinstance(module, TrainableTokensWrapper):
            hidden.append(f"{name}.")
    return view


def _input_embedding(model: nn.Module, base: dict[str, nn.Module], indices: list[int], who: str) -> str:
    """The module ``model.get_input_embeddings()`` returns (else one named ``embed_tokens``), as PEFT picks it."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if isinstance(embedding, TrainableTokensWrapper):
        embedding = embedding.token_adapter.base_layer
    names = [n for n, m in base.items() if m is embedding] if isinstance(embedding, nn.Module) else \
        [n for n in base if name_matches(n, ["embed_tokens"])]
    if not names:
        raise ValueError(
            f"{who}({_FIELD}={indices!r}): {type(model).__name__} has no input embedding (no get_input_embeddings(), "
            "no module named 'embed_tokens'); name the embedding, e.g. trainable_token_indices={'embedding': "
            f"{indices!r}}}, or leave trainable_token_indices out."
        )
    return names[0]


def _check_module(model: nn.Module, base: dict[str, nn.Module], name: str, ids: list[int], indices: Indices,
                  who: str) -> None:
    module = base[name]
    if not (isinstance(module, nn.Embedding) or (isinstance(module, nn.Linear) and module.bias is None)):
        raise TypeError(f"{who}({_FIELD}={indices!r}): {name!r} is a {type(module).__name__}; trainable tokens "
                        "replace rows of an nn.Embedding (or of a bias-free nn.Linear head tied to one). Name the "
                        "embedding module.")
    if isinstance(module, nn.Embedding) and module.max_norm is not None:
        raise ValueError(f"{who}({_FIELD}={indices!r}): {name!r} is an nn.Embedding with max_norm={module.max_norm}, "
                         "which renormalises rows in place as it reads them; trainable tokens need max_norm=None.")
    rows = module.weight.shape[0]
    if max(ids) >= rows:
        raise ValueError(f"{who}({_FIELD}={indices!r}): token id {max(ids)} is out of range for {name!r}, which has "
                         f"{rows} rows (ids 0..{rows - 1}); resize the embeddings first "
                         "(model.resize_token_embeddings(len(tokenizer))).")
    aliases = [n for n, m in base.items() if m is module and n != name]
    if aliases:
        raise ValueError(f"{who}({_FIELD}={indices!r}): the module at {name!r} is also registered as {aliases}; its "
                         "rows would be trained under one name only. Register the module once.")


def _sharing(base: dict[str, nn.Module]) -> dict[int, list[str]]:
    """``id(weight) -> names of the modules whose weight it is``."""
    owners: dict[int, list[str]] = {}
    for name, module in base.items():
        weight = module._parameters.get("weight") if name else None
        if weight is not None:
            owners.setdefault(id(weight), []).append(name)
    return owners


def _tied(model: nn.Module, base: dict[str, nn.Module], sharing: dict[int, list[str]], name: str, indices: Indices,
          who: str) -> list[str]:
    """The modules whose weight is ``name``'s: tied heads when the model declares them (as PEFT ties them)."""
    others = [n for n in sharing[id(base[name].weight)] if n != name]
    get = getattr(model, "get_input_embeddings", None)
    declared = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False)) and callable(get)
    if others and not (declared and _unwrapped(get()) is base[name]):
        raise ValueError(
            f"{who}({_FIELD}={indices!r}): the weight of {name!r} is also the weight of {others[0]!r}, but it is not "
            "an input embedding the model declares tied (config.tie_word_embeddings); Hugging Face PEFT would train "
            f"the rows of {name!r} only, so the two would differ. Name the input embedding, or untie the weights."
        )
    for other in others:
        _check_module(model, base, other, [0], indices, who)
    return others


def _unwrapped(module: object) -> object:
    return module.token_adapter.base_layer if isinstance(module, TrainableTokensWrapper) else module


def wrap_tokens(model: nn.Module, chosen: dict[str, tuple[list[int], list[str]]], adapter_name: str, routing
                ) -> dict[str, TrainableTokensWrapper]:
    """Give adapter ``adapter_name`` the rows ``chosen`` (from `select_tokens`), wrapping the modules not wrapped
    yet; returns the owners' wrappers."""
    wrapped = {}
    for name, (ids, tied) in chosen.items():
        wrapper = model.get_submodule(name)
        if not isinstance(wrapper, TrainableTokensWrapper):
            wrapper = TrainableTokensWrapper(TrainableTokensLayer(wrapper, routing))
            set_submodule(model, name, wrapper)
        wrapper.token_adapter.add_adapter(adapter_name, ids)
        for other in tied:
            if not isinstance(model.get_submodule(other), TrainableTokensWrapper):
                layer = TrainableTokensLayer(model.get_submodule(other), routing, tied_to=wrapper.token_adapter)
                set_submodule(model, other, TrainableTokensWrapper(layer))
        wrapped[name] = wrapper
    return wrapped


def merged_token_state(model: nn.Module, state: dict[str, Tensor], chosen) -> dict[str, Tensor]:
    """``state`` (a state dict of ``model``) with every wrapper under its base layer's keys and, where
    ``chosen(layer)`` names an adapter of it, that adapter's rows written into the weight (one tensor for tied
    modules)."""
    merged: dict[int, Tensor] = {}
    for name, wrapper in token_wrappers(model).items():
        layer, prefix = wrapper.token_adapter, f"{name}.{INNER}."
        for key in [k for k in state if k.startswith(prefix)]:
            value = state.pop(key)
            if key.startswith(f"{prefix}base_layer."):
                state[f"{name}.{key[len(prefix) + len('base_layer.'):]}"] = value
        owner = layer.owner
        adapter = owner.merged_adapter or chosen(owner)
        if adapter in owner.token_indices and f"{name}.weight" in state:  # a state dict holds unmerged rows
            if id(owner) not in merged:
                merged[id(owner)] = owner.merged_weight(state[f"{name}.weight"], adapter)
            state[f"{name}.weight"] = merged[id(owner)]
    return state


def unload_tokens(model: nn.Module, names: Iterable[str] | None = None) -> None:
    """Put the base layers back in place of the wrappers (of adapters ``names`` when every adapter a wrapper holds is
    among them; None: all). Merging is the caller's business."""
    for name, wrapper in token_wrappers(model).items():
        owner = wrapper.token_adapter.owner
        if names is None or set(owner.token_indices) <= set(names):
            set_submodule(model, name, wrapper.token_adapter.base_layer)


def delete_tokens(model: nn.Module, name: str) -> None:
    """Remove adapter ``name``'s rows; wrappers left without rows give their base layer back."""
    owners = [w.token_adapter for w in token_wrappers(model).values()
              if not w.token_adapter._tied_to and name in w.token_adapter.token_indices]
    unload_tokens(model, [name])
    for owner in owners:
        owner.delete_adapter(name)


def merge_tokens(model: nn.Module, name: str) -> list[str]:
    """Merge adapter ``name``'s rows into the weights in place; returns the names of the embeddings this call merged.

    Raises:
        RuntimeError: If some rows are not finite (before anything is merged).
    """
    owners = {n: w.token_adapter for n, w in token_wrappers(model).items() if not w.token_adapter._tied_to
              and name in w.token_adapter.token_indices and w.token_adapter.merged_adapter != name}
    for where, owner in owners.items():
        if not torch.isfinite(owner.trainable_tokens_delta[name]).all():
            raise RuntimeError(f"the trained rows of {where!r} (adapter {name!r}) hold inf or NaN; merging would write "
                               "them into the embedding. Nothing was merged.")
    for owner in owners.values():
        owner.merge(name)
    return list(owners)


def unmerge_tokens(model: nn.Module) -> list[str]:
    """Write back the rows every merged owner replaced; returns their names."""
    merged = {n: w.token_adapter for n, w in token_wrappers(model).items()
              if not w.token_adapter._tied_to and w.token_adapter.merged_adapter is not None}
    for owner in merged.values():
        owner.unmerge()
    return list(merged)
