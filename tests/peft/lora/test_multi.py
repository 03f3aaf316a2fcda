"""Named LoRA adapters on one base: per-sample routing (forward, gradients, optimizer steps), switching, disabling,
deleting, combining, merging, and PEFT's multi-adapter layout in both directions."""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from lightning_peft.peft import (
    LoRAConfig,
    active_adapter,
    add_adapter,
    combine_adapters,
    delete_adapter,
    disable_adapters,
    inject_lora,
    load_adapter,
    lora_layers,
    merge_lora,
    route_adapters,
    save_adapter,
    set_adapter,
    unmerge_lora,
)
from tests._models import VOCAB, bert_model

SEQ_CLS = peft.TaskType.SEQ_CLS


class Tiny(nn.Module):
    """An embedding, linear blocks and a conv branch, so every LoRA layer type meets a mixed batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6, padding_idx=0)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"query": nn.Linear(6, 6), "value": nn.Linear(6, 6), "norm": nn.LayerNorm(6)}) for _ in range(2)
        )
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, 6)
        for block in self.blocks:
            h = block["norm"](h + block["query"](h).tanh() * block["value"](h))
        image = self.conv(h.unsqueeze(1))  # (B, 4, T, 6)
        return self.head(h.mean(1) + image.mean((1, 2)))  # (B, 3)


def _randomise(model: nn.Module, seed: int = 1) -> None:
    """Give every adapter nonzero factors (B starts at zero, which would hide routing mistakes)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for param in layer.adapter_parameters().values():
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.5)


def _three_adapters() -> nn.Module:
    """Adapters with different ranks, alphas and targets: a (query, embed), b (query, value, conv), c (value)."""
    model = Tiny().double()
    inject_lora(model, rank=2, alpha=4, target_modules=["query", "embed"], adapter_name="a")
    add_adapter(model, "b", rank=3, alpha=3, target_modules=["query", "value", "conv"], use_rslora=True)
    add_adapter(model, "c", rank=1, alpha=2, target_modules=["value"])
    _randomise(model)
    return model


IDS = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [2, 2, 3, 1], [0, 5, 5, 4]])  # 5 samples, padding 0
ROUTE = ["b", None, "a", "c", "b"]


