"""``MergeOnSave`` callback: export a merged standalone model and the PEFT adapter, without touching training.

At the end of fit (and, with ``every_checkpoint=True``, with every checkpoint) it writes:

- ``<dirpath>/merged/``: the base model with every adapter merged in (of several named adapters, the one
  ``adapter_name`` names, else the active one). For a Hugging Face model this is a ``save_pretrained`` directory that
  ``AutoModel*.from_pretrained`` loads with no PEFT; the datamodule's tokenizer is saved beside it when it has one.
  Otherwise ``model.safetensors`` with the base model's own key names.
- ``<dirpath>/adapter/``: the adapters in Hugging Face PEFT layout (``PeftModel.from_pretrained`` loads them): named
  adapters as PEFT saves them, ``default`` at the top, others in ``<name>/``.

Techniques that cannot be merged into the base weights (bottleneck adapters, prompt and prefix tuning) are exported
with ``save_merged=False``: the adapter folder only.

The merge is computed out of place ([`merged_state_dict`][lightning_peft.peft.merged_state_dict]): the weights that keep
training are never modified. Both exports are computed and checked (finite values, a layout PEFT runs the same way)
before anything is written, and each directory is written under a temporary name and renamed into place; both carry a
manifest (``lightning_peft_export.json``: the export's id and global step, every file's size) that ``load_adapter``
checks, and the next export completes one that a kill interrupted between its two folders
(`lightning_peft.peft.recover_export`). At fit start it checks, before any training, that ``dirpath`` can be written
and has room for the export, that ``merged`` and ``adapter`` there are no symbolic links, that the model has an
adapter, and that no trained parameter lies outside the exported model. If the export fails on rank 0, every rank
raises (no rank is left waiting in a collective).

YAML:

```yaml
- class_path: lightning_peft.callbacks.MergeOnSave
  init_args: {dirpath: artifacts/minilm_bbc}
```
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from safetensors.torch import save_file
from torch import nn
from typing_extensions import override

from lightning_peft._checks import boolean, path
from lightning_peft._gather import gathered, reshard
from lightning_peft._manifest import write_export
from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.callbacks._export_checks import (
    check_target,
    export_bytes,
    no_adapter,
    refuse_unmergeable,
    refuse_unsaveable,
)
from lightning_peft.callbacks._lightning import on_rank_zero
from lightning_peft.callbacks._target import is_hf_model, resolve_target
from lightning_peft.peft._export import save_pretrained_merged
from lightning_peft.peft.adapter import adapter_tensors, attached, merged_state_dict
from lightning_peft.peft.io import check_saveable, unshared
from lightning_peft.peft.io import save_adapter as write_adapter


class MergeOnSave(Callback):
    """Write the merged model and the PEFT-format adapter at fit end (and optionally with every checkpoint).

    Args:
        dirpath: Output directory; ``merged/`` and ``adapter/`` are created in it.
        every_checkpoint: Also export alongside every checkpoint, into ``<dirpath>/step=<N>/``.
        save_adapter: Write ``adapter/``.
        save_merged: Write ``merged/``.
        adapter_name: Of several named adapters (MultiLoRA), the one merged into ``merged/`` (default: the active one).
        model_attribute: Dotted path of the adapted model in the LightningModule (as for ``LoRA``).
    """

    def __init__(
        self,
        dirpath: str = "merged_model",
        every_checkpoint: bool = False,
        save_adapter: bool = True,
        save_merged: bool = True,
        adapter_name: str | None = None,
        model_attribute: str | None = None,
    ) -> None:
        path("MergeOnSave", "dirpath", dirpath, example="'artifacts/run'")
        for name, flag in (("every_checkpoint", every_checkpoint), ("save_adapter", save_adapter),
                           ("save_merged", save_merged)):
            boolean("MergeOnSave", name, flag)
        for name, value, example in (("adapter_name", adapter_name, "'default'"),
                                     ("model_attribute", model_attribute, "'model'")):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"MergeOnSave({name}={value!r}): {name} must be a name (str) or None, e.g. {example}.")
        if not (save_adapter or save_merged):
            raise ValueError("MergeOnSave(save_adapter=False, save_merged=False): nothing to export; keep one of them.")
        self.dirpath = Path(dirpath)
        self.every_checkpoint = every_checkpoint
        self.save_adapter = save_adapter
        self.save_merged = save_merged
        self.adapter_name = adapter_name
        self.model_attribute = model_attribute
        self.last_export: dict[str, Path] = {}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Checked here, not in setup: a model built (and adapted) in configure_model exists only now.
        name, model = resolve_target(pl_module, self.model_attribute, "MergeOnSave")
        if not attached(model):
            raise RuntimeError(no_adapter("MergeOnSave", self.model_attribute, pl_module, name, model))
        adapting = [c.who for c in trainer.callbacks if isinstance(c, AdapterCallback)]  # type: ignore[attr-defined]
        _refuse_trained_outside(pl_module, name, model, adapting)
        names = [name for adapter in attached(model).values() if adapter.named for name in adapter.names]
        if self.adapter_name is not None and self.adapter_name not in names:
            raise ValueError(f"MergeOnSave(adapter_name={self.adapter_name!r}): the model has no named adapter of that "
                             f"name; its named adapters: {names}.")
        if self.save_merged:
            refuse_unmergeable("MergeOnSave", model, self.adapter_name)
        if self.save_adapter:
            with _gathered(trainer, model, adapter_parameters(model)):
                refuse_unsaveable("MergeOnSave", model)  # adapter/ loads onto the original base
        check = lambda: check_target(f"MergeOnSave(dirpath={str(self.dirpath)!r})", self.dirpath,  # noqa: E731
                                     export_bytes(model, self.save_merged, self.save_adapter))  # on rank 0 only
        on_rank_zero(trainer, check, "MergeOnSave", "the check of dirpath")

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.every_checkpoint:
            self.export(trainer, pl_module, self.dirpath / f"step={trainer.global_step}")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.export(trainer, pl_module, self.dirpath)

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule, directory: Path) -> dict[str, Path]:
        """Write ``merged/`` (and ``adapter/``) under ``directory`` on global rank 0; returns the paths.

        Every rank must call it: under a sharding strategy every rank takes part in gathering the parameters
        (only the adapter's, unless the merged model is written too), and a failure on rank 0 is sent to the
        others, which raise too.
        """
        _, model = resolve_target(pl_module, self.model_attribute, "MergeOnSave")
        reshard(pl_module)  # FSDP2 units an evaluation forward left gathered: their parameters are swapped back now
        needed = None if self.save_merged else adapter_parameters(model)
        with _gathered(trainer, model, needed):
            write = lambda: self._write(trainer, pl_module, directory)  # noqa: E731
            return on_rank_zero(trainer, write, "MergeOnSave", "the export") or {}

    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, directory: Path) -> dict[str, Path]:
        _, model = resolve_target(pl_module, self.model_attribute, "MergeOnSave")
        writers = {}
        if self.save_merged:
            state = merged_state_dict(model, self.adapter_name)  # raises before anything is written if non-finite
            writers["merged"] = lambda tmp: _save_merged(model, state, tmp, trainer)
        if self.save_adapter:
            check_saveable(model, convert_to_lora=True)  # likewise for the adapter, so merged/ is never written without adapter/
            writers["adapter"] = lambda tmp: write_adapter(model, tmp, convert_to_lora=True)
        # one export: both folders carry a manifest naming it, and an interrupted pair is completed next time
        paths = write_export(directory, writers, global_step=int(trainer.global_step))
        rank_zero_info("MergeOnSave: " + "; ".join(f"wrote the {'merged model' if name == 'merged' else 'PEFT adapter'} "
                                                   f"to {path.resolve()}" for name, path in paths.items()))
        self.last_export = paths
        return paths


def _gathered(trainer: pl.Trainer, model, params):
    """The strategy's own gathering if it has one (a pipeline's ranks hold different layers), else the generic one
    (ZeRO-3 partitions, DTensor shards); for unsharded models it does nothing."""
    own = getattr(trainer.strategy, "gathered_parameters", None)
    return own(model, params) if callable(own) else gathered(model, params)


def adapter_parameters(model) -> list:
    """The adapter's parameters (what an adapter-only export needs gathered)."""
    return [t for t in adapter_tensors(model).values() if isinstance(t, nn.Parameter)]


