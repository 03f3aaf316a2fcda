"""Pipeline stages without Lightning: cutting a sequential model into stages, running them with
``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B), owning and exchanging their parameters, and
merging their checkpoint files. :class:`~lightning_peft.strategies.PipelineStrategy` is the Lightning glue over it.

Papers: Huang et al. 2019, "GPipe" (arXiv:1811.06965): all forwards, then all backwards; Narayanan et al. 2019,
"PipeDream" (arXiv:1806.03377) and 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (arXiv:2104.04473): 1F1B (one forward, one backward in the steady state; at most ``p`` micro-batches
in flight) and interleaved 1F1B (``v`` stages per rank, a ``v`` times smaller bubble).

Bubble. With ``p`` pipeline ranks and ``m`` micro-batches of equal cost, the share of a step a rank is idle is
``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, and ``(p - 1) / (v * m + p - 1)`` with ``v`` stages per rank
(:func:`bubble_fraction`).

Pieces and stages. A `TransformerDecoder` is cut into ``embed_tokens``, ``layers.<i>``, ``norm``, ``lm_head``; a
`TransformerEncoder` into ``embeddings``, ``layers.<i>``, ``final_norm``; an ``nn.Sequential`` into its children
(:func:`pipeline_pieces`). :func:`split_pieces` cuts the pieces into consecutive stages, at named split points or
balanced by parameter count (:func:`lightning_peft.parallel.partition.balanced_cuts`). Stage ``s`` runs on rank
``s % ranks``.

Ownership. Every rank builds the whole model, then replaces the parameters of the stages it does not hold by
``meta`` tensors (:func:`free_parameters`; shapes kept, no storage). A parameter used by several ranks' stages
(tied input and output embeddings) stays on each of them; its gradient is summed across them
(:func:`sum_shared_gradients`), and the global gradient norm counts it once (:func:`clip_by_global_norm`).

Checkpoints. One file per rank, ``stage-<rank>.ckpt``, whose ``state_dict`` and optimizer states hold that rank's
parameters (keys as in the unsplit model) and whose ``"pipeline"`` entry records the split and each kept
parameter's position in the unsplit optimizer. :func:`consolidate_checkpoint` merges the files into one ordinary
checkpoint of the unsplit model.

Shapes: ``input_ids`` (B, L) with B divisible by ``num_microbatches``; a micro-batch is (B / m, L); between stages
travel the hidden states (B / m, L, H) and, if given, the attention mask (B / m, L).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_peft.parallel.partition import balanced_starts, unique_numel

__all__ = [
    "SCHEDULES", "STAGE_FILE", "Ownership", "Piece", "StageModule", "answering", "batch_size", "bubble_fraction",
    "build_schedule", "clip_by_global_norm", "consolidate_checkpoint", "free_parameters", "gather_on_rank",
    "keep_owned_parameters", "move_real_tensors", "ownership", "pipeline_pieces", "select_optimizer_state",
    "split_pieces", "sum_shared_gradients", "take_rows",
]


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


STAGE_FILE = "stage-{}.ckpt"


@dataclass
class Piece:
    """One cut of the sequential model: ``name`` (its module path, a valid split point), the module, and ``run``,
    which maps the carried tensors (hidden states first, then the attention mask if any) to the next ones."""

    name: str
    module: nn.Module
    run: Callable[[tuple[Tensor, ...]], tuple[Tensor, ...]]


def _padding_mask(mask: Tensor | None) -> Tensor | None:
    """The block's ``key_padding_mask`` (bool, True = real token) from a carried 0/1 mask; None when all real."""
    if mask is None:
        return None
    mask = mask.bool()
    return None if bool(mask.all()) else mask


