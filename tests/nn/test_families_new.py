"""`TransformerDecoder.from_pretrained` on Qwen3, Gemma 2 and Gemma 3 (text) against transformers' own models, and
the options that carry them (``qk_norm``, ``attention_scale``, soft-capping, ``sandwich_norm``,
``sliding_rope_theta``) and the ``"math"`` attention backend that soft-caps.

As in ``test_families.py``: tiny random transformers models saved with ``save_pretrained``, logits on every real
token equal in float64 to 1e-10 (float32: 1e-5).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_peft.nn import FlashAttention, TransformerBlock, TransformerDecoder
from lightning_peft.nn.attention import attention, packed_attention, select_backend
from tests.nn.test_families import VOCAB, _batch, _check_logits, _save, _theirs, _write_config

GEMMA2 = {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 2.0,
          "final_logit_softcapping": 3.0}  # caps small enough to bend these random logits, a scale not 1/sqrt(16)
GEMMA3 = {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 12, "sliding_window_pattern": 2,
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}}


def _logits(decoder: TransformerDecoder, length: int = 20) -> torch.Tensor:
    ids, _ = _batch(length, False)
    with torch.no_grad():
        return decoder(ids)


def _rewrite_config(directory: Path, drop: tuple[str, ...], **add) -> None:
    """config.json as the official releases wrote it before transformers 5 (their keys, no layer_types)."""
    path = directory / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    path.write_text(json.dumps({**config, **add}))


# ---- Qwen3 -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 6], ids=["full", "sliding"])
def test_qwen3_equals_transformers(tmp_path, window):
    # head_dim 16 with hidden 32 and 4 heads (not 32 / 4): from the config, as Qwen3's 128
    directory = _save(tmp_path, "qwen3", head_dim=16, use_sliding_window=window is not None, sliding_window=window,
                      max_window_layers=1)
    ours = _check_logits(directory, 20)
    attn = ours.layers[0].attn
    assert attn.q_proj.weight.shape == (4 * 16, 32) and attn.q_proj.bias is None and attn.o_proj.bias is None
    theirs = _theirs(directory, torch.float64)
    torch.testing.assert_close(attn.k_norm.weight, theirs.model.layers[0].self_attn.k_norm.weight, rtol=0, atol=0)
    assert [layer.attn.sliding_window for layer in ours.layers] == [None, window]
    # the q/k norms matter on these inputs: without them the logits differ
    plain = TransformerDecoder(**{**ours.config, "qk_norm": False}).double().eval()
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if "_norm." not in k or "attn." not in k},
                          strict=False)
    assert not torch.allclose(_logits(plain), _logits(ours))


def test_qwen3_config_without_layer_types_slides_from_max_window_layers(tmp_path):
    """Qwen2/2.5/3 configs written before transformers 5: use_sliding_window and max_window_layers, no layer_types."""
    directory = _save(tmp_path, "qwen3", head_dim=8, num_hidden_layers=3, use_sliding_window=True, sliding_window=6,
                      max_window_layers=1)
    _rewrite_config(directory, drop=("layer_types",))
    ours = _check_logits(directory, 20)
    assert [layer.attn.sliding_window for layer in ours.layers] == [None, 6, 6]


def test_qwen3_attention_bias_on_all_four_projections(tmp_path):
    ours = _check_logits(_save(tmp_path, "qwen3", head_dim=8, attention_bias=True), 12)
    assert all(getattr(ours.layers[1].attn, f"{n}_proj").bias is not None for n in "qkvo")


def test_lora_reaches_a_loaded_qwen3(tmp_path):
    from lightning_peft.peft import inject_lora

    decoder = TransformerDecoder.from_pretrained(str(_save(tmp_path, "qwen3", head_dim=8))).double().eval()
    ids, mask = _batch(12, True)
    with torch.no_grad():
        base = decoder(ids, mask)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    injected = inject_lora(decoder, rank=2, target_modules=targets)
    assert len(injected) == 2 * len(targets)  # every projection of both layers, and not the q/k norms
    out = decoder(ids, mask)
    torch.testing.assert_close(out, base, rtol=0, atol=0)  # B starts at zero: the base model exactly
    out[mask.bool()].sum().backward()
    trained = {n for n, p in decoder.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)
    assert any(".attn.k_proj.lora_A" in n for n in trained)  # k's gradient flows back through k_norm


# ---- Gemma 2 -----------------------------------------------------------------------------------------------------

def test_gemma2_equals_transformers(tmp_path):
    # float64 without left padding: transformers' eager Gemma 2 softmaxes in float32, where its float64 mask value
    # becomes -inf, so a left-padded row that sees no key is NaN and reaches the real tokens through the values
    # (ours gives that row zeros); float32 below covers left padding.
    directory = _save(tmp_path, "gemma2", **GEMMA2)
    ours = _check_logits(directory, 20, left=False)
    attn = ours.layers[0].attn
    assert (attn.scale, attn.softcap, ours.final_logit_softcapping) == (12 ** -0.5, 2.0, 3.0)
    assert attn.last_backend == "math"  # SDPA cannot soft-cap
    assert [layer.attn.sliding_window for layer in ours.layers] == [6, None]  # even layers slide
    assert ours.layers[1].attn_post_norm is not None and ours.layers[1].mlp_post_norm is not None
    # each Gemma 2 option matters on these inputs: without it the logits differ
    full = _logits(ours)
    assert _logits(ours).abs().max() < 3.0  # capped
    for option in ("attn_logit_softcapping", "final_logit_softcapping", "attention_scale", "sliding_window"):
        without = {option: None, **({"sliding_window_layers": None} if option == "sliding_window" else {})}
        other = TransformerDecoder.from_pretrained(str(directory), **without).double().eval()
        assert not torch.allclose(_logits(other), full), option


def test_gemma2_config_without_layer_types_slides_on_even_layers(tmp_path):
    """The official Gemma 2 configs (2024) have no layer_types: transformers slides on layers 0, 2, ..."""
    directory = _save(tmp_path, "gemma2", **{**GEMMA2, "num_hidden_layers": 3})
    _rewrite_config(directory, drop=("layer_types",))
    ours = _check_logits(directory, 20, left=False)
    assert [layer.attn.sliding_window for layer in ours.layers] == [6, None, 6]


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3_text"])
def test_float32_logits_within_1e5_with_left_padding(tmp_path, family):
    config = {"qwen3": {"head_dim": 8, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
              "gemma2": GEMMA2, "gemma3_text": GEMMA3}[family]
    _check_logits(_save(tmp_path, family, **config), 20, dtype=torch.float32, atol=1e-5)


# ---- Gemma 3 -----------------------------------------------------------------------------------------------------

def _check_gemma3_rope(ours: TransformerDecoder, directory: Path) -> None:
    from lightning_peft.nn import RotaryEmbedding

    theirs = _theirs(directory, torch.float64).model.rotary_emb
    local, global_ = ours.layers[0].attn.rotary, ours.layers[1].attn.rotary
    assert torch.equal(local.inv_freq, theirs.sliding_attention_inv_freq.float())
    assert torch.equal(global_.inv_freq, theirs.full_attention_inv_freq.float())
    assert torch.equal(local.inv_freq, RotaryEmbedding(16, 50.0).inv_freq)  # the local base, unscaled
    assert torch.equal(global_.inv_freq, RotaryEmbedding(16, 1000.0).inv_freq / 2)  # linear factor 2


def test_gemma3_text_equals_transformers(tmp_path):
    directory = _save(tmp_path, "gemma3_text", **GEMMA3)
    ours = _check_logits(directory, 20)
    assert [layer.attn.sliding_window for layer in ours.layers] == [6, None]
    assert ours.layers[0].attn.q_norm.offset == 1.0 and ours.layers[0].attn.last_backend == "sdpa"
    assert ours.final_logit_softcapping is None and ours.layers[0].attn.softcap is None
    _check_gemma3_rope(ours, directory)


def test_gemma3_text_config_of_the_official_releases(tmp_path):
    """rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern, as the Hub's Gemma 3 configs."""
    directory = _save(tmp_path, "gemma3_text", **GEMMA3)
    _rewrite_config(directory, drop=("layer_types", "rope_parameters"), rope_theta=1000.0, rope_local_base_freq=50.0,
                    rope_scaling={"rope_type": "linear", "factor": 2.0}, sliding_window_pattern=2)
    _check_gemma3_rope(_check_logits(directory, 20), directory)


