"""Module-name patterns are matched in bounded time (:mod:`lightning_peft._regex`): the shapes that make ``re``
backtrack are refused before matching; the patterns PEFT users write pass and still select what they did."""

from __future__ import annotations

import re
import signal
import time

import pytest
import torch
from torch import nn

from lightning_peft._regex import MAX_WILDCARDS, backtracking
from lightning_peft.peft import inject_lora, lora_layers

# Each refused pattern with a name it takes (far) more than a second to fail on, checked below.
HOSTILE = {
    "(.|.)*Z": ("alternatives that can start with the same character", "a" * 40),
    r"(a+)+Z": ("a quantifier inside a repeated group", "a" * 40),
    r"(\w+\.?)*Z": ("a quantifier inside a repeated group", "a" * 40),
    r"(a|ab|b)*Z": ("alternatives that can start with the same character", "ab" * 40),
    r"(a?a?)*Z": ("a repeated group that can match empty text", "a" * 40),
    ".*" * 9 + "Z": (f"more than {MAX_WILDCARDS} repeats that can match a '.'", "a.b" * 14),
}
ORDINARY = [
    r".*\.(q|v)_proj", r"model\.layers\.\d+\.self_attn\.(q_proj|v_proj)", r"^(?!.*classifier).*query$",
    r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj", r".*\.(c_attn|c_proj)", r"(?:layer\.0\.query|layer\.1\.value)",
    r"^(?!.*lm_head).*\.layers\.\d+\..*_proj$", r"(?i).*QUERY", "all-linear",
]


@pytest.mark.parametrize("pattern", list(HOSTILE))
def test_a_pattern_that_backtracks_is_named_for_why(pattern):
    assert backtracking(pattern).startswith(HOSTILE[pattern][0])


@pytest.mark.parametrize("pattern", list(HOSTILE))
def test_the_refused_patterns_really_take_long(pattern):
    """The control: each refused pattern is one ``re`` would hang on (stopped here after 0.5 s)."""
    def expire(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    start = time.perf_counter()
    try:
        with pytest.raises(TimeoutError):
            re.fullmatch(pattern, HOSTILE[pattern][1])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - start >= 0.5


@pytest.mark.parametrize("pattern", ORDINARY)
def test_the_patterns_peft_users_write_pass(pattern):
    assert backtracking(pattern) is None


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.value, self.classifier_query = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)


@pytest.mark.parametrize("pattern, chosen", [
    (r"^(?!.*classifier).*query$", ["layer.0.query", "layer.1.query"]),
    (r"layer\.\d+\.(query|value)", ["layer.0.query", "layer.0.value", "layer.1.query", "layer.1.value"]),
    (r".*\.(q|v)\w*", ["layer.0.query", "layer.0.value", "layer.1.query", "layer.1.value"]),
])
def test_ordinary_patterns_still_select_what_they_did(pattern, chosen):
    model = nn.Module()
    model.layer = nn.ModuleList([_Block(), _Block()])
    inject_lora(model, rank=2, target_modules=pattern)
    assert sorted(lora_layers(model)) == chosen


def test_inject_lora_refuses_a_backtracking_pattern_naming_it():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"LoRA\(target_modules='\(a\+\)\+'\): target_modules has a quantifier inside "
                                         r"a repeated group, .*refused before matching"):
        inject_lora(model, rank=2, target_modules="(a+)+")
    assert lora_layers(model) == {} and isinstance(model[0], nn.Linear) and model[0].weight.dtype == torch.float32
