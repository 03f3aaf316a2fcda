"""OFT's own behaviour beyond PEFT's rows (tests/peft/oft/test_peft_cases.py): the rotation is orthogonal, refusals
with their fixes, the deliberate differences from PEFT 0.21.2 (multiplicative dropout that drops, a Conv2d forward
equal to its merge), COFT's radius, merges and unloads, files PEFT wrote before its OFT changed."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from lightning_peft.peft import (
    OFTConfig,
    inject_oft,
    load_adapter,
    merged_state_dict,
    save_adapter,
    unload_oft,
)
from lightning_peft.peft.oft import disable_oft, merge_oft, oft_layers, unmerge_oft
from lightning_peft.peft.oft.layer import cayley, skew
from tests._models import conv1d
from tests.peft._oracle import adapted_pair, base_model, close, inputs, outputs, peft
from tests.peft.oft._oracle import OFT

pytestmark = pytest.mark.filterwarnings("ignore:Already unmerged:UserWarning")


def randomised(model: nn.Module, seed: int = 1, scale: float = 0.3) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in oft_layers(model).values():
            w = layer.rotation.weight
            w.copy_(scale * torch.randn(w.shape, generator=generator, dtype=w.dtype))
    return model


def mlp(**config) -> tuple[nn.Module, nn.Module]:
    """(the float64 base MLP of PEFT's rows, a copy with OFT ``config`` and random rotations)."""
    base = base_model("MLP")
    model = copy.deepcopy(base)
    inject_oft(model, **config)
    return base, randomised(model)


@pytest.mark.parametrize("shared", [False, True])
def test_the_exact_rotation_is_orthogonal_to_1e_12_and_the_merge_rotates_the_weight(shared):
    base, model = mlp(target_modules=["lin0"], oft_block_size=5, use_cayley_neumann=False, block_share=shared)
    blocks = model.lin0.merge_blocks()
    assert blocks.shape == (2, 5, 5) and (torch.equal(blocks[0], blocks[1]) == shared)
    eye = torch.eye(5, dtype=torch.float64).expand(2, 5, 5)
    torch.testing.assert_close(blocks @ blocks.transpose(-2, -1), eye, rtol=0, atol=1e-12)
    merged = merged_state_dict(model)["lin0.weight"]
    full = torch.block_diag(*blocks)  # M^T
    close(merged, base.lin0.weight @ full, "W M^T")
    # rotations keep the angles between the neurons: W' W'^T == W W^T
    close(merged @ merged.T, base.lin0.weight @ base.lin0.weight.T, "Gram matrix")


def test_the_neumann_series_is_peft_s_including_its_three_terms_equal_to_four():
    q = skew(0.02 * torch.randn(3, 6, dtype=torch.float64), 4)
    torch.testing.assert_close(cayley(q, 3), cayley(q, 4), rtol=0, atol=0)
    exact = cayley(-q, None)  # the series approximates (I + Q)(I - Q)^-1, the exact transform of -Q
    torch.testing.assert_close(cayley(q, 20), exact, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"target_modules": ["lin0"], "r": 3, "oft_block_size": 0}, ValueError,
     (r"OFT\(r=3\): 'lin0' \(Linear\) rotates 10 features, which r=3 does not divide into blocks\. Give r among "
      r"\[1, 2, 5, 10\] \(r \* oft_block_size = 10\)")),
    ({"target_modules": ["lin1"], "oft_block_size": 32}, ValueError,
     r"OFT\(oft_block_size=32\): 'lin1' \(Linear\) rotates 20 features, .* Give oft_block_size among \[1, 2, 4, 5, 10"),
    ({"target_modules": ["lin0"], "r": 10, "oft_block_size": 0}, ValueError,
     r"OFT\(r=10\): 'lin0' would get blocks of size 1, which cannot rotate anything\. Give a smaller r \(at most 5\)"),
    ({"target_modules": ["lin0"], "r": 2, "oft_block_size": 5}, ValueError,
     r"OFT\(r=2, oft_block_size=5\): give exactly one of them and set the other to 0"),
    ({"target_modules": "all-linear"}, ValueError, r"OFT\(target_modules='all-linear'\): not supported .* name the"),
    ({"target_modules": ["lin0"], "bias": "lora_only"}, ValueError, r"OFT\(bias='lora_only'\): bias must be one of"),
    ({"target_modules": ["lin0"], "module_dropout": 1.0}, ValueError, r"OFT\(module_dropout=1\.0\): .* \[0, 1\)"),
    ({"target_modules": ["lin0"], "coft": 1}, TypeError, r"OFT\(coft=1\): coft must be True or False"),
    ({"target_modules": "lin0", "layers_to_transform": [0]}, ValueError,
     r"OFT\(layers_to_transform=\[0\], target_modules='lin0'\): layers_to_transform needs target_modules as a list"),
    ({"target_modules": ["lin0"], "rank": 4}, TypeError, r"inject_oft: unknown argument 'rank'; OFT layers take"),
])
def test_bad_settings_are_refused_before_anything_changes_naming_the_fix(kwargs, error, message):
    base = base_model("MLP")
    model = copy.deepcopy(base)
    with pytest.raises(error, match=message):
        inject_oft(model, **kwargs)
    assert type(model.lin0) is nn.Linear and all(p.requires_grad for p in model.parameters())


