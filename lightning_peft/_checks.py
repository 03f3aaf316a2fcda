"""One validator vocabulary and one message format for every setting lightning-peft takes.

Every message reads ``who(name=value): name must be <requirement>[, e.g. <example>][ (<meaning>)].``: it names
what was given and what would be accepted. A wrong type raises `TypeError`, a value out of range
`ValueError`. ``bool`` is never accepted as a number (``True`` is an ``int`` in Python, never a rank).
Each check returns the normalised value (``int`` / ``float``), so a caller writes ``rank = integer(...)``.
An element of a list or dict argument is checked with ``of=(argument, as given)``: the message names the argument as
the user gave it, then the element (``LoRA(layers_to_transform=[0, -1]): layers_to_transform[1]=-1 must be ...``).

>>> integer("LoRA", "rank", 8, minimum=1)
8
>>> integer("LoRA", "rank", True, minimum=1, example="8")
Traceback (most recent call last):
TypeError: LoRA(rank=True): rank must be an integer >= 1, e.g. 8.
>>> probability("LoRA", "dropout", 1.0)
Traceback (most recent call last):
ValueError: LoRA(dropout=1.0): dropout must be a number in [0, 1), e.g. 0.1.
>>> choice("LoRA", "bias", "some", ("none", "all"))
Traceback (most recent call last):
ValueError: LoRA(bias='some'): bias must be one of 'none', 'all'.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Iterable
from typing import TypeVar

from ._regex import backtracking

T = TypeVar("T")


def _fail(error: type[Exception], who: str, name: str, value: object, requirement: str, example: str | None,
          meaning: str | None, of: tuple[str, object] | None = None) -> Exception:
    tail = (f", e.g. {example}" if example else "") + (f" ({meaning})" if meaning else "")
    return error(f"{_given(who, name, value, of)} must be {requirement}{tail}.")


def _given(who: str, name: str, value: object, of: tuple[str, object] | None) -> str:
    """``who(name=value): name`` or, for an element ``name`` of the argument ``of = (argument, as given)``,
    ``who(argument=given): name=value``: a message names what the user wrote, then the bad part."""
    return f"{who}({name}={value!r}): {name}" if of is None else f"{who}({of[0]}={of[1]!r}): {name}={value!r}"


def _bound(minimum: float | None, maximum: float | None, open_low: bool, open_high: bool) -> str:
    if minimum is not None and maximum is not None:
        return f"in {'(' if open_low else '['}{minimum}, {maximum}{')' if open_high else ']'}"
    if minimum is not None:
        return f"{'>' if open_low else '>='} {minimum}"
    if maximum is not None:
        return f"{'<' if open_high else '<='} {maximum}"
    return ""


def _in_range(value: float, minimum: float | None, maximum: float | None, open_low: bool, open_high: bool) -> bool:
    if minimum is not None and (value <= minimum if open_low else value < minimum):
        return False
    return not (maximum is not None and (value >= maximum if open_high else value > maximum))


def integer(who: str, name: str, value: object, *, minimum: int | None = None, maximum: int | None = None,
            example: str | None = None, meaning: str | None = None, of: tuple[str, object] | None = None) -> int:
    """``value`` as an ``int``: an integral number (not a bool) within ``[minimum, maximum]``.

    >>> integer("LoRA", "layers_to_transform[1]", -1, minimum=0, of=("layers_to_transform", [0, -1]))
    Traceback (most recent call last):
    ValueError: LoRA(layers_to_transform=[0, -1]): layers_to_transform[1]=-1 must be an integer >= 0.
    """
    requirement = " ".join(part for part in ("an integer", _bound(minimum, maximum, False, False)) if part)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(TypeError, who, name, value, requirement, example, meaning, of)
    if not _in_range(value, minimum, maximum, False, False):
        raise _fail(ValueError, who, name, value, requirement, example, meaning, of)
    return int(value)


def real(who: str, name: str, value: object, *, minimum: float | None = None, maximum: float | None = None,
         open_low: bool = False, open_high: bool = False, example: str | None = None,
         meaning: str | None = None, of: tuple[str, object] | None = None) -> float:
    """``value`` as a ``float``: a finite real number (not a bool) within the given bounds."""
    bound = _bound(minimum, maximum, open_low, open_high)
    requirement = f"a finite number {bound}" if bound else "a finite number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(TypeError, who, name, value, requirement, example, meaning, of)
    if not math.isfinite(value) or not _in_range(value, minimum, maximum, open_low, open_high):
        raise _fail(ValueError, who, name, value, requirement, example, meaning, of)
    return float(value)


def positive(who: str, name: str, value: object, *, example: str | None = None, meaning: str | None = None,
             of: tuple[str, object] | None = None) -> float:
    """``value`` as a ``float`` > 0 and finite."""
    return real(who, name, value, minimum=0, open_low=True, example=example, meaning=meaning, of=of)


def probability(who: str, name: str, value: object, *, example: str | None = "0.1",
                meaning: str | None = None) -> float:
    """A dropout-like probability in ``[0, 1)``."""
    requirement = "a number in [0, 1)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(TypeError, who, name, value, requirement, example, meaning)
    if not 0 <= value < 1:
        raise _fail(ValueError, who, name, value, requirement, example, meaning)
    return float(value)


def fraction(who: str, name: str, value: object, *, example: str | None = None, meaning: str | None = None) -> float:
    """A share in ``(0, 1]``."""
    return real(who, name, value, minimum=0, maximum=1, open_low=True, example=example, meaning=meaning)


def boolean(who: str, name: str, value: object) -> bool:
    """``value`` if it is exactly ``True`` or ``False`` (not ``1``, not ``"yes"``)."""
    if not isinstance(value, bool):
        raise TypeError(f"{who}({name}={value!r}): {name} must be True or False.")
    return value


def choice(who: str, name: str, value: T, choices: Iterable[object]) -> T:
    """``value`` if it is one of ``choices``."""
    choices = tuple(choices)
    try:
        known = value in choices
    except TypeError:  # an unhashable value compared against a set-like
        known = False
    if not known:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{who}({name}={value!r}): {name} must be one of {listed}.")
    return value


def names(who: str, name: str, value: object, *, example: str = "['classifier']") -> list[str]:
    """A list of strings from any iterable of strings but a bare string (sets come out sorted)."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"{who}({name}={value!r}): {name} must be a list of names, e.g. {example}.")
    items = list(value)
    if not all(isinstance(item, str) for item in items):
        raise TypeError(f"{who}({name}={value!r}): {name} must be a list of names, e.g. {example}.")
    return sorted(items) if isinstance(value, (set, frozenset)) else items


