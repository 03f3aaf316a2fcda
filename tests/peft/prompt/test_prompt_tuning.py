"""Prompt tuning (:mod:`lightning_peft.peft.prompt.prompt_tuning`) against float64 references and Hugging Face PEFT.

Tiny random BERT (classification), GPT-2 and Llama (causal LM) are built from configs and run in float64. A soft
prompt has no start that equals the base model, so the exact properties checked instead are: the base model sees
exactly ``[P; E(x)]`` with the mask, token types, positions and labels extended as documented; a prompt initialised
from a text computes exactly what the plain model computes on that text followed by the input; unloading gives
the base model back exactly; save -> load and PEFT interop give identical outputs. Prompts are rounded to float32
values before an interop comparison: PEFT keeps its prompt in float32, and such values survive that unchanged.
"""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors_bytes
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from lightning_peft.peft.adapter import adapter_state_dict, attached, merged_state_dict  # noqa: E402
from lightning_peft.peft.io import load_adapter, save_adapter  # noqa: E402
from lightning_peft.peft.lora import inject_lora  # noqa: E402
from lightning_peft.peft.prompt.prompt_tuning import (  # noqa: E402
    PROMPT_MODULE,
    PromptEmbedding,
    PromptTuningAdapter,
    inject_prompt_tuning,
    prompt_embedding,
    unload_prompt_tuning,
)
from tests._models import bert_model, gpt2_model, llama_model, seeded  # noqa: E402

# PEFT calls a transformers API that transformers deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

VOCAB = 64
POSITIONS = 32
N = 4  # virtual tokens
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]


# --------------------------------------------------------------------------------------------------- models


SPECIAL = {"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}
BUILDERS = {"bert": partial(bert_model, max_position_embeddings=POSITIONS),
            "gpt2": partial(gpt2_model, n_positions=POSITIONS, **SPECIAL),
            "llama": partial(llama_model, max_position_embeddings=POSITIONS, **SPECIAL)}
TASKS = {"bert": "SEQ_CLS", "gpt2": "CAUSAL_LM", "llama": "CAUSAL_LM"}


def _base(family: str, seed: int = 0) -> nn.Module:
    return seeded(BUILDERS[family], seed)


def _copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def _ids(length: int = 7, batch: int = 2) -> torch.Tensor:
    return torch.randint(5, VOCAB, (batch, length), generator=torch.Generator().manual_seed(7))  # (B, T)


def _mask(length: int = 7) -> torch.Tensor:
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, -2:] = 0  # padding at the end of the second row
    return mask


@torch.no_grad()
def _randomise_ours(model: nn.Module, seed: int = 1) -> None:
    """Random adapter values exactly representable in float32 (PEFT keeps its prompt in float32)."""
    generator = torch.Generator().manual_seed(seed)
    state = adapter_state_dict(model)
    for key in sorted(state):
        value = torch.randn(state[key].shape, generator=generator, dtype=torch.float32)
        state[key].copy_(value.to(state[key].dtype))


@torch.no_grad()
def _randomise_peft(model: nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _, param in sorted(model.named_parameters()):
        if param.requires_grad:
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.dtype))


def _call(model: nn.Module, family: str, **extra) -> object:
    inputs = {"input_ids": _ids(), "attention_mask": _mask()}
    if family == "bert":
        inputs["token_type_ids"] = torch.ones_like(inputs["input_ids"])
    else:
        inputs["labels"] = _ids()
    with torch.no_grad():
        return model(**inputs, **extra)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_safetensors_bytes(Path(path).read_bytes())


class _Tokenizer:
    """A stand-in tokenizer: ``tokenizer(text)["input_ids"]`` gives fixed ids."""

    name_or_path = ""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(self.ids)}


@pytest.fixture
def tokenizer_dir(tmp_path) -> Path:
    """A real BertTokenizerFast over the tiny vocabulary, saved to a directory (nothing is downloaded)."""
    directory = tmp_path / "tokenizer"
    vocab = {word: i for i, word in enumerate(WORDS)}
    transformers.BertTokenizerFast(vocab=vocab, do_lower_case=False).save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------- forward, exactly


