"""P-tuning (:mod:`lightning_peft.peft.prompt.p_tuning`) against Hugging Face PEFT's ``P_TUNING`` as the oracle.

Tiny random BERT (sequence classification), GPT-2 and Llama (causal LM), float64. PEFT builds its prompt encoder in
float32; it is cast to float64 (``.double()``) and its values copied into ours, so the comparisons are float64 against
float64. PEFT's files hold the encoder's output only (``prompt_embeddings``): loading one gives a folded adapter.
"""

from __future__ import annotations

import copy
import json
from functools import partial

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from lightning_peft.peft import (
    PTuningAdapter,
    PTuningConfig,
    PTuningEncoder,
    adapter_state_dict,
    attached,
    fold_prompt_encoder,
    inject_p_tuning,
    inject_prompt_tuning,
    load_adapter,
    save_adapter,
    unload_p_tuning,
)
from lightning_peft.peft.adapter import technique
from lightning_peft.peft.prompt.embedding import PROMPT_MODULE
from tests._models import bert_model, gpt2_model, llama_model, seeded

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

VOCAB = 64
N = 3  # virtual tokens
HIDDEN = 5  # encoder_hidden_size
SPECIAL = {"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}
FAMILIES = {"bert": (partial(bert_model, "seq_cls"), "SEQ_CLS"), "gpt2": (partial(gpt2_model, **SPECIAL), "CAUSAL_LM"),
            "llama": (partial(llama_model, **SPECIAL), "CAUSAL_LM")}
ENCODERS = {"MLP": {}, "LSTM": {"encoder_reparameterization_type": "LSTM", "encoder_num_layers": 2}}


def base(family: str) -> nn.Module:
    return seeded(FAMILIES[family][0])


def batch(family: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))  # (B, T)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if family == "bert":
        inputs.update(token_type_ids=torch.ones_like(ids), labels=torch.tensor([0, 2]))
    else:
        inputs["labels"] = torch.randint(5, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    return inputs


def theirs_and_ours(family: str, encoder: str, **peft_only) -> tuple[nn.Module, nn.Module]:
    """PEFT's P-tuning model (float64) and ours on the same base, with PEFT's encoder (and head) values copied."""
    config = peft.PromptEncoderConfig(task_type=FAMILIES[family][1], num_virtual_tokens=N,
                                      encoder_hidden_size=HIDDEN, **{**ENCODERS[encoder], **peft_only})
    torch.manual_seed(3)
    theirs = peft.get_peft_model(base(family), config).double().eval()
    ours = base(family)
    inject_p_tuning(ours, num_virtual_tokens=N, encoder_hidden_size=HIDDEN, **ENCODERS[encoder])
    ours.eval()
    their_params = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, param in adapter_state_dict(ours).items():
            param.copy_(their_params[_their_name(name)])
    return theirs, ours


def _their_name(ours: str) -> str:
    if ours.startswith(PROMPT_MODULE):
        return "prompt_encoder.default" + ours[len(PROMPT_MODULE):]
    return "base_model." + ours.replace(".trained_module.", ".modules_to_save.default.")


def logits(model: nn.Module, family: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch(family)).logits


# ------------------------------------------------------------------------------------------ equal to PEFT


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("encoder", list(ENCODERS))
def test_outputs_equal_peft(family, encoder):
    theirs, ours = theirs_and_ours(family, encoder)
    with torch.no_grad():
        got, expected = ours(**batch(family)), theirs(**batch(family))
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=1e-10)
    assert (got.logits[:, -1] - base(family)(**batch(family)).logits[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["bert", "gpt2"])
@pytest.mark.parametrize("encoder", list(ENCODERS))
def test_one_training_step_equals_peft(family, encoder):
    theirs, ours = theirs_and_ours(family, encoder)
    their_params = {n: p for n, p in theirs.named_parameters() if p.requires_grad}
    our_params = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert sorted(_their_name(n) for n in our_params) == sorted(their_params)  # same trainable set, same names
    for model, params in ((theirs, their_params), (ours, our_params)):
        model.train()
        model(**batch(family)).loss.backward()
        torch.optim.SGD(params.values(), lr=0.5).step()
    for name, param in our_params.items():
        torch.testing.assert_close(param.grad, their_params[_their_name(name)].grad, rtol=0, atol=1e-10)
        torch.testing.assert_close(param, their_params[_their_name(name)], rtol=0, atol=1e-10)
    assert our_params[f"{PROMPT_MODULE}.mlp_head.0.weight"].grad.abs().max() > 0
    torch.testing.assert_close(logits(ours.eval(), family), logits(theirs.eval(), family), rtol=0, atol=1e-10)


def test_the_prompt_is_the_encoder_output_through_the_prompt_tuning_hook():
    # One hook for both techniques: P-tuning equals prompt tuning whose prompt is the encoder's output, bit for bit.
    ours = base("gpt2")
    encoder = inject_p_tuning(ours, num_virtual_tokens=N, encoder_hidden_size=HIDDEN)
    prompted = base("gpt2")
    inject_prompt_tuning(prompted, num_virtual_tokens=N)
    with torch.no_grad():
        getattr(prompted, PROMPT_MODULE).weight.copy_(encoder.table())
    torch.testing.assert_close(logits(ours, "gpt2"), logits(prompted, "gpt2"), rtol=0, atol=0)


@pytest.mark.parametrize("encoder", list(ENCODERS))
def test_generate_equals_greedy_decoding_by_full_forwards(encoder):
    _, ours = theirs_and_ours("gpt2", encoder)
    ids = batch("gpt2")["input_ids"][:, :4]
    settings = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        out = ours.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **settings)
        sequence = ids
        for _ in range(5):
            sequence = torch.cat((sequence, ours(input_ids=sequence).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, sequence)


# ------------------------------------------------------------------------------------------------ files


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("encoder", list(ENCODERS))
def test_peft_loads_our_adapter_with_identical_outputs(family, encoder, tmp_path):
    _, ours = theirs_and_ours(family, encoder)
    save_adapter(ours, tmp_path)
    fresh = base(family)  # built in float32, as the others
    torch.set_default_dtype(torch.float64)  # PEFT builds its prompt encoder in the default dtype, then loads into it
    try:
        loaded = peft.PeftModel.from_pretrained(fresh, tmp_path).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    torch.testing.assert_close(logits(loaded, family), logits(ours, family), rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("encoder", list(ENCODERS))
def test_we_load_peft_adapters_with_identical_outputs(family, encoder, tmp_path):
    theirs, _ = theirs_and_ours(family, encoder)
    theirs.save_pretrained(tmp_path)
    ours = load_adapter(base(family), tmp_path)
    adapter = attached(ours)["p_tuning"]
    assert adapter.folded and getattr(ours, PROMPT_MODULE).mlp_head is None  # the file holds the output only
    assert adapter.config.encoder_reparameterization_type == encoder
    assert adapter.modules_to_save == (("classifier",) if family == "bert" else ())
    torch.testing.assert_close(logits(ours, family), logits(theirs, family), rtol=0, atol=1e-10)


def test_saved_files_are_peft_layout_and_hold_the_eval_prompt_in_any_mode(tmp_path):
    from safetensors.torch import load_file

    model = base("bert")
    encoder = inject_p_tuning(model, num_virtual_tokens=N, encoder_reparameterization_type="LSTM",
                              encoder_num_layers=2, encoder_dropout=0.5)
    model.train()  # the LSTM's dropout is on: the saved prompt is still the eval-mode one (no dropout draw)
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config == {
        "peft_type": "P_TUNING", "task_type": "SEQ_CLS", "base_model_name_or_path": None, "revision": None,
        "inference_mode": True, "num_virtual_tokens": N, "token_dim": 16, "num_transformer_submodules": 1,
        "num_attention_heads": 2, "num_layers": 2, "modules_to_save": ["classifier"],
        "encoder_reparameterization_type": "LSTM", "encoder_hidden_size": 16, "encoder_num_layers": 2,
        "encoder_dropout": 0.5,
    }
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert set(tensors) == {"prompt_embeddings", "base_model.classifier.weight", "base_model.classifier.bias"}
    with torch.no_grad():
        assert torch.equal(tensors["prompt_embeddings"], encoder.eval().table())
        assert not torch.equal(encoder.train().table(), tensors["prompt_embeddings"])  # dropout draws differ


def test_saving_runs_the_encoder_without_module_hooks(tmp_path):
    # Under ZeRO-3 a save computes the prompt on rank 0 alone, inside gathered parameters: a module hook there (the
    # strategy's gathering) would start a collective the other ranks never join. The forward keeps its hooks.
    _, ours = theirs_and_ours("gpt2", "LSTM")
    expected = logits(ours, "gpt2")
    encoder = getattr(ours, PROMPT_MODULE)
    calls = []
    for module in (encoder.embedding, encoder.lstm_head, encoder.mlp_head[0]):
        module.register_forward_pre_hook(lambda module, args: calls.append(type(module).__name__))
    save_adapter(ours, tmp_path)
    assert calls == []
    logits(ours, "gpt2")
    assert calls == ["Embedding", "LSTM", "Linear"]
    assert torch.equal(logits(load_adapter(base("gpt2"), tmp_path), "gpt2"), expected)


def test_round_trip_and_loading_into_a_folded_prompt(tmp_path):
    _, ours = theirs_and_ours("llama", "LSTM")
    save_adapter(ours, tmp_path)
    loaded = load_adapter(base("llama"), tmp_path)
    assert torch.equal(logits(loaded, "llama"), logits(ours, "llama"))
    again = base("llama")
    inject_p_tuning(again, num_virtual_tokens=N)
    fold_prompt_encoder(again)
    load_adapter(again, tmp_path)  # into an existing, folded prompt
    assert torch.equal(logits(again, "llama"), logits(ours, "llama"))


def test_a_peft_mlp_config_with_settings_peft_ignores_loads_as_what_ran(tmp_path):
    with pytest.warns(UserWarning, match="encoder_num_layers` is ignored"):  # PEFT warns, and ignores both
        theirs, _ = theirs_and_ours("gpt2", "MLP", encoder_num_layers=4, encoder_dropout=0.3)
    theirs.save_pretrained(tmp_path)
    ours = load_adapter(base("gpt2"), tmp_path)
    config = attached(ours)["p_tuning"].config
    assert (config.encoder_num_layers, config.encoder_dropout) == (2, 0.0)
    torch.testing.assert_close(logits(ours, "gpt2"), logits(theirs, "gpt2"), rtol=0, atol=1e-10)


# ------------------------------------------------------------------------------ checkpoints, fold, unload


def test_the_checkpoint_keeps_the_encoder_and_rebuilds_it_exactly():
    _, ours = theirs_and_ours("bert", "LSTM")
    adapter = attached(ours)["p_tuning"]
    state = {k: v.detach().clone() for k, v in adapter_state_dict(ours).items()}
    assert {f"{PROMPT_MODULE}.embedding.weight", f"{PROMPT_MODULE}.lstm_head.weight_ih_l1_reverse",
            f"{PROMPT_MODULE}.mlp_head.2.weight"} <= set(state)
    fresh = base("bert")
    rebuilt = technique("p_tuning").inject(fresh, json.loads(json.dumps(adapter.config_dict())))
    assert rebuilt.config == adapter.config and not rebuilt.folded
    fresh.load_state_dict(state, strict=False)
    assert torch.equal(logits(fresh.eval(), "bert"), logits(ours, "bert"))


@pytest.mark.parametrize("encoder", list(ENCODERS))
def test_fold_keeps_outputs_and_leaves_one_trainable_table(encoder):
    _, ours = theirs_and_ours("gpt2", encoder)
    before = logits(ours, "gpt2")
    table = fold_prompt_encoder(ours)
    assert torch.equal(logits(ours, "gpt2"), before)
    assert torch.equal(fold_prompt_encoder(ours), table)  # idempotent
    assert [n for n, p in ours.named_parameters() if p.requires_grad] == [f"{PROMPT_MODULE}.embedding.weight"]
    assert attached(ours)["p_tuning"].config_dict()["folded"] is True


def test_unload_gives_the_base_model_back_exactly():
    model = base("bert")
    plain = copy.deepcopy(model)
    inject_p_tuning(model, num_virtual_tokens=N)
    unload_p_tuning(model)
    assert not hasattr(model, PROMPT_MODULE) and not attached(model) and not model._forward_pre_hooks
    assert torch.equal(logits(model, "bert"), logits(plain, "bert"))
    assert model.classifier is not None and type(model.classifier) is nn.Linear  # the original head is back


def test_matches_takes_a_folded_prompt_for_its_encoder_and_dropout_as_training_only():
    adapter = PTuningAdapter(PTuningConfig(num_virtual_tokens=N), folded=False, modules_to_save=[])
    lstm = {"num_virtual_tokens": N, "encoder_reparameterization_type": "LSTM", "encoder_num_layers": 2}
    assert adapter.matches({"config": {"num_virtual_tokens": N}})
    assert not adapter.matches({"config": lstm})
    assert not adapter.matches({"config": {"num_virtual_tokens": N + 1}})
    folded = PTuningAdapter(PTuningConfig(num_virtual_tokens=N), folded=True, modules_to_save=[])
    assert folded.matches({"config": lstm})
    dropped = PTuningAdapter(PTuningConfig(**lstm, encoder_dropout=0.1), folded=False, modules_to_save=[])
    assert dropped.matches({"config": lstm}) and PTuningAdapter.training_only == ("encoder_dropout",)


# ----------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"num_virtual_tokens": 0}, ValueError, r"PTuning\(num_virtual_tokens=0\)"),
    ({"encoder_reparameterization_type": "GRU"}, ValueError, r"must be one of 'MLP', 'LSTM'"),
    ({"encoder_num_layers": 3}, ValueError, r"the MLP encoder has exactly 2 hidden layers and no dropout"),
    ({"encoder_dropout": 0.1}, ValueError, r"the MLP encoder has exactly 2 hidden layers"),
    ({"encoder_reparameterization_type": "LSTM", "encoder_num_layers": 1, "encoder_dropout": 0.1}, ValueError,
     r"PTuning\(encoder_num_layers=1, encoder_dropout=0.1\): the LSTM applies dropout between its layers"),
    ({"encoder_hidden_size": 2.5}, TypeError, r"PTuning\(encoder_hidden_size=2.5\)"),
    ({"encoder_dropout": 1.0, "encoder_reparameterization_type": "LSTM"}, ValueError, r"encoder_dropout=1.0"),
    ({"token_dim": 8}, ValueError, r"inject_p_tuning\(token_dim=8\): BertForSequenceClassification's input embed"),
    ({"num_virtual_tokens": 40}, ValueError, r"has 32 learned positions"),
    ({"rank": 4}, TypeError, r"inject_p_tuning: unknown argument 'rank'"),
])
def test_bad_settings_are_refused_and_the_model_is_unchanged(kwargs, error, match):
    model = base("bert")
    with pytest.raises(error, match=match):
        inject_p_tuning(model, **kwargs)
    assert not hasattr(model, PROMPT_MODULE) and not attached(model)


