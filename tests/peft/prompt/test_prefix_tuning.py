"""Prefix tuning (:mod:`lightning_peft.peft.prompt.prefix_tuning`) against a float64 hand-built cache and Hugging Face PEFT.

Tiny random GPT-2 / Llama (grouped-query: 1 key/value head for 2 query heads) / BERT models are built from configs and
run in float64. The reference passes the prefix to the plain model as its attention cache, built here by slicing the
table column by column, with the attention mask extended by hand. PEFT 0.21.2 is the oracle for the file format and
for the forward pass; its sequence-classification forward and its ``generate`` do not work with transformers 5.24
(see ``docs/prefix_tuning.md``), so classification is checked against the reference and generation against a greedy
loop of full forward passes.
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

from peft import PeftModel, PrefixTuningConfig, get_peft_model  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from lightning_peft.peft.adapter import attached, technique  # noqa: E402
from lightning_peft.peft.io import load_adapter, save_adapter  # noqa: E402
from lightning_peft.peft.prompt.prefix_tuning import (  # noqa: E402
    PREFIX_ATTRIBUTE,
    PrefixTuningAdapter,
    fold_prefix_projection,
    inject_prefix_tuning,
    prefix_tuning_spec,
    unload_prefix_tuning,
)
from tests._models import bert_model, gpt2_model, llama_model, seeded  # noqa: E402

pytestmark = [
    # PEFT calls transformers APIs that transformers deprecates (and passes the cache by its old name); not ours.
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning"),
]

VOCAB = 64
N = 3  # virtual tokens


_gpt2 = partial(gpt2_model, bos_token_id=None, eos_token_id=None)
_llama = partial(llama_model, bos_token_id=None, eos_token_id=None)
FAMILIES = {"gpt2": (_gpt2, "CAUSAL_LM"), "llama": (_llama, "CAUSAL_LM"),
            "bert": (partial(bert_model, "base"), "FEATURE_EXTRACTION")}


def base(family: str) -> nn.Module:
    return seeded(FAMILIES[family][0])


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0  # left padding in the second row
    return {"input_ids": ids, "attention_mask": mask}


def output(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def geometry(model: nn.Module) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) read from the config here, independently of the module under test."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, heads, config.hidden_size // config.num_attention_heads


def reference_cache(table: torch.Tensor, model: nn.Module, batch_size: int) -> DynamicCache:
    """The prefix as a cache, column block by column block: columns are ordered (layer, key/value, head, dim)."""
    layers, heads, head_dim = geometry(model)
    width = heads * head_dim
    pairs = []
    for layer in range(layers):
        kv = []
        for which in range(2):  # 0: keys, 1: values
            block = table[:, (2 * layer + which) * width:(2 * layer + which + 1) * width]  # (n, H * d_h)
            per_head = torch.stack([block[:, h * head_dim:(h + 1) * head_dim] for h in range(heads)])  # (H, n, d_h)
            kv.append(per_head.unsqueeze(0).repeat(batch_size, 1, 1, 1))  # (B, H, n, d_h)
        pairs.append(tuple(kv))
    return DynamicCache(pairs)


def reference(plain: nn.Module, table: torch.Tensor, inputs: dict[str, torch.Tensor], **extra) -> torch.Tensor:
    """The plain model with the prefix passed by hand as its cache and ``n`` ones in front of the mask."""
    inputs = dict(inputs)
    ids = inputs["input_ids"]
    if "attention_mask" in inputs:
        mask = inputs["attention_mask"]
        inputs["attention_mask"] = torch.cat([torch.ones(mask.shape[0], table.shape[0], dtype=mask.dtype), mask], 1)
    return output(plain(**inputs, cache=reference_cache(table, plain, ids.shape[0]), **extra))


def adapted(family: str, **kwargs) -> tuple[nn.Module, nn.Module]:
    """(plain copy, model with a prefix) of the same base."""
    model = base(family)
    plain = copy.deepcopy(model)
    inject_prefix_tuning(model, num_virtual_tokens=N, **kwargs)
    return plain, model


def table_of(model: nn.Module) -> torch.Tensor:
    return getattr(model, PREFIX_ATTRIBUTE).table().detach()


# --------------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("projection", [False, True])
def test_outputs_equal_the_plain_model_with_the_prefix_as_its_cache(family, projection):
    plain, model = adapted(family, prefix_projection=projection)
    for inputs in (batch(), {"input_ids": batch()["input_ids"]}):
        ours = output(model(**inputs))
        torch.testing.assert_close(ours, reference(plain, table_of(model), inputs), rtol=0, atol=1e-12)
        assert not torch.allclose(ours, output(plain(**inputs)))  # the prefix changes the output


def test_a_classifier_gets_the_prefix_through_its_backbone():
    torch.manual_seed(0)
    model = bert_model().double().eval()
    plain = copy.deepcopy(model)
    inject_prefix_tuning(model, num_virtual_tokens=N, modules_to_save=[])
    # BertForSequenceClassification's forward takes no cache; BertModel's does, and gets the hook.
    assert len(model.bert._forward_pre_hooks) == 1 and not model._forward_pre_hooks
    inputs = {**batch(), "token_type_ids": torch.zeros(2, 5, dtype=torch.long)}
    ours = model(**inputs).logits
    torch.testing.assert_close(ours, reference(plain, table_of(model), inputs), rtol=0, atol=1e-12)


def test_explicit_position_ids_are_moved_behind_the_prefix():
    plain, model = adapted("gpt2")
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    ours = output(model(**batch(), position_ids=positions))
    torch.testing.assert_close(ours, reference(plain, table_of(model), batch(), position_ids=positions + N),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("projection", [False, True])
def test_gradients_reach_only_the_prefix_and_equal_the_reference(projection):
    plain, model = adapted("llama", prefix_projection=projection)
    model.train()
    output(model(**batch())).square().sum().backward()
    encoder = getattr(model, PREFIX_ATTRIBUTE)
    trained = {id(p) for p in encoder.parameters()}
    assert all(p.grad is None and not p.requires_grad for p in model.parameters() if id(p) not in trained)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.parameters())
    # d loss / d table, through the reference, equals the chain rule through our table
    table = table_of(model).clone().requires_grad_(True)
    reference(plain.train(), table, batch()).square().sum().backward()
    if not projection:
        torch.testing.assert_close(encoder.embedding.weight.grad, table.grad, rtol=1e-10, atol=1e-12)
    else:
        ours = torch.autograd.grad(encoder.table(), encoder.embedding.weight, table.grad)[0]
        torch.testing.assert_close(encoder.embedding.weight.grad, ours, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_fold_replaces_the_mlp_by_its_table_with_identical_outputs(family):
    _, model = adapted(family, prefix_projection=True, encoder_hidden_size=5)
    before = output(model(**batch()))
    table = fold_prefix_projection(model)
    encoder = getattr(model, PREFIX_ATTRIBUTE)
    assert encoder.transform is None and encoder.embedding.weight.requires_grad
    assert torch.equal(output(model(**batch())), before)
    assert [p.numel() for p in model.parameters() if p.requires_grad] == [table.numel()]
    assert prefix_tuning_spec(model).config_dict()["config"]["prefix_projection"] is False
    assert torch.equal(fold_prefix_projection(model), table)  # idempotent


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_equals_a_greedy_loop_of_full_forward_passes(family):
    _, model = adapted(family)
    ids = batch()["input_ids"]
    expected = ids
    for _ in range(4):
        step = output(model(input_ids=expected))[:, -1].argmax(-1, keepdim=True)
        expected = torch.cat([expected, step], dim=1)
    generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, expected)


def test_unload_gives_the_plain_model_back():
    torch.manual_seed(0)
    model = bert_model().double().eval()
    plain = copy.deepcopy(model)
    inject_prefix_tuning(model, num_virtual_tokens=N)
    assert unload_prefix_tuning(model) is model
    assert not hasattr(model, PREFIX_ATTRIBUTE) and not attached(model) and not model.bert._forward_pre_hooks
    assert torch.equal(model(**batch()).logits, plain(**batch()).logits)
    assert model.state_dict().keys() == plain.state_dict().keys()


def test_the_checkpoint_config_rebuilds_the_same_adapter_on_a_fresh_model():
    _, model = adapted("gpt2", prefix_projection=True, encoder_hidden_size=5)
    spec = prefix_tuning_spec(model)
    fresh = base("gpt2")
    rebuilt = technique(spec.kind).inject(fresh, json.loads(json.dumps(spec.config_dict())))
    assert {k: v.shape for k, v in rebuilt.state(fresh).items()} == {k: v.shape for k, v in spec.state(model).items()}
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(output(fresh(**batch())), output(model(**batch())))


def test_the_task_head_is_trained_and_saved_by_default():
    torch.manual_seed(0)
    model = bert_model()
    encoder = inject_prefix_tuning(model, num_virtual_tokens=N)
    spec = prefix_tuning_spec(model)
    assert spec.modules_to_save == ("classifier",)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"classifier.trained_module.weight", "classifier.trained_module.bias",
                         f"{PREFIX_ATTRIBUTE}.embedding.weight"}
    assert set(spec.peft_state(model)) == {"prompt_embeddings", "base_model.classifier.weight",
                                           "base_model.classifier.bias"}
    assert spec.peft_state(model)["prompt_embeddings"] is encoder.embedding.weight


# --------------------------------------------------------------------------------------------------- files


def peft_model(family: str, projection: bool) -> nn.Module:
    config = PrefixTuningConfig(task_type=FAMILIES[family][1], num_virtual_tokens=N, prefix_projection=projection,
                                encoder_hidden_size=5 if projection else None)
    return get_peft_model(base(family), config).double().eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("projection", [False, True])
def test_peft_loads_our_adapter_with_identical_outputs(family, projection, tmp_path):
    _, model = adapted(family, prefix_projection=projection)
    save_adapter(model, tmp_path)
    fresh = base(family)
    torch.set_default_dtype(torch.float64)  # PEFT builds its prompt encoder in the default dtype, then loads into it
    try:
        theirs = PeftModel.from_pretrained(fresh, tmp_path).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    torch.testing.assert_close(output(theirs(**batch())), output(model(**batch())), rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("projection", [False, True])
def test_we_load_peft_adapter_with_identical_outputs(family, projection, tmp_path):
    theirs = peft_model(family, projection)
    theirs.save_pretrained(tmp_path)
    ours = load_adapter(base(family), tmp_path)
    assert getattr(ours, PREFIX_ATTRIBUTE).transform is None  # the file holds the folded table
    torch.testing.assert_close(output(ours(**batch())), output(theirs(**batch())), rtol=0, atol=1e-12)


@pytest.mark.parametrize("projection", [False, True])
def test_save_load_round_trip(projection, tmp_path):
    _, model = adapted("llama", prefix_projection=projection)
    save_adapter(model, tmp_path)
    loaded = load_adapter(base("llama"), tmp_path)
    assert torch.equal(output(loaded(**batch())), output(model(**batch())))
    assert torch.equal(table_of(loaded), table_of(model))


def test_saved_files_are_in_peft_layout(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = bert_model()
    inject_prefix_tuning(model, num_virtual_tokens=N, prefix_projection=True, encoder_hidden_size=5)
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config == {
        "peft_type": "PREFIX_TUNING", "task_type": "SEQ_CLS", "base_model_name_or_path": None, "revision": None,
        "inference_mode": True, "num_virtual_tokens": N, "token_dim": 16, "num_transformer_submodules": 1,
        "num_attention_heads": 2, "num_layers": 2, "encoder_hidden_size": 5, "prefix_projection": True,
        "init_weights": None, "modules_to_save": ["classifier"],
    }
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as handle:  # the base it was trained on
        recorded = json.loads(handle.metadata()["lightning_peft"])  # (test_base_identity.py): no wrapped layer,
    assert recorded == {"base_model": {"architecture": "BertForSequenceClassification", "model_type": "bert"}}
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert set(tensors) == {"prompt_embeddings", "base_model.classifier.weight", "base_model.classifier.bias"}
    assert torch.equal(tensors["prompt_embeddings"], table_of(model))
    assert torch.equal(tensors["base_model.classifier.weight"], model.classifier.trained_module.weight.detach())


def test_peft_reads_our_classifier_adapter_and_its_own_classifier_forward_fails(tmp_path):
    torch.manual_seed(0)
    model = bert_model().double().eval()
    inject_prefix_tuning(model, num_virtual_tokens=N)
    with torch.no_grad():
        model.classifier.trained_module.weight.normal_()
    save_adapter(model, tmp_path)
    torch.manual_seed(0)
    theirs = PeftModel.from_pretrained(bert_model().double(), tmp_path)
    assert torch.equal(theirs.prompt_encoder["default"].embedding.weight, table_of(model))
    assert torch.equal(theirs.base_model.classifier.modules_to_save["default"].weight,
                       model.classifier.trained_module.weight)
    # PEFT 0.21.2 looks for an argument named past_key_values, which transformers 5 calls cache.
    with pytest.raises(ValueError, match="does not support past key values"):
        theirs(**batch())


def test_we_load_peft_classifier_adapter_with_the_reference_outputs(tmp_path):
    torch.manual_seed(0)
    theirs = get_peft_model(bert_model().double(), PrefixTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=N))
    with torch.no_grad():
        theirs.base_model.classifier.modules_to_save["default"].weight.normal_()
    theirs.save_pretrained(tmp_path)
    torch.manual_seed(0)
    plain = bert_model().double().eval()
    ours = load_adapter(copy.deepcopy(plain), tmp_path).eval()
    assert prefix_tuning_spec(ours).modules_to_save == ("classifier",)
    plain.classifier.load_state_dict(theirs.base_model.classifier.modules_to_save["default"].state_dict())
    table = theirs.prompt_encoder["default"].embedding.weight.detach()
    torch.testing.assert_close(ours(**batch()).logits, reference(plain, table, batch()), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"num_virtual_tokens": 0}, ValueError, r"PrefixTuning\(num_virtual_tokens=0\): num_virtual_tokens must be an "
                                            "integer >= 1"),
    ({"num_virtual_tokens": 2.5}, TypeError, r"num_virtual_tokens=2.5\): .* e.g. 20"),
    ({"prefix_projection": "yes"}, TypeError, r"PrefixTuning\(prefix_projection='yes'\): prefix_projection must be True"),
    ({"encoder_hidden_size": 8}, ValueError, "sizes the projection MLP, but prefix_projection=False has none"),
    ({"prefix_projection": True, "encoder_hidden_size": -1}, ValueError,
     r"encoder_hidden_size=-1\): encoder_hidden_size must be an integer >= 1"),
    ({"modules_to_save": "classifier"}, TypeError, r"modules_to_save='classifier'\): modules_to_save must be a list"),
    ({"modules_to_save": ["head"]}, ValueError, r"\['head'\] matched no module of BertForSequenceClassification"),
])
def test_bad_arguments_are_refused_and_the_model_is_unchanged(kwargs, error, match):
    model = bert_model()
    names = [n for n, _ in model.named_modules()]
    with pytest.raises(error, match=match):
        inject_prefix_tuning(model, **kwargs)
    assert [n for n, _ in model.named_modules()] == names and not attached(model)


class NoCache(nn.Module):
    def forward(self, input_ids):
        return input_ids


def test_a_model_without_an_attention_cache_input_is_refused_by_class():
    with pytest.raises(TypeError, match=r"the forward of NoCache takes no attention cache \(an argument cache or "
                                        r"past_key_values\)"):
        inject_prefix_tuning(NoCache())
    model = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=32))
    with pytest.raises(TypeError, match="DistilBertForSequenceClassification nor that of its backbone 'distilbert' "
                                        r"\(DistilBertModel\) takes no attention cache"):
        inject_prefix_tuning(model)


def test_encoder_decoder_models_are_refused():
    model = transformers.BartModel(transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
    with pytest.raises(TypeError, match="BartModel is an encoder-decoder model"):
        inject_prefix_tuning(model)


def test_models_with_a_special_peft_cache_are_refused():
    model = _gpt2()
    model.config.model_type = "bloom"
    with pytest.raises(TypeError, match=r"GPT2LMHeadModel \(model_type 'bloom'\) needs a special attention cache"):
        inject_prefix_tuning(model)


class CacheButNoConfig(nn.Module):
    config = object()

    def forward(self, input_ids, cache=None):
        return input_ids


def test_a_config_without_the_prefix_shape_is_refused():
    with pytest.raises(ValueError, match=r"config of CacheButNoConfig has none of \['num_hidden_layers'"):
        inject_prefix_tuning(CacheButNoConfig())


def test_a_second_injection_is_refused():
    model = _gpt2()
    inject_prefix_tuning(model, num_virtual_tokens=N)
    with pytest.raises(RuntimeError, match="GPT2LMHeadModel already has a prefix .* injected twice"):
        inject_prefix_tuning(model, num_virtual_tokens=N)


def test_gradient_checkpointing_is_refused_at_inject_and_in_training():
    model = _gpt2()
    model.activation_checkpointing_enable()
    with pytest.raises(RuntimeError, match="inject_prefix_tuning: gradient checkpointing is on in GPT2LMHeadModel"):
        inject_prefix_tuning(model)
    model.activation_checkpointing_disable()
    inject_prefix_tuning(model, num_virtual_tokens=N)
    model.activation_checkpointing_enable()
    model.train()
    with pytest.raises(RuntimeError, match="prefix tuning: gradient checkpointing is on .* drops the attention cache"):
        model(**batch())


def test_forward_errors_name_the_problem():
    _, model = adapted("gpt2")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel got a 4-D attention_mask of shape \(2, 1, 5, 8\); .* Pass "
                                         "the 2-D mask"):
        model(input_ids=batch()["input_ids"], attention_mask=torch.ones(2, 1, 5, 5 + N))
    with pytest.raises(ValueError, match="GPT2LMHeadModel was called with neither input_ids nor inputs_embeds"):
        model(attention_mask=batch()["attention_mask"])
    with pytest.raises(TypeError, match=r"GPT2LMHeadModel.forward takes 11 positional arguments "
                                        r"\(input_ids, cache, attention_mask.*\), but 12 were given"):
        model(*[None] * 12)


def test_fold_and_unload_need_a_prefix():
    with pytest.raises(RuntimeError, match="fold_prefix_projection: GPT2LMHeadModel has no prefix-tuning adapter"):
        fold_prefix_projection(_gpt2())
    with pytest.raises(RuntimeError, match="unload_prefix_tuning: GPT2LMHeadModel has no prefix-tuning adapter"):
        unload_prefix_tuning(_gpt2())


def test_unload_with_merge_is_refused():
    _, model = adapted("gpt2")
    with pytest.raises(RuntimeError, match=r"PrefixTuningAdapter: a prefix cannot be merged into the base "
                                           r"weights \(it is extra attention keys"):
        prefix_tuning_spec(model).unload(model, merge=True)
    assert prefix_tuning_spec(model) is not None


def test_a_recorded_adapter_for_another_model_is_refused():
    with pytest.raises(ValueError, match="names module 'classifier', which GPT2LMHeadModel does not have"):
        PrefixTuningAdapter.inject(_gpt2(), {"config": {"num_virtual_tokens": N}, "modules_to_save": ["classifier"]})


def test_saving_for_a_model_peft_has_no_task_type_for_is_refused(tmp_path):
    model = bert_model("masked_lm")
    inject_prefix_tuning(model, num_virtual_tokens=N)
    with pytest.raises(ValueError, match="PEFT has no task type for BertForMaskedLM, and a PeftModel without one runs "
                                         "the base model without the prefix"):
        save_adapter(model, tmp_path)


def saved_peft_adapter(tmp_path, **changes) -> None:
    peft_model("gpt2", False).save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_loading_into_a_prefix_with_a_projection_mlp_is_refused(tmp_path):
    saved_peft_adapter(tmp_path)
    _, model = adapted("gpt2", prefix_projection=True)
    with pytest.raises(RuntimeError, match="prefix is produced by a projection MLP, .* fold_prefix_projection"):
        load_adapter(model, tmp_path)


def test_loading_into_a_prefix_of_another_length_is_refused(tmp_path):
    saved_peft_adapter(tmp_path)
    model = base("gpt2")
    inject_prefix_tuning(model, num_virtual_tokens=N + 1)
    with pytest.raises(ValueError, match=f"num_virtual_tokens={N}, but the model's prefix has {N + 1}"):
        load_adapter(model, tmp_path)


@pytest.mark.parametrize(("changes", "match"), [
    ({"num_layers": 3}, "has num_layers=3, but GPT2LMHeadModel needs 2 .* trained for another model"),
    ({"num_attention_heads": 4}, "has num_attention_heads=4, but GPT2LMHeadModel needs 2"),
    ({"num_transformer_submodules": 2}, "num_transformer_submodules=2 .* decoder and encoder models only"),
    ({"num_virtual_tokens": None}, "num_virtual_tokens=None; it is not a complete prefix tuning config"),
])
def test_a_peft_config_that_does_not_fit_is_refused_and_the_model_is_unchanged(changes, match, tmp_path):
    saved_peft_adapter(tmp_path, **changes)
    model = base("gpt2")
    with pytest.raises(ValueError, match=match):
        load_adapter(model, tmp_path)
    assert not attached(model) and not hasattr(model, PREFIX_ATTRIBUTE)


def test_from_peft_refuses_another_peft_type():
    with pytest.raises(ValueError, match=r"x.json has peft_type='LORA', not 'PREFIX_TUNING'"):
        PrefixTuningAdapter.from_peft(_gpt2(), {"peft_type": "LORA"}, "x.json")


def test_a_head_lora_already_saves_is_left_to_lora():
    """The filter the other techniques have: a head wrapped by LoRA's modules_to_save is not wrapped twice."""
    from lightning_peft.peft import inject_lora
    from lightning_peft.peft.modules_to_save import ModulesToSave

    model = bert_model().eval()
    inject_lora(model, rank=2, target_modules=["query"])  # saves the classifier
    lora_head = model.classifier
    with pytest.raises(ValueError, match=r"PrefixTuning\(modules_to_save=\['classifier'\]\): 'classifier' is already "
                       "trained and saved in full by another adapter"):
        inject_prefix_tuning(copy.deepcopy(model), num_virtual_tokens=N, modules_to_save=["classifier"])
    inject_prefix_tuning(model, num_virtual_tokens=N)  # default: the task head, unless another adapter saves it
    assert model.classifier is lora_head and isinstance(lora_head.trained_module, nn.Linear)
    assert not isinstance(lora_head.trained_module, ModulesToSave)
    assert attached(model)["prefix_tuning"].modules_to_save == ()


def test_protocol_members_training_only_matches_and_wrapped():
    from lightning_peft.peft.prompt.prefix_tuning import PrefixTuningConfig

    model = _gpt2()
    inject_prefix_tuning(model, num_virtual_tokens=N, prefix_projection=True, encoder_hidden_size=8)
    adapter = prefix_tuning_spec(model)
    asked = {"config": PrefixTuningConfig(N, prefix_projection=True, encoder_hidden_size=8).to_dict()}
    assert PrefixTuningAdapter.training_only == () and adapter.wrapped(model) == {}
    assert adapter.matches(adapter.config_dict()) and adapter.matches(asked)
    assert not adapter.matches({"config": PrefixTuningConfig(N).to_dict()})  # the MLP is still there
    fold_prefix_projection(model)
    assert adapter.matches(asked) and adapter.matches({"config": PrefixTuningConfig(N).to_dict()})  # a table now
    assert not adapter.matches({"config": PrefixTuningConfig(N + 1).to_dict()})
