"""Packed attention on SDPA: the sequences of a packed (1, H, T, D) batch gathered into padded groups of similar length.

Where flash-attn's varlen kernel is missing (the CPU, fp32, or no ``flash-attn``), a packed batch needs another way
to keep attention inside each sequence. Three exact ones:

- **loop**: one SDPA call per sequence. Its cost is a fixed overhead per call plus ``sum_i l_i^2`` of work: slow
  when the sequences are many and short (a pack of 64 rows of 16 tokens is 64 calls per layer, and as many in
  backward).
- **one padded batch**: every sequence gathered into an ``(N, H, l_max, D)`` batch with a key-padding mask, one
  call: ``N * l_max^2`` of work, so fast for rows of equal length and wasteful for a long-tailed mix.
- **groups** (the default, ``"auto"``): the rows sorted longest first and cut into groups, each one padded call. A
  row of ``l`` tokens joins the current group (longest row ``l_max``) when its padded work is at most
  ``max_padding`` times its own, ``l_max^2 <= max_padding * l^2``, or when ``l_max <= free_length`` (there a call's
  overhead outweighs any padding). So a group's work is at most ``max_padding`` times the loop's, in one call.

A block-diagonal ``(T, T)`` boolean mask in one SDPA call is exact too, but SDPA's kernels compute every masked
block: ``T^2`` work and memory, 4x to 9x the loop's time at 2048 tokens and slower than the groups at every shape
measured (``benchmarks/bench_packed_attention.py``), so it is not a path here.

Every path runs `_sdpa_attention` per call (the fused CPU kernel with causal plus a key-padding mask stays linear in
memory) and gives each sequence exactly the attention it gets alone: padded keys are masked, padded queries are
dropped, and the padding (copies of the row's last token) never mixes with another row. Gradients flow through the
gathers (zeros for the padding).

Shapes: ``q`` (1, H, T, D); ``k``, ``v`` (1, Hkv, T, D); ``bounds`` the ``cu_seqlens`` as a list ``[0, ..., T]``;
a group's gathered tensors (n, H, l_max, D); the output (1, H, T, D).
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import Tensor

from lightning_peft._checks import choice
from lightning_peft.nn.attention_backends import _sdpa_attention

__all__ = ["PACKED_METHODS", "length_groups", "packed_sdpa"]

PACKED_METHODS = ("auto", "loop", "padded")
MAX_PADDING = 2.0  # padded work / the rows' own work a group may reach (measured: see the module docstring)
FREE_LENGTH = 32  # rows this short always share a call: the call's overhead exceeds their padding


def length_groups(lengths: list[int] | tuple[int, ...], method: str = "auto", max_padding: float = MAX_PADDING,
                  free_length: int = FREE_LENGTH) -> list[list[int]]:
    """The rows (indices into ``lengths``) each padded SDPA call takes, longest row first in every group.

    ``"loop"``: one row a group; ``"padded"``: every row in one group; ``"auto"``: the greedy rule of the module
    docstring. Empty rows are in no group.

    Examples:
        >>> length_groups([3, 40, 38, 200, 5])
        [[3], [1, 2], [4, 0]]
        >>> length_groups([3, 40, 38, 200, 5], "loop")
        [[3], [1], [2], [4], [0]]
    """
    choice("packed_attention", "sdpa_method", method, PACKED_METHODS)
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    if method == "padded":
        return [order] if order else []
    groups: list[list[int]] = []
    for i in order:
        longest = lengths[groups[-1][0]] if groups else 0
        if method == "auto" and groups and (longest <= free_length or longest**2 <= max_padding * lengths[i]**2):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@functools.lru_cache(maxsize=8)  # one plan per batch, reused by every layer (and by activation recomputation)
def _plan(bounds: tuple[int, ...], method: str, device: torch.device) -> tuple[list, Tensor]:
    """Per group: ``(start, stop)`` for a row taken alone, or ``(index (n, l_max), valid (n, l_max) | None)``;
    and the permutation that puts the groups' outputs back in token order. Small: O(T) integers."""
    starts, lengths = bounds[:-1], [b - a for a, b in itertools.pairwise(bounds)]
    calls, order = [], []
    for group in length_groups(lengths, method):
        order += [t for i in group for t in range(starts[i], starts[i] + lengths[i])]
        if len(group) == 1:
            calls.append((starts[group[0]], starts[group[0]] + lengths[group[0]]))
            continue
        first = torch.tensor([starts[i] for i in group], device=device)[:, None]  # (n, 1)
        size = torch.tensor([lengths[i] for i in group], device=device)[:, None]  # (n, 1)
        offset = torch.arange(lengths[group[0]], device=device)[None]  # (1, l_max)
        valid = offset < size  # (n, l_max)
        index = first + torch.minimum(offset, size - 1)  # padding repeats the row's last token
        calls.append((index, None if bool(valid.all()) else valid))
    inverse = torch.empty(len(order), dtype=torch.long, device=device)
    inverse[torch.tensor(order, dtype=torch.long, device=device)] = torch.arange(len(order), device=device)
    return calls, inverse


def packed_sdpa(q: Tensor, k: Tensor, v: Tensor, bounds: list[int], causal: bool, dropout_p: float, scale: float,
                method: str = "auto", window: int | None = None) -> Tensor:
    """Attention inside each packed sequence of ``q``/``k``/``v`` (1, H*, T, D) on SDPA: (1, H, T, D).

    ``bounds`` are the checked ``cu_seqlens``; ``method`` one of `PACKED_METHODS` (`length_groups`); ``window`` a
    causal sliding window inside each sequence (right padding never reaches a real query's band).
    """
    calls, inverse = _plan(tuple(bounds), method, q.device)
    if not calls:
        return torch.zeros_like(q)
    pieces = []  # (H, tokens of the group, D) each, in the plan's token order
    for first, second in calls:
        if isinstance(first, int):
            out = _sdpa_attention(q[:, :, first:second], k[:, :, first:second], v[:, :, first:second], causal, None,
                                  dropout_p, scale, window)  # (1, H, l, D)
            pieces.append(out[0])
            continue
        grouped = [t[0][:, first].transpose(0, 1) for t in (q, k, v)]  # (n, H*, l_max, D)
        out = _sdpa_attention(*grouped, causal, second, dropout_p, scale, window).transpose(0, 1)  # (H, n, l_max, D)
        pieces.append(out.flatten(1, 2) if second is None else out[:, second])  # (H, tokens, D)
    return torch.cat(pieces, dim=1).index_select(1, inverse)[None]  # (1, H, T, D)