def _alone(model: nn.Module, ids: torch.Tensor, names: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each sample run alone with its own adapter: outputs and the summed adapter gradients (the reference)."""
    outputs = []
    for i, name in enumerate(names):
        if name is None:
            with disable_adapters(model):
                out = model(ids[i : i + 1])
        else:
            set_adapter(model, name)
            out = model(ids[i : i + 1])
            (out * (i + 1)).sum().backward()  # a different weight per sample, so a swapped gradient shows
        outputs.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return torch.cat(outputs), grads


def test_mixed_batch_gives_each_sample_its_own_adapters_output_and_gradients():
    model = _three_adapters()
    expected, expected_grads = _alone(model, IDS, ROUTE)
    with route_adapters(model, ROUTE):
        out = model(IDS)
    (out * torch.arange(1, 6, dtype=out.dtype).unsqueeze(1)).sum().backward()
    assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_inference_mixed_batches_reuse_stacked_weights_and_see_every_update():
    model = _three_adapters().eval()
    for route in (ROUTE, ["c", "c", None, "a", "a"], ROUTE):  # the stack of every adapter is built once, reused
        expected, _ = _alone(model, IDS, route)
        with torch.inference_mode(), route_adapters(model, route):
            assert_close(model(IDS), expected, rtol=1e-12, atol=1e-12)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    with route_adapters(model, ROUTE):
        model(IDS).sum().backward()
    optimizer.step()  # in-place updates: the cached stacks are stale now
    expected, _ = _alone(model, IDS, ROUTE)
    with torch.no_grad(), route_adapters(model, ROUTE):
        assert_close(model(IDS), expected, rtol=1e-12, atol=1e-12)
    model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})  # a load: new values again
    expected, _ = _alone(model, IDS, ROUTE)
    with torch.no_grad(), route_adapters(model, ROUTE):
        assert_close(model(IDS), expected, rtol=1e-12, atol=1e-12)


def _routed_no_grad(model: nn.Module, route: list) -> torch.Tensor:
    with torch.no_grad(), route_adapters(model, route):
        return model(IDS)


def test_routed_inference_sees_a_fused_adamw_step():
    """A fused AdamW step moves neither the version counter nor the storage of the parameters it updates."""
    model = _three_adapters().eval()
    _routed_no_grad(model, ROUTE)  # a first validation: what a cache would keep
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, fused=True)
    with route_adapters(model, ROUTE):
        model(IDS).sum().backward()
    optimizer.step()
    expected, _ = _alone(model, IDS, ROUTE)
    assert_close(_routed_no_grad(model, ROUTE), expected, rtol=1e-12, atol=1e-12)


def test_routed_inference_sees_writes_through_data():
    model = _three_adapters().eval()
    _routed_no_grad(model, ROUTE)
    for layer in lora_layers(model).values():
        for param in layer.adapter_parameters().values():
            param.data.mul_(-2)  # .data has its own version counter
    layer = lora_layers(model)["blocks.0.value"]
    layer.lora_A["b"].weight.data = layer.lora_A["b"].weight.data + 1  # new storage, no version change
    expected, _ = _alone(model, IDS, ROUTE)
    assert_close(_routed_no_grad(model, ROUTE), expected, rtol=1e-12, atol=1e-12)


def test_a_parameter_replaced_in_place_is_the_one_used():
    """FSDP2 and DTensor parallelism swap parameters with register_parameter: no stale reference may survive."""
    model = _three_adapters()
    with route_adapters(model, ROUTE):
        model(IDS)  # looks the factors up once
    layer = lora_layers(model)["blocks.0.query"]
    for name in ("a", "b"):
        layer.lora_B[name].weight = nn.Parameter(layer.lora_B[name].weight.detach() * 3)
    from lightning_peft.peft.adapter import attached, technique

    fresh = Tiny().double()  # the same adapters, built anew: nothing looked up before the swap
    technique("lora").inject(fresh, attached(model)["lora"].config_dict())
    fresh.load_state_dict(model.state_dict())
    expected, _ = _alone(fresh, IDS, ROUTE)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), route_adapters(model, ROUTE):
            assert_close(model(IDS), expected, rtol=1e-12, atol=1e-12)


def test_gradients_reach_exactly_the_adapters_the_batch_used():
    model = _three_adapters()
    with route_adapters(model, ["a", None, "a"]):
        model(IDS[:3]).sum().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all(".a." in n or n.endswith(".a") for n in with_grad)
    assert with_grad == {n for n, p in model.named_parameters() if p.requires_grad and (".a." in n or n.endswith(".a"))}


def test_adamw_step_on_a_mixed_batch_leaves_unused_adapters_bit_for_bit_unchanged():
    model = _three_adapters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.5)
    with route_adapters(model, ["b", "c", "b"]):  # a step that gives every adapter momentum first
        model(IDS[:3]).sum().backward()
    set_adapter(model, "a")
    model(IDS[:3]).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = copy.deepcopy(optimizer.state_dict()["state"])
    for _ in range(2):  # two steps on batches that use only "b" and the base: a and c have momentum, yet stay
        with route_adapters(model, ["b", None, "b"]):
            model(IDS[:3]).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    params = dict(model.named_parameters())
    moved = {n for n in params if not torch.equal(params[n], before[n])}
    assert moved == {n for n in params if params[n].requires_grad and (".b." in n or n.endswith(".b"))}
    index = {id(p): i for i, p in enumerate(optimizer.param_groups[0]["params"])}
    for name, param in params.items():
        if param.requires_grad and name not in moved:  # momentum of the unused adapters untouched as well
            state, old = optimizer.state[param], state_before[index[id(param)]]
            assert torch.equal(state["exp_avg"], old["exp_avg"]) and torch.equal(state["step"], old["step"])


def test_none_rows_and_disable_adapters_give_the_exact_base_output():
    model = _three_adapters()
    base = Tiny().double()
    base.load_state_dict({k.replace(".base_layer", ""): v for k, v in model.state_dict().items()
                          if "lora_" not in k}, strict=True)
    with disable_adapters(model):
        assert torch.equal(model(IDS), base(IDS))
    with route_adapters(model, [None] * 5):
        assert torch.equal(model(IDS), base(IDS))
    with route_adapters(model, ["a", None, "a", None, None]):
        mixed = model(IDS)
    assert torch.equal(mixed[[1, 3, 4]], base(IDS)[[1, 3, 4]])


def test_every_new_adapter_starts_at_the_base_output():
    model = Tiny().double()
    base = copy.deepcopy(model)
    inject_lora(model, rank=2, target_modules=["query", "embed", "conv"], adapter_name="a", init="gaussian")
    add_adapter(model, "b", rank=4, target_modules=["value"], init="gaussian")
    for name in ("a", "b"):
        set_adapter(model, name)
        assert torch.equal(model(IDS), base(IDS))


def test_set_adapter_switches_in_constant_time_without_touching_the_base():
    model = _three_adapters()
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    outputs = {}
    for name in ("a", "b", "c"):
        set_adapter(model, name)
        assert active_adapter(model) == name
        outputs[name] = model(IDS)
        with route_adapters(model, [name] * 5):
            assert_close(model(IDS), outputs[name], rtol=1e-12, atol=1e-12)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights  # nothing copied or rebuilt
    assert not torch.allclose(outputs["a"], outputs["b"])


def test_eval_mode_mixed_batch_ignores_dropout_and_training_mode_applies_each_adapters_own():
    model = Tiny().double()
    inject_lora(model, rank=2, target_modules=["query"], adapter_name="a", dropout=0.9)
    add_adapter(model, "b", rank=2, target_modules=["query"])  # no dropout
    _randomise(model)
    model.eval()
    expected, _ = _alone(model, IDS[:2], ["a", "b"])
    with route_adapters(model, ["a", "b"]):
        assert_close(model(IDS[:2]), expected, rtol=1e-12, atol=1e-12)
    model.train()
    with route_adapters(model, ["a", "b"]):
        noisy = model(IDS[:2])
    assert_close(noisy[1], expected[1], rtol=1e-12, atol=1e-12)  # b has no dropout
    assert not torch.allclose(noisy[0], expected[0])  # a drops 90% of its input


def test_an_adapter_added_to_a_model_in_eval_mode_runs_in_eval_mode():
    model = Tiny().double().eval()
    inject_lora(model, rank=2, target_modules=["query"], adapter_name="a", dropout=0.5)
    add_adapter(model, "b", rank=2, target_modules=["query", "value"], dropout=0.5)  # on existing and new layers
    _randomise(model)
    assert not any(m.training for m in model.modules())
    for route in (["a", "b", "b"], ["b", "b", "b"]):
        with route_adapters(model, route):
            assert torch.equal(model(IDS[:3]), model(IDS[:3]))  # no dropout left switched on
    set_adapter(model, "b")
    assert torch.equal(model(IDS[:3]), model(IDS[:3]))


def test_mixed_batch_works_under_torch_compile():
    model = _three_adapters()
    expected, _ = _alone(model, IDS, ROUTE)
    compiled = torch.compile(model, backend="eager")
    with route_adapters(compiled, ROUTE):
        assert_close(compiled(IDS), expected, rtol=1e-12, atol=1e-12)


def test_delete_adapter_removes_its_parameters_and_unwraps_layers_left_without_adapters():
    model = _three_adapters()
    set_adapter(model, "b")
    delete_adapter(model, "c")
    assert not any(".c." in n or n.endswith(".c") for n, _ in model.named_parameters())
    delete_adapter(model, "a")
    assert isinstance(model.embed, nn.Embedding)  # only "a" adapted the embedding: a plain module again
    assert set(lora_layers(model)) == {"blocks.0.query", "blocks.1.query", "blocks.0.value", "blocks.1.value", "conv"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".b." in n for n in trainable)


def _delta(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    return {t: layer.delta_weight(name) for t, layer in lora_layers(model).items() if name in layer.specs}


def test_combine_cat_is_exactly_the_weighted_sum_of_the_deltas():
    model = _three_adapters()
    combine_adapters(model, {"a": 0.7, "b": -1.5}, "mix", method="cat")
    da, db, mix = _delta(model, "a"), _delta(model, "b"), _delta(model, "mix")
    assert set(mix) == set(da) | set(db)
    for target, delta in mix.items():
        expected = 0.7 * da.get(target, 0) + -1.5 * db.get(target, 0)
        assert_close(delta, expected, rtol=1e-12, atol=1e-12, msg=target)
    assert lora_layers(model)["blocks.0.query"].specs["mix"].rank == 2 + 3  # ranks add where both adapt
    assert lora_layers(model)["blocks.0.value"].specs["mix"].rank == 3


def test_combine_linear_is_the_weighted_sum_of_the_factors_as_peft_defines_it():
    model = Tiny().double()
    inject_lora(model, rank=2, alpha=4, target_modules=["query"], adapter_name="a")
    add_adapter(model, "b", rank=2, alpha=1, target_modules=["query"])
    _randomise(model)
    combine_adapters(model, {"a": 0.5, "b": -2.0}, "mix")
    layer = lora_layers(model)["blocks.1.query"]
    ca, cb = (0.5 * 2.0) ** 0.5, (2.0 * 0.5) ** 0.5  # sqrt(|w| * scaling)
    a = ca * layer.lora_A["a"].weight + cb * layer.lora_A["b"].weight
    b = ca * layer.lora_B["a"].weight - cb * layer.lora_B["b"].weight
    assert_close(layer.delta_weight("mix"), b @ a, rtol=1e-12, atol=1e-12)
    assert layer.specs["mix"].scaling == 1.0


def test_combine_svd_is_the_best_low_rank_approximation_of_the_weighted_delta():
    model = _three_adapters()
    combine_adapters(model, {"a": 1.0, "b": 0.5}, "full", method="svd", rank=5)  # rank 2 + 3: exact
    combine_adapters(model, {"a": 1.0, "b": 0.5}, "low", method="svd", rank=1)
    da, db = _delta(model, "a"), _delta(model, "b")
    for target, delta in _delta(model, "full").items():
        weighted = da.get(target, 0) + 0.5 * db.get(target, 0)
        assert_close(delta, weighted, rtol=1e-10, atol=1e-10, msg=target)
        matrix = weighted.flatten(1) if weighted.dim() == 4 else weighted
        u, s, vh = torch.linalg.svd(matrix.T if target == "embed" else matrix)
        best = (s[0] * torch.outer(u[:, 0], vh[0]))
        best = best.T if target == "embed" else best
        assert_close(_delta(model, "low")[target], best.view_as(weighted), rtol=1e-10, atol=1e-10, msg=target)


def test_merge_lora_merges_the_named_adapter_exactly_and_only_one_at_a_time():
    model = _three_adapters()
    set_adapter(model, "a")
    expected = {}
    for name in ("b", "c"):
        set_adapter(model, name)
        expected[name] = model(IDS)
    set_adapter(model, "a")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    merge_lora(model, "b")
    assert active_adapter(model) == "b"
    assert_close(model(IDS), expected["b"], rtol=1e-12, atol=1e-12)
    assert merge_lora(model, "b") == []  # idempotent
    with pytest.raises(RuntimeError, match=r"merge_lora: adapter 'b' is merged .*; call unmerge_lora\(model\) before "
                                           r"merging 'c'"):
        merge_lora(model, "c")
    unmerge_lora(model)
    for key, value in model.state_dict().items():
        assert_close(value, before[key], rtol=1e-12, atol=1e-12, msg=key)


# ----------------------------------------------------------------------------------------- errors

def test_routing_errors_name_the_problem():
    model = _three_adapters()
    with pytest.raises(ValueError, match=r"route_adapters: unknown adapter name 'z' in the batch; the model has "
                                         r"\['a', 'b', 'c'\] \(None means the base model\)"):
        with route_adapters(model, ["a", "z"]):
            pass
    with pytest.raises(ValueError, match=r"route_adapters: a batch of 5 samples reached LoRAEmbedding .* but 2 adapter "
                                         r"names were given; give one name per sample"):
        with route_adapters(model, ["a", "b"]):
            model(IDS)
    with pytest.raises(ValueError, match=r"route_adapters\(names='ab'\): give one adapter name \(or None\) per sample"):
        with route_adapters(model, "ab"):
            pass
    merge_lora(model, "a")
    with pytest.raises(RuntimeError, match=r"route_adapters: adapter 'a' is merged into the base weights; call "
                                           r"unmerge_lora\(model\) first"):
        with route_adapters(model, ["a"] * 5):
            pass
    with pytest.raises(RuntimeError, match=r"disable_adapters: adapter 'a' is merged"):
        with disable_adapters(model):
            pass
    with pytest.raises(RuntimeError, match=r"set_adapter\('b'\): adapter 'a' is merged; call unmerge_lora"):
        set_adapter(model, "b")


def test_a_failed_forward_inside_route_adapters_still_ends_the_routing():
    model = _three_adapters()
    set_adapter(model, "a")
    with pytest.raises(ValueError, match="adapter names were given"), route_adapters(model, ["b"]):
        model(IDS)
    expected = model(IDS)  # routing over: every sample uses the active adapter again
    with route_adapters(model, ["a"] * 5):
        # Within rounding: the routed path (bmm) and the single-adapter one (addmm) round differently on some CPUs.
        assert_close(model(IDS), expected)


def test_adapter_management_errors():
    model = _three_adapters()
    with pytest.raises(ValueError, match=r"add_adapter: the model already has an adapter named 'b'"):
        add_adapter(model, "b", rank=2, target_modules=["query"])
    with pytest.raises(ValueError, match=r"add_adapter: adapter name 'x.y' is not usable; give a non-empty identifier"):
        add_adapter(model, "x.y", rank=2, target_modules=["query"])
    with pytest.raises(ValueError, match=r"add_adapter\('d'\): modules_to_save=\['head'\], but the model trains \[\] "
                                         r"in full; modules_to_save is shared by every adapter"):
        add_adapter(model, "d", rank=2, target_modules=["query"], modules_to_save=["head"])
    with pytest.raises(ValueError, match=r"add_adapter\('d'\): bias='all' .* several adapters need bias='none'"):
        add_adapter(model, "d", rank=2, target_modules=["query"], bias="all")
    with pytest.raises(ValueError, match=r"set_adapter: no adapter named 'z'; the model has \['a', 'b', 'c'\]"):
        set_adapter(model, "z")
    with pytest.raises(RuntimeError, match=r"delete_adapter\('a'\): it is the active adapter; set_adapter\(model, 'b'\)"):
        delete_adapter(model, "a")
    with pytest.raises(RuntimeError, match=r"add_adapter: Tiny has no LoRA adapter; call inject_lora"):
        add_adapter(Tiny(), "a", rank=2)
    single = Tiny()
    inject_lora(single, rank=2, target_modules=["query"])
    with pytest.raises(RuntimeError, match=r"delete_adapter\('default'\): it is the model's only LoRA adapter; use "
                                           r"unload_lora"):
        delete_adapter(single, "default")


def test_combine_errors():
    model = _three_adapters()
    with pytest.raises(ValueError, match=r"combine_adapters\(method='linear'\): the sources have different ranks at "
                                         r"'blocks.0.query' \(\{'a': 2, 'b': 3\}\); .* Use method='cat'"):
        combine_adapters(model, {"a": 1.0, "b": 1.0}, "mix")
    with pytest.raises(ValueError, match=r"combine_adapters: no adapter named 'z'"):
        combine_adapters(model, {"z": 1.0}, "mix")
    with pytest.raises(ValueError, match=r"combine_adapters\(method='mean'\): method must be 'linear', 'cat' or 'svd'"):
        combine_adapters(model, {"a": 1.0}, "mix", method="mean")
    with pytest.raises(ValueError, match=r"combine_adapters\(rank=2\): rank is chosen by method='cat'"):
        combine_adapters(model, {"a": 1.0}, "mix", method="cat", rank=2)
    with pytest.raises(ValueError, match=r"combine_adapters: weight nan of 'a' must be a finite number"):
        combine_adapters(model, {"a": float("nan")}, "mix")
    with pytest.raises(ValueError, match=r"combine_adapters\(rank=0\): rank must be an integer >= 1, e\.g\. 8\.$"):
        combine_adapters(model, {"a": 1.0}, "mix", method="svd", rank=0)
    with pytest.raises(TypeError, match=r"combine_adapters\(rank=2\.5\): rank must be an integer >= 1"):
        combine_adapters(model, {"a": 1.0}, "mix", method="svd", rank=2.5)
    assert "mix" not in lora_layers(model)["blocks.0.query"].specs  # nothing half-built


# ----------------------------------------------------------------------------------------- PEFT's layout

def _bert() -> nn.Module:
    torch.manual_seed(0)
    return bert_model().eval()


def _bert_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_save_adapter_writes_peft_multi_adapter_layout_and_peft_loads_each(tmp_path):
    model = _bert()
    inject_lora(model, rank=2, alpha=4, target_modules=["query", "value"])
    add_adapter(model, "sports", rank=4, alpha=8, target_modules=["key", "dense"])
    _randomise(model)
    save_adapter(model, tmp_path)
    assert (tmp_path / "adapter_config.json").is_file() and (tmp_path / "sports" / "adapter_config.json").is_file()
    assert json.loads((tmp_path / "sports" / "adapter_config.json").read_text())["r"] == 4
    inputs = _bert_inputs()
    for name, where in (("default", tmp_path), ("sports", tmp_path / "sports")):
        set_adapter(model, name)
        ours = model(**inputs).logits
        theirs = peft.PeftModel.from_pretrained(_bert(), where).eval()
        assert_close(theirs(**inputs).logits, ours, rtol=1e-6, atol=1e-6)
    fresh = load_adapter(_bert(), tmp_path)  # the whole layout reads back
    for name in ("default", "sports"):
        set_adapter(fresh, name)
        set_adapter(model, name)
        assert torch.equal(fresh(**inputs).logits, model(**inputs).logits)
    save_adapter(model, tmp_path / "only", adapter_names=["sports"])
    assert sorted(p.name for p in (tmp_path / "only").iterdir()) == ["sports"]
    with pytest.raises(ValueError, match=r"save_adapter\(adapter_names=\['golf'\]\): no adapter named 'golf'"):
        save_adapter(model, tmp_path / "x", adapter_names=["golf"])


def test_we_load_every_adapter_of_a_peft_multi_adapter_model(tmp_path):
    theirs = peft.get_peft_model(
        _bert(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query"], task_type=SEQ_CLS)
    )
    theirs.add_adapter("legal", peft.LoraConfig(r=3, lora_alpha=3, target_modules=["value", "key"], task_type=SEQ_CLS))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    theirs.save_pretrained(tmp_path)
    ours = load_adapter(_bert(), tmp_path)
    inputs = _bert_inputs()
    theirs.eval()
    for name in ("default", "legal"):
        theirs.set_adapter(name)
        set_adapter(ours, name)
        assert_close(ours(**inputs).logits, theirs(**inputs).logits, rtol=1e-6, atol=1e-6)
    with route_adapters(ours, ["legal", "default", None]):
        mixed = ours(**inputs).logits
    theirs.set_adapter("legal")
    assert_close(mixed[0], theirs(**inputs).logits[0], rtol=1e-6, atol=1e-6)
    peft_mixed = theirs(**inputs, adapter_names=["legal", "default", "__base__"]).logits
    assert_close(mixed, peft_mixed, rtol=1e-6, atol=1e-6)  # PEFT's own mixed batch (inference only) agrees


def test_checkpoint_config_round_trip_rebuilds_every_named_adapter():
    from lightning_peft.peft.adapter import attached, technique

    model = _three_adapters()
    set_adapter(model, "c")
    config = attached(model)["lora"].config_dict()
    fresh = Tiny().double()
    technique("lora").inject(fresh, json.loads(json.dumps(config)))
    fresh.load_state_dict(model.state_dict())
    assert active_adapter(fresh) == "c"
    with route_adapters(model, ROUTE), route_adapters(fresh, ROUTE):
        assert torch.equal(fresh(IDS), model(IDS))


def test_single_adapter_checkpoint_format_of_earlier_versions_still_loads():
    from lightning_peft.peft.adapter import technique

    old = {"config": LoRAConfig(rank=2, target_modules=["query"]).to_dict(),
           "targets": ["blocks.0.query", "blocks.1.query"], "modules_to_save": ["head"]}
    model = Tiny()
    technique("lora").inject(model, old)
    assert active_adapter(model) == "default" and set(lora_layers(model)) == {"blocks.0.query", "blocks.1.query"}


def test_a_state_dict_of_the_single_adapter_layout_loads_into_the_first_adapter():
    model = Tiny().double()
    inject_lora(model, rank=2, target_modules=["query", "embed"])
    _randomise(model)
    old = {k.replace(".default", ""): v for k, v in model.state_dict().items()}  # lora_A.weight, lora_embedding_A
    assert "blocks.0.query.lora_A.weight" in old and "embed.lora_embedding_A" in old
    fresh = Tiny().double()
    inject_lora(fresh, rank=2, target_modules=["query", "embed"])
    fresh.load_state_dict(old)
    assert torch.equal(fresh(IDS), model(IDS))


def _trained_bert_classifier():
    """A tiny BERT classifier, its untouched copy, and the LoRA'd one after a training step (head trained too)."""
    base = bert_model().eval()
    reference = copy.deepcopy(base)
    model = copy.deepcopy(base)
    inject_lora(model, rank=2, alpha=4, target_modules=["query", "value"])  # modules_to_save: the classifier
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(1, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=torch.tensor([0, 1, 2, 1])).loss.backward()
    optimizer.step()
    return reference, model, ids


def test_disabled_adapters_give_the_base_model_output_with_the_original_head(tmp_path):
    reference, model, ids = _trained_bert_classifier()
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        assert not torch.allclose(model(input_ids=ids).logits, expected)  # the step changed the output
        with disable_adapters(model):
            assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    # Hugging Face PEFT on the same weights: its disable_adapter() switches the head back as well.
    save_adapter(model, tmp_path)
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(reference), tmp_path).eval()
    with torch.no_grad(), theirs.disable_adapter():
        assert_close(theirs(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_samples_routed_to_the_base_get_the_original_head():
    reference, model, ids = _trained_bert_classifier()
    route = ["default", None, "default", None]
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with route_adapters(model, route):
            out = model(input_ids=ids).logits
        expected = reference(input_ids=ids).logits
    assert_close(out[[0, 2]], adapted[[0, 2]], rtol=1e-6, atol=1e-6)
    assert_close(out[[1, 3]], expected[[1, 3]], rtol=1e-6, atol=1e-6)
