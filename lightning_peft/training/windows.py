"""The accumulation windows of a training run that may resume anywhere, and may end inside a window.

The windows of an epoch are laid from an *anchor*: a micro-batch known to start a window and the optimizer step it
produces (the epoch's first micro-batch and the step then; saved in checkpoints, so a resumed epoch keeps its windows).
Each window follows [`AccumulationSchedule`][lightning_peft.training.AccumulationSchedule].

Loss division (`WindowTracker.loss_window`): each micro-batch's loss is divided by its window's size, except

- resumed inside a window (a checkpoint saved between its micro-batches): the gradient of the micro-batches before
  the checkpoint is not in the checkpoint, so the rest of the window is divided by the micro-batches it has left;
- a stream of unknown length ending inside a window: the step comes at the last micro-batch, so it is divided by the
  micro-batches the window got, and the gradient accumulated so far is rescaled
  ([`shorten_window`][lightning_peft.training.shorten_window]).

Either way each optimizer step averages over the micro-batches it got. Lightning-free: the ``GradientAccumulation``
callback feeds it the trainer's counters.

Examples:
    >>> from lightning_peft.training import AccumulationSchedule
    >>> tracker, schedule = WindowTracker(), AccumulationSchedule(4)
    >>> tracker.window(schedule, epoch=0, batch=5, num_batches=10, step=0)  # anchored at batch 5, step 0
    Window(start=5, size=4, step=0)
    >>> tracker.loss_window(schedule, epoch=0, batch=9, num_batches=10, step=1, last=True)  # 9 starts a window of 1
    (1, None)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_peft.training.accumulation import AccumulationSchedule, Window

__all__ = ["WindowTracker", "fit_steps"]


class WindowTracker:
    """Where the windows of the current epoch start (the anchor), and where a resumed run started."""

    def __init__(self) -> None:
        # (epoch, batch, step): a window of `epoch` starts at micro-batch `batch` and produces optimizer step `step`.
        self.anchor: tuple[int, int, int] | None = None
        self._restored = False  # a checkpoint was loaded; the next micro-batch is where the resumed run starts
        self._resumed_at: tuple[int, int] | None = None  # (epoch, batch) of that start

    def start_fit(self) -> None:
        """A new fit: no resume yet (a checkpoint's state, if any, comes after)."""
        self._restored, self._resumed_at = False, None

    def restore(self, anchor: Sequence[int] | None) -> None:
        """The anchor from a checkpoint (`anchor` as a list, or None)."""
        self.anchor = None if anchor is None else (int(anchor[0]), int(anchor[1]), int(anchor[2]))
        self._restored, self._resumed_at = True, None

    def window(self, schedule: AccumulationSchedule, epoch: int, batch: int, num_batches: float, step: int,
               anchor: bool = True) -> Window | None:
        """The window of micro-batch ``batch`` of ``epoch`` (``num_batches`` long; ``step``: the optimizer step now).

        Without an anchor for this epoch at or before ``batch``, ``batch`` becomes one when ``anchor`` (a checkpoint
        from a step's end); None otherwise.
        """
        if self.anchor is None or self.anchor[0] != epoch or batch < self.anchor[1]:
            if not anchor:
                return None
            self.anchor = (epoch, batch, step)
        _, first, first_step = self.anchor
        window = schedule.window_at(batch - first, num_batches - first, first_step)
        return Window(window.start + first, window.size, window.step)

    def starts(self, schedule: AccumulationSchedule, epoch: int, num_batches: float, step: int, batch: int) -> bool:
        """Whether micro-batch ``batch`` starts its window (zero the gradients there)."""
        return batch == self.window(schedule, epoch, batch, num_batches, step).start  # type: ignore[union-attr]

    def ends(self, schedule: AccumulationSchedule, epoch: int, num_batches: float, step: int, ready: int) -> bool:
        """Whether the ``ready`` micro-batches fetched in ``epoch`` end a window (step the optimizer then)."""
        if ready == 0:
            return True
        window = self.window(schedule, epoch, ready - 1, num_batches, step, anchor=False)
        return window is None or ready == window.start + window.size

    def loss_window(self, schedule: AccumulationSchedule, epoch: int, batch: int, num_batches: float, step: int,
                    last: bool) -> tuple[int, int | None]:
        """``(divisor, planned)`` for micro-batch ``batch``: divide its loss by ``divisor``; if ``planned`` is not
        None, first rescale the gradient accumulated so far with ``shorten_window(params, planned, divisor)``.

        ``last``: the stream ends after this micro-batch (the trainer steps after it).
        """
        window = self.window(schedule, epoch, batch, num_batches, step, anchor=True)
        if window is None:  # anchor=True always finds one: an internal error, kept under python -O too
            raise RuntimeError(f"lightning-peft: no accumulation window for micro-batch {batch} of epoch {epoch} "
                               f"(step {step}); this is a bug, please report it with the schedule {schedule!r}.")
        if self._restored:  # the first micro-batch after a checkpoint was loaded
            self._restored, self._resumed_at = False, (epoch, batch)
        first, end = window.start, window.start + window.size
        if self._resumed_at is not None and self._resumed_at[0] == epoch and first < self._resumed_at[1] < end:
            first = self._resumed_at[1]  # resumed inside this window: only its micro-batches from here count
        size = end - first
        if last and batch + 1 < end:  # the stream ended inside the window (only a loader without len() can)
            actual = batch + 1 - first
            return actual, (size if actual > 1 else None)
        return size, None


def fit_steps(schedule: AccumulationSchedule, num_batches: float, max_epochs: int | None, max_steps: int) -> float:
    """The optimizer steps of a fit of ``max_epochs`` epochs of ``num_batches`` micro-batches, at most ``max_steps``
    (-1: no limit); ``inf`` when the fit has no end in steps (``max_epochs`` None or -1, ``num_batches`` inf).

    Examples:
        >>> fit_steps(AccumulationSchedule({0: 1, 3: 4}), num_batches=10, max_epochs=2, max_steps=-1)
        8
    """
    if max_epochs is None or max_epochs == -1 or num_batches == math.inf:
        return math.inf if max_steps == -1 else max_steps
    steps = schedule.steps_in_epochs(int(num_batches), max(max_epochs, 1))
    return steps if max_steps == -1 else min(steps, max_steps)
