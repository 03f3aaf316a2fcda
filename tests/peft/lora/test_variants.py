"""DoRA (:mod:`lightning_peft.peft.lora.variants`) with Hugging Face PEFT 0.21 as the oracle, in float64.

The same tiny models (a Linear with bias, one without, a transformers ``Conv1D``; an Embedding and two Conv2d) get
our DoRA and PEFT's with the same ``A``, ``B`` and magnitude (random, so that no check passes because ``B = 0``):
same outputs (dropout on and off), the same adapter after one AdamW step, each side's files loaded by the other with
equal outputs; merged equals unmerged, the merged weights are PEFT's and unmerging restores ``W``; the convolution
variant on Conv1d, Conv3d and a grouped Conv2d; the errors (routing, resume with ``use_dora`` changed).
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from lightning_peft.peft import LoRAConfig, add_adapter, combine_adapters, delete_adapter, inject_lora  # noqa: E402
from lightning_peft.peft import load_adapter, lora_layers, merge_lora, merged_state_dict, peft_config  # noqa: E402
from lightning_peft.peft import route_adapters, save_adapter, set_adapter, unload_lora, unmerge_lora  # noqa: E402
from lightning_peft.peft.lora import LoRAAdapter, LoRAConv2d, LoRAEmbedding  # noqa: E402
from lightning_peft.peft.lora.variants import DoRA, refuse_unsupported  # noqa: E402
from tests._models import conv1d  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to:UserWarning")  # PEFT fixes its flag per layer
PREFIX = "base_model.model."
TARGETS = ["up", "down", "proj"]


class Net(nn.Module):
    inputs = staticmethod(lambda *batch: torch.randn(*batch, 6, dtype=torch.float64))

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 5, bias=False)
        self.proj = conv1d(5, 4)  # weight (in, out)

    def forward(self, x):  # (B, T, 6) -> (B, T, 4)
        return self.proj(self.down(self.up(x).tanh()).tanh())


class Vision(nn.Module):
    """An Embedding (with a padding row) whose rows become a 3-channel image, then two Conv2d (one strided, one
    without bias)."""

    inputs = staticmethod(lambda *batch: torch.randint(0, 11, (batch[0], 3, 6)))

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.down = nn.Conv2d(5, 4, (2, 3), stride=2, bias=False)

    def forward(self, ids):  # (B, 3, 6) ids -> (B, 3, 6, 6) -> (B, 4, 3, 2)
        return self.down(self.conv(self.emb(ids)).tanh())


VISION = ["emb", "conv", "down"]


def _pair(dropout: float = 0.0, seed: int = 0, model: type[nn.Module] = Net, targets: list[str] = TARGETS):
    """(ours, PEFT's, the base): DoRA on ``targets``, the same random A, B and magnitude (near ||W||)."""
    torch.manual_seed(seed)
    base = model().double()
    ours = copy.deepcopy(base)
    inject_lora(ours, rank=2, alpha=4, dropout=dropout, target_modules=targets, use_dora=True)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=dropout, target_modules=targets, use_dora=True))
    _close_params(ours, theirs, "magnitude")  # the magnitude starts as PEFT's (B = 0: the norms of W)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.requires_grad:
                p.mul_(1 + 0.3 * torch.randn_like(p)) if "magnitude" in name else p.normal_(0, 0.5)
        peft_params = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            if p.requires_grad:
                key = PREFIX + (f"{name}.weight" if "magnitude" in name else name)
                peft_params[key].copy_(p)
    return ours, theirs, base


def _adapter(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix).removesuffix(".weight") if "magnitude" in k else k.removeprefix(prefix): p
            for k, p in model.named_parameters() if p.requires_grad}


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _close_params(ours: nn.Module, theirs: nn.Module, part: str = "") -> None:
    after = _adapter(theirs, PREFIX)
    assert after.keys() == _adapter(ours).keys()
    for key, p in _adapter(ours).items():
        if part in key:
            _close(p, after[key])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("model", [Net, Vision])
