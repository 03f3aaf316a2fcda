"""What ``MergeOnSave`` checks when fit starts, so that an export cannot fail at the end of a long run.

The target folder must be writable, ``merged/`` and ``adapter/`` must not be symbolic links (an export replaces
each by a rename inside ``dirpath``, which would replace the link rather than write where it points, so the link is
refused before training instead of being silently dropped), and the filesystem must have room for the export.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from torch import Tensor, nn

from lightning_peft._atomic import refuse_link
from lightning_peft._manifest import recover_export
from lightning_peft.peft.adapter import adapter_tensors, attached


def check_target(who: str, dirpath: Path, needed: dict[str, int]) -> None:
    """Refuse a ``dirpath`` that cannot take the export (``{part: at least so many bytes}``, see the module docstring);
    complete or clean up what an interrupted earlier export left there."""
    try:
        dirpath.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=dirpath)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"{who}: cannot write there ({type(err).__name__}: {err.strerror or err}). Choose a writable directory; "
            "checked before training so no run is lost."
        ) from None
    for part in needed:
        refuse_link(dirpath / part, who)
    recover_export(dirpath)
    free = shutil.disk_usage(dirpath).free
    total = sum(needed.values())
    if free < total:
        shown = " + ".join(f"{_size(size)} {name}" for name, size in needed.items())
        raise RuntimeError(
            f"{who}: the export needs at least {_size(total)} ({shown}) but the filesystem of {str(dirpath)!r} has "
            f"{_size(free)} free ({total} > {free} bytes). Free some space or choose a dirpath on another disk; "
            "checked before training so the run does not fail at its end."
        )


def _size(size: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return ""  # unreachable


def _nbytes(tensor: Tensor) -> int:
    """Bytes of the whole tensor: a ZeRO-3 partition counts at its full size, a DTensor shard at the global one."""
    numel = getattr(tensor, "ds_numel", None) or tensor.numel()
    return int(numel) * tensor.element_size()


def export_bytes(model: nn.Module, merged: bool, adapter: bool) -> dict[str, int]:
    """A lower bound of the export's size: the tensors' bytes (file headers, configs, a tokenizer not counted)."""
    own = {id(t): t for t in adapter_tensors(model).values()}
    needed = {}
    if merged:
        base = {id(t): t for t in (*model.parameters(), *model.buffers()) if id(t) not in own}
        needed["merged"] = sum(_nbytes(t) for t in base.values())
    if adapter:
        needed["adapter"] = sum(_nbytes(t) for t in own.values())
    return needed


def no_adapter(who: str, model_attribute: str | None, pl_module: nn.Module, name: str, model: nn.Module) -> str:
    """Why the model to export has no adapter, naming the submodules that have one."""
    adapted = [n for n, m in pl_module.named_modules() if m is not model and attached(m)]
    if adapted:
        shown = ", ".join(repr(n) if n else "the whole LightningModule" for n in adapted[:3])
        where = "the whole LightningModule" if name == "" else repr(name)
        return (
            f"{who}(model_attribute={model_attribute!r}) exports {where} ({type(model).__name__}), which has no "
            f"adapter; the PEFT callbacks adapted {shown}. Give {who} the PEFT callback's model_attribute (here "
            f"{who}(model_attribute={adapted[0]!r}), or None where the callback has None)."
        )
    return (
        f"{who}: {type(model).__name__} has no adapter when fit starts. Add a PEFT callback (LoRA, MultiLoRA, "
        "BottleneckAdapters, PromptTuning, PrefixTuning) to Trainer(callbacks=[...]) with the same model_attribute, "
        "or call its inject function in configure_model."
    )
