"""The accumulation schedule: windows per epoch, exact loss scaling in float64, target global batch arithmetic."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from lightning_peft.training import AccumulationSchedule
from lightning_peft.training.accumulation import MicroBatch, Window, shorten_window


def simulate(schedule: AccumulationSchedule, num_batches: int, start_step: int) -> list[int]:
    """The windows one at a time: each takes the count of the step it produces, the last one what is left."""
    sizes, position, step = [], 0, start_step
    while position < num_batches:
        sizes.append(min(schedule.accumulation_at(step), num_batches - position))
        position, step = position + sizes[-1], step + 1
    return sizes


@pytest.mark.parametrize(("schedule", "num_batches", "start_step", "expected"), [
    (4, 10, 0, [4, 4, 2]),
    (4, 8, 0, [4, 4]),
    ({0: 1, 3: 4}, 10, 0, [1, 1, 1, 4, 3]),
    ({0: 1, 3: 4}, 10, 2, [1, 4, 4, 1]),  # an epoch that starts at step 2: one step of 1, then 4s
    ({1: 3}, 7, 0, [1, 3, 3]),  # step 0 is implied as 1
    ({0: 4, 2: 1}, 10, 0, [4, 4, 1, 1]),  # the count may also fall
    (3, 0, 5, []),
])
def test_windows_are_laid_from_the_first_micro_batch_and_the_last_one_is_short(
    schedule, num_batches, start_step, expected
):
    assert AccumulationSchedule(schedule).windows(num_batches, start_step) == expected


def test_windows_window_at_and_step_counts_agree_with_a_step_by_step_simulation():
    rng = random.Random(0)
    for _ in range(300):
        schedule = AccumulationSchedule({k: rng.randint(1, 5) for k in rng.sample(range(12), rng.randint(0, 4))})
        num_batches, start = rng.randint(0, 30), rng.randint(0, 15)
        sizes = simulate(schedule, num_batches, start)
        assert schedule.windows(num_batches, start) == sizes
        position = 0
        for index, size in enumerate(sizes):
            for batch in range(position, position + size):
                assert schedule.window_at(batch, num_batches, start) == Window(position, size, start + index)
            position += size
        epochs, step = rng.randint(0, 3), start
        for _ in range(epochs):
            step += len(simulate(schedule, num_batches, step))
        assert schedule.steps_in_epochs(num_batches, epochs, start) == step - start


def test_an_epoch_of_unknown_length_cuts_no_window():
    schedule = AccumulationSchedule({0: 2, 2: 5})
    assert schedule.window_at(6, math.inf) == Window(4, 5, 2)
    assert schedule.window_at(6, 7) == Window(4, 3, 2)


def test_the_schedule_is_keyed_by_step_with_step_0_implied():
    schedule = AccumulationSchedule({100: 4, 10: 2})
    assert schedule.schedule == {0: 1, 10: 2, 100: 4}
    assert [schedule.accumulation_at(t) for t in (0, 9, 10, 99, 100, 10**9)] == [1, 1, 2, 2, 4, 4]
    assert not schedule.is_constant and schedule.min_count == 1
    assert AccumulationSchedule(3) == AccumulationSchedule({0: 3}) and AccumulationSchedule(3).is_constant
    assert repr(AccumulationSchedule({0: 2})) == "AccumulationSchedule({0: 2})"


def loss_fn(weight, x, y):
    return ((x @ weight - y) ** 2).mean()  # mean over the micro-batch, as a model's loss is


def test_a_window_gives_the_gradient_of_one_batch_as_large_including_the_short_last_one():
    """10 micro-batches of 3, count 4: windows 4, 4, 2; each equals one batch of 12, 12, 6 samples (float64)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(30, 5, dtype=torch.float64, generator=generator)
    y = torch.randn(30, 2, dtype=torch.float64, generator=generator)
    batches = list(zip(x.split(3), y.split(3)))
    weight = torch.randn(5, 2, dtype=torch.float64, generator=generator, requires_grad=True)
    grads, sizes = [], []
    for micro in AccumulationSchedule(4).micro_batches(batches):
        (loss_fn(weight, *micro.batch) / micro.window_size).backward()
        if micro.last:
            grads.append(weight.grad.clone())
            sizes.append(micro.window_size)
            weight.grad = None
    assert sizes == [4, 4, 2]
    for grad, (lo, hi) in zip(grads, [(0, 12), (12, 24), (24, 30)]):
        reference = weight.detach().clone().requires_grad_()
        loss_fn(reference, x[lo:hi], y[lo:hi]).backward()
        torch.testing.assert_close(grad, reference.grad, rtol=1e-13, atol=0)
    wrong = weight.detach().clone().requires_grad_()  # dividing the short window by the count 4 would halve it
    sum(loss_fn(wrong, x[i:i + 3], y[i:i + 3]) / 4 for i in (24, 27)).backward()
    assert not torch.allclose(wrong.grad, grads[-1])


def test_shorten_window_turns_a_cut_window_into_the_mean_of_what_it_had():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(9, 4, dtype=torch.float64, generator=generator)
    y = torch.randn(9, 1, dtype=torch.float64, generator=generator)
    weight = nn.Parameter(torch.randn(4, 1, dtype=torch.float64, generator=generator))
    unused = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    for lo in (0, 3):  # planned 5 micro-batches, the stream ends after 3
        (loss_fn(weight, x[lo:lo + 3], y[lo:lo + 3]) / 5).backward()
    assert shorten_window([weight, unused], planned=5, actual=3) == pytest.approx(5 / 3)
    (loss_fn(weight, x[6:], y[6:]) / 3).backward()
    reference = weight.detach().clone().requires_grad_()
    loss_fn(reference, x, y).backward()
    torch.testing.assert_close(weight.grad, reference.grad, rtol=1e-13, atol=1e-15)
    assert unused.grad is None


