"""attention / FlashAttention against a float64 softmax(QK^T)V written here, rotary against transformers' Llama."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from lightning_peft.nn.attention import (
    BACKENDS,
    FlashAttention,
    RotaryEmbedding,
    apply_rotary,
    attention,
    attention_received,
    flash_attn_available,
    packed_attention,
    select_backend,
)

B, H, D = 2, 4, 8


# ------------------------------------------------------------------------------------------------ references


def allowed_keys(batch: int, q_len: int, k_len: int, causal: bool, mask: Tensor | None) -> Tensor:
    """(B, 1, Lq, Lk) bool: query i sees key j (bottom-right causal: j <= i + Lk - Lq)."""
    allowed = torch.ones(batch, 1, q_len, k_len, dtype=torch.bool)
    if mask is not None:
        allowed &= mask.bool()[:, None, None, :]
    if causal:
        i = torch.arange(q_len)[:, None]
        j = torch.arange(k_len)[None, :]
        allowed &= j <= i + k_len - q_len
    return allowed


def reference_probs(q, k, causal=False, mask=None, scale=None) -> Tensor:
    """Full float64 attention probabilities (B, H, Lq, Lk); rows with no visible key are 0."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # query head h reads key head h // group
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    allowed = allowed_keys(q.shape[0], q.shape[2], k.shape[2], causal, mask)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.where(allowed.any(-1, keepdim=True), probs, torch.zeros_like(probs))


def reference_attention(q, k, v, causal=False, mask=None, scale=None) -> Tensor:
    v = v.double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return reference_probs(q, k, causal, mask, scale) @ v


