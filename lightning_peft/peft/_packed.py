"""Packed batches for per-row routing: one ``(1, T)`` sequence of N rows with row boundaries ``cu_seqlens`` (the
``(N + 1,)`` ints ``[0, end of row 0, ..., T]`` that ``SFTDataModule(packing=True)`` writes and flash-attn's varlen
kernel takes), and what a layer needs to give each token its row's adapter: the boundaries checked, the row of each
token, the runs of rows that share an adapter, and the layout of a layer's input.

LoRA's [`Routing`][lightning_peft.peft.Routing] uses these; nothing here is LoRA's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor


def check_bounds(cu_seqlens: object, rows: int | None) -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple of ints, checked: ``rows + 1`` increasing integers from 0 (one per row edge).

    Raises:
        ValueError: If they are not, or ``rows`` is None (boundaries without names).
    """
    given = f"route_adapters(cu_seqlens={_short(cu_seqlens)})"
    if rows is None:
        raise ValueError(f"{given}: cu_seqlens comes with names, one per packed row; give both, or neither to end "
                         "routing.")
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex \
                or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"{given}: give the row boundaries as a 1-D integer tensor (N + 1,), as SFTDataModule "
                             f"writes them; got a {cu_seqlens.dim()}-D {cu_seqlens.dtype} tensor.")
        cu_seqlens = cu_seqlens.tolist()
    if isinstance(cu_seqlens, (str, bytes)) or not isinstance(cu_seqlens, Sequence) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in cu_seqlens):
        raise ValueError(f"{given}: give the row boundaries as a 1-D integer tensor or a list of ints.")
    if len(cu_seqlens) != rows + 1:
        raise ValueError(f"{given}: {len(cu_seqlens)} boundaries for {rows} names; a packed batch of N rows has "
                         "N + 1 boundaries [0, end of row 0, ..., T] and one adapter name (or None) per row.")
    if cu_seqlens[0] != 0:
        raise ValueError(f"{given}: the boundaries must start at 0 (the first row's first token), not at "
                         f"{cu_seqlens[0]}.")
    if any(b <= a for a, b in itertools.pairwise(cu_seqlens)):
        raise ValueError(f"{given}: the boundaries must increase (every packed row holds at least one token).")
    return tuple(cu_seqlens)


def _short(value: object) -> str:
    """``value`` for a message: a tensor's values (the first 8) rather than its repr."""
    if isinstance(value, Tensor) and value.dim() == 1:
        values = value.tolist()
        return str(values if len(values) <= 8 else [*values[:8], "..."])
    return repr(value)


def row_of_token(bounds: tuple[int, ...]) -> Tensor:
    """(T,): the packed row of each token."""
    lengths = torch.tensor(bounds).diff()  # (N,)
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=bounds[-1])


def runs(values: Sequence, bounds: tuple[int, ...]) -> list[tuple[object, int]]:
    """``(value, tokens)`` of each run of consecutive rows with the same value (``values``: one per row), in order.

    Examples:
        >>> runs(["a", "a", None, "b"], (0, 3, 5, 6, 9))
        [('a', 5), (None, 1), ('b', 3)]
    """
    merged: list[tuple[object, int]] = []
    for value, (start, end) in zip(values, itertools.pairwise(bounds)):
        if merged and merged[-1][0] == value:
            merged[-1] = (value, merged[-1][1] + end - start)
        else:
            merged.append((value, end - start))
    return merged


def token_layout(x: Tensor, bounds: tuple[int, ...], features: int | None, where: str) -> int:
    """How many leading dimensions of ``x`` hold a packed batch's tokens: 2 for ``(1, T, ...)``, 1 for ``(T, ...)``
    (tokens flattened, as MoE routers see them), ``features`` trailing dimensions after them (None: ``x`` is not one
    entry per token, and only its batch dimension is checked).

    Raises:
        ValueError: For any other layout, naming ``where`` (the layer).
    """
    tokens, rows = bounds[-1], len(bounds) - 1
    lead = tuple(x.shape[: x.dim() - features]) if features is not None else tuple(x.shape[:1])
    if lead == (1, tokens) or (features is None and lead == (1,)):
        return 2
    if lead == (tokens,) and features is not None:
        return 1
    if not lead or lead[0] != 1:
        raise ValueError(
            f"route_adapters(cu_seqlens=...): an input of shape {tuple(x.shape)} (a batch of "
            f"{lead[0] if lead else 0}) reached {where}, but a packed batch has batch size 1: its {rows} rows are "
            f"{tokens} tokens in one sequence, (1, {tokens}, ...). Pack the rows into one sequence, or route a padded "
            "batch without cu_seqlens (one name per sample)."
        )
    raise ValueError(
        f"route_adapters(cu_seqlens=...): an input of shape {tuple(x.shape)} ({math.prod(lead[1:])} tokens) reached "
        f"{where}, but cu_seqlens ends at {tokens}: every LoRA layer must see the packed batch's {tokens} tokens, one "
        "per position. Give the boundaries of this batch (SFTDataModule writes them as batch['cu_seqlens'])."
    )
