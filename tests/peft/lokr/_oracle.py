"""Hugging Face PEFT's LoKr as the oracle: the method-independent check (`tests.peft._oracle`) driven with LoKr."""

from __future__ import annotations

import re

from lightning_peft.peft import LoKrConfig, inject_lokr
from lightning_peft.peft.lokr import disable_lokr, merge_lokr, unmerge_lokr
from tests.peft._oracle import Method, peft


def peft_name(name: str) -> str:
    """PEFT's in-memory name of our adapter parameter ``name``: a factor under the adapter's name, a saved module's
    trained copy under ``modules_to_save.<adapter>``."""
    return re.sub(r"\.(lokr_\w+)$", r".\1.default", name).replace(".trained_module.", ".modules_to_save.default.")


LOKR = Method(
    config=peft.LoKrConfig,
    inject=lambda model, config: inject_lokr(model, LoKrConfig.from_peft(config)),
    disable=disable_lokr, merge=merge_lokr, unmerge=unmerge_lokr, rename=peft_name, markers=("lokr_",),
)
