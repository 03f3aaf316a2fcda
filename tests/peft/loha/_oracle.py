"""Hugging Face PEFT's LoHa as the oracle: the method-independent check (`tests.peft._oracle`) driven with LoHa."""

from __future__ import annotations

import re

from lightning_peft.peft import LoHaConfig, inject_loha
from lightning_peft.peft.loha import disable_loha, merge_loha, unmerge_loha
from tests.peft._oracle import Method, peft


def peft_name(name: str) -> str:
    """PEFT's in-memory name of our adapter parameter ``name``: a factor under the adapter's name
    (``hada_w1_a.default``), a saved module's trained copy under ``modules_to_save.<adapter>``."""
    return re.sub(r"\.(hada_\w+)$", r".\1.default", name).replace(".trained_module.", ".modules_to_save.default.")


def peft_wrong_gradients(peft_kwargs: dict) -> tuple[str, ...]:
    """PEFT's hand-written backward of the Tucker form (``HadaWeightCP``, ``use_effective_conv2d``) gets the gradients
    of ``hada_w1_a`` and ``hada_w2_a`` wrong (autograd of its own forward differs; `test_model.py` shows it): ours are
    autograd's, so those two are left out of the step comparison on the convolutions of PEFT's rows."""
    if not peft_kwargs.get("use_effective_conv2d"):
        return ()
    return tuple(f"{conv}.{name}" for conv in ("conv1d", "conv2d") for name in ("hada_w1_a", "hada_w2_a"))


LOHA = Method(
    config=peft.LoHaConfig,
    inject=lambda model, config: inject_loha(model, LoHaConfig.from_peft(config)),
    disable=disable_loha, merge=merge_loha, unmerge=unmerge_loha, rename=peft_name, markers=("hada_",),
    peft_wrong_gradients=peft_wrong_gradients,
)