@pytest.mark.parametrize("family", list(BUILDERS))
def test_output_equals_float64_reference_that_concatenates_by_hand(family):
    base = _base(family)
    model = _copy(base)
    prompt = inject_prompt_tuning(model, num_virtual_tokens=N)
    assert prompt.weight.dtype == torch.float64  # the model's dtype when wider than float32

    ids, mask = _ids(), _mask()
    embeds = torch.cat((prompt.weight.detach().expand(2, -1, -1), base.get_input_embeddings()(ids)), dim=1)
    reference = {"inputs_embeds": embeds, "attention_mask": torch.cat((torch.ones(2, N, dtype=torch.long), mask), 1)}
    if family == "bert":
        types = torch.ones_like(ids)
        reference["token_type_ids"] = torch.cat((torch.zeros(2, N, dtype=torch.long), types), dim=1)
        extra = {"token_type_ids": types}
    else:
        labels = _ids()
        reference["labels"] = torch.cat((torch.full((2, N), -100), labels), dim=1)
        extra = {"labels": labels}
    with torch.no_grad():
        expected = base(**reference)
        got = model(input_ids=ids, attention_mask=mask, **extra)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=0)
    if family != "bert":
        assert got.logits.shape == (2, N + 7, VOCAB)  # PEFT's shape: the virtual positions stay
        torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=0)
    with torch.no_grad():
        plain = base(input_ids=ids, attention_mask=mask, **extra).logits
    assert (got.logits[:, -1] - plain[:, -1]).abs().max() > 1e-3  # the prompt does change the output


def test_positional_and_keyword_calls_agree():
    model = _base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=N)
    ids, mask = _ids(), _mask()
    with torch.no_grad():
        positional = model(ids, mask).logits
        keyword = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(positional, keyword, rtol=0, atol=0)


def test_the_base_sees_the_prompt_then_the_real_tokens_unchanged():
    model = _base("gpt2")
    prompt = inject_prompt_tuning(model, num_virtual_tokens=N)
    seen = {}
    model.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)  # runs after ours
    ids, mask, labels = _ids(), _mask(), _ids()
    positions = torch.arange(7).expand(2, 7)
    types = torch.ones_like(ids)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, labels=labels, position_ids=positions, token_type_ids=types)
    assert seen.get("input_ids") is None
    embeds = seen["inputs_embeds"]  # (B, n+T, d)
    assert torch.equal(embeds[:, :N], prompt.weight.detach().expand(2, -1, -1))
    assert torch.equal(embeds[:, N:], model.get_input_embeddings()(ids))  # the real tokens' embeddings, untouched
    assert torch.equal(seen["attention_mask"], torch.cat((torch.ones(2, N, dtype=torch.long), mask), dim=1))
    assert torch.equal(seen["labels"], torch.cat((torch.full((2, N), -100), labels), dim=1))
    assert torch.equal(seen["position_ids"], torch.arange(N + 7).expand(2, -1))
    assert torch.equal(seen["token_type_ids"], torch.cat((torch.zeros(2, N, dtype=torch.long), types), dim=1))


def test_given_embeddings_get_the_prompt_too_and_sequence_labels_stay():
    base = _base("bert")
    model = _copy(base)
    prompt = inject_prompt_tuning(model, num_virtual_tokens=N)
    embeds = base.get_input_embeddings()(_ids())
    labels = torch.tensor([0, 2])
    with torch.no_grad():
        got = model(inputs_embeds=embeds, labels=labels)
        expected = base(inputs_embeds=torch.cat((prompt.weight.expand(2, -1, -1), embeds), dim=1), labels=labels)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=0)


def test_question_answering_span_labels_move_with_the_tokens():
    torch.manual_seed(0)
    base = bert_model("qa", max_position_embeddings=POSITIONS, num_labels=2).double().eval()
    model = _copy(base)
    prompt = inject_prompt_tuning(model, num_virtual_tokens=N)
    assert attached(model)["prompt_tuning"].modules_to_save == ("qa_outputs",)
    ids, start, end = _ids(), torch.tensor([1, 2]), torch.tensor([3, 5])
    with torch.no_grad():
        got = model(input_ids=ids, start_positions=start, end_positions=end)
        embeds = torch.cat((prompt.weight.expand(2, -1, -1), base.get_input_embeddings()(ids)), dim=1)
        expected = base(inputs_embeds=embeds, start_positions=start + N, end_positions=end + N)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=0)


