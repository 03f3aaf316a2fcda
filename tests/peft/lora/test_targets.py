"""Target selection by layer (``layers_to_transform`` / ``layers_pattern``), with Hugging Face PEFT as the oracle:
the same adapted modules on a tiny BERT, GPT-2 and Llama, the same outputs, and PEFT's files both ways."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from lightning_peft.peft import LoRAConfig, inject_lora, load_adapter, lora_layers, save_adapter
from tests._models import bert_model, gpt2_model, llama_model, seeded

pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False:UserWarning")]  # PEFT's, on GPT-2

PREFIX = "base_model.model."
BUILDERS = {
    "bert": partial(bert_model, "base", num_hidden_layers=3),
    "gpt2": partial(gpt2_model, n_layer=3),
    "llama": partial(llama_model, num_hidden_layers=3),
}
IDS = torch.tensor([[3, 9, 4, 1, 7], [2, 8, 8, 5, 6]])  # (B, T)


def _model(family: str) -> nn.Module:
    return seeded(BUILDERS[family])


def _out(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=IDS)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _peft_targets(model: nn.Module) -> list[str]:
    return sorted(n.removeprefix(PREFIX) for n, m in model.named_modules() if isinstance(m, LoraLayer))


CASES = [
    ("bert", {"target_modules": ["query", "value"], "layers_to_transform": 1}),
    ("bert", {"target_modules": ["dense"], "layers_to_transform": [0, 2], "layers_pattern": "layer"}),
    ("gpt2", {"target_modules": ["c_attn", "c_fc"], "layers_to_transform": [2], "layers_pattern": "h"}),
    ("llama", {"target_modules": ["q_proj", "v_proj", "down_proj"], "layers_to_transform": [0, 1],
               "layers_pattern": ["blocks", "layers"]}),
    # An entry naming a module in full is adapted wherever it is (PEFT's rule): layer 0's up_proj joins layer 2's.
    ("llama", {"target_modules": ["q_proj", "model.layers.0.mlp.up_proj"], "layers_to_transform": [2]}),
]


@pytest.mark.parametrize(("family", "kwargs"), CASES)
def test_layers_to_transform_adapts_what_peft_adapts_and_the_files_round_trip(family, kwargs, tmp_path):
    peft_model = get_peft_model(_model(family), LoraConfig(r=2, lora_alpha=4, **kwargs))
    ours = _model(family)
    layers = inject_lora(ours, LoRAConfig.from_peft(peft_model.peft_config["default"]))
    assert sorted(layers) == _peft_targets(peft_model)
    assert 0 < len(layers) < len(inject_lora(_model(family), rank=2, target_modules=kwargs["target_modules"]))
    torch.manual_seed(1)
    for name, param in ours.named_parameters():
        if param.requires_grad:
            param.data.normal_(0.0, 0.3)
    peft_model.load_state_dict({f"{PREFIX}{k}": v for k, v in ours.state_dict().items()
                                if "lora_" in k}, strict=False)
    torch.testing.assert_close(_out(peft_model), _out(ours), rtol=1e-12, atol=1e-12)
    assert (_out(ours) - _out(_model(family))).abs().max() > 1e-3  # not a vacuous comparison

    save_adapter(ours, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    loaded = PeftModel.from_pretrained(_model(family), tmp_path / "ours").eval()
    assert _peft_targets(loaded) == sorted(layers)
    torch.testing.assert_close(_out(loaded), _out(ours), rtol=1e-12, atol=1e-12)
    assert written["layers_to_transform"] == (kwargs["layers_to_transform"] if isinstance(written["target_modules"], list)
                                              else None)

    peft_model.save_pretrained(tmp_path / "theirs")
    back = _model(family)
    load_adapter(back, tmp_path / "theirs")
    assert sorted(lora_layers(back)) == sorted(layers)
    torch.testing.assert_close(_out(back), _out(ours), rtol=1e-12, atol=1e-12)


def test_a_target_outside_every_layer_list_gets_no_adapter_as_in_peft_and_a_warning_says_so(tmp_path):
    kwargs = {"target_modules": ["query", "pooler.dense"], "layers_to_transform": [1], "modules_to_save": ["classifier"]}
    peft_model = get_peft_model(seeded(partial(bert_model, num_hidden_layers=3)), LoraConfig(r=2, **kwargs))
    expected = _peft_targets(peft_model)
    assert expected == ["bert.encoder.layer.1.attention.self.query"]  # PEFT drops bert.pooler.dense, silently
    warning = (r"LoRA\(layers_to_transform=\[1\]\): target_modules=\['query', 'pooler\.dense'\] lists 'pooler\.dense', "
               r"which matched only modules outside every numbered layer list \(bert\.pooler\.dense\); "
               r"layers_to_transform keeps only the modules of its layers \(as PEFT does\), so these get no adapter\. "
               r"To adapt one, name it in full \(e\.g\. 'bert\.pooler\.dense': a full name is kept wherever it is\)")
    with pytest.warns(UserWarning, match=warning) as caught:
        assert sorted(inject_lora(bert_model(num_hidden_layers=3), rank=2, **kwargs)) == expected
    assert len([w for w in caught if "numbered layer list" in str(w.message)]) == 1  # once, for every entry
    peft_model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=warning.replace(r"\['query', 'pooler\.dense'\]", r"\[.*\]")):
        # PEFT's file (target_modules saved from a set, in any order) loads as PEFT reads it, and says so too
        load_adapter(back := bert_model(num_hidden_layers=3), tmp_path)
    assert sorted(lora_layers(back)) == expected
    kwargs["target_modules"] = ["query", "bert.pooler.dense"]  # the fix the warning gives
    assert "bert.pooler.dense" in inject_lora(bert_model(num_hidden_layers=3), rank=2, **kwargs)


@pytest.mark.parametrize(("family", "kwargs", "match"), [
    ("bert", {"target_modules": ["query"], "layers_to_transform": [0, 5]},
     (r"LoRA\(layers_to_transform=\[0, 5\]\): there is no layer 5 in any layer list holding a module that "
     r"target_modules=\['query'\] matched in BertModel\. Numbered layer lists found there: 'encoder\.layer' "
     r"\(layers 0, 1, 2\)\. Give indices of layers that exist\.")),
    ("gpt2", {"target_modules": ["c_attn"], "layers_to_transform": 0, "layers_pattern": "layers"},
     (r"LoRA\(layers_to_transform=0, layers_pattern='layers'\): layers_pattern 'layers' names no layer list holding "
     r"a module that target_modules=\['c_attn'\] matched in GPT2LMHeadModel\. Numbered layer lists found there: "
     r"'transformer\.h' \(layers 0, 1, 2\)\. Give the name of the ModuleList")),
    ("llama", {"target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": ["blocks", "h"]},
     r"layers_pattern \['blocks', 'h'\] names no layer list .* found there: 'model\.layers' \(layers 0, 1, 2\)"),
])
def test_a_layer_or_pattern_that_finds_nothing_is_refused_naming_the_layers_found(family, kwargs, match):
    model = _model(family)
    with pytest.raises(ValueError, match=match):
        inject_lora(model, rank=2, **kwargs)
    assert not lora_layers(model)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"target_modules": "all-linear", "layers_to_transform": [0]}, ValueError,
     (r"LoRA\(layers_to_transform=\[0\], target_modules='all-linear'\): layers_to_transform needs target_modules as "
     r"a list of names")),
    ({"target_modules": r".*\.query", "layers_pattern": "layer"}, ValueError,
     r"layers_pattern needs target_modules as a list"),
    ({"target_modules": ["query"], "layers_pattern": "layer"}, ValueError,
     (r"LoRA\(layers_pattern='layer'\): layers_pattern only says where layers_to_transform counts layers; give "
     r"layers_to_transform too")),
    ({"target_modules": ["query"], "layers_to_transform": [0, -1]}, ValueError,
     r"LoRA\(layers_to_transform=\[0, -1\]\): layers_to_transform\[1\]=-1 must be an integer >= 0, e\.g\. \[0, 1\]\."),
    ({"target_modules": ["query"], "layers_to_transform": 0, "layers_pattern": ["layer", "h("]}, ValueError,
     r"LoRA\(layers_pattern=\['layer', 'h\('\]\): layers_pattern\[1\]='h\(' is not a valid regular expression"),
    ({"target_modules": ["query"], "layers_to_transform": "0"}, TypeError,
     r"LoRA\(layers_to_transform='0'\): layers_to_transform must be an integer >= 0"),
    ({"target_modules": ["query"], "layers_to_transform": [], "layers_pattern": None}, TypeError,
     r"LoRA\(layers_to_transform=\[\]\)"),
    ({"target_modules": ["query"], "layers_to_transform": 0, "layers_pattern": []}, ValueError,
     r"LoRA\(layers_pattern=\[\]\): give the name of the ModuleList holding the layers"),
])
def test_layer_settings_peft_refuses_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        LoRAConfig(**kwargs)


def test_peft_reads_an_empty_layer_list_as_none_given():
    config = LoRAConfig.from_peft(LoraConfig(r=2, target_modules=["query"], layers_to_transform=[]))
    assert config.layers_to_transform is None
