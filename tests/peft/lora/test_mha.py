"""LoRA on nn.MultiheadAttention against Hugging Face PEFT 0.21 with huggingface/peft#3774 fixed (the oracle:
`fixed_peft_mha`, each update once, as LoRA defines it), PEFT 0.21.2's own double out-projection update, and what is
refused."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import Tensor, nn

from lightning_peft.peft import (
    add_adapter,
    combine_adapters,
    inject_lora,
    load_adapter,
    merge_lora,
    merged_state_dict,
    route_adapters,
    save_adapter,
    set_adapter,
    unload_lora,
    unmerge_lora,
)
from lightning_peft.peft.lora import LoRAMultiheadAttention
from tests.peft.lora._oracle import (
    MHA,
    MODELS,
    PEFT_MHA,
    PREFIX,
    assert_equal_to_peft,
    close,
    fixed_peft_mha,
    inputs,
    peft,
    peft_name,
    trainable,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:(All adapters are already merged|Already unmerged):UserWarning"),
    pytest.mark.filterwarnings("ignore:load_adapter.*adapts the nn.MultiheadAttention layer:UserWarning"),
]


@pytest.fixture
def fixed_peft():
    """PEFT 0.21.2 with huggingface/peft#3774 fixed, the oracle."""
    with fixed_peft_mha():
        yield


class Attention(MHA):
    """The oracle's MHA model with nn.MultiheadAttention's options: sequence-first layout, no biases, masks, and the
    attention weights in the output. ``inputs`` gives it (B, T, 8), as MHA."""

    def __init__(self, batch_first: bool = True, bias: bool = True, masks: bool = False, weights: bool = False):
        nn.Module.__init__(self)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=batch_first, bias=bias)
        self.lin0 = nn.Linear(8, 2)
        self.masks, self.weights = masks, weights

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 8) -> (B, 2)
        q = x if self.mha.batch_first else x.transpose(0, 1)  # (T, B, 8)
        masks = {}
        if self.masks:
            padding = torch.zeros(x.shape[:2], dtype=torch.bool)
            padding[1, -1] = True  # (B, T): the last token of sample 1 is padding
            causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)  # (T, T)
            masks = {"key_padding_mask": padding, "attn_mask": causal}
        out, weights = self.mha(q, q, q, need_weights=self.weights, **masks)
        out = out if self.mha.batch_first else out.transpose(0, 1)
        y = self.lin0(out).sum(1)
        return y + weights.square().sum((1, 2))[:, None] if self.weights else y


VARIANTS = {
    "seq-first": {"batch_first": False},
    "no bias": {"bias": False},
    "masks, weights": {"masks": True, "weights": True},
    "seq-first, masks, weights": {"batch_first": False, "masks": True, "weights": True},
}


@pytest.mark.usefixtures("fixed_peft")
@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_options_equal_peft(variant, tmp_path, monkeypatch):
    monkeypatch.setitem(MODELS, "Attention", lambda: Attention(**VARIANTS[variant]))
    assert_equal_to_peft("Attention", {"target_modules": ["mha"], "lora_alpha": 4}, tmp_path)


@pytest.mark.usefixtures("fixed_peft")
def test_rank_pattern_and_gaussian_init_equal_peft(tmp_path):
    assert_equal_to_peft("MHA", {"target_modules": ["mha", "lin0"], "r": 2, "rank_pattern": {"mha": 4},
                                 "init_lora_weights": "gaussian", "use_rslora": True}, tmp_path)


