"""`generate`: greedy and sampled decoding of a `TransformerDecoder`, prefilled once, then one token per step on a
`KVCache`.

Papers: Fan et al. 2018, "Hierarchical Neural Story Generation" (arXiv:1805.04833: top-k sampling); Holtzman et al.
2020, "The Curious Case of Neural Text Degeneration" (arXiv:1904.09751: top-p, nucleus sampling).

Rule. At each step, with ``z`` the float32 logits ``(B, V)`` of each sample's last position:

    greedy (temperature = 0):  next = argmax z
    sampling:                  z = z / temperature
                               top-k: z_i = -inf where z_i < the k-th largest z          (ties kept)
                               top-p: sorted ascending, z_i = -inf where cumsum(softmax(z)) <= 1 - p
                                      (the most likely token always stays)
                               next ~ softmax(z)

which is transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` in that order, then
``torch.multinomial``. Stop tokens: a sample that emits one of ``eos_token_id`` is finished; its later tokens are
``pad_token_id``, and the loop ends when every sample is finished or after ``max_new_tokens``.

Left-padded prompts: ``attention_mask`` ``(B, L)`` is 0 on the padding before each prompt; positions are
``cumsum(mask) - 1`` (each sample's first real token at 0, as transformers counts) and no query ever attends to a
padding key. The batch keeps its ``B`` rows to the end (a finished sample decodes padding), so a per-sample adapter
routing (`lightning_peft.peft.route_adapters` around the call) stays aligned with the rows.

Cost: the prompt runs once through the decoder (prefill), filling a `KVCache` of ``L + max_new_tokens`` positions;
each later step runs one token per sample over the cached keys, and the head runs on the last position only.

Shapes: ``input_ids``, ``attention_mask`` ``(B, L)``; the result ``(B, L + n)``, ``n <= max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_peft._checks import fraction, integer, real
from lightning_peft.nn._decode import last_logits, positions_and_mask
from lightning_peft.nn.beam_search import beam_search, check_beams
from lightning_peft.nn.decoder import TransformerDecoder
from lightning_peft.nn.kv_cache import KVCache

__all__ = ["filter_logits", "generate"]


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """``logits`` ``(..., V)`` with the tokens outside the top-k, then outside the top-p nucleus, set to ``-inf``.

    Equal to transformers' ``TopKLogitsWarper(top_k)`` followed by ``TopPLogitsWarper(top_p)`` (min_tokens_to_keep 1).

    Args:
        logits: Scores ``(..., V)`` (after any temperature).
        top_k: Keep the ``top_k`` highest (and any tied with the k-th); None keeps all.
        top_p: Keep the smallest set of most likely tokens whose probability reaches ``top_p`` in ``(0, 1]``; None
            or 1.0 keeps all.

    Examples:
        >>> filter_logits(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), top_k=2)
        tensor([[-inf, 3., 2., -inf]])
        >>> filter_logits(torch.tensor([[0.0, 5.0, 0.0]]), top_p=0.9)  # 5.0 alone holds 0.987 of the mass
        tensor([[-inf, 5., -inf]])
    """
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]))[0][..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ascending, order = torch.sort(logits, descending=False)
        remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        remove[..., -1:] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


@dataclass(frozen=True)
class _Settings:
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    stops: Tensor | None  # (S,) stop token ids
    pad: int | None
    mask: Tensor | None  # (B, L) bool, None when every token is real


def generate(
    decoder: TransformerDecoder,
    input_ids: Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    attention_mask: Tensor | None = None,
    use_cache: bool = True,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
) -> Tensor:
    """Appends up to ``max_new_tokens`` tokens to each prompt of ``input_ids`` (the rule: module docstring).

    Runs under ``torch.no_grad()`` in the decoder's current mode (call ``decoder.eval()`` first for dropout off).
    The decoder runs through its submodules' calls (``hidden_states``, then ``lm_head`` on the last position), so
    adapters injected into its layers (LoRA, per-sample routing) apply at every step.

    Args:
        decoder: The model.
        input_ids: Prompts ``(B, L)``, at least one token each.
        max_new_tokens: Most tokens to add.
        temperature: 0 for greedy decoding; otherwise sampling from ``softmax(logits / temperature)``.
        generator: Random generator for sampling (reproducible draws); None uses the global one.
        top_k: Sample among the ``top_k`` most likely tokens (sampling only).
        top_p: Sample within the top-p nucleus, ``0 < top_p <= 1`` (sampling only).
        eos_token_id: Stop token id, or several.
        pad_token_id: Token written after a sample's stop token; default: the first stop token.
        attention_mask: ``(B, L)`` 1 for real tokens, 0 for the left padding of shorter prompts.
        use_cache: Decode on a `KVCache` (one token per step); False recomputes the whole sequence every step
            (the same tokens, for checking).
        num_beams: More than 1: beam search with that many beams per prompt (`lightning_peft.nn.beam_search`,
            where the rule is; transformers' ``num_beams`` with ``do_sample=False``); greedy decoding only.
        length_penalty: Beam search: a finished hypothesis scores its summed log-probabilities divided by its new
            tokens ** length_penalty (> 0 favours longer ones).
        early_stopping: Beam search: True stops a prompt once it has ``num_beams`` finished hypotheses; False when
            no running beam can beat them at its current length; ``"never"`` at the longest length.
        num_return_sequences: Beam search: the best hypotheses returned per prompt, ``<= num_beams``.

    Returns:
        ``(B, L + n)`` long: the prompts followed by ``n`` new tokens, ``n = max_new_tokens`` unless every sample
        stopped earlier. With beams, ``(B * num_return_sequences, L + n)``: each prompt's best hypotheses in a row.

    Raises:
        ValueError: If an argument is out of range, ``top_k`` / ``top_p`` come with greedy decoding, a prompt ends
            with padding (pad on the left), or the prompt plus ``max_new_tokens`` exceeds the decoder's
            ``max_position_embeddings`` (the cache does not slide a window over a longer context), or a beam
            argument is out of range or comes with sampling (`check_beams`).
        TypeError: If ``input_ids`` or ``attention_mask`` is not an integer (or bool) tensor.

    Examples:
        >>> decoder = TransformerDecoder(vocab_size=50, hidden_size=16, num_layers=2, num_heads=4).eval()
        >>> prompts = torch.tensor([[0, 3, 4], [7, 8, 9]])
        >>> mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # the first prompt is 2 tokens, left-padded
        >>> out = generate(decoder, prompts, 5, attention_mask=mask)
        >>> out.shape, torch.equal(out, generate(decoder, prompts, 5, attention_mask=mask, use_cache=False))
        (torch.Size([2, 8]), True)
    """
    settings = check_generation("generate", decoder, input_ids, max_new_tokens, temperature, top_k, top_p,
                                eos_token_id, pad_token_id, attention_mask)
    beams = check_beams("generate", settings, num_beams, length_penalty, early_stopping, num_return_sequences)
    if beams is not None:  # num_beams > 1: its own loop (lightning_peft.nn.beam_search)
        return beam_search(decoder, input_ids, settings, beams, use_cache)
    return run_generation(decoder, input_ids, settings, generator, use_cache)


def check_generation(
    who: str, decoder: TransformerDecoder, input_ids: Tensor, max_new_tokens: int, temperature: float,
    top_k: int | None, top_p: float | None, eos_token_id: int | Sequence[int] | None, pad_token_id: int | None,
    attention_mask: Tensor | None,
) -> _Settings:
    """`generate`'s arguments checked (errors name ``who``) and put in the form the loop uses."""
    max_new_tokens = integer(who, "max_new_tokens", max_new_tokens, minimum=0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"{who}(temperature={temperature!r}): temperature must be >= 0 (0 = greedy).")
    real(who, "temperature", temperature)
    if top_k is not None:
        integer(who, "top_k", top_k, minimum=1, example="50")
    if top_p is not None:
        fraction(who, "top_p", top_p, example="0.9")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError(f"{who}(temperature=0, top_k={top_k!r}, top_p={top_p!r}): top_k and top_p filter the "
                         "sampling distribution, and temperature=0 decodes greedily; set temperature > 0 (1.0 samples "
                         "the model's own distribution) or leave top_k and top_p at None.")
    batch, length = _check_ids(who, input_ids)
    if length + max_new_tokens > decoder.max_position_embeddings:
        raise ValueError(f"{who}: the prompts' {length} positions (padding included) plus max_new_tokens="
                         f"{max_new_tokens} exceed the decoder's max_position_embeddings="
                         f"{decoder.max_position_embeddings}; shorten the prompts or lower max_new_tokens (the "
                         "key/value cache does not slide a window over a longer context).")
    stops = _stop_tokens(who, eos_token_id, input_ids.device)
    if pad_token_id is not None:
        pad_token_id = integer(who, "pad_token_id", pad_token_id, minimum=0)
    elif stops is not None:
        pad_token_id = int(stops[0])
    mask = _check_mask(who, attention_mask, batch, length)
    return _Settings(max_new_tokens, float(temperature), top_k, top_p, stops, pad_token_id, mask)


def _check_ids(who: str, input_ids: Tensor) -> tuple[int, int]:
    if not isinstance(input_ids, Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError(f"{who}: input_ids must be an integer tensor (B, L) of token ids, got "
                        f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}.")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"{who}: input_ids must be (batch, length) with at least one token per prompt, got shape "
                         f"{tuple(input_ids.shape)}.")
    return input_ids.shape[0], input_ids.shape[1]


def _stop_tokens(who: str, eos_token_id: int | Sequence[int] | None, device: torch.device) -> Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if not isinstance(eos_token_id, Sequence) else list(eos_token_id)
    if not ids:
        raise ValueError(f"{who}(eos_token_id=[]): give a stop token id, a list of them, or None.")
    for index, token in enumerate(ids):
        integer(who, "eos_token_id" if len(ids) == 1 and not isinstance(eos_token_id, Sequence)
                else f"eos_token_id[{index}]", token, minimum=0)
    return torch.tensor(ids, device=device)


def _check_mask(who: str, attention_mask: Tensor | None, batch: int, length: int) -> Tensor | None:
    """The (B, L) bool mask, or None where every token is real; refuses a prompt that ends with padding."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(f"{who}: attention_mask must be a bool or integer 0/1 tensor (1 = real token), got "
                        f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)}.")
    if tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"{who}: attention_mask must have the shape of input_ids ({batch}, {length}), got "
                         f"{tuple(attention_mask.shape)}.")
    mask = attention_mask.bool()
    ends_padded = (~mask[:, -1]).nonzero().flatten().tolist()
    if ends_padded:
        raise ValueError(f"{who}: prompt {ends_padded[0]} ends with padding (attention_mask 0 in the last column); "
                         "new tokens follow the last column, so pad the prompts on the left (a Hugging Face "
                         "tokenizer: padding_side='left').")
    return None if bool(mask.all()) else mask


@torch.no_grad()
def run_generation(decoder: TransformerDecoder, input_ids: Tensor, settings: _Settings,
                   generator: torch.Generator | None, use_cache: bool) -> Tensor:
    """The decoding loop of `generate` on checked settings (the rule: module docstring).

    The tokens, positions and mask of the whole generation are allocated once, ``(B, L + max_new_tokens)``, and each
    step reads views of them: no per-step concatenation of the growing sequences.
    """
    batch, length = input_ids.shape
    total = length + settings.max_new_tokens
    tokens = input_ids.new_empty(batch, total)
    tokens[:, :length] = input_ids
    positions, mask = positions_and_mask(settings.mask, batch, length, settings.max_new_tokens, input_ids.device)
    cache = KVCache(total) if use_cache and settings.max_new_tokens else None
    unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    end = length  # tokens[:, :end] are filled
    for _ in range(settings.max_new_tokens):
        start = 0 if cache is None or end == length else end - 1  # the cache holds tokens[:, :end - 1]
        logits = last_logits(decoder, tokens[:, start:end], None if mask is None else mask[:, :end],
                             positions[:, start:end], cache)  # (B, V)
        new = _next_tokens(logits, settings, generator)  # (B,)
        if settings.stops is not None:
            new = torch.where(unfinished, new, settings.pad)
            unfinished &= ~torch.isin(new, settings.stops)
        tokens[:, end] = new
        end += 1
        if settings.stops is not None and not bool(unfinished.any()):
            break
    return tokens if end == total else tokens[:, :end].clone()


def _next_tokens(logits: Tensor, settings: _Settings, generator: torch.Generator | None) -> Tensor:
    """``(B,)`` next tokens from the last position's float32 logits ``(B, V)``."""
    if settings.temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / settings.temperature, settings.top_k, settings.top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)
