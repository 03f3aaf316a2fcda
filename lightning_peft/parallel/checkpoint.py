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

Reading a checkpoint from a stranger must not run its code. Pickled files are read with
``torch.load(weights_only=True)``, allowing only the few plain classes DeepSpeed writes into its files
(`DEEPSPEED_SAFE_GLOBALS`); DeepSpeed's own reader (``zero_to_fp32``) unpickles without that restriction, so
every file it will read is checked that way first, and torch's distributed-checkpoint ``.metadata`` is checked by an
unpickler that knows only its metadata classes. A file holding anything else is refused, naming it;
``trust=True`` (``--trust``) skips the checks, for a checkpoint whose origin you trust.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from lightning_peft._atomic import write_files
from lightning_peft.parallel.pipeline_state import consolidate_checkpoint

__all__ = ["convert_checkpoint", "deepspeed_checkpoint", "load_optimizer_states"]

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
        ValueError: If ``checkpoint`` is a single file already, a directory of neither layout, or (unless
            ``trust``) holds a file that could run code when read.
        FileNotFoundError: If ``checkpoint`` does not exist.
    """
    source, target = Path(checkpoint), Path(output)
    if not source.exists():
        raise FileNotFoundError(f"convert_checkpoint: {str(source)!r} does not exist.")
    if source.is_file():
        raise ValueError(f"convert_checkpoint({str(source)!r}): this is one file already (a DDP or single-process "
                         "checkpoint); load it directly, there is nothing to convert.")
    if (source / "meta.pt").is_file():
        state = _from_distributed_checkpoint(source, trust)
    elif (source / "latest").is_file():
        state = deepspeed_checkpoint(source, trust)
    elif any(source.glob("stage-*.ckpt")):
        state = consolidate_checkpoint(source, weights_only=not trust)
        state.pop("optimizer_states", None)  # weights only, as for the other layouts
    else:
        found = ", ".join(sorted(p.name for p in source.iterdir())[:6]) or "nothing"
        raise ValueError(f"convert_checkpoint({str(source)!r}): not a sharded checkpoint (neither DeepSpeed's "
                         "'latest' + checkpoint/, a distributed checkpoint's meta.pt nor a pipeline's stage-<r>.ckpt "
                         f"files); it holds: {found}.")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_files({target: lambda tmp: torch.save(state, tmp)})
    return target


def deepspeed_safe_globals() -> list[type]:
    """The classes DeepSpeed 0.19 pickles into its checkpoint files, beyond tensors and containers: its loss scalers
    (plain attributes), the ZeRO stage enum and the address record of a parameter fragment."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _load(file: Path, trust: bool, safe_globals: list[type] = ()) -> Any:
    """``torch.load`` of ``file`` on the CPU: ``weights_only`` (with ``safe_globals``) unless ``trust``."""
    if trust:
        return torch.load(file, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        raise ValueError(
            f"convert_checkpoint: {str(file)!r} holds objects that torch.load(weights_only=True) does not read "
            f"({found.group(1) if found else str(error).splitlines()[0]}); reading it unrestricted could run code from whoever wrote it. If you trust where this "
            "checkpoint comes from, pass convert_checkpoint(..., trust=True) (--trust on the command line)."
        ) from None


def deepspeed_checkpoint(directory: Path, trust: bool = False) -> dict[str, Any]:
    """A DeepSpeed checkpoint directory as one Lightning checkpoint dict: full float32 weights, no optimizer."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, get_model_state_files

    tag = (directory / "latest").read_text().strip()
    safe = deepspeed_safe_globals()
    if not trust:  # DeepSpeed's reader unpickles unrestricted: every file it reads passes the safe reader first
        for file in sorted((directory / tag).glob("*.pt")):
            _load(file, trust, safe)
    # Rank 0's model-states file carries what Lightning saved besides the weights (its client state).
    client = _load(Path(get_model_state_files(str(directory / tag))[0]), trust, safe)
    adapter_only = bool((client.get("lightning_peft") or {}).get("adapter_only"))
    weights = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag,
                                                       exclude_frozen_parameters=adapter_only)
    state = {k: v for k, v in client.items() if k not in _DEEPSPEED_STATES}
    state["state_dict"] = {k.removeprefix("_forward_module."): v for k, v in weights.items()}
    return state


class _MetadataUnpickler(pickle.Unpickler):
    """Reads torch's distributed-checkpoint ``.metadata`` (a plain pickle) knowing only the classes it holds."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self._ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def _check_metadata(file: Path) -> None:
    try:
        with file.open("rb") as handle:
            _MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"convert_checkpoint: {str(file)!r} holds objects a distributed checkpoint's metadata does not ({error}); "
            "reading it unrestricted could run code from whoever wrote it. If you trust where this checkpoint "
            "comes from, pass convert_checkpoint(..., trust=True) (--trust on the command line)."
        ) from None


def _from_distributed_checkpoint(directory: Path, trust: bool = False) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not trust:  # torch's reader unpickles .metadata unrestricted (its tensors it reads with weights_only)
        _check_metadata(directory / ".metadata")
    loaded: dict[str, Any] = {}
    _load_state_dict(loaded, storage_reader=FileSystemReader(directory), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    state = _load(directory / "meta.pt", trust)
    state["state_dict"] = loaded["state_dict"]
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