def _layer_run(layer: nn.Module) -> Callable[[tuple[Tensor, ...]], tuple[Tensor, ...]]:
    def run(carry: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        mask = carry[1] if len(carry) > 1 else None
        return (layer(carry[0], key_padding_mask=_padding_mask(mask)), *carry[1:])

    return run


def _last_run(module: nn.Module) -> Callable[[tuple[Tensor, ...]], tuple[Tensor, ...]]:
    """A piece after the layers: applied to the hidden states; the mask is no longer carried."""
    return lambda carry: (module(carry[0]),)


def pipeline_pieces(model: nn.Module, input_names: Sequence[str] = ("input_ids",)) -> list[Piece]:
    """The sequence of pieces of ``model`` that stages are cut from.

    Args:
        model: A `TransformerDecoder`, a `TransformerEncoder` or an ``nn.Sequential``.
        input_names: The names of the tensors the first piece receives, in order (``input_ids`` first; then any of
            ``attention_mask`` and, for the encoder, ``token_type_ids``). An ``nn.Sequential`` takes one input.

    Returns:
        The pieces in execution order; running them one after the other computes ``model(*inputs)``.

    Raises:
        ValueError: If the model is a reversible or token-pruning stack (its layers do not compose one by one).
        TypeError: If the model is none of the supported kinds.
    """
    from lightning_peft.nn.transformer import TransformerDecoder, TransformerEncoder

    if isinstance(model, nn.Sequential):
        return [Piece(name, child, lambda carry, c=child: (c(*carry),)) for name, child in model.named_children()]
    if not isinstance(model, (TransformerDecoder, TransformerEncoder)):
        raise TypeError(
            f"PipelineStrategy: cannot cut {type(model).__name__} into stages; it splits TransformerDecoder, "
            "TransformerEncoder or nn.Sequential models. Point model_attribute at one of them, or wrap your layers "
            "in an nn.Sequential."
        )
    who = type(model).__name__
    if getattr(model, "reversible", False):
        raise ValueError(
            f"PipelineStrategy: the {who} is reversible (reversible=True): its layers run as one coupled sequence "
            "that cannot be cut between ranks; build it with reversible=False."
        )
    if getattr(model, "token_pruner", None) is not None:
        raise ValueError(
            f"PipelineStrategy: the {who} prunes tokens (token_pruner is set): the pruned sequence changes shape "
            "inside the stack, which a pipeline cannot send between stages; remove the token_pruner."
        )
    names = list(input_names)
    mask_at = names.index("attention_mask") if "attention_mask" in names else None

    def embed(carry: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        inputs = dict(zip(names, carry, strict=True))
        if isinstance(model, TransformerDecoder):
            x = model.embed_tokens(inputs["input_ids"])
        else:
            x = model.embeddings(inputs["input_ids"], inputs.get("token_type_ids"))
        return (x,) if mask_at is None else (x, carry[mask_at])

    first = "embed_tokens" if isinstance(model, TransformerDecoder) else "embeddings"
    pieces = [Piece(first, getattr(model, first), embed)]
    pieces += [Piece(f"layers.{i}", layer, _layer_run(layer)) for i, layer in enumerate(model.layers)]
    if isinstance(model, TransformerDecoder):
        pieces += [Piece("norm", model.norm, _last_run(model.norm)), Piece("lm_head", model.lm_head,
                                                                            _last_run(model.lm_head))]
    elif model.final_norm is not None:
        pieces.append(Piece("final_norm", model.final_norm, _last_run(model.final_norm)))
    return pieces


def split_pieces(
    pieces: Sequence[Piece], num_stages: int, split_points: Sequence[str] | None = None
) -> list[list[Piece]]:
    """Cuts ``pieces`` into ``num_stages`` consecutive, non-empty stages.

    Args:
        pieces: From `pipeline_pieces`.
        num_stages: How many stages.
        split_points: ``num_stages - 1`` piece names, in order; a new stage starts at each. ``None``: balanced by
            parameter count (the cut that minimises the largest stage).

    Raises:
        ValueError: If there are more stages than pieces, or a split point names no piece, repeats one, is out of
            order, or their number is not ``num_stages - 1``.

    Example:
        >>> from lightning_peft.nn import TransformerDecoder
        >>> pieces = pipeline_pieces(TransformerDecoder(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2))
        >>> [p.name for p in pieces]
        ['embed_tokens', 'layers.0', 'layers.1', 'norm', 'lm_head']
        >>> [[p.name for p in stage] for stage in split_pieces(pieces, 2, ["layers.1"])]
        [['embed_tokens', 'layers.0'], ['layers.1', 'norm', 'lm_head']]
    """
    names = [p.name for p in pieces]
    if num_stages > len(pieces):
        raise ValueError(
            f"PipelineStrategy(num_stages={num_stages}): more stages than layers to put in them; the model has "
            f"{len(pieces)} pieces ({', '.join(names)}). Use at most {len(pieces)} stages, or a deeper model."
        )
    if split_points is not None:
        points = list(split_points)
        if len(points) != num_stages - 1:
            raise ValueError(
                f"PipelineStrategy(split_points={points!r}): {num_stages} stages need {num_stages - 1} split points "
                "(each names the piece a new stage starts at)."
            )
        starts = []
        for point in points:
            if point not in names:
                raise ValueError(
                    f"PipelineStrategy(split_points={points!r}): {point!r} names no module of the sequence that is "
                    f"cut into stages; split points are: {', '.join(names[1:])}."
                )
            starts.append(names.index(point))
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ValueError(
                f"PipelineStrategy(split_points={points!r}): split points must follow the model's order without "
                f"repeats and leave the first stage non-empty (order: {', '.join(names)})."
            )
    else:
        starts = balanced_starts([unique_numel([p.module]) for p in pieces], num_stages)
    bounds = [0, *starts, len(pieces)]
    return [list(pieces[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class StageModule(nn.Module):
    """The pieces of one stage run in order; the last stage returns the hidden states / logits alone.

    A new schedule first runs every stage once to infer the shapes it sends, on uninitialised inputs (all but the
    first stage). That first call runs in eval mode and restores the random generators, so it leaves no trace: no
    BatchNorm statistics of garbage, no dropout draws that the real micro-batches would otherwise have had.
    """

    def __init__(self, pieces: list[Piece], is_last: bool, device: torch.device) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(p.module for p in pieces)
        self._runs = [p.run for p in pieces]
        self._is_last = is_last
        self._device = device
        self._inferring = True  # the schedule's shape inference is this module's first call

    def forward(self, *carry: Tensor) -> Tensor | tuple[Tensor, ...]:
        if not self._inferring:
            return self._run(carry)
        self._inferring = False
        modes = [(m, m.training) for m in self.modules()]
        devices = [self._device] if self._device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                self.eval()
                return self._run(carry)
        finally:
            for module, training in modes:
                module.training = training

    def _run(self, carry: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        for run in self._runs:
            carry = run(tuple(carry))
        return carry[0] if self._is_last or len(carry) == 1 else tuple(carry)


@contextlib.contextmanager
def answering(model: nn.Module, output: Any) -> Iterator[None]:
    """Inside, every call of ``model`` returns ``output`` (the pipeline computed it)."""
    model.forward = lambda *args, **kwargs: output  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        del model.forward


def batch_size(batch: Any) -> int:
    if isinstance(batch, Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return next(v.shape[0] for v in batch.values() if isinstance(v, Tensor) and v.dim() > 0)
    return batch_size(batch[0])


def take_rows(batch: Any, start: int, stop: int, size: int) -> Any:
    """Rows ``start:stop`` of every tensor of ``batch`` whose first dimension is the batch size."""
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == size else batch
    if isinstance(batch, dict):
        return type(batch)((k, take_rows(v, start, stop, size)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return type(batch)(take_rows(v, start, stop, size) for v in batch)
    return batch


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """Moves every parameter and buffer that is not a ``meta`` placeholder to ``device`` (in place, as ``.to``)."""
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for tensor in store.values():
                if tensor is not None and tensor.device.type != "meta" and tensor.device != device:
                    tensor.data = tensor.data.to(device)


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
        ValueError: If ``path`` holds no stage files.

    Example:
        >>> torch.save(consolidate_checkpoint("checkpoints/last.ckpt"), "last-merged.ckpt")  # doctest: +SKIP
    """
    directory = Path(path)
    files = sorted(directory.glob("stage-*.ckpt"), key=lambda f: int(f.stem.split("-")[1]))
    if not directory.is_dir() or not files:
        raise ValueError(
            f"consolidate_checkpoint({str(path)!r}): not a pipeline checkpoint directory (no stage-<rank>.ckpt files)."
        )
    parts = [torch.load(f, map_location="cpu", weights_only=weights_only) for f in files]
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


def bubble_fraction(schedule: str, num_stages: int, num_microbatches: int, ranks: int | None = None) -> float:
    """The idle share ``schedule`` predicts: ``(p - 1) / (v * m + p - 1)`` (``v = 1`` unless interleaved).

    Args:
        ranks: The number of pipeline processes ``p``; default: the number of stages (interleaved: half of it).

    Example:
        >>> bubble_fraction("gpipe", num_stages=2, num_microbatches=4)
        0.2
    """
    interleaved = schedule == "interleaved_1f1b"
    p = ranks if ranks is not None else (num_stages // 2 if interleaved else num_stages)
    v = num_stages // p if interleaved else 1
    return (p - 1) / (v * num_microbatches + p - 1)


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


def build_schedule(pieces: Sequence[Piece], split_names: Sequence[Sequence[str]], local_stages: Sequence[int],
                   device: torch.device, microbatches: int, loss_fn: Callable | None, one_f_one_b: bool) -> tuple:
    """``(schedule, stages)``: the `PipelineStage` objects of this rank's ``local_stages`` (``split_names[s]``
    names the pieces of stage ``s``) and the schedule over them: interleaved 1F1B for several local stages, else
    1F1B if ``one_f_one_b``, else GPipe. ``loss_fn`` None: forward only (``schedule.eval``)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    by_name = {p.name: p for p in pieces}
    num_stages = len(split_names)
    stages = []
    for index in local_stages:
        module = StageModule([by_name[n] for n in split_names[index]], index == num_stages - 1, device)
        stages.append(PipelineStage(module, index, num_stages, device))
    if len(stages) > 1:
        return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=False), stages
    kind = Schedule1F1B if one_f_one_b else ScheduleGPipe
    return kind(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False), stages


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
