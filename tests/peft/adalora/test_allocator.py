"""AdaLoRA's schedule against PEFT's ``RankAllocator`` / ``update_and_allocate`` on the same model, batches and
gradients over a whole run (warm-up, the cubic budget, masking every ``deltaT`` steps, the final fixed mask), with the
orthogonal regularisation in the loss as PEFT adds it; and the saved, resized file both ways."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_peft.peft import load_adapter, save_adapter, update_and_allocate
from lightning_peft.peft.adalora import (
    adalora_layers,
    add_orthogonal_gradient,
    orthogonal_loss,
    start_allocation,
)
from lightning_peft.peft.adapter import attached
from tests.peft._oracle import PREFIX, adapted_pair, close, inputs, outputs, trainable
from tests.peft.adalora._oracle import ADALORA

SCHEDULE = {"target_modules": ["lin0", "lin1"], "init_r": 4, "target_r": 2, "total_step": 12, "tinit": 2,
            "tfinal": 3, "deltaT": 2, "lora_alpha": 4}


def loss_of(y):
    return y.square().sum() + y.sum()


def with_loss(model: nn.Module) -> None:
    """Make ``model`` return its loss as ``.loss`` (PEFT's AdaLoRA adds its regularisation to an output's ``loss``)."""
    forward = model.forward
    model.forward = lambda x: SimpleNamespace(loss=loss_of(forward(x)))


def run_both(kwargs, steps):
    """Train ours and PEFT's side by side; yield (step, ours, PEFT's, our pattern, PEFT's pattern) after each."""
    ours, theirs, base = adapted_pair("MLP", kwargs, ADALORA)
    with_loss(theirs.base_model.model)
    optimizers = [torch.optim.SGD(trainable(m).values(), lr=0.05) for m in (ours, theirs)]
    for step in range(steps):
        x = inputs(base, seed=step)
        y = ours(x)
        (loss_of(y) + orthogonal_loss(ours)).backward()
        theirs.base_model(x).loss.backward()  # AdaLoraModel.forward adds the regularisation (PeftModel skips it)
        for optimizer in optimizers:
            optimizer.step()
        mine = update_and_allocate(ours, step)
        theirs.base_model.update_and_allocate(step)
        for optimizer in optimizers:
            optimizer.zero_grad()
        yield step, ours, theirs, mine, theirs.peft_config["default"].rank_pattern


def test_a_whole_schedule_masks_and_trains_as_peft():
    masked_at, previous = [], None
    for step, ours, theirs, mine, pattern in run_both(SCHEDULE, 14):
        their_params = dict(theirs.named_parameters())
        for name, p in trainable(ours).items():  # E holds the masks: equal after every step
            close(p, their_params[PREFIX + ADALORA.rename(name)], f"step {step}: {name}")
        allocated = attached(ours)["adalora"].rank_pattern()
        expected = None if pattern is None else {k.replace(".default", ""): v
                                                 for k, v in pattern.items()}
        assert allocated == expected, f"step {step}"
        if mine is not None:
            masked_at.append(step)
        if pattern is not None and pattern != previous:
            previous = pattern
    # masks at t % deltaT == 0 between tinit and T - tfinal, then the final one at T - tfinal = 9
    assert masked_at == [4, 6, 8, 9]
    kept = [sum(v) for v in previous.values()]
    assert sum(kept) == 2 * 2 and kept != [4, 4]  # the final budget, target_r per layer on average
    layers = adalora_layers(ours)
    assert all(torch.equal(layer.lora_E.detach().flatten() == 0, ~torch.tensor(previous[f"{n}.lora_E.default"]))
               for n, layer in layers.items())  # after the final phase's steps, still masked by the final pattern


def test_the_scores_are_peft_s_after_each_step():
    for step, ours, theirs, _, _ in run_both(SCHEDULE, 6):
        allocator = attached(ours)["adalora"].allocator
        theirs_allocator = theirs.base_model.rankallocator
        for key, value in allocator.average.items():
            name, factor = key.rsplit(".", 1)
            their_key = f"{name}.{factor}.default"
            close(value, theirs_allocator.exp_avg_ipt[their_key], f"step {step}: sensitivity of {key}")
            close(allocator.uncertainty[key], theirs_allocator.exp_avg_unc[their_key], f"step {step}: {key}")