def target_names(who: str, name: str, value: object, *, example: str, all_linear: bool = True) -> list[str] | str:
    """A ``target_modules``-like field: a regular expression string (``"all-linear"`` kept, or refused where the
    technique has no ``all_linear``), or a list of module names or dotted suffixes (non-empty for
    ``target_modules``); ``example`` is such a list, for the messages."""
    if isinstance(value, str):
        if value == "all-linear" and not all_linear:
            raise ValueError(f"{who}({name}='all-linear'): not supported by lightning-peft's {who}; name the modules "
                             f"(e.g. {example}).")
        return value if value == "all-linear" else regex(who, name, value)
    if name == "target_modules" and not value:
        raise TypeError(f"{who}(target_modules={value!r}): give a non-empty list of module names or dotted suffixes "
                        f"(e.g. {example}) or a regular expression string.")
    return names(who, name, value, example=example)


def module_fields(config: object, who: str, *, example: str, all_linear: bool = True) -> None:
    """Check a frozen config's ``target_modules``, ``exclude_modules`` and ``modules_to_save`` (the latter two where
    given) and set their normalised values on it (the caller's objects are not mutated)."""
    normal = object.__setattr__  # a frozen dataclass
    for name in ("target_modules", "exclude_modules"):
        if name == "target_modules" or getattr(config, name) is not None:
            normal(config, name, target_names(who, name, getattr(config, name), example=example,
                                              all_linear=all_linear))
    if getattr(config, "modules_to_save", None) is not None:
        normal(config, "modules_to_save", names(who, "modules_to_save", config.modules_to_save))


def path(who: str, name: str, value: object, *, example: str | None = None) -> str | os.PathLike:
    """``value`` if it is a non-empty path: a ``str`` or an ``os.PathLike`` (a ``pathlib.Path``)."""
    if not isinstance(value, (str, os.PathLike)):
        raise _fail(TypeError, who, name, value, "a path (str or os.PathLike)", example, None)
    if not os.fspath(value):
        raise _fail(ValueError, who, name, value, "a non-empty path", example, None)
    return value


def regex(who: str, name: str, value: object, of: tuple[str, object] | None = None) -> str:
    """``value`` if it is a string that compiles as a regular expression matched in bounded time (`_regex`)."""
    if not isinstance(value, str):
        raise TypeError(f"{_given(who, name, value, of)} must be a regular expression string.")
    try:
        re.compile(value)
    except re.error as error:
        raise ValueError(f"{_given(who, name, value, of)} is not a valid regular expression ({error}).") from None
    why = backtracking(value)
    if why:
        raise ValueError(
            f"{_given(who, name, value, of)} has {why}, so matching it against a module name can take time that "
            "grows exponentially with the name's length (catastrophic backtracking); it is refused before matching. "
            r"Write it so each part of a name can be matched one way only (e.g. '.*\.(q|v)_proj', "
            r"'model\.layers\.\d+\.self_attn\.q_proj'), or give a list of module names."
        )
    return value

