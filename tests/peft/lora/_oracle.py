"""Hugging Face PEFT as the oracle for LoRA: the method-independent check (`tests.peft._oracle`: the tiny float64
custom models of PEFT's own ``tests/test_custom_models.py``, forward, disable, merge/unmerge, files both ways, one
training step) driven with LoRA (`LORA`), and PEFT's ``nn.MultiheadAttention`` with its doubled out-projection fixed.

``assert_equal_to_peft(model_id, peft_kwargs, tmp_path)`` runs a PEFT ``LoraConfig`` on ours and on PEFT's.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

peft = pytest.importorskip("peft")
from peft.tuners.lora.layer import MultiheadAttention as PeftMHA
from peft.tuners.tuners_utils import check_adapters_to_merge

from lightning_peft.peft import (
    LoRAConfig,
    disable_adapters,
    inject_lora,
    merge_lora,
    merged_state_dict,
    unmerge_lora,
)
from tests.peft import _oracle as common
from tests.peft._oracle import (  # noqa: F401  (the LoRA tests import these names from here)
    MHA,
    MODELS,
    PREFIX,
    TOLERANCE,
    EmbConv1D,
    LinearUsingParameter,
    MlpUsingParameters,
    MoE,
    base_model,
    close,
    inputs,
    trainable,
)


def peft_name(name: str) -> str:
    """PEFT's in-memory name of our adapter parameter ``name``, where the two differ: PEFT keeps a DoRA magnitude
    in a module (``.weight``), and a saved module's trained copy under ``modules_to_save.<adapter>``."""
    if ".lora_magnitude_vector." in name:
        return f"{name}.weight"
    name = name.replace(".out_proj_lora_", ".base_layer.out_proj.lora_")  # an nn.MultiheadAttention's out-projection
    return name.replace(".trained_module.", ".modules_to_save.default.")


#: Models whose LoRA PEFT 0.21 cannot merge, and what its merge raises. A grouped convolution: PEFT refuses (the
#: update reads every input channel, which a grouped weight cannot hold), and ours refuses too. A 1x1x1 Conv3d: PEFT's
#: 1x1 shortcut squeezes two of the three kernel dimensions and fails; ours merges, checked against its own outputs.
PEFT_CANNOT_MERGE = {"Conv2dGroups": NotImplementedError, "Conv2dGroups2": NotImplementedError,
                     "Conv3d1x1": RuntimeError}


def _merge_without_peft(model_id: str, ours: nn.Module, theirs: nn.Module, base: nn.Module, x: Tensor,
                        adapted: Tensor) -> None:
    if any(getattr(m, "groups", 1) > 1 for m in base.modules()):
        for merge in (merge_lora, merged_state_dict):
            with pytest.raises(RuntimeError, match=r"groups=\d+; .* so it cannot be merged \(PEFT refuses"):
                merge(ours)
        close(common.outputs(ours, x), adapted, "after the refused merge")
        return
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged_state_dict(ours))
    close(common.outputs(plain, x), adapted, "the merged export")
    merge_lora(ours)
    close(common.outputs(ours, x), adapted, "merged")
    unmerge_lora(ours)
    close(common.outputs(ours, x), adapted, "unmerged")


LORA = common.Method(
    config=peft.LoraConfig,
    inject=lambda model, config: inject_lora(model, config=LoRAConfig.from_peft(config)),
    disable=disable_adapters, merge=merge_lora, unmerge=unmerge_lora, rename=peft_name,
    markers=("lora_", "trainable_tokens_"), peft_cannot_merge=PEFT_CANNOT_MERGE, merge_without_peft=_merge_without_peft,
)


