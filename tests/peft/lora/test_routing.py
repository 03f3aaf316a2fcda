"""The per-sample routed path (`lightning_peft.peft.lora.routing`) at decode shapes and its per-routing plan: each
sample equals itself alone with its adapter (float64), through a key/value cache, in training, after the adapters
change, and inside generation (transformers' ``generate`` and our decoder's cached ``generate``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from lightning_peft.peft import (
    add_adapter,
    delete_adapter,
    disable_adapters,
    inject_lora,
    lora_layers,
    route_adapters,
    set_adapter,
)
from tests._models import VOCAB, llama_model, randomise

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[3, 17, 5, 40, 9], [12, 2, 33, 7, 21], [8, 8, 1, 30, 4], [5, 6, 7, 8, 9]])  # (4, 5)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _adapted(seed: int = 0) -> nn.Module:
    """A float64 tiny Llama with a and b (rank 2, alpha 4: one shared scale) and c (rank 2, alpha 1: its own scale),
    all random."""
    torch.manual_seed(seed)
    model = llama_model().double().eval()
    inject_lora(model, rank=2, alpha=4, target_modules=ATTENTION, adapter_name="a")
    add_adapter(model, "b", rank=2, alpha=4, target_modules=ATTENTION)
    add_adapter(model, "c", rank=2, alpha=1, target_modules=["q_proj", "v_proj"])
    randomise(lora_layers(model))
    return model


def _alone(model: nn.Module, ids: torch.Tensor, names: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each sample alone with its adapter (None: the base): the logits, and the adapter gradients of
    ``sum_i (i + 1) * logits_i.sum()`` (a different weight per sample, so a swapped gradient shows)."""
    outputs = []
    for i, name in enumerate(names):
        if name is None:
            with disable_adapters(model):
                out = model(ids[i : i + 1]).logits
        else:
            set_adapter(model, name)
            out = model(ids[i : i + 1]).logits
            if out.requires_grad:
                (out.sum() * (i + 1)).backward()
        outputs.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return torch.cat(outputs), grads


