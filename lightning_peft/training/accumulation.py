"""Gradient accumulation with a step-keyed schedule and exact loss scaling.

An optimizer step ``t`` is taken after a *window* of ``n_t`` micro-batches. Each micro-batch ``i`` of the window
contributes its (mean-reduced) loss divided by ``n_t``, so the accumulated gradient is:

```text
g_t = sum_{i in window t} grad(L_i) / n_t
```

which for equal-sized micro-batches is exactly the gradient of one batch ``n_t`` times as large.

Schedule. ``{step: count}``: the window that produces optimizer step ``t`` holds ``count`` micro-batches, where
``count`` belongs to the largest key ``<= t`` (step 0 is implied as 1 when absent). Keys are optimizer steps,
not epochs, so the count can change in the middle of an epoch.

Windows. In each epoch the windows are laid one after another from the epoch's first micro-batch, each as long
as the schedule says for the step it will produce. When the epoch runs out of micro-batches the last window is
shorter, and its losses are divided by its real length ``n < count`` (not by ``count``): every step averages
over exactly the micro-batches it got. ``windows(10, 0)`` for a constant count 4 is ``[4, 4, 2]``.

Shapes: none of this touches tensors except [`shorten_window`][lightning_peft.training.shorten_window], which scales
every ``.grad`` in place (any shape, dtype or device).

Target global batch: ``global = micro_batch_size * data_parallel_size * count``, where ``data_parallel_size`` is the
number of distinct batches one optimizer step sees (the number of processes under plain data parallelism; 1 under
pipeline parallelism, ``world / tp`` under tensor parallelism);
[`AccumulationSchedule.for_global_batch`][lightning_peft.training.AccumulationSchedule.for_global_batch] derives the
constant ``count``.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_peft._checks import integer


class Window(NamedTuple):
    """A window of micro-batches: it starts at micro-batch ``start``, holds ``size`` of them, then steps ``step``."""

    start: int
    size: int
    step: int


class MicroBatch(NamedTuple):
    """One micro-batch of
    [`AccumulationSchedule.micro_batches`][lightning_peft.training.AccumulationSchedule.micro_batches].

    ``batch`` is what the loader gave; divide its loss by ``window_size``; it contributes to optimizer step
    ``step``; step the optimizer after its backward when ``last``.
    """

    batch: Any
    window_size: int
    step: int
    last: bool


class AccumulationSchedule:
    """How many micro-batches each optimizer step accumulates, keyed by optimizer step.

    Args:
        schedule: ``{optimizer step: accumulation count}`` (step 0 is 1 when absent), or one count for every step.
        who: The name that error messages start with.

    Raises:
        TypeError: If ``schedule`` is neither an int nor a mapping of ints to ints.
        ValueError: If a step is negative or a count is below 1.

    Examples:
        >>> schedule = AccumulationSchedule({0: 1, 3: 4})
        >>> schedule.accumulation_at(2), schedule.accumulation_at(3)
        (1, 4)
        >>> schedule.windows(10)  # one epoch of 10 micro-batches from step 0: steps 0-2 take 1, then 4, then 3 left
        [1, 1, 1, 4, 3]
        >>> schedule.steps_in_epochs(10, epochs=2)
        8
    """

    def __init__(self, schedule: Mapping[int, int] | int, *, who: str = "AccumulationSchedule") -> None:
        self.who = who
        if _is_int(schedule):
            schedule = {0: schedule}
        if not isinstance(schedule, Mapping):
            raise TypeError(
                f"{who}(schedule={schedule!r}): schedule must be an int or a dict {{optimizer step: accumulation "
                "count}, e.g. {0: 1, 100: 4}."
            )
        for step, count in schedule.items():
            if not _is_int(step) or not _is_int(count):
                raise TypeError(
                    f"{who}(schedule={dict(schedule)!r}): steps and counts must be integers; got {step!r}: {count!r}."
                )
            if step < 0:
                raise ValueError(f"{who}(schedule={dict(schedule)!r}): step {step} is negative; steps count from 0.")
            if count < 1:
                raise ValueError(
                    f"{who}(schedule={dict(schedule)!r}): step {step} has count {count}; a count must be >= 1 "
                    "(1 = no accumulation)."
                )
        table = {0: 1, **{int(step): int(count) for step, count in schedule.items()}}
        self._steps = sorted(table)
        self._counts = [table[step] for step in self._steps]

    @property
    def schedule(self) -> dict[int, int]:
        """The schedule as ``{step: count}``, step 0 included."""
        return dict(zip(self._steps, self._counts))

    @property
    def is_constant(self) -> bool:
        """Whether every step accumulates the same count."""
        return len(set(self._counts)) == 1

    @property
    def min_count(self) -> int:
        """The smallest count of the schedule."""
        return min(self._counts)

    @classmethod
    def for_global_batch(
        cls, global_batch_size: int, micro_batch_size: int, data_parallel_size: int = 1, *,
        who: str = "AccumulationSchedule",
    ) -> AccumulationSchedule:
        """The constant schedule that makes ``micro_batch_size * data_parallel_size * count == global_batch_size``.

        ``data_parallel_size`` counts the distinct batches of one pass, not the processes: the ranks of one pipeline
        or one tensor-parallel group read the same batch.

        Raises:
            ValueError: If a size is not a positive integer, or ``global_batch_size`` is not a multiple of
                ``micro_batch_size * data_parallel_size``.

        Examples:
            >>> AccumulationSchedule.for_global_batch(64, micro_batch_size=8, data_parallel_size=2).schedule
            {0: 4}
        """
        sizes = {"global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size,
                 "data_parallel_size": data_parallel_size}
        for name, value in sizes.items():
            integer(who, name, value, minimum=1)
        per_pass = micro_batch_size * data_parallel_size
        if global_batch_size % per_pass:
            below = global_batch_size // per_pass * per_pass
            nearest = f"{below} or {below + per_pass}" if below else f"{per_pass}"
            raise ValueError(
                f"{who}(global_batch_size={global_batch_size}): the global batch size must be a multiple of "
                f"micro_batch_size * data_parallel_size = {micro_batch_size} * {data_parallel_size} = {per_pass}; the "
                f"nearest valid global batch sizes are {nearest} (or change the micro-batch size or the number of "
                "data-parallel replicas)."
            )
        return cls(global_batch_size // per_pass, who=who)

    def accumulation_at(self, step: int) -> int:
        """The number of micro-batches that optimizer step ``step`` accumulates."""
        _check_count("step", step, self.who)
        return self._counts[bisect.bisect_right(self._steps, step) - 1]

    def window_at(self, batch: int, num_batches: float = math.inf, start_step: int = 0) -> Window:
        """The window that holds micro-batch ``batch`` of an epoch of ``num_batches`` that starts at ``start_step``.

        ``num_batches`` may be ``math.inf`` (an epoch of unknown length): no window is then cut short.

        Examples:
            >>> AccumulationSchedule({0: 1, 2: 3}).window_at(6, num_batches=7)  # windows 1, 1, 3, 2
            Window(start=5, size=2, step=3)
        """
        _check_count("batch", batch, self.who)
        _check_count("start_step", start_step, self.who)
        if not batch < num_batches:
            raise ValueError(f"{self.who}.window_at(batch={batch}): the epoch has only {num_batches} micro-batches.")
        position = 0
        for step, count, next_step in self._segments(start_step):
            span = math.inf if next_step is None else (next_step - step) * count
            if batch < position + span:
                index = (batch - position) // count
                start = position + index * count
                return Window(start, int(min(count, num_batches - start)), step + index)
            position += span
        raise AssertionError("unreachable: the last segment is endless")

    def windows(self, num_batches: int, start_step: int = 0) -> list[int]:
        """The window sizes of one epoch of ``num_batches`` micro-batches whose first window produces ``start_step``.

        Examples:
            >>> AccumulationSchedule(4).windows(10)
            [4, 4, 2]
        """
        _check_count("num_batches", num_batches, self.who)
        _check_count("start_step", start_step, self.who)
        sizes: list[int] = []
        left = num_batches
        for step, count, next_step in self._segments(start_step):
            full = left // count if next_step is None else min(next_step - step, left // count)
            sizes += [count] * full
            left -= full * count
            if next_step is None or full < next_step - step:
                break
        return sizes + [left] if left else sizes

    def steps_in_epochs(self, num_batches: int, epochs: int, start_step: int = 0) -> int:
        """The number of optimizer steps in ``epochs`` epochs of ``num_batches`` micro-batches from ``start_step``.

        For a learning-rate schedule's ``total_steps``.
        """
        _check_count("num_batches", num_batches, self.who)
        _check_count("epochs", epochs, self.who)
        step = _check_count("start_step", start_step, self.who)
        for _ in range(epochs):
            step += self._steps_in_epoch(num_batches, step)
        return step - start_step

    def micro_batches(
        self, batches: Iterable[Any], start_step: int = 0, num_batches: float | None = None
    ) -> Iterator[MicroBatch]:
        """One epoch of ``batches`` for a plain training loop, with each micro-batch's window size and step.

        Args:
            batches: The epoch's micro-batches.
            start_step: The optimizer step that the epoch's first window produces.
            num_batches: How many micro-batches the epoch has; default ``len(batches)``. With ``math.inf`` (a
                stream of unknown length) no window is cut short, and a window left unfinished when the stream ends
                is never marked ``last``.

        Yields:
            `MicroBatch` ``(batch, window_size, step, last)``.

        Raises:
            TypeError: If ``batches`` has no ``len()`` and ``num_batches`` is not given.

        Examples:
            >>> step = 0
            >>> for micro in AccumulationSchedule(4).micro_batches(range(10), start_step=step):
            ...     # (loss_fn(model(micro.batch)) / micro.window_size).backward()
            ...     if micro.last:  # optimizer.step(); optimizer.zero_grad()
            ...         step += 1
            ...         print(micro.batch, micro.window_size)
            3 4
            7 4
            9 2
        """
        if num_batches is None:
            try:
                num_batches = len(batches)  # type: ignore[arg-type]
            except TypeError:
                raise TypeError(
                    f"{self.who}.micro_batches: {type(batches).__name__} has no len(), so the last window of the "
                    "epoch cannot be sized; pass num_batches= (math.inf for an endless stream)."
                ) from None
        window: Window | None = None
        for index, batch in enumerate(batches):
            if index >= num_batches:
                break
            if window is None or index >= window.start + window.size:
                window = self.window_at(index, num_batches, start_step)
            yield MicroBatch(batch, window.size, window.step, index == window.start + window.size - 1)

    def _segments(self, start_step: int) -> Iterator[tuple[int, int, int | None]]:
        """``(first step, count, next key or None)`` for each constant stretch of the schedule from ``start_step``."""
        first = bisect.bisect_right(self._steps, start_step) - 1
        step = start_step
        for index in range(first, len(self._steps)):
            next_step = self._steps[index + 1] if index + 1 < len(self._steps) else None
            yield step, self._counts[index], next_step
            if next_step is not None:
                step = next_step

    def _steps_in_epoch(self, num_batches: int, start_step: int) -> int:
        steps, left = 0, num_batches
        for step, count, next_step in self._segments(start_step):
            if next_step is None or (next_step - step) * count >= left:
                return steps + -(-left // count)
            steps += next_step - step
            left -= (next_step - step) * count
        raise AssertionError("unreachable: the last segment is endless")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AccumulationSchedule) and self.schedule == other.schedule

    def __hash__(self) -> int:
        return hash(tuple(self.schedule.items()))

    def __repr__(self) -> str:
        return f"AccumulationSchedule({self.schedule})"


@torch.no_grad()
def shorten_window(parameters: Iterable[nn.Parameter] | Iterable[torch.Tensor], planned: int, actual: int) -> float:
    """End a window early: turn gradients accumulated as ``sum g_i / planned`` into ``sum g_i / actual``.

    For a stream of unknown length that ends inside a window: call it before the backward of the window's last
    micro-batch (the ``actual``-th), then divide that micro-batch's loss by ``actual``. The step then averages
    over the ``actual`` micro-batches it got, as if the window had been planned that long.

    Args:
        parameters: The parameters whose ``.grad`` (where present) holds the window's first ``actual - 1``
            micro-batches, each divided by ``planned``.
        planned: The window size the losses were divided by.
        actual: The number of micro-batches the window really has, ``1 <= actual <= planned``.

    Returns:
        The factor applied, ``planned / actual``.

    Raises:
        ValueError: If ``actual`` is not in ``[1, planned]``.
    """
    integer("shorten_window", "planned", planned, minimum=0)
    if not _is_int(actual) or not 1 <= actual <= planned:
        raise ValueError(f"shorten_window(planned={planned}, actual={actual!r}): actual must be in [1, planned].")
    factor = planned / actual
    if factor != 1:
        for param in parameters:
            if param.grad is not None:
                param.grad.mul_(factor)
    return factor


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_count(name: str, value: object, who: str) -> int:
    return integer(who, name, value, minimum=0)
