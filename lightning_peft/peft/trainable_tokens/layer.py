"""The trainable-tokens layer: a frozen embedding (or tied head) with chosen rows replaced by trained ones, and the
wrapper that stands in the model in its place (names and shapes as PEFT's, in `lightning_peft.peft.trainable_tokens`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._common import LayerWrapper, adapter_dtype

INNER = "token_adapter"


class TrainableTokensLayer(LayerWrapper):
    """A frozen embedding (or bias-free linear head) whose rows ``token_indices[n]`` are replaced by the trained
    ``trainable_tokens_delta[n]`` (k, d) of adapter ``n``; which adapter runs is ``routing``'s (LoRA's
    [`Routing`][lightning_peft.peft.Routing]).

    A layer ``tied_to`` another one (an output head sharing the embedding's weight) owns nothing: it reads the other
    layer's rows, so both always hold the same ones.
    """

    def __init__(self, base_layer: nn.Module, routing, tied_to: TrainableTokensLayer | None = None) -> None:
        super().__init__(base_layer)
        self.routing = routing
        self._tied_to = [] if tied_to is None else [tied_to]  # in a list: not a submodule, its rows saved once
        if tied_to is None:
            self.trainable_tokens_delta = nn.ParameterDict()
            self.trainable_tokens_original = nn.Module()  # non-persistent buffers, one per adapter
            self.token_indices: dict[str, list[int]] = {}
            self.merged_adapter: str | None = None
            self._remerge_after_load: str | None = None
        self.register_state_dict_post_hook(_unmerged_state)
        self.register_load_state_dict_pre_hook(_unmerge_before_load)
        self.register_load_state_dict_post_hook(_remerge_after_load)

    @property
    def owner(self) -> TrainableTokensLayer:
        """The layer holding the rows: this one, or the one it is tied to."""
        return self._tied_to[0] if self._tied_to else self

    def add_adapter(self, name: str, ids: list[int]) -> None:
        """Adapter ``name`` trains rows ``ids``, starting from the base's rows (the base output)."""
        weight = self.base_layer.weight
        with torch.no_grad():
            rows = weight[torch.as_tensor(ids, device=weight.device)].detach()  # (k, d)
        self.token_indices[name] = list(ids)
        self.trainable_tokens_delta[name] = nn.Parameter(rows.to(adapter_dtype(weight)))
        self.trainable_tokens_original.register_buffer(name, rows.clone(), persistent=False)

    def delete_adapter(self, name: str) -> None:
        if self.merged_adapter == name:
            raise RuntimeError(f"TrainableTokensLayer: adapter {name!r} is merged; unmerge it before deleting it.")
        del self.token_indices[name], self.trainable_tokens_delta[name]
        delattr(self.trainable_tokens_original, name)

    def rows(self, name: str) -> tuple[Tensor, Tensor]:
        """``(idx (k,), delta (k, d))`` of adapter ``name``, on the delta's device."""
        owner = self.owner
        delta = owner.trainable_tokens_delta[name]
        return torch.as_tensor(owner.token_indices[name], device=delta.device), delta

    def merged_weight(self, weight: Tensor, name: str) -> Tensor:
        """``weight`` (the base's, or a copy of it) with adapter ``name``'s rows in place, out of place."""
        index, delta = self.rows(name)
        return weight.index_copy(0, index.to(weight.device), delta.detach().to(weight))

    @torch.no_grad()
    def merge(self, name: str) -> None:
        """Write adapter ``name``'s rows into the base weight (the tied head's too: it is the same weight)."""
        if self.merged_adapter == name:
            return
        if self.merged_adapter is not None:
            raise RuntimeError(f"TrainableTokensLayer: adapter {self.merged_adapter!r} is merged; unmerge it "
                               f"before merging {name!r}.")
        index, _ = self.rows(name)
        weight = self.base_layer.weight
        self.trainable_tokens_original.register_buffer(name, weight[index].clone(), persistent=False)
        weight.copy_(self.merged_weight(weight, name))
        self.merged_adapter = name
        self.routing.merged[name] = self.routing.merged.get(name, 0) + 1

    @torch.no_grad()
    def unmerge(self) -> None:
        """Write back the rows the base weight held before the merge."""
        name, weight = self.merged_adapter, self.base_layer.weight
        index, _ = self.rows(name)
        weight.index_copy_(0, index.to(weight.device), getattr(self.trainable_tokens_original, name).to(weight))
        self.routing.merged[name] -= 1
        self.merged_adapter = None

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        result = self.base_layer(x, *args, **kwargs)
        owner, routing = self.owner, self.routing
        if owner.merged_adapter is not None or routing.disabled:
            return result
        if routing.names is None:
            active = routing.active
            return self._replaced(x, result, active) if active in owner.token_indices else result
        packed = routing.cu_seqlens is not None  # names are packed rows of one (1, T) sequence: flags per token
        if packed and tuple(result.shape[:2]) != (1, routing.cu_seqlens[-1]):
            raise ValueError(f"route_adapters(cu_seqlens=...): an input of shape {tuple(x.shape)} reached the trainable "
                             f"tokens of {self.base_layer}, but a packed batch is one sequence of "
                             f"{routing.cu_seqlens[-1]} tokens, (1, {routing.cu_seqlens[-1]}).")
        if not packed and x.shape[0] != len(routing.names):
            raise ValueError(f"route_adapters: a batch of {x.shape[0]} samples reached the trainable tokens of "
                             f"{self.base_layer}, but {len(routing.names)} adapter names were given; give one name "
                             "per sample (the batch dimension must come first).")
        for name in dict.fromkeys(n for n in routing.names if n in owner.token_indices):
            flags = [n == name for n in routing.names]
            mine = routing.per_token(flags, result.device) if packed else torch.tensor(flags, device=result.device)
            mine = mine.view(*[1] * packed, -1, *[1] * (result.dim() - 1 - packed))  # (B, 1, ...) or (1, T, 1, ...)
            result = torch.where(mine, self._replaced(x, result, name), result)
        return result

    def _replaced(self, x: Tensor, result: Tensor, name: str) -> Tensor:
        """``result`` (the base output) with adapter ``name``'s rows in place of the base's."""
        index, delta = self.rows(name)
        base = self.base_layer
        if isinstance(base, nn.Linear):  # a head: logits (..., V), the k columns of the chosen tokens recomputed
            return result.index_copy(-1, index, F.linear(x, delta.to(x.dtype)).to(result.dtype))
        k = index.numel()
        slots = torch.full((base.num_embeddings,), k, dtype=torch.long, device=index.device)
        slots[index] = torch.arange(k, device=index.device)
        slot = slots[x]  # x's shape: the position of each id among the chosen ones; k: not chosen
        rows = F.pad(delta, (0, 0, 0, 1)).to(result.dtype)  # (k + 1, d): a last row for the ids not chosen
        pad = None if base.padding_idx is None else int(slots[base.padding_idx])  # no gradient to the padding row
        picked = F.embedding(slot, rows, padding_idx=None if pad == k else pad,
                             scale_grad_by_freq=base.scale_grad_by_freq)  # (..., d)
        scale = getattr(base, "embed_scale", None)  # scaled embeddings (Gemma) multiply in their forward
        if scale is not None:
            picked = picked * torch.as_tensor(scale, dtype=picked.dtype, device=picked.device)
        return torch.where((slot < k).unsqueeze(-1), picked, result)


# State-dict hooks: a merged layer reports its unmerged base weight, and loads into the unmerged layout, merging
# again afterwards (as LoRA layers do). A tied layer acts on its owner: the weight is the same.

def _unmerged_state(module: TrainableTokensLayer, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    owner, key = module.owner, f"{prefix}base_layer.weight"
    if owner.merged_adapter is not None and key in state_dict:
        index, _ = owner.rows(owner.merged_adapter)
        original = getattr(owner.trainable_tokens_original, owner.merged_adapter)
        state_dict[key] = state_dict[key].index_copy(0, index.to(original.device), original.to(state_dict[key]))


def _unmerge_before_load(module: TrainableTokensLayer, *args) -> None:
    owner = module.owner
    if owner.merged_adapter is not None:
        owner._remerge_after_load = owner.merged_adapter
        owner.unmerge()


def _remerge_after_load(module: TrainableTokensLayer, incompatible_keys) -> None:
    owner = module.owner
    if owner._remerge_after_load is not None:
        name, owner._remerge_after_load = owner._remerge_after_load, None
        owner.merge(name)


class TrainableTokensWrapper(nn.Module):
    """What stands in the model in place of the embedding (PEFT's ``TrainableTokensWrapper``): it runs its
    ``token_adapter``; attributes it lacks (``weight``, ``num_embeddings``, ``padding_idx``) are the base layer's."""

    def __init__(self, token_adapter: TrainableTokensLayer) -> None:
        super().__init__()
        self.token_adapter = token_adapter

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == INNER:
                raise
            return getattr(self.token_adapter, name)

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        return self.token_adapter(x, *args, **kwargs)