def reference_rotary(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotate the pairs (x[d], x[d + D/2]) by positions * base^(-2d/D): the rotate_half convention, in float64."""
    dim = x.shape[-1]
    freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (D/2,)
    angle = positions.double()[:, None, :, None] * freq  # (B, 1, L, D/2)
    first, second = x[..., : dim // 2], x[..., dim // 2:]
    return torch.cat((first * angle.cos() - second * angle.sin(), second * angle.cos() + first * angle.sin()), -1)


def reference_module(module: FlashAttention, x: Tensor, mask=None, positions=None) -> Tensor:
    """The module's computation written out in float64 from its own weights."""
    b, length, _ = x.shape

    def heads(linear, count):
        return linear(x).view(b, length, count, module.head_dim).transpose(1, 2)  # (B, h, L, D)

    q, k, v = heads(module.q_proj, module.num_heads), heads(module.k_proj, module.num_kv_heads), heads(
        module.v_proj, module.num_kv_heads)
    if module.rotary is not None:
        positions = torch.arange(length).expand(b, length) if positions is None else positions
        q, k = reference_rotary(q, positions, module.rotary.base), reference_rotary(k, positions, module.rotary.base)
    out = reference_attention(q, k, v, module.causal, mask)
    return module.o_proj(out.transpose(1, 2).reshape(b, length, -1))


def padding_mask(lengths: list[int], total: int) -> Tensor:
    return torch.arange(total)[None, :] < torch.tensor(lengths)[:, None]  # (B, L) bool, right padding


def qkv(q_len: int, k_len: int, kv_heads: int = H, dtype=torch.float64):
    shapes = ((B, H, q_len, D), (B, kv_heads, k_len, D), (B, kv_heads, k_len, D))
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


def grads(out: Tensor, tensors: list[Tensor], seed: int = 1) -> list[Tensor]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return list(torch.autograd.grad((out * weight).sum(), tensors))


# ------------------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_attention_matches_float64_reference(kv_heads, causal, padded):
    q, k, v = qkv(6, 6, kv_heads)
    mask = padding_mask([6, 4], 6) if padded else None
    out = attention(q, k, v, causal=causal, key_padding_mask=mask)
    expected = reference_attention(q, k, v, causal, mask)
    torch.testing.assert_close(out, expected)
    for mine, theirs in zip(grads(out, [q, k, v]), grads(expected, [q, k, v]), strict=True):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("q_len,k_len", [(3, 7), (1, 5), (7, 4)])
@pytest.mark.parametrize("padded", [False, True])
def test_causal_with_unequal_lengths_is_bottom_right_aligned(q_len, k_len, padded):
    q, k, v = qkv(q_len, k_len, kv_heads=2)
    mask = padding_mask([k_len, k_len - 1], k_len) if padded else None
    out = attention(q, k, v, causal=True, key_padding_mask=mask)
    expected = reference_attention(q, k, v, True, mask)
    torch.testing.assert_close(out, expected)
    for mine, theirs in zip(grads(out, [q, k, v]), grads(expected, [q, k, v]), strict=True):
        torch.testing.assert_close(mine, theirs)
    if q_len <= k_len:  # the last query sees every (real) key
        full = reference_attention(q[:, :, -1:], k, v, False, mask)
        torch.testing.assert_close(out[:, :, -1:], full)


def test_causal_with_padding_on_kernels_that_refuse_mask_and_is_causal_together():
    # SDPA's math kernel refuses attn_mask with is_causal=True; attention then combines the two into one mask.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv(5, 5, kv_heads=2)
    mask = padding_mask([5, 3], 5)
    with sdpa_kernel([SDPBackend.MATH]):
        out = attention(q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, reference_attention(q, k, v, True, mask))


def test_float32_inputs_and_a_custom_scale():
    q, k, v = (t.detach().float() for t in qkv(5, 5, kv_heads=2))
    mask = padding_mask([5, 3], 5)
    out = attention(q, k, v, causal=True, key_padding_mask=mask, scale=0.3)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, True, mask, scale=0.3), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_give_zeros_and_finite_gradients(causal):
    q, k, v = qkv(4, 4, kv_heads=2)
    mask = padding_mask([4, 0], 4)  # the second sequence is all padding
    out = attention(q, k, v, causal=causal, key_padding_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    gq, gk, gv = grads(out, [q, k, v])
    assert all(torch.isfinite(g).all() for g in (gq, gk, gv))
    assert torch.equal(gq[1], torch.zeros_like(gq[1]))


def test_queries_before_every_key_give_zeros_under_bottom_right_causal():
    q, k, v = qkv(6, 3)  # Lq > Lk: queries 0..2 see no key
    out = attention(q, k, v, causal=True)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert all(torch.isfinite(g).all() for g in grads(out, [q, k, v]))
    torch.testing.assert_close(out, reference_attention(q, k, v, True))


def test_integer_mask_equals_bool_mask_and_all_true_mask_equals_none():
    q, k, v = qkv(5, 5)
    mask = padding_mask([5, 2], 5)
    out = attention(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(attention(q, k, v, key_padding_mask=mask.long()), out, rtol=0, atol=0)
    torch.testing.assert_close(attention(q, k, v, key_padding_mask=mask.to(torch.int32)), out, rtol=0, atol=0)
    ones = torch.ones(B, 5, dtype=torch.bool)
    torch.testing.assert_close(attention(q, k, v, causal=True, key_padding_mask=ones), attention(q, k, v, causal=True))


def test_attention_dropout_drops_only_when_asked():
    q, k, v = (t.detach() for t in qkv(6, 6))
    plain = attention(q, k, v)
    torch.testing.assert_close(attention(q, k, v, dropout_p=0.0), plain, rtol=0, atol=0)
    torch.manual_seed(3)
    dropped = attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(attention(q, k, v, dropout_p=0.5), dropped)  # reproducible under a seed
    assert not torch.allclose(dropped, plain)


def test_attention_rejects_bad_input():
    q, k, v = (t.detach() for t in qkv(4, 4))
    with pytest.raises(ValueError, match="must be 4-D"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="key/value heads must divide"):
        attention(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="same shape"):
        attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, kv_len\) = \(2, 4\)"):
        attention(q, k, v, key_padding_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool .* or integer 0/1, got torch.float32"):
        attention(q, k, v, key_padding_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"attention\(dropout_p=1.0\): dropout_p must be a number in \[0, 1\)"):
        attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match=r"attention\(backend='xformers'\): backend must be one of 'auto', 'flash_attn', 'sdpa'"):
        attention(q, k, v, backend="xformers")


# ------------------------------------------------------------------------------------------------ dispatch


def test_auto_picks_sdpa_on_cpu_for_every_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        assert select_backend(torch.zeros(1, 2, 3, 8, dtype=dtype)) == "sdpa"
    assert select_backend(torch.zeros(1, 2, 3, 8), "sdpa") == "sdpa"
    assert BACKENDS == ("auto", "flash_attn", "sdpa", "math")


def test_forcing_flash_attn_where_it_cannot_run_names_every_reason():
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="cannot run here") as error:
        select_backend(q, "flash_attn")
    message = str(error.value)
    assert "q is on cpu, flash-attn needs a CUDA device" in message
    assert "q is torch.float32, flash-attn needs torch.float16 or torch.bfloat16" in message
    assert ("flash_attn package is not installed" in message) == (not flash_attn_available())
    assert "Use backend='auto'" in message
    with pytest.raises(RuntimeError, match="on cpu") as error:
        attention(q.half(), q.half(), q.half(), backend="flash_attn")
    assert "float16 or torch.bfloat16" not in str(error.value)  # fp16 is fine; only the device is not
    with pytest.raises(RuntimeError, match="head_dim is 512, flash-attn supports at most 256"):
        select_backend(torch.zeros(1, 1, 2, 512, dtype=torch.float16), "flash_attn")
    with pytest.raises(RuntimeError, match="causal attention with a key_padding_mask needs as many queries"):
        select_backend(q, "flash_attn", key_padding_mask=torch.ones(1, 5, dtype=torch.bool), causal=True)


