"""One-file checkpoints from sharded ones: what a multi-rank run saved, loadable by one process for inference.

A ZeRO, FSDP2, tensor-parallel or pipeline run saves a directory with one shard per rank: DeepSpeed's layout
(``checkpoint/`` with ``zero_pp_rank_<r>_..._states.pt`` files and a ``latest`` tag), torch's distributed checkpoint
(``.distcp`` files and Lightning's ``meta.pt``) or ``PipelineStrategy``'s ``stage-<rank>.ckpt`` files.
[`convert_checkpoint`][lightning_peft.strategies.convert_checkpoint] assembles the full float32 weights, as DeepSpeed's
``zero_to_fp32`` does, and writes one Lightning checkpoint file with everything else the run recorded (hyper-
parameters, callback states, the adapter record of ``checkpoint["lightning_peft"]``), without the optimizer state (which
only the sharded run can use):

```python
from lightning_peft.strategies import convert_checkpoint
convert_checkpoint("checkpoints/epoch=2-step=300.ckpt", "model.ckpt")
model = MyModule.load_from_checkpoint("model.ckpt")       # or lightning_peft.callbacks.load_from_checkpoint
```

or from a shell: ``python -m lightning_peft.strategies.checkpoint SHARDED_DIR OUTPUT_FILE [--trust]``. An adapter-only
checkpoint stays adapter-only: loading takes the frozen base from the module as built. No process group is needed.

Reading a checkpoint from a stranger must not run its code. With ``trust=False`` (the default, and what
``load_from_checkpoint`` on a directory uses) nothing is unpickled unrestricted, as DeepSpeed's and torch's readers
would:

- pickled files (DeepSpeed's ``*_states.pt``, ``meta.pt``, ``stage-<r>.ckpt``) with ``torch.load(weights_only=True)``,
  allowing exactly the plain classes DeepSpeed writes (`deepspeed_safe_globals`); DeepSpeed's ``zero_to_fp32`` only
  assembles what was read;
- DeepSpeed's ``latest`` must name one folder of the directory, by name: no pattern (``*`` is a folder called ``*``),
  no path (``..``, ``/``);
- a distributed checkpoint's ``.metadata`` with an unpickler that allows exact (module, name) pairs of torch's metadata
  classes (a name reached through an allowed module, as ``os.system`` through ``torch.distributed.checkpoint.metadata``,
  is not one), naming only data files beside it; its non-tensor entries with ``torch.load(weights_only=True)``
  (torch reads its tensors that way too);
- no file that is a link leading out of the directory.

What cannot be read that way is refused, naming the file (and the entry) and pointing to ``trust=True``
(``--trust``), which reads the files unrestricted, for a checkpoint whose origin you trust (the tag is still one
folder by name). An empty or truncated file, a missing rank's file or an output that cannot be written (a full disk:
nothing is replaced) is named with its cause too.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_peft._atomic import write_files
from lightning_peft._checkpoint_files import FIX, check_file, inside, read_file
from lightning_peft.parallel.pipeline_state import merge_stages, read_stages, stage_files

__all__ = ["convert_checkpoint", "deepspeed_checkpoint", "load_optimizer_states"]

_WHO = "convert_checkpoint"
_DEEPSPEED_STATES = ("module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps",
                     "global_steps", "dp_world_size", "mp_world_size", "buffer_names", "param_shapes",
                     "frozen_param_shapes", "shared_params", "frozen_param_fragments", "ds_config", "ds_version")


def convert_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *, trust: bool = False) -> Path:
    """Write the sharded checkpoint directory ``checkpoint`` as the single Lightning checkpoint file ``output``.

    Args:
        checkpoint: A directory saved by ``ZeROStrategy`` (DeepSpeed or native) or another sharding strategy.
        output: The file to write (written under a temporary name, then renamed: never half-written).
        trust: Read the files as they are, without the checks that keep a stranger's checkpoint from running
            code (see the module docstring). Only for a checkpoint whose origin you trust.

    Returns:
        ``output``.

    Raises:
        ValueError: If ``checkpoint`` is a single file already, a directory of neither layout, holds an empty,
            truncated or missing file, or (unless ``trust``) a file that could run code when read, a DeepSpeed tag
            that is not a folder's name or a link out of the directory; the message names the file.
        FileNotFoundError: If ``checkpoint`` does not exist.
        OSError: If ``output`` cannot be written (a full disk): named, with the cause; nothing is replaced.
    """
    source, target = Path(checkpoint), Path(output)
    if not source.exists():
        raise FileNotFoundError(f"convert_checkpoint: {str(source)!r} does not exist.")
    if source.is_file():
        check_file(source, "convert_checkpoint")  # an empty or truncated file: say so, not "load it directly"
        raise ValueError(f"convert_checkpoint({str(source)!r}): this is one file already (a DDP or single-process "
                         "checkpoint); load it directly, there is nothing to convert.")
    if (source / "meta.pt").is_file():
        state = _from_distributed_checkpoint(source, trust)
    elif (source / "latest").is_file():
        state = deepspeed_checkpoint(source, trust)
    elif stages := stage_files(source):
        parts = read_stages(stages, _WHO, trust)
        for part in parts:
            part.pop("optimizer_states", None)  # weights only, as for the other layouts
        state = merge_stages(parts)
        state.pop("optimizer_states")
    else:
        found = ", ".join(sorted(p.name for p in source.iterdir())[:6]) or "nothing"
        raise ValueError(f"convert_checkpoint({str(source)!r}): not a sharded checkpoint (neither DeepSpeed's "
                         "'latest' + checkpoint/, a distributed checkpoint's meta.pt nor a pipeline's stage-<r>.ckpt "
                         f"files); it holds: {found}.")
    target.parent.mkdir(parents=True, exist_ok=True)
    _write(state, target)
    return target


def _write(state: dict[str, Any], target: Path) -> None:
    """``torch.save`` of ``state`` to ``target`` through a temporary file; a failed write says what happened.

    torch reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``; writing
    through a Python file, the ``OSError`` the write raised is there (as it is, or as that error's context).
    """

    def save(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            torch.save(state, handle)

    existed = target.exists()
    try:
        write_files({target: save})
    except (OSError, RuntimeError) as error:
        cause = next((e for e in _chain(error) if isinstance(e, OSError)), None)
        if cause is None:
            raise
        full = cause.errno in (errno.ENOSPC, errno.EDQUOT)
        what = f"the disk is full ({cause.strerror})" if full else str(cause.strerror or cause)
        kept = f"{str(target)!r} is as it was" if existed else f"no {target.name} was written"
        fix = ("Free space there, or write the output to another disk." if full
               else "Write the output somewhere this process can write.")
        raise OSError(cause.errno, f"{_WHO}: could not write {str(target)!r}: {what}; nothing was replaced ({kept}, "
                                   f"the temporary file removed). {fix}") from error


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from or while handling."""
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def deepspeed_safe_globals() -> list[type]:
    """The classes DeepSpeed 0.19 pickles into its checkpoint files, beyond tensors and containers: its loss scalers
    (plain attributes), the ZeRO stage enum and the address record of a parameter fragment."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def deepspeed_checkpoint(directory: Path, trust: bool = False) -> dict[str, Any]:
    """A DeepSpeed checkpoint directory as one Lightning checkpoint dict: full float32 weights, no optimizer.

    The files are read here (`read_file`: ``weights_only`` unless ``trust``) and assembled by DeepSpeed's
    ``zero_to_fp32`` functions, which are given what was read: DeepSpeed's own reader (which globs the tag folder and
    unpickles unrestricted) reads nothing.
    """
    folder = _tag_folder(Path(directory), trust)
    safe = deepspeed_safe_globals()
    models = [read_file(f, _WHO, trust, safe) for f in _rank_files(folder, "_model_states.pt", trust)]
    optimizers = [read_file(f, _WHO, trust, safe) for f in _rank_files(folder, "_optim_states.pt", trust)]
    client = models[0]  # rank 0's model states carry what Lightning saved besides the weights (its client state)
    adapter_only = bool((client.get("lightning_peft") or {}).get("adapter_only"))
    try:
        weights = _assemble(models, optimizers, adapter_only)
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        raise ValueError(f"{_WHO}: {str(folder)!r} is not a ZeRO checkpoint as DeepSpeed writes it (reading its "
                         f"model and optimizer states failed: {type(error).__name__}: {error}). {FIX}") from None
    state = {k: v for k, v in client.items() if k not in _DEEPSPEED_STATES}
    state["state_dict"] = {k.removeprefix("_forward_module."): v for k, v in weights.items()}
    return state


def _tag_folder(directory: Path, trust: bool) -> Path:
    """The folder ``latest`` names: exactly one child of ``directory``, by name (no pattern, no path)."""
    latest = inside(directory, directory / "latest", _WHO, trust)
    if not latest.is_file():
        raise ValueError(f"{_WHO}: {str(directory)!r} has no 'latest' file naming its tag folder: not a DeepSpeed "
                         "checkpoint, or one whose save did not finish.")
    with latest.open("rb") as handle:
        tag = handle.read(256).decode("utf-8", "replace").strip()  # DeepSpeed writes a short name: global_step300
    if tag in ("", ".", "..") or Path(tag).name != tag or any(c in tag for c in "/\\\0"):
        raise ValueError(f"{_WHO}: {str(latest)!r} names the tag {tag!r}, which is not the name of a folder in "
                         f"{str(directory)!r} (DeepSpeed writes a folder name, such as 'global_step300'). Write the "
                         "name of the checkpoint's tag folder into it.")
    folder = inside(directory, directory / tag, _WHO, trust)
    if not folder.is_dir():
        found = ", ".join(sorted(p.name for p in directory.iterdir() if p.is_dir())[:6]) or "none"
        raise ValueError(f"{_WHO}: {str(latest)!r} names the tag {tag!r}, but {str(directory)!r} has no folder of "
                         f"that name (its folders: {found}). Write the name of the checkpoint's tag folder into it.")
    return folder


def _rank_files(folder: Path, suffix: str, trust: bool) -> list[Path]:
    """The files of ``folder`` whose names end in ``suffix`` (``zero_to_fp32``'s ``*<suffix>``), in rank order."""
    files = [p for p in folder.iterdir() if p.name.endswith(suffix) and not p.name.startswith(".")]
    if not files:
        raise ValueError(f"{_WHO}: {str(folder)!r} holds no *{suffix} file: not a DeepSpeed checkpoint's tag folder, "
                         f"or one whose save did not finish. {FIX}")
    natural = [[int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)] for p in files]
    return [inside(folder.parent, p, _WHO, trust) for _, p in sorted(zip(natural, files), key=lambda x: x[0])]


