"""Per-token routing of a packed batch (``route_adapters(model, names, cu_seqlens=...)``): a (1, T) sequence of rows,
each row its own adapter, gives every row the logits and every adapter the gradients of the rows run alone, on a tiny
Hugging Face Llama in float64 (rows kept apart by ``position_ids`` and ``use_cache=False``, as in
``tests/data/test_sft_packed_llama.py``); each token its row's adapter's dropout; and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from lightning_peft.peft import (
    add_adapter,
    disable_adapters,
    inject_lora,
    lora_layers,
    route_adapters,
    set_adapter,
)
from lightning_peft.peft.modules_to_save import saved_modules
from tests._models import VOCAB, llama_model

pytest.importorskip("transformers")

LENGTHS = [5, 9, 3, 7, 4]
ROUTE = ["b", None, "a", "c", "b"]  # b's rows apart, so the tokens must be sorted by adapter
CU = torch.tensor([0, 5, 14, 17, 24, 28], dtype=torch.int32)  # (N + 1,), as SFTDataModule writes it


def _model() -> nn.Module:
    """A float64 Llama with adapters of different ranks, scales and targets, ``lora_bias`` (c), an embedding adapter
    (a), an adapter no row uses (d) and a shared ``lm_head`` (modules_to_save), all random."""
    torch.manual_seed(0)
    model = llama_model(attention_bias=True, mlp_bias=True).double().train()
    inject_lora(model, rank=2, alpha=4, target_modules=["q_proj", "v_proj", "embed_tokens"], adapter_name="a",
                modules_to_save=["lm_head"])
    add_adapter(model, "b", rank=4, alpha=4, use_rslora=True, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj"])
    add_adapter(model, "c", rank=3, alpha=6, lora_bias=True, target_modules=["v_proj", "down_proj"])
    add_adapter(model, "d", rank=2, alpha=2, target_modules=["q_proj", "up_proj"])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for param in layer.adapter_parameters().values():
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
        for param in saved_modules(model)["lm_head"].trained_module.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(2))  # (1, T)


def _positions() -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)  # (1, T), restarting at every row


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _alone(model: nn.Module, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Each row run alone with its adapter: the logits (1, T, V) and the gradients of ``sum(logits * weights)``."""
    logits = []
    for i, name in enumerate(ROUTE):
        start, end = int(CU[i]), int(CU[i + 1])
        if name is None:  # the base model alone: nothing trainable takes part
            with disable_adapters(model):
                out = model(input_ids=ids[:, start:end]).logits
        else:
            set_adapter(model, name)
            out = model(input_ids=ids[:, start:end]).logits
            (out * weights[:, start:end]).sum().backward()
        logits.append(out.detach())
    set_adapter(model, "a")
    return torch.cat(logits, dim=1), _grads(model)


def test_every_row_of_a_packed_batch_gets_its_own_adapters_logits_and_gradients():
    model, ids = _model(), _ids()
    weights = torch.randn(1, sum(LENGTHS), VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected, expected_grads = _alone(model, ids, weights)

    with route_adapters(model, ROUTE, cu_seqlens=CU):
        logits = model(input_ids=ids, position_ids=_positions(), use_cache=False).logits
    (logits * weights).sum().backward()
    grads = _grads(model)

    assert_close(logits, expected, rtol=0, atol=1e-10)
    assert grads.keys() == expected_grads.keys()
    assert {n.split(".")[-2] for n in grads if "lora_A" in n} == {"a", "b", "c"}  # d: no row, no gradient
    assert any("lora_B.c.bias" in n for n in grads) and any("trained_module" in n for n in grads)
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name], rtol=0, atol=1e-10, msg=name)

    with torch.inference_mode(), route_adapters(model, ROUTE, cu_seqlens=CU):  # the in-place path
        inferred = model(input_ids=ids, position_ids=_positions(), use_cache=False).logits
    assert_close(inferred, expected, rtol=0, atol=1e-10)


