"""LoHa's own behaviour beyond PEFT's rows (tests/peft/loha/test_peft_cases.py): refusals, dropout in training and in
evaluation, exact merges and unloads, the two deliberate differences from PEFT (an all-dropped rank draw, PEFT's
Tucker gradient), the checks of a file loaded into an existing adapter or torn."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_peft.peft import (
    LoHaConfig,
    inject_loha,
    load_adapter,
    merged_state_dict,
    save_adapter,
    unload_loha,
)
from lightning_peft.peft.loha import disable_loha, loha_layers, merge_loha, unmerge_loha
from tests.peft._oracle import adapted_pair, close, inputs, outputs, peft
from tests.peft.loha._oracle import LOHA


def mlp(**config) -> tuple[nn.Module, nn.Module]:
    """(the float64 base MLP of PEFT's rows, a copy with LoHa ``config``, every factor random)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)).double().eval()
    model = copy.deepcopy(base)
    inject_loha(model, init_weights=False, **config)
    return base, model.eval()


def reference(layer, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """A Linear LoHa layer's output written out: W x + b + (keep ⊙ alpha / r (w1a w1b) ⊙ (w2a w2b)) x."""
    delta = (layer.hada_w1_a @ layer.hada_w1_b) * (layer.hada_w2_a @ layer.hada_w2_b) * layer.alpha / layer.r
    if keep is not None:
        delta = delta * keep[:, None]
    return layer.base_layer(x) + x @ delta.T


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"target_modules": ["0"], "r": 0}, ValueError, r"LoHa\(r=0\): r must be an integer >= 1"),
    ({"target_modules": ["0"], "alpha": -1}, ValueError, r"LoHa\(alpha=-1\): alpha must be a finite number > 0"),
    ({"target_modules": ["0"], "rank_dropout": 1.0}, ValueError,
     r"LoHa\(rank_dropout=1\.0\): rank_dropout must be a number in \[0, 1\)"),
    ({"target_modules": ["0"], "module_dropout": "x"}, TypeError, r"LoHa\(module_dropout='x'\)"),
    ({"target_modules": []}, TypeError, r"LoHa\(target_modules=\[\]\): give a non-empty list of module names"),
    ({"target_modules": ["0"], "init_weights": 1}, TypeError, r"LoHa\(init_weights=1\): .* True or False"),
    ({"target_modules": ["0"], "use_effective_conv2d": "yes"}, TypeError, r"LoHa\(use_effective_conv2d='yes'\)"),
    ({"target_modules": ["0"], "rank_pattern": {"(": 2}}, ValueError, r"LoHa\(rank_pattern key='\('\)"),
    ({"target_modules": ["0"], "alpha_pattern": [2]}, TypeError, r"LoHa\(alpha_pattern=\[2\]\): give a dict"),
    ({"target_modules": ["0"], "layers_pattern": "layers"}, ValueError,
     r"LoHa\(layers_pattern='layers'\): layers_pattern only says where layers_to_transform counts layers"),
    ({"target_modules": "0", "layers_to_transform": [0]}, ValueError,
     r"LoHa\(layers_to_transform=\[0\], target_modules='0'\): layers_to_transform needs target_modules as a list"),
    ({"target_modules": ["0"], "rank": 4}, TypeError,
     r"inject_loha: unknown argument 'rank'; LoHa layers take target_modules, exclude_modules, r, alpha"),
])
def test_bad_settings_are_refused_naming_the_argument(kwargs, error, message):
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(error, match=message):
        inject_loha(model, **kwargs)
    assert type(model[0]) is nn.Linear


def test_a_layer_peft_has_no_loha_for_and_a_second_injection_are_refused_before_anything_changes():
    model = nn.Sequential(nn.Conv3d(2, 3, 1), nn.Linear(3, 3))
    with pytest.raises(TypeError, match=r"LoHa\(target_modules=\['0', '1'\]\): '0' is a Conv3d; LoHa adapts nn\.Linear, "
                                        r"nn\.Conv1d, nn\.Conv2d \(Hugging Face PEFT's LoHa layers\)\. Sequential has: 1"):
        inject_loha(model, target_modules=["0", "1"])
    assert isinstance(model[1], nn.Linear) and all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match=r"LoHa\(target_modules=\['2'\]\) matched no module of Sequential\. Modules "
                                         r"it can adapt: 1\."):
        inject_loha(model, target_modules=["2"])
    inject_loha(model, target_modules=["1"])
    with pytest.raises(RuntimeError, match=r"inject_loha: Sequential already has LoHa layers \(e\.g\. '1'\); LoHa "
                                           r"injected twice"):
        inject_loha(model, target_modules=["1"])


