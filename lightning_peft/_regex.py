r"""Regular expressions that match module names in bounded time.

Python's ``re`` backtracks: a pattern in which one text can be matched in many ways takes time exponential in the
length of the name (``(.|.)*Z`` doubles per character), and a chain of wildcards ``.*.*.*.*.*`` polynomial time of
high degree. A pattern from a file (``adapter_config.json``) must not be able to hang the process, so
[`backtracking`][lightning_peft._regex.backtracking] refuses, before anything is matched, the shapes that cause it:

- a quantifier inside a repeated group: ``(a+)+``, ``(\w+\.)*`` (star height above one);
- a repeated group that can match empty text: ``(a?)*``;
- alternatives that can start with the same character inside a repeated group: ``(.|.)*``, ``(ab|ac)*``;
- more than ``MAX_WILDCARDS`` repeats that can run over a ``.`` (a module name is dotted: they compete for it).

The patterns PEFT users write pass: ``.*\.(q|v)_proj``, ``model\.layers\.\d+\.self_attn\.(q_proj|v_proj)``,
``^(?!.*classifier).*query$``.

>>> backtracking(r"model\.layers\.\d+\.self_attn\.(q_proj|v_proj)") is None
True
>>> backtracking("(.|.)*Z")
'alternatives that can start with the same character inside a repeated group'
"""

from __future__ import annotations

import re

try:  # Python >= 3.11; the same parser that re.compile uses
    from re import _constants as _c
    from re import _parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c
    import sre_parse as _parser

MAX_WILDCARDS = 3
_OTHER = 128  # stands for every non-ASCII character
_ALL = frozenset(range(_OTHER + 1))
_DOT = ord(".")
_REPEATS = tuple(getattr(_c, n) for n in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(_c, n))


def backtracking(pattern: str) -> str | None:
    """Why matching ``pattern`` could take time exponential (or polynomial of high degree) in a name's length;
    None if it cannot. ``pattern`` must compile."""
    tree = _parser.parse(pattern)
    fold = bool(tree.state.flags & re.IGNORECASE)
    why = _walk(list(tree), False, fold)
    if why is None and _wildcards(list(tree), fold) > MAX_WILDCARDS:
        why = f"more than {MAX_WILDCARDS} repeats that can match a '.' (e.g. '.*')"
    return why


def _walk(items: list, repeated: bool, fold: bool) -> str | None:
    for op, av in items:
        why = None
        if op in _REPEATS:
            _, high, body = av
            if high > 1 and repeated:
                return "a quantifier inside a repeated group"
            if high > 1 and _first(list(body), fold)[1]:
                return "a repeated group that can match empty text"
            why = _walk(list(body), repeated or high > 1, fold)
        elif op is _c.BRANCH:
            branches = [list(b) for b in av[1]]
            if repeated and _overlap([_first(b, fold) for b in branches]):
                return "alternatives that can start with the same character inside a repeated group"
            why = next((w for b in branches if (w := _walk(b, repeated, fold))), None)
        else:
            why = next((w for sub in _children(op, av) if (w := _walk(sub, repeated, fold))), None)
        if why:
            return why
    return None


def _children(op, av) -> list[list]:
    """The sub-patterns of a group, an assertion, a conditional, an atomic group."""
    if op is _c.SUBPATTERN:
        return [list(av[3])]
    if op in (_c.ASSERT, _c.ASSERT_NOT):
        return [list(av[1])]
    if op is _c.GROUPREF_EXISTS:
        return [list(p) for p in av[1:] if p is not None]
    if op is getattr(_c, "ATOMIC_GROUP", None):
        return [list(av)]
    return []


def _overlap(firsts: list[tuple[frozenset, bool]]) -> bool:
    """Whether two alternatives can start the same way (an empty alternative starts every way)."""
    seen: set[int] = set()
    for chars, empty in firsts:
        chars = _ALL if empty else chars
        if seen & chars:
            return True
        seen |= chars
    return False


