"""Gradient noise against the paper's rule: the variance (not the standard deviation) is eta / (1 + t)^gamma."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_peft.training import add_gradient_noise, noise_variance, step_generator


@pytest.mark.parametrize(("step", "eta", "gamma"), [(0, 0.3, 0.55), (99, 0.3, 0.55), (9, 1.0, 1.0)])
def test_the_noise_variance_is_eta_over_1_plus_t_to_the_gamma(step, eta, gamma):
    param = nn.Parameter(torch.zeros(1_000_000, dtype=torch.float64))
    param.grad = torch.zeros_like(param)
    std = add_gradient_noise([param], step, eta, gamma, generator=torch.Generator().manual_seed(0))
    expected = eta / (1 + step) ** gamma
    assert std == pytest.approx(math.sqrt(expected), rel=1e-12)
    sample = param.grad.var().item()
    # The sample variance of n normal draws has relative standard deviation sqrt(2 / n) = 0.14% here; 1% is 7 of those.
    assert sample == pytest.approx(expected, rel=0.01)
    assert abs(param.grad.mean().item()) < 5 * math.sqrt(expected / 1_000_000)
    if step > 0:  # the standard-deviation reading of the formula would give expected ** 2 instead
        assert abs(sample - expected**2) > 0.1 * expected


def test_noise_is_added_to_the_existing_gradient_and_skips_parameters_without_one():
    a = nn.Parameter(torch.zeros(5, dtype=torch.float64))
    b = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    a.grad = torch.arange(5, dtype=torch.float64)
    add_gradient_noise([a, b], 0, 0.25, generator=torch.Generator().manual_seed(3))
    expected = torch.arange(5, dtype=torch.float64) + 0.5 * torch.randn(5, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a.grad, expected, rtol=0, atol=1e-7)  # drawn in float32, added in float64
    assert b.grad is None


def test_the_same_seed_and_step_draw_the_same_noise_and_other_steps_do_not():
    def draw(seed, step):
        p = nn.Parameter(torch.zeros(100))
        p.grad = torch.zeros(100)
        add_gradient_noise([p], step, 1.0, generator=step_generator(seed, step))
        return p.grad

    assert torch.equal(draw(0, 5), draw(0, 5))
    assert not torch.equal(draw(0, 5), draw(0, 6)) and not torch.equal(draw(0, 5), draw(1, 5))


def test_noise_variance_example():
    assert noise_variance(3, 0.3, 0.5) == pytest.approx(0.15)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"step": -1}, r"add_gradient_noise\(step=-1\): step must be an integer >= 0"),
    ({"eta": 0.0}, r"add_gradient_noise\(eta=0\.0\): eta must be a finite number > 0 \(0\.01, 0\.3 or 1\.0 in the paper\)"),
    ({"gamma": float("nan")}, r"add_gradient_noise\(gamma=nan\): gamma must be a finite number >= 0"),
])
def test_bad_settings_are_refused(kwargs, match):
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.zeros(2)
    with pytest.raises(ValueError, match=match):
        add_gradient_noise([p], **{"step": 0, "eta": 0.1, **kwargs})


def test_a_sparse_gradient_is_refused():
    p = nn.Parameter(torch.zeros(4, 2))
    p.grad = torch.zeros(4, 2).to_sparse()
    with pytest.raises(TypeError, match=r"add_gradient_noise: a sparse gradient cannot take a dense update"):
        add_gradient_noise([p], 0, 0.1)
