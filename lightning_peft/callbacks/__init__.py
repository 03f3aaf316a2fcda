"""Lightning callbacks: thin glue over the pure-PyTorch techniques in [`lightning_peft.peft`][lightning_peft.peft]."""

from lightning_peft.callbacks._checkpoint import load_from_checkpoint
from lightning_peft.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_peft.callbacks.adalora import AdaLoRA
from lightning_peft.callbacks.boft import BOFT
from lightning_peft.callbacks.bottleneck import BottleneckAdapters
from lightning_peft.callbacks.curriculum import Curriculum
from lightning_peft.callbacks.gradient_accumulation import GradientAccumulation
from lightning_peft.callbacks.gradient_noise import GradientNoise
from lightning_peft.callbacks.ia3 import IA3
from lightning_peft.callbacks.layerwise_lr_decay import LayerwiseLRDecay
from lightning_peft.callbacks.loha import LoHa
from lightning_peft.callbacks.lokr import LoKr
from lightning_peft.callbacks.lora import LoRA
from lightning_peft.callbacks.merge_on_save import MergeOnSave
from lightning_peft.callbacks.multi_lora import MultiLoRA
from lightning_peft.callbacks.oft import OFT
from lightning_peft.callbacks.p_tuning import PTuning
from lightning_peft.callbacks.prefix_tuning import PrefixTuning
from lightning_peft.callbacks.prompt_tuning import PromptTuning
from lightning_peft.callbacks.token_pruning import TokenPruning
from lightning_peft.callbacks.vera import VeRA
from lightning_peft.peft.checkpoint import restore_adapters

__all__ = [
    "BOFT", "IA3", "OFT", "ActivationCheckpointing", "AdaLoRA", "BottleneckAdapters", "Curriculum",
    "GradientAccumulation", "GradientNoise", "LayerwiseLRDecay", "LoHa", "LoKr", "LoRA", "MergeOnSave", "MultiLoRA",
    "PTuning", "PrefixTuning", "PromptTuning", "TokenPruning", "VeRA", "load_from_checkpoint", "restore_adapters",
]
