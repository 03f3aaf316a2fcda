"""Hugging Face PEFT's OFT as the oracle: the method-independent check (`tests.peft._oracle`) driven with OFT, and
PEFT's Conv2d layer with its forward as its own merge computes it (`peft_conv2d_as_merged`), for inputs where PEFT's
unfolded patches overlap."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_peft.peft import OFTConfig, inject_oft
from lightning_peft.peft.oft import disable_oft, merge_oft, unmerge_oft
from tests.peft._oracle import Method, peft


def peft_name(name: str) -> str:
    """PEFT's in-memory name of our adapter parameter ``name``: its rotation under the adapter's name, a saved
    module's trained copy under ``modules_to_save.<adapter>``."""
    return (name.replace(".oft_R.weight", ".oft_R.default.weight")
            .replace(".oft_embedding_R.weight", ".oft_embedding_R.default.weight")
            .replace(".trained_module.", ".modules_to_save.default."))


OFT = Method(
    config=peft.OFTConfig,
    inject=lambda model, config: inject_oft(model, OFTConfig.from_peft(config)),
    disable=disable_oft, merge=merge_oft, unmerge=unmerge_oft, rename=peft_name, markers=("oft_",),
    peft_unmerge_tolerance=1e-6,
    least_change=1e-6,  # COFT's default radius (eps=6e-5, PEFT's Conv2d rows) keeps the rotation that close to I  # PEFT inverts its float64 rotation in float32 to unmerge (ours: a float64 solve)
)


def _merged_forward(original):
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.disable_adapters or self.merged:
            return original(self, x, *args, **kwargs)
        base = self.get_base_layer()
        module = self.oft_R[self.active_adapters[0]]
        if module.coft:  # PEFT's projection, in place (its get_weight would also detach the weight from the graph)
            with torch.no_grad():
                module.weight.copy_(module._project_batch(module.weight, eps=module.eps))
        blocks = module._cayley_batch(module.weight, module.block_size, module.use_cayley_neumann,
                                      module.num_cayley_neumann_terms)
        count = module.in_features // module.block_size if module.block_share else module.r
        rotation = module._block_diagonal(blocks, count)  # (n, n): PEFT's own Cayley transform and layout
        weight = (rotation @ base.weight.reshape(base.weight.shape[0], -1).T).T.reshape(base.weight.shape)
        return base._conv_forward(x, weight, base.bias)  # PEFT's merge, W' = (M W^T)^T, unmerged
    return forward


def peft_conv2d_as_merged(monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT's OFT ``Conv2d`` whose unmerged forward is its merged one (the formula: the conv with ``W M^T``), for
    every PEFT model made while the fixture is active (``get_peft_model``, ``PeftModel.from_pretrained``)."""
    conv2d = peft.tuners.oft.layer.Conv2d
    monkeypatch.setattr(conv2d, "forward", _merged_forward(conv2d.forward))


def is_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())
