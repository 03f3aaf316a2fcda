"""`beam_search`: deterministic beam search for `lightning_peft.nn.generate` (``num_beams > 1``), on a `KVCache`
whose rows follow the beams.

Papers: Sutskever et al. 2014, "Sequence to Sequence Learning with Neural Networks" (arXiv:1409.3215: left-to-right
beam search); Wu et al. 2016, "Google's Neural Machine Translation System" (arXiv:1609.08144: the length penalty).

Rule (transformers' ``GenerationMixin._beam_search``, ``do_sample=False``, whose tokens it returns). Each prompt keeps
``k = num_beams`` running beams with scores ``s`` (the sum of their tokens' float32 log-probabilities; at the start
beam 0 scores 0 and the others -1e9, so the first step expands one beam) and a list of ``k`` finished hypotheses
(placeholders scoring -1e9 at first). With ``S`` stop tokens, ``K = max(2, 1 + S) * k`` and ``n`` the tokens
generated so far, one step is:

    candidates:  the K best (beam, token) by s_beam + log_softmax(logits_beam)_token over all k * V pairs
    running:     the k best candidates that neither end in a stop token nor reach max_new_tokens
    finished:    each of the k best candidates that does, scored  s / (n + 1) ** length_penalty,
                 enters the list if it beats its worst entry (the list keeps the k best)

``length_penalty`` > 0 favours longer hypotheses, < 0 shorter ones (transformers' ``length ** penalty``, not GNMT's
``((5 + length) / 6) ** alpha``). A prompt stops collecting when its list is full and no running beam can beat it:
with ``early_stopping=True`` as soon as it holds ``k`` hypotheses; with False when the best running score divided by
``n ** length_penalty`` is below the list's worst; with ``"never"`` the same bound at the longest length when
``length_penalty > 0`` (the canonical search). The loop ends when every prompt has stopped, or after
``max_new_tokens`` (every running beam then finishes). The result holds each prompt's ``num_return_sequences`` best
hypotheses, best first, cut to the longest of them; shorter ones end in ``pad_token_id``.

Cache and rows. The prompts run once (``B`` rows, prefill); their cached keys and values are then repeated to
``B * k`` rows, prompt ``b``'s beams in rows ``b * k .. b * k + k - 1``, and after each step the cache's rows are
reordered to the beams' parents (`KVCache.reorder`: one ``index_select`` on the batch dimension). A beam never moves
to another prompt's rows, so a per-sample routing (``route_adapters(decoder, names)`` with ``B`` names around the
call) is repeated ``k`` times in a row for the ``B * k`` rows, as transformers' expansion repeats the inputs, and
restored afterwards.

Shapes: ``input_ids`` ``(B, L)``; the result ``(B * R, L + n)`` with ``R = num_return_sequences``, prompt ``b``'s
hypotheses in rows ``b * R .. b * R + R - 1``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_peft._checks import integer, real
from lightning_peft.nn._decode import last_logits, positions_and_mask
from lightning_peft.nn.decoder import TransformerDecoder
from lightning_peft.nn.kv_cache import KVCache

__all__ = ["BeamSettings", "beam_search", "check_beams"]

#: `generate`'s checked settings, ``generation._Settings`` (read here: ``max_new_tokens``, ``temperature``, ``top_k``,
#: ``top_p``, ``stops``, ``pad``, ``mask``); named, not imported, since `lightning_peft.nn.generation` imports this.
_Settings = Any


_NEVER = -1.0e9  # transformers' score of an excluded hypothesis (added in float32: the same rounding as its search)


@dataclass(frozen=True)
class BeamSettings:
    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    num_return_sequences: int


def check_beams(who: str, settings: _Settings, num_beams: int, length_penalty: float, early_stopping: bool | str,
                num_return_sequences: int) -> BeamSettings | None:
    """The beam arguments of `generate` checked (errors name ``who``); None for ``num_beams=1`` (greedy or sampling).

    Raises:
        ValueError: If ``num_beams < 1``, ``num_return_sequences`` is not in ``[1, num_beams]``, beams come with
            sampling (``temperature > 0``), or ``length_penalty`` / ``early_stopping`` come without beams.
        TypeError: If an argument has the wrong type.
    """
    num_beams = integer(who, "num_beams", num_beams, minimum=1, example="4")
    num_return_sequences = integer(who, "num_return_sequences", num_return_sequences, minimum=1, example="1")
    length_penalty = real(who, "length_penalty", length_penalty, example="1.0")
    if not isinstance(early_stopping, bool) and early_stopping != "never":
        raise ValueError(f"{who}(early_stopping={early_stopping!r}): early_stopping must be True, False or 'never'.")
    if num_return_sequences > num_beams:
        raise ValueError(f"{who}(num_beams={num_beams}, num_return_sequences={num_return_sequences}): the search keeps "
                         f"{num_beams} hypotheses per prompt, so it returns at most that many; raise num_beams to >= "
                         f"{num_return_sequences} or lower num_return_sequences.")
    if num_beams == 1:
        if length_penalty != 1.0 or early_stopping is not False:
            raise ValueError(f"{who}(num_beams=1, length_penalty={length_penalty!r}, early_stopping="
                             f"{early_stopping!r}): length_penalty and early_stopping rank beam hypotheses, and "
                             "num_beams=1 decodes one sequence per prompt (greedy or sampled); set num_beams > 1 or "
                             "leave them at 1.0 and False.")
        return None
    if settings.temperature > 0:
        raise ValueError(f"{who}(num_beams={num_beams}, temperature={settings.temperature!r}, top_k={settings.top_k!r}"
                         f", top_p={settings.top_p!r}): beam search is deterministic (transformers' num_beams with "
                         "do_sample=False) and does not sample; set temperature=0 (without top_k and top_p) for beams, "
                         "or num_beams=1 to sample.")
    return BeamSettings(num_beams, length_penalty, early_stopping, num_return_sequences)


@dataclass
class _State:
    """The search's tensors (``P`` prompts, ``k`` beams, ``T`` = prompt + new tokens)."""

    running: Tensor  # (P, k, T) token ids: the running beams' tokens (unwritten positions hold the padding token)
    running_scores: Tensor  # (P, k) float32: summed log-probabilities
    finished: Tensor  # (P, k, T) token ids: the finished hypotheses, best first
    scores: Tensor  # (P, k) float32: their length-penalised scores (-1e9: an empty slot)
    lengths: Tensor  # (P, k) long: their new tokens
    is_finished: Tensor  # (P, k) bool: a real hypothesis in the slot
    open: Tensor  # (P, 1) bool: a running beam may still beat the list


