"""What greedy, sampled (`lightning_peft.nn.generation`) and beam (`lightning_peft.nn.beam_search`) decoding share:
the positions and mask of a whole generation, and the logits of each row's last position."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_peft.nn.decoder import TransformerDecoder
from lightning_peft.nn.kv_cache import KVCache


def positions_and_mask(mask: Tensor | None, batch: int, length: int, new: int,
                       device: torch.device) -> tuple[Tensor, Tensor | None]:
    """Positions ``(B, L + new)`` (the prompt's, ``cumsum(mask) - 1`` when left-padded, then one more per new token)
    and the mask ``(B, L + new)`` (new tokens real), or None when every prompt token is real. Allocated once per
    generation; each step reads views of them."""
    if mask is None:
        return torch.arange(length + new, device=device).expand(batch, length + new), None
    prompt = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L); padding's positions are never read
    later = prompt[:, -1:] + torch.arange(1, new + 1, device=device)  # (B, new)
    return torch.cat([prompt, later], dim=1), torch.cat([mask, mask.new_ones(batch, new)], dim=1)


def last_logits(decoder: TransformerDecoder, ids: Tensor, mask: Tensor | None, positions: Tensor,
                cache: KVCache | None) -> Tensor:
    """The float32 logits ``(N, V)`` of each row's last position (the head on that position only)."""
    hidden = decoder.hidden_states(ids, mask, positions, kv_cache=cache)
    return decoder.cap_logits(decoder.lm_head(hidden[:, -1:]))[:, -1].float()