def _refuse_trained_outside(pl_module: pl.LightningModule, name: str, model, adapting: list[str]) -> None:
    """Parameters that train but live outside the exported model would be lost from the export; the message names
    the PEFT callbacks on the trainer (``adapting``) that need ``model_attribute=''`` too."""
    inside = {id(p) for p in model.parameters()}
    outside = [n for n, p in pl_module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        shown = ", ".join(outside[:4]) + (f" and {len(outside) - 4} more" if len(outside) > 4 else "")
        raise ValueError(
            f"MergeOnSave: {type(pl_module).__name__} trains parameters outside the exported model {name!r} "
            f"({shown}); the export would leave them out. Adapt and export the whole LightningModule instead: "
            f"model_attribute='' on both {' and '.join(adapting) or 'the PEFT callback'} and MergeOnSave, with the "
            "extra module in modules_to_save "
            "(e.g. modules_to_save=['head']); or freeze those parameters."
        )


TRAINING_RECORD = "lightning_peft_training.json"


def training_record(trainer: pl.Trainer) -> dict[str, Any]:
    """How far the run that wrote an export had trained: what a later run that loads it (a curriculum teacher) reports."""
    planned = trainer.max_steps if trainer.max_steps not in (-1, None) else None
    if planned is None:
        estimate = trainer.estimated_stepping_batches
        planned = int(estimate) if math.isfinite(estimate) else None
    return {"optimizer_steps": int(trainer.global_step), "planned_steps": planned, "epochs": int(trainer.current_epoch)}


@contextlib.contextmanager
def _quiet_deepspeed_detection() -> Iterator[None]:
    """``save_pretrained`` imports ``accelerate``, which imports DeepSpeed when it is installed; DeepSpeed then warns
    "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." in a run that
    never used it. That one record is dropped while the export runs."""

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("Setting accelerator to CPU")

    logger = logging.getLogger("DeepSpeed")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _save_merged(model, state: dict, directory: Path, trainer: pl.Trainer) -> None:
    (directory / TRAINING_RECORD).write_text(json.dumps(training_record(trainer), indent=1) + "\n")
    if is_hf_model(model):
        with _quiet_deepspeed_detection():
            save_pretrained_merged(model, state, directory)  # tied embeddings the merge made differ: untied
        tokenizer = getattr(trainer.datamodule, "tokenizer", None) if trainer.datamodule is not None else None
        if callable(getattr(tokenizer, "save_pretrained", None)):
            tokenizer.save_pretrained(directory)
    else:
        save_file(unshared(state), directory / "model.safetensors", metadata={"format": "pt"})
