"""`TransformerDecoder` on packed batches (``cu_seqlens``): logits and gradients equal each sequence run alone, with
LoRA, reversible layers, and either SDPA path of packed attention (padded groups or one call per sequence); the
refusals. The flash-attn varlen path runs in the gpu-marked test at the end (skipped without CUDA and flash-attn)."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_peft.nn import (
    TransformerDecoder,
    apply_activation_checkpointing,
    flash_attn_available,
    packed_attention,
)
from lightning_peft.nn.attention_functional import attention
from lightning_peft.nn.packed_sdpa import FREE_LENGTH, MAX_PADDING, _plan, length_groups
from lightning_peft.parallel.pipeline import pipeline_pieces
from lightning_peft.peft import inject_lora
from tests._models import randomise

VOCAB = 40
TOL = {"rtol": 0, "atol": 1e-10}
MANY_SHORT = [5, 1, 8, 3, 7, 2, 6, 4, 8, 1, 5, 3]  # 12 rows of at most 8 tokens: one padded call
FEW_LONG = [80, 50, 34]  # lengths too far apart to pad together: one call per row


def _decoder(**kwargs) -> TransformerDecoder:
    torch.manual_seed(0)
    options = {"vocab_size": VOCAB, "hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
               "ffn_size": 32, **kwargs}
    return TransformerDecoder(**options).double()


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _grads(output: torch.Tensor, weights: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((output * weights).sum(), params)


def _check_against_rows(decoder: TransformerDecoder, lengths: list[int]) -> None:
    """Packed logits and the gradients of every trainable parameter equal the rows run alone (float64)."""
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    packed = decoder(ids, cu_seqlens=_cu(lengths))
    alone = torch.cat([decoder(row) for row in ids.split(lengths, dim=1)], dim=1)  # (1, T, V)
    torch.testing.assert_close(packed, alone, **TOL)
    weights = torch.randn(alone.shape, dtype=torch.float64)
    params = [p for p in decoder.parameters() if p.requires_grad]
    for mine, theirs in zip(_grads(packed, weights, params), _grads(alone, weights, params), strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)


@pytest.mark.parametrize("lengths", [MANY_SHORT, FEW_LONG], ids=["many-short", "few-long"])
def test_packed_logits_and_gradients_equal_each_row_alone(lengths):
    calls, _ = _plan(tuple(_cu(lengths).tolist()), "auto", torch.device("cpu"))
    assert len(calls) == (1 if lengths is MANY_SHORT else 3)  # both ways of the choice are exercised
    _check_against_rows(_decoder(), lengths)


def test_packed_rows_with_lora_equal_each_row_alone():
    decoder = _decoder()
    randomise(inject_lora(decoder, rank=2, target_modules=["q_proj", "v_proj", "down_proj"]))
    _check_against_rows(decoder, [9, 4, 40, 1])


def test_reversible_packed_rows_equal_each_row_alone():
    _check_against_rows(_decoder(reversible=True), [6, 11, 3])


def test_checkpointed_moe_layers_pass_the_boundaries_on():
    decoder = _decoder(moe={"num_experts": 4, "top_k": 2, "dropless": True})  # capacity drops depend on the batch
    assert apply_activation_checkpointing(decoder)  # the blocks recompute in backward with cu_seqlens
    _check_against_rows(decoder.train(), [6, 11, 3])


def test_given_position_ids_and_hidden_states_take_the_packed_path_too():
    decoder, lengths = _decoder(), [4, 7]
    ids = torch.randint(0, VOCAB, (1, 11))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    hidden = decoder.hidden_states(ids, position_ids=positions, cu_seqlens=_cu(lengths))
    alone = torch.cat([decoder.hidden_states(row) for row in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(hidden, alone, **TOL)


# ------------------------------------------------------------------------------------------------ packed SDPA


def _reference(q, k, v, lengths, causal):
    pieces = [attention(*(t[:, :, a:a + n] for t in (q, k, v)), causal=causal)
              for a, n in zip(itertools.accumulate([0, *lengths]), lengths) if n]
    return torch.cat(pieces, dim=2)


@pytest.mark.parametrize("method", ["auto", "loop", "padded"])
@pytest.mark.parametrize("causal", [True, False])
def test_every_sdpa_method_equals_each_sequence_alone(method, causal):
    lengths = [7, 0, 40, 3, 33, 1, 29, 12]  # an empty sequence, rows on both sides of FREE_LENGTH
    q, k, v = (torch.randn(1, h, sum(lengths), 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = packed_attention(q, k, v, _cu(lengths), causal=causal, sdpa_method=method)
    expected = _reference(q, k, v, lengths, causal)
    torch.testing.assert_close(out, expected, **TOL)
    weights = torch.randn(out.shape, dtype=torch.float64)
    for mine, theirs in zip(_grads(out, weights, [q, k, v]), _grads(expected, weights, [q, k, v]), strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)


def test_length_groups_cover_every_row_once_within_the_padding_bound():
    lengths = [int(n) for n in torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(0))]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == [i for i, n in enumerate(lengths) if n > 0]
    for group in groups:
        longest = lengths[group[0]]
        assert longest == max(lengths[i] for i in group)
        assert longest <= FREE_LENGTH or all(longest**2 <= MAX_PADDING * lengths[i]**2 for i in group)
    assert len(groups) < 20  # 200 rows in a handful of calls
    assert length_groups(lengths, "loop") == [[i] for i in sorted((i for i, n in enumerate(lengths) if n),
                                                                  key=lambda i: -lengths[i])]
    assert length_groups(lengths, "padded") == [[i for g in length_groups(lengths, "loop") for i in g]]
    assert length_groups([0, 0], "padded") == []


# ------------------------------------------------------------------------------------------------ refusals


def test_the_longest_packed_sequence_not_the_row_must_fit_the_positions():
    decoder, lengths = _decoder(max_position_embeddings=8), [8, 5, 8]
    _check_against_rows(decoder, lengths)  # 21 tokens in the row, at most 8 in a sequence
    with pytest.raises(ValueError, match=r"^TransformerDecoder: a packed sequence of 9 tokens exceeds "
                                         r"max_position_embeddings=8"):
        decoder(torch.randint(0, VOCAB, (1, 12)), cu_seqlens=_cu([3, 9]))


def test_refusals_name_what_was_given():
    decoder, ids = _decoder(), torch.randint(0, VOCAB, (1, 6))
    cu = _cu([2, 4])
    with pytest.raises(ValueError, match=r"^TransformerDecoder: cu_seqlens packs .* got an attention_mask of shape "
                                         r"\(1, 6\)\. Give a packed batch"):
        decoder(ids, attention_mask=torch.ones(1, 6), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"got input_ids of shape \(2, 6\)"):
        decoder(ids.expand(2, 6), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"^TransformerDecoder: cu_seqlens must rise from 0 to the sequence length 6, "
                                         r"got \[0, 2, 5\]"):
        decoder(ids, cu_seqlens=_cu([2, 3]))
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match=r"^packed_attention\(sdpa_method='mask'\): sdpa_method must be one of "
                                         r"'auto', 'loop', 'padded'"):
        packed_attention(q, q, q, cu, sdpa_method="mask")


def test_pipeline_refuses_packed_batches():
    with pytest.raises(ValueError, match=r"^PipelineStrategy: the batch is packed \(cu_seqlens\)"):
        pipeline_pieces(_decoder(), ["input_ids", "cu_seqlens"])


# ------------------------------------------------------------------------------------------------ flash-attn (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and flash_attn_available()),
                    reason="needs CUDA and the flash_attn package")
def test_packed_decoder_runs_flash_attn_varlen_on_cuda():
    lengths = [37, 5, 90, 18]
    decoder = _decoder(hidden_size=128, num_heads=2, num_kv_heads=1, ffn_size=256).cuda().to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), device="cuda")
    packed = decoder(ids, cu_seqlens=_cu(lengths).cuda())
    assert {layer.attn.last_backend for layer in decoder.layers} == {"flash_attn"}
    alone = torch.cat([decoder(row) for row in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed.float(), alone.float(), atol=3e-2, rtol=3e-2)