@pytest.mark.skipif(flash_attn_available(), reason="flash_attn is installed here")
def test_forcing_flash_attn_without_the_package_says_so():
    with pytest.raises(RuntimeError, match=r"flash_attn package is not installed \(pip install flash-attn"):
        select_backend(torch.zeros(1, 2, 3, 8, dtype=torch.float16), "flash_attn")


def test_select_backend_rejects_unknown_backend_and_dropout():
    with pytest.raises(ValueError, match=r"attention\(backend='flash'\): backend must be one of"):
        select_backend(torch.zeros(1, 1, 1, 2), "flash")
    with pytest.raises(ValueError, match=r"attention\(dropout_p=-0.1\): dropout_p must be a number in \[0, 1\)"):
        select_backend(torch.zeros(1, 1, 1, 2), dropout_p=-0.1)


# ------------------------------------------------------------------------------------------------ importance


def reference_received(q, k, mask=None, causal=False, queries="all") -> Tensor:
    probs = reference_probs(q, k, causal, mask)  # (B, H, Lq, Lk)
    if queries == "first":
        return probs[:, :, 0].mean(1)
    real = torch.ones(q.shape[0], q.shape[2], dtype=torch.float64)
    if mask is not None and q.shape[2] == k.shape[2]:
        real = mask.double()
    summed = (probs * real[:, None, :, None]).sum(dim=(1, 2))  # (B, Lk)
    return summed / (q.shape[1] * real.sum(-1, keepdim=True).clamp(min=1))


@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("queries", ["all", "first"])
def test_attention_received_matches_full_matrix(kv_heads, causal, padded, queries):
    q, k, _ = (t.detach() for t in qkv(7, 7, kv_heads))
    mask = padding_mask([7, 5], 7) if padded else None
    received = attention_received(q, k, mask, causal=causal, chunk_size=3, queries=queries)
    assert received.dtype == torch.float32 and received.shape == (B, 7)
    torch.testing.assert_close(received.double(), reference_received(q, k, mask, causal, queries))
    if padded:
        assert torch.equal(received[1, 5:], torch.zeros(2))  # padding receives nothing
    if queries == "all":  # every real query distributes one unit of attention per head
        torch.testing.assert_close(received.sum(-1), torch.ones(B))


def test_attention_received_chunks_agree_and_unequal_lengths_count_every_query():
    q, k, _ = (t.detach() for t in qkv(5, 9, kv_heads=2))
    mask = padding_mask([9, 6], 9)
    whole = attention_received(q, k, mask, causal=True, chunk_size=64)
    torch.testing.assert_close(attention_received(q, k, mask, causal=True, chunk_size=1), whole)
    torch.testing.assert_close(whole.double(), reference_received(q, k, mask, True))
    half = attention_received(q.half(), k.half())
    assert half.dtype == torch.float32
    torch.testing.assert_close(half.double(), reference_received(q.half(), k.half()), atol=2e-3, rtol=2e-3)


