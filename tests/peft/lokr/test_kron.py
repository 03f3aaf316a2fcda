"""LoKr's pure math (`lightning_peft.peft.lokr.kron`) against Hugging Face PEFT's ``LoKrLayer`` on the same tensors:
the factorization, the factors' names and shapes, their initialisation (one seed, the same values) and the delta
weight, for every layer kind and factor choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
from peft.tuners.lokr import layer as peft_lokr

from lightning_peft.peft.lokr.kron import factor_shapes, factorization, init_factors, kron_weight

LAYERS = {
    "linear": lambda: nn.Linear(10, 20),
    "linear-out2": lambda: nn.Linear(20, 2),
    "linear-square": lambda: nn.Linear(64, 64),
    "conv1d": lambda: nn.Conv1d(2, 6, 3),
    "conv1d-bigger": lambda: nn.Conv1d(64, 16, 2),
    "conv1d-groups": lambda: nn.Conv1d(8, 8, 3, groups=2),
    "conv1d-kernel1": lambda: nn.Conv1d(12, 10, 1),
    "conv2d": lambda: nn.Conv2d(2, 6, 3),
    "conv2d-wide": lambda: nn.Conv2d(36, 48, (3, 2)),
    "conv2d-groups": lambda: nn.Conv2d(4, 6, 3, groups=2),
    "conv2d-1x1": lambda: nn.Conv2d(12, 10, 1),
}
OPTIONS = [
    {"r": 8}, {"r": 1}, {"r": 2}, {"r": 1, "decompose_both": True}, {"r": 2, "use_effective_conv2d": True},
    {"r": 1, "use_effective_conv2d": True, "decompose_both": True}, {"r": 2, "decompose_factor": 4},
    {"r": 1, "use_effective_conv2d": True, "decompose_factor": 4, "decompose_both": True, "alpha": 3},
]


def peft_layer(kind: str, options: dict, init_weights=False) -> nn.Module:
    torch.manual_seed(0)
    base = LAYERS[kind]().double()
    options = dict(options)
    r, alpha = options.pop("r"), options.pop("alpha", 8)
    config = peft.LoKrConfig(r=r, alpha=alpha, init_weights=init_weights, **options)
    cls = {nn.Linear: peft_lokr.Linear, nn.Conv1d: peft_lokr.Conv1d, nn.Conv2d: peft_lokr.Conv2d}[type(base)]
    torch.manual_seed(1)
    return cls(base, "default", config=config, r=r, alpha=alpha)


def ours(layer: nn.Module, options: dict) -> dict[str, tuple[int, ...]]:
    base = layer.base_layer
    keys = ("decompose_both", "decompose_factor", "use_effective_conv2d")
    return factor_shapes(tuple(base.weight.shape), options["r"],
                         **{k: v for k, v in options.items() if k in keys})


def their_factors(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {name: getattr(layer, name)["default"] for name in layer.adapter_layer_names
            if "default" in getattr(layer, name)}


def test_factorization_equals_peft():
    for dimension in [*range(1, 130), 256, 768, 1000, 1024, 3072, 4096, 11008]:
        for factor in (-1, 1, 2, 3, 4, 5, 8, 16, 64):
            assert factorization(dimension, factor) == peft_lokr.factorization(dimension, factor), (dimension, factor)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("kind", list(LAYERS))
def test_factors_and_delta_weight_equal_peft(kind, options):
    layer = peft_layer(kind, options)
    theirs = their_factors(layer)
    shapes = ours(layer, options)
    assert shapes == {name: tuple(t.shape) for name, t in theirs.items()}
    for name in theirs:  # no factor at zero: a misplaced one cannot pass
        assert theirs[name].abs().min() > 0 or theirs[name].numel() == 0, name
    try:
        expected = layer.get_delta_weight("default")
    except RuntimeError as err:  # PEFT's torch.kron on a Tucker w2 with odd strides (r = 1): the same, cloned
        assert "view size is not compatible" in str(err) and "lokr_t2" in theirs
        w1 = theirs["lokr_w1"] if "lokr_w1" in theirs else theirs["lokr_w1_a"] @ theirs["lokr_w1_b"]
        w2 = peft_lokr.make_weight_cp(theirs["lokr_t2"], theirs["lokr_w2_a"], theirs["lokr_w2_b"])
        w1, w2 = (t.clone(memory_format=torch.contiguous_format) for t in (w1[:, :, None, None], w2))
        expected = torch.kron(w1, w2).mul(layer.scaling["default"]).reshape(layer.base_layer.weight.shape)
    got = kron_weight(theirs, layer.scaling["default"], layer.base_layer.weight.shape)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert got.abs().max() > 0


@pytest.mark.parametrize("init_weights", [True, False, "lycoris"])
@pytest.mark.parametrize(("kind", "options"), [("linear", {"r": 8}), ("linear-square", {"r": 2, "decompose_both": True}),
                                               ("conv2d-wide", {"r": 2, "use_effective_conv2d": True}),
                                               ("conv1d-bigger", {"r": 1})])
def test_init_equals_peft(kind, options, init_weights):
    layer = peft_layer(kind, options, init_weights)
    theirs = their_factors(layer)
    mine = {name: torch.empty(shape) for name, shape in ours(layer, options).items()}
    torch.manual_seed(1)
    init_factors(mine, init_weights)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name].double(), value, rtol=0, atol=0)  # PEFT: drawn in float32, cast
    delta = kron_weight(mine, 1.0, layer.base_layer.weight.shape)
    assert (delta.abs().max() == 0) == (init_weights is not False)


def test_conv1d_full_w2_is_peft_index_order_not_a_plain_kronecker():
    """PEFT's quirk, kept: a Conv1d with a full 3-D w2 is not ``kron(w1[..., None], w2)`` (what Conv2d's path does)."""
    layer = peft_layer("conv1d", {"r": 8})
    factors = their_factors(layer)
    assert set(factors) == {"lokr_w1", "lokr_w2"}
    plain = torch.kron(factors["lokr_w1"][:, :, None], factors["lokr_w2"]) * layer.scaling["default"]
    got = kron_weight(factors, layer.scaling["default"], layer.base_layer.weight.shape)
    torch.testing.assert_close(got, layer.get_delta_weight("default"), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, plain)