def _seeded(model: nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable(model).values():
            p.add_(0.3 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).double()


@pytest.mark.usefixtures("fixed_peft")
def test_transformer_encoder_trains_as_peft_and_its_fused_inference_keeps_the_adapter(tmp_path):
    base = _encoder()
    ours = copy.deepcopy(base)
    inject_lora(ours, target_modules=["self_attn"], rank=2, alpha=4)
    _seeded(ours)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules=["self_attn"], r=2, lora_alpha=4))
    their_params = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, p in trainable(ours).items():
            their_params[PREFIX + peft_name(name)].copy_(p)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    grads = []
    for model in (ours, theirs):  # training: the step PEFT takes
        model.train()
        y = model(x)
        y.square().sum().backward()
        grads.append(({k: p.grad for k, p in trainable(model).items()}, y.detach()))
    close(grads[0][1], grads[1][1], "training forward")
    for name, grad in grads[0][0].items():
        close(grad, grads[1][0][PREFIX + peft_name(name)], f"gradient of {name}")
    # Inference: the encoder's fused kernels read self_attn.in_proj_weight themselves; ours keeps the adapter (PEFT
    # 0.21's unmerged layer drops it there), so it equals the merged model, ours and PEFT's.
    ours.eval(), theirs.eval()
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    with torch.no_grad():
        adapted = ours(x)
        padded = ours(x, src_key_padding_mask=padding)  # the nested-tensor path
        theirs.merge_adapter()
        close(adapted, theirs(x), "inference (PEFT merged)")
        close(padded[~padding], theirs(x, src_key_padding_mask=padding)[~padding], "padded inference (PEFT merged)")
        close(adapted, grads[0][1], "inference equals the training forward")
        merge_lora(ours)
        close(ours(x), adapted, "inference, merged")


@pytest.mark.usefixtures("fixed_peft")
def test_dropout_is_not_applied_to_attention_as_in_peft(tmp_path):
    with pytest.warns(UserWarning, match=r"LoRA\(dropout=0.5\): not applied to nn.MultiheadAttention layers, whose "
                                         r"adapter enters the attention through its weights"):
        assert_equal_to_peft("MHA", {"target_modules": ["mha", "lin0"], "lora_dropout": 0.5}, tmp_path)


@pytest.mark.usefixtures("fixed_peft")
def test_named_adapters_switch_as_in_peft():
    torch.manual_seed(0)
    base = MODELS["MHA"]().double()
    ours = copy.deepcopy(base)
    inject_lora(ours, target_modules=["mha"], rank=2)
    add_adapter(ours, "other", target_modules=["mha"], rank=3, alpha=6)
    _seeded(ours)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules=["mha"], r=2, lora_alpha=8))
    theirs.add_adapter("other", peft.LoraConfig(target_modules=["mha"], r=3, lora_alpha=6))
    their_params = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_" in f".{name}" or "_lora_" in name:
                their_params[PREFIX + peft_name(name)].copy_(p)
    x = inputs(base)
    ours.eval(), theirs.eval()
    with torch.no_grad():
        for name in ("default", "other"):
            set_adapter(ours, name)
            theirs.set_adapter(name)
            close(ours(x), theirs(x), f"adapter {name!r}")
        assert (ours(x) - base(x)).abs().max() > 1e-3


def test_merged_state_dict_and_unload_give_a_plain_attention_with_merged_weights():
    torch.manual_seed(0)
    base = MODELS["MHA"]().double().eval()
    ours = copy.deepcopy(base)
    inject_lora(ours, target_modules=["mha"], rank=2)
    _seeded(ours)
    x = inputs(base)
    with torch.no_grad():
        adapted = ours(x)
    layer = ours.mha
    scaling = layer.specs["default"].scaling
    deltas = {"in_proj_weight": scaling * layer.lora_B["default"].weight @ layer.lora_A["default"].weight,
              "out_proj.weight": scaling * layer.out_proj_lora_B["default"].weight
              @ layer.out_proj_lora_A["default"].weight}
    expected = dict(base.state_dict())
    expected["mha.in_proj_weight"] = base.mha.in_proj_weight + deltas["in_proj_weight"]
    expected["mha.out_proj.weight"] = base.mha.out_proj.weight + deltas["out_proj.weight"]  # once, as LoRA
    exported = merged_state_dict(ours)
    assert set(exported) == set(expected)
    for key, value in expected.items():
        close(exported[key], value, key)
    merge_lora(ours)
    unmerged = ours.state_dict()  # a merged layer's state dict holds its base weights
    close(unmerged["mha.base_layer.in_proj_weight"], base.mha.in_proj_weight, "state dict of a merged layer")
    close(unmerged["mha.base_layer.out_proj.weight"], base.mha.out_proj.weight, "state dict of a merged layer")
    unmerge_lora(ours)
    plain = unload_lora(ours, merge=True)
    assert type(plain.mha) is nn.MultiheadAttention and type(plain.mha.out_proj) is type(base.mha.out_proj)
    for key, value in plain.state_dict().items():
        close(value, expected[key], f"unloaded {key}")
    with torch.no_grad():
        close(plain(x), adapted, "the unloaded model")


