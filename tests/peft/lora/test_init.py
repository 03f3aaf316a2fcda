"""Starts that read and rewrite the base weight (PiSSA, OLoRA, LoftQ): equal to Hugging Face PEFT where PEFT runs
(float32: PEFT computes them in float32 and refuses float64 bases), to the papers' formulas in float64, and saved as
PEFT's conversion to a plain LoRA on the original base."""

from __future__ import annotations

import copy
import json
import math

import peft
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.testing import assert_close

from lightning_peft.peft import (
    LoRAConfig,
    add_adapter,
    inject_lora,
    load_adapter,
    merged_state_dict,
    save_adapter,
)
from lightning_peft.peft._common import dense_weight, is_quantized
from lightning_peft.peft.lora.init import SEED
from lightning_peft.peft.quantize import quantized

PREFIX = "base_model.model."


def _mlp(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)).to(dtype)  # NF4: multiples of 64 values


def _pair(init: str, base: nn.Module, **kwargs) -> tuple[nn.Module, nn.Module]:
    """PEFT's model and ours for ``init``, each built from the same random state; pissa_niter_K: PEFT's start run
    with the generator seeded `SEED` on each layer, as ours draws its random projection."""
    config = dict(r=3, lora_alpha=6, target_modules=["0", "2"], init_lora_weights=init, **kwargs)
    niter = "_niter_" in init
    torch.manual_seed(5)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**{**config, "init_lora_weights": True} if niter
                                                                       else config))
    for layer in (m for m in theirs.modules() if isinstance(m, peft.tuners.lora.Linear)) if niter else ():
        torch.manual_seed(SEED)
        layer.pissa_init("default", init)
        if "default" in layer.lora_variant:  # DoRA's magnitude, from the rewritten base (as PEFT's update_layer)
            layer.lora_variant["default"].init(layer, adapter_name="default")
    ours = copy.deepcopy(base)
    torch.manual_seed(5)
    inject_lora(ours, LoRAConfig.from_peft(peft.LoraConfig(**config)))
    return theirs, ours


def _peft_name(key: str) -> str:
    return PREFIX + key.replace("lora_magnitude_vector.default", "lora_magnitude_vector.default.weight")


def _step(model: nn.Module, x: torch.Tensor) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1)
    y = model(x)
    (y.square().sum() + y.sum()).backward()
    optimizer.step()


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora"])
def test_starts_equal_peft_bit_for_bit_in_float32(init, use_dora):
    """A, B and the rewritten base equal PEFT's exactly (pissa_niter_K: PEFT seeded as ours); a DoRA magnitude to float32's
    last bit (PEFT adds s B A to W in two roundings, we in one); the forward and one training step to float32's
    rounding (the same math in another order)."""
    base = _mlp()
    theirs, ours = _pair(init, base, use_dora=use_dora)
    x = torch.randn(4, 16)
    for tolerance in (0, 1e-5):  # the start, then after one step
        params = dict(theirs.named_parameters())
        for key, value in ours.state_dict().items():
            exact = max(tolerance, 1.2e-7 if "magnitude" in key else 0)
            assert_close(value, params[_peft_name(key)].detach(), rtol=exact, atol=exact, msg=key)
        assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
        _step(ours, x)
        _step(theirs, x)


