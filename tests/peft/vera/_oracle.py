"""Hugging Face PEFT's VeRA as the oracle: the method-independent check (`tests.peft._oracle`) driven with VeRA.

No hook is needed for the shared projections: they are buffers, not trained, so the check leaves them as each side
drew them, and every row compares PEFT's draw with ours through the outputs."""

from __future__ import annotations

from lightning_peft.peft import VeraConfig, inject_vera
from lightning_peft.peft.vera import disable_vera, merge_vera, unmerge_vera
from tests.peft._oracle import Method, peft


def peft_name(name: str) -> str:
    """PEFT's in-memory name of our adapter parameter ``name``: its vectors under the adapter's name, a saved module's
    trained copy under ``modules_to_save.<adapter>``."""
    for vector in (".vera_lambda_b", ".vera_lambda_d"):
        name = name.replace(vector, f"{vector}.default")
    return name.replace(".trained_module.", ".modules_to_save.default.")


VERA = Method(
    config=peft.VeraConfig,
    inject=lambda model, config: inject_vera(model, VeraConfig.from_peft(config)),
    disable=disable_vera, merge=merge_vera, unmerge=unmerge_vera, rename=peft_name, markers=("vera_",),
)