def _first(items: list, fold: bool) -> tuple[frozenset, bool]:
    """(the characters a match of ``items`` can start with, whether it can match empty text)."""
    chars: set[int] = set()
    for op, av in items:
        head, empty = _first_of(op, av, fold)
        chars |= head
        if not empty:
            return frozenset(chars), False
    return frozenset(chars), True


def _first_of(op, av, fold: bool) -> tuple[frozenset, bool]:
    if op is _c.LITERAL:
        return _literal(av, fold), False
    if op in (_c.NOT_LITERAL, _c.ANY):
        return _ALL, False
    if op is _c.IN:
        return _charset(av, fold), False
    if op in _REPEATS:
        chars, empty = _first(list(av[2]), fold)
        return chars, empty or av[0] == 0
    if op is _c.BRANCH:
        firsts = [_first(list(b), fold) for b in av[1]]
        return frozenset().union(*(f for f, _ in firsts)), any(e for _, e in firsts)
    if op is _c.SUBPATTERN or op is getattr(_c, "ATOMIC_GROUP", None):
        return _first(_children(op, av)[0], fold)
    if op in (_c.AT, _c.ASSERT, _c.ASSERT_NOT):
        return frozenset(), True  # zero-width
    return _ALL, True  # a back-reference or a conditional: anything


def _literal(code: int, fold: bool) -> frozenset:
    return _folded({min(code, _OTHER)}, fold)


def _folded(chars: set[int], fold: bool) -> frozenset:
    if fold:
        chars = chars | {ord(chr(c).swapcase()) for c in chars if c < _OTHER and chr(c).swapcase().isascii()}
    return frozenset(chars)


# The ASCII characters of each category (\d, \w, \s, their negations), and every non-ASCII one (Unicode has more).
_CATEGORIES = {
    name: frozenset({c for c in range(_OTHER) if re.fullmatch(escape, chr(c))} | {_OTHER})
    for suffix, escape in (("DIGIT", r"\d"), ("NOT_DIGIT", r"\D"), ("SPACE", r"\s"), ("NOT_SPACE", r"\S"),
                           ("WORD", r"\w"), ("NOT_WORD", r"\W"))
    for name in (f"CATEGORY_{suffix}", f"CATEGORY_UNI_{suffix}", f"CATEGORY_LOC_{suffix}")
}


def _charset(items, fold: bool) -> frozenset:
    chars: set[int] = set()
    negate = False
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            chars |= _literal(av, fold)
        elif op is _c.RANGE:
            low, high = av
            chars |= _folded(set(range(min(low, _OTHER), min(high, _OTHER) + 1)), fold)
        elif op is _c.CATEGORY:
            chars |= _CATEGORIES.get(str(av), _ALL)
        else:  # anything else: every character it could take
            return _ALL
    return _ALL - chars if negate else frozenset(chars)


def _chars(items: list, fold: bool) -> frozenset:
    """Every character a match of ``items`` can contain."""
    chars: set[int] = set()
    for op, av in items:
        if op in (_c.LITERAL, _c.NOT_LITERAL, _c.ANY, _c.IN):
            chars |= _first_of(op, av, fold)[0]
        elif op in _REPEATS:
            chars |= _chars(list(av[2]), fold)
        elif op is _c.BRANCH:
            chars |= set().union(*(_chars(list(b), fold) for b in av[1]))
        elif op not in (_c.AT, _c.ASSERT, _c.ASSERT_NOT):
            subs = _children(op, av)
            chars |= set().union(*(_chars(sub, fold) for sub in subs)) if subs else _ALL
    return frozenset(chars)


def _wildcards(items: list, fold: bool) -> int:
    """How many repeats in ``items`` (nested ones and those in lookarounds included) can run over a ``.``."""
    count = 0
    for op, av in items:
        if op in _REPEATS:
            count += int(av[1] > 1 and _DOT in _chars(list(av[2]), fold)) + _wildcards(list(av[2]), fold)
        elif op is _c.BRANCH:
            count += sum(_wildcards(list(b), fold) for b in av[1])
        else:
            count += sum(_wildcards(sub, fold) for sub in _children(op, av))
    return count