@torch.no_grad()
def beam_search(decoder: TransformerDecoder, input_ids: Tensor, settings: _Settings, beams: BeamSettings,
                use_cache: bool) -> Tensor:
    """`generate` with ``num_beams > 1`` on checked settings (the rule: module docstring).

    Examples:
        >>> from lightning_peft.nn import generate
        >>> decoder = TransformerDecoder(vocab_size=50, hidden_size=16, num_layers=2, num_heads=4).eval()
        >>> prompts = torch.tensor([[3, 4, 5], [7, 8, 9]])
        >>> out = generate(decoder, prompts, 6, num_beams=3, num_return_sequences=2)  # 2 hypotheses per prompt
        >>> out.shape, torch.equal(out, generate(decoder, prompts, 6, num_beams=3, num_return_sequences=2,
        ...                                      use_cache=False))
        (torch.Size([4, 9]), True)
    """
    batch, length = input_ids.shape
    k, repeat = beams.num_beams, beams.num_return_sequences
    if settings.max_new_tokens == 0:
        return input_ids.repeat_interleave(repeat, dim=0)
    device, total = input_ids.device, length + settings.max_new_tokens
    positions, mask = positions_and_mask(settings.mask, batch, length, settings.max_new_tokens, device)  # (B, total)
    cache = KVCache(total) if use_cache else None
    logits = last_logits(decoder, input_ids, None if mask is None else mask[:, :length], positions[:, :length],
                         cache)  # (B, V): the prompts once
    rows = torch.arange(batch, device=device).repeat_interleave(k)  # (B * k,): each prompt's row, k times
    if cache is not None:
        cache.reorder(rows)
    mask = None if mask is None else mask[rows]  # (B * k, total)
    positions = positions[rows]  # (B * k, total)
    state = _start(input_ids, k, total, settings.pad)
    with _routed_beams(decoder, batch, k):
        for step in range(settings.max_new_tokens):
            if step:
                end = length + step  # tokens so far
                start = 0 if cache is None else end - 1  # the cache holds all but the beams' last tokens
                ids = state.running[:, :, start:end].reshape(batch * k, -1)  # (B * k, end - start)
                logits = last_logits(decoder, ids, None if mask is None else mask[:, :end], positions[:, start:end],
                                     cache)
            else:
                logits = logits[rows]
            parents, stop = _step(state, logits, settings, beams, length, length + step, total)
            if stop:
                break
            if cache is not None:
                cache.reorder(parents)  # each beam's row now holds its parent's keys and values
    return _best(state, repeat, length)


def _start(input_ids: Tensor, k: int, total: int, pad: int | None) -> _State:
    batch, length = input_ids.shape
    device = input_ids.device
    running = input_ids.new_full((batch, k, total), 0 if pad is None else pad)  # (B, k, T)
    running[:, :, :length] = input_ids[:, None]
    running_scores = torch.zeros(batch, k, device=device)  # (B, k) float32
    running_scores[:, 1:] = _NEVER  # the k beams start equal: only the first one expands at the first step
    return _State(running, running_scores, running.clone(), torch.full((batch, k), _NEVER, device=device),
                  torch.zeros(batch, k, dtype=torch.long, device=device),
                  torch.zeros(batch, k, dtype=torch.bool, device=device),
                  torch.ones(batch, 1, dtype=torch.bool, device=device))


