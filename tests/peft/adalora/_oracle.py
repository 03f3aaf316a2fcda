"""Hugging Face PEFT's AdaLoRA as the oracle: the method-independent check (`tests.peft._oracle`) driven with
AdaLoRA."""

from __future__ import annotations

from torch import nn

from lightning_peft.peft import AdaLoraConfig, inject_adalora
from lightning_peft.peft.adalora import disable_adalora, merge_adalora, unmerge_adalora
from tests.peft._oracle import Method, peft


def peft_name(name: str) -> str:
    """PEFT's in-memory name of our adapter parameter ``name``: its factor under the adapter's name, a saved module's
    trained copy under ``modules_to_save.<adapter>``."""
    for factor in ("lora_A", "lora_B", "lora_E"):
        name = name.replace(f".{factor}", f".{factor}.default")
    return name.replace(".trained_module.", ".modules_to_save.default.")


def freeze_ranknum(model: nn.Module) -> None:
    """PEFT's quirk: on a float64 model its dtype move re-creates ``ranknum`` as a trainable parameter; it is a
    constant (PEFT's own intent, and ours)."""
    for name, param in model.named_parameters():
        if ".ranknum." in name:
            param.requires_grad_(False)


ADALORA = Method(
    config=peft.AdaLoraConfig,
    inject=lambda model, config: inject_adalora(model, AdaLoraConfig.from_peft(config)),
    disable=disable_adalora, merge=merge_adalora, unmerge=unmerge_adalora, rename=peft_name,
    markers=("lora_", "ranknum"), fix_peft=freeze_ranknum,
)
