"""The scaffolding the wrap-and-merge-in-place techniques share (`lightning_peft.peft._wrapping`), checked once for
all of them: reading another method's PEFT config, and a target another technique wraps already."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_peft.peft import (
    AdaLoraConfig,
    BOFTConfig,
    IA3Config,
    LoHaConfig,
    LoKrConfig,
    OFTConfig,
    VeraConfig,
    inject_adalora,
    inject_boft,
    inject_ia3,
    inject_loha,
    inject_lokr,
    inject_lora,
    inject_oft,
    inject_vera,
)

peft = pytest.importorskip("peft")

#: (who speaks, the technique in words, its config, its inject function, its PEFT type)
TECHNIQUES = [
    ("IA3", "IA³", IA3Config, inject_ia3, "IA3"),
    ("VeRA", "VeRA", VeraConfig, inject_vera, "VERA"),
    ("AdaLoRA", "AdaLoRA", AdaLoraConfig, inject_adalora, "ADALORA"),
    ("LoHa", "LoHa", LoHaConfig, inject_loha, "LOHA"),
    ("LoKr", "LoKr", LoKrConfig, inject_lokr, "LOKR"),
    ("OFT", "OFT", OFTConfig, inject_oft, "OFT"),
    ("BOFT", "BOFT", BOFTConfig, inject_boft, "BOFT"),
]
FITS_8 = {"OFT": {"oft_block_size": 4}}  # settings other than the defaults that an 8-feature layer needs


@pytest.mark.parametrize(("who", "technique", "config", "inject", "peft_type"), TECHNIQUES, ids=[t[0] for t in TECHNIQUES])
def test_another_methods_peft_config_object_is_refused_naming_both_types(who, technique, config, inject, peft_type):
    theirs = peft.LoraConfig(target_modules=["0"])  # its peft_type is PEFT's enum, written as its value
    with pytest.raises(ValueError, match=rf"load_adapter: x has peft_type='LORA', not '{peft_type}'\.$"):
        config.from_peft(theirs, "x")


@pytest.mark.parametrize(("who", "technique", "config", "inject", "peft_type"), TECHNIQUES, ids=[t[0] for t in TECHNIQUES])
def test_a_target_another_technique_wraps_is_refused_before_anything_changes(who, technique, config, inject, peft_type):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    inject_lora(model, target_modules=["0"], rank=2)
    before = dict(model.named_modules())
    article = "an" if technique[0] in "AEIOU" else "a"
    with pytest.raises(ValueError, match=rf"{who}: '0' is already wrapped by another technique \(\w+\); {article} "
                                         rf"{technique} layer around it would move that technique's parameters\. "
                                         rf"Keep {technique} off this module\.$"):
        inject(model, target_modules=["0"])
    assert dict(model.named_modules()) == before


@pytest.mark.parametrize(("who", "technique", "config", "inject", "peft_type"), TECHNIQUES, ids=[t[0] for t in TECHNIQUES])
def test_lora_on_a_target_another_technique_wraps_is_refused_the_same_way(who, technique, config, inject, peft_type):
    # (LoRA said its layer's type was not one LoRA supports, listing the types: a TypeError about the wrong thing)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    inject(model, target_modules=["0"], **FITS_8.get(who, {}))
    before = dict(model.named_modules())
    with pytest.raises(ValueError, match=r"LoRA: '0' is already wrapped by another technique \(\w+\); a LoRA layer "
                                         r"around it would move that technique's parameters\. Keep LoRA off this "
                                         r"module\.$"):
        inject_lora(model, target_modules=["0"], rank=2)
    assert dict(model.named_modules()) == before