# ---- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("config", "match"), [
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50.0 on gemma3_text, which transformers' Gemma 3 does"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     r"rope type 'linear' on the sliding_attention layers is not implemented"),
    ({"hidden_activation": "silu"}, r"hidden_activation 'silu' is not supported for model_type 'gemma3_text'"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=True \(Gemma as an encoder\)"),
])
def test_gemma3_text_configs_the_decoder_lacks_are_refused(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        TransformerDecoder.from_pretrained(str(_write_config(tmp_path, model_type="gemma3_text", **config)))


def test_softcap_refusals():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"attention\(backend='sdpa', softcap=2.0\): scaled_dot_product_attention "
                                         "cannot soft-cap"):
        attention(q, q, q, backend="sdpa", softcap=2.0)
    with pytest.raises(ValueError, match=r"attention\(softcap=0\): softcap must be a positive number"):
        attention(q, q, q, softcap=0)
    with pytest.raises(ValueError, match=r"FlashAttention\(softcap=2.0, backend='sdpa'\): "):
        FlashAttention(16, 2, softcap=2.0, backend="sdpa")
    with pytest.raises(ValueError, match=r"FlashAttention\(scale=-1.0\): scale must be a positive number"):
        FlashAttention(16, 2, scale=-1.0)
    with pytest.raises(ValueError, match=r"FlashAttention\(softcap=2.0\): need_importance computes the attention "
                                         "without soft-capping"):
        FlashAttention(16, 2, softcap=2.0)(torch.randn(1, 3, 16), need_importance=True)
    with pytest.raises(ValueError, match=r"TransformerBlock\(sandwich_norm=True, norm_first=False\)"):
        TransformerBlock(16, 2, 32, norm_first=False, sandwich_norm=True)
    with pytest.raises(ValueError, match=r"TransformerDecoder\(final_logit_softcapping=-3.0\): "
                                         "final_logit_softcapping must be a positive number"):
        TransformerDecoder(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, final_logit_softcapping=-3.0)
    with pytest.raises(ValueError, match=r"TransformerDecoder\(sliding_rope_theta=100.0, sliding_window=None\): the "
                                         "base is for the sliding-window layers, and there are none"):
        TransformerDecoder(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, sliding_rope_theta=100.0)
    with pytest.raises(RuntimeError, match=r"cannot run here: .*Use backend='auto' \(falls back to 'math', which "
                                           r"soft-caps\) or backend='math'\.$"):
        select_backend(q, "flash_attn", softcap=2.0)


