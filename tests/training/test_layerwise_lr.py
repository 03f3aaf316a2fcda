"""Layer-wise LR decay groups against the BEiT/ELECTRA rule, written out by hand, on real Hugging Face layouts."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_peft.peft import inject_lora
from lightning_peft.training import layer_depths, layerwise_lr_groups


def bert(layers=3):
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=3))


def expected_lr(name: str, lr: float, decay: float, num_layers: int) -> float:
    """The rule, by hand: layer i -> decay^(L - i), embeddings -> decay^(L + 1), the rest -> 1."""
    match = re.search(r"\.layer\.(\d+)\.", name)
    if match:
        return lr * decay ** (num_layers - int(match.group(1)))
    if ".embeddings." in name:
        return lr * decay ** (num_layers + 1)
    return lr


def test_every_bert_parameter_gets_the_rule_s_rate_and_1d_parameters_no_weight_decay():
    model = bert(layers=3)
    groups = layerwise_lr_groups(model, lr=2e-3, decay=0.8, weight_decay=0.05)
    assert set(groups[0]) == {"params", "lr", "weight_decay", "names"}
    params = dict(model.named_parameters())
    seen = []
    for group in groups:
        assert [id(p) for p in group["params"]] == [id(params[n]) for n in group["names"]]
        for name, param in zip(group["names"], group["params"]):
            assert group["lr"] == pytest.approx(expected_lr(name, 2e-3, 0.8, 3), rel=1e-12), name
            assert group["weight_decay"] == (0.0 if param.ndim == 1 else 0.05), name
        seen += group["names"]
    assert sorted(seen) == sorted(params)  # every parameter exactly once
    lrs = [g["lr"] for g in groups]
    assert lrs == sorted(lrs) and lrs[0] == pytest.approx(2e-3 * 0.8**4) and lrs[-1] == 2e-3


def test_an_sgd_step_on_the_groups_equals_the_hand_written_update_in_float64():
    model = bert(layers=2).double()
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=torch.tensor([0, 1, 2, 0])).loss.backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    torch.optim.SGD(layerwise_lr_groups(model, lr=0.1, decay=0.5)).step()
    for name, param in model.named_parameters():
        weight, grad = before[name]
        torch.testing.assert_close(param.detach(), weight - expected_lr(name, 0.1, 0.5, 2) * grad, rtol=0, atol=1e-15)


def test_after_lora_only_trainable_parameters_are_grouped_and_the_depth_counts_frozen_layers():
    model = bert(layers=3)
    inject_lora(model, rank=2, alpha=4, target_modules=["encoder.layer.2.attention.self.query"],
                modules_to_save=["classifier"])
    groups = layerwise_lr_groups(model, lr=1.0, decay=0.5)
    assert [(g["names"], g["lr"]) for g in groups] == [
        (["bert.encoder.layer.2.attention.self.query.lora_A.default.weight",
          "bert.encoder.layer.2.attention.self.query.lora_B.default.weight"], 0.5),  # layer 2 of 3: decay^(3 - 2)
        (["classifier.trained_module.weight"], 1.0),
        (["classifier.trained_module.bias"], 1.0),
    ]


def test_a_soft_prompt_gets_the_embedding_rate_and_a_prefix_the_top_rate():
    """The prompt stands in front of the input embeddings; the prefix is one table of every layer's keys and values
    (its name has "embedding" in it, which once gave it the embedding rate)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_peft.peft import inject_prefix_tuning, inject_prompt_tuning
    from lightning_peft.peft.prompt.prefix_cache import PREFIX_ATTRIBUTE
    from lightning_peft.peft.prompt.embedding import PROMPT_MODULE

    prompted = bert(layers=3)
    inject_prompt_tuning(prompted, num_virtual_tokens=2, modules_to_save=[])
    rates = {n: g["lr"] for g in layerwise_lr_groups(prompted, lr=1.0, decay=0.5) for n in g["names"]}
    assert rates == {f"{PROMPT_MODULE}.weight": 0.5 ** 4}  # the embeddings' decay^(L + 1)
    prefixed = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=3, n_head=2, n_positions=32))
    inject_prefix_tuning(prefixed, num_virtual_tokens=2, prefix_projection=True, modules_to_save=[])
    rates = {n: g["lr"] for g in layerwise_lr_groups(prefixed, lr=1.0, decay=0.5) for n in g["names"]}
    assert rates and all(n.startswith(f"{PREFIX_ATTRIBUTE}.") for n in rates) and set(rates.values()) == {1.0}
    assert f"{PREFIX_ATTRIBUTE}.embedding.weight" in rates


def test_gpt2_llama_and_t5_layouts_are_found():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, T5Config, T5Model

    gpt2, num = layer_depths(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=32, n_positions=16)))
    assert num == 2 and gpt2["transformer.wte.weight"] == gpt2["transformer.wpe.weight"] == 0
    assert gpt2["transformer.h.1.attn.c_attn.weight"] == 2 and gpt2["transformer.ln_f.weight"] == 3
    llama, num = layer_depths(LlamaForCausalLM(LlamaConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=32)))
    assert num == 3 and llama["model.embed_tokens.weight"] == 0 and llama["model.layers.0.mlp.up_proj.weight"] == 1
    assert llama["model.norm.weight"] == llama["lm_head.weight"] == 4
    t5, num = layer_depths(T5Model(T5Config(d_model=8, d_ff=16, d_kv=4, num_heads=2, num_layers=2, vocab_size=32)))
    assert num == 2 and t5["shared.weight"] == 0
    assert t5["encoder.block.1.layer.0.SelfAttention.q.weight"] == t5["decoder.block.1.layer.0.SelfAttention.q.weight"] == 2