def test_a_deep_copy_runs_its_own_prompt():
    model = _base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=N)
    before = _call(model, "bert").logits
    twin = copy.deepcopy(model)
    with torch.no_grad():
        prompt_embedding(twin).weight.add_(1.0)
    assert torch.equal(_call(model, "bert").logits, before)
    assert not torch.equal(_call(twin, "bert").logits, before)


# ------------------------------------------------------------------------------------------ initialisation


def test_text_init_equals_prepending_the_text(tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "w1 w2 w3"
    text_ids = torch.tensor(tokenizer(text)["input_ids"])  # [CLS] w1 w2 w3 [SEP]
    assert text_ids.tolist()[0] == WORDS.index("[CLS]") and len(text_ids) == 5
    for family in ("bert", "gpt2"):
        base = _base(family)
        model = _copy(base)
        inject_prompt_tuning(model, num_virtual_tokens=len(text_ids), init="text", init_text=text,
                             tokenizer=tokenizer)
        ids = _ids()
        with torch.no_grad():
            got = model(input_ids=ids).logits
            plain = base(input_ids=torch.cat((text_ids.expand(2, -1), ids), dim=1)).logits
        torch.testing.assert_close(got, plain, rtol=0, atol=0)


@pytest.mark.parametrize(("n", "expected"), [(3, [2, 6, 7]), (7, [2, 6, 7, 3, 2, 6, 7])])
def test_text_init_repeats_or_cuts_the_text_as_peft_does(tokenizer_dir, n, expected):
    model = _base("bert")
    prompt = inject_prompt_tuning(model, num_virtual_tokens=n, init="text", init_text="w1 w2",
                                  tokenizer=str(tokenizer_dir))  # a directory works as well as an object
    words = model.get_input_embeddings().weight
    assert torch.equal(prompt.weight.detach(), words[expected])
    config = attached(model)["prompt_tuning"].peft_config(model)
    assert (config["prompt_tuning_init"], config["prompt_tuning_init_text"]) == ("TEXT", "w1 w2")
    assert config["tokenizer_name_or_path"] == str(tokenizer_dir)
    peft.PromptTuningConfig(**{k: v for k, v in config.items() if k != "peft_type"})  # PEFT accepts it


def test_a_tokenizer_name_that_loads_nothing_is_named_with_the_fix(tmp_path):
    model = _base("bert")
    with pytest.raises(ValueError, match=r"inject_prompt_tuning\(tokenizer='.*no-such-tokenizer'\): no tokenizer could "
                                         r"be loaded from it \((OSError|ValueError): .*\)\. Give the model's tokenizer "
                                         r"directory, an installed model package"):
        inject_prompt_tuning(model, num_virtual_tokens=2, init="text", init_text="w1",
                             tokenizer=str(tmp_path / "no-such-tokenizer"))
    assert not attached(model)


def test_text_init_with_a_nameless_tokenizer_is_recorded_as_random_for_peft():
    model = _base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=2, init="text", init_text="x", tokenizer=_Tokenizer([9, 10]))
    torch.testing.assert_close(prompt_embedding(model).weight.detach(), model.get_input_embeddings().weight[[9, 10]])
    config = attached(model)["prompt_tuning"].peft_config(model)
    assert (config["prompt_tuning_init"], config["tokenizer_name_or_path"]) == ("RANDOM", None)


