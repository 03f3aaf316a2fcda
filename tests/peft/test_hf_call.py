"""What prompt and prefix tuning share when they rewrite a Hugging Face call (peft/_hf_call.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_peft.peft._hf_call import bind, cached_length, extend_mask, given_cache, shift_positions, the_input


class Model(nn.Module):
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        return input_ids


def test_positional_arguments_are_bound_by_name():
    ids, mask = torch.zeros(1, 2), torch.ones(1, 2)
    assert bind(Model(), (ids, mask), {"inputs_embeds": None}, "X") == {
        "input_ids": ids, "attention_mask": mask, "inputs_embeds": None}
    with pytest.raises(TypeError, match=r"X: Model.forward takes 3 positional arguments \(input_ids, attention_mask, "
                                        r"inputs_embeds\), but 4 were given\. Pass the extra ones by name\."):
        bind(Model(), (ids, mask, None, None), {}, "X")
    with pytest.raises(TypeError, match=r"X: Model.forward got two values for 'input_ids'\."):
        bind(Model(), (ids,), {"input_ids": ids}, "X")


def test_exactly_one_input():
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert the_input({"input_ids": ids}, Model(), "X") is ids
    with pytest.raises(ValueError, match=r"X: Model was called with neither input_ids nor inputs_embeds"):
        the_input({}, Model(), "X")
    with pytest.raises(ValueError, match=r"X: Model was called with both input_ids and inputs_embeds"):
        the_input({"input_ids": ids, "inputs_embeds": torch.zeros(2, 3, 4)}, Model(), "X")


def test_mask_positions_and_cache_length():
    mask = torch.tensor([[1, 1, 0]])
    assert torch.equal(extend_mask(mask, 2, Model(), "X"), torch.tensor([[1, 1, 1, 1, 0]]))  # (B, n + T)
    with pytest.raises(ValueError, match=r"X: Model got a 4-D attention_mask of shape \(1, 1, 3, 3\); the 2 "
                                         r"positions in front extend the 2-D \(batch, length\) padding mask"):
        extend_mask(torch.ones(1, 1, 3, 3), 2, Model(), "X")
    positions = torch.tensor([[0, 1, 2]])
    assert torch.equal(shift_positions(positions, 2, head=False), torch.tensor([[2, 3, 4]]))
    assert torch.equal(shift_positions(positions, 2, head=True), torch.tensor([[0, 1, 2, 3, 4]]))
    legacy = ((torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4)),)  # ((k, v), ...): k (B, h, L, hd)
    assert given_cache({"cache": None, "past_key_values": legacy}) is legacy
    assert cached_length(legacy) == 5 and cached_length(None) == 0
