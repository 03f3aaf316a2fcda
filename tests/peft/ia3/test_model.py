"""IA³'s own behaviour beyond PEFT's rows (tests/peft/ia3/test_peft_cases.py): refusals, exact merges and unloads,
PEFT's plain-suffix reading of ``feedforward_modules`` in both directions, loading into an existing adapter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_peft.peft import (
    IA3Config,
    inject_ia3,
    inject_lora,
    load_adapter,
    merged_state_dict,
    save_adapter,
    unload_ia3,
)
from lightning_peft.peft.ia3 import disable_ia3, ia3_layers, merge_ia3, unmerge_ia3
from tests.peft._oracle import adapted_pair, close, inputs, outputs, peft
from tests.peft.ia3._oracle import IA3

pytestmark = pytest.mark.filterwarnings("ignore:Unmerge result can be inaccurate:UserWarning")


class Suffixes(nn.Module):
    """``up`` and ``cup``: a PEFT ``feedforward_modules`` list entry ``"up"`` picks both (plain ``endswith``)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.cup = nn.Linear(6, 3)

    def forward(self, x):  # (B, 4) -> (B, 3)
        return self.cup(self.up(x).tanh())


def randomised(model: nn.Module, seed: int = 1) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in ia3_layers(model).values():
            for vector in layer.ia3_l.values():
                vector.copy_(1 + 0.3 * torch.randn(vector.shape, generator=generator, dtype=torch.float64))
    return model


