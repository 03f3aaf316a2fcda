"""One-file checkpoints from sharded ones: what a multi-rank run saved, loadable by one process for inference.

A ZeRO, FSDP2, tensor-parallel or pipeline run saves a directory with one shard per rank: DeepSpeed's layout
(``checkpoint/`` with ``zero_pp_rank_<r>_..._states.pt`` files and a ``latest`` tag), torch's distributed checkpoint
(``.distcp`` files and Lightning's ``meta.pt``) or ``PipelineStrategy``'s ``stage-<rank>.ckpt`` files. :func:`convert_checkpoint` assembles the full float32 weights, as DeepSpeed's
``zero_to_fp32`` does, and writes one Lightning checkpoint file with everything else the run recorded (hyper-
parameters, callback states, the adapter record of ``checkpoint["lightning_peft"]``), without the optimizer state
(which only the sharded run can use)::

    from lightning_peft.strategies import convert_checkpoint
    convert_checkpoint("checkpoints/epoch=2-step=300.ckpt", "model.ckpt")
    model = MyModule.load_from_checkpoint("model.ckpt")       # or lightning_peft.callbacks.load_from_checkpoint

or from a shell: ``python -m lightning_peft.strategies.checkpoint SHARDED_DIR OUTPUT_FILE``. An adapter-only
checkpoint stays adapter-only: loading takes the frozen base from the module as built. No process group is needed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_peft._atomic import write_files

__all__ = ["convert_checkpoint"]

_DEEPSPEED_STATES = ("module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps",
                     "global_steps", "dp_world_size", "mp_world_size", "buffer_names", "param_shapes",
                     "frozen_param_shapes", "shared_params", "frozen_param_fragments", "ds_config", "ds_version")


def convert_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write the sharded checkpoint directory ``checkpoint`` as the single Lightning checkpoint file ``output``.

    Args:
        checkpoint: A directory saved by ``ZeROStrategy`` (DeepSpeed or native) or another sharding strategy.
        output: The file to write (written under a temporary name, then renamed: never half-written).

    Returns:
        ``output``.

    Raises:
        ValueError: If ``checkpoint`` is a single file already, or a directory of neither layout.
        FileNotFoundError: If ``checkpoint`` does not exist.
    """
    source, target = Path(checkpoint), Path(output)
    if not source.exists():
        raise FileNotFoundError(f"convert_checkpoint: {str(source)!r} does not exist.")
    if source.is_file():
        raise ValueError(f"convert_checkpoint({str(source)!r}): this is one file already (a DDP or single-process "
                         "checkpoint); load it directly, there is nothing to convert.")
    if (source / "meta.pt").is_file():
        state = _from_distributed_checkpoint(source)
    elif (source / "latest").is_file():
        state = deepspeed_checkpoint(source)
    elif any(source.glob("stage-*.ckpt")):
        from lightning_peft.strategies.pipeline import consolidate_checkpoint

        state = consolidate_checkpoint(source)
        state.pop("optimizer_states", None)  # weights only, as for the other layouts
    else:
        found = ", ".join(sorted(p.name for p in source.iterdir())[:6]) or "nothing"
        raise ValueError(f"convert_checkpoint({str(source)!r}): not a sharded checkpoint (neither DeepSpeed's "
                         "'latest' + checkpoint/, a distributed checkpoint's meta.pt nor a pipeline's stage-<r>.ckpt "
                         f"files); it holds: {found}.")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_files({target: lambda tmp: torch.save(state, tmp)})
    return target


def deepspeed_checkpoint(directory: Path) -> dict[str, Any]:
    """A DeepSpeed checkpoint directory as one Lightning checkpoint dict: full float32 weights, no optimizer."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, get_model_state_files

    tag = (directory / "latest").read_text().strip()
    adapter_only = _adapter_only(directory / tag)
    weights = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag,
                                                       exclude_frozen_parameters=adapter_only)
    # Rank 0's model-states file carries what Lightning saved besides the weights (its client state).
    client = torch.load(get_model_state_files(str(directory / tag))[0], map_location="cpu", weights_only=False)
    state = {k: v for k, v in client.items() if k not in _DEEPSPEED_STATES}
    state["state_dict"] = {k.removeprefix("_forward_module."): v for k, v in weights.items()}
    return state


def _adapter_only(tag_directory: Path) -> bool:
    from deepspeed.utils.zero_to_fp32 import get_model_state_files

    client = torch.load(get_model_state_files(str(tag_directory))[0], map_location="cpu", weights_only=False)
    return bool((client.get("lightning_peft") or {}).get("adapter_only"))


def _from_distributed_checkpoint(directory: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    loaded: dict[str, Any] = {}
    _load_state_dict(loaded, storage_reader=FileSystemReader(directory), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    state = torch.load(directory / "meta.pt", map_location="cpu", weights_only=False)
    state["state_dict"] = loaded["state_dict"]
    return state


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m lightning_peft.strategies.checkpoint SHARDED_CHECKPOINT_DIR OUTPUT_FILE")
    print(convert_checkpoint(sys.argv[1], sys.argv[2]))