def test_vocab_init_takes_rows_of_the_vocabulary_and_random_is_standard_normal():
    model = _base("bert")
    prompt = inject_prompt_tuning(model, num_virtual_tokens=6, init="vocab")
    words = model.get_input_embeddings().weight
    for row in prompt.weight.detach():
        assert (words == row).all(dim=1).any()
    assert attached(model)["prompt_tuning"].peft_config(model)["prompt_tuning_init"] == "SAMPLE_VOCAB"
    wide = _base("bert").float()
    prompt = inject_prompt_tuning(wide, num_virtual_tokens=N)
    assert prompt.weight.dtype == torch.float32
    big = inject_prompt_tuning(_base("llama").float(), num_virtual_tokens=1000 // 16).weight.detach()
    assert abs(big.mean().item()) < 0.1 and abs(big.std().item() - 1.0) < 0.1  # N(0, 1), PEFT's RANDOM


# ------------------------------------------------------------------------------------ what trains, unload


def test_gradients_reach_only_the_prompt_and_the_saved_head():
    model = _base("bert").train()
    inject_prompt_tuning(model, num_virtual_tokens=N)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    head = {"classifier.trained_module.weight", "classifier.trained_module.bias"}
    assert trainable == {f"{PROMPT_MODULE}.weight", *head}
    model(input_ids=_ids(), attention_mask=_mask(), labels=torch.tensor([0, 2])).loss.backward()
    for name, param in model.named_parameters():
        assert (param.grad is not None) == (name in trainable), name
        if param.grad is not None:
            assert param.grad.abs().sum() > 0, name


def test_combines_with_lora_and_both_train():
    model = _base("bert")
    inject_lora(model, rank=2, target_modules=["query"])  # LoRA saves the classifier head ...
    inject_prompt_tuning(model, num_virtual_tokens=N)  # ... so the prompt's default leaves it to LoRA
    assert attached(model)["prompt_tuning"].modules_to_save == ()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {f"{PROMPT_MODULE}.weight", "classifier.trained_module.weight"} <= trainable
    assert any("lora_A" in n for n in trainable)
    model(input_ids=_ids()).logits.sum().backward()
    assert prompt_embedding(model).weight.grad is not None


def test_unload_gives_the_base_model_back_exactly():
    base = _base("bert")
    model = _copy(base)
    inject_prompt_tuning(model, num_virtual_tokens=N)
    _randomise_ours(model)
    assert unload_prompt_tuning(model) is model
    assert not attached(model) and prompt_embedding(model) is None and not model._forward_pre_hooks
    assert model.state_dict().keys() == base.state_dict().keys()
    torch.testing.assert_close(_call(model, "bert").logits, _call(base, "bert").logits, rtol=0, atol=0)


def test_checkpoint_config_rebuilds_the_same_adapter():
    model = _base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=N, init="vocab")
    adapter = attached(model)["prompt_tuning"]
    fresh = _base("bert")
    rebuilt = PromptTuningAdapter.inject(fresh, json.loads(json.dumps(adapter.config_dict())))
    assert rebuilt.config_dict() == adapter.config_dict()
    assert fresh.state_dict().keys() == model.state_dict().keys()
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(_call(fresh, "bert").logits, _call(model, "bert").logits, rtol=0, atol=0)


# ------------------------------------------------------------------------------------- save and load, PEFT