def _reference(weight: torch.Tensor, init: str, rank: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) from the papers: PiSSA (arXiv:2404.02948) the principal triplets, split as sqrt(S / s) on each side;
    OLoRA (arXiv:2406.01775) the reduced QR's first r columns of Q and rows of R."""
    if init == "olora":
        q, r = torch.linalg.qr(weight)
        return r[:rank], q[:, :rank]
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    root = (s[:rank] / scaling).sqrt()
    return root[:, None] * vh[:rank], u[:, :rank] * root


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_starts_in_float64_equal_the_papers_and_keep_the_model(init):
    base = _mlp(torch.float64)
    model = copy.deepcopy(base)
    inject_lora(model, rank=3, alpha=6, target_modules=["0", "2"], init=init)
    x = torch.randn(4, 16, dtype=torch.float64)
    assert_close(model(x), base(x), rtol=1e-12, atol=1e-12)  # W_res + s B A = W
    for name in ("0", "2"):
        weight, layer = base.get_submodule(name).weight, model.get_submodule(name)
        a, b = _reference(weight.detach(), init, 3, 2.0)
        assert_close(layer.lora_A["default"].weight.detach(), a, rtol=1e-12, atol=1e-12)
        assert_close(layer.lora_B["default"].weight.detach(), b, rtol=1e-12, atol=1e-12)
        assert_close(layer.base_layer.weight.detach(), weight - 2.0 * b @ a, rtol=1e-12, atol=1e-12)


def test_pissa_niter_reconstructs_the_weight_and_spans_the_principal_subspace_in_float64():
    """svd_lowrank is randomised: in float64 its start is checked by W_res + s B A == W and B's column space against
    the exact top-r left singular space (a well separated spectrum, 4 power iterations)."""
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(10, 10, dtype=torch.float64))
    weight = u[:, :10] @ torch.diag(torch.tensor([50.0, 40, 30, 1, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4]).double()) @ v.t()
    layer = nn.Linear(10, 16).double()
    with torch.no_grad():
        layer.weight.copy_(weight)
    model = nn.Sequential(layer)
    inject_lora(model, rank=3, alpha=6, target_modules=["0"], init="pissa_niter_4")
    lora = model[0]
    a, b = lora.lora_A["default"].weight.detach(), lora.lora_B["default"].weight.detach()
    assert_close(lora.base_layer.weight.detach() + 2.0 * b @ a, weight, rtol=1e-12, atol=1e-12)
    projector = u[:, :3] @ u[:, :3].t()
    assert_close(projector @ b, b, rtol=1e-9, atol=1e-9)


def test_pissa_niter_draws_the_same_start_whatever_the_global_seed_and_leaves_the_generator_alone():
    """A resume rebuilds the rewritten base by running the start again: it must not depend on the global generator
    (the projection is drawn from a fork seeded `SEED`), nor move it (the generator after it is where PiSSA's exact
    SVD, which draws nothing, leaves it)."""
    models, states = [], []
    for seed, init in ((1, "pissa_niter_2"), (2, "pissa_niter_2"), (2, "pissa")):
        models.append(copy.deepcopy(_mlp(torch.float64)))
        torch.manual_seed(seed)
        inject_lora(models[-1], rank=3, alpha=6, target_modules=["0", "2"], init=init)
        states.append(torch.get_rng_state())
    for key, value in models[0].state_dict().items():
        assert torch.equal(models[1].state_dict()[key], value), key
    assert torch.equal(states[1], states[2])


def _trained(init: str, dtype=torch.float32, **kwargs) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    base = _mlp(dtype)
    model = copy.deepcopy(base)
    inject_lora(model, rank=3, alpha=6, target_modules=["0", "2"], init=init, **kwargs)
    x = torch.randn(4, 16, dtype=dtype)
    _step(model, x)
    return model.eval(), base, x


def test_a_plain_save_is_refused_and_nothing_is_written(tmp_path):
    model, _, _ = _trained("pissa")
    with pytest.raises(ValueError, match=r"save_adapter: adapter 'default' started with init='pissa', which rewrote "
                                         r"the base weights; .* pass save_adapter\(\.\.\., convert_to_lora=True\)"):
        save_adapter(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_the_converted_save_is_a_plain_lora_of_the_original_base(init, use_rslora, tmp_path):
    """Rank 2r, alpha doubled (rsLoRA: times sqrt(2)): PEFT and we load it onto the original base and compute the
    trained model."""
    model, base, x = _trained(init, torch.float64, use_rslora=use_rslora)
    save_adapter(model, tmp_path, convert_to_lora=True)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["init_lora_weights"]) == (
        6, 6 * (math.sqrt(2) if use_rslora else 2), True)
    expected = model(x)
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    assert_close(theirs(x), expected, rtol=1e-12, atol=1e-12)
    mine = load_adapter(copy.deepcopy(base), tmp_path).eval()
    assert_close(mine(x), expected, rtol=1e-12, atol=1e-12)


