"""``MergeOnSave`` callback: export a merged standalone model and the PEFT adapter, without touching training.

At the end of fit (and, with ``every_checkpoint=True``, with every checkpoint) it writes::

    <dirpath>/merged/    the base model with every adapter merged in. For a Hugging Face model this is a
                         ``save_pretrained`` directory that ``AutoModel*.from_pretrained`` loads with no PEFT;
                         the datamodule's tokenizer is saved beside it when it has one. Otherwise
                         ``model.safetensors`` with the base model's own key names.
    <dirpath>/adapter/   the adapter in Hugging Face PEFT layout (``PeftModel.from_pretrained`` loads it).

The merge is computed out of place (:func:`~lightning_peft.peft.merged_state_dict`): the weights that keep
training are never modified. Each directory is written under a temporary name and renamed into place.

YAML::

    - class_path: lightning_peft.callbacks.MergeOnSave
      init_args: {dirpath: artifacts/minilm_bbc}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from safetensors.torch import save_file
from typing_extensions import override

from lightning_peft._atomic import write_dir
from lightning_peft.callbacks._target import is_hf_model, resolve_target
from lightning_peft.peft.io import save_adapter as write_adapter
from lightning_peft.peft.lora import lora_spec, merged_state_dict


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
        _, model = resolve_target(pl_module, self.model_attribute, "MergeOnSave")
        if lora_spec(model) is None:
            raise RuntimeError(
                f"MergeOnSave: {type(model).__name__} has no LoRA adapter when fit starts. Add the LoRA callback to "
                "Trainer(callbacks=[...]) with the same model_attribute, or call inject_lora in configure_model."
            )

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.every_checkpoint:
            self.export(trainer, pl_module, self.dirpath / f"step={trainer.global_step}")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.export(trainer, pl_module, self.dirpath)

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule, directory: Path) -> dict[str, Path]:
        """Write ``merged/`` (and ``adapter/``) under ``directory`` on global rank 0; returns the paths."""
        if not trainer.is_global_zero:
            return {}
        _, model = resolve_target(pl_module, self.model_attribute, "MergeOnSave")
        state = merged_state_dict(model)  # raises before anything is written if a merge is non-finite
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


def _save_merged(model, state: dict, directory: Path, trainer: pl.Trainer) -> None:
    if is_hf_model(model):
        model.save_pretrained(directory, state_dict=state)
        tokenizer = getattr(trainer.datamodule, "tokenizer", None) if trainer.datamodule is not None else None
        if callable(getattr(tokenizer, "save_pretrained", None)):
            tokenizer.save_pretrained(directory)
    else:
        save_file(_unshared(state), directory / "model.safetensors", metadata={"format": "pt"})


def _unshared(state: dict) -> dict:
    """safetensors refuses tensors that share memory (tied weights): give each key its own copy."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        pointer = value.untyped_storage().data_ptr()
        out[key] = value.clone() if pointer in seen else value.contiguous()
        seen.add(pointer)
    return out

