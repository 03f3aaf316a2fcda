"""Checkpoint files written so that a kill or a full disk never costs the previous checkpoint.

Lightning's ``TorchCheckpointIO`` serialises into memory, writes through fsspec to a temporary file in ``$TMPDIR``
and moves it onto the target; where ``$TMPDIR`` is another filesystem the move is a copy that truncates the target
first, so a kill or a full disk during it leaves a torn ``last.ckpt`` and no good one. `AtomicCheckpointIO` writes
to a temporary name in the target folder, flushes it, and renames it over the target (`lightning_peft._atomic`).
The library's strategies use it unless given another ``CheckpointIO``; the PEFT callbacks put it in place of
Lightning's plain ``TorchCheckpointIO`` (that exact type: a user's own plugin is kept). Checkpoints that are folders
written by several ranks are filled under a temporary name and swapped in (`save_folder`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from lightning_peft._atomic import clean_stale, finish_dir, save_torch, swap, temporary_prefix
from lightning_peft._checkpoint_files import check_file


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves go to a temporary file beside the target, renamed over it when whole.

    On an error (a full disk, an object that cannot be pickled) the temporary is removed and the previous file is
    left as it was; a kill leaves the previous file and a temporary that the next save into that folder removes.
    Remote paths (``s3://``, ...) are saved by Lightning's ``TorchCheckpointIO``.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options={storage_options!r}): "
                            "storage_options are not used for a local file; leave them out.")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        save_torch(checkpoint, target, type(self).__name__)
        return None

    @override
    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's load, after naming an empty or truncated local file (torch says ``EOFError`` or ``OSError:
        [Errno 22] Invalid argument``, and nothing about the file)."""
        if _is_local(path) and Path(path).is_file():
            check_file(Path(path), f"{type(self).__name__}.load_checkpoint")
        return super().load_checkpoint(path, *args, **kwargs)


def _is_local(path: Any) -> bool:
    return get_filesystem(path).protocol in ("file", ("file", "local"), "local")


class AtomicCheckpoints:
    """Strategy mixin: `AtomicCheckpointIO` where Lightning's strategies default to ``TorchCheckpointIO`` (a plugin
    given to the Trainer or the strategy is kept)."""

    _checkpoint_io: CheckpointIO | None

    @property
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        return Strategy.checkpoint_io.fget(self)

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io


def use_atomic_checkpoint_io(strategy: Strategy) -> None:
    """Give ``strategy`` an `AtomicCheckpointIO` where it would use Lightning's plain ``TorchCheckpointIO``."""
    current = getattr(strategy, "_checkpoint_io", None)
    if current is None or type(current) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()


def save_folder(strategy: Strategy, path: Any, write: Callable[[Path], object]) -> None:
    """Fill a checkpoint folder that every rank writes to under a temporary name, then swap it in for ``path``.

    Every rank must call it. ``write(folder)`` writes this rank's part; global rank 0 chooses the temporary name
    (beside ``path``, so the swap is a rename) and swaps it in after every rank has written. Under several ranks a
    rank that fails removes nothing (another may still be writing): the next save cleans the temporary once this
    process is gone.
    """
    target = Path(path)
    name = None
    if strategy.is_global_zero:
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(target.parent)
        name = tempfile.mkdtemp(prefix=temporary_prefix(target.name, "new"), dir=target.parent)
    folder = Path(strategy.broadcast(name))  # what global rank 0 made, on every rank
    try:
        write(folder)
    except BaseException:
        if strategy.world_size == 1:  # no other rank may still be writing into it
            shutil.rmtree(folder, ignore_errors=True)
        raise
    strategy.barrier("lightning_peft_checkpoint_written")
    if strategy.is_global_zero:
        finish_dir(folder)
        swap(folder, target)
    strategy.barrier("lightning_peft_checkpoint_swapped")


def save_sharded(strategy: Strategy, save: Callable[..., None], checkpoint: dict[str, Any], path: Any,
                 storage_options: Any | None, sharded: bool = True) -> None:
    """``save(checkpoint, path, storage_options)``, the strategy's own save; one that writes a folder from every
    rank (``sharded``) goes through `save_folder`."""
    if not sharded:
        return save(checkpoint, path, storage_options)
    save_folder(strategy, strategy.broadcast(path), lambda folder: save(checkpoint, folder, storage_options))
    return None