def test_the_converted_save_equals_peft_conversion(tmp_path):
    """PEFT's save_pretrained(path_initial_model_for_weight_conversion=...) writes the same tensors and settings."""
    base = _mlp()
    theirs, ours = _pair("pissa", base)
    theirs.peft_config["default"].init_lora_weights = True  # PEFT's recipe: the initial adapter, saved as plain
    theirs.save_pretrained(tmp_path / "initial")
    theirs.peft_config["default"].init_lora_weights = "pissa"
    x = torch.randn(4, 16)
    _step(theirs, x)
    _step(ours, x)
    theirs.save_pretrained(tmp_path / "theirs", path_initial_model_for_weight_conversion=str(tmp_path / "initial"))
    save_adapter(ours, tmp_path / "ours", convert_to_lora=True)
    files = [load_file(tmp_path / side / "adapter_model.safetensors") for side in ("ours", "theirs")]
    assert files[0].keys() == files[1].keys()
    for key, value in files[1].items():
        assert torch.equal(files[0][key], value), key
    configs = [json.loads((tmp_path / side / "adapter_config.json").read_text()) for side in ("ours", "theirs")]
    for field in ("r", "lora_alpha", "init_lora_weights", "use_rslora"):
        assert configs[0][field] == configs[1][field], field


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_peft_files_of_these_starts_load_as_peft_loads_them(init, tmp_path):
    """PEFT's plain save keeps init_lora_weights='pissa': loading re-runs the start on the original base, in PEFT and
    here, before the trained factors are loaded."""
    base = _mlp()
    theirs, _ = _pair(init, base)
    x = torch.randn(4, 16)
    _step(theirs, x)
    theirs.save_pretrained(tmp_path)
    expected = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()(x)
    mine = load_adapter(copy.deepcopy(base), tmp_path).eval()
    assert_close(mine(x), expected, rtol=1e-6, atol=1e-6)
    assert_close(mine(x), theirs.eval()(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("init", ["pissa", "olora", "loftq"])
def test_the_merged_export_is_the_trained_model(init):
    model, base, x = _trained(init, quantize="nf4" if init == "loftq" else None)
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(merged_state_dict(model))
    assert_close(fresh(x), model(x), rtol=1e-5, atol=1e-5)


def _loftq_reference(weight, rank, scaling, iterations, round_trip):
    """LoftQ, Algorithm 1 of arXiv:2310.08659: Q_t = q(W - A_{t-1} B_{t-1}^T), A_t B_t^T = SVD_r(W - Q_t); here the
    factors carry 1/sqrt(s) each so that s B A is the SVD term."""
    low_rank = torch.zeros_like(weight)
    for _ in range(iterations):
        quantized_base = round_trip(weight - low_rank)
        u, s, vh = torch.linalg.svd(weight - quantized_base, full_matrices=False)
        low_rank = u[:, :rank] @ torch.diag(s[:rank]) @ vh[:rank]
        root = (s[:rank] / scaling).sqrt()
        a, b = root[:, None] * vh[:rank], u[:, :rank] * root
    return a, b, quantized_base


@pytest.mark.parametrize("iterations", [1, 3])
def test_loftq_with_our_nf4_equals_the_paper_in_float64(iterations):
    """PEFT's loftq_init runs on CUDA (bitsandbytes) only; the algorithm is checked against the paper's, with our NF4.
    The scale is 4 (alpha 8, rank 2): the model starts at Q + L R, not PEFT's Q + s L R (peft#1982)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 16)).double()
    weight = base[0].weight.detach().clone()
    model = copy.deepcopy(base)
    init = "loftq" if iterations == 1 else f"loftq_iter_{iterations}"
    inject_lora(model, rank=2, alpha=8, target_modules=["0"], init=init, quantize="nf4")
    a, b, q = _loftq_reference(weight, 2, 4.0, iterations, lambda w: dense_weight(quantized(w, "nf4")))
    layer = model[0]
    assert is_quantized(layer.base_layer.weight)
    assert_close(dense_weight(layer.base_layer.weight), q, rtol=1e-12, atol=1e-12)
    assert_close(layer.lora_A["default"].weight.detach(), a, rtol=1e-12, atol=1e-12)
    assert_close(layer.lora_B["default"].weight.detach(), b, rtol=1e-12, atol=1e-12)
    x = torch.randn(3, 32, dtype=torch.float64)
    assert_close(model(x), x @ (q + 4.0 * b @ a).t() + base[0].bias, rtol=1e-12, atol=1e-12)
    plain_error = (weight - dense_weight(quantized(weight, "nf4"))).norm()
    assert (weight - q - 4.0 * b @ a).norm() < plain_error  # LoftQ starts closer to W than QLoRA's quant(W)


def test_loftq_is_saved_only_merged(tmp_path):
    model, _, _ = _trained("loftq", quantize="nf4")
    with pytest.raises(ValueError, match=r"started with init='loftq', .* only its merged export"):
        save_adapter(model, tmp_path, convert_to_lora=True)


def test_peft_loftq_config_maps_to_our_quantizer():
    config = peft.LoraConfig(r=2, target_modules=["0"], init_lora_weights="loftq",
                             loftq_config=peft.LoftQConfig(loftq_bits=4, loftq_iter=3))
    ours = LoRAConfig.from_peft(config)
    assert (ours.init, ours.quantize) == ("loftq_iter_3", "nf4")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"init": "eva"}, ValueError, r"LoRA\(init='eva'\): init must be one of .* It needs a pass over training data"),
    ({"init": "corda"}, ValueError, r"LoRA\(init='corda'\): .* It needs a pass over training data"),
    ({"init": "loftq"}, ValueError, r"LoRA\(init='loftq'\): LoftQ .* needs a quantized base; pass quantize='nf4'"),
    ({"init": "loftq", "quantize": "nf4", "use_dora": True, "target_modules": ["0"]}, ValueError, r"LoftQ with use_dora=True"),
    ({"init": "pissa", "rank": 7, "target_modules": ["0"]}, ValueError, r"rank 7 at '0' exceeds min\(6, 4\)"),
    ({"init": "olora", "target_modules": ["1"]}, TypeError, r"'1' is a Embedding; this start is implemented for"),
    ({"init": "pissa", "quantize": "nf4", "target_modules": ["0"]}, ValueError,
     r"layer '0' cannot be quantized with 'nf4'"),
])
def test_starts_that_cannot_run_are_refused_before_anything_changes(kwargs, error, match):
    model = nn.ModuleDict({"0": nn.Linear(4, 6), "1": nn.Embedding(5, 4)})
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=match):
        inject_lora(model, **{"rank": 2, "target_modules": ["0", "1"], **kwargs})
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_start_that_rewrites_a_base_another_adapter_uses_is_refused():
    model = _mlp()
    inject_lora(model, rank=2, target_modules=["0"])
    with pytest.raises(ValueError, match=r"'0' already has LoRA adapter\(s\) \['default'\]; this start rewrites"):
        add_adapter(model, "other", rank=2, target_modules=["0"], init="pissa")


def test_the_callback_takes_the_starts():
    from lightning_peft.callbacks import LoRA

    assert LoRA(init="pissa_niter_4").config.init == "pissa_niter_4"
    with pytest.raises(ValueError, match=r"LoRA\(init='eva'\)"):
        LoRA(init="eva")