def test_attention_received_rejects_bad_options():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"queries='cls'\): queries must be one of 'all', 'first'"):
        attention_received(q, q, queries="cls")
    with pytest.raises(ValueError, match=r"chunk_size=0\): chunk_size must be an integer >= 1"):
        attention_received(q, q, chunk_size=0)


# ------------------------------------------------------------------------------------------------ rotary


@pytest.mark.parametrize("head_dim,base", [(8, 10000.0), (6, 500.0)])
def test_rotary_matches_transformers_llama(head_dim, base):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=base)
    theirs = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(head_dim, base)
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, rtol=0, atol=0)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 3, 0, 11, 2]])
    q, k = torch.randn(2, 4, 5, head_dim), torch.randn(2, 2, 5, head_dim)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = ours(positions, dtype)
        their_cos, their_sin = theirs(q.to(dtype), positions)  # (B, L, D)
        assert cos.shape == (2, 1, 5, head_dim) and cos.dtype == dtype
        torch.testing.assert_close(cos[:, 0], their_cos, rtol=0, atol=0)
        torch.testing.assert_close(sin[:, 0], their_sin, rtol=0, atol=0)
    cos, sin = ours(positions, torch.float32)
    their_q, their_k = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])
    torch.testing.assert_close(apply_rotary(q, cos, sin), their_q, rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), their_k, rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(q.double(), *ours(positions, torch.float64)),
                               reference_rotary(q.double(), positions, base))


def test_rotary_buffer_is_not_saved_and_odd_sizes_are_refused():
    assert RotaryEmbedding(4).state_dict() == {}
    with pytest.raises(ValueError, match=r"RotaryEmbedding\(head_dim=5\): head_dim must be even"):
        RotaryEmbedding(5)
    with pytest.raises(ValueError, match=r"position_ids must be \(batch, length\)"):
        RotaryEmbedding(4)(torch.arange(3))


# ------------------------------------------------------------------------------------------------ module


def build(hidden=16, heads=4, **kwargs) -> FlashAttention:
    torch.manual_seed(0)
    module = FlashAttention(hidden, heads, **kwargs).double()
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.3)  # biases too: non-zero everywhere
    return module


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("rotary", [False, True])
def test_module_outputs_and_gradients_match_reference(kv_heads, causal, padded, rotary):
    module = build(num_kv_heads=kv_heads, causal=causal, rotary=rotary)
    x = torch.randn(B, 6, 16, dtype=torch.float64, requires_grad=True)
    mask = padding_mask([6, 3], 6) if padded else None
    out = module(x, key_padding_mask=mask)
    expected = reference_module(module, x, mask)
    # The rotary tables are float32 (as Llama's; the rotary test matches transformers exactly), the reference float64.
    tolerance = {"atol": 2e-6, "rtol": 2e-6} if rotary else {}
    torch.testing.assert_close(out, expected, **tolerance)
    params = [x, *module.parameters()]
    assert len(params) == 9  # x, four weights, four biases
    for mine, theirs in zip(grads(out, params), grads(expected, params), strict=True):
        torch.testing.assert_close(mine, theirs, **tolerance)
    assert module.last_backend == "sdpa"


def test_module_shapes_names_and_attributes():
    module = FlashAttention(32, 4, num_kv_heads=2, head_dim=6, rotary=True, bias=False, rope_theta=500.0)
    assert (module.hidden_size, module.num_heads, module.num_kv_heads, module.head_dim) == (32, 4, 2, 6)
    assert module.q_proj.weight.shape == (24, 32) and module.k_proj.weight.shape == (12, 32)
    assert module.v_proj.weight.shape == (12, 32) and module.o_proj.weight.shape == (32, 24)
    assert module.q_proj.bias is None and module.rotary.base == 500.0
    assert module.last_backend is None and module.backend == "auto"
    assert set(module.state_dict()) == {f"{p}_proj.weight" for p in "qkvo"}
    assert FlashAttention(8, 2).rotary is None
    x = torch.randn(2, 3, 32)
    assert module(x).shape == (2, 3, 32)


def test_module_custom_positions_match_reference():
    module = build(num_kv_heads=2, rotary=True, causal=True, rope_theta=100.0)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 0, 1, 2, 3]])
    torch.testing.assert_close(module(x, position_ids=positions), reference_module(module, x, None, positions),
                               atol=2e-6, rtol=2e-6)  # float32 rotary tables


