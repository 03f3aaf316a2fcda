"""LoKr's own behaviour beyond PEFT's rows (tests/peft/lokr/test_peft_cases.py): its settings and their refusals, the
three initialisations, the Kronecker structure of the update, and where it deliberately differs from PEFT (the rank
dropout's rescale in the update's dtype; a Tucker factor PEFT's ``torch.kron`` cannot build)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_peft.peft import LoKrConfig, inject_lokr, load_adapter, save_adapter
from lightning_peft.peft.lokr import lokr_layers
from tests.peft._oracle import adapted_pair, close, inputs, outputs, peft
from tests.peft.lokr._oracle import LOKR


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)).double().eval()


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"decompose_factor": 0}, ValueError, r"LoKr\(decompose_factor=0\): give -1 .* or a positive factor"),
    ({"decompose_factor": -2}, ValueError, r"LoKr\(decompose_factor=-2\)"),
    ({"decompose_factor": 2.5}, TypeError, r"LoKr\(decompose_factor=2\.5\)"),
    ({"decompose_both": "yes"}, TypeError, r"LoKr\(decompose_both='yes'\)"),
    ({"rank_dropout_scale": 1}, TypeError, r"LoKr\(rank_dropout_scale=1\)"),
    ({"init_weights": "gaussian"}, TypeError, r"LoKr\(init_weights='gaussian'\)"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        LoKrConfig(**{"target_modules": ["0"], **kwargs})


def test_peft_config_translates_with_lokr_fields_and_back():
    theirs = peft.LoKrConfig(target_modules=["q", "v"], r=4, alpha=2, decompose_both=True, decompose_factor=8,
                             rank_dropout_scale=True, init_weights="lycoris", use_effective_conv2d=True,
                             rank_pattern={"q": 2}, alpha_pattern={"v": 16})
    ours = LoKrConfig.from_peft(theirs)
    assert ours == LoKrConfig(target_modules=["q", "v"], r=4, alpha=2, decompose_both=True, decompose_factor=8,
                              rank_dropout_scale=True, init_weights="lycoris", use_effective_conv2d=True,
                              rank_pattern={"q": 2}, alpha_pattern={"v": 16})
    assert LoKrConfig(**ours.to_dict()) == ours
    with pytest.raises(ValueError, match=r"load_adapter: peft\.LoKrConfig holds a value LoKr refuses: .*decompose_"):
        LoKrConfig.from_peft({**theirs.to_dict(), "decompose_factor": 0})


@pytest.mark.parametrize(("init_weights", "zero"), [(True, "lokr_w1"), ("lycoris", "lokr_w2_b"), (False, None)])
def test_the_three_initialisations(init_weights, zero):
    base = mlp()
    model = copy.deepcopy(base)
    layer = inject_lokr(model, target_modules=["0"], r=2, init_weights=init_weights)["0"]
    # Linear(10, 20): out 20 = 4 * 5, in 10 = 2 * 5; r = 2 < 5 / 2: W2 low-rank
    assert {n: tuple(p.shape) for n, p in layer.factors().items()} == {
        "lokr_w1": (4, 2), "lokr_w2_a": (5, 2), "lokr_w2_b": (2, 5)}
    assert [n for n, p in layer.factors().items() if not p.any()] == ([zero] if zero else [])
    x = inputs(base)
    same = torch.equal(outputs(model, x), outputs(base, x))
    assert same == (zero is not None)


def test_the_update_is_the_kronecker_product_of_the_factors():
    model = mlp()
    layer = inject_lokr(model, target_modules=["0"], r=8, init_weights=False)["0"]
    w1, w2 = layer.lokr_w1.detach(), layer.lokr_w2.detach()  # (4, 2), (5, 5): r = 8 >= 5 / 2, W2 full
    expected = torch.empty(20, 10, dtype=torch.float64)
    for i in range(4):
        for j in range(2):
            expected[i * 5:(i + 1) * 5, j * 5:(j + 1) * 5] = w1[i, j] * w2  # block (i, j) is W1[i, j] W2
    close(layer.delta_weight().detach(), expected)  # alpha / r = 8 / 8
    x = inputs(model)
    hidden = layer.base_layer(x) + x @ expected.T
    close(outputs(model, x), outputs(model[2], model[1](hidden)))


def test_rank_dropout_scale_rescales_in_the_update_dtype_peft_in_float32():
    """PEFT's LoKr divides its rank-dropout mask by the kept share in float32; ours in the update's dtype (float64
    here). The same draws: equal to float32's rounding of the rescale, not to float64's."""
    kwargs = {"target_modules": ["lin0"], "rank_dropout": 0.5, "rank_dropout_scale": True}
    ours, theirs, _ = adapted_pair("MLP", kwargs, LOKR)
    x = inputs(ours)
    ours.train(), theirs.train()
    differences = []
    for seed in range(8):  # a kept share k / 20 whose inverse float32 holds exactly (k = 10) gives no difference
        y = []
        for model in (ours, theirs):
            torch.manual_seed(seed)
            y.append(model(x).detach())
        differences.append((y[0] - y[1]).abs().max().item())
    assert 1e-12 < max(differences) < 1e-6, differences


def test_a_tucker_factor_peft_cannot_build_works_here():
    """Conv1d(8, 8, 3, groups=2) at r=1 with use_effective_conv2d: PEFT's torch.kron raises on the Tucker W2's
    strides; ours builds the same product (its formula, the tensors cloned)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv1d(8, 8, 3, groups=2)).double()
    kwargs = {"target_modules": ["0"], "r": 1, "use_effective_conv2d": True, "init_weights": False}
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoKrConfig(**kwargs))
    x = torch.randn(2, 8, 9, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        theirs(x)
    model = copy.deepcopy(base)
    layer = inject_lokr(model, LoKrConfig.from_peft(peft.LoKrConfig(**kwargs)))["0"]
    f = {name: p.detach() for name, p in layer.factors().items()}
    w2 = torch.einsum("ijkl,ip,jq->pqkl", f["lokr_t2"], f["lokr_w2_a"], f["lokr_w2_b"])  # (4, 2, 3, 1)
    expected = torch.einsum("ij,pqkl->ipjqkl", f["lokr_w1"], w2).reshape(8, 4, 3) * layer.scaling  # kron, by index
    close(layer.delta_weight().detach(), expected)
    close(outputs(model, x), outputs(base, x) + nn.functional.conv1d(x, expected, groups=2))


def test_a_file_with_other_factors_is_refused_by_an_existing_adapter(tmp_path):
    model = mlp()
    inject_lokr(model, target_modules=["0"], r=1, decompose_factor=2)
    save_adapter(model, tmp_path)
    other = mlp()
    inject_lokr(other, target_modules=["0"], r=1)
    with pytest.raises(ValueError, match=r"load_adapter: .* has decompose_factor=2, but the model's LoKr adapter has "
                                         r"-1\. Load it into a model without LoKr\."):
        load_adapter(other, tmp_path)
    fresh = load_adapter(mlp(), tmp_path)
    assert {n: tuple(p.shape) for n, p in lokr_layers(fresh)["0"].factors().items()} == {
        "lokr_w1": (2, 2), "lokr_w2_a": (10, 1), "lokr_w2_b": (1, 5)}
