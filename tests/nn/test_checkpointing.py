"""Activation checkpointing (lightning_peft.nn.checkpointing): gradients equal those without it, in float64 with
dropout on (the recomputation replays the masks), for our decoder and encoder and a Hugging Face BERT with LoRA over
frozen embeddings (where reentrant checkpointing gives zero gradients); what it selects; what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from lightning_peft.nn import (
    TokenPruner,
    TransformerBlock,
    TransformerDecoder,
    TransformerEncoder,
    apply_activation_checkpointing,
    checkpointed_modules,
    remove_activation_checkpointing,
)
from lightning_peft.nn.checkpointing import is_checkpointed
from lightning_peft.peft import inject_lora
from lightning_peft.peft.prompt.prefix_tuning import inject_prefix_tuning
from tests._models import VOCAB, bert_model, gpt2_model, llama_model, randomise

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
IDS = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(3))
MASK = torch.ones(3, 7, dtype=torch.long).index_fill_(1, torch.tensor([5, 6]), 0)  # 2 padded tokens per row


def decoder() -> nn.Module:
    torch.manual_seed(0)
    model = TransformerDecoder(vocab_size=VOCAB, hidden_size=16, num_layers=3, num_heads=2, dropout=0.2,
                               attention_dropout=0.2).double()
    randomise(inject_lora(model, rank=2, target_modules=["q_proj", "v_proj", "down_proj"], dropout=0.1))
    return model


def encoder() -> nn.Module:
    torch.manual_seed(0)
    model = TransformerEncoder(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32,
                               max_position_embeddings=16, dropout=0.2, attention_dropout=0.2).double()
    randomise(inject_lora(model, rank=2, target_modules=["q_proj", "v_proj"], dropout=0.1))
    return model


def bert() -> nn.Module:
    torch.manual_seed(0)
    model = bert_model(hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2).double()
    randomise(inject_lora(model, rank=2, target_modules=["query", "value"], dropout=0.1))
    return model


def loss_of(model: nn.Module) -> torch.Tensor:
    if isinstance(model, TransformerDecoder):
        return model(IDS, attention_mask=MASK).square().mean()
    if isinstance(model, TransformerEncoder):
        return model(IDS, attention_mask=MASK).square().mean()
    return model(input_ids=IDS, attention_mask=MASK, labels=torch.tensor([0, 1, 2])).loss


def gradients(model: nn.Module, seed: int = 5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks on both sides
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def recomputations(model: nn.Module, blocks: dict[str, nn.Module]) -> int:
    """Forward pre-hooks of the blocks' first child fire again when backward recomputes the block."""
    calls = []
    handles = [next(b.children()).register_forward_pre_hook(lambda *_: calls.append(1)) for b in blocks.values()]
    gradients(model)
    for handle in handles:
        handle.remove()
    return len(calls)


@pytest.mark.parametrize("build", [decoder, encoder, bert], ids=["decoder", "encoder", "bert"])
def test_gradients_equal_those_without_checkpointing(build):
    plain = build()
    loss, expected = gradients(plain)
    assert recomputations(plain, {"x": plain}) == 1
    model = build()
    wrapped = apply_activation_checkpointing(model)
    assert len(wrapped) == (3 if build is decoder else 2) and all(is_checkpointed(m) for m in wrapped.values())
    got_loss, got = gradients(model)
    assert got.keys() == expected.keys() and all(v.abs().sum() > 0 for v in got.values())
    assert_close(got_loss, loss, rtol=0, atol=1e-12)
    for name in expected:  # every trainable parameter: LoRA factors, the classifier, ...
        assert_close(got[name], expected[name], rtol=0, atol=1e-12, msg=name)
    assert recomputations(model, wrapped) == 2 * len(wrapped)  # each block ran again in backward
    assert set(model.state_dict()) == set(plain.state_dict())  # no wrapper module: the keys do not change
    model.eval()
    with torch.no_grad():
        assert_close(loss_of(model), loss_of(plain.eval()), rtol=0, atol=1e-12)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")
def test_reentrant_checkpointing_gives_zero_gradients_where_ours_does_not():
    """transformers issue 26221: frozen embeddings, so no block input requires grad; reentrant checkpointing
    then builds no graph through the block and the LoRA factors get no gradient."""
    from torch.utils.checkpoint import checkpoint

    model = bert()
    layer = model.bert.encoder.layer[0]
    hidden = model.bert.embeddings(IDS)
    assert not hidden.requires_grad  # frozen embeddings
    out = checkpoint(layer, hidden, use_reentrant=True)
    out = out[0] if isinstance(out, tuple) else out
    assert not out.requires_grad  # nothing to backpropagate into the adapters: they would get zero gradients
    apply_activation_checkpointing(model)
    _, got = gradients(model)
    lora = [n for n in got if "encoder.layer.0" in n and "lora_" in n]
    assert lora and all(got[n].abs().sum() > 0 for n in lora)