def test_outputs_and_one_adamw_step_equal_peft(dropout, model):
    ours, theirs, base = _pair(dropout, model=model, targets=TARGETS if model is Net else VISION)
    x = model.inputs(3, 2)
    with torch.no_grad():
        assert (ours(x) - base(x)).abs().max() > 0.1
    opt_ours = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=0.05)
    opt_theirs = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=0.05)
    outs = []
    for side, opt in ((ours, opt_ours), (theirs, opt_theirs)):
        torch.manual_seed(1)  # the same dropout masks
        y = side(x)
        (y.square().sum() + y.sum()).backward()
        outs.append((y.detach(), {k: p.grad for k, p in _adapter(side, PREFIX).items()}))
        opt.step()
    _close(outs[0][0], outs[1][0])
    assert outs[0][1].keys() == outs[1][1].keys()
    for key, grad in outs[0][1].items():
        assert grad.abs().max() > 0, key  # the magnitude and both factors train
        _close(grad, outs[1][1][key])
    _close_params(ours, theirs)
    ours.eval(), theirs.eval()
    with torch.no_grad():
        _close(ours(x), theirs(x))


def test_new_adapter_starts_at_the_base_with_magnitude_the_row_norm():
    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(4, 6, dtype=torch.float64)
    before = model(x)
    layers = inject_lora(model, rank=2, target_modules=TARGETS, use_dora=True)
    _close(model(x), before)
    _close(layers["up"].lora_magnitude_vector["default"], layers["up"].base_layer.weight.norm(dim=1))
    _close(layers["proj"].lora_magnitude_vector["default"], layers["proj"].base_layer.weight.norm(dim=0))


@pytest.mark.parametrize("model", [Net, Vision])
def test_peft_files_both_ways(tmp_path, model):
    targets = TARGETS if model is Net else VISION
    ours, theirs, base = _pair(model=model, targets=targets)
    x = model.inputs(3)
    save_adapter(ours, tmp_path / "ours")
    assert peft_config(ours)["use_dora"] is True
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours")
    with torch.no_grad():
        for layer in [m for m in loaded.modules() if hasattr(m, "lora_magnitude_vector")]:
            assert "default" in layer.lora_magnitude_vector
        _close(loaded(x), ours(x))
        theirs.save_pretrained(tmp_path / "theirs")
        mine = load_adapter(copy.deepcopy(base), tmp_path / "theirs")
        assert all(isinstance(s.variant, DoRA) for layer in lora_layers(mine).values() for s in layer.specs.values())
        _close(mine(x), theirs(x))
    keys = set(load_file(tmp_path / "ours" / "adapter_model.safetensors"))
    assert keys == set(load_file(tmp_path / "theirs" / "adapter_model.safetensors"))
    assert {f"{PREFIX}{t}.lora_magnitude_vector" for t in targets} <= keys
    plain = copy.deepcopy(base)
    inject_lora(plain, rank=2, alpha=4, target_modules=targets)
    with pytest.raises(ValueError, match=r"sets use_dora=True, but the model's LoRA adapter 'default' at '\w+' has "
                                         r"use_dora=False\. Load it into a model without LoRA layers"):
        load_adapter(plain, tmp_path / "ours")


@pytest.mark.parametrize("model", [Net, Vision])
def test_merge_unmerge_unload_and_merged_state_equal_the_adapted_outputs(model):
    ours, theirs, base = _pair(model=model, targets=TARGETS if model is Net else VISION)
    x = model.inputs(3)
    weights = {n: layer.base_layer.weight.detach().clone() for n, layer in lora_layers(ours).items()}
    with torch.no_grad():
        expected = ours(x)
        plain = copy.deepcopy(base)
        exported = merged_state_dict(ours)
        merge_lora(ours)
        _close(ours(x), expected)
        theirs.merge_adapter()
        for name, layer in lora_layers(ours).items():  # PEFT's merged weight, too
            _close(layer.base_layer.weight, theirs.get_base_model().get_submodule(name).base_layer.weight)
        unmerge_lora(ours)
        for name, layer in lora_layers(ours).items():
            _close(layer.base_layer.weight, weights[name])
        _close(ours(x), expected)
        plain.load_state_dict(exported)
        _close(plain(x), expected)
        unloaded = unload_lora(ours)
        assert not lora_layers(unloaded)
        _close(unloaded(x), expected)