def test_one_soft_prompt_per_model_and_encoder_decoder_models_are_refused():
    model = base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=N)
    with pytest.raises(RuntimeError, match=r"already has a soft prompt \(lightning_peft_prompt\); P-tuning was "
                                           "injected twice"):
        inject_p_tuning(model, num_virtual_tokens=N)
    other = base("bert")
    inject_p_tuning(other, num_virtual_tokens=N)
    with pytest.raises(RuntimeError, match=r"already has a soft prompt .*prompt tuning was injected twice"):
        inject_prompt_tuning(other, num_virtual_tokens=N)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match="is an encoder-decoder model; P-tuning here supports"):
        inject_p_tuning(t5, num_virtual_tokens=N)


def test_loading_peft_output_into_a_live_encoder_is_refused(tmp_path):
    theirs, _ = theirs_and_ours("gpt2", "MLP")
    theirs.save_pretrained(tmp_path)
    model = base("gpt2")
    inject_p_tuning(model, num_virtual_tokens=N)
    before = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    with pytest.raises(RuntimeError, match=r"produced by its encoder, .* holds only a prompt .*"
                                           r"Call fold_prompt_encoder\(model\) first"):
        load_adapter(model, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in adapter_state_dict(model).items())
    fold_prompt_encoder(model)
    shorter = base("gpt2")
    inject_p_tuning(shorter, num_virtual_tokens=N - 1)
    fold_prompt_encoder(shorter)
    with pytest.raises(ValueError, match=f"has num_virtual_tokens={N}, but the model's prompt has {N - 1}"):
        load_adapter(shorter, tmp_path)


