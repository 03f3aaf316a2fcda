"""A quantized frozen base (QLoRA): quantize_base, inject_lora(quantize=...), merging, exports, checkpoints, errors.

The reference is the same model in float64 with the base weights replaced by their dequantized values: the quantized
layer must compute exactly that function (forward, input gradient, adapter gradients), and the merged model must
equal the quantized LoRA model.
"""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from safetensors import safe_open
from safetensors.torch import load_file
from torch.testing import assert_close

from lightning_peft.peft import (
    LoRAConfig,
    adapter_state_dict,
    add_adapter,
    inject_lora,
    load_adapter,
    merge_lora,
    merged_state_dict,
    route_adapters,
    save_adapter,
    set_adapter,
    unload_lora,
)
from lightning_peft.peft._common import dense_weight, is_quantized
from lightning_peft.peft.quantize import quantize_base, quantized_layers, shard_problems

pytest.importorskip("torchao")
ROOT = Path(__file__).resolve().parents[2]


class Net(nn.Module):
    """Two quantizable layers (64 x 64, 32 x 64), one too small for NF4 blocks (6 x 6: 36 values), a head."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.query = nn.Linear(64, 64, dtype=dtype)
        self.value = nn.Linear(64, 32, dtype=dtype)
        self.down = nn.Linear(32, 6, dtype=dtype)
        self.small = nn.Linear(6, 6, dtype=dtype)
        self.head = nn.Linear(6, 2, dtype=dtype)

    def forward(self, x):
        return self.head(self.small(self.down(torch.relu(self.value(torch.relu(self.query(x)))))))


def dense_copy(model: nn.Module, dtype=torch.float64) -> nn.Module:
    """``model`` with every quantized weight replaced by its values, cast to ``dtype``: the reference."""
    ref = copy.deepcopy(model)
    for module in quantized_layers(ref).values():
        module.weight = nn.Parameter(dense_weight(module.weight).detach().clone(), requires_grad=False)
    return ref.to(dtype)


def randomise_b(model: nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_a_quantized_lora_model_computes_its_dequantized_float64_reference(method):
    model = Net()
    plain = copy.deepcopy(model)
    layers = inject_lora(model, rank=4, alpha=8, target_modules=["query", "value"], quantize=method)
    randomise_b(model)
    for layer in layers.values():  # frozen, stored quantized, the adapters float32
        weight = layer.base_layer.weight
        assert type(layer.base_layer) is nn.Linear and is_quantized(weight) and not weight.requires_grad
        assert layer.lora_A["default"].weight.dtype == torch.float32 and weight.dtype == torch.float32
    ref = dense_copy(model)
    x = torch.randn(5, 64, requires_grad=True)
    x_ref = x.detach().double().requires_grad_(True)
    model(x).square().sum().backward()
    ref(x_ref).square().sum().backward()
    assert_close(x.grad, x_ref.grad.float(), rtol=1e-4, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(grads) == sorted(n for n, _ in ref.named_parameters() if "lora_" in n)
    for name, p in ref.named_parameters():
        if name in grads:
            assert_close(grads[name], p.grad.float(), rtol=1e-4, atol=1e-5)
    # Quantization error, for the record: NF4 ~9% of a Gaussian-initialised weight, int8 well under 1%.
    error = (dense_weight(model.query.base_layer.weight) - plain.query.weight).norm() / plain.query.weight.norm()
    assert error < (0.12 if method == "nf4" else 0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_values_are_torchaos_bit_for_bit(dtype):
    from lightning_peft.peft.quantize import _torchao

    to_nf4 = _torchao()[0]  # torchao, with our faster decoding in place
    weight = torch.randn(96, 64, dtype=dtype)
    quantized = to_nf4(weight, 64, 12)
    first = (quantized.quantized_data >> 4).long()  # torchao's own decoding, written out: high nibble first
    second = (quantized.quantized_data & 15).long()
    scales = quantized.dequantize_scalers(quantized.quantized_scalers, quantized.quantization_factor, 12)
    scales = scales.repeat_interleave(32)
    expected = torch.stack([quantized.nf4[first] * scales, quantized.nf4[second] * scales], dim=-1).view(96, 64)
    assert torch.equal(quantized.get_original_weight(), expected) and quantized.get_original_weight().dtype == dtype


def test_nf4_stores_under_fifteen_percent_of_the_float32_bytes():
    model = Net()
    quantize_base(model, "nf4", target_modules=["query"])
    weight = model.query.weight
    inner, _ = weight.__tensor_flatten__()
    stored = sum(getattr(weight, k).numel() * getattr(weight, k).element_size() for k in inner)
    assert stored / (64 * 64 * 4) <= 0.15


def test_unload_with_merge_gives_plain_linears_in_the_original_dtype_with_the_quantized_models_outputs():
    model = Net(torch.bfloat16)
    inject_lora(model, rank=4, target_modules=["query", "value"], quantize="nf4")
    randomise_b(model)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
        exported = merged_state_dict(model)
    assert all(type(v) is torch.Tensor for v in exported.values())  # an export holds values, never NF4
    with pytest.raises(RuntimeError, match=r"merge_lora: layer 'query': .*quantized \(NF4Tensor\); merging in place "
                                           r"would requantize it.*unload_lora\(model, merge=True\)"):
        merge_lora(model)
    assert not model.query.merged and is_quantized(model.query.base_layer.weight)  # refused before any change
    plain = unload_lora(model, merge=True)
    assert type(plain.query) is nn.Linear and type(plain.query.weight) is nn.Parameter
    assert plain.query.weight.dtype == torch.bfloat16
    assert not quantized_layers(plain)
    with torch.no_grad():
        assert_close(plain(x), expected, rtol=2e-2, atol=2e-2)  # one bf16 rounding of the merged weight
        assert_close(plain.state_dict()["query.weight"], exported["query.weight"], rtol=0, atol=0)


def test_float32_merge_equals_the_unmerged_quantized_model():
    model = Net()
    inject_lora(model, rank=4, target_modules=["query", "value"], quantize="int8")
    randomise_b(model)
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = model(x)
        assert_close(unload_lora(model, merge=True)(x), expected, rtol=1e-5, atol=1e-5)


def test_the_adapter_file_differs_only_by_the_recorded_quantization_and_peft_loads_it(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    base = transformers.BertModel(config).eval()
    full, quantized = copy.deepcopy(base), copy.deepcopy(base)
    inject_lora(full, rank=4, target_modules=["query", "value"])
    inject_lora(quantized, rank=4, target_modules=["query", "value"], quantize="nf4")
    randomise_b(full)
    quantized.load_state_dict(adapter_state_dict(full), strict=False)
    save_adapter(full, tmp_path / "full")
    save_adapter(quantized, tmp_path / "quantized")
    weights = "adapter_model.safetensors"  # the same tensors, bit for bit, and the same config
    full_tensors, quantized_tensors = (load_file(tmp_path / d / weights) for d in ("full", "quantized"))
    assert full_tensors.keys() == quantized_tensors.keys()
    assert all(torch.equal(full_tensors[k], quantized_tensors[k]) for k in full_tensors)
    full_config, quantized_config = (json.loads((tmp_path / d / "adapter_config.json").read_text())
                                     for d in ("full", "quantized"))
    assert quantized_config == full_config
    records = []
    for d in ("full", "quantized"):
        with safe_open(str(tmp_path / d / weights), "pt") as handle:
            records.append(json.loads(handle.metadata()["lightning_peft"])["base_model"])
    assert records[1].pop("quantization") == {"nf4": 2}  # query, value
    assert records[1] == records[0]  # nothing else differs
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "quantized")).eval()
    ids = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        assert_close(theirs(input_ids=ids).last_hidden_state, full(input_ids=ids).last_hidden_state)
    again = copy.deepcopy(base)  # ours loads it onto the full-precision base too, saying it is not the trained model
    with pytest.warns(UserWarning, match=r"was trained on a base whose adapted layers were quantized \(nf4 on 2 "
                                         r"layers\); the adapted layers of this BertModel are full precision"):
        load_adapter(again, tmp_path / "quantized")
    assert not quantized_layers(again)


def test_full_checkpoints_with_quantized_weights_load_under_weights_only():
    model = Net()
    inject_lora(model, rank=2, target_modules=["query"], quantize="nf4")
    quantize_base(model, "int8", target_modules=["value"])
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = Net()
    inject_lora(fresh, rank=2, target_modules=["query"], quantize="nf4")
    quantize_base(fresh, "int8", target_modules=["value"])
    fresh.load_state_dict(state)
    for name in ("query.base_layer.weight", "value.weight"):
        assert type(state[name]) is type(model.get_parameter(name))
        assert torch.equal(dense_weight(fresh.get_parameter(name)), dense_weight(model.get_parameter(name)))


def test_quantization_is_deterministic_so_resume_rebuilds_the_same_base():
    first, second = Net(), Net()
    second.load_state_dict(first.state_dict())
    for model in (first, second):
        inject_lora(model, rank=2, target_modules=["query", "value"], quantize="nf4")
    for name, layer in quantized_layers(first).items():
        other = second.get_submodule(name).weight
        inner, meta = layer.weight.__tensor_flatten__()
        assert all(torch.equal(getattr(layer.weight, k), getattr(other, k)) for k in inner)


def test_patterns_skip_unquantizable_layers_with_one_warning_and_named_layers_are_refused():
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = quantize_base(model, "nf4")  # all-linear: every linear but the head
    assert sorted(done) == ["down", "query", "value"]
    messages = [str(w.message) for w in caught if "unquantized" in str(w.message)]
    assert messages == ["quantize_base(method='nf4'): 1 matched layer(s) left unquantized (full precision): small "
                        "(its weight (6, 6) has 36 values, not a multiple of the NF4 block size 64 (use int8))."]
    model = Net()
    with pytest.raises(ValueError, match=r"LoRA\(quantize='nf4'\): layer 'small' cannot be quantized with method "
                                         r"'nf4': its weight \(6, 6\) has 36 values, not a multiple of the NF4 block "
                                         r"size 64 \(use int8\)\. Leave it out of target_modules"):
        inject_lora(model, rank=2, target_modules=["query", "small"], quantize="nf4")
    assert not quantized_layers(model) and not hasattr(model.query, "base_layer")  # nothing changed
    with pytest.raises(ValueError, match=r"layer 'query' cannot be quantized with method 'int8': its weight is "
                                         r"torch\.float64, which torchao's int8 weight-only tensor does not take"):
        inject_lora(Net(torch.float64), target_modules=["query"], quantize="int8")
    embedded = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"layer '0' cannot be quantized .*it is a Embedding; only nn\.Linear"):
        inject_lora(embedded, target_modules=["0", "1"], quantize="nf4")


def test_unknown_methods_are_refused_naming_the_choices():
    match = r"quantize='fp4'\): quantize must be one of 'nf4', 'int8'"
    with pytest.raises(ValueError, match=r"LoRA\(" + match):
        LoRAConfig(quantize="fp4")
    with pytest.raises(ValueError, match=r"quantize_base\(" + match):
        quantize_base(Net(), "fp4")
    with pytest.raises(ValueError, match=r"'qeury' matched no module of Net"):
        quantize_base(Net(), "nf4", target_modules=["qeury"])
    model = Net()
    with pytest.raises(ValueError, match=r"quantize_base\(target_modules='all_linear'\) matched no module of Net\. "
                                         r"Modules it can quantize: query, value, down, small, head\. Did you mean "
                                         r"'all-linear'"):
        quantize_base(model, "nf4", target_modules="all_linear")  # a regular expression that matches nothing
    assert not quantized_layers(model)


def test_shard_problems_name_each_weight_fsdp2_cannot_split():
    model = Net()
    quantize_base(model, "nf4", target_modules=["query", "value"])
    quantize_base(model, "int8", target_modules=["down"])
    problems = shard_problems(model, 2)
    assert problems == ["down: a Int8Tensor weight, which torchao cannot shard with FSDP2"]
    assert shard_problems(model, 3)[0] == ("query: NF4 weight (64, 64) has rows 64, quantized_data 2048, "
                                           "quantized_scalers 64, quantization_factor 8, not divisible by 3 shards")


def test_importing_lightning_peft_does_not_import_torchao():
    code = ("import sys; import lightning_peft, lightning_peft.peft, lightning_peft.peft.quantize; "
            "print('torchao' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert (result.returncode, result.stdout, result.stderr) == (0, "False\n", "")


def test_lora_on_bitsandbytes_layers_trains_and_unloads_to_plain_linears():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    dense = Net()
    four = bnb.nn.Linear4bit(64, 64, quant_type="nf4", compute_dtype=torch.float32)
    eight = bnb.nn.Linear8bitLt(64, 32, has_fp16_weights=False)
    four.load_state_dict(dense.query.state_dict())
    eight.load_state_dict(dense.value.state_dict())
    model = copy.deepcopy(dense)
    model.query, model.value = four.to("cpu"), eight.to("cpu")  # quantized as they move to the device
    inject_lora(model, rank=4, target_modules=["query", "value"])
    randomise_b(model)
    x = torch.randn(5, 64)
    model(x).sum().backward()  # bitsandbytes moves Linear8bitLt's scales to the layer here
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    reference = copy.deepcopy(dense).double()
    with torch.no_grad():
        for name in ("query", "value"):
            layer = model.get_submodule(name)
            reference.get_submodule(name).weight.copy_(dense_weight(layer.base_layer.weight, layer.base_layer)
                                                       + layer.delta_weight())
        expected = model(x)
        assert_close(expected.double(), reference(x.double()), rtol=1e-4, atol=1e-4)
        exported = merged_state_dict(model)
    assert sorted(exported) == sorted(dense.state_dict())  # no bitsandbytes entries (absmax, SCB, ...) left
    with pytest.raises(RuntimeError, match=r"the base weight is quantized \(Params4bit\)"):
        merge_lora(model)
    plain = unload_lora(model, merge=True)
    assert type(plain.query) is nn.Linear and type(plain.value) is nn.Linear
    with torch.no_grad():
        assert_close(plain(x), expected, rtol=1e-5, atol=1e-5)


def test_named_adapters_share_the_quantized_base_and_route_per_sample():
    model = Net()
    inject_lora(model, rank=2, target_modules=["query"], quantize="nf4", adapter_name="a")
    add_adapter(model, "b", rank=2, target_modules=["query", "value"], quantize="nf4")
    randomise_b(model)
    assert sorted(quantized_layers(model)) == ["query.base_layer", "value.base_layer"]
    x = torch.randn(2, 64)
    with torch.no_grad():
        singles = []
        for name in ("a", "b"):
            set_adapter(model, name)
            singles.append(model(x))
        with route_adapters(model, ["a", "b"]):  # the routed path: one batched product over both adapters
            routed = model(x)
    assert_close(routed, torch.stack([singles[0][0], singles[1][1]]))
