"""LoRA's ``trainable_token_indices`` (`lightning_peft.peft.trainable_tokens`) against Hugging Face PEFT, the oracle:
a tiny Llama and a tiny GPT-2 built from configs (both tie the head to the input embedding) in float64: outputs,
gradients, disabled, merged exports and in-place merges, the files both ways, and what an optimizer step changes."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lightning_peft.peft import (
    LoRAConfig,
    add_adapter,
    combine_adapters,
    delete_adapter,
    disable_adapters,
    inject_lora,
    load_adapter,
    merge_lora,
    merged_state_dict,
    route_adapters,
    save_adapter,
    set_adapter,
    unload_lora,
    unmerge_lora,
)
from lightning_peft.peft.adapter import attached
from lightning_peft.peft.trainable_tokens import TrainableTokensWrapper, check_indices
from tests._models import gpt2_model, llama_model, seeded

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PREFIX = "base_model.model."
IDS = [3, 7, 11]
FAMILIES = {  # family -> (model builder, LoRA targets, input embedding, tied head)
    "llama": (partial(llama_model, tie_word_embeddings=True), ["q_proj"], "model.embed_tokens", "lm_head"),
    "gpt2": (gpt2_model, ["c_attn"], "transformer.wte", "lm_head"),
}
X = torch.tensor([[1, 3, 5, 7], [11, 2, 3, 0]])  # (B, T): chosen and other ids


def close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")


def base_model(family: str) -> nn.Module:
    return seeded(FAMILIES[family][0])


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def pair(family: str, **kwargs):
    """(ours, PEFT's, the base) with ``trainable_token_indices=IDS`` (unless given) and the same random values."""
    kwargs = {"r": 2, "target_modules": FAMILIES[family][1], "trainable_token_indices": IDS, **kwargs}
    base = base_model(family)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kwargs)).eval()
    ours = copy.deepcopy(base)
    inject_lora(ours, config=LoRAConfig.from_peft(peft.LoraConfig(**kwargs)))
    ours.eval()
    assert {PREFIX + k for k in trainable(ours)} == set(trainable(theirs))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainable(ours).items():
            p.add_(0.3 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
            trainable(theirs)[PREFIX + name].copy_(p)
    return ours, theirs, base


def logits(model: nn.Module, x=X) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_gradients_and_disabled_equal_peft_with_the_tied_head_following(family):
    ours, theirs, base = pair(family)
    embedding, head = FAMILIES[family][2:]
    assert isinstance(ours.get_submodule(embedding), TrainableTokensWrapper)
    assert isinstance(ours.get_submodule(head), TrainableTokensWrapper)  # tied: it follows the embedding's rows
    assert f"{embedding}.token_adapter.trainable_tokens_delta.default" in trainable(ours)
    adapted = logits(ours)
    assert (adapted - logits(base)).abs().max() > 1e-3
    close(adapted, logits(theirs), "forward")
    with disable_adapters(ours):
        assert torch.equal(logits(ours), logits(base))
    for model in (ours, theirs):
        model.train()
        (model(X).logits.square().sum() + model(X).logits.sum()).backward()
    for name, p in trainable(ours).items():
        close(p.grad, trainable(theirs)[PREFIX + name].grad, f"gradient of {name}")


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_export_unload_and_in_place_merge_equal_peft_merge_and_unload(family):
    ours, theirs, base = pair(family)
    embedding, head = FAMILIES[family][2:]
    adapted = logits(ours)
    expected = copy.deepcopy(theirs).merge_and_unload().state_dict()
    exported = merged_state_dict(ours)
    assert set(exported) == set(expected)
    for key, value in expected.items():
        close(exported[key], value, f"merged {key}")
    rows = exported[f"{embedding}.weight"]
    assert torch.equal(exported[f"{head}.weight"], rows)  # the tied head holds the same rows

    original = unload_lora(copy.deepcopy(ours), merge=False)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in original.state_dict().items())

    merge_lora(ours)
    close(logits(ours), adapted, "merged in place")
    weight = ours.get_submodule(embedding).token_adapter.base_layer.weight
    assert torch.equal(weight, rows) and ours.get_submodule(head).token_adapter.base_layer.weight is weight
    assert torch.equal(ours.state_dict()[f"{embedding}.token_adapter.base_layer.weight"],
                       base.state_dict()[f"{embedding}.weight"])  # a state dict is taken unmerged
    unmerge_lora(ours)
    assert torch.equal(weight, base.get_submodule(embedding).weight)  # the original rows back, bit for bit
    close(logits(ours), adapted, "unmerged")

    plain = unload_lora(copy.deepcopy(ours), merge=True)
    assert not any(isinstance(m, TrainableTokensWrapper) for m in plain.modules())
    assert torch.equal(plain.get_submodule(embedding).weight, rows)
    close(logits(plain), adapted, "unloaded, merged")


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_our_files_and_we_load_peft_s_with_the_same_keys_and_outputs(family, tmp_path):
    ours, theirs, base = pair(family)
    adapted = logits(ours)
    save_adapter(ours, tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    keys = set(load_file(tmp_path / "ours" / "adapter_model.safetensors"))
    assert keys == set(load_file(tmp_path / "theirs" / "adapter_model.safetensors"))
    assert f"{PREFIX}{FAMILIES[family][2]}.token_adapter.trainable_tokens_delta" in keys
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours").eval()
    close(logits(loaded), adapted, "PEFT loading ours")
    mine = load_adapter(copy.deepcopy(base), tmp_path / "theirs").eval()
    close(logits(mine), adapted, "loading PEFT's")


def test_an_adamw_step_changes_only_the_chosen_rows_of_the_embedding_and_of_its_tied_head():
    ours, _, base = pair("llama")
    optimizer = torch.optim.AdamW(trainable(ours).values(), lr=0.1, weight_decay=0.1)
    ours.train()
    ours(X).logits.logsumexp(-1).sum().backward()
    optimizer.step()
    before = base.state_dict()["model.embed_tokens.weight"]
    after = merged_state_dict(ours)
    others = [i for i in range(before.shape[0]) if i not in IDS]
    assert torch.equal(after["model.embed_tokens.weight"][others], before[others])
    assert torch.equal(after["lm_head.weight"], after["model.embed_tokens.weight"])
    assert (after["model.embed_tokens.weight"][IDS] - before[IDS]).abs().amin(1).gt(0).all()
    frozen = {k: v for k, v in ours.state_dict().items() if "lora_" not in k and "trainable_tokens" not in k}
    assert all(torch.equal(v, base.state_dict()[k.replace(".token_adapter.base_layer", "").replace(
        ".base_layer", "")]) for k, v in frozen.items())


def test_the_dict_form_naming_the_embedding_and_its_tied_head_equals_the_list_form():
    ours, _, _ = pair("llama", trainable_token_indices={"embed_tokens": IDS, "lm_head": IDS})
    listed, _, _ = pair("llama")
    assert set(trainable(ours)) == set(trainable(listed))
    close(logits(ours), logits(listed), "dict form")
    with pytest.raises(ValueError, match=r"'lm_head' shares its weight with 'model\.embed_tokens' \(tied\), so both "
                                         r"get the same rows; give them the same ids"):
        inject_lora(base_model("llama"), target_modules=["q_proj"],
                    trainable_token_indices={"embed_tokens": IDS, "lm_head": [1]})


def test_named_adapters_switch_route_per_sample_and_delete_their_rows():
    model = base_model("llama")
    inject_lora(model, target_modules=["q_proj"], trainable_token_indices=[3, 7])
    add_adapter(model, "other", target_modules=["q_proj"], trainable_token_indices=[7, 11])
    rows = model.model.embed_tokens.token_adapter.trainable_tokens_delta
    with torch.no_grad():
        for p in rows.values():
            p.add_(torch.randn_like(p))
    alone = {}
    for name in ("default", "other"):
        set_adapter(model, name)
        alone[name] = logits(model)
    with disable_adapters(model):
        alone[None] = logits(model)
    with route_adapters(model, ["other", None]):
        routed = logits(model)
    close(routed[0], alone["other"][0], "routed to 'other'")
    close(routed[1], alone[None][1], "routed to the base")
    set_adapter(model, "default")
    delete_adapter(model, "other")
    assert set(rows) == {"default"}
    close(logits(model), alone["default"], "after deleting 'other'")
    with pytest.raises(ValueError, match=r"source 'default' trains token rows \(trainable_token_indices\)"):
        combine_adapters(model, {"default": 1.0}, "mix")


def test_the_adapter_comes_back_from_its_recorded_config_and_state():
    ours, _, _ = pair("gpt2")
    spec = attached(ours)["lora"]
    fresh = base_model("gpt2")
    type(spec).inject(fresh, spec.config_dict())
    fresh.load_state_dict({k: v.detach() for k, v in spec.state(ours).items()}, strict=False)
    close(logits(fresh.eval()), logits(ours), "re-injected")


def test_peft_config_with_trainable_tokens_translates_and_a_loaded_adapter_must_train_the_same_rows(tmp_path):
    config = LoRAConfig.from_peft(peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                  trainable_token_indices={"embed_tokens": (1, 2)}))
    assert config.trainable_token_indices == {"embed_tokens": [1, 2]}
    ours, _, base = pair("llama")
    save_adapter(ours, tmp_path)
    other = copy.deepcopy(base)
    inject_lora(other, target_modules=["q_proj"], rank=2, trainable_token_indices=[3, 7, 12])
    with pytest.raises(ValueError, match=r"sets trainable_token_indices=\[3, 7, 11\], but the model's LoRA adapter "
                                         r"'default' trains \[3, 7, 12\]"):
        load_adapter(other, tmp_path)


