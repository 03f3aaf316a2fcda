"""What each rank of a pipeline holds and exchanges, without Lightning: its parameters (the others' are ``meta``
placeholders), the gradients of parameters several ranks share, the global gradient norm, the agreement on a
``GradScaler`` overflow, an export gathered on rank 0, and the checkpoint file of its stages.

Ownership. Every rank builds the whole model, then replaces the parameters of the stages it does not hold by
``meta`` tensors (`free_parameters`; shapes kept, no storage). A parameter used by several ranks' stages
(tied input and output embeddings) stays on each of them; its gradient is summed across them
(`sum_shared_gradients`), and the global gradient norm counts it once (`clip_by_global_norm`).
Buffers (BatchNorm statistics) stay on every rank, but only the ranks whose stages run a module update its buffers.

Checkpoints. One file per rank, ``stage-<rank>.ckpt``, whose ``state_dict`` and optimizer states hold that rank's
parameters (keys as in the unsplit model) and whose ``"pipeline"`` entry records the split and each kept
parameter's position in the unsplit optimizer (`keep_owned_parameters`). `consolidate_checkpoint`
merges the files into one ordinary checkpoint of the unsplit model; `select_optimizer_state` takes a rank's
part of an unsplit optimizer state.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_peft._checkpoint_files import FIX, inside, read_file
from lightning_peft.parallel.pipeline import Piece

__all__ = [
    "STAGE_FILE", "Ownership", "agree_on_overflow", "clip_by_global_norm", "consolidate_checkpoint",
    "free_parameters", "gather_on_rank", "keep_owned_parameters", "move_real_tensors", "ownership",
    "select_optimizer_state", "sum_shared_gradients",
]


STAGE_FILE = "stage-{}.ckpt"


@dataclass
class Ownership:
    """Which tensors of the model a rank holds once the stages are placed.

    ``owned``: ids of the parameters its stages use (heads outside the sequence belong to the last stage);
    ``foreign_buffers`` / ``foreign_buffer_ids``: state-dict keys and ids of the buffers only other ranks' stages
    update (BatchNorm statistics: this rank's copies are stale); ``shared``: ``(ranks, parameters, group)`` for the
    parameters this rank shares with other ranks (tied embeddings), one process group per set of ranks.
    """

    owned: set[int]
    foreign_buffers: set[str]
    foreign_buffer_ids: set[int]
    shared: list[tuple[list[int], list[nn.Parameter], Any]]


def ownership(module: nn.Module, stages: Sequence[Sequence[Piece]], ranks: Sequence[int], rank: int) -> Ownership:
    """What ``rank`` holds of ``module`` when stage ``s`` of ``stages`` runs on ``ranks[s]``.

    Every rank must call it (it creates the process groups of shared parameters, each on every rank).
    """
    owners: dict[int, set[int]] = {}
    buffer_owners: dict[int, set[int]] = {}
    for index, stage in enumerate(stages):
        for piece in stage:
            for p in piece.module.parameters():
                owners.setdefault(id(p), set()).add(ranks[index])
            for b in piece.module.buffers():
                buffer_owners.setdefault(id(b), set()).add(ranks[index])
    last = ranks[-1]
    for p in module.parameters():  # heads outside the sequence (a classifier, a pooler) run on the last stage
        owners.setdefault(id(p), {last})
    foreign = [(name, b) for name, b in module.named_buffers(remove_duplicate=False)
               if rank not in buffer_owners.get(id(b), {last})]
    params = {id(p): p for p in module.parameters()}
    groups: dict[tuple[int, ...], list[int]] = {}
    for pid, rs in owners.items():
        if len(rs) > 1:
            groups.setdefault(tuple(sorted(rs)), []).append(pid)
    shared = []
    for rs, pids in sorted(groups.items()):
        group = dist.new_group(list(rs)) if dist.is_initialized() else None  # every rank creates every group
        if rank in rs:
            shared.append((list(rs), [params[i] for i in pids], group))
    return Ownership({i for i, rs in owners.items() if rank in rs}, {name for name, _ in foreign},
                     {id(b) for _, b in foreign}, shared)


def free_parameters(module: nn.Module, owned: set[int]) -> None:
    """Replaces every parameter whose id is not in ``owned`` by a ``meta`` parameter of the same shape."""
    placeholders: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or id(p) in owned or p.device.type == "meta":
                continue
            if id(p) not in placeholders:
                placeholders[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            sub._parameters[name] = placeholders[id(p)]


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """Moves every parameter and buffer that is not a ``meta`` placeholder to ``device`` (in place, as ``.to``)."""
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for tensor in store.values():
                if tensor is not None and tensor.device.type != "meta" and tensor.device != device:
                    tensor.data = tensor.data.to(device)


def keep_owned_parameters(optimizers: Sequence[Any], owned: set[int]) -> list[list[list[int]]]:
    """Drops the other ranks' (meta) parameters from every optimizer; returns the kept ones' positions (per
    optimizer, per group: positions in the unsplit optimizer's flattened parameter order)."""
    positions_of = []
    for optimizer in optimizers:
        positions, index = [], 0
        for group in optimizer.param_groups:
            kept = []
            for p in group["params"]:
                if id(p) in owned:
                    kept.append(index)
                index += 1
            positions.append(kept)
            group["params"] = [p for p in group["params"] if id(p) in owned]
        positions_of.append(positions)
    return positions_of


def select_optimizer_state(state: dict[str, Any], positions: list[list[int]]) -> dict[str, Any]:
    """The part of an unsplit optimizer ``state_dict`` for the parameters at ``positions`` (one list per group, each
    a position in the unsplit optimizer's flattened parameter order)."""
    flat = [i for group in state["param_groups"] for i in group["params"]]
    groups, new_state, index = [], {}, 0
    for group, kept in zip(state["param_groups"], positions, strict=True):
        ids = []
        for position in kept:
            if flat[position] in state["state"]:
                new_state[index] = state["state"][flat[position]]
            ids.append(index)
            index += 1
        groups.append({**group, "params": ids})
    return {"state": new_state, "param_groups": groups}


def sum_shared_gradients(shared: Sequence[tuple[list[int], list[nn.Parameter], Any]]) -> None:
    """Sums the gradients of parameters several ranks hold (tied embeddings) over those ranks."""
    for _, params, group in shared:
        for p in params:
            if not p.requires_grad:  # frozen (a LoRA base): no gradient anywhere
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=group)
            p.grad = grad


def clip_by_global_norm(optimizer: Any, clip_val: float, shared: Sequence[tuple[list[int], list[nn.Parameter], Any]],
                        rank: int, device: torch.device) -> None:
    """Clips ``optimizer``'s gradients by the global gradient norm over all stages (a shared parameter counted once:
    by the first of its ranks)."""
    counted = {id(p) for _, params, _ in shared for p in params}
    lead = {id(p) for rs, params, _ in shared if rs[0] == rank for p in params}
    grads, squares = [], torch.zeros((), dtype=torch.float64, device=device)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            grads.append(p.grad)
            if id(p) not in counted or id(p) in lead:
                squares += p.grad.detach().double().pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(squares)
    coefficient = clip_val / (float(squares.sqrt()) + 1e-6)
    if coefficient < 1:
        for grad in grads:
            grad.mul_(coefficient)


def agree_on_overflow(scaler: Any, device: torch.device) -> None:
    """Under a ``GradScaler`` (``16-mixed``), every rank skips the step (and lowers the scale) when any stage's
    gradients overflowed, as DDP's all-reduced gradients make it; else the stages would drift apart."""
    if scaler is None or getattr(scaler, "_lightning_peft_pipeline", False) or not dist.is_initialized():
        return
    unscale = scaler.unscale_

    def unscale_on_every_rank(optimizer: Any) -> None:
        unscale(optimizer)
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        overflow = torch.zeros(1, device=device)
        for flag in found.values():
            overflow = torch.maximum(overflow, flag.to(device))
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
        for key, flag in list(found.items()) or [(device, overflow)]:
            found[key] = overflow.to(flag.device)

    scaler.unscale_ = unscale_on_every_rank
    scaler._lightning_peft_pipeline = True


@contextlib.contextmanager
def gather_on_rank(module: nn.Module, params: Sequence[nn.Parameter] | None, foreign_buffer_ids: set[int],
                   rank: int, world_size: int, device: torch.device) -> Iterator[nn.Module]:
    """Inside, the chosen parameters of ``module`` (default: all, and then its buffers too) hold their full values
    on global rank 0.

    Every rank must enter (it runs collectives). The other ranks' parameters are sent to rank 0 and swapped in for
    its ``meta`` placeholders, and the buffers of the stages rank 0 does not run (``foreign_buffer_ids``) for its
    stale copies; on exit the placeholders and copies are put back.
    """
    chosen = None if params is None else {id(p) for p in params}
    ordered = [p for _, p in module.named_parameters() if chosen is None or id(p) in chosen]
    buffers = [b for _, b in module.named_buffers()] if chosen is None else []
    mine = ({i: p.detach().cpu() for i, p in enumerate(ordered) if p.device.type != "meta"},
            {i: b.detach().cpu() for i, b in enumerate(buffers) if id(b) not in foreign_buffer_ids})
    gathered: list[Any] = [None] * world_size if rank == 0 else None
    if dist.is_initialized():
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    swapped: list[tuple[dict[str, Any], str, Tensor]] = []
    try:
        if rank == 0:
            full: dict[int, Tensor] = {}
            for part, buffer_part in gathered:
                for i, tensor in part.items():
                    p = ordered[i]
                    if p.device.type == "meta" and id(p) not in full:
                        full[id(p)] = nn.Parameter(tensor.to(device), p.requires_grad)
                for i, tensor in buffer_part.items():
                    b = buffers[i]
                    if id(b) in foreign_buffer_ids and id(b) not in full:
                        full[id(b)] = tensor.to(b.device)
            for owner in module.modules():
                for store in (owner._parameters, owner._buffers):
                    for name, t in list(store.items()):
                        if t is not None and id(t) in full:
                            swapped.append((store, name, t))
                            store[name] = full[id(t)]
        yield module
    finally:
        for store, name, t in reversed(swapped):
            store[name] = t


def consolidate_checkpoint(path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, Any]:
    """Merges a pipeline checkpoint directory into one ordinary Lightning checkpoint of the unsplit model.

    The ``state_dict`` is the union of the stage files' (keys as in the unsplit model; each buffer from the stage
    that runs its module, the only one that saves it); optimizer states are put back
    at the unsplit model's parameter positions, so ``Trainer(...).fit(ckpt_path=...)`` on one process (or DDP)
    resumes from the result. Everything else is taken from stage 0's file.

    Args:
        path: The directory a `PipelineStrategy` checkpoint was saved to.
        weights_only: Read the files with ``torch.load(weights_only=True)`` (tensors and plain containers only: a
            file cannot run code). ``False`` for trusted checkpoints whose hyperparameters hold other objects.

    Returns:
        The merged checkpoint dict (``torch.save`` it to get a file).

    Raises:
        ValueError: If ``path`` holds no stage files, misses a rank's, or one is empty, truncated, not a stage
            checkpoint or (with ``weights_only``) holds other objects; the message names the file.

    Examples:
        >>> torch.save(consolidate_checkpoint("checkpoints/last.ckpt"), "last-merged.ckpt")  # doctest: +SKIP
    """
    directory = Path(path)
    files = stage_files(directory) if directory.is_dir() else []
    if not files:
        raise ValueError(
            f"consolidate_checkpoint({str(path)!r}): not a pipeline checkpoint directory (no stage-<rank>.ckpt files)."
        )
    return merge_stages(read_stages(files, "consolidate_checkpoint", trust=not weights_only))


def stage_files(directory: Path) -> list[Path]:
    """The ``stage-<rank>.ckpt`` files of ``directory``, in rank order.

    Raises:
        ValueError: If a rank's file is missing (ranks 0 to the highest must all be there).
    """
    ranks = {int(m.group(1)): p for p in directory.iterdir() if (m := re.fullmatch(r"stage-(\d+)\.ckpt", p.name))}
    missing = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
    if missing:
        raise ValueError(f"{str(directory)!r}: a pipeline checkpoint of {max(ranks) + 1} ranks lacks "
                         f"{STAGE_FILE.format(missing[0])} (a rank's save did not finish, or was deleted); use a "
                         "checkpoint whose every stage file is there.")
    return [ranks[r] for r in sorted(ranks)]


def read_stages(files: Sequence[Path], who: str, trust: bool) -> list[dict[str, Any]]:
    """The stage files read (``weights_only`` unless ``trust``), each checked to be a stage checkpoint."""
    parts = []
    for file in files:
        part = read_file(inside(file.parent, file, who, trust), who, trust)
        if not isinstance(part, dict) or not isinstance(part.get("state_dict"), dict):
            raise ValueError(f"{who}: {str(file)!r} is not a pipeline stage checkpoint (no 'state_dict' entry). "
                             f"{FIX}")
        parts.append(part)
    return parts


def merge_stages(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The stage checkpoints ``parts`` (in rank order) as one checkpoint of the unsplit model."""
    merged = {k: v for k, v in parts[0].items() if k != "pipeline"}
    merged["state_dict"] = {}
    for part in parts:
        merged["state_dict"].update(part["state_dict"])
    optimizers = []
    for n, first in enumerate(parts[0].get("optimizer_states", [])):
        groups = [{**g, "params": []} for g in first["param_groups"]]
        state: dict[int, Any] = {}
        for part in parts:
            local = part["optimizer_states"][n]
            positions = part["pipeline"]["optimizer_positions"][n]
            flat_local = [i for g in local["param_groups"] for i in g["params"]]
            cursor = 0
            for g, kept in enumerate(positions):
                for global_position in kept:
                    local_id = flat_local[cursor]
                    cursor += 1
                    if global_position not in groups[g]["params"]:
                        groups[g]["params"].append(global_position)
                    if local_id in local["state"]:
                        state[global_position] = local["state"][local_id]
        for g in groups:
            g["params"].sort()
        optimizers.append({"state": state, "param_groups": groups})
    merged["optimizer_states"] = optimizers
    return merged