def _assemble(models: list[dict[str, Any]], optimizers: list[dict[str, Any]], adapter_only: bool) -> dict[str, Any]:
    """The full weights from the ranks' model and optimizer states, as ``zero_to_fp32`` assembles them once it has
    read the files (``parse_model_states``, ``parse_optim_states``, then the merge of the stage)."""
    from deepspeed.utils import zero_to_fp32 as ds

    refuse_partitioned_experts = getattr(ds, "_raise_if_autoep_zero3_partitioned_state", None)  # DeepSpeed >= 0.19
    states = []
    for model in models:
        if refuse_partitioned_experts is not None:
            refuse_partitioned_experts(model)
        buffers = {k: v.float() if v.is_floating_point() else v for k, v in model["module"].items()
                   if k in model["buffer_names"]}
        states.append(ds.zero_model_state(
            buffers=buffers, param_shapes=model["param_shapes"], ds_version=model.get("ds_version"),
            shared_params=[[k, v] for k, v in model["shared_params"].items()],
            frozen_param_shapes=model.get("frozen_param_shapes"),
            frozen_param_fragments=model.get("frozen_param_fragments")))
    first = optimizers[0]["optimizer_state_dict"]
    stage, world = int(first["zero_stage"]), first["partition_count"]
    world = max(world) if isinstance(world, list) else world
    if world != len(optimizers):
        raise ValueError(f"{_WHO}: the checkpoint was saved by {world} ranks but holds {len(optimizers)} "
                         f"*_optim_states.pt files (a rank's save did not finish, or files of two saves). {FIX}")
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    groups = [o["optimizer_state_dict"][key] for o in optimizers]
    if stage <= 2:
        paddings = first.get("param_alignment_paddings")  # DeepSpeed >= 0.19 records it (and takes it)
        extra = () if paddings is None else (paddings,)
        weights = ds._get_fp32_state_dict_from_zero2_checkpoint(world, groups, states, adapter_only, *extra)
    else:
        weights = ds._get_fp32_state_dict_from_zero3_checkpoint(world, groups, states, adapter_only)
    return ds.to_torch_tensor(weights)


def _from_distributed_checkpoint(directory: Path, trust: bool = False) -> dict[str, Any]:
    from lightning_peft.parallel._distcp import distributed_weights

    weights = distributed_weights(directory, trust)
    state = read_file(inside(directory, directory / "meta.pt", _WHO, trust), _WHO, trust)
    state["state_dict"] = weights
    return state


def load_optimizer_states(path: Path, module: Any, optimizers: list[Any]) -> None:
    """Load each optimizer's state (``optimizer_<index>``) of the torch distributed checkpoint ``path`` into
    ``optimizers`` of the (sharded) ``module``; every rank calls it."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        load(optimizer_state, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key],
                                 options=StateDictOptions(cpu_offload=True))