def adapted_pair(model_id: str, peft_kwargs: dict[str, Any], rename: Callable[[str], str] = peft_name,
                 seed: int = 0) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(ours, PEFT's, the base) for LoRA ``peft_kwargs``, with the same random adapter values on both."""
    return common.adapted_pair(model_id, peft_kwargs, LORA, rename, seed)


def assert_equal_to_peft(model_id: str, peft_kwargs: dict[str, Any], tmp_path: Path,
                         rename: Callable[[str], str] = peft_name, lr: float = 0.1) -> None:
    """Ours equals PEFT for LoRA ``peft_kwargs`` on model ``model_id`` (`tests.peft._oracle.assert_equal_to_peft`).

    ``rename`` maps one of our adapter parameter names to PEFT's in-memory name (without ``base_model.model.``);
    a case with names of its own wraps `peft_name`.
    """
    common.assert_equal_to_peft(model_id, peft_kwargs, tmp_path, LORA, rename, lr)


# ------------------------------------------------------------------------------------------------ PEFT's MHA, fixed
# PEFT 0.21.2's lora.MultiheadAttention.merge adds the out-projection's update twice: by hand, then again through
# out_proj.merge() (huggingface/peft#3774, open). Its forward merges per call, so its outputs mean W + 2 s B A. The
# oracle for nn.MultiheadAttention is PEFT with that fixed (`fixed_peft_mha`); test_mha.py checks the bug is still
# there.

PEFT_MHA = {"merge": PeftMHA.merge, "unmerge": PeftMHA.unmerge}  # PEFT's own, unpatched


def _fixed_merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
    """PEFT 0.21.2's ``MultiheadAttention.merge`` with each update added once. The in-projection as PEFT merges it;
    the out-projection the same way (``W.detach() + s B A``, which keeps the factors' gradient in PEFT's forward, as
    0.21.2's first addition does), and its LoRA layer marked merged instead of merged a second time. (#3774 calls
    ``out_proj.merge()`` instead, which writes through ``.data``: the out-projection's factors would get no
    gradient.)"""
    for name in check_adapters_to_merge(self, adapter_names):
        if name not in self.lora_A:
            continue
        base = self.get_base_layer()
        out_proj = base.out_proj
        dtype = out_proj.weight.dtype
        merged = {
            (base, "in_proj_weight"): base.in_proj_weight.data.detach() + self.get_delta_weight(name).to(dtype),
            (out_proj.get_base_layer(), "weight"): out_proj.weight.data.detach()
            + out_proj.get_delta_weight(name).to(dtype),
        }
        if safe_merge and not all(torch.isfinite(w).all() for w in merged.values()):
            raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems to be broken")
        for (module, key), weight in merged.items():
            delattr(module, key)  # as PEFT: a tensor in the parameter's place, restored by unmerge
            setattr(module, key, weight)
        out_proj.merged_adapters.append(name)
        self.merged_adapters.append(name)


def _fixed_unmerge(self) -> None:
    """PEFT 0.21.2's ``MultiheadAttention.unmerge`` with each update subtracted once (`_fixed_merge`'s inverse)."""
    if not self.merged:
        warnings.warn("Already unmerged. Nothing to do.")
        return
    base = self.get_base_layer()
    out_proj = base.out_proj
    dtype = out_proj.get_base_layer().weight.dtype
    while self.merged_adapters:
        name = self.merged_adapters.pop()
        if name not in self.lora_A:
            continue
        for module, key, delta in ((base, "in_proj_weight", self.get_delta_weight(name)),
                                   (out_proj.get_base_layer(), "weight", out_proj.get_delta_weight(name))):
            restored = getattr(module, key).data - delta.to(dtype)
            delattr(module, key)
            module.register_parameter(key, nn.Parameter(restored, requires_grad=False))
        out_proj.merged_adapters.remove(name)


@contextmanager
def fixed_peft_mha():
    """PEFT's ``lora.MultiheadAttention`` with huggingface/peft#3774 fixed (each update once), while in the block."""
    PeftMHA.merge, PeftMHA.unmerge = _fixed_merge, _fixed_unmerge
    try:
        yield
    finally:
        PeftMHA.merge, PeftMHA.unmerge = PEFT_MHA["merge"], PEFT_MHA["unmerge"]