def test_layers_peft_has_no_oft_for_are_refused():
    model = nn.Sequential(conv1d(4, 4), nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 4, (3, 1)), nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"OFT\(target_modules=\['0'\]\): '0' is a Conv1D; OFT rotates nn\.Linear, "
                                        r"nn\.Conv2d, nn\.Embedding .*none for transformers Conv1D"):
        inject_oft(model, target_modules=["0"], oft_block_size=2)
    with pytest.raises(ValueError, match=r"OFT: the Conv2d '1' has groups=2; PEFT's OFT format has square, "
                                         r"ungrouped, undilated convolutions only"):
        inject_oft(model, target_modules=["1"], oft_block_size=2)
    with pytest.raises(ValueError, match=r"the Conv2d '2' has kernel_size=\(3, 1\)"):
        inject_oft(model, target_modules=["2"], oft_block_size=2)
    inject_oft(model, target_modules=["3"], oft_block_size=2)
    with pytest.raises(RuntimeError, match=r"inject_oft: Sequential already has OFT layers \(e\.g\. '3'\); OFT "
                                           r"injected twice"):
        inject_oft(model, target_modules=["3"], oft_block_size=2)


def test_module_dropout_drops_whole_blocks_in_training_where_peft_0_21_2_never_calls_its_dropout():
    base, model = mlp(target_modules=["lin0"], oft_block_size=2, module_dropout=0.5)  # 5 blocks: 2 dropped a step
    layer = model.lin0
    x = inputs(base)
    torch.manual_seed(3)
    blocks = layer.rotation.rotations(train=True)
    identity = [bool(torch.equal(b, torch.eye(2, dtype=b.dtype))) for b in blocks]
    assert sum(identity) == 2
    model.train()
    torch.manual_seed(3)
    dropped = model(x)
    close(dropped, base.lin1(base.relu(base.lin0(x @ torch.block_diag(*blocks)))), "training forward")
    model.eval()
    assert not torch.allclose(outputs(model, x), dropped)  # evaluation: every block rotates
    theirs = adapted_pair("MLP", {"target_modules": ["lin0"], "r": 0, "oft_block_size": 2, "module_dropout": 0.5},
                          OFT)[1]
    theirs.train()
    close(theirs(x), outputs(theirs.eval(), x), "PEFT 0.21.2: its training forward does not drop")


def test_a_conv2d_rotates_its_weight_where_peft_0_21_2_s_forward_sums_overlapping_patches():
    ours, theirs, base = adapted_pair("Conv2dPEFT5x5", {"target_modules": ["conv2d"], "r": 5, "oft_block_size": 0},
                                      OFT)
    x = inputs(base)
    unmerged = outputs(theirs, x)
    theirs.merge_adapter()
    close(outputs(ours, x), outputs(theirs, x), "ours unmerged vs PEFT merged")
    assert (unmerged - outputs(theirs, x)).abs().max() > 1e-2  # PEFT's own unmerged forward is not its merge
    fresh = copy.deepcopy(base)
    inject_oft(fresh, target_modules=["conv2d"], r=5, oft_block_size=0)
    close(outputs(fresh, x), outputs(base, x), "ours at the identity")
    peft_fresh = peft.get_peft_model(copy.deepcopy(base), peft.OFTConfig(target_modules=["conv2d"], r=5,
                                                                         oft_block_size=0))
    assert (outputs(peft_fresh, x) - outputs(base, x)).abs().max() > 1e-2  # PEFT's, at the identity, is not the base