def test_selection_by_class_name_base_path_class_and_regex():
    names = {
        ("TransformerBlock",): ["layers.0", "layers.1", "layers.2"],
        ("lightning_peft.nn.block.TransformerBlock",): ["layers.0", "layers.1", "layers.2"],
        (TransformerBlock,): ["layers.0", "layers.1", "layers.2"],
        (r"layers\.[02]",): ["layers.0", "layers.2"],
        ("FeedForward", r"layers\.0"): ["layers.0", "layers.1.mlp", "layers.2.mlp"],  # outermost only
        ("layers",): ["layers"],  # a regex: no class is called that
    }
    for modules, expected in names.items():
        model = decoder()
        assert list(apply_activation_checkpointing(model, list(modules))) == expected, modules
        assert list(checkpointed_modules(model)) == expected
    model = bert()
    assert list(apply_activation_checkpointing(model, ["GradientCheckpointingLayer"])) == [
        "bert.encoder.layer.0", "bert.encoder.layer.1"]


def test_remove_restores_and_copies_carry_the_wrapper():
    model = decoder()
    apply_activation_checkpointing(model)
    twin = copy.deepcopy(model)
    assert twin.layers[0].forward.module is twin.layers[0]  # the copy checkpoints itself, not the original
    assert list(remove_activation_checkpointing(model)) == ["layers.0", "layers.1", "layers.2"]
    assert "forward" not in vars(model.layers[0]) and checkpointed_modules(model) == {}
    assert remove_activation_checkpointing(model) == {}
    assert recomputations(model, {"0": model.layers[0]}) == 1
    apply_activation_checkpointing(model)  # and it can be applied again


def test_a_llama_cache_made_in_training_is_dropped_not_written_twice():
    torch.manual_seed(0)
    plain = llama_model(use_cache=True).double()
    randomise(inject_lora(plain, rank=2, target_modules=["q_proj", "v_proj"]))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model)

    def grads(m):
        m.train()
        m(input_ids=IDS, labels=IDS).loss.backward()
        return {n: p.grad for n, p in m.named_parameters() if p.requires_grad}

    expected, got = grads(plain), grads(model)
    for name in expected:
        assert_close(got[name], expected[name], rtol=0, atol=1e-12, msg=name)


def test_bad_selections_name_what_was_given_and_what_the_model_has():
    with pytest.raises(ValueError, match=r"modules=\['TransfomerBlock', 'layers\\\\.9', 'TransformerBlock'\]\): "
                                         r"\['TransfomerBlock', 'layers\\\\.9'\] matched no module of "
                                         r"TransformerDecoder .* Its module classes: TransformerDecoder, Embedding, "
                                         r"ModuleList, TransformerBlock \(x3\), .*\. Blocks: layers.0, layers.1, "
                                         r"layers.2\.$"):
        apply_activation_checkpointing(decoder(), ["TransfomerBlock", r"layers\.9", "TransformerBlock"])
    with pytest.raises(ValueError, match=r"modules=None\): Sequential has no default block .* Its module classes: "
                                         r"Sequential, Linear \(x2\), ReLU\. Module names: 0, 1, 2\. Name the blocks"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"modules='TransformerBlock'\): modules must be None or a non-empty list"):
        apply_activation_checkpointing(decoder(), "TransformerBlock")
    with pytest.raises(TypeError, match=r"3 is neither a class nor a string"):
        apply_activation_checkpointing(decoder(), ["TransformerBlock", 3])
    with pytest.raises(ValueError, match=r"modules='\['\): modules is not a valid regular expression"):
        apply_activation_checkpointing(decoder(), ["["])


def test_refusals_name_the_reason_and_the_fix():
    model = decoder()
    apply_activation_checkpointing(model)
    with pytest.raises(RuntimeError, match=r"TransformerDecoder is already checkpointed \(layers.0, layers.1, "
                                           r"layers.2\); .* Call remove_activation_checkpointing\(model\) first"):
        apply_activation_checkpointing(model)
    hf = bert_model("base")
    hf.activation_checkpointing_enable()
    with pytest.raises(RuntimeError, match="transformers' own gradient checkpointing is on in BertModel; .*"
                                           r"activation_checkpointing_disable\(\)"):
        apply_activation_checkpointing(hf)
    reversible = TransformerDecoder(vocab_size=VOCAB, hidden_size=8, num_layers=2, num_heads=2, reversible=True)
    with pytest.raises(RuntimeError, match=r"layers.0 sits in a reversible stack \(the model: TransformerDecoder"):
        apply_activation_checkpointing(reversible)
    pruned = TransformerEncoder(vocab_size=VOCAB, hidden_size=8, num_layers=2, num_heads=2, ffn_size=8,
                                token_pruner=TokenPruner(0.5))
    with pytest.raises(RuntimeError, match="layers.0 is a block of the model .* prunes tokens"):
        apply_activation_checkpointing(pruned)
    pruned.token_pruner = None  # pruning installed after checkpointing: refused at the first training step
    apply_activation_checkpointing(pruned)
    pruned.token_pruner = TokenPruner(0.5)
    with pytest.raises(RuntimeError, match=r"TransformerBlock was called with between= \(token pruning\)"):
        pruned.train()(IDS[:, :4]).sum().backward()


