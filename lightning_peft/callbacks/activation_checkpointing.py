"""``ActivationCheckpointing`` callback: non-reentrant activation checkpointing of chosen blocks during ``fit``.

The technique lives in `lightning_peft.nn.checkpointing` (what is wrapped, how, what is refused); this callback
decides when: at ``setup`` of a fit it wraps the blocks of the LightningModule, before the strategy wraps the model
(DDP, FSDP2's ``fully_shard``, DeepSpeed: the wrapper is on each block's ``forward``, so their hooks stay outside it),
and at ``teardown`` (or after an exception) it gives the blocks their forward back. A PEFT callback injecting at
``setup`` too may run before or after it: the wrapper is on the block, and the block calls whatever layers it holds
when it runs. Prefix tuning is refused in either order (its prefix is an attention cache that a recomputed layer
would write twice).

It keeps no state: checkpoints and the state dict's keys are the same as without it, so ``load_from_checkpoint``,
a resume with or without the callback, and exports are unaffected.

YAML:

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.ActivationCheckpointing
      init_args:
        modules: [BertLayer]   # or omit: every transformers layer and TransformerBlock
```
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_peft.nn.checkpointing import (
    apply_activation_checkpointing,
    check_modules,
    check_release_memory,
    remove_activation_checkpointing,
)


class ActivationCheckpointing(Callback):
    """Recompute the activations of chosen blocks in backward instead of keeping them (training only).

    Args:
        modules: Which modules of the LightningModule to checkpoint. None: every Hugging Face
            ``GradientCheckpointingLayer`` (``BertLayer``, ``LlamaDecoderLayer``, ...) and every
            `TransformerBlock`. Otherwise a list of strings, each a class name (of the
            module's class or one of its bases), a dotted class path, or else a regular expression matched in full
            against module names as the LightningModule names them (``model\\.bert\\.encoder\\.layer\\.[0-5]``).
            Every entry must select at least one module.
        release_memory: After each checkpointed block's forward on the CPU, return the heap pages it freed to the
            operating system (glibc ``malloc_trim``); without it glibc's default malloc keeps them resident and
            checkpointing saves less (measured at 24 blocks: 0.40 of the plain activation memory instead of 0.24,
            for 1.13x the step time). None: on where glibc provides it; False (default): never (see
            `lightning_peft.nn.apply_activation_checkpointing` for why it is off by default).
    """

    def __init__(self, modules: list[str] | None = None, release_memory: bool | None = False) -> None:
        self.modules = check_modules(modules, "ActivationCheckpointing")
        self.release_memory = check_release_memory(release_memory, "ActivationCheckpointing")
        self._applied: pl.LightningModule | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return  # validate / test / predict run without gradients: nothing to checkpoint
        wrapped = apply_activation_checkpointing(pl_module, self.modules, release_memory=self.release_memory,
                                                 who="ActivationCheckpointing")
        self._applied = pl_module
        rank_zero_info(f"ActivationCheckpointing: {len(wrapped)} modules checkpointed ({_summary(wrapped)})")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove()  # Lightning skips teardown after an exception

    def _remove(self) -> None:
        if self._applied is not None:
            remove_activation_checkpointing(self._applied)
            self._applied = None


def _summary(wrapped: dict) -> str:
    names = list(wrapped)
    return ", ".join(names[:3]) + (f", ... {names[-1]}" if len(names) > 3 else "")
