"""Methods called on an adapted Hugging Face model (``lightning_peft/peft/_model_methods.py``): ``save_pretrained``
writes the merged model, transformers' PEFT integration reaches lightning-peft's functions, ``generate`` under
``route_adapters`` repeats the names as it repeats the samples, PEFT's ``PeftModel`` names point to ours."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from lightning_peft.peft import (
    active_adapter,
    add_adapter,
    inject_bottleneck_adapters,
    inject_lora,
    lora_layers,
    merge_lora,
    route_adapters,
    set_adapter,
    unload_lora,
)
from tests._models import llama_model, randomise

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[3, 17, 5, 40, 9], [12, 2, 33, 7, 21]])  # (2, 5)


def _two_adapters():
    """A tiny Llama with adapters 'a' (attention) and 'b' (every linear layer), both random."""
    model = llama_model().eval()
    inject_lora(model, rank=4, target_modules=["q_proj", "v_proj"], adapter_name="a")
    add_adapter(model, "b", rank=2, target_modules="all-linear")
    randomise(lora_layers(model))
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_writes_the_merged_model_that_from_pretrained_reproduces(tmp_path, tied):
    """The class's own save_pretrained wrote base_layer / lora_A.default keys; from_pretrained re-initialised every
    adapted layer without an error (logits 9.65 off on a real model)."""
    model = llama_model(tie_word_embeddings=tied).eval()
    inject_lora(model, rank=4, target_modules="all-linear")
    randomise(lora_layers(model))
    with torch.no_grad():
        expected = model(IDS).logits
    model.save_pretrained(tmp_path, max_shard_size="10MB")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert_close(loaded(IDS).logits, expected, rtol=1e-5, atol=1e-5)
    assert not lora_layers(loaded) and lora_layers(model)  # a plain model on disk; the live one still adapted
    assert all(not layer.merged for layer in lora_layers(model).values())


def test_save_pretrained_with_a_state_dict_writes_that_and_without_adapters_is_the_class_s_again(tmp_path):
    model = llama_model().eval()
    inject_lora(model, rank=4, target_modules=["q_proj"])
    state = {k: v for k, v in llama_model().state_dict().items()}
    model.save_pretrained(tmp_path / "given", state_dict=state)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "given")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    plain = unload_lora(model)
    assert "save_pretrained" not in plain.__dict__ and "set_adapter" not in plain.__dict__


def test_save_pretrained_refuses_what_no_plain_model_reproduces(tmp_path):
    model = llama_model().eval()
    inject_bottleneck_adapters(model, target_modules=["down_proj"])
    with pytest.raises(RuntimeError, match=(
        r"LlamaForCausalLM\.save_pretrained\(\): the model carries lightning-peft's bottleneck adapter, which cannot "
        r"be folded into the base weights.*lightning_peft\.peft\.save_adapter\(model, directory\)"
    )):
        model.save_pretrained(tmp_path)
    lora = llama_model().eval()
    inject_lora(lora, rank=4, target_modules=["q_proj"])
    lora.disable_adapters()
    with pytest.raises(RuntimeError, match=r"save_pretrained\(\): the adapters are disabled.*enable_adapters\(\)"):
        lora.save_pretrained(tmp_path)
    assert not list(tmp_path.iterdir())


def test_transformers_adapter_methods_reach_lightning_peft_s(tmp_path):
    """They reached transformers' PEFT integration, which said "use a version >= 0.22.0" of PEFT."""
    model = _two_adapters()
    with torch.no_grad():
        base = unload_lora(copy.deepcopy(model), merge=False)(IDS).logits
    model.set_adapter("b")
    assert active_adapter(model) == "b" and model.active_adapters() == ["b"]
    model.set_adapter(["a"])
    assert active_adapter(model) == "a"
    with torch.no_grad():
        adapted = model(IDS).logits
        model.disable_adapters()
        assert_close(model(IDS).logits, base)  # off until enable_adapters(), as in transformers
        assert_close(model(IDS).logits, base)
        model.enable_adapters()
        assert_close(model(IDS).logits, adapted)
        with model.disable_adapters():  # or for a block, as lightning_peft.peft.disable_adapters
            assert_close(model(IDS).logits, base)
        assert_close(model(IDS).logits, adapted)
    model.delete_adapter("b")
    assert list(lora_layers(model)["model.layers.0.self_attn.q_proj"].specs) == ["a"]
    with pytest.raises(ValueError, match=r"set_adapter: no adapter named 'c'; the model has \['a'\]"):
        model.set_adapter("c")
    with pytest.raises(ValueError, match=r"set_adapter\(\): got \['a', 'b'\]; lightning-peft runs one adapter at a "
                                         r"time\. For one adapter per sample use route_adapters"):
        model.set_adapter(["a", "b"])
    with pytest.raises(RuntimeError, match=r"LlamaForCausalLM\.add_adapter\(\) is transformers' PEFT integration.*"
                                           r"lightning_peft\.peft\.add_adapter\(model, name, config\)"):
        model.add_adapter(None)
    with pytest.raises(RuntimeError, match=r"load_adapter\(\) is transformers' PEFT integration.*"
                                           r"lightning_peft\.peft\.load_adapter\(model, directory"):
        model.load_adapter(str(tmp_path))
    merge_lora(model)
    with pytest.raises(RuntimeError, match=r"disable_adapters\(\): adapter 'a' is merged into the base weights; call "
                                           r"unmerge_lora\(model\) first"):
        model.disable_adapters()


@pytest.mark.parametrize(("num_beams", "num_return_sequences"), [(2, 1), (3, 2)])
def test_routed_beam_search_equals_each_sample_alone_with_its_adapter(num_beams, num_return_sequences):
    """generate repeats each sample num_beams times in a row; the routed names used to stay one per sample, and every
    LoRA layer refused the batch."""
    model = _two_adapters()
    options = {"max_new_tokens": 4, "num_beams": num_beams, "num_return_sequences": num_return_sequences,
               "do_sample": False, "pad_token_id": 0}
    names = ["b", "a"]
    with route_adapters(model, names):
        routed = model.generate(IDS, **options)
        assert lora_layers(model)["model.layers.0.self_attn.q_proj"].routing.names == tuple(names)  # restored
    alone = []
    for i, name in enumerate(names):
        set_adapter(model, name)
        alone.append(model.generate(IDS[i:i + 1], **options))
    assert torch.equal(routed, torch.cat(alone))
    assert not torch.equal(alone[0], model.generate(IDS[:1], **options))  # 'a' (active now) writes something else



def test_beam_search_on_a_model_that_holds_the_adapters_inside_says_num_beams():
    model = llama_model().eval()
    inject_lora(model.model, rank=2, target_modules=["q_proj"], adapter_name="a")  # generate is the outer model's
    with route_adapters(model.model, ["a", None]), pytest.raises(ValueError, match=(
        r"route_adapters: a batch of 4 samples reached .* but 2 adapter names were given; .* A batch 2 times larger "
        r"is what generate\(num_beams=2\) or num_return_sequences=2 makes: call generate on the Hugging Face model "
        r"the adapters were injected into"
    )):
        model.generate(IDS, max_new_tokens=2, num_beams=2, do_sample=False, pad_token_id=0)