@pytest.mark.parametrize(("changes", "error", "match"), [
    ({"num_transformer_submodules": 2}, ValueError, "num_transformer_submodules=2 \\(an encoder-decoder prompt\\)"),
    ({"token_dim": 8}, ValueError, "has token_dim=8, but GPT2LMHeadModel's input embeddings are 16 wide"),
    ({"encoder_reparameterization_type": "GRU"}, ValueError, "holds a value P-tuning refuses"),
])
def test_peft_configs_we_cannot_load_are_refused(tmp_path, changes, error, match):
    theirs, _ = theirs_and_ours("gpt2", "MLP")
    theirs.save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    model = base("gpt2")
    with pytest.raises(error, match=match):
        load_adapter(model, tmp_path)
    assert not hasattr(model, PROMPT_MODULE) and not attached(model)


def test_merge_fold_and_unload_refusals():
    model = base("gpt2")
    for call, name in ((fold_prompt_encoder, "fold_prompt_encoder"), (unload_p_tuning, "unload_p_tuning")):
        with pytest.raises(RuntimeError, match=f"{name}: GPT2LMHeadModel has no P-tuning adapter; call "
                                               "inject_p_tuning"):
            call(model)
    inject_p_tuning(model, num_virtual_tokens=N)
    with pytest.raises(RuntimeError, match="PTuningAdapter: a prompt cannot be merged"):
        attached(model)["p_tuning"].unload(model, merge=True)
    with pytest.raises(ValueError, match="PTuning: prompt longer than the position limit"):
        model(input_ids=torch.zeros(1, 32, dtype=torch.long))


def test_from_peft_translates_an_object_and_refuses_another_type():
    config = PTuningConfig.from_peft(peft.PromptEncoderConfig(num_virtual_tokens=N, encoder_hidden_size=HIDDEN,
                                                              encoder_reparameterization_type="LSTM"))
    assert config == PTuningConfig(num_virtual_tokens=N, encoder_reparameterization_type="LSTM",
                                   encoder_hidden_size=HIDDEN)
    assert isinstance(PTuningEncoder(N, 4, config, None).lstm_head, nn.LSTM)
    with pytest.raises(ValueError, match="has peft_type='PROMPT_TUNING', not 'P_TUNING'"):
        PTuningConfig.from_peft({"peft_type": "PROMPT_TUNING", "num_virtual_tokens": N})
