"""Several named IA³ adapters on one model, against PEFT's (``add_adapter`` / ``set_adapter``): outputs per adapter,
merged exports, PEFT's multi-adapter layout both ways, checkpoints, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_peft.peft import load_adapter, merged_state_dict, save_adapter
from lightning_peft.peft.adapter import attached, technique
from lightning_peft.peft.ia3 import (
    IA3Layer,
    active_ia3_adapter,
    add_ia3_adapter,
    delete_ia3_adapter,
    ia3_layers,
    inject_ia3,
    merge_ia3,
    set_ia3_adapter,
    unmerge_ia3,
)
from tests.peft._oracle import PREFIX, base_model, close, inputs, outputs, peft

pytestmark = pytest.mark.filterwarnings("ignore:Unmerge result can be inaccurate:UserWarning")
FIRST = {"target_modules": ["lin0", "lin1"], "feedforward_modules": ["lin1"]}
SECOND = {"target_modules": ["lin0"], "feedforward_modules": []}  # lin1 stays the base under "other"


def pair() -> tuple[nn.Module, nn.Module, nn.Module]:
    """(ours, PEFT's, the base MLP) with adapters ``default`` (FIRST) and ``other`` (SECOND), equal random vectors."""
    base = base_model("MLP")
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.IA3Config(**FIRST)).eval()
    theirs.add_adapter("other", peft.IA3Config(**SECOND))
    ours = copy.deepcopy(base)
    inject_ia3(ours, **FIRST)
    add_ia3_adapter(ours, "other", **SECOND)
    mine, their = dict(ours.named_parameters()), dict(theirs.named_parameters())
    vectors = {k: p for k, p in mine.items() if ".ia3_l." in k}
    assert {PREFIX + k for k in vectors} == {k for k in their if ".ia3_l." in k}  # PEFT's own names
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, p in vectors.items():
            p.add_(0.3 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
            their[PREFIX + key].copy_(p)
    return ours, theirs, base


def test_each_named_adapter_computes_what_peft_computes_and_merges_alone():
    ours, theirs, base = pair()
    x = inputs(base)
    assert active_ia3_adapter(ours) == "default" and attached(ours)["ia3"].names == ("default", "other")
    for name in ("default", "other"):
        set_ia3_adapter(ours, name)
        theirs.set_adapter(name)
        close(outputs(ours, x), outputs(theirs, x), f"adapter {name}")
        plain = copy.deepcopy(base)
        plain.load_state_dict(merged_state_dict(ours, adapter_name=name))
        close(outputs(plain, x), outputs(ours, x), f"merged export of {name}")
    with_other = outputs(ours, x)
    set_ia3_adapter(ours, "default")
    theirs.set_adapter("default")
    assert not torch.allclose(outputs(ours, x), with_other)
    assert merge_ia3(ours) == ["lin0", "lin1"]  # the active adapter's vectors
    close(outputs(ours, x), outputs(theirs, x), "merged in place")
    with pytest.raises(RuntimeError, match=r"set_ia3_adapter\('other'\): layer 'lin0' has an IA³ vector merged into "
                                           r"its weight; call unmerge_ia3\(model\) first"):
        set_ia3_adapter(ours, "other")
    with pytest.raises(RuntimeError, match=r"merged_state_dict: adapter 'default' is merged into the base weights, not "
                                           r"'other'"):
        merged_state_dict(ours, adapter_name="other")
    unmerge_ia3(ours)
    set_ia3_adapter(ours, "other")
    assert merge_ia3(ours) == ["lin0"]  # lin1 has no vector of "other"


def test_only_the_active_adapter_trains():
    ours, _, base = pair()
    set_ia3_adapter(ours, "other")
    ours(inputs(base)).sum().backward()
    grads = {k: p.grad is not None for k, p in ours.named_parameters() if p.requires_grad}
    assert grads == {"lin0.ia3_l.default": False, "lin0.ia3_l.other": True, "lin1.ia3_l.default": False}


def test_peft_multi_adapter_files_load_both_ways(tmp_path):
    ours, theirs, base = pair()
    x = inputs(base)
    save_adapter(ours, tmp_path / "ours")  # default at the root, other in other/ (PEFT's layout)
    assert sorted(p.relative_to(tmp_path / "ours").as_posix() for p in (tmp_path / "ours").rglob("*.json")) == [
        "adapter_config.json", "other/adapter_config.json"]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours").eval()
    loaded.load_adapter(tmp_path / "ours" / "other", adapter_name="other")
    theirs.save_pretrained(tmp_path / "theirs")
    back = load_adapter(copy.deepcopy(base), tmp_path / "theirs")  # both, under their folder's names
    assert attached(back)["ia3"].names == ("default", "other")
    for name in ("default", "other"):
        set_ia3_adapter(ours, name)
        set_ia3_adapter(back, name)
        loaded.set_adapter(name)
        close(outputs(loaded, x), outputs(ours, x), f"PEFT loading our {name}")
        close(outputs(back, x), outputs(ours, x), f"us loading PEFT's {name}")


def test_a_checkpoint_record_rebuilds_every_adapter_and_reads_the_single_adapter_layout():
    ours, _, base = pair()
    set_ia3_adapter(ours, "other")
    x = inputs(base)
    fresh = copy.deepcopy(base)
    technique("ia3").inject(fresh, attached(ours)["ia3"].config_dict())
    fresh.load_state_dict(ours.state_dict())
    assert active_ia3_adapter(fresh) == "other"
    close(outputs(fresh, x), outputs(ours, x), "rebuilt from the record")
    # lightning-peft before named IA³ adapters: one config, keys <module>.ia3_l
    single = copy.deepcopy(base)
    inject_ia3(single, **FIRST)
    old_record = {"config": attached(single)["ia3"].config.to_dict(), "targets": ["lin0", "lin1"],
                  "feedforward": ["lin1"], "modules_to_save": []}
    set_ia3_adapter(ours, "default")
    old_state = {k.replace(".ia3_l.default", ".ia3_l"): v for k, v in ours.state_dict().items() if ".other" not in k}
    older = copy.deepcopy(base)
    technique("ia3").inject(older, old_record)
    older.load_state_dict(old_state)
    close(outputs(older, x), outputs(ours, x), "the single-adapter layout")


def test_deleting_an_adapter_leaves_the_others_and_unwraps_layers_left_without_a_vector():
    base = base_model("MLP")
    ours = copy.deepcopy(base)
    inject_ia3(ours, target_modules=["lin0"])
    add_ia3_adapter(ours, "other", target_modules=["lin1"])
    with pytest.raises(RuntimeError, match=r"delete_ia3_adapter\('default'\): it is the active adapter; "
                                           r"set_ia3_adapter\(model, 'other'\)"):
        delete_ia3_adapter(ours, "default")
    set_ia3_adapter(ours, "other")
    delete_ia3_adapter(ours, "default")
    assert type(ours.lin0) is nn.Linear and isinstance(ours.lin1, IA3Layer) and list(ia3_layers(ours)) == ["lin1"]
    assert [k for k, p in ours.named_parameters() if p.requires_grad] == ["lin1.ia3_l.other"]
    with pytest.raises(RuntimeError, match=r"delete_ia3_adapter\('other'\): it is the model's only IA³ adapter; use "
                                           r"unload_ia3\(model\)"):
        delete_ia3_adapter(ours, "other")


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda m: add_ia3_adapter(m, "default", target_modules=["lin0"]), ValueError,
     r"add_ia3_adapter: the model already has an IA³ adapter named 'default'"),
    (lambda m: add_ia3_adapter(m, "a.b", target_modules=["lin0"]), ValueError,
     r"add_ia3_adapter: adapter name 'a\.b' is not usable; .* ia3_l\.<name>"),
    (lambda m: add_ia3_adapter(m, "x", target_modules=["lin1"]), ValueError,
     (r"add_ia3_adapter\('x'\): 'lin1' would be scaled at its output, but the model's other IA³ adapters scale its "
      r"input; one layer scales one side")),
    (lambda m: add_ia3_adapter(m, "x", target_modules=["lin0"], modules_to_save=["lin1"]), ValueError,
     r"add_ia3_adapter\('x'\): modules_to_save=\['lin1'\], but the model trains \[\] in full; .* with the first"),
    (lambda m: set_ia3_adapter(m, "nope"), ValueError,
     r"set_ia3_adapter: no IA³ adapter named 'nope'; the model has \['default'\]"),
    (lambda m: delete_ia3_adapter(m, "nope"), ValueError, r"delete_ia3_adapter: no IA³ adapter named 'nope'"),
    (lambda m: merged_state_dict(m, adapter_name="nope"), ValueError,
     r"merged_state_dict: no IA³ adapter named 'nope'"),
])
def test_bad_named_adapter_calls_are_refused_before_anything_changes(call, error, message):
    model = copy.deepcopy(base_model("MLP"))
    inject_ia3(model, **FIRST)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=message):
        call(model)
    assert attached(model)["ia3"].names == ("default",) and model.state_dict().keys() == before.keys()