@pytest.mark.usefixtures("fixed_peft")
def test_peft_files_with_a_rank_pattern_load(tmp_path):
    torch.manual_seed(0)
    base = MODELS["MHA"]().double().eval()
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules=["mha", "lin0"], r=2,
                                                                     rank_pattern={"mha": 4}))
    _seeded(theirs)
    theirs.save_pretrained(tmp_path)
    ours = load_adapter(copy.deepcopy(base), tmp_path).eval()
    assert ours.mha.out_proj_lora_B["default"].weight.shape == (8, 4)
    x = inputs(base)
    with torch.no_grad():
        close(ours(x), theirs.eval()(x), "loaded PEFT files")


def test_refusals_name_the_attention_module_and_the_fix():
    seq = nn.Sequential(nn.MultiheadAttention(8, 2, kdim=4, vdim=6))
    with pytest.raises(TypeError, match=r"LoRA\(target_modules=\['0'\]\) matched '0', an nn.MultiheadAttention "
                                        r"with separate query, key and value projections \(embed_dim=8, kdim=4, vdim=6\); LoRA adapts the fused"):
        inject_lora(seq, target_modules=["0"])
    with pytest.raises(ValueError, match="Only same embed for query/key/value is supported"):  # PEFT refuses it too
        peft.get_peft_model(seq, peft.LoraConfig(target_modules=["0"]))
    for bias in ("all", "lora_only"):
        with pytest.raises(ValueError, match=rf"LoRA\(bias='{bias}'\) with the nn.MultiheadAttention 'mha': its "):
            inject_lora(MHA(), target_modules=["mha"], bias=bias)
    with pytest.raises(TypeError, match=r"LoRA\(target_modules=\['out_proj'\]\) matched 'mha.out_proj', which "
                                        r"belongs to an nn.MultiheadAttention: .* Target the attention "
                                        r"module itself \('mha'\): LoRA adapts its in- and out-projections together"):
        inject_lora(MHA(), target_modules=["out_proj"])
    with pytest.raises(TypeError, match=r"LoRA\(use_dora=True\): 'mha' is of type MultiheadAttention; DoRA supports"):
        inject_lora(MHA(), target_modules=["mha"], use_dora=True)
    model = MHA()
    with pytest.raises(ValueError, match=r"LoRA\(lora_bias=True\) with the nn.MultiheadAttention 'mha': PEFT's "):
        inject_lora(model, target_modules=["mha"], lora_bias=True)  # was an AttributeError, half-way through
    assert type(model.mha) is nn.MultiheadAttention  # nothing changed
    with pytest.raises(ValueError, match=r"matched no module of Sequential\. Modules it can adapt: 0\.$"):  # not out_proj
        inject_lora(nn.Sequential(nn.MultiheadAttention(8, 2)), target_modules=["nothing"])


def test_routing_and_combining_refuse_attention_layers():
    model = MHA().double()
    inject_lora(model, target_modules=["mha"], rank=2, adapter_name="a")
    add_adapter(model, "b", target_modules=["lin0"], rank=2)
    x = inputs(model)
    with route_adapters(model, ["b", None, "b"]):  # no sample uses the attention's adapter: it runs its base
        model(x)
    with pytest.raises(ValueError, match=r"route_adapters: per-sample adapters are not supported on "
                                         r"nn.MultiheadAttention layers .* this layer has \['a'\]"), \
            route_adapters(model, ["a", None, "b"]):
        model(x)
    with pytest.raises(TypeError, match=r"combine_adapters: 'mha' is an nn.MultiheadAttention layer"):
        combine_adapters(model, {"a": 1.0}, "c")
    assert isinstance(model.mha, LoRAMultiheadAttention) and list(model.mha.specs) == ["a"]


def _peft_0_21_encoder(tmp_path) -> tuple[nn.Module, nn.Module]:
    """(the base encoder, PEFT 0.21.2 as released on its two self_attn layers), seeded; PEFT's files in tmp_path."""
    base = _encoder()
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules=["self_attn"], r=2, lora_alpha=4))
    _seeded(theirs)
    theirs.save_pretrained(tmp_path)
    return base, theirs


