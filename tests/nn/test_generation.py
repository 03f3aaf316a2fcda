"""Generation with a key/value cache (`lightning_peft.nn.generate`, `KVCache`) against transformers' `generate` on the
same Llama weights, and cached steps against the whole-sequence forward, float64."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_peft.nn import KVCache, TransformerDecoder, filter_logits, generate, generation, kv_cache
from lightning_peft.peft import inject_lora

VOCAB = 70


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LlamaForCausalLM (grouped-query attention, untied head) saved in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=40, rope_theta=500.0, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    directory = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _ours(directory: Path) -> TransformerDecoder:
    return TransformerDecoder.from_pretrained(str(directory)).double().eval()


def _theirs(directory: Path) -> nn.Module:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory).double().eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


def _left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of ``lengths`` real tokens, left-padded with token 0 to the longest: ``(ids, mask)`` ``(B, L)``."""
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return ids * mask, mask


def test_docstring_examples() -> None:
    assert doctest.testmod(generation).failed == 0
    assert doctest.testmod(kv_cache).failed == 0


# ---- the cache: every step's logits equal the whole-sequence forward --------------------------------------------

def _decoders(directory: Path) -> dict[str, TransformerDecoder]:
    torch.manual_seed(0)
    small = {"vocab_size": VOCAB, "hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "max_position_embeddings": 40}
    return {
        "llama": _ours(directory),
        "reversible": TransformerDecoder(**small, reversible=True).double().eval(),
        "moe": TransformerDecoder(**small, moe={"num_experts": 4, "top_k": 2, "dropless": True}).double().eval(),
    }


@pytest.mark.parametrize("which", ["llama", "reversible", "moe"])
def test_cached_logits_equal_the_whole_forward_at_every_step(llama_dir: Path, which: str) -> None:
    decoder = _decoders(llama_dir)[which]
    ids, mask = _left_padded([5, 9, 2], seed=1)
    more = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(2))
    full_ids, full_mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)  # (3, 15)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = decoder(full_ids, full_mask, positions)  # (3, 15, V)
        cache = KVCache(15)
        got = [decoder(ids, mask, positions[:, :9], kv_cache=cache)]  # prefill, then one token per step
        for t in range(9, 15):
            got.append(decoder(full_ids[:, t : t + 1], full_mask[:, : t + 1], positions[:, t : t + 1], kv_cache=cache))
    got = torch.cat(got, 1)
    real = full_mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-10)
    assert cache.length == 15 and all(layer.length == 15 for layer in cache.layers)


def test_cache_default_positions_continue_after_the_cached_tokens(llama_dir: Path) -> None:
    decoder = _ours(llama_dir)
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = KVCache(7)
        decoder(ids[:, :4], kv_cache=cache)
        got = decoder(ids[:, 4:], kv_cache=cache)  # three tokens at once after four cached ones, no positions given
        want = decoder(ids)[:, 4:]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


# ---- greedy and sampled tokens equal transformers' generate -----------------------------------------------------

@pytest.mark.parametrize("lengths", [[7], [4, 9, 1, 6]], ids=["batch1", "left-padded"])
@pytest.mark.parametrize("stop", [False, True], ids=["no-eos", "eos"])
def test_greedy_tokens_equal_transformers_generate(llama_dir: Path, lengths: list[int], stop: bool) -> None:
    ours, theirs = _ours(llama_dir), _theirs(llama_dir)
    ids, mask = _left_padded(lengths)
    options = {}
    if stop:  # a token the first sample emits at its third step, so it stops there and gets padding after
        third = generate(ours, ids, 3, attention_mask=mask)[0, -1].item()
        options = {"eos_token_id": [third, 69], "pad_token_id": 0}
    with torch.no_grad():
        want = theirs.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **options)
    got = generate(ours, ids, 12, attention_mask=mask, **options)
    assert torch.equal(got, want)
    assert torch.equal(generate(ours, ids, 12, attention_mask=mask, use_cache=False, **options), want)
    if stop:
        width = ids.shape[1]
        assert torch.equal(got[0, width + 3 :], torch.zeros_like(got[0, width + 3 :]))