@pytest.mark.parametrize("family", list(BUILDERS))
def test_save_load_round_trip_is_exact(family, tmp_path):
    base = _base(family)
    model = _copy(base)
    inject_prompt_tuning(model, num_virtual_tokens=N)
    _randomise_ours(model)
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "PROMPT_TUNING" and config["task_type"] == TASKS[family]
    assert (config["num_virtual_tokens"], config["token_dim"], config["num_transformer_submodules"]) == (N, 16, 1)
    assert (config["num_layers"], config["num_attention_heads"]) == (2, 2)
    weights = _read_weights(tmp_path / "adapter_model.safetensors")
    head = {"base_model.classifier.weight", "base_model.classifier.bias"} if family == "bert" else set()
    assert set(weights) == {"prompt_embeddings"} | head

    loaded = load_adapter(_copy(base), tmp_path)
    ours, theirs = adapter_state_dict(model), adapter_state_dict(loaded)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    torch.testing.assert_close(_call(loaded, family).logits, _call(model, family).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_peft_loads_our_adapter_with_identical_outputs(family, tmp_path):
    base = _base(family)
    model = _copy(base)
    inject_prompt_tuning(model, num_virtual_tokens=N)
    _randomise_ours(model)
    save_adapter(model, tmp_path)
    theirs = peft.PeftModel.from_pretrained(_copy(base), tmp_path).eval()
    assert type(theirs).__name__ == {"SEQ_CLS": "PeftModelForSequenceClassification",
                                     "CAUSAL_LM": "PeftModelForCausalLM"}[TASKS[family]]
    ours_out, theirs_out = _call(model, family), _call(theirs, family)
    torch.testing.assert_close(theirs_out.logits, ours_out.logits, rtol=0, atol=0)
    if family != "bert":
        torch.testing.assert_close(theirs_out.loss, ours_out.loss, rtol=0, atol=0)
    assert (ours_out.logits[:, -1] - _call(base, family).logits[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("family", list(BUILDERS))
def test_we_load_peft_adapters_with_identical_outputs(family, tmp_path):
    base = _base(family)
    config = peft.PromptTuningConfig(task_type=TASKS[family], num_virtual_tokens=N)
    theirs = peft.get_peft_model(_copy(base), config).eval()
    _randomise_peft(theirs)
    theirs.save_pretrained(tmp_path)

    model = load_adapter(_copy(base), tmp_path)
    adapter = attached(model)["prompt_tuning"]
    assert adapter.num_virtual_tokens == N
    assert adapter.modules_to_save == (("classifier",) if family == "bert" else ())
    torch.testing.assert_close(_call(model, family).logits, _call(theirs, family).logits, rtol=0, atol=0)


def test_a_saved_module_whose_path_starts_with_model_keeps_its_full_key(tmp_path):
    # Llama's norm is at model.norm: PEFT writes base_model.model.norm.weight, which must not lose "base_model.model."
    base = _base("llama")
    model = _copy(base)
    inject_prompt_tuning(model, num_virtual_tokens=N, modules_to_save=["model.norm"])
    _randomise_ours(model)
    save_adapter(model, tmp_path)
    assert set(_read_weights(tmp_path / "adapter_model.safetensors")) == {
        "prompt_embeddings", "base_model.model.norm.weight"}
    theirs = peft.PeftModel.from_pretrained(_copy(base), tmp_path).eval()
    loaded = load_adapter(_copy(base), tmp_path)
    for other in (theirs, loaded):
        torch.testing.assert_close(_call(other, "llama").logits, _call(model, "llama").logits, rtol=0, atol=0)


def test_text_init_from_peft_and_into_an_existing_prompt(tmp_path, tokenizer_dir):
    base = _base("bert")
    config = peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=N, prompt_tuning_init="TEXT",
                                     prompt_tuning_init_text="w1 w2", tokenizer_name_or_path=str(tokenizer_dir))
    theirs = peft.get_peft_model(_copy(base), config).eval()
    theirs.save_pretrained(tmp_path)
    model = _copy(base)
    inject_prompt_tuning(model, num_virtual_tokens=N)  # an existing prompt is loaded into
    load_adapter(model, tmp_path)
    torch.testing.assert_close(_call(model, "bert").logits, _call(theirs, "bert").logits, rtol=0, atol=0)
    fresh = load_adapter(_copy(base), tmp_path)
    assert attached(fresh)["prompt_tuning"].init == {"init": "text", "init_text": "w1 w2",
                                                     "tokenizer": str(tokenizer_dir)}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_with_a_cache_equals_greedy_decoding_by_full_forwards(family):
    # Not PEFT as the oracle: PEFT 0.21.2's prompt-tuning generate() misses transformers 5's `cache` argument and
    # prepends the prompt again at every step (GPT-2 runs out of positions).
    base = _base(family)
    model = _copy(base)
    inject_prompt_tuning(model, num_virtual_tokens=N)
    _randomise_ours(model)
    ids = _ids(length=5)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "eos_token_id": None,
                "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **settings)
        plain = base.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **settings)
        sequence, scores = ids, []
        for _ in range(6):
            logits = model(input_ids=sequence).logits[:, -1]  # the whole sequence again, no cache
            scores.append(logits)
            sequence = torch.cat((sequence, logits.argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out.sequences, sequence)
    assert out.sequences.shape[1] == ids.shape[1] + 6
    torch.testing.assert_close(torch.stack(out.logits).double(), torch.stack(scores))
    assert (out.logits[0] - plain.logits[0]).abs().max() > 1e-3  # the prompt steers generation


# ------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_virtual_tokens": 0}, ValueError, r"num_virtual_tokens=0\): num_virtual_tokens must be an integer >= 1"),
        ({"num_virtual_tokens": "8"}, TypeError, r"num_virtual_tokens='8'\): num_virtual_tokens must be an integer"),
        ({"num_virtual_tokens": True}, TypeError, r"num_virtual_tokens=True\): num_virtual_tokens must be an integer"),
        ({"init": "sample"}, ValueError, r"init='sample'\): init must be one of 'random', 'vocab', 'text'"),
        ({"init": "text"}, ValueError, r"init_text=None\): give the text whose token embeddings start the prompt"),
        ({"init_text": "hello"}, ValueError, r"init_text is only read with init='text'"),
        ({"init": "text", "init_text": "hi"}, ValueError, r"init='text'\): give the model's tokenizer"),
        ({"init": "text", "init_text": "hi", "tokenizer": 5}, TypeError, r"tokenizer=int\): give a Hugging Face"),
        ({"init": "text", "init_text": "hi", "tokenizer": _Tokenizer([])}, ValueError,
         r"init_text='hi'\): the tokenizer turns the text into no tokens"),
        ({"init": "text", "init_text": "hi", "tokenizer": _Tokenizer([3, 100])}, ValueError,
         r"gives token id 100, but the model's vocabulary has 64 entries"),
        ({"modules_to_save": "classifier"}, TypeError, r"modules_to_save='classifier'\): modules_to_save must be a list"),
        ({"modules_to_save": ["head"]}, ValueError, r"\['head'\] matched no module of BertForSequenceClassification"),
        ({"num_virtual_tokens": POSITIONS}, ValueError, r"has 32 learned positions, so the prompt leaves no room"),
    ],
)
def test_inject_errors(kwargs, error, match):
    model = _base("bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        inject_prompt_tuning(model, **kwargs)
    assert not attached(model) and prompt_embedding(model) is None and not model._forward_pre_hooks
    assert model.state_dict().keys() == before.keys()  # nothing changed


def test_inject_refuses_other_models_and_a_second_prompt():
    with pytest.raises(TypeError, match=r"Linear has no get_input_embeddings\(\) returning an embedding module"):
        inject_prompt_tuning(nn.Linear(2, 2))
    model = _base("bert")
    model.config.is_encoder_decoder = True
    with pytest.raises(ValueError, match=r"BertForSequenceClassification is an encoder-decoder model"):
        inject_prompt_tuning(model)
    model = _base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=N)
    with pytest.raises(RuntimeError, match=r"already has a soft prompt \(lightning_peft_prompt\)"):
        inject_prompt_tuning(model)


