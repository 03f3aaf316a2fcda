"""What ``MergeOnSave`` checks when fit starts, so that an export cannot fail at the end of a long run.

The merged export must be one the adapters can write: every technique mergeable, and no layer a merge would refuse
([`Adapter.merge_problems`][lightning_peft.peft.Adapter.merge_problems]: LoRA on a grouped convolution, ``lora_bias``
on a base without a bias), named with the fix.

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
from lightning_peft.peft.adapter import Adapter, adapter_tensors, attached
from lightning_peft.peft.io import check_saveable


def refuse_unmergeable(who: str, model: nn.Module, adapter_name: str | None) -> None:
    """Raise if the merged export of ``model`` (``adapter_name``: the named adapter folded in) would be refused."""
    adapters = attached(model)
    unmergeable = [kind for kind, adapter in adapters.items() if not adapter.mergeable]
    if unmergeable:
        raise ValueError(
            f"{who}: the {unmergeable[0]} adapter cannot be merged into the base weights, so there is no merged model "
            "to write. Export the adapter only: MergeOnSave(save_merged=False)."
        )
    problems = [f"{kind}: {line}" for kind, adapter in adapters.items()
                for line in adapter.merge_problems(model, **_named(adapter, adapter_name))]
    if problems:
        raise ValueError(
            f"{who}(save_merged=True): the merged export would be refused at its first write, as PEFT refuses these "
            f"merges: {'; '.join(problems)}. Export the adapter only (MergeOnSave(save_merged=False)), or leave those "
            "layers out (exclude_modules=[...]) or their setting off; checked before training so no run is lost."
        )


def refuse_unsaveable(who: str, model: nn.Module) -> None:
    """Raise what writing ``adapter/`` (converted: it loads onto the original base) would raise, naming ``who``'s fix
    (a LoftQ adapter has no such file: only the merged model represents it)."""
    try:
        check_saveable(model, convert_to_lora=True)
    except ValueError as err:
        raise ValueError(f"{who}(save_adapter=True): {err} To export the merged model alone: "
                         f"{who}(save_adapter=False).") from None


def _named(adapter: Adapter, adapter_name: str | None) -> dict[str, str]:
    return {"name": adapter_name} if adapter_name is not None and adapter.named else {}


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
