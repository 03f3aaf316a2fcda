"""A Lightning checkpoint with adapters back into a fresh LightningModule:
[`load_from_checkpoint`][lightning_peft.callbacks.load_from_checkpoint].

What a checkpoint records about its adapters, and [`restore_adapters`][lightning_peft.callbacks.restore_adapters], which
re-applies them to a freshly built module before its weights are loaded (for an adapter-only checkpoint, taking the
frozen base weights from the model as built), are pure PyTorch: `lightning_peft.peft.checkpoint`.
``LightningModule.load_from_checkpoint`` builds the module and calls its ``on_load_checkpoint`` before loading the
weights, so a module whose ``on_load_checkpoint`` calls ``restore_adapters`` (``HFSequenceClassifier`` does) loads its
adapter checkpoints directly; any other module loads them with
[`load_from_checkpoint`][lightning_peft.callbacks.load_from_checkpoint].

The callbacks' side (recording, checking and completing checkpoints as they are written and loaded) is
`AdapterCallback`.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl

from lightning_peft._checkpoint_files import check_file
from lightning_peft.peft.checkpoint import restore_adapters

_PATCH_LOCK = threading.Lock()
M = TypeVar("M", bound=pl.LightningModule)


def load_from_checkpoint(module_class: type[M], checkpoint_path: str | os.PathLike, **kwargs: Any) -> M:
    """``module_class.load_from_checkpoint(checkpoint_path, **kwargs)`` with the checkpoint's adapters re-applied.

    Works for any LightningModule class, full and adapter-only checkpoints alike (for an adapter-only one the frozen
    base comes from the module as its ``__init__`` builds it, e.g. from the pretrained weights), and for checkpoints
    written by LightningCLI in subclass mode. While it runs, ``module_class.on_load_checkpoint`` calls
    [`restore_adapters`][lightning_peft.callbacks.restore_adapters] first (the class is patched under a lock and
    restored afterwards).

    A sharded checkpoint directory (``ZeROStrategy``, FSDP2, tensor parallelism: one shard per rank) is assembled first
    in a temporary file ([`convert_checkpoint`][lightning_peft.strategies.convert_checkpoint]), so one process loads
    what N ranks saved.

    Raises:
        ValueError: If the checkpoint file is empty or truncated (naming it), or, for a directory, what
            [`convert_checkpoint`][lightning_peft.strategies.convert_checkpoint] refuses.

    Example:
        ``model = load_from_checkpoint(MyModule, "checkpoints/last.ckpt", map_location="cpu")``
    """
    if Path(checkpoint_path).is_dir():
        from lightning_peft.parallel.checkpoint import convert_checkpoint

        with tempfile.TemporaryDirectory(prefix="lightning-peft-") as scratch:
            single = convert_checkpoint(checkpoint_path, Path(scratch) / "assembled.ckpt")
            return load_from_checkpoint(module_class, single, **kwargs)
    if Path(checkpoint_path).is_file():  # torch says "failed finding central directory" for a torn file
        check_file(Path(checkpoint_path), "load_from_checkpoint")
    with _PATCH_LOCK:
        own = module_class.__dict__.get("on_load_checkpoint")
        inherited = module_class.on_load_checkpoint

        def on_load_checkpoint(self: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
            restore_adapters(self, checkpoint)
            inherited(self, checkpoint)

        module_class.on_load_checkpoint = on_load_checkpoint
        try:
            return module_class.load_from_checkpoint(checkpoint_path, **kwargs)
        finally:
            if own is None:
                del module_class.on_load_checkpoint
            else:
                module_class.on_load_checkpoint = own
