"""Whether a model's adapter is the one a callback asks for, judged by what the callback's settings RESOLVE to on this
model rather than by how they are spelled.

A model adapted elsewhere (Hugging Face PEFT's folder through `lightning_peft.peft.load_adapter`, typically, to train
on from it) records its config as written there: PEFT writes ``target_modules`` from a Python set (in no order) or as
the exact module names, and its task types name the head in ``modules_to_save`` where the user's callback leaves it at
None (meaning that very head). Such spellings differ while the adapter is the same. So the callback's settings are
injected, for real, into a copy of the model whose tensors live on the ``meta`` device (no memory, no arithmetic) and
from which the model's adapter of this technique was taken out again: the adapter the callback WOULD build on this
model. The two adapters' records then agree on what was resolved (the adapted modules, ``modules_to_save``, the numeric
settings), the rule spellings aside, or the callback is refused, naming the first difference.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from lightning_peft.peft.adapter import Adapter, attached
from lightning_peft.peft.checkpoint import resolved


def meta_copy(model: nn.Module, keep: tuple[Any, ...] = ()) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are empty ``meta`` tensors of the same shapes and dtypes
    (``keep``: objects the copy shares instead of copying, such as a trainer a LightningModule points at)."""
    memo: dict[int, Any] = {id(obj): obj for obj in keep}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def resolved_difference(callback: Any, trainer: Any, model: nn.Module, adapter: Adapter) -> str | None:
    """None if ``adapter`` (``model``'s, of ``callback.kind``) is what ``callback`` would inject into the plain model
    (`lightning_peft.peft.checkpoint.resolved` records equal); else the first difference in words, or why the
    callback's adapter could not be resolved on a ``meta`` copy of the model."""
    try:
        skeleton = meta_copy(model, keep=(trainer,))
        attached(skeleton)[callback.kind].unload(skeleton, merge=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            callback.inject(trainer, skeleton)
        wanted = attached(skeleton)[callback.kind]
    except Exception as err:  # noqa: BLE001 -- whatever stops the rehearsal, the adapters cannot be shown to agree
        return f"the callback's settings could not be resolved on a copy of the model ({type(err).__name__}: {err})"
    first_only = bool(callback.request().get("first_only"))
    have, want = resolved(adapter.config_dict(), first_only), resolved(wanted.config_dict(), first_only)
    for key in [*have, *(k for k in want if k not in have)]:
        if have.get(key, "<none>") != want.get(key, "<none>"):
            return f"{key}: the model's adapter has {have.get(key, '<none>')!r}, this callback's settings resolve " \
                   f"to {want.get(key, '<none>')!r} on it"
    return None