def test_float32_merge_and_half_cast_keep_the_magnitude_float32():
    torch.manual_seed(0)
    model = Net()
    layers = inject_lora(model, rank=2, target_modules=["up", "down"], use_dora=True)
    with torch.no_grad():
        for layer in layers.values():
            layer.lora_B["default"].weight.normal_()
    x = torch.randn(3, 6)
    expected = model(x)
    merge_lora(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    unmerge_lora(model)
    model.bfloat16()
    assert layers["up"].lora_magnitude_vector["default"].dtype == torch.float32
    assert model.up(x.bfloat16()).dtype == torch.bfloat16


def test_named_adapters_each_have_their_own_magnitude():
    torch.manual_seed(0)
    base = Net().double()
    model = copy.deepcopy(base)
    inject_lora(model, rank=2, target_modules=["up"], use_dora=True)
    add_adapter(model, "other", rank=3, target_modules=["up", "down"], use_dora=True)
    add_adapter(model, "plain", rank=2, target_modules=["up"])
    up = model.up
    assert set(up.lora_magnitude_vector) == {"default", "other"}
    with torch.no_grad():
        for p in up.adapter_parameters().values():
            p.add_(torch.randn_like(p))
    x = torch.randn(2, 6, dtype=torch.float64)
    outs = {}
    for name in ("default", "other", "plain"):
        set_adapter(model, name)
        outs[name] = model(x)
    assert (outs["default"] - outs["other"]).abs().max() > 1e-3
    merge_lora(model, "other")
    with torch.no_grad():
        _close(model(x), outs["other"])
    unmerge_lora(model)
    set_adapter(model, "default")
    delete_adapter(model, "other")
    assert set(up.lora_magnitude_vector) == {"default"}
    with pytest.raises(ValueError, match=r"route_adapters: adapter 'default' is a DoRA adapter \(use_dora=True\); "
                                         r"per-sample routing of DoRA adapters is not supported"):
        with route_adapters(model, ["default", "plain"]):
            pass
    with pytest.raises(ValueError, match="combine_adapters: source 'default' is a DoRA adapter"):
        combine_adapters(model, {"default": 0.5, "plain": 0.5}, "mix")


class AnyConv(LoRAConv2d):
    """LoRAConv2d for a convolution of any number of dimensions, its B grouped as the base (as PEFT builds it): a
    stand-in for the N-d convolution layer, to run the convolution variant on Conv1d, Conv3d and groups."""

    def _create(self, name, rank, device, dtype):
        base, ones = self.base_layer, (1,) * (self.base_layer.weight.dim() - 2)
        self.lora_A[name] = type(base)(base.in_channels, rank, base.kernel_size, base.stride, base.padding,
                                       bias=False, device=device, dtype=dtype)
        self.lora_B[name] = type(base)(rank, base.out_channels, ones, ones, groups=base.groups, bias=False,
                                       device=device, dtype=dtype)


@pytest.mark.filterwarnings("ignore:LoRA adapter added to ConvNd layer with groups:UserWarning")
@pytest.mark.parametrize(("conv", "size", "groups"), [(nn.Conv1d, (9,), 1), (nn.Conv3d, (5, 4, 6), 1),
                                                      (nn.Conv2d, (5, 6), 2)])
def test_the_convolution_variant_equals_peft_in_any_dimension_and_grouped(conv, size, groups):
    torch.manual_seed(0)
    base = conv(4, 6, 3, stride=2, padding=1, groups=groups).double()
    ours = AnyConv(copy.deepcopy(base), rank=2, alpha=4, dropout=0.3, use_dora=True)
    theirs = peft.get_peft_model(nn.Sequential(copy.deepcopy(base)), peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=0.3, target_modules=["0"], use_dora=True))
    peft_params = dict(theirs.named_parameters())
    pairs = {name: (p, peft_params[f"{PREFIX}0.{name}" + (".weight" if "magnitude" in name else "")])
             for name, p in ours.adapter_parameters().items()}
    with torch.no_grad():
        for name, (p, their) in pairs.items():
            if "magnitude" in name:
                _close(p, their)  # PEFT's shape (1, out, 1, ...) and initial value
                p.mul_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5)
            their.copy_(p)
    x = torch.randn(3, 4, *size, dtype=torch.float64)
    for train in (False, True):  # dropout off, then on
        ours.train(train), theirs.train(train)
        outs = []
        for model in (ours, theirs):
            torch.manual_seed(1)
            y = model(x)
            (y.square().sum() + y.sum()).backward()
            outs.append(y.detach())
        _close(outs[0], outs[1])
        for p, their in pairs.values():
            assert p.grad.abs().max() > 0
            _close(p.grad, their.grad)
            p.grad, their.grad = None, None
    if groups == 1:  # PEFT does not merge grouped convolutions
        weight = base.weight.detach().clone()
        ours.merge()
        theirs.merge_adapter()
        _close(ours.base_layer.weight, theirs.base_model.model[0].base_layer.weight)
        ours.unmerge()
        _close(ours.base_layer.weight, weight)