def test_a_packed_batch_on_one_adapter_and_the_routing_after_it():
    model, ids = _model(), _ids()
    with torch.no_grad():
        set_adapter(model, "b")
        expected = model(input_ids=ids, position_ids=_positions(), use_cache=False).logits
        set_adapter(model, "a")
        with route_adapters(model, ["b"] * len(LENGTHS), cu_seqlens=CU):
            packed = model(input_ids=ids, position_ids=_positions(), use_cache=False).logits
            with route_adapters(model, ["b", "a"]):  # nested: a padded batch inside
                model(input_ids=ids[0, :8].view(2, 4))
            assert model.model.layers[0].self_attn.q_proj.routing.cu_seqlens == tuple(CU.tolist())  # restored
        assert model.model.layers[0].self_attn.q_proj.routing.cu_seqlens is None
    assert_close(packed, expected, rtol=0, atol=1e-10)


def test_each_token_gets_its_rows_adapters_dropout():
    """With ``A = B = I`` and scale 1, a LoRA update is the dropped-out input itself: each entry is 0 or
    ``x / (1 - p)`` for the dropout ``p`` of the token's adapter, and exactly ``x`` in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4)).double()
    inject_lora(model, rank=4, alpha=4, dropout=0.5, target_modules=["0"], adapter_name="a")
    add_adapter(model, "b", rank=4, alpha=4, dropout=0.2, target_modules=["0"])
    with torch.no_grad():
        for param in lora_layers(model)["0"].adapter_parameters().values():
            param.copy_(torch.eye(4))
    x = torch.randn(1, 400, 4, dtype=torch.float64).abs() + 0.1
    route, cu = ["a", "b", None, "a"], [0, 100, 250, 300, 400]
    with torch.no_grad(), route_adapters(model, route, cu_seqlens=cu):
        update = (model(x) - model[0].base_layer(x))[0]  # (T, 4)
        model.eval()
        assert_close((model(x) - model[0].base_layer(x))[0, :250], x[0, :250], rtol=0, atol=1e-12)
    keep = {"a": 0.5, "b": 0.8, None: None}
    for i, name in enumerate(route):
        got, inputs = update[cu[i]:cu[i + 1]], x[0, cu[i]:cu[i + 1]]
        if name is None:
            assert torch.equal(got, torch.zeros_like(got))
            continue
        kept = got != 0
        assert_close(got[kept], inputs[kept] / keep[name], rtol=1e-12, atol=0)
        assert 0.2 < kept.double().mean() < 0.95  # some entries dropped, some kept, at about 1 - p


def _linear_pair() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4))
    inject_lora(model, rank=2, target_modules=["0"], adapter_name="a")
    add_adapter(model, "b", rank=2, target_modules=["0"])
    return model


BAD_BOUNDARIES = {
    "not from 0": ([1, 3, 6], (r"route_adapters\(cu_seqlens=\[1, 3, 6\]\): the boundaries must start at 0 \(the first "
                              r"row's first token\), not at 1")),
    "not increasing": ([0, 3, 3], (r"route_adapters\(cu_seqlens=\[0, 3, 3\]\): the boundaries must increase \(every "
                                  r"packed row holds at least one token\)")),
    "one per name": ([0, 6], (r"route_adapters\(cu_seqlens=\[0, 6\]\): 2 boundaries for 2 names; a packed batch of N "
                             r"rows has N \+ 1 boundaries")),
    "floats": (torch.tensor([0.0, 3.0, 6.0]), (r"route_adapters\(cu_seqlens=\[0.0, 3.0, 6.0\]\): give the row "
                                              r"boundaries as a 1-D integer tensor \(N \+ 1,\), as SFTDataModule "
                                              r"writes them; got a 1-D torch.float32 tensor")),
}


@pytest.mark.parametrize("case", BAD_BOUNDARIES)
def test_bad_boundaries_are_refused_before_routing_starts(case):
    model = _linear_pair()
    cu, message = BAD_BOUNDARIES[case]
    with pytest.raises(ValueError, match=message), route_adapters(model, ["a", "b"], cu_seqlens=cu):
        pass
    assert model[0].routing.names is None and model[0].routing.cu_seqlens is None


def test_inputs_that_are_not_the_packed_sequence_are_refused():
    model = _linear_pair()
    with route_adapters(model, ["a", "b", None], cu_seqlens=torch.tensor([0, 3, 6, 9])):
        with pytest.raises(ValueError, match=r"route_adapters\(cu_seqlens=...\): an input of shape \(3, 3, 4\) \(a "
                                             r"batch of 3\) reached LoRALinear \(Linear\(in_features=4, .*\), but a "
                                             r"packed batch has batch size 1: its 3 rows are 9 tokens in one sequence, "
                                             r"\(1, 9, ...\)"):
            model(torch.randn(3, 3, 4))
        with pytest.raises(ValueError, match=r"route_adapters\(cu_seqlens=...\): an input of shape \(1, 8, 4\) \(8 "
                                             r"tokens\) reached LoRALinear .* but cu_seqlens ends at 9: every LoRA "
                                             r"layer must see the packed batch's 9 tokens"):
            model(torch.randn(1, 8, 4))
        flat = torch.randn(9, 4)  # tokens flattened, as a MoE router sees them: the same routing
        assert_close(model(flat), model(flat.unsqueeze(0))[0], rtol=0, atol=1e-6)


def test_a_convolution_takes_one_adapter_per_packed_batch_and_refuses_several():
    model = nn.Sequential(nn.Conv1d(4, 4, 3, padding=1))
    inject_lora(model, rank=2, target_modules=["0"], adapter_name="a")
    add_adapter(model, "b", rank=2, target_modules=["0"])
    x = torch.randn(1, 4, 6)
    with torch.no_grad():
        set_adapter(model, "b")
        expected = model(x)
        with route_adapters(model, ["b", "b"], cu_seqlens=[0, 2, 6]):
            assert_close(model(x), expected, rtol=0, atol=0)
        with route_adapters(model, ["a", "b"], cu_seqlens=[0, 2, 6]), pytest.raises(ValueError, match=(
            r"route_adapters\(cu_seqlens=...\): the packed rows go to adapters \['a', 'b'\] at LoRAConv \(Conv1d\(4, 4, "
            r".*\), whose input is not one entry per token .* leave convolutions out of the adapters' target_modules"
        )):
            model(x)


def test_dora_adapters_are_refused_in_packed_batches_as_in_padded_ones():
    model = nn.Sequential(nn.Linear(4, 4))
    inject_lora(model, rank=2, target_modules=["0"], adapter_name="a", use_dora=True)
    add_adapter(model, "b", rank=2, target_modules=["0"])
    with pytest.raises(ValueError, match=r"route_adapters: adapter 'a' is a DoRA adapter \(use_dora=True\); per-sample "
                                         r"routing of DoRA adapters is not supported"), \
            route_adapters(model, ["a", "b"], cu_seqlens=[0, 2, 6]):
        pass


def test_trainable_tokens_follow_the_rows_of_a_packed_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)).double()
    inject_lora(model, rank=2, target_modules=["1"], trainable_token_indices={"0": [1, 2]}, adapter_name="a")
    add_adapter(model, "b", rank=2, target_modules=["1"], trainable_token_indices={"0": [2, 3]})
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param))
    ids, route, cu = torch.tensor([[1, 2, 3, 2, 1, 3, 4, 2]]), ["a", "b", None], [0, 3, 6, 8]
    rows = []
    for i, name in enumerate(route):
        if name is None:
            with disable_adapters(model):
                rows.append(model(ids[:, cu[i]:cu[i + 1]]))
        else:
            set_adapter(model, name)
            rows.append(model(ids[:, cu[i]:cu[i + 1]]))
    with route_adapters(model, route, cu_seqlens=cu):
        assert_close(model(ids), torch.cat(rows, dim=1), rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match=r"route_adapters\(cu_seqlens=...\): an input of shape \(2, 4\) reached "
                                             r"the trainable tokens of Embedding\(10, 4\), but a packed batch is one "
                                             r"sequence of 8 tokens, \(1, 8\)"):
            model(ids.view(2, 4))