def test_a_head_saved_by_lora_is_refused():
    model = _base("bert")
    inject_lora(model, rank=2, target_modules=["query"], modules_to_save=["classifier"])
    with pytest.raises(ValueError, match=r"'classifier' is already trained and saved in full by another adapter"):
        inject_prompt_tuning(model, modules_to_save=["classifier"])


def test_position_limit_at_forward_and_rotary_models_have_none():
    model = _base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=N)
    with torch.no_grad():
        model(input_ids=_ids(POSITIONS - N))  # exactly full
        with pytest.raises(ValueError, match=r"prompt longer than the position limit: 4 virtual tokens \+ 29 real "
                                             r"tokens = 33 positions, but BertForSequenceClassification has 32"):
            model(input_ids=_ids(POSITIONS - N + 1))
    llama = _base("llama")
    inject_prompt_tuning(llama, num_virtual_tokens=N)
    with torch.no_grad():
        assert llama(input_ids=_ids(POSITIONS)).logits.shape[1] == POSITIONS + N  # rotary: no table to overflow


def test_roberta_positions_start_after_the_padding_index():
    config = transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=32, max_position_embeddings=POSITIONS, pad_token_id=1)
    model = transformers.RobertaModel(config).eval()
    assert inject_prompt_tuning(model, num_virtual_tokens=N).position_limit == POSITIONS - 2
    with torch.no_grad():
        model(input_ids=_ids(POSITIONS - 2 - N))
        with pytest.raises(ValueError, match=r"but RobertaModel has 30 learned positions"):
            model(input_ids=_ids(POSITIONS - 1 - N))


def test_forward_errors():
    model = _base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=N)
    ids = _ids()
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"called with neither input_ids nor inputs_embeds; give exactly one"):
            model(attention_mask=_mask())
        with pytest.raises(ValueError, match=r"called with both input_ids and inputs_embeds"):
            model(input_ids=ids, inputs_embeds=model.get_input_embeddings()(ids))
        with pytest.raises(ValueError, match=r"got a 4-D attention_mask of shape \(2, 1, 7, 7\); the 4 positions in "
                                             r"front extend the 2-D"):
            model(input_ids=ids, attention_mask=torch.ones(2, 1, 7, 7))
        with pytest.raises(TypeError, match=r"forward takes 6 positional arguments \(input_ids, attention_mask, "):
            model(ids, None, None, None, None, None, None)
        with pytest.raises(TypeError, match=r"forward got two values for 'input_ids'"):
            model(ids, input_ids=ids)