def test_dora_reaches_every_layer_type_and_refuses_what_it_lacks():
    torch.manual_seed(0)
    layer = LoRAEmbedding(nn.Embedding(5, 4), rank=2, alpha=2, use_dora=True)
    layer.add_adapter("other", 2, 2.0)
    assert "default: rank=2, alpha=2, scaling=1, dora, other: rank=2, alpha=2.0, scaling=1, merged=False" in repr(layer)
    layer.routing.route_to(["default", "other"])
    with pytest.raises(ValueError, match=r"route_adapters: adapter 'default' is a DoRA adapter"):
        layer(torch.tensor([[1, 2], [3, 4]]))

    class NoDoRA(LoRAConv2d):
        dora_variant = None

    with pytest.raises(TypeError, match=r"NoDoRA\(use_dora=True\): DoRA is not implemented for a Conv2d base layer"):
        NoDoRA(nn.Conv2d(2, 2, 3), rank=2, alpha=2, use_dora=True)
    model = nn.ModuleDict({"mha": nn.MultiheadAttention(4, 2), "lin": nn.Linear(4, 4)})
    with pytest.raises(TypeError, match=r"LoRA\(use_dora=True\): 'mha' is of type MultiheadAttention; DoRA supports "
                                        r"Linear, Embedding, Conv1d, Conv2d, Conv3d layers only\. Leave the "
                                        r"MultiheadAttention layers out of target_modules .*or set use_dora=False"):
        refuse_unsupported("LoRA", ["lin", "mha"], dict(model.named_children()),
                           (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d))
    with pytest.raises(TypeError, match=r"LoRA\(use_dora='yes'\): use_dora must be"):
        LoRAConfig(use_dora="yes")


def test_configs_resume_fields_and_multi_lora_refusal():
    assert LoRAConfig.from_peft(peft.LoraConfig(r=2, target_modules=["q"], use_dora=True)).use_dora is True
    fields = LoRAAdapter.resume_fields
    dora = {"adapters": {"default": {"config": LoRAConfig(use_dora=True).to_dict(), "targets": ["q"]}},
            "modules_to_save": []}
    plain = {"adapters": {"default": {"config": LoRAConfig().to_dict(), "targets": ["q"]}}, "modules_to_save": []}
    assert fields(dora) != fields(plain)  # resuming with use_dora changed is refused
    older = copy.deepcopy(plain)
    del older["adapters"]["default"]["config"]["use_dora"]  # a checkpoint written before use_dora existed
    assert fields(older) == fields(plain)
    from lightning_peft.callbacks import LoRA, MultiLoRA

    assert LoRA(use_dora=True).config.use_dora
    with pytest.raises(ValueError, match=r"MultiLoRA\(adapters\['a'\]\): use_dora=True; MultiLoRA routes"):
        MultiLoRA(adapters={"a": {"rank": 2, "use_dora": True}})
