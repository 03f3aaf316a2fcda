"""Hugging Face PEFT's BOFT as the oracle: the method-independent check (`tests.peft._oracle`) driven with BOFT, and
PEFT's BOFT with its CUDA block-diagonal kernel (``fbd_cuda``) computed by ``torch.block_diag`` (`peft_with_kernel`):
without the kernel, PEFT silently trains one butterfly factor whatever its config says."""

from __future__ import annotations

import pytest
import torch

from lightning_peft.peft import BOFTConfig, inject_boft
from lightning_peft.peft.boft import disable_boft, merge_boft, unmerge_boft
from tests.peft._oracle import Method, peft


def peft_name(name: str) -> str:
    """PEFT's in-memory name of our adapter parameter ``name`` (its ParameterDicts under the adapter's name)."""
    for own in ("boft_R", "boft_s"):
        if name.endswith(f".{own}"):
            return f"{name}.default"
    return name.replace(".trained_module.", ".modules_to_save.default.")


BOFT = Method(
    config=peft.BOFTConfig,
    inject=lambda model, config: inject_boft(model, BOFTConfig.from_peft(config)),
    disable=disable_boft, merge=merge_boft, unmerge=unmerge_boft, rename=peft_name, markers=("boft_",),
)


class _BlockDiagonal:
    """What ``fbd_cuda`` computes: (N, D, H, H) blocks -> (N, D H, D H), each of the N block diagonal."""

    @staticmethod
    def apply(blocks: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.block_diag(*level) for level in blocks])


def peft_with_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT's BOFT as it runs where its CUDA extension loads: every butterfly factor asked for, its own permutations
    and Cayley transform, for every PEFT model made while it is active."""
    layer = peft.tuners.boft.layer
    monkeypatch.setattr(layer, "get_fbd_cuda", lambda: True)
    monkeypatch.setattr(layer, "FastBlockDiag", _BlockDiagonal)
