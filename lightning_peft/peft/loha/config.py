"""LoHa's settings: [`LoHaConfig`][lightning_peft.peft.LoHaConfig], Hugging Face PEFT's ``LoHaConfig`` under its own
field names. LoHa has no field of its own beyond what LyCORIS methods share
(`lightning_peft.peft.lycoris.LycorisConfig`); see `lightning_peft.peft.loha.model` for the
technique."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..lycoris.config import LycorisConfig

PEFT_TYPE = "LOHA"


@dataclass(frozen=True)
class LoHaConfig(LycorisConfig):
    """Which modules LoHa adapts, and how (the fields of
    `lightning_peft.peft.lycoris.LycorisConfig`, PEFT's ``LoHaConfig``'s).

    Examples:
        >>> LoHaConfig(target_modules=["query", "value"], r=4, alpha=8).rank_for("encoder.layer.0.query")
        4
    """

    who: ClassVar[str] = "LoHa"
    peft_type: ClassVar[str] = PEFT_TYPE