def test_module_accepts_hugging_face_integer_masks():
    module = build()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = padding_mask([5, 2], 5)
    torch.testing.assert_close(module(x, key_padding_mask=mask.long()), module(x, key_padding_mask=mask))


def test_module_dropout_only_in_training():
    module = build(dropout=0.5)
    plain = build(dropout=0.0)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    module.eval()
    torch.testing.assert_close(module(x), plain(x), rtol=0, atol=0)
    module.train()
    assert not torch.allclose(module(x), plain(x))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary", [False, True])
def test_packed_sequences_equal_each_sequence_alone(causal, rotary):
    module = build(num_kv_heads=2, causal=causal, rotary=rotary)
    lengths = [3, 1, 4]
    x = torch.randn(1, sum(lengths), 16, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    out = module(x, cu_seqlens=cu)
    alone = torch.cat([module(piece) for piece in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(out, alone)
    params = [x, *module.parameters()]
    for mine, theirs in zip(grads(out, params), grads(alone, params), strict=True):
        torch.testing.assert_close(mine, theirs)
    assert module.last_backend == "sdpa"
    _, importance = module(x, cu_seqlens=cu, need_importance=True)
    expected = torch.cat([module(piece, need_importance=True)[1] for piece in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(importance, expected)


def test_packed_attention_with_an_empty_sequence():
    q, k, v = (t.detach() for t in qkv(5, 5, kv_heads=2))
    q, k, v = q[:1], k[:1], v[:1]
    cu = torch.tensor([0, 2, 2, 5])
    out = packed_attention(q, k, v, cu, causal=True)
    torch.testing.assert_close(out[:, :, 2:], reference_attention(q[:, :, 2:], k[:, :, 2:], v[:, :, 2:], True))


@pytest.mark.parametrize("how", [True, "mean", "cls"])
def test_need_importance_returns_attention_received(how):
    module = build(num_kv_heads=2, rotary=True)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = padding_mask([6, 4], 6)
    out, importance = module(x, key_padding_mask=mask, need_importance=how)
    torch.testing.assert_close(out, module(x, key_padding_mask=mask))
    assert importance.shape == (2, 6) and importance.dtype == torch.float32 and not importance.requires_grad
    b, length, _ = x.shape
    q = module.q_proj(x).view(b, length, 4, 4).transpose(1, 2)
    k = module.k_proj(x).view(b, length, 2, 4).transpose(1, 2)
    positions = torch.arange(length).expand(b, length)
    q, k = reference_rotary(q, positions, 10000.0), reference_rotary(k, positions, 10000.0)
    queries = "first" if how == "cls" else "all"
    torch.testing.assert_close(importance.double(), reference_received(q, k, mask, queries=queries), atol=2e-6,
                               rtol=2e-6)  # float32 rotary tables


def test_module_rejects_bad_configuration():
    with pytest.raises(ValueError, match=r"FlashAttention\(hidden_size=10, num_heads=3\): num_heads must divide"):
        FlashAttention(10, 3)
    assert FlashAttention(10, 3, head_dim=4).q_proj.weight.shape == (12, 10)  # an explicit head_dim is fine
    with pytest.raises(ValueError, match=r"num_heads=4, num_kv_heads=3\): num_kv_heads must divide num_heads"):
        FlashAttention(16, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"FlashAttention\(backend='triton'\): backend must be one of"):
        FlashAttention(16, 4, backend="triton")
    with pytest.raises(ValueError, match=r"FlashAttention\(dropout=1.5\): dropout must be a number in \[0, 1\)"):
        FlashAttention(16, 4, dropout=1.5)
    with pytest.raises(ValueError, match=r"FlashAttention\(num_heads=0\): num_heads must be an integer >= 1"):
        FlashAttention(16, 0)
    with pytest.raises(ValueError, match=r"RotaryEmbedding\(head_dim=3\)"):
        FlashAttention(12, 4, rotary=True)


def test_module_rejects_bad_input():
    module = FlashAttention(16, 4)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"x must be \(batch, length, 16\), got \(2, 5, 8\)"):
        module(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, kv_len\) = \(2, 5\), got \(2, 4"):
        module(x, key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be bool .* got torch.float32.*float_mask == 0"):
        module(x, key_padding_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"position_ids must have shape \(2, 5\)"):
        module(x, position_ids=torch.arange(5))
    with pytest.raises(ValueError, match="cu_seqlens packs sequences into a batch of one .* got batch 2"):
        module(x, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="and a key_padding_mask"):
        module(x[:1], key_padding_mask=torch.ones(1, 5, dtype=torch.bool), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to the sequence length 5, got \[0, 2, 4\]"):
        module(x[:1], cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"got \[0, 3, 2, 5\]"):
        module(x[:1], cu_seqlens=torch.tensor([0, 3, 2, 5], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D integer tensor"):
        module(x[:1], cu_seqlens=torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match=r"need_importance='max'\): choose False, True, 'mean' or 'cls'"):
        module(x, need_importance="max")


# ------------------------------------------------------------------------------------------------ flash-attn (GPU)

needs_flash = pytest.mark.skipif(not (torch.cuda.is_available() and flash_attn_available()),
                                 reason="needs CUDA and the flash_attn package")


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_flash_attn_matches_sdpa_on_cuda(kv_heads, causal, padded):
    shapes = ((B, H, 64, 64), (B, kv_heads, 64, 64), (B, kv_heads, 64, 64))
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.float16, requires_grad=True) for s in shapes)
    mask = padding_mask([64, 40], 64).cuda() if padded else None
    assert select_backend(q, key_padding_mask=mask, causal=causal) == "flash_attn"
    out = attention(q, k, v, causal=causal, key_padding_mask=mask, backend="flash_attn")
    cpu = [t.detach().cpu() for t in (q, k, v)]
    expected = reference_attention(*cpu, causal, mask.cpu() if padded else None).cuda()
    rows = slice(None) if not (causal and padded) else slice(0, 40)  # flash-attn zeroes padding queries there
    torch.testing.assert_close(out[1, :, rows].double(), expected[1, :, rows], atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(out[0].double(), expected[0], atol=5e-3, rtol=5e-3)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.gpu
@needs_flash
def test_flash_attn_module_packed_and_last_backend_on_cuda():
    module = FlashAttention(128, 2, num_kv_heads=1, causal=True, rotary=True).cuda().half()
    x = torch.randn(1, 48, 128, device="cuda", dtype=torch.float16)
    cu = torch.tensor([0, 16, 48], dtype=torch.int32, device="cuda")
    out = module(x, cu_seqlens=cu)
    assert module.last_backend == "flash_attn"
    alone = torch.cat([module(x[:, :16]), module(x[:, 16:])], dim=1)
    torch.testing.assert_close(out, alone, atol=5e-3, rtol=5e-3)
    sdpa = FlashAttention(128, 2, num_kv_heads=1, causal=True, rotary=True, backend="sdpa").cuda().half()
    sdpa.load_state_dict(module.state_dict())
    torch.testing.assert_close(sdpa(x, cu_seqlens=cu), out, atol=5e-3, rtol=5e-3)
    assert sdpa.last_backend == "sdpa"


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("window, softcap", [(16, None), (None, 2.0), (16, 2.0)])
def test_flash_attn_window_and_softcap_match_the_math_path_on_cuda(window, softcap):
    """Mistral's sliding window and Gemma 2's soft-capping on flash-attn's own arguments, against the explicit
    math path on the same CUDA tensors (float32 there), packed too."""
    shapes = ((1, H, 64, 64), (1, 1, 64, 64), (1, 1, 64, 64))
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes)
    out = attention(q, k, v, causal=True, backend="flash_attn", window=window, softcap=softcap)
    want = attention(q.float(), k.float(), v.float(), causal=True, backend="math", window=window, softcap=softcap)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    cu = torch.tensor([0, 24, 64], dtype=torch.int32, device="cuda")
    packed = packed_attention(q, k, v, cu, causal=True, backend="flash_attn", window=window, softcap=softcap)
    alone = torch.cat([attention(q[:, :, a:b].float(), k[:, :, a:b].float(), v[:, :, a:b].float(), causal=True,
                                 backend="math", window=window, softcap=softcap) for a, b in ((0, 24), (24, 64))], 2)
    torch.testing.assert_close(packed.float(), alone, atol=2e-2, rtol=2e-2)