class Staged(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(2, 4)
        self.stages = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.out = nn.Linear(4, 1)


def test_layers_given_as_regular_expressions():
    groups = layerwise_lr_groups(Staged(), lr=1.0, decay=0.5, layer_patterns=[r"^stages\.(\d+)\."],
                                 embedding_patterns=[r"^stem\."])
    assert [(g["names"][0], g["lr"]) for g in groups] == [
        ("stem.weight", 0.125), ("stem.bias", 0.125), ("stages.0.weight", 0.25), ("stages.0.bias", 0.25),
        ("stages.1.weight", 0.5), ("stages.1.bias", 0.5), ("out.weight", 1.0), ("out.bias", 1.0)]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({}, ValueError, r"layerwise_lr_groups: found no layers in Staged: no parameter name matches .*Its parameter names "
                     r"look like: stem\.weight, stem\.bias, stages\.0\.weight.*Pass layer_patterns="),
    ({"layer_patterns": [r"^stages\.(\d+)\.", r"^blocks\.(\d+)\."]}, ValueError,
     r"layerwise_lr_groups\(layer_patterns=\[.*\]\): \['\^blocks\\\\.\(\\\\d\+\)\\\\.'\] matched no parameter of Staged"),
    ({"layer_patterns": [r"^stages\.\d+\."]}, ValueError, r"a layer pattern needs exactly one group capturing the "
                                                          r"layer index.*it has 0"),
    ({"layer_patterns": [r"^stages\.(\d+"]}, ValueError, r"not a regular expression"),
    ({"layer_patterns": r"^stages\.(\d+)\."}, TypeError, r"layer_patterns must be a list of regular expressions"),
    ({"decay": 0.0}, ValueError, r"layerwise_lr_groups\(decay=0\.0\): decay must be a finite number in \(0, 1\] "
                                 r"\(ELECTRA uses 0\.8"),
    ({"decay": 1.5}, ValueError, r"decay=1\.5\): decay must be a finite number in \(0, 1\]"),
    ({"lr": 0.0}, ValueError, r"layerwise_lr_groups\(lr=0\.0\): lr must be a finite number > 0"),
    ({"weight_decay": -1.0}, ValueError, r"layerwise_lr_groups\(weight_decay=-1\.0\): weight_decay must be a finite "
                                         r"number >= 0"),
])
def test_bad_arguments_are_refused_with_what_to_do(kwargs, error, match):
    arguments = {"lr": 1.0, "decay": 0.8, **kwargs}
    with pytest.raises(error, match=match):
        layerwise_lr_groups(Staged(), **arguments)


def test_a_fully_frozen_model_is_refused():
    model = bert(layers=1).requires_grad_(False)
    with pytest.raises(ValueError, match=r"layerwise_lr_groups: no parameter of BertForSequenceClassification requires "
                                         r"gradients"):
        layerwise_lr_groups(model, lr=1.0, decay=0.8)


def test_the_split_makes_no_group_of_frozen_parameters_only():
    """Frozen parameters join a group that trains (their depth's if one does), so DeepSpeed, which drops them, never
    meets an empty group of ours; a user's group where nothing trains stays one group, as given."""
    from lightning_peft.training.layerwise_lr import split_by_depth

    model = bert(layers=2)
    inject_lora(model, rank=2, target_modules=["query"])  # freezes the base: biases train nowhere
    depths, num_layers = layer_depths(model)
    names = {id(p): n for n, p in model.named_parameters()}
    params = list(model.parameters())
    parts = split_by_depth(params, names, depths, num_layers, 0.5, 1.0, {"weight_decay": 0.01})
    assert all(any(p.requires_grad for p in group["params"]) for _, group in parts)
    assert sorted(id(p) for _, g in parts for p in g["params"]) == sorted(id(p) for p in params)  # each once
    for depth, group in parts:  # every group holds LoRA matrices of one layer (2-D: the decayed group)
        trained = [n for n, p in zip(group["names"], group["params"]) if p.requires_grad]
        assert {depths[n] for n in trained} == {depth} and group["lr"] == 0.5 ** (num_layers + 1 - depth)
    layer_0 = next(g for d, g in parts if d == 1)
    assert "bert.encoder.layer.0.attention.self.query.base_layer.weight" in layer_0["names"]  # its own depth's
    assert "bert.embeddings.word_embeddings.weight" in parts[0][1]["names"]  # no embedding group trains: the first
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias") and not p.requires_grad]
    [(depth, whole)] = split_by_depth(biases, names, depths, num_layers, 0.5, 1.0, {"weight_decay": 0.0})
    assert depth is None and whole["params"] == biases and whole["lr"] == 1.0