class _Shared(nn.Module):
    """An embedding and a head sharing one weight, the tie not declared (no Hugging Face config)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(20, 4), nn.Linear(4, 4), nn.Linear(4, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.lin(self.emb(x)))


@pytest.mark.parametrize(("make", "kwargs", "error", "match"), [
    (lambda: base_model("llama"), {"trainable_token_indices": [3, 64]}, ValueError,
     r"token id 64 is out of range for 'model\.embed_tokens', which has 64 rows \(ids 0\.\.63\); resize the embed"),
    (lambda: nn.Sequential(nn.Linear(4, 4)), {"target_modules": ["0"], "rank": 2, "trainable_token_indices": [1]},
     ValueError, r"Sequential has no input embedding \(no get_input_embeddings\(\), no module named 'embed_tokens'\)"),
    (lambda: base_model("llama"), {"trainable_token_indices": {"norm": [1]}}, TypeError,
     r"'model\.norm' is a LlamaRMSNorm; trainable tokens replace rows of an nn\.Embedding"),
    (lambda: base_model("llama"), {"trainable_token_indices": {"embedding": [1]}}, ValueError,
     r"'embedding' matches no module of LlamaForCausalLM"),
    (lambda: base_model("llama"), {"target_modules": ["q_proj", "embed_tokens"], "trainable_token_indices": [1]},
     ValueError, r"'model\.embed_tokens' is also adapted or saved in full by this adapter"),
    (lambda: base_model("llama"), {"modules_to_save": ["lm_head"], "trainable_token_indices": [1]},
     ValueError, r"'lm_head' is also adapted or saved in full by this adapter"),
    (_Shared, {"target_modules": ["lin"], "rank": 2, "trainable_token_indices": {"emb": [1]}}, ValueError,
     r"the weight of 'emb' is also the weight of 'head', but it is not an input embedding the model declares tied"),
])
def test_what_cannot_be_trained_is_refused_before_anything_changes(make, kwargs, error, match):
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        inject_lora(model, **{"target_modules": ["q_proj"], **kwargs})
    assert not attached(model) and not any(isinstance(m, TrainableTokensWrapper) for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and set(model.state_dict()) == set(before)


@pytest.mark.parametrize(("value", "error", "match"), [
    ([1, 1], ValueError, r"trainable_token_indices=\[1, 1\]\): token id 1 is listed twice"),
    ([-1], ValueError, r"trainable_token_indices=-1\): trainable_token_indices must be an integer >= 0"),
    ([True], TypeError, r"must be an integer >= 0"),
    ("5", TypeError, r"give a non-empty list of token ids"),
    ([], TypeError, r"give a non-empty list of token ids"),
    ({"": [1]}, TypeError, r"with non-empty names"),
])
def test_bad_indices_are_refused_by_the_config(value, error, match):
    with pytest.raises(error, match=match):
        LoRAConfig(trainable_token_indices=value)
    assert check_indices((4, 2)) == [4, 2]
