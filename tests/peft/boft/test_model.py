"""BOFT's own behaviour beyond PEFT's rows (tests/peft/boft/test_peft_cases.py): the butterfly product is orthogonal
and dense, PEFT's CPU files (one factor, config saying more) are refused with the fix, refusals, merges."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from lightning_peft.peft import inject_boft, load_adapter, merged_state_dict, save_adapter, unload_boft
from lightning_peft.peft.boft import boft_layers, merge_boft, unmerge_boft
from lightning_peft.peft.boft.layer import butterfly_order
from tests.peft._oracle import adapted_pair, base_model, close, inputs, outputs, peft
from tests.peft.boft._oracle import BOFT, peft_with_kernel

pytestmark = [pytest.mark.filterwarnings("ignore:Failed to load the CUDA extension:UserWarning"),
              pytest.mark.filterwarnings("ignore:Setting boft_n_butterfly_factor to 1:UserWarning")]


def randomised(model: nn.Module, seed: int = 1) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in boft_layers(model).values():
            for p in (layer.boft_R, layer.boft_s):
                p.add_(0.3 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


def test_the_butterfly_product_is_orthogonal_dense_and_is_what_the_merge_applies():
    base = base_model("MLP2")
    model = copy.deepcopy(base)
    inject_boft(model, target_modules=["lin1"], boft_block_size=2, boft_n_butterfly_factor=5)  # 16 blocks: log2 + 1
    randomised(model)
    layer = model.lin1
    blocks = layer.rotations()
    product = torch.eye(32, dtype=torch.float64)
    for i in range(5):  # F_i = P_i B_i P_i^T with P_i[k, idx[k]] = 1, M = F_4 ... F_0
        perm = torch.eye(32, dtype=torch.float64)[butterfly_order(32, 16 // 2**i, 1, 5)]
        product = perm @ torch.block_diag(*blocks[i]) @ perm.T @ product
    torch.testing.assert_close(product @ product.T, torch.eye(32, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (product.abs() > 1e-12).all()  # log2(blocks) + 1 factors of 2x2 blocks reach every pair of features
    expected = layer.boft_s.detach() * (base.lin1.weight @ product.T)
    close(merged_state_dict(model)["lin1.weight"], expected, "s ⊙ W M^T")


def test_peft_on_a_cpu_trains_one_factor_and_says_two_and_its_file_is_refused_with_the_fix(tmp_path):
    base = base_model("MLP")
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.BOFTConfig(
        target_modules=["lin1"], boft_block_size=10, boft_n_butterfly_factor=2, init_weights=False))
    assert theirs.base_model.model.lin1.boft_R["default"].shape[0] == 1  # one factor: no CUDA kernel here
    theirs.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["boft_n_butterfly_factor"] == 2
    with pytest.raises(ValueError, match=r"load_adapter: .*adapter_config\.json says boft_n_butterfly_factor=2, but "
                                         r"lin1\.boft_R holds 1 factor\(s\): PEFT without its CUDA extension .* Set "
                                         r"boft_n_butterfly_factor to 1 in that adapter_config\.json"):
        load_adapter(copy.deepcopy(base), tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "boft_n_butterfly_factor": 1}))
    x = inputs(base)
    close(outputs(load_adapter(copy.deepcopy(base), tmp_path), x), outputs(theirs.eval(), x), "what PEFT trained")


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"target_modules": ["lin1"], "boft_block_size": 3}, ValueError,
     (r"BOFT\(boft_block_size=3, boft_n_butterfly_factor=1\): 'lin1' \(Linear\) rotates 20 features, which do not "
     r"split into blocks of 3 .* boft_block_size that fit: \[1, 2, 4, 5, 10, 20\]")),
    ({"target_modules": ["lin1"], "boft_block_size": 5, "boft_n_butterfly_factor": 2}, ValueError,
     r"rotates 20 features, .* boft_block_size that fit: \[2, 10\]"),
    ({"target_modules": ["lin1"], "boft_block_size": 2, "boft_block_num": 10}, ValueError,
     r"BOFT\(boft_block_size=2, boft_block_num=10\): give exactly one of them"),
    ({"target_modules": ["lin1"], "boft_n_butterfly_factor": 0}, ValueError,
     r"BOFT\(boft_n_butterfly_factor=0\): boft_n_butterfly_factor must be an integer >= 1"),
    ({"target_modules": "all-linear"}, ValueError, r"BOFT\(target_modules='all-linear'\): not supported"),
    ({"target_modules": ["lin1"], "bias": "oft_only"}, ValueError, r"BOFT\(bias='oft_only'\): bias must be one of"),
])
def test_bad_settings_are_refused_before_anything_changes(kwargs, error, message):
    model = base_model("MLP")
    with pytest.raises(error, match=message):
        inject_boft(model, **kwargs)
    assert type(model.lin1) is nn.Linear


def test_layers_peft_has_no_boft_for_are_refused():
    model = nn.Sequential(nn.Embedding(4, 4), nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(TypeError, match=r"BOFT\(target_modules=\['0'\]\): '0' is a Embedding; BOFT rotates nn\.Linear, "
                                        r"nn\.Conv2d"):
        inject_boft(model, target_modules=["0"])
    with pytest.raises(ValueError, match=r"BOFT: the Conv2d '1' has groups=2; PEFT's BOFT format has square"):
        inject_boft(model, target_modules=["1"], boft_block_size=2)


def test_merge_unmerge_unload_give_the_adapted_outputs(monkeypatch):
    peft_with_kernel(monkeypatch)  # PEFT's side of the pair, with every factor
    ours, _, base = adapted_pair("Conv2d2", {"target_modules": ["conv2d"], "boft_block_size": 2,
                                             "boft_n_butterfly_factor": 3}, BOFT)
    x = inputs(base)
    adapted = outputs(ours, x)
    assert merge_boft(ours) == ["conv2d"]
    close(outputs(ours, x), adapted, "merged")
    unmerge_boft(ours)
    close(ours.conv2d.base_layer.weight, base.conv2d.weight, "unmerged weight", 1e-13)
    unloaded = unload_boft(ours)
    assert type(unloaded.conv2d) is nn.Conv2d
    close(outputs(unloaded, x), adapted, "unloaded merged")


def test_our_three_factor_file_round_trips(tmp_path, monkeypatch):
    peft_with_kernel(monkeypatch)
    ours, _, base = adapted_pair("MLP2", {"target_modules": ["lin1"], "boft_block_num": 8,
                                          "boft_n_butterfly_factor": 3, "boft_block_size": 0}, BOFT)
    save_adapter(ours, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["boft_n_butterfly_factor"] == 3
    x = inputs(base)
    close(outputs(load_adapter(copy.deepcopy(base), tmp_path), x), outputs(ours, x), "reloaded")