def test_unload_and_merge_errors():
    model = _base("bert")
    with pytest.raises(RuntimeError, match=r"unload_prompt_tuning: BertForSequenceClassification has no soft prompt"):
        unload_prompt_tuning(model)
    inject_prompt_tuning(model, num_virtual_tokens=N)
    with pytest.raises(RuntimeError, match=r"PromptTuningAdapter: a prompt cannot be merged into the base "
                                           r"weights \(it is extra input embeddings"):
        attached(model)["prompt_tuning"].unload(model, merge=True)
    with pytest.raises(RuntimeError, match=r"the prompt_tuning adapter cannot be merged"):
        merged_state_dict(model)
    assert prompt_embedding(model) is not None  # nothing was undone


def test_rebuilding_from_a_checkpoint_for_another_model_is_refused():
    model = _base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=N)
    config = attached(model)["prompt_tuning"].config_dict()
    with pytest.raises(ValueError, match=r"names module 'classifier', which GPT2LMHeadModel does not have"):
        PromptTuningAdapter.inject(_base("gpt2"), config)


def _peft_dir(tmp_path: Path, **changes) -> Path:
    base = _base("bert")
    peft.get_peft_model(base, peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=N)).save_pretrained(
        tmp_path)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_virtual_tokens": None}, r"has num_virtual_tokens=None; it is not a complete prompt tuning config"),
        ({"num_transformer_submodules": 2}, r"num_transformer_submodules=2 \(an encoder-decoder prompt\)"),
        ({"token_dim": 32}, r"has token_dim=32, but BertForSequenceClassification's input embeddings are 16 wide"),
        # 2**24 rows: refused from the file's shapes before a table that size is allocated
        ({"num_virtual_tokens": 16777216}, (
            r"adapter_model\.safetensors key prompt_embeddings has shape \(4, 16\) \(size 4 along dimension 0\), "
            r"but its own config .* says num_virtual_tokens=16777216: the file's tensors disagree with its config")),
    ],
)
def test_peft_configs_we_cannot_load_are_refused(tmp_path, changes, match):
    directory = _peft_dir(tmp_path, **changes)
    model = _base("bert")
    with pytest.raises(ValueError, match=match):
        load_adapter(model, directory)
    assert not attached(model) and prompt_embedding(model) is None


def test_loading_into_a_prompt_of_another_length_is_refused(tmp_path):
    directory = _peft_dir(tmp_path)
    model = _base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=N + 1)
    with pytest.raises(ValueError, match=r"has num_virtual_tokens=4, but the model's prompt has 5"):
        load_adapter(model, directory)


def test_from_peft_refuses_another_peft_type():
    with pytest.raises(ValueError, match=r"x has peft_type='LORA', not 'PROMPT_TUNING'"):
        PromptTuningAdapter.from_peft(_base("bert"), {"peft_type": "LORA"}, "x")


def test_prompt_embedding_module():
    prompt = PromptEmbedding(torch.arange(6.0).view(3, 2), position_limit=None)
    assert prompt(2, torch.float64).shape == (2, 3, 2) and prompt(2, torch.float64).dtype == torch.float64
    assert repr(prompt) == "PromptEmbedding(num_virtual_tokens=3, dim=2)"


def test_protocol_members_training_only_matches_and_wrapped():
    model = _base("bert")
    inject_prompt_tuning(model, num_virtual_tokens=N, init="vocab")
    adapter = attached(model)["prompt_tuning"]
    # how the prompt started steers training only (the callback's settings name the init record's fields)
    assert PromptTuningAdapter.training_only == ("init", "init_text", "tokenizer")
    assert adapter.matches(adapter.config_dict())
    assert adapter.matches({"config": {"num_virtual_tokens": N, "init": {"init": "random"}}})
    assert not adapter.matches({"config": {"num_virtual_tokens": N + 1}})
    assert adapter.wrapped(model) == {}  # it wraps no base layer
