"""Beam search (`lightning_peft.nn.generate(num_beams=k)`, `lightning_peft.nn.beam_search`) against transformers'
``generate(num_beams=k, do_sample=False)`` on the same Llama weights, float64; the reordered `KVCache` against the
whole-sequence forward; routed beams against each prompt alone with its adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_peft.modules.causal_lm import CausalLM
from lightning_peft.nn import KVCache, TransformerDecoder, generate
from lightning_peft.peft import (
    add_adapter,
    disable_adapters,
    inject_lora,
    lora_layers,
    route_adapters,
    set_adapter,
)
from tests._models import randomise
from tests.nn.test_generation import VOCAB, _left_padded, _ours, _theirs, llama_dir  # noqa: F401  (the fixture)

NEW = 12


def _stops(decoder: TransformerDecoder, ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """Two tokens the search without stops writes early (the first prompt's best hypothesis at its third new token,
    the last prompt's at its second), so that with them as stop tokens hypotheses end before the others."""
    free = generate(decoder, ids, NEW, attention_mask=mask, num_beams=2)[:, ids.shape[1]:]  # (B, NEW)
    return sorted({int(free[0, 2]), int(free[-1, 1])})


@pytest.mark.parametrize(
    ("lengths", "stop", "beams"),
    [
        ([7], False, {"num_beams": 2}),
        ([7], False, {"num_beams": 4, "num_return_sequences": 4}),
        ([4, 9, 1, 6], True, {"num_beams": 2, "num_return_sequences": 2}),
        ([4, 9, 1, 6], True, {"num_beams": 4, "num_return_sequences": 4, "length_penalty": 0.5,
                              "early_stopping": True}),
        ([4, 9, 1, 6], True, {"num_beams": 4, "length_penalty": -1.5, "early_stopping": False}),
        ([4, 9, 1, 6], True, {"num_beams": 3, "num_return_sequences": 3, "length_penalty": 2.0,
                              "early_stopping": "never"}),
    ],
    ids=["k2", "k4-all", "left-padded-eos-k2", "eos-lp0.5-early", "eos-lp-1.5", "eos-lp2-never"],
)
def test_beam_tokens_equal_transformers_generate(llama_dir: Path, lengths: list[int], stop: bool,  # noqa: F811
                                                 beams: dict) -> None:
    ours, theirs = _ours(llama_dir), _theirs(llama_dir)
    ids, mask = _left_padded(lengths)
    # pad 1, not 0: transformers fills finished hypotheses with `pad_token_id or eos_token_id[0]`, so with pad 0 it
    # writes the first stop token there (we write pad_token_id, as greedy decoding does)
    options = {"eos_token_id": _stops(ours, ids, mask), "pad_token_id": 1} if stop else {}
    with torch.no_grad():
        want = theirs.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **beams, **options)
    got = generate(ours, ids, NEW, attention_mask=mask, **beams, **options)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(generate(ours, ids, NEW, attention_mask=mask, use_cache=False, **beams, **options), want)
    if stop:  # the stop tokens took part; without a bonus for length, returned hypotheses ended early on them
        free = generate(ours, ids, NEW, attention_mask=mask, **beams)
        assert got.shape != free.shape or not torch.equal(got, free)
        if beams.get("length_penalty", 1.0) <= 1.0:
            assert bool(torch.isin(got[:, ids.shape[1] : -1], torch.tensor(options["eos_token_id"])).any())