def test_peft_0_21_merges_the_out_projection_update_twice(tmp_path):
    base, theirs = _peft_0_21_encoder(tmp_path)
    layer = theirs.base_model.model.layers[0].self_attn
    with torch.no_grad():
        once = {"in_proj_weight": base.layers[0].self_attn.in_proj_weight + layer.get_delta_weight("default"),
                "out_proj": base.layers[0].self_attn.out_proj.weight
                + layer.base_layer.out_proj.get_delta_weight("default")}
        PEFT_MHA["merge"](layer)  # PEFT's own MultiheadAttention.merge, not the oracle's fixed one
        close(layer.base_layer.in_proj_weight, once["in_proj_weight"], "PEFT's merged in_proj_weight")
        twice = once["out_proj"] + layer.base_layer.out_proj.get_delta_weight("default")
        merged = layer.base_layer.out_proj.get_base_layer().weight
        assert torch.allclose(merged, twice, rtol=0, atol=1e-12) and not torch.allclose(merged, once["out_proj"]), (
            f"peft {peft.__version__} merges the out-projection update of nn.MultiheadAttention once "
            "(huggingface/peft#3774 is fixed in it): remove fixed_peft_mha from tests/peft/lora/_oracle.py and this "
            "test, limit lora.mha.warn_doubled_out_proj to files of the PEFT versions before it, and update "
            "docs/lora.md."
        )


def test_peft_0_21_files_load_with_a_warning_and_twice_the_out_projection_b_gives_peft_0_21_outputs(tmp_path):
    base, theirs = _peft_0_21_encoder(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = load_adapter(copy.deepcopy(base), tmp_path)
    told = [w for w in caught if "nn.MultiheadAttention layer" in str(w.message)]
    assert len(told) == 1 and told[0].category is UserWarning and told[0].filename == __file__, told  # once, here
    assert re.fullmatch(
        rf"load_adapter: {re.escape(str(tmp_path / 'adapter_config.json'))} \(peft_version='{peft.__version__}'\) "
        r"adapts the nn.MultiheadAttention layer\(s\) 'layers.0.self_attn', 'layers.1.self_attn'. Hugging Face PEFT "
        r"through 0.21.2 applies their out-projection's LoRA update twice \(out_proj.weight \+ 2\*s\*B\*A, in its "
        r"forward and merged weights; huggingface/peft#3774\); lightning-peft applies it once, as LoRA defines it "
        r"\(\+ s\*B\*A\), so the outputs differ from that PEFT's. To get that PEFT's outputs, scale each such "
        r"layer's out-projection B factor by 2 after loading: with torch.no_grad\(\): "
        r"model.get_submodule\(name\).out_proj_lora_B\['default'\].weight.mul_\(2\).", str(told[0].message))
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    ours.train(), theirs.train()  # (the encoder's fused inference kernel drops PEFT's unmerged adapter)
    with torch.no_grad():
        peft_0_21 = theirs(x)  # PEFT as released: W_out + 2 s B A
        assert (ours(x) - peft_0_21).abs().max() > 1e-3, "once and twice do not differ: nothing is compared"
        with fixed_peft_mha():
            close(ours(x), theirs(x), "PEFT with #3774 fixed")
        once = ours(x)
    save_adapter(ours, tmp_path / "ours")  # our own files (no peft_version) mean what they compute: no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_adapter(copy.deepcopy(base), tmp_path / "ours")
    assert not [w for w in caught if "nn.MultiheadAttention layer" in str(w.message)]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours").train()
    with torch.no_grad():
        for name in ("layers.0.self_attn", "layers.1.self_attn"):  # what the docs say: half B in PEFT 0.21.2
            loaded.base_model.model.get_submodule(name).base_layer.out_proj.lora_B["default"].weight.mul_(0.5)
            ours.get_submodule(name).out_proj_lora_B["default"].weight.mul_(2)  # what the warning says to do
        close(loaded(x), once, "our files in PEFT 0.21.2, its out-projection B factors halved")
        close(ours(x), peft_0_21, "the out-projection B factors doubled: PEFT 0.21.2's outputs")