def test_the_default_start_is_the_base_model_and_only_the_factors_train():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)).double()
    model = copy.deepcopy(base)
    layers = inject_loha(model, target_modules=["0", "2"], r=3)
    x = inputs(base)
    assert torch.equal(outputs(model, x), outputs(base, x))  # hada_w2_b starts at zero
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{i}.hada_{w}" for i in (0, 2) for w in ("w1_a", "w1_b", "w2_a", "w2_b")}
    assert layers["0"].hada_w1_a.shape == (20, 3) and layers["2"].hada_w2_b.shape == (3, 20)


def test_exclude_modules_and_layers_to_transform_pick_the_modules_peft_picks():
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(3))
            self.model = nn.ModuleDict({"layers": layers})  # model.layers.<i>.<j>: PEFT finds the index there

        def forward(self, x):  # (B, 4) -> (B, 4)
            for layer in self.model["layers"]:
                x = layer(x)
            return x

    for config in ({"target_modules": ["0", "1"], "layers_to_transform": [0, 2], "layers_pattern": "layers"},
                   {"target_modules": ["1"], "layers_to_transform": 1},
                   {"target_modules": r".*layers\.\d\.\d", "exclude_modules": ["2.0"]}):
        theirs = peft.get_peft_model(Stack(), peft.LoHaConfig(**config))
        expected = sorted(n.removeprefix("base_model.model.") for n, m in theirs.named_modules()
                          if n.endswith(tuple("01")) and hasattr(m, "hada_w1_a"))
        ours = Stack()
        assert sorted(inject_loha(ours, **config)) == expected, config
    with pytest.raises(ValueError, match=r"LoHa\(layers_to_transform=\[5\]\): there is no layer 5"):
        inject_loha(Stack(), target_modules=["0"], layers_to_transform=[5])
    with pytest.raises(ValueError, match=r"LoHa\(exclude_modules=\['3'\]\): '3' matched no module"):
        inject_loha(Stack(), target_modules=["0"], exclude_modules=["3"])


def test_all_linear_picks_what_peft_picks_and_a_transformers_conv1d_among_them_is_refused():
    from tests._models import bert_model, gpt2_model

    torch.manual_seed(0)
    base = bert_model().eval()
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoHaConfig(target_modules="all-linear", task_type="SEQ_CLS"))
    expected = sorted(n.removeprefix("base_model.model.") for n, m in theirs.named_modules() if hasattr(m, "hada_w1_a"))
    ours = copy.deepcopy(base)
    assert sorted(inject_loha(ours, target_modules="all-linear")) == expected  # every Linear but the classifier
    assert "bert.pooler.dense" in expected
    gpt2 = gpt2_model()
    with pytest.raises(TypeError, match=r"LoHa\(target_modules='all-linear'\): 'transformer\.h\.0\.attn\.c_attn' is a "
                                        r"Conv1D; LoHa adapts nn\.Linear, nn\.Conv1d, nn\.Conv2d"):
        inject_loha(gpt2, target_modules="all-linear")
    assert not loha_layers(gpt2)


def test_evaluation_is_deterministic_and_training_draws_module_and_rank_dropout():
    _, model = mlp(target_modules=["0"], module_dropout=0.5, rank_dropout=0.3)
    layer, x = model[0], inputs(nn.Linear(10, 2))
    with torch.no_grad():
        assert torch.equal(layer(x), layer(x))
        close(layer(x), reference(layer, x), "evaluation: no dropout")
        layer.train()
        seen = set()
        for seed in range(12):
            torch.manual_seed(seed)
            skipped = not torch.rand(1).item() > 0.5  # PEFT's draws, in PEFT's order
            keep = (torch.rand(20) > 0.3).double()
            torch.manual_seed(seed)
            got = layer(x)
            expected = layer.base_layer(x) if skipped else reference(layer, x, keep / keep.mean())
            close(got, expected, f"training, seed {seed}")
            seen.add(skipped)
    assert seen == {True, False}  # both branches ran