def test_sampled_tokens_equal_transformers_sampling(llama_dir: Path) -> None:
    ours, theirs = _ours(llama_dir), _theirs(llama_dir)
    ids, mask = _left_padded([3, 8, 5])
    settings = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
    torch.manual_seed(11)
    with torch.no_grad():
        want = theirs.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, **settings)
    torch.manual_seed(11)  # the same global draws: our sampler is transformers' (warpers, then multinomial)
    got = generate(ours, ids, 10, attention_mask=mask, **settings)
    assert torch.equal(got, want)


def test_sampling_is_reproducible_and_top_k_1_is_greedy(llama_dir: Path) -> None:
    decoder = _ours(llama_dir)
    ids, mask = _left_padded([3, 6])

    def sample(seed: int, **options: object) -> torch.Tensor:
        return generate(decoder, ids, 10, 1.5, torch.Generator().manual_seed(seed), attention_mask=mask, **options)

    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))  # the draws do depend on the generator
    assert torch.equal(sample(5, top_k=1), generate(decoder, ids, 10, attention_mask=mask))


@pytest.mark.parametrize(("top_k", "top_p"), [(1, None), (7, None), (200, None), (None, 0.3), (None, 0.95),
                                              (None, 1.0), (12, 0.8)])
def test_filter_logits_equals_transformers_warpers(top_k: int | None, top_p: float | None) -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(4)) * 3
    logits[0, :10] = logits[0, 0]  # ties at the top
    logits[1] = (logits[1] * 2).round() / 2  # ties everywhere
    want = logits
    if top_k is not None:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p is not None and top_p < 1.0:
        want = TopPLogitsWarper(top_p)(None, want)
    assert torch.equal(filter_logits(logits, top_k, top_p), want)


def test_top_p_drops_a_token_whose_cumulative_probability_equals_one_minus_p() -> None:
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.zeros(1, 4)  # probabilities 0.25 each, exact: cumulative 0.25, 0.5 <= 1 - 0.5 drop two tokens
    want = TopPLogitsWarper(0.5)(None, logits)
    assert torch.equal(filter_logits(logits, top_p=0.5), want) and int(want.isinf().sum()) == 2


# ---- adapters: a LoRA'd decoder generates through its LoRA layers, with the cache as without --------------------

def test_lora_decoder_generates_with_the_cache_as_without(llama_dir: Path) -> None:
    decoder = _ours(llama_dir)
    ids, mask = _left_padded([4, 8, 2])
    base = generate(decoder, ids, 10, attention_mask=mask)
    layers = inject_lora(decoder, rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "up_proj", "lm_head"])
    torch.manual_seed(6)
    for layer in layers.values():
        for b in layer.lora_B.values():
            nn.init.normal_(b.weight, std=1.0)
    cached = generate(decoder, ids, 10, attention_mask=mask)
    assert torch.equal(cached, generate(decoder, ids, 10, attention_mask=mask, use_cache=False))
    assert not torch.equal(cached, base)  # the adapters took part


# ---- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_new_tokens": 33}, ValueError, (r"^generate: the prompts' 8 positions \(padding included\) plus "
         r"max_new_tokens=33 exceed the decoder's max_position_embeddings=40; .* does not slide a window")),
        ({"top_k": 5}, ValueError, (r"^generate\(temperature=0, top_k=5, top_p=None\): top_k and top_p filter the "
         "sampling distribution")),
        ({"temperature": 1.0, "top_p": 1.5}, ValueError, r"^generate\(top_p=1.5\): top_p must be a finite number in"),
        ({"temperature": 1.0, "top_k": 0}, ValueError, r"^generate\(top_k=0\): top_k must be an integer >= 1"),
        ({"temperature": -1.0}, ValueError, r"^generate\(temperature=-1.0\): temperature must be >= 0"),
        ({"eos_token_id": []}, ValueError, r"^generate\(eos_token_id=\[\]\): give a stop token id"),
        ({"eos_token_id": [3, -1]}, ValueError, r"^generate\(eos_token_id\[1\]=-1\): .* must be an integer >= 0"),
        ({"attention_mask": torch.tensor([[1] * 8, [1] * 7 + [0]])}, ValueError,
         r"^generate: prompt 1 ends with padding .* pad the prompts on the left"),
        ({"attention_mask": torch.ones(2, 8)}, TypeError, r"^generate: attention_mask must be a bool or integer"),
        ({"attention_mask": torch.ones(2, 7, dtype=torch.long)}, ValueError,
         r"^generate: attention_mask must have the shape of input_ids \(2, 8\), got \(2, 7\)"),
    ],
)
def test_generate_refuses(llama_dir: Path, kwargs: dict[str, object], error: type, match: str) -> None:
    options = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(error, match=match):
        generate(_ours(llama_dir), torch.ones(2, 8, dtype=torch.long), **options)