# ---- the math backend --------------------------------------------------------------------------------------------

def _reference(q, k, v, mask, window, softcap, scale):
    """softmax(cap(scale q k^T) + mask) v in float64 with every key head repeated (as transformers' repeat_kv)."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * scale
    scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None]
    allowed = (j <= i) & (j > i - window) & mask[:, None, None, :]
    return torch.nan_to_num(scores.masked_fill(~allowed, -math.inf).softmax(-1)) @ v


def test_math_backend_soft_caps_as_a_reference_and_packs():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.tensor([[True] * 9, [False] * 3 + [True] * 6])  # row 1's first queries see no key: zeros
    assert select_backend(q, softcap=2.0) == "math"
    got = attention(q, k, v, True, mask, scale=0.3, window=4, softcap=2.0)
    want = _reference(q, k, v, mask, 4, 2.0, 0.3)
    # its softmax runs in float32 (as transformers' eager attention): float32 rounding in float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(got[1, :, :3], torch.zeros_like(got[1, :, :3]))
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    for ours, theirs in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # packed: each sequence alone
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    packed = packed_attention(q[:1], k[:1], v[:1], cu, causal=True, scale=0.3, window=4, softcap=2.0)
    alone = [attention(q[:1, :, a:b], k[:1, :, a:b], v[:1, :, a:b], True, scale=0.3, window=4, softcap=2.0)
             for a, b in ((0, 4), (4, 9))]
    torch.testing.assert_close(packed, torch.cat(alone, dim=2), rtol=0, atol=0)


def test_math_backend_rounds_as_transformers_eager_attention_in_bfloat16():
    """The operations of transformers' eager attention in its order: bfloat16 outputs equal exactly."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 7, 8).bfloat16(), *torch.randn(2, 2, 2, 7, 8).bfloat16()
    additive = torch.full((7, 7), torch.finfo(torch.bfloat16).min).triu(1)[None, None].bfloat16()
    module = SimpleNamespace(num_key_value_groups=2, training=False, head_dim=8)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3, softcap=2.0)  # (B, L, H, D)
    got = attention(q, k, v, causal=True, scale=0.3, softcap=2.0)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=0, atol=0)