def mlp(**config) -> tuple[nn.Module, nn.Module]:
    """(the float64 base MLP of PEFT's rows, a copy with IA³ ``config`` and random vectors)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)).double().eval()
    model = copy.deepcopy(base)
    inject_ia3(model, **config)
    return base, randomised(model)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"target_modules": ["k"], "feedforward_modules": ["wo"]}, ValueError,
     (r"IA3\(feedforward_modules=\['wo'\], target_modules=\['k'\]\): feedforward_modules must be a subset of "
      r"target_modules; \['wo'\] is not among them")),
    ({"target_modules": []}, TypeError, r"IA3\(target_modules=\[\]\): give a non-empty list of module names"),
    ({"target_modules": "(a"}, ValueError, r"IA3\(target_modules='\(a'\): target_modules is not a valid regular"),
    ({"target_modules": ["k"], "init_ia3_weights": 1}, TypeError, r"IA3\(init_ia3_weights=1\): .* True or False"),
    ({"target_modules": ["k"], "rank": 4}, TypeError,
     r"inject_ia3: unknown argument 'rank'; IA³ layers take target_modules, feedforward_modules"),
])
def test_bad_settings_are_refused_naming_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        inject_ia3(nn.Linear(2, 2), **kwargs)


def test_a_layer_peft_has_no_ia3_for_and_a_second_injection_are_refused_before_anything_changes():
    model = nn.Sequential(nn.Conv1d(2, 3, 1), nn.Linear(3, 3))
    with pytest.raises(TypeError, match=r"IA3\(target_modules=\['0', '1'\]\): '0' is a Conv1d; IA³ scales nn\.Linear, "
                                        r"transformers Conv1D, nn\.Conv2d, nn\.Conv3d .* Sequential has: 1"):
        inject_ia3(model, target_modules=["0", "1"])
    assert isinstance(model[1], nn.Linear) and all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match=r"IA3\(target_modules=\['2'\]\) matched no module of Sequential\. Modules "
                                         r"it can scale: 1\."):
        inject_ia3(model, target_modules=["2"])
    inject_ia3(model, target_modules=["1"])
    with pytest.raises(RuntimeError, match=r"inject_ia3: Sequential already has IA³ layers \(e\.g\. '1'\); IA³ "
                                           r"injected twice"):
        inject_ia3(model, target_modules=["1"])


def test_exclude_modules_wins_and_an_exclusion_that_matches_nothing_is_refused():
    _, model = mlp(target_modules=r"0|2", exclude_modules=["2"])
    assert list(ia3_layers(model)) == ["0"]
    with pytest.raises(ValueError, match=r"IA3\(exclude_modules=\['3'\]\): '3' matched no module"):
        mlp(target_modules=["0"], exclude_modules=["3"])


def test_merge_unmerge_unload_and_the_merged_export_all_give_the_adapted_outputs_exactly_enough():
    base, model = mlp(target_modules=["0", "2"], feedforward_modules=["2"])
    x = inputs(nn.Linear(10, 2))
    adapted = outputs(model, x)
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged_state_dict(model))
    close(outputs(plain, x), adapted, "merged export")
    assert torch.equal(plain[2].bias, base[2].bias)  # an input scale leaves the bias alone
    assert merge_ia3(model) == ["0", "2"] and merge_ia3(model) == []  # idempotent
    close(outputs(model, x), adapted, "merged")
    with pytest.raises(RuntimeError, match=r"disable_ia3: the vectors are merged .* call unmerge_ia3\(model\) first"), \
            disable_ia3(model):
        pass
    unmerge_ia3(model)
    close(model[0].base_layer.weight, base[0].weight, "unmerged weight")  # divided by l, not l + 1e-8
    with pytest.raises(RuntimeError, match=r"unmerge_ia3: no IA³ layer of Sequential is merged; call merge_ia3 first"):
        unmerge_ia3(model)
    merge_ia3(model)
    unloaded = unload_ia3(copy.deepcopy(model), merge=False)  # merged: divided back, then plain
    assert all(torch.allclose(a, b, rtol=1e-14, atol=0) for a, b in zip(unloaded.parameters(), base.parameters()))
    merged = unload_ia3(model)
    assert type(merged[0]) is nn.Linear and type(merged[2]) is nn.Linear
    close(outputs(merged, x), adapted, "unloaded merged")


def test_a_zero_scale_is_merged_for_exports_but_not_in_place():
    base, model = mlp(target_modules=["0"])
    with torch.no_grad():
        model[0].ia3_l["default"][3] = 0.0
    before = model[0].base_layer.weight.clone()
    with pytest.raises(RuntimeError, match=r"merge_ia3: layer '0': ia3_l has a zero entry, so the merged weight could "
                                           r"not be divided back \(unmerge\)\. Use merged_state_dict"):
        merge_ia3(model)
    assert torch.equal(model[0].base_layer.weight, before) and not model[0].merged
    x = inputs(nn.Linear(10, 2))
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged_state_dict(model))
    close(outputs(plain, x), outputs(model, x), "merged export")


def test_a_tied_weight_is_not_merged_in_place():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    inject_ia3(model, target_modules=["0"])
    with pytest.raises(RuntimeError, match=r"merge_ia3: the weight of '0' is tied to '1\.weight'; merging in place "
                                           r"would change both"):
        merge_ia3(model)


def test_peft_reads_feedforward_entries_as_plain_suffixes_and_our_files_say_exactly_which(tmp_path):
    torch.manual_seed(0)
    base = Suffixes().double().eval()
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.IA3Config(target_modules=["up", "cup"],
                                                                     feedforward_modules=["up"]))
    ours = copy.deepcopy(base)
    inject_ia3(ours, IA3Config.from_peft(peft.IA3Config(target_modules=["up", "cup"], feedforward_modules=["up"])))
    assert [n for n, layer in ia3_layers(ours).items() if layer.feedforward] == ["up", "cup"]  # as PEFT: both
    assert theirs.base_model.model.cup.is_feedforward

    only_up = copy.deepcopy(base)
    inject_ia3(only_up, target_modules=["up", "cup"], feedforward_modules="up")  # a regular expression: "up" alone
    randomised(only_up)
    save_adapter(only_up, tmp_path)
    config = peft.PeftConfig.from_pretrained(tmp_path)
    assert config.feedforward_modules == "(?:up)"  # a list ["up"] would make PEFT scale cup's input too
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    close(outputs(loaded, x), outputs(only_up, x), "PEFT loading our file")


def test_loading_into_a_model_with_ia3_checks_which_inputs_are_scaled(tmp_path):
    ours, _, base = adapted_pair("MLP", {"target_modules": ["lin0", "lin1"], "feedforward_modules": ["lin1"]}, IA3)
    save_adapter(ours, tmp_path)
    other = copy.deepcopy(base)
    inject_ia3(other, target_modules=["lin0", "lin1"], feedforward_modules=["lin0"])
    with pytest.raises(ValueError, match=r"load_adapter: .*adapter_config\.json scales the input of \['lin1'\], but "
                                         r"the model's IA³ adapter 'default' scales the input of \['lin0'\]\. Load "
                                         r"it into a model without IA³, or under another adapter_name"):
        load_adapter(other, tmp_path)
    same = copy.deepcopy(base)
    inject_ia3(same, target_modules=["lin0", "lin1"], feedforward_modules=["lin1"])
    x = inputs(base)
    close(outputs(load_adapter(same, tmp_path), x), outputs(ours, x), "loaded into the existing adapter")


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=12, num_labels=3))


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=8, n_layer=2, n_head=2, n_positions=16))


@pytest.mark.parametrize(("make", "task", "feedforward"), [(tiny_bert, "SEQ_CLS", ["output.dense"]),
                                                           (tiny_gpt2, "CAUSAL_LM", ["mlp.c_proj"])])
def test_all_linear_scales_what_peft_scales_and_peft_loads_it_equal(make, task, feedforward, tmp_path):
    base = make().double().eval()
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.IA3Config(
        target_modules="all-linear", feedforward_modules=feedforward, task_type=task))
    chosen = {n.removeprefix("base_model.model."): m.is_feedforward for n, m in theirs.named_modules()
              if hasattr(m, "ia3_l")}
    ours = copy.deepcopy(base)
    layers = inject_ia3(ours, target_modules="all-linear", feedforward_modules=feedforward)
    assert {n: layer.feedforward for n, layer in layers.items()} == chosen  # the output head left out, as PEFT
    assert any(chosen.values()) and not all(chosen.values())
    save_adapter(randomised(ours), tmp_path)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(0))
    close(loaded(input_ids=ids).logits, ours(input_ids=ids).logits, "PEFT loading our all-linear adapter")


def test_all_linear_leaves_the_insides_of_other_techniques_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    inject_lora(model, rank=2, target_modules=["0"])
    assert list(inject_ia3(model, target_modules="all-linear")) == ["1"]  # not LoRA's A and B, not the head '2'
