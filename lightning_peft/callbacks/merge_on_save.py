"""``MergeOnSave`` callback: export a merged standalone model and the PEFT adapter, without touching training.

At the end of fit (and, with ``every_checkpoint=True``, with every checkpoint) it writes::

    <dirpath>/merged/    the base model with every adapter merged in. For a Hugging Face model this is a
                         ``save_pretrained`` directory that ``AutoModel*.from_pretrained`` loads with no PEFT;
                         the datamodule's tokenizer is saved beside it when it has one. Otherwise
                         ``model.safetensors`` with the base model's own key names.
    <dirpath>/adapter/   the adapter in Hugging Face PEFT layout (``PeftModel.from_pretrained`` loads it).

The merge is computed out of place (:func:`~lightning_peft.peft.merged_state_dict`): the weights that keep
training are never modified. Both exports are computed and checked (finite values, a layout PEFT runs the
same way) before anything is written, and each directory is written under a temporary name and renamed into
place. At fit start it checks, before any training, that ``dirpath`` can be written, that the model has an
adapter, and that no trained parameter lies outside the exported model. If the export fails on rank 0, every
rank raises (no rank is left waiting in a collective).

YAML::

    - class_path: lightning_peft.callbacks.MergeOnSave
      init_args: {dirpath: artifacts/minilm_bbc}
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from safetensors.torch import save_file
from typing_extensions import override

from lightning_peft._atomic import write_dir
from lightning_peft.callbacks._target import is_hf_model, resolve_target
from lightning_peft.peft.adapter import attached, merged_state_dict
from lightning_peft.peft.io import check_saveable, unshared
from lightning_peft.peft.io import save_adapter as write_adapter


class MergeOnSave(Callback):
    """Write the merged model and the PEFT-format adapter at fit end (and optionally with every checkpoint).

    Args:
        dirpath: Output directory; ``merged/`` and ``adapter/`` are created in it.
        every_checkpoint: Also export alongside every checkpoint, into ``<dirpath>/step=<N>/``.
        save_adapter: Write ``adapter/`` as well as ``merged/``.
        model_attribute: Dotted path of the adapted model in the LightningModule (as for ``LoRA``).
    """

    def __init__(
        self,
        dirpath: str = "merged_model",
        every_checkpoint: bool = False,
        save_adapter: bool = True,
        model_attribute: str | None = None,
    ) -> None:
        if not dirpath:
            raise ValueError("MergeOnSave(dirpath=''): give a directory to write the merged model to.")
        self.dirpath = Path(dirpath)
        self.every_checkpoint = every_checkpoint
        self.save_adapter = save_adapter
        self.model_attribute = model_attribute
        self.last_export: dict[str, Path] = {}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Checked here, not in setup: a model built (and adapted) in configure_model exists only now.
        name, model = resolve_target(pl_module, self.model_attribute, "MergeOnSave")
        if not attached(model):
            raise RuntimeError(
                f"MergeOnSave: {type(model).__name__} has no adapter when fit starts. Add the LoRA callback to "
                "Trainer(callbacks=[...]) with the same model_attribute, or call inject_lora in configure_model."
            )
        _refuse_trained_outside(pl_module, name, model)
        if self.save_adapter:
            check_saveable(model)
        _on_rank_zero(trainer, self._check_writable, "the check of dirpath")

    def _check_writable(self) -> None:
        try:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=self.dirpath)
            os.close(fd)
            os.unlink(probe)
        except OSError as err:
            raise ValueError(
                f"MergeOnSave(dirpath={str(self.dirpath)!r}): cannot write there ({type(err).__name__}: "
                f"{err.strerror or err}). Choose a writable directory; checked before training so no run is lost."
            ) from None

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.every_checkpoint:
            self.export(trainer, pl_module, self.dirpath / f"step={trainer.global_step}")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.export(trainer, pl_module, self.dirpath)

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule, directory: Path) -> dict[str, Path]:
        """Write ``merged/`` (and ``adapter/``) under ``directory`` on global rank 0; returns the paths.

        Every rank must call it: a failure on rank 0 is sent to the others, which raise too.
        """
        return _on_rank_zero(trainer, lambda: self._write(trainer, pl_module, directory), "the export") or {}

    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, directory: Path) -> dict[str, Path]:
        _, model = resolve_target(pl_module, self.model_attribute, "MergeOnSave")
        state = merged_state_dict(model)  # raises before anything is written if a merge is non-finite
        if self.save_adapter:
            check_saveable(model)  # likewise for the adapter, so merged/ is never written without adapter/
        paths = {"merged": directory / "merged"}
        write_dir(paths["merged"], lambda tmp: _save_merged(model, state, tmp, trainer))
        message = f"MergeOnSave: wrote the merged model to {paths['merged'].resolve()}"
        if self.save_adapter:
            paths["adapter"] = directory / "adapter"
            write_dir(paths["adapter"], lambda tmp: write_adapter(model, tmp))
            message += f"; wrote the PEFT adapter to {paths['adapter'].resolve()}"
        rank_zero_info(message)
        self.last_export = paths
        return paths


def _on_rank_zero(trainer: pl.Trainer, work: Callable[[], Any], what: str) -> Any:
    """Run ``work`` on global rank 0; if it fails, every rank raises (none is left waiting in a collective)."""
    error: BaseException | None = None
    result = None
    if trainer.is_global_zero:
        try:
            result = work()
        except Exception as err:  # re-raised below, after the other ranks heard of it
            error = err
    failure = trainer.strategy.broadcast(None if error is None else f"{type(error).__name__}: {error}", src=0)
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"MergeOnSave: {what} on rank 0 failed ({failure}); stopping this rank as well.")
    return result


def _refuse_trained_outside(pl_module: pl.LightningModule, name: str, model) -> None:
    """Parameters that train but live outside the exported model would be lost from the export."""
    inside = {id(p) for p in model.parameters()}
    outside = [n for n, p in pl_module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        shown = ", ".join(outside[:4]) + (f" and {len(outside) - 4} more" if len(outside) > 4 else "")
        raise ValueError(
            f"MergeOnSave: {type(pl_module).__name__} trains parameters outside the exported model {name!r} "
            f"({shown}); the export would leave them out. Adapt and export the whole LightningModule instead: "
            "model_attribute='' on both LoRA and MergeOnSave, with the extra module in modules_to_save "
            "(e.g. modules_to_save=['head']); or freeze those parameters."
        )


def _save_merged(model, state: dict, directory: Path, trainer: pl.Trainer) -> None:
    if is_hf_model(model):
        model.save_pretrained(directory, state_dict=state)
        tokenizer = getattr(trainer.datamodule, "tokenizer", None) if trainer.datamodule is not None else None
        if callable(getattr(tokenizer, "save_pretrained", None)):
            tokenizer.save_pretrained(directory)
    else:
        save_file(unshared(state), directory / "model.safetensors", metadata={"format": "pt"})
