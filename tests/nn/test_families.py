"""`TransformerDecoder.from_pretrained` on each family against transformers' own model of the same checkpoint.

Each checkpoint is a tiny random transformers model saved with ``save_pretrained`` (float32 weights, which float64
holds exactly); both models then run in float64 and their logits on every real token agree to 1e-10, on a batch
with right and left padding and on one without (float32: 1e-5).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_peft.nn import FlashAttention, RMSNorm, RotaryEmbedding, TransformerDecoder
from lightning_peft.nn.attention import attention, packed_attention

VOCAB = 70
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


CLASSES = {"llama": ("Llama", "Llama"), "qwen2": ("Qwen2", "Qwen2"), "qwen3": ("Qwen3", "Qwen3"),
           "mistral": ("Mistral", "Mistral"), "gemma": ("Gemma", "Gemma"), "gemma2": ("Gemma2", "Gemma2"),
           "gemma3_text": ("Gemma3", "Gemma3Text")}  # model_type: (the ForCausalLM's prefix, the Config's)


def _save(directory: Path, family: str, **config) -> Path:
    import transformers

    model_name, config_name = CLASSES[family]
    torch.manual_seed(3)
    model = getattr(transformers, f"{model_name}ForCausalLM")(
        getattr(transformers, f"{config_name}Config")(**{**SHAPE, **config}))
    with torch.no_grad():  # random norms and biases, which a fresh model leaves at 1 (Gemma 0) and 0
        for param_name, param in model.named_parameters():
            if param.dim() == 1:
                mean = 0.0 if family.startswith("gemma") else 1.0
                param.normal_(mean, 0.1) if "norm" in param_name else param.normal_()
    model.save_pretrained(directory)
    return directory


def _theirs(directory: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def _batch(length: int, padded: bool, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, length), generator=generator)
    mask = torch.ones(3, length, dtype=torch.long)
    if padded:
        mask[1, length - 5:] = 0  # right padding
        if left:
            mask[2, :7] = 0  # left padding
    return ids * mask, mask


def _check_logits(directory: Path, length: int, dtype: torch.dtype = torch.float64, atol: float = 1e-10,
                  left: bool = True, **overrides) -> TransformerDecoder:
    ours = TransformerDecoder.from_pretrained(str(directory), **overrides).to(dtype).eval()
    theirs = _theirs(directory, dtype)
    for padded in (True, False):
        ids, mask = _batch(length, padded, left)
        with torch.no_grad():
            want = theirs(input_ids=ids, attention_mask=mask).logits
            got = ours(ids, mask if padded else None)
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=atol)
    return ours


# ---- each family -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
def test_llama2_equals_transformers(tmp_path, tie):
    _check_logits(_save(tmp_path, "llama", tie_word_embeddings=tie, rope_theta=500.0), 20)


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}],
                         ids=["llama3", "linear"])
def test_llama_rope_scaling_equals_transformers_beyond_the_original_context(tmp_path, scaling):
    directory = _save(tmp_path, "llama", rope_parameters=dict(scaling))
    ours = _check_logits(directory, 40)  # 40 positions: beyond original_max_position_embeddings=32
    theirs = _theirs(directory, torch.float64)
    inv_freq = ours.layers[0].attn.rotary.inv_freq
    assert torch.equal(inv_freq, theirs.model.rotary_emb.inv_freq.float())
    assert not torch.equal(inv_freq, RotaryEmbedding(8, 500.0).inv_freq)  # the scaling changed the frequencies
    if scaling["rope_type"] == "llama3":  # all three bands occur: kept, interpolated, divided by the factor
        unscaled = RotaryEmbedding(8, 500.0).inv_freq
        ratio = (unscaled / inv_freq).tolist()
        assert ratio[0] == 1.0 and 1.0 < ratio[1] < 4.0 and ratio[-1] == pytest.approx(4.0)


@pytest.mark.parametrize("window", [None, 8], ids=["full", "sliding"])
def test_qwen2_equals_transformers(tmp_path, window):
    directory = _save(tmp_path, "qwen2", tie_word_embeddings=True, use_sliding_window=window is not None,
                      sliding_window=window, max_window_layers=1)
    ours = _check_logits(directory, 20)
    assert ours.layers[0].attn.q_proj.bias is not None and ours.layers[0].attn.o_proj.bias is None
    assert ours.lm_head.weight is ours.embed_tokens.weight
    assert [layer.attn.sliding_window for layer in ours.layers] == [None, window]


def test_mistral_sliding_window_and_head_dim_equal_transformers(tmp_path):
    ours = _check_logits(_save(tmp_path, "mistral", sliding_window=6, head_dim=16), 20)
    assert ours.layers[0].attn.q_proj.weight.shape == (4 * 16, 32)
    # the window matters on these inputs: without it the logits differ
    ids, _ = _batch(20, False)
    full = TransformerDecoder.from_pretrained(str(tmp_path), sliding_window=None).double().eval()
    with torch.no_grad():
        assert not torch.allclose(full(ids)[:, 6:], ours(ids)[:, 6:])


def test_gemma_equals_transformers(tmp_path):
    # hidden 24: sqrt(24) is not a float32 number, so the embedding scale's rounding is compared too
    ours = _check_logits(_save(tmp_path, "gemma", hidden_size=24, head_dim=16), 20)
    assert ours.embed_tokens.scale == math.sqrt(24) and ours.norm.offset == 1.0
    assert ours.lm_head.weight is ours.embed_tokens.weight


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_float32_logits_within_1e5(tmp_path, family):
    extra = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0} if family == "qwen2" else {}
    _check_logits(_save(tmp_path, family, **extra), 20, dtype=torch.float32, atol=1e-5)


# ---- refusals ----------------------------------------------------------------------------------------------------

def _write_config(directory: Path, **config) -> Path:
    import json

    (directory / "config.json").write_text(json.dumps({**SHAPE, **config}))
    return directory


@pytest.mark.parametrize(("model_type", "match"), [
    ("gemma3", r"model_type 'gemma3' is not supported \(the vision tower and image inputs of multimodal Gemma 3 are not "),
    ("qwen3_moe", r"model_type 'qwen3_moe' is not supported \(mixture-of-experts feed-forwards are not implemented"),
    ("gpt2", r"model_type 'gpt2' is not supported; this decoder loads 'llama', 'qwen2', 'mistral', 'gemma'"),
])
def test_unknown_model_types_are_refused(tmp_path, model_type, match):
    with pytest.raises(ValueError, match=match):
        TransformerDecoder.from_pretrained(str(_write_config(tmp_path, model_type=model_type)))


@pytest.mark.parametrize(("config", "match"), [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
     r"rope type 'yarn' .* is not implemented; implemented: 'default', 'linear', 'llama3'"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     r"partial_rotary_factor=0.5 \(rotary on part of each head\) is not implemented"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported for model_type 'llama' \(accepted: 'silu'\)"),
])
def test_config_values_the_decoder_lacks_are_refused(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        TransformerDecoder.from_pretrained(str(_write_config(tmp_path, model_type="llama", **config)))


def test_gemma_bidirectional_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=True \(Gemma as an encoder\)"):
        TransformerDecoder.from_pretrained(str(_write_config(tmp_path, model_type="gemma",
                                                             use_bidirectional_attention=True)))


def test_option_refusals():
    with pytest.raises(ValueError, match=r"rope_type 'dynamic' is not implemented"):
        RotaryEmbedding(8, scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_type 'llama3' needs 'low_freq_factor'"):
        RotaryEmbedding(8, scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match=r"sliding_window=4, causal=False\): a sliding window is implemented for "
                                         "causal attention only"):
        FlashAttention(16, 2, sliding_window=4)
    with pytest.raises(ValueError, match=r"attention\(window=4, causal=False\)"):
        attention(*torch.randn(3, 1, 2, 5, 4), window=4)
    with pytest.raises(ValueError, match=r"sliding_window_layers=\[0\], sliding_window=None\)"):
        TransformerDecoder(vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, sliding_window_layers=[0])
    with pytest.raises(ValueError, match=r"sliding_window_layers=\[2\]\): sliding_window_layers\[0\]=2 must be"):
        TransformerDecoder(vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, sliding_window=4,
                           sliding_window_layers=[2])
    attn = FlashAttention(16, 2, causal=True, sliding_window=4)
    with pytest.raises(ValueError, match=r"sliding_window=4\): need_importance computes the attention without"):
        attn(torch.randn(1, 5, 16), need_importance=True)


# ---- the options on their own ------------------------------------------------------------------------------------

def test_sliding_window_attention_equals_a_banded_reference_and_packs():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8, dtype=torch.float64), *torch.randn(2, 2, 2, 9, 8, dtype=torch.float64)
    mask = torch.tensor([[True] * 9, [False] * 2 + [True] * 7])
    i, j = torch.arange(9)[:, None], torch.arange(9)[None]
    allowed = (j <= i) & (j > i - 3) & mask[:, None, None, :]  # (B, 1, L, L)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8)).masked_fill(~allowed, -math.inf)
    want = torch.nan_to_num(scores.softmax(-1)) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(attention(q, k, v, True, mask, window=3), want, rtol=0, atol=1e-12)
    # packed: each sequence alone, with the same window, whichever way SDPA groups the sequences
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    alone = [attention(q[:1, :, a:b], k[:1, :, a:b], v[:1, :, a:b], True, window=3) for a, b in ((0, 4), (4, 9))]
    for method in ("auto", "loop", "padded"):
        packed = packed_attention(q[:1], k[:1], v[:1], cu, causal=True, window=3, sdpa_method=method)
        torch.testing.assert_close(packed, torch.cat(alone, dim=2), rtol=0, atol=1e-12)


def test_gemma_norm_offset_from_scratch():
    norm = RMSNorm(4, offset=1.0)  # computed in float32, as Llama's and Gemma's
    assert torch.equal(norm.weight, torch.zeros(4))  # a fresh norm scales by 1
    x = torch.randn(2, 4)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.tensor([1.5, 0.0, 1.0, 3.0])
    torch.testing.assert_close(norm(x), want, rtol=0, atol=1e-6)
    decoder = TransformerDecoder(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, norm_offset=1.0,
                                 embedding_scale=2.0, activation="gelu_tanh", qkv_bias=True)
    assert decoder.layers[0].mlp_norm.offset == 1.0 and decoder.layers[0].attn.o_proj.bias is None
    assert decoder(torch.tensor([[1, 2, 3]])).shape == (1, 3, 10)


def test_gemma_norm_and_embedding_round_as_gemma_in_bfloat16():
    """The same operations in the same order as transformers' Gemma modules: bfloat16 outputs equal exactly
    (Llama's order, casting before the weight multiplies, rounds differently)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm, GemmaTextScaledWordEmbedding

    from lightning_peft.nn.decoder import ScaledEmbedding

    torch.manual_seed(0)
    theirs_norm, ours_norm = GemmaRMSNorm(24), RMSNorm(24, offset=1.0)
    with torch.no_grad():
        theirs_norm.weight.normal_()
        ours_norm.weight.copy_(theirs_norm.weight)
    x = torch.randn(4, 24).bfloat16()
    torch.testing.assert_close(ours_norm.bfloat16()(x), theirs_norm.bfloat16()(x), rtol=0, atol=0)
    theirs_embed = GemmaTextScaledWordEmbedding(10, 24, 0, embed_scale=24**0.5)
    ours_embed = ScaledEmbedding(10, 24, scale=24**0.5)
    with torch.no_grad():
        ours_embed.weight.copy_(theirs_embed.weight.normal_())
    ids = torch.arange(10)[None]
    torch.testing.assert_close(ours_embed.bfloat16()(ids), theirs_embed.bfloat16()(ids), rtol=0, atol=0)


# ---- what runs on a loaded decoder -------------------------------------------------------------------------------

def test_lora_on_a_loaded_qwen2_and_causal_lm(tmp_path):
    from lightning_peft.modules import CausalLM
    from lightning_peft.peft import inject_lora

    directory = _save(tmp_path, "qwen2", tie_word_embeddings=True)
    decoder = TransformerDecoder.from_pretrained(str(directory)).double().eval()
    ids, mask = _batch(12, True)
    with torch.no_grad():
        base = decoder(ids, mask)
    inject_lora(decoder, rank=2, target_modules=["q_proj", "v_proj"])
    out = decoder(ids, mask)
    torch.testing.assert_close(out, base, rtol=0, atol=0)  # B starts at zero: the base model exactly
    out[mask.bool()].sum().backward()
    trained = [n for n, p in decoder.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained)
    lm = CausalLM(vocab_size=VOCAB, pretrained=str(directory)).double().eval()
    with torch.no_grad():
        torch.testing.assert_close(lm(ids, mask)[mask.bool()], base[mask.bool()], rtol=0, atol=1e-12)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's memory map (Linux)")
def test_from_pretrained_keeps_the_checkpoint_s_mapped_tensors_and_training_leaves_the_file_alone(tmp_path):
    from safetensors.torch import load_file

    directory = _save(tmp_path, "llama", tie_word_embeddings=True)
    before = load_file(str(directory / "model.safetensors"))
    ours = TransformerDecoder.from_pretrained(str(directory))
    assert ours.lm_head.weight is ours.embed_tokens.weight  # still tied after the parameters were replaced
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    file = str((directory / "model.safetensors").resolve())
    for name, param in ours.named_parameters():  # each weight in the file's mapping, not a copy
        ptr = param.data_ptr()
        assert any(int(m[0].split("-")[0], 16) <= ptr < int(m[0].split("-")[1], 16) and m[-1] == file
                   for m in maps if len(m) >= 6), name
    ours(torch.tensor([[1, 2, 3]])).sum().backward()
    with torch.no_grad():
        for param in ours.parameters():
            param -= 0.1 * param.grad  # written in place: a private copy of the page, never the file
    after = load_file(str(directory / "model.safetensors"))
    assert all(torch.equal(before[key], after[key]) for key in before)
    again = TransformerDecoder.from_pretrained(str(directory))
    assert torch.equal(again.embed_tokens.weight, before["model.embed_tokens.weight"])
    assert not torch.equal(ours.embed_tokens.weight, before["model.embed_tokens.weight"])