def test_micro_batches_carry_the_step_across_epochs():
    schedule = AccumulationSchedule({0: 1, 1: 2})
    first = list(schedule.micro_batches(["a", "b", "c", "d"]))
    assert first == [MicroBatch("a", 1, 0, True), MicroBatch("b", 2, 1, False), MicroBatch("c", 2, 1, True),
                     MicroBatch("d", 1, 2, True)]
    second = list(schedule.micro_batches(iter("efgh"), start_step=3, num_batches=4))
    assert [(m.window_size, m.step, m.last) for m in second] == [(2, 3, False), (2, 3, True), (2, 4, False),
                                                                 (2, 4, True)]
    endless = list(schedule.micro_batches(iter("abcd"), num_batches=math.inf))
    assert [m.last for m in endless] == [True, False, True, False]  # the unfinished window is never stepped
    assert [m.batch for m in schedule.micro_batches("abcdef", num_batches=2)] == ["a", "b"]  # like limit_train_batches


@pytest.mark.parametrize(("global_batch", "micro", "world", "count"), [(64, 8, 2, 4), (32, 16, 1, 2), (8, 4, 2, 1)])
def test_the_count_for_a_target_global_batch(global_batch, micro, world, count):
    schedule = AccumulationSchedule.for_global_batch(global_batch, micro, world)
    assert schedule.schedule == {0: count}
    assert micro * world * schedule.accumulation_at(0) == global_batch


@pytest.mark.parametrize(("global_batch", "match"), [
    (60, (r"AccumulationSchedule\(global_batch_size=60\): the global batch size must be a multiple of "
          r"micro_batch_size \* data_parallel_size = 8 \* 2 = 16; the nearest valid global batch sizes are 48 or 64")),
    (10, r"AccumulationSchedule\(global_batch_size=10\): .* = 16; the nearest valid global batch sizes are 16 \("),
])
def test_a_global_batch_that_is_not_a_multiple_is_refused_with_the_nearest_valid_ones(global_batch, match):
    with pytest.raises(ValueError, match=match):
        AccumulationSchedule.for_global_batch(global_batch, micro_batch_size=8, data_parallel_size=2)


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: AccumulationSchedule("4"), TypeError,
     r"AccumulationSchedule\(schedule='4'\): schedule must be an int or a dict \{optimizer step: accumulation count\}"),
    (lambda: AccumulationSchedule({0: 2.0}), TypeError,
     r"AccumulationSchedule\(schedule=\{0: 2\.0\}\): steps and counts must be integers; got 0: 2\.0"),
    (lambda: AccumulationSchedule({True: 2}), TypeError, r"steps and counts must be integers; got True: 2"),
    (lambda: AccumulationSchedule({-1: 2}), ValueError,
     r"AccumulationSchedule\(schedule=\{-1: 2\}\): step -1 is negative; steps count from 0"),
    (lambda: AccumulationSchedule({0: 1, 5: 0}), ValueError,
     r"AccumulationSchedule\(schedule=\{0: 1, 5: 0\}\): step 5 has count 0; a count must be >= 1"),
    (lambda: AccumulationSchedule(0), ValueError, r"step 0 has count 0; a count must be >= 1"),
    (lambda: AccumulationSchedule(2).accumulation_at(-1), ValueError,
     r"AccumulationSchedule\(step=-1\): step must be an integer >= 0"),
    (lambda: AccumulationSchedule(2).windows(3.5), TypeError,
     r"AccumulationSchedule\(num_batches=3\.5\): num_batches must be an integer >= 0"),
    (lambda: AccumulationSchedule(2).windows(3, start_step=-2), ValueError,
     r"AccumulationSchedule\(start_step=-2\): start_step must be an integer >= 0"),
    (lambda: AccumulationSchedule(2).steps_in_epochs(3, epochs=-1), ValueError,
     r"AccumulationSchedule\(epochs=-1\): epochs must be an integer >= 0"),
    (lambda: AccumulationSchedule(2).window_at(-1), ValueError,
     r"AccumulationSchedule\(batch=-1\): batch must be an integer >= 0"),
    (lambda: AccumulationSchedule(2).window_at(5, num_batches=5), ValueError,
     r"AccumulationSchedule.window_at\(batch=5\): the epoch has only 5 micro-batches"),
    (lambda: list(AccumulationSchedule(2).micro_batches(iter([1, 2]))), TypeError,
     (r"AccumulationSchedule.micro_batches: list_iterator has no len\(\), so the last window of the epoch cannot "
      r"be sized; pass num_batches= \(math.inf for an endless stream\)")),
    (lambda: AccumulationSchedule.for_global_batch(32, 0), ValueError,
     r"AccumulationSchedule\(micro_batch_size=0\): micro_batch_size must be an integer >= 1"),
    (lambda: shorten_window([], planned=2, actual=3), ValueError,
     r"shorten_window\(planned=2, actual=3\): actual must be in \[1, planned\]"),
    (lambda: shorten_window([], planned=-1, actual=1), ValueError,
     r"shorten_window\(planned=-1\): planned must be an integer >= 0"),
])
def test_bad_arguments_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()