def test_prefix_tuning_refuses_in_both_orders():
    model = gpt2_model()
    inject_prefix_tuning(model, num_virtual_tokens=2)
    with pytest.raises(RuntimeError, match=r"lightning_peft_prefix \(PrefixEncoder\) refuses activation "
                                           "checkpointing: prefix tuning passes its prefix as the attention cache"):
        apply_activation_checkpointing(model)
    assert checkpointed_modules(model) == {}  # nothing was wrapped
    model = gpt2_model()
    apply_activation_checkpointing(model)
    with pytest.raises(RuntimeError, match=r"inject_prefix_tuning: activation checkpointing is on in GPT2LMHeadModel "
                                           r"\(transformer.h.0, transformer.h.1, .*a recomputed layer would write it"):
        inject_prefix_tuning(model, num_virtual_tokens=2)


def test_a_mixture_of_experts_aux_loss_backpropagates_through_the_recomputed_blocks():
    from lightning_peft.nn import moe_aux_loss

    torch.manual_seed(0)
    plain = TransformerDecoder(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, ffn_size=16,
                               moe={"num_experts": 4, "top_k": 2}).double()
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model)
    grads = []
    for m in (plain, model):
        (m.train()(IDS).square().mean() + moe_aux_loss(m)).backward()  # the aux loss of the forward, not a recompute
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, expected in grads[0].items():
        assert_close(grads[1][name], expected, rtol=0, atol=1e-12, msg=name)


def test_dora_on_an_nf4_base_checkpointed_gives_the_gradients_of_the_plain_run():
    """LoRA's memory-efficient stack together: DoRA (its magnitude reads the dequantized NF4 weight inside the
    recomputed block) on a quantized base, checkpointed; float32, as NF4 is."""
    pytest.importorskip("torchao")

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = TransformerDecoder(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, dropout=0.2)
        randomise(inject_lora(model, rank=2, target_modules=["q_proj", "v_proj"], dropout=0.1, use_dora=True,
                              quantize="nf4"))
        return model

    plain = build()
    loss, expected = gradients(plain)
    model = build()
    assert len(apply_activation_checkpointing(model)) == 2
    assert type(model.layers[0].attn.q_proj.base_layer.weight.data).__name__ == "NF4Tensor"
    got_loss, got = gradients(model)
    assert any("lora_magnitude_vector" in n for n in got) and all(v.abs().sum() > 0 for v in got.values())
    assert_close(got_loss, loss, rtol=0, atol=0)
    for name in expected:
        assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)


def test_release_memory_trims_after_each_checkpointed_forward_on_the_cpu_and_changes_no_number(monkeypatch):
    from lightning_peft.nn import checkpointing

    real = checkpointing._malloc_trim_function()
    if real is None:
        pytest.skip("no glibc malloc_trim here")
    kept = decoder()
    apply_activation_checkpointing(kept, release_memory=False)
    _, expected = gradients(kept)
    calls = []
    monkeypatch.setattr(checkpointing, "_malloc_trim", lambda: (calls.append(1), real(0)))  # a spy: the real trim runs
    model = decoder()
    default = apply_activation_checkpointing(decoder())
    assert not any(vars(m)["forward"].release_memory for m in default.values())  # off unless asked for
    wrapped = apply_activation_checkpointing(model, release_memory=None)  # None: on where glibc has malloc_trim
    assert all(vars(m)["forward"].release_memory for m in wrapped.values())
    _, got = gradients(model)
    assert len(calls) == len(wrapped)  # once per block forward; the recomputation in backward does not trim
    for name in expected:
        assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    calls.clear()
    gradients(kept)
    with torch.no_grad():
        loss_of(model.eval())  # evaluation runs the block as is: nothing freed by a checkpoint, nothing trimmed
    assert calls == []


def test_release_memory_must_be_a_boolean_or_none():
    with pytest.raises(TypeError, match=r"apply_activation_checkpointing\(release_memory='yes'\): release_memory "
                                        "must be True, False or None"):
        apply_activation_checkpointing(decoder(), release_memory="yes")
    from lightning_peft.callbacks import ActivationCheckpointing

    with pytest.raises(TypeError, match=r"ActivationCheckpointing\(release_memory=1\)"):
        ActivationCheckpointing(release_memory=1)