def test_from_scratch_options_train(tmp_path):
    """A from-scratch decoder with every new option: runs, and every parameter gets a gradient."""
    decoder = TransformerDecoder(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, qk_norm=True,
                                 attention_scale=0.5, attn_logit_softcapping=20.0, final_logit_softcapping=10.0,
                                 sandwich_norm=True, sliding_window=3, sliding_window_layers=[0],
                                 sliding_rope_theta=100.0, norm_offset=1.0)
    assert decoder.layers[0].attn.rotary.inv_freq[1] != decoder.layers[1].attn.rotary.inv_freq[1]
    ids, mask = _batch(10, True)
    decoder(ids, mask)[mask.bool()].logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in decoder.parameters())


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_packed_rows_equal_each_row_alone(tmp_path, family):
    """cu_seqlens through q/k norms, soft-capping (math, one sequence at a time) and a window shorter than a row."""
    config = {"qwen3": {"head_dim": 8}, "gemma2": GEMMA2}[family]
    decoder = TransformerDecoder.from_pretrained(str(_save(tmp_path, family, **config))).double().eval()
    ids, _ = _batch(20, False)
    rows = [ids[0, :7], ids[1, :13]]
    with torch.no_grad():
        packed = decoder(torch.cat(rows)[None], cu_seqlens=torch.tensor([0, 7, 20], dtype=torch.int32))
        alone = torch.cat([decoder(row[None]) for row in rows], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)


def test_pipeline_pieces_end_with_the_logit_cap():
    from lightning_peft.parallel.pipeline import pipeline_pieces

    torch.manual_seed(0)
    decoder = TransformerDecoder(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2,
                                 final_logit_softcapping=0.5).double()
    ids, mask = _batch(8, True, left=False)
    carry = (ids, mask)
    for piece in pipeline_pieces(decoder, ["input_ids", "attention_mask"]):
        carry = piece.run(tuple(carry))
    torch.testing.assert_close(carry[0], decoder(ids, mask), rtol=0, atol=1e-12)


def test_causal_lm_with_final_soft_capping_keeps_the_plain_loss(tmp_path):
    """The chunked loss applies the head itself and would skip the cap after it: CausalLM falls back."""
    from lightning_peft.modules import CausalLM
    from lightning_peft.modules.causal_lm import shifted_token_losses

    directory = _save(tmp_path, "gemma2", **GEMMA2)
    lm = CausalLM(vocab_size=VOCAB, pretrained=str(directory), chunked_loss=4).double().eval()
    assert lm.chunked_head() is None
    ids, mask = _batch(12, True, left=False)
    with torch.no_grad():
        loss_sum, count = lm._token_losses({"input_ids": ids, "attention_mask": mask})
        theirs = _theirs(directory, torch.float64)(input_ids=ids, attention_mask=mask).logits
        want_sum, want_count = shifted_token_losses(theirs, ids.masked_fill(mask == 0, -100))
    torch.testing.assert_close(loss_sum, want_sum, rtol=0, atol=1e-5)  # float32 sums
    assert int(count) == int(want_count)
