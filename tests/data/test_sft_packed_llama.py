"""A packed SFT batch through a Hugging Face Llama (transformers 5) equals its rows run alone: every token's loss and
the gradients, in float64, with LoRA on the attention (docs/sft.md, "Packed batches in a Hugging Face model").

transformers 5 finds the rows of a packed batch from ``position_ids`` that restart at 0, when the batch has no
``attention_mask`` and the forward no cache: ``use_cache=False`` is required (with a cache, attention silently crosses
the rows, as without ``position_ids``; both are checked here to differ).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from lightning_peft.data.sft import pack_examples
from lightning_peft.data.sft_rows import IGNORE_INDEX, Example
from lightning_peft.peft import inject_lora
from tests._models import VOCAB, llama_model, randomise

pytest.importorskip("transformers")

# (length, prompt tokens) of each row
SHAPES = [(5, 2), (9, 4), (3, 1), (7, 3)]


def _rows() -> list[Example]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length, prompt in SHAPES:
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        rows.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return rows


def _model(**config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = llama_model(**config).double().train()
    randomise(inject_lora(model, rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(T,)``: entry ``t`` the loss of predicting ``labels[t]`` from the tokens before it (0 where unlabelled)."""
    losses = F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="none")
    return torch.cat([losses.new_zeros(1), losses])


def _alone(model: torch.nn.Module, rows: list[Example]) -> torch.Tensor:
    return torch.cat([_token_losses(model(input_ids=torch.tensor([r.input_ids])).logits[0], torch.tensor(r.labels))
                      for r in rows])


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_a_packed_batch_gives_each_row_its_own_losses_and_gradients():
    model, rows = _model(), _rows()
    batch = pack_examples(rows)
    labels = batch["labels"][0]
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                use_cache=False)
    packed = _token_losses(out.logits[0], labels)
    alone = _alone(model, rows)

    assert_close(packed, alone, rtol=0, atol=1e-10)
    assert labels[batch["cu_seqlens"][:-1].long()].eq(IGNORE_INDEX).all()  # so no loss crosses a row boundary
    # transformers' own loss is the token-weighted mean over the rows, computed in float32 (it upcasts the logits)
    assert out.loss.dtype == torch.float32
    assert_close(out.loss.double(), alone.sum() / labels.ne(IGNORE_INDEX).sum(), rtol=1e-6, atol=0)
    ours, theirs = _grads(model, packed.sum()), _grads(model, _alone(model, rows).sum())
    assert ours.keys() == theirs.keys() and any("lora" in n for n in ours)
    for name in ours:
        assert_close(ours[name], theirs[name], rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("inputs", ["with a cache", "without position_ids"])
def test_attention_crosses_rows_with_a_cache_or_without_position_ids(inputs):
    model, rows = _model(), _rows()
    batch = pack_examples(rows)
    kwargs = {"position_ids": batch["position_ids"]} if inputs == "with a cache" else {"use_cache": False}
    with torch.no_grad():
        packed = _token_losses(model(input_ids=batch["input_ids"], **kwargs).logits[0], batch["labels"][0])
        alone = _alone(model, rows)
    first = SHAPES[0][0]  # the first row sees nothing before it either way; the others differ
    assert_close(packed[:first], alone[:first], rtol=0, atol=1e-10)
    assert (packed[first:] - alone[first:]).abs().max() > 1e-3


def test_eager_attention_agrees_to_its_float32_softmax():
    """transformers' eager attention computes its softmax in float32 whatever the model's dtype: packed and alone then
    agree to float32's rounding, not float64's."""
    model, rows = _model(attn_implementation="eager"), _rows()
    batch = pack_examples(rows)
    with torch.no_grad():
        packed = _token_losses(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     use_cache=False).logits[0], batch["labels"][0])
        alone = _alone(model, rows)
    assert_close(packed, alone, rtol=0, atol=1e-6)
    assert (packed - alone).abs().max() > 1e-12  # (so the tolerance is needed, and this test says why)
