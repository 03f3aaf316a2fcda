"""The examples in docstrings run (the cheap ones: those not marked ``doctest: +SKIP``).

The modules are found, not listed: every module of the package whose source holds a ``>>>`` example (a module whose
examples are all marked ``+SKIP`` has nothing to run and is left out).
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_peft"


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if any(">>>" in line and "doctest: +SKIP" not in line for line in text.splitlines()):
            parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_modules_are_found():
    assert len(MODULES) >= 20 and "lightning_peft.peft.lora.model" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