def test_a_rank_draw_that_drops_every_row_gives_the_base_output_where_peft_gives_nan():
    config = {"target_modules": ["lin1"], "rank_dropout": 0.5}
    ours, theirs, base = adapted_pair("MLP", config, LOHA)  # lin1 has 2 output rows: a quarter of draws drop both
    x = inputs(base)
    seed = next(s for s in range(100) if not (_draws(s)[1] > 0.5).any())
    for model in (ours, theirs):
        model.train()
    torch.manual_seed(seed)
    mine = ours(x)
    torch.manual_seed(seed)
    peft_out = theirs(x)
    close(mine, outputs(base, x), "all rows dropped: the base output")
    assert torch.isnan(peft_out).all()  # PEFT divides the all-zero mask by its mean, 0


def _draws(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training forward's draws of a one-layer, two-row model after ``torch.manual_seed(seed)``: PEFT's order,
    module dropout's ``rand(1)`` first, then the rank mask's ``rand(2)``."""
    torch.manual_seed(seed)
    return torch.rand(1), torch.rand(2)


def test_peft_gets_the_tucker_gradients_of_w1_a_and_w2_a_wrong_and_ours_are_autograds():
    from peft.tuners.loha.layer import HadaWeightCP

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).double()
    inject_loha(model := nn.Sequential(conv), target_modules=["0"], r=2, use_effective_conv2d=True,
                init_weights=False)
    layer = model[0]
    factors = [layer.hada_t1, layer.hada_w1_a, layer.hada_w1_b, layer.hada_t2, layer.hada_w2_a, layer.hada_w2_b]
    assert torch.autograd.gradcheck(lambda *f: _tucker_delta(*f), factors)
    assert torch.autograd.gradcheck(lambda *f: F.conv2d(torch.ones(1, 3, 4, 4, dtype=torch.float64), _tucker_delta(*f)),
                                    factors)
    grad = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    ours = torch.autograd.grad(layer.delta(), factors, grad)
    theirs = torch.autograd.grad(HadaWeightCP.apply(*factors, torch.tensor(layer.alpha / layer.r)), factors, grad)
    for name, a, b in zip(("t1", "w1_a", "w1_b", "t2", "w2_a", "w2_b"), ours, theirs):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12) == (name not in ("w1_a", "w2_a")), name


def _tucker_delta(t1, w1a, w1b, t2, w2a, w2b):
    """The Tucker form written out: (t1 ×₁ w1aᵀ ×₂ w1bᵀ) ⊙ (t2 ×₁ w2aᵀ ×₂ w2bᵀ), scale 1."""
    def rebuild(t, a, b):
        return torch.einsum("ijkl,ip,jq->pqkl", t, a, b)
    return rebuild(t1, w1a, w1b) * rebuild(t2, w2a, w2b)


@pytest.mark.parametrize("base", [nn.Linear(12, 10), nn.Conv2d(3, 10, 3)], ids=["linear", "tucker"])
def test_backward_keeps_the_factors_not_the_two_weight_sized_products(base):
    model = nn.Sequential(base.double())
    inject_loha(model, target_modules=["0"], r=2, use_effective_conv2d=True, init_weights=False)
    x = torch.randn(4, 12, dtype=torch.float64) if isinstance(base, nn.Linear) else torch.randn(
        4, 3, 5, 5, dtype=torch.float64)
    x.requires_grad_(True)  # as inside a network: the input's gradient needs the weights
    weight_sized = []

    def pack(tensor):
        if tensor.numel() == base.weight.numel():  # a Linear keeps its weights transposed
            weight_sized.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x).sum().backward()
    # the frozen base weight and ΔW (F.linear / the convolution keep them for the input's gradient), not the
    # products (w1_a w1_b) and (w2_a w2_b): those are recomputed in backward
    assert len(weight_sized) == 2, [tuple(t.shape) for t in weight_sized]
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model[0].parameters() if p.requires_grad)


def test_merge_unmerge_unload_and_the_merged_export_all_give_the_adapted_outputs():
    base, model = mlp(target_modules=["0", "2"], r=3, alpha=5)
    x = inputs(nn.Linear(10, 2))
    adapted = outputs(model, x)
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged_state_dict(model))
    close(outputs(plain, x), adapted, "merged export")
    assert torch.equal(plain[0].bias, base[0].bias)  # LoHa leaves the bias alone
    assert merge_loha(model) == ["0", "2"] and merge_loha(model) == []  # idempotent
    close(outputs(model, x), adapted, "merged")
    with pytest.raises(RuntimeError, match=r"disable_loha: the updates are merged .* call unmerge_loha\(model\) "
                                           r"first"), disable_loha(model):
        pass
    unmerge_loha(model)
    close(model[0].base_layer.weight, base[0].weight, "unmerged weight", 1e-15)
    with pytest.raises(RuntimeError, match=r"unmerge_loha: no LoHa layer of Sequential is merged; call merge_loha "
                                           r"first"):
        unmerge_loha(model)
    with disable_loha(model):
        assert torch.equal(outputs(model, x), outputs(base, x))
    merge_loha(model)
    unloaded = unload_loha(copy.deepcopy(model), merge=False)  # merged: subtracted back, then plain
    assert all(torch.allclose(a, b, rtol=1e-14, atol=1e-15) for a, b in zip(unloaded.parameters(), base.parameters()))
    merged = unload_loha(model)
    assert type(merged[0]) is nn.Linear and type(merged[2]) is nn.Linear
    close(outputs(merged, x), adapted, "unloaded merged")
    with pytest.raises(RuntimeError, match=r"merge_loha: Sequential has no LoHa adapter; call inject_loha"):
        merge_loha(merged)


def test_a_tied_weight_is_not_merged_in_place():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    inject_loha(model, target_modules=["0"])
    with pytest.raises(RuntimeError, match=r"merge_loha: the weight of '0' is tied to '1\.weight'; merging in place "
                                           r"would change both"):
        merge_loha(model)


def test_a_reflect_padded_convolution_pads_the_update_as_it_pads_the_base_and_is_not_saved_for_peft(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")).double()
    base = copy.deepcopy(model)
    inject_loha(model, target_modules=["0"], r=2, init_weights=False)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    adapted = outputs(model, x)
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged_state_dict(model))
    close(adapted, outputs(plain, x), "the merged model (W + ΔW, reflect padded)")
    with pytest.raises(ValueError, match=r"save_adapter: Hugging Face PEFT would run this loha adapter differently: "
                                         r"'0' is a convolution with padding_mode='reflect', and PEFT's LoHa pads the "
                                         r"update with zeros"):
        save_adapter(model, tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_file_for_another_alpha_or_a_torn_file_is_refused_before_loading(tmp_path):
    ours, _, base = adapted_pair("MLP", {"target_modules": ["lin0"], "r": 4, "alpha": 8}, LOHA)
    save_adapter(ours, tmp_path)
    other = copy.deepcopy(base)
    inject_loha(other, target_modules=["lin0"], r=4, alpha=2)
    with pytest.raises(ValueError, match=r"load_adapter: .*adapter_config\.json gives 'lin0' alpha=8, but the model's "
                                         r"LoHa adapter has alpha=2\. Load it into a model without LoHa"):
        load_adapter(other, tmp_path)
    same = copy.deepcopy(base)
    inject_loha(same, target_modules=["lin0"], r=4, alpha=8)
    x = inputs(base)
    close(outputs(load_adapter(same, tmp_path), x), outputs(ours, x), "loaded into the existing adapter")

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    fresh = copy.deepcopy(base)
    with pytest.raises(ValueError, match=r"key base_model\.model\.lin0\.hada_w1_a has shape \(20, 4\) .* but its own "
                                         r"config .* says r=64"):
        load_adapter(fresh, tmp_path)
    assert not loha_layers(fresh)


def test_config_round_trips_through_peft_and_our_dict():
    config = LoHaConfig(target_modules={"b", "a"}, r=4, alpha=2.5, rank_pattern={"a": 2}, use_effective_conv2d=True)
    assert config.target_modules == ["a", "b"]
    assert LoHaConfig(**config.to_dict()) == config
    theirs = peft.LoHaConfig(**{k: v for k, v in config.to_dict().items()})
    assert LoHaConfig.from_peft(theirs) == config
    with pytest.raises(ValueError, match=r"load_adapter: peft\.LoHaConfig has peft_type='LORA', not 'LOHA'"):
        LoHaConfig.from_peft({"peft_type": "LORA", "target_modules": ["a"]})