def test_causal_lm_generate_takes_the_beam_arguments(llama_dir: Path) -> None:  # noqa: F811
    lm = CausalLM(vocab_size=VOCAB, pretrained=str(llama_dir)).double().train()
    ids, mask = _left_padded([3, 6])
    options = {"num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.7, "attention_mask": mask}
    got = lm.generate(ids, 6, **options)
    assert lm.training  # the mode restored
    assert torch.equal(got, generate(lm.decoder.eval(), ids, 6, **options)) and got.shape[0] == 4
    with pytest.raises(ValueError, match=r"^CausalLM.generate\(num_beams=2, num_return_sequences=3\): the search "):
        lm.generate(ids, 2, num_beams=2, num_return_sequences=3)


# ---- the cache: reordered rows continue as those rows' own sequences ---------------------------------------------

def test_reordered_cache_steps_equal_the_whole_forward_of_the_reordered_rows(llama_dir: Path) -> None:  # noqa: F811
    decoder = _ours(llama_dir)
    ids, mask = _left_padded([5, 3, 6], seed=4)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    expand, permute = torch.tensor([2, 0, 0, 1]), torch.tensor([3, 1, 2, 0])  # to 4 rows, then among them
    rows = expand[permute]
    more = torch.randint(1, VOCAB, (4, 2), generator=torch.Generator().manual_seed(5))
    full_ids = torch.cat([ids[rows], more], 1)
    full_mask = torch.cat([mask[rows], torch.ones_like(more)], 1)
    full_positions = torch.cat([positions[rows], positions[rows, -1:] + torch.arange(1, 3)], 1)  # (4, 8)
    with torch.no_grad():
        want = decoder(full_ids, full_mask, full_positions)[:, -2:]  # (4, 2, V)
        cache = KVCache(8)
        decoder(ids, mask, positions, kv_cache=cache)  # 3 prompts
        cache.reorder(expand)  # a new batch of 4 rows
        first = decoder(more[permute.argsort(), :1], full_mask[permute.argsort(), :7],
                        full_positions[permute.argsort(), 6:7], kv_cache=cache)  # in the expanded order
        cache.reorder(permute)  # in place: the same 4 rows, permuted
        second = decoder(more[:, 1:], full_mask, full_positions[:, 7:], kv_cache=cache)
    torch.testing.assert_close(first[permute], want[:, :1], rtol=0, atol=1e-10)
    torch.testing.assert_close(second, want[:, 1:], rtol=0, atol=1e-10)
    assert all(layer.keys.shape[0] == 4 and layer.length == 8 for layer in cache.layers)


# ---- routed beams: each prompt's beams run its adapter -----------------------------------------------------------

@pytest.mark.parametrize("use_cache", [True, False])
def test_routed_beams_equal_each_prompt_alone_with_its_adapter(use_cache: bool) -> None:
    torch.manual_seed(0)
    decoder = TransformerDecoder(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                                 max_position_embeddings=40).double().eval()
    inject_lora(decoder, rank=2, alpha=4, target_modules=["q_proj", "v_proj", "o_proj", "lm_head"], adapter_name="a")
    add_adapter(decoder, "b", rank=3, alpha=3, target_modules=["q_proj", "k_proj", "lm_head"])
    randomise(lora_layers(decoder))
    ids, mask = _left_padded([3, 5, 4], seed=7)
    names = ["b", None, "a"]
    options = {"max_new_tokens": 8, "num_beams": 3, "num_return_sequences": 2, "eos_token_id": [11, 40],
               "pad_token_id": 0}
    with route_adapters(decoder, names):
        routed = generate(decoder, ids, attention_mask=mask, use_cache=use_cache, **options)  # (3 * 2, L + n)
        assert lora_layers(decoder)["layers.0.attn.q_proj"].routing.names == tuple(names)  # restored after
    with disable_adapters(decoder):
        assert not torch.equal(routed, generate(decoder, ids, attention_mask=mask, **options))  # the adapters ran
    for i, name in enumerate(names):
        prompt = ids[i : i + 1, int((mask[i] == 0).sum()) :]  # alone, without padding
        if name is None:
            with disable_adapters(decoder):
                alone = generate(decoder, prompt, use_cache=use_cache, **options)
        else:
            set_adapter(decoder, name)
            alone = generate(decoder, prompt, use_cache=use_cache, **options)
        new, width = routed[2 * i : 2 * i + 2, ids.shape[1] :], alone.shape[1] - prompt.shape[1]
        assert torch.equal(new[:, :width], alone[:, prompt.shape[1] :]), (i, name)
        assert (new[:, width:] == 0).all()  # the others ran longer: padding


# ---- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_beams": 0}, ValueError, r"^generate\(num_beams=0\): num_beams must be an integer >= 1"),
        ({"num_beams": 2.0}, TypeError, r"^generate\(num_beams=2.0\): num_beams must be an integer >= 1"),
        ({"num_beams": 2, "num_return_sequences": 3}, ValueError,
         (r"^generate\(num_beams=2, num_return_sequences=3\): the search keeps 2 hypotheses per prompt, so it returns "
          r"at most that many; raise num_beams to >= 3 or lower num_return_sequences")),
        ({"num_return_sequences": 2}, ValueError, r"^generate\(num_beams=1, num_return_sequences=2\)"),
        ({"num_beams": 2, "temperature": 0.7}, ValueError,
         (r"^generate\(num_beams=2, temperature=0.7, top_k=None, top_p=None\): beam search is deterministic "
          r"\(transformers' num_beams with do_sample=False\) and does not sample; set temperature=0")),
        ({"num_beams": 4, "temperature": 1.0, "top_k": 5, "top_p": 0.9}, ValueError,
         r"^generate\(num_beams=4, temperature=1.0, top_k=5, top_p=0.9\): beam search is deterministic"),
        ({"num_beams": 2, "early_stopping": "yes"}, ValueError,
         r"^generate\(early_stopping='yes'\): early_stopping must be True, False or 'never'"),
        ({"num_beams": 2, "length_penalty": float("nan")}, ValueError,
         r"^generate\(length_penalty=nan\): length_penalty must be a finite number"),
        ({"length_penalty": 2.0}, ValueError,
         (r"^generate\(num_beams=1, length_penalty=2.0, early_stopping=False\): length_penalty and early_stopping "
          r"rank beam hypotheses, .* set num_beams > 1")),
    ],
)
def test_beam_search_refuses(kwargs: dict, error: type, match: str) -> None:
    decoder = TransformerDecoder(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2).eval()
    with pytest.raises(error, match=match):
        generate(decoder, torch.ones(2, 4, dtype=torch.long), 3, **kwargs)