def _routed(model: nn.Module, ids: torch.Tensor, names: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with route_adapters(model, names):
        out = model(ids).logits
    weights = torch.arange(1, len(names) + 1, dtype=out.dtype).view(-1, 1, 1)
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def _assert_same(got: tuple, expected: tuple) -> None:
    assert_close(got[0], expected[0], rtol=1e-10, atol=1e-10)
    assert got[1].keys() == expected[1].keys()
    for name, grad in got[1].items():
        assert_close(grad, expected[1][name], rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("names", [["a", "b", "b", "a"], ["c", "a", "b", "c"], ["b", None, "a", "b"]],
                         ids=["shared-scale", "own-scales", "with-base"])
def test_mixed_batch_of_equal_ranks_trains_as_each_sample_alone(names):
    """Equal ranks: the factors are gathered from the parameters themselves; a shared scale goes into the matmul's
    alpha, different ones onto the low-rank hidden state, a sample on the base gets zero factors."""
    model = _adapted().train()
    _assert_same(_routed(model, IDS, names), _alone(model, IDS, names))


@pytest.mark.parametrize("names", [["a", "b", "b", "a"], ["c", "a", "b", "c"], ["b", None, "a", "b"]],
                         ids=["shared-scale", "own-scales", "with-base"])
def test_mixed_batch_without_autograd_equals_each_sample_alone(names):
    """Without autograd, several tokens per sample take the low-rank product in the other order (``A x^T``)."""
    model = _adapted()
    with torch.inference_mode():
        with route_adapters(model, names):
            routed = model(IDS).logits
        expected, _ = _alone(model, IDS, names)
    assert_close(routed, expected, rtol=1e-10, atol=1e-10)


def test_every_sample_on_one_adapter_is_exactly_the_single_adapter_path():
    """It used to take the gathered batched matmuls, equal only up to rounding (and slower: one copy of the factors
    per sample)."""
    model = _adapted().train()
    set_adapter(model, "b")
    single = model(IDS).logits
    single.sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    set_adapter(model, "a")
    with route_adapters(model, ["b"] * 4):
        routed = model(IDS).logits
    routed.sum().backward()
    assert torch.equal(routed, single)
    assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters() if p.grad is not None)


def test_routed_decode_steps_on_a_cache_equal_each_sample_alone():
    """One token per sample after a cached prompt (the decode step), three steps."""
    model = _adapted()
    names = ["c", "a", None, "b"]
    cache = transformers.DynamicCache()
    tokens = IDS
    with torch.no_grad(), route_adapters(model, names):
        steps = [model(IDS, cache=cache).logits]
        for _ in range(3):
            tokens = torch.cat([tokens, steps[-1][:, -1:].argmax(-1)], dim=1)
            steps.append(model(tokens[:, -1:], cache=cache).logits)
    with torch.no_grad():
        expected, _ = _alone(model, tokens, names)
    assert_close(torch.cat(steps, dim=1), expected, rtol=1e-10, atol=1e-10)


def test_the_routed_plan_follows_adapters_replaced_and_a_cast_inside_one_routing():
    """The per-routing plan holds where each sample's factors live and their scale: an adapter deleted and added
    again (another rank and alpha) and a cast must not leave it stale."""
    model = _adapted().train()
    names = ["a", "b", "c", "b"]
    with route_adapters(model, names):
        model(IDS)  # makes the plan
        delete_adapter(model, "b")
        add_adapter(model, "b", rank=2, alpha=7, target_modules=ATTENTION)
        randomise(lora_layers(model))
        routed = model(IDS).logits
    expected, _ = _alone(model, IDS, names)
    assert_close(routed.detach(), expected, rtol=1e-10, atol=1e-10)
    model.float()
    with torch.no_grad(), route_adapters(model, names):
        assert model(IDS).logits.dtype == torch.float32
        assert_close(model(IDS).logits, expected.float(), rtol=1e-4, atol=1e-4)


def test_routed_sampling_with_num_return_sequences_scores_each_sequence_with_its_adapter():
    """transformers repeats each sample num_return_sequences times for sampling too; every returned sequence's
    scores (the logits of each step) equal its own sample's adapter run on it alone."""
    model = _adapted()
    model.generation_config.eos_token_id = None
    names, repeats = ["b", None, "c"], 2
    options = {"max_new_tokens": 3, "do_sample": True, "num_return_sequences": repeats, "pad_token_id": 0,
               "output_logits": True, "return_dict_in_generate": True, "top_k": 0}
    torch.manual_seed(3)
    with route_adapters(model, names):
        out = model.generate(IDS[:3], **options)
    got = torch.stack(out.logits, dim=1)  # (3 * repeats, new, V)
    expected, _ = _alone(model, out.sequences, [n for n in names for _ in range(repeats)])
    with torch.no_grad():
        assert_close(got, expected[:, IDS.shape[1] - 1 : -1].float())  # generate returns float32 logits
    assert not torch.equal(out.sequences[::repeats], out.sequences[1::repeats])  # the repeats sampled apart


def _our_decoder():
    from lightning_peft.nn import TransformerDecoder

    torch.manual_seed(0)
    decoder = TransformerDecoder(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                                 max_position_embeddings=40).double().eval()
    inject_lora(decoder, rank=2, alpha=4, target_modules=ATTENTION + ["lm_head"], adapter_name="a")
    add_adapter(decoder, "b", rank=3, alpha=3, target_modules=["q_proj", "v_proj", "lm_head"])
    randomise(lora_layers(decoder))
    return decoder


@pytest.mark.parametrize("use_cache", [True, False])
def test_our_cached_generate_routed_gives_each_sample_its_adapter_s_tokens(use_cache):
    """Left-padded prompts, a stop token, one adapter (or the base) per sample: each row equals generating alone."""
    from lightning_peft.nn import generate

    decoder = _our_decoder()
    ids = torch.tensor([[0, 0, 5, 9, 3], [4, 1, 7, 2, 8], [0, 6, 6, 1, 2]])
    mask = (ids != 0).long()
    names = ["b", None, "a"]
    options = {"max_new_tokens": 8, "eos_token_id": 11, "pad_token_id": 0}
    with route_adapters(decoder, names):
        routed = generate(decoder, ids, attention_mask=mask, use_cache=use_cache, **options)
    for i, name in enumerate(names):
        row = ids[i : i + 1, int((mask[i] == 0).sum()) :]  # the prompt alone, without padding
        if name is None:
            with disable_adapters(decoder):
                alone = generate(decoder, row, **options)
        else:
            set_adapter(decoder, name)
            alone = generate(decoder, row, **options)
        new = routed[i, ids.shape[1] :]
        assert torch.equal(new[: alone.shape[1] - row.shape[1]], alone[0, row.shape[1] :]), (i, name)
        assert (new[alone.shape[1] - row.shape[1] :] == 0).all()  # stopped early: padding after the stop token