def test_coft_keeps_every_block_within_its_radius_after_a_forward():
    base, model = mlp(target_modules=["lin1"], oft_block_size=5, coft=True, eps=1e-2)  # 4 blocks
    model(inputs(base))
    norms = torch.linalg.matrix_norm(skew(model.lin1.rotation.weight.detach(), 5))
    assert torch.all(norms <= 1e-2 / 2 * (1 + 1e-6)) and torch.allclose(norms, torch.full_like(norms, 5e-3))


def test_merge_unmerge_unload_and_the_merged_export_give_the_adapted_outputs():
    base, model = mlp(target_modules=["lin0", "lin1"], oft_block_size=5, use_cayley_neumann=True)
    x = inputs(base)
    adapted = outputs(model, x)
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged_state_dict(model))
    close(outputs(plain, x), adapted, "merged export")
    assert merge_oft(model) == ["lin0", "lin1"] and merge_oft(model) == []
    close(outputs(model, x), adapted, "merged")
    with pytest.raises(RuntimeError, match=r"disable_oft: the rotations are merged .* call unmerge_oft\(model\) first"), \
            disable_oft(model):
        pass
    unmerge_oft(model)
    close(model.lin0.base_layer.weight, base.lin0.weight, "unmerged weight", 1e-13)  # the Neumann form, inverted
    with pytest.raises(RuntimeError, match=r"unmerge_oft: no OFT layer of MLP is merged; call merge_oft first"):
        unmerge_oft(model)
    unloaded = unload_oft(copy.deepcopy(model), merge=False)
    for a, b in zip(unloaded.parameters(), base.parameters()):
        close(a, b, "unloaded without merging", 1e-13)
    merged = unload_oft(model)
    assert type(merged.lin0) is nn.Linear
    close(outputs(merged, x), adapted, "unloaded merged")


@pytest.mark.parametrize(("bias", "biases"), [("oft_only", ["lin0.base_layer.bias"]),
                                             ("all", ["lin0.base_layer.bias", "lin1.bias"])])
def test_trained_biases_train_and_travel_in_peft_s_files_both_ways(bias, biases, tmp_path):
    kwargs = {"target_modules": ["lin0"], "r": 2, "oft_block_size": 0, "bias": bias}
    ours, theirs, base = adapted_pair("MLP", kwargs, OFT)  # random biases too, copied to PEFT's
    assert sorted(n for n, p in ours.named_parameters() if p.requires_grad) == sorted([*biases, "lin0.oft_R.weight"])
    x = inputs(base)
    close(outputs(ours, x), outputs(theirs, x), "forward")
    save_adapter(ours, tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    close(outputs(peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours"), x), outputs(ours, x),
          "PEFT loading ours")
    close(outputs(load_adapter(copy.deepcopy(base), tmp_path / "theirs"), x), outputs(ours, x), "loading PEFT's")


def test_files_of_an_older_peft_oft_are_refused_as_peft_refuses_or_warns(tmp_path):
    ours, _, base = adapted_pair("MLP", {"target_modules": ["lin0"], "r": 2, "oft_block_size": 0}, OFT)
    save_adapter(ours, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_version"] == "0.21.2" and config["use_cayley_neumann"] is True
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "peft_version": "0.17.1"}))
    with pytest.raises(ValueError, match=r"load_adapter: .*adapter_config\.json has use_cayley_neumann=True and "
                                         r"peft_version='0\.17\.1': PEFT before 0\.18 used another Cayley-Neumann"):
        load_adapter(copy.deepcopy(base), tmp_path)
    del config["oft_block_size"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"has no oft_block_size: it was written by PEFT before 0\.14"):
        load_adapter(copy.deepcopy(base), tmp_path)


def test_loading_into_a_model_with_oft_checks_the_rotation_s_settings(tmp_path):
    ours, _, base = adapted_pair("MLP", {"target_modules": ["lin0"], "r": 2, "oft_block_size": 0}, OFT)
    save_adapter(ours, tmp_path)
    other = copy.deepcopy(base)
    inject_oft(other, OFTConfig(target_modules=["lin0"], r=2, oft_block_size=0, use_cayley_neumann=False))
    with pytest.raises(ValueError, match=r"load_adapter: .*adapter_config\.json has use_cayley_neumann=True \(the "
                                         r"model's: False\)\. Load it into a model without OFT"):
        load_adapter(other, tmp_path)
    same = copy.deepcopy(base)
    inject_oft(same, target_modules=["lin0"], r=2, oft_block_size=0)
    x = inputs(base)
    close(outputs(load_adapter(same, tmp_path), x), outputs(ours, x), "loaded into the existing adapter")
