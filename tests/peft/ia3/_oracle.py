"""Hugging Face PEFT's IA³ as the oracle: the method-independent check (`tests.peft._oracle`) driven with IA³."""

from __future__ import annotations

from lightning_peft.peft import IA3Config, inject_ia3
from lightning_peft.peft.ia3 import disable_ia3, merge_ia3, unmerge_ia3
from tests.peft._oracle import Method, peft


def peft_name(name: str) -> str:
    """PEFT's in-memory name of our adapter parameter ``name``: the vector's is the same (``ia3_l.<adapter>``), a saved
    module's trained copy is under ``modules_to_save.<adapter>``."""
    return name.replace(".trained_module.", ".modules_to_save.default.")


IA3 = Method(
    config=peft.IA3Config,
    inject=lambda model, config: inject_ia3(model, IA3Config.from_peft(config)),
    disable=disable_ia3, merge=merge_ia3, unmerge=unmerge_ia3, rename=peft_name, markers=("ia3_",),
    peft_unmerge_tolerance=1e-6,  # PEFT's unmerge divides by l + 1e-8 (ours by l)
)