def test_cache_refusals() -> None:
    decoder = TransformerDecoder(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=6)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"^KVCache: the keys and values require grad; .* torch.no_grad\(\)"):
        decoder(ids, kv_cache=KVCache(6))
    cases = [
        (6, ids[:, :3], None, r"^TransformerDecoder: 4 cached tokens and 3 new ones exceed max_position_embeddings=6"),
        (5, ids[:, :2], None, r"^KVCache\(max_length=5\): layer 0 holds 4 tokens and got 2 more"),
        (6, ids[:, :1], torch.ones(1, 1, dtype=torch.long),
         (r"attention_mask has shape \(1, 1\) but input_ids \(1, 1\) after 4 cached tokens \(the mask covers both\); "
          r".* shape \(1, 5\)")),
        (6, ids[:, :1].expand(2, 1), None,
         r"^KVCache: layer 0 holds keys of \(batch, kv_heads, head_dim\) = \(1, 2, 8\), got \(2, 2, 8\)"),
    ]
    for length, more, mask, match in cases:  # four cached tokens, then a call that does not fit
        cache = KVCache(length)
        with torch.no_grad(), pytest.raises(ValueError, match=match):
            decoder(ids, kv_cache=cache)
            decoder(more, mask, kv_cache=cache)
    attn = decoder.layers[0].attn
    with pytest.raises(ValueError, match=r"^FlashAttention: kv_cache .* does not combine with cu_seqlens"):
        attn(torch.randn(1, 4, 16), cu_seqlens=torch.tensor([0, 4]), kv_cache=KVCache(4).layer(0))
    with pytest.raises(ValueError, match=r"^KVCache\(max_length=0\): max_length must be an integer >= 1"):
        KVCache(0)


@pytest.mark.parametrize("family, config", [
    ("mistral", {"sliding_window": 4}),  # the window slides over the cached keys (5 + 10 tokens)
    ("qwen3", {"head_dim": 16}),  # q/k norms before the cache
    ("gemma2", {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 3.0}),  # soft-capped scores and logits, on the math backend
    ("gemma3_text", {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 12, "sliding_window_pattern": 2,
                     "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}}),
    # two rotary tables (a base per layer type), each computed once per step and given to its own layers
])
def test_cached_greedy_on_other_families_equals_transformers(tmp_path: Path, family: str, config: dict) -> None:
    from tests.nn.test_families import _save
    from tests.nn.test_families import _theirs as theirs_of

    directory = _save(tmp_path, family, **config)
    ours = TransformerDecoder.from_pretrained(str(directory)).double().eval()
    ids = torch.randint(1, 60, (2, 5), generator=torch.Generator().manual_seed(1))
    theirs = theirs_of(directory, torch.float64)
    stops = {"eos_token_id": theirs.generation_config.eos_token_id, "pad_token_id": 0}  # what transformers stops on
    with torch.no_grad():
        want = theirs.generate(ids, max_new_tokens=10, do_sample=False, **stops)
    assert torch.equal(generate(ours, ids, 10, **stops), want)
    assert torch.equal(generate(ours, ids, 10, use_cache=False, **stops), want)
