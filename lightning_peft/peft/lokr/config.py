"""LoKr's settings: [`LoKrConfig`][lightning_peft.peft.LoKrConfig], Hugging Face PEFT's ``LoKrConfig`` under its own
field names: the fields LyCORIS methods share (`lightning_peft.peft.lycoris.LycorisConfig`) and
LoKr's own (how the sizes are factored, a low-rank ``W1``, the rescaled rank dropout, the "lycoris" initialisation).
See `lightning_peft.peft.lokr.model` for the technique."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..._checks import boolean, integer
from ..lycoris.config import LycorisConfig

PEFT_TYPE = "LOKR"


@dataclass(frozen=True)
class LoKrConfig(LycorisConfig):
    """Which modules LoKr adapts, and how: the fields of `lightning_peft.peft.lycoris.LycorisConfig`
    and LoKr's own (PEFT's ``LoKrConfig``'s, under its names).

    Args:
        decompose_both: Make the small Kronecker factor low-rank too (``lokr_w1_a @ lokr_w1_b``) when ``r`` is below
            half its larger side; otherwise it is a full ``lokr_w1``.
        decompose_factor: How each size is split into two factors (``out = a * b``, ``in = c * d``): a positive
            divisor is taken as the smaller factor; -1: the divisor pair nearest the square root.
        rank_dropout_scale: Divide the rows kept by ``rank_dropout`` by the kept share (PEFT's default: not).
        init_weights: True: ``lokr_w1`` (or ``lokr_w1_a``) starts at zero, so the adapted model starts as the base;
            ``"lycoris"``: ``lokr_w2`` (or ``lokr_w2_b``) starts at zero instead, as the LyCORIS repository does;
            False: every factor drawn at random (PEFT's, for tests).

    Examples:
        >>> LoKrConfig(target_modules=["query", "value"], r=4, decompose_factor=8).rank_for("encoder.layer.0.query")
        4
    """

    who: ClassVar[str] = "LoKr"
    peft_type: ClassVar[str] = PEFT_TYPE

    decompose_both: bool = False
    decompose_factor: int = -1
    rank_dropout_scale: bool = False
    init_weights: bool | str = True

    def __post_init__(self) -> None:
        super().__post_init__()
        boolean(self.who, "decompose_both", self.decompose_both)
        boolean(self.who, "rank_dropout_scale", self.rank_dropout_scale)
        integer(self.who, "decompose_factor", self.decompose_factor, minimum=-1, example="-1 or 8")
        if self.decompose_factor == 0:
            raise ValueError("LoKr(decompose_factor=0): give -1 (split each size near its square root) or a positive "
                             "factor, e.g. 8 (PEFT would silently not factor the sizes at all).")

    def check_init_weights(self) -> None:
        """True, False or ``"lycoris"`` (PEFT's choices)."""
        if self.init_weights != "lycoris":
            boolean(self.who, "init_weights", self.init_weights)