@pytest.mark.filterwarnings("ignore:The following rank_pattern keys did not match:RuntimeWarning")  # PEFT's own
def test_the_allocated_adapter_is_saved_resized_and_loads_both_ways(tmp_path):
    *_, (_, ours, theirs, _, _) = run_both(SCHEDULE, 11)
    base = copy.deepcopy(ours)
    from lightning_peft.peft import unload_adalora
    unload_adalora(base, merge=False)
    x = inputs(base)
    expected = outputs(ours, x)
    save_adapter(ours, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert sorted(written["rank_pattern"]) == ["lin0.lora_E", "lin1.lora_E"]
    import peft

    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours").eval()
    close(outputs(loaded, x), expected, "PEFT loading our resized file")
    assert loaded.base_model.model.lin0.lora_A["default"].shape[0] == sum(written["rank_pattern"]["lin0.lora_E"])
    theirs.save_pretrained(tmp_path / "theirs")
    mine = load_adapter(copy.deepcopy(base), tmp_path / "theirs").eval()
    close(outputs(mine, x), expected, "our loading of PEFT's resized file")
    ranks = {n: layer.rank for n, layer in adalora_layers(mine).items()}
    assert ranks == {n[:-len(".lora_E")]: sum(v) for n, v in written["rank_pattern"].items()}
    save_adapter(mine, tmp_path / "again")  # a loaded, resized adapter writes the same file again
    assert json.loads((tmp_path / "again" / "adapter_config.json").read_text())["rank_pattern"] == \
        written["rank_pattern"]


def test_the_orthogonal_gradient_equals_the_regularisation_in_the_loss():
    ours = adapted_pair("MLP", SCHEDULE, ADALORA)[0]
    other = copy.deepcopy(ours)
    x = inputs(ours)
    (ours(x).sum() + orthogonal_loss(ours)).backward()
    other(x).sum().backward()
    loss = add_orthogonal_gradient(other)
    assert loss is not None and loss > 0
    for (name, p), q in zip(trainable(ours).items(), trainable(other).values()):
        close(q.grad, p.grad, f"gradient of {name}")


def test_allocation_without_total_step_or_with_a_bad_schedule_is_refused():
    kwargs = {k: v for k, v in SCHEDULE.items() if k != "total_step"}
    ours = adapted_pair("MLP", SCHEDULE, ADALORA)[0]
    from lightning_peft.peft import AdaLoraConfig, inject_adalora
    from tests.peft._oracle import base_model

    bare = base_model("MLP")
    inject_adalora(bare, AdaLoraConfig(**kwargs))
    with pytest.raises(ValueError, match=r"update_and_allocate: AdaLoraConfig\(total_step=None\) and "
                                         r"total_step=None; give total_step"):
        update_and_allocate(bare, 0)
    with pytest.raises(ValueError, match=r"AdaLoRA\(tinit=2, tfinal=3, total_step=5\): the schedule leaves no step"):
        start_allocation(ours, 5)
    with pytest.raises(RuntimeError, match=r"AdaLoRA: lin0.lora_A has no gradient at the allocation"):
        update_and_allocate(ours, 0)


def test_gradients_zeroed_before_the_allocation_are_refused_not_scored_as_zero():
    """zero_grad(set_to_none=False) before update_and_allocate (or after the step, under the callback with manual
    optimization) leaves zeros: every triplet would score 0 and all would be masked, below the budget too."""
    model = adapted_pair("MLP", SCHEDULE, ADALORA)[0]
    optimizer = torch.optim.SGD(trainable(model).values(), lr=0.1)
    loss_of(model(inputs(model))).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"AdaLoRA: every factor's gradient is zero at the allocation, so every "
                                           r"triplet would score 0 and be masked .* before zero_grad \(with the "
                                           r"AdaLoRA callback and manual optimization: zero the gradients before"):
        update_and_allocate(model, 0)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing masked