def _step(state: _State, logits: Tensor, settings: _Settings, beams: BeamSettings, length: int, current: int,
          total: int) -> tuple[Tensor, bool]:
    """One step on the logits ``(P * k, V)`` of the running beams; ``current`` is where the new token goes. Returns
    each new running beam's parent row ``(P * k,)`` and whether the search is over."""
    batch, k = state.running_scores.shape
    vocab = logits.shape[-1]
    stops = settings.stops
    keep = max(2, 1 + (0 if stops is None else stops.numel())) * k  # enough that k candidates do not stop
    scores = torch.log_softmax(logits, dim=-1).view(batch, k, vocab) + state.running_scores[:, :, None]
    top_scores, top = torch.topk(scores.view(batch, k * vocab), keep)  # (P, K), best first
    parent, token = top // vocab, top % vocab  # (P, K)
    candidates = _gather(state.running, parent)  # (P, K, T)
    candidates[:, :, current] = token
    hits = torch.full_like(token, current + 1 >= total, dtype=torch.bool)  # (P, K): the candidate is complete
    if stops is not None:
        hits |= torch.isin(token, stops)
    # running: the k best candidates that go on
    go_on = top_scores + hits.to(torch.float32) * _NEVER
    chosen = torch.topk(go_on, k)[1]  # (P, k)
    state.running, state.running_scores = _gather(candidates, chosen), _gather(go_on, chosen)
    offsets = torch.arange(batch, device=token.device)[:, None] * k
    parents = (_gather(parent, chosen) + offsets).flatten()  # (P * k,)
    _collect(state, candidates, top_scores, hits, beams, current + 1 - length)
    state.open = _may_improve(state, beams, current + 1 - length, total - length)
    over = ~state.open.any() | (state.is_finished.all() & (beams.early_stopping is True)) | hits.all()
    return parents, bool(over)


def _collect(state: _State, candidates: Tensor, top_scores: Tensor, hits: Tensor, beams: BeamSettings,
             generated: int) -> None:
    """Put the complete candidates among the ``k`` best into the finished lists (``generated`` new tokens each)."""
    k = state.scores.shape[1]
    just = hits.clone()
    just[:, k:] = False  # only the k best candidates may finish; the rest are there to keep k running
    scores = top_scores / (generated ** beams.length_penalty)  # in transformers' order, for its float32 rounding
    scores += (state.is_finished.all(dim=-1, keepdim=True) & (beams.early_stopping is True)).to(torch.float32) * _NEVER
    scores += (~state.open).to(torch.float32) * _NEVER
    scores += (~just) * _NEVER
    merged = torch.cat([state.scores, scores], dim=1)  # (P, k + K)
    best = torch.topk(merged, k)[1]  # (P, k)
    state.finished = _gather(torch.cat([state.finished, candidates], dim=1), best)
    state.scores = _gather(merged, best)
    state.lengths = _gather(torch.cat([state.lengths, torch.full_like(hits, generated, dtype=torch.long)], 1), best)
    state.is_finished = _gather(torch.cat([state.is_finished, just], dim=1), best)


def _may_improve(state: _State, beams: BeamSettings, generated: int, most: int) -> Tensor:
    """``(P, 1)``: whether a prompt's best running beam may still beat its worst finished hypothesis."""
    penalty = beams.length_penalty
    reach = most if beams.early_stopping == "never" and penalty > 0.0 else generated
    best = state.running_scores[:, :1] / (reach ** penalty)
    worst = torch.where(state.is_finished, state.scores.min(dim=1, keepdim=True)[0], _NEVER)  # (P, k)
    return state.open & (best > worst).any(dim=-1, keepdim=True)


def _gather(tensor: Tensor, index: Tensor) -> Tensor:
    """``tensor`` ``(P, n, ...)`` at ``index`` ``(P, m)`` along dimension 1: ``(P, m, ...)``."""
    return torch.take_along_dim(tensor, index.view(*index.shape, *([1] * (tensor.dim() - 2))), dim=1)


def _best(state: _State, repeat: int, length: int) -> Tensor:
    """Each prompt's ``repeat`` best hypotheses ``(P * repeat, L + n)``, cut to the longest of them."""
    longest = int(state.lengths[:, :repeat].max())
    return state.finished[:, :repeat, : length + longest].flatten(0, 1)


@contextlib.contextmanager
def _routed_beams(decoder: TransformerDecoder, prompts: int, k: int) -> Iterator[None]:
    """Inside: each per-sample routing of the decoder's layers (``route_adapters`` with one name per prompt) gives
    its names ``k`` times in a row, one per beam row; restored on exit. Found by its protocol (an object with
    ``names`` and ``route_to``, shared by the adapted layers), since this layer does not import the adapters'."""
    routings = {id(r): r for m in decoder.modules() if (r := m.__dict__.get("routing")) is not None
                and callable(getattr(r, "route_to", None)) and getattr(r, "cu_seqlens", None) is None
                and getattr(r, "names", None) is not None and len(r.names) == prompts}
    before = {key: r.names for key, r in routings.items()}
    for key, routing in routings.items():
        routing.route_to([name for name in before[key] for _ in range(k)])  # (B * k,)
    try:
        yield
    finally:
        for key, routing in routings.items():
            routing.route_to(before[key])
