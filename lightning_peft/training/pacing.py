"""Curriculum pacing: how much of the score-sorted data optimizer step ``t`` admits.

Paper: Hacohen & Weinshall, "On The Power of Curriculum Learning in Training Deep Networks", arXiv:1904.03626 (a
*pacing function* says how much of the sorted data is admitted); Platanios et al., "Competence-based Curriculum
Learning for Neural Machine Translation", arXiv:1903.09848 (the "root" pacing).

With the ``N`` samples sorted by score, optimizer step ``t`` admits the easiest ``n_t = ceil(g(t) * N)`` samples,
with ``s`` the start fraction and ``T`` the duration (all four give ``g(t) = 1`` for ``t >= T``):

```text
linear        g(t) = s + (1 - s) * t / T
root          g(t) = sqrt(s^2 + (1 - s^2) * t / T)                  (Platanios et al.'s competence)
step          g(t) = s + (1 - s) * floor(K * t / T) / K             (K = stairs equal rises)
exponential   g(t) = s * (1 / s)^(t / T)
```
"""

from __future__ import annotations

import math

from lightning_peft._checks import choice, fraction, integer

__all__ = ["PACINGS", "check_pacing", "pacing_fraction"]

PACINGS = ("linear", "root", "step", "exponential")


def pacing_fraction(
    step: int,
    pacing: str = "linear",
    start_fraction: float = 0.2,
    duration: int = 1000,
    stairs: int = 4,
    who: str = "pacing_fraction",
) -> float:
    """``g(step)``: the fraction of the sorted data admitted at optimizer step ``step``.

    Args:
        step: The optimizer step, counted from 0.
        pacing: ``"linear"``, ``"root"``, ``"step"`` or ``"exponential"`` (formulas above).
        start_fraction: ``g(0)``, in ``(0, 1]``.
        duration: The step from which all the data is admitted (``g = 1``).
        stairs: Number of equal rises of the ``"step"`` pacing (ignored by the others).
        who: Name used in error messages.

    Returns:
        The fraction, in ``[start_fraction, 1]``.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or the pacing is unknown.

    Examples:
        >>> [round(pacing_fraction(t, "linear", 0.2, 4), 2) for t in range(6)]
        [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
        >>> [round(pacing_fraction(t, "step", 0.2, 4, stairs=2), 2) for t in range(5)]
        [0.2, 0.2, 0.6, 0.6, 1.0]
    """
    check_pacing(pacing, start_fraction, duration, stairs, who)
    integer(who, "step", step, minimum=0)
    if step >= duration:
        return 1.0
    s, x = float(start_fraction), step / duration
    if pacing == "linear":
        return s + (1 - s) * x
    if pacing == "root":
        return math.sqrt(s * s + (1 - s * s) * x)
    if pacing == "step":
        return s + (1 - s) * ((stairs * step) // duration) / stairs
    return s ** (1 - x)  # exponential: s * (1 / s) ** x


def check_pacing(pacing: object, start_fraction: object, duration: object, stairs: object, who: str) -> None:
    """Raises what [`pacing_fraction`][lightning_peft.training.pacing_fraction] would raise for these settings; returns
    None if they are valid."""
    choice(who, "pacing", pacing, PACINGS)
    fraction(who, "start_fraction", start_fraction,
             meaning="the share of the easiest data admitted at step 0; 1 admits everything from the start")
    integer(who, "duration", duration, minimum=1, meaning="the step from which all the data is admitted")
    integer(who, "stairs", stairs, minimum=1, meaning="the number of equal rises of the 'step' pacing")
