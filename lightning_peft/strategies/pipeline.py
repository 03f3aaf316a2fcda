"""Pipeline parallelism as a Lightning strategy, on ``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B).

Lightning has no pipeline strategy (pytorch-lightning issue 17180). `PipelineStrategy` splits the LightningModule's
sequential model into ``num_stages`` consecutive stages, one rank holding each (two or more with the interleaved
schedule), and runs every training batch as ``num_microbatches`` micro-batches through a pipeline schedule.

Papers: Huang et al. 2019, "GPipe" (arXiv:1811.06965): all forwards, then all backwards; Narayanan et al. 2019,
"PipeDream" (arXiv:1806.03377) and 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (arXiv:2104.04473): 1F1B (one forward, one backward in the steady state; at most ``p`` micro-batches
in flight) and interleaved 1F1B (``v`` stages per rank, a ``v`` times smaller bubble).

Bubble. With ``p`` pipeline ranks and ``m`` micro-batches of equal cost, the share of a step a rank is idle is
``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, and ``(p - 1) / (v * m + p - 1)`` with ``v`` stages per rank.

Contract with the LightningModule (nothing to change in it):

1. The sequential model is the submodule ``model_attribute`` (found automatically: the LightningModule's only child
   that is a `TransformerDecoder`, `TransformerEncoder` or ``nn.Sequential``). Its top-level sequence is cut into
   pieces (decoder: ``embed_tokens``, ``layers.<i>``, ``norm``, ``lm_head``; encoder: ``embeddings``,
   ``layers.<i>``, ``final_norm``; ``nn.Sequential``: its children), and the pieces into stages: at ``split_points``
   (a new stage starts at each named piece) or balanced by parameter count.
2. Batches are dicts (or a tensor, or a tuple whose first element is the input). The first stage receives the batch
   entries named like the sequential model's ``forward`` arguments (``input_ids``, ``attention_mask``,
   ``token_type_ids``); the attention mask travels with the hidden states from stage to stage.
3. On the last stage the LightningModule's own ``training_step`` is called once per micro-batch (on that slice of
   the batch) while the sequential model answers every call with the pipeline's output for the micro-batch; the
   loss it returns is what the schedule differentiates. So heads outside the sequential model (a classifier, a
   pooler) and the module's own loss work unchanged; their parameters belong to the last stage.
4. What that ``training_step`` logs is combined over the micro-batches as one process would log it for the whole
   batch (per ``reduce_fx``: the mean weighted by batch size, the sum, the max or min), broadcast from the last
   stage and logged on every rank with the whole batch's size; ``training_step`` returns the mean micro-batch loss
   on every rank. The gradient is that of the mean micro-batch loss, as with gradient accumulation (equal to the
   whole batch's for a per-sample mean loss and equal micro-batches); under a ``GradScaler`` the schedule
   differentiates the scaled loss, so Lightning's unscale gives it.
5. Validation and test run the pipeline forward (no micro-batch backward) and call ``validation_step`` /
   ``test_step`` on the last stage with the whole batch's output; logged metrics are replayed the same way
   (``torchmetrics`` states, zero on the other ranks, sum correctly when synced).

How it meets Lightning's loop. Lightning's automatic optimization runs ``training_step``, then ``zero_grad``, then
``backward``. A schedule's ``step`` does forward and backward together, so `PipelineStrategy.training_step` runs it
and sets the gradients aside, and `PipelineStrategy.backward` puts them back instead of differentiating (the
``on_before_backward`` / ``on_after_backward`` hooks still run). Gradient clipping by norm uses the global norm
over all stages.

Memory. Every rank builds the whole LightningModule, then replaces the parameters of the stages it does not hold
by ``meta`` tensors (shapes kept, no storage), and its optimizers only see its own parameters. A parameter used by
several ranks' stages (tied input and output embeddings) stays on each of them; its gradient is summed across them.

Checkpoints. A checkpoint is a directory with one file per rank, ``stage-<rank>.ckpt``: a complete Lightning
checkpoint whose ``state_dict`` and optimizer states hold that rank's parameters only (keys as in the unsplit
model). It resumes into the same split; `consolidate_checkpoint` merges the files into one ordinary checkpoint (the
unsplit model's ``state_dict`` and optimizer states) that loads into the unsplit model. Buffers (BatchNorm
statistics) are saved by the rank whose stage runs their module only. Exports (`MergeOnSave`) use
`PipelineStrategy.gathered_parameters`, which brings every stage's parameters to rank 0.

Shapes: ``input_ids`` (B, L) with B divisible by ``num_microbatches``; a micro-batch is (B / m, L); between stages
travel the hidden states (B / m, L, H) and, if given, the attention mask (B / m, L).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from typing_extensions import override

from lightning_peft.strategies.device_map import _balanced_cuts

__all__ = ["SCHEDULES", "Piece", "PipelineStrategy", "consolidate_checkpoint", "pipeline_pieces", "split_pieces"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_STAGE_FILE = "stage-{}.ckpt"


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


def _unique_numel(modules: Sequence[nn.Module]) -> int:
    seen: dict[int, int] = {}
    for module in modules:
        for p in module.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


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
        starts = _balanced_starts([_unique_numel([p.module]) for p in pieces], num_stages)
    bounds = [0, *starts, len(pieces)]
    return [list(pieces[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _balanced_starts(sizes: list[int], num_stages: int) -> list[int]:
    """Start indices of stages 1..k-1 minimising the largest stage's total size (the device map's partition)."""
    owner = _balanced_cuts(sizes, num_stages)  # stage of each piece
    return [i for i in range(1, len(owner)) if owner[i] != owner[i - 1]]


class _StageModule(nn.Module):
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
def _answering(model: nn.Module, output: Any) -> Iterator[None]:
    """Inside, every call of ``model`` returns ``output`` (the pipeline computed it)."""
    model.forward = lambda *args, **kwargs: output  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        del model.forward


_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


def _reduction(reduce_fx: Any) -> str:
    """Lightning's ``reduce_fx`` (a name or ``torch.mean`` / ``sum`` / ``max`` / ``min``) as one of those names."""
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
    return _REDUCTIONS.get(name, "mean")


class _LogRecorder:
    """Stands in for ``LightningModule.log`` while the last stage runs the module's steps; replays one value per
    name: what one process would log for the whole batch.

    Each call is weighted by its ``batch_size`` (or, as Lightning does, the size of the batch the step was given:
    ``self.batch``). Per ``reduce_fx``: ``mean`` gives the weighted mean of the calls, ``sum`` their sum, ``max`` /
    ``min`` their maximum / minimum; the replayed call carries the total batch size, so Lightning's epoch mean is
    weighted by samples, as on one process.
    """

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self.batch: Any = None  # the (micro-)batch the step being recorded was given
        self.calls: dict[str, dict[str, Any]] = {}
        self._names = {id(m): n for n, m in module.named_modules()}

    def __call__(self, name: str, value: Any, *args: Any, batch_size: int | None = None, **kwargs: Any) -> None:
        if args:
            raise TypeError(f"PipelineStrategy: log({name!r}, ...) got positional options {args!r}; pass them by name.")
        kind = _reduction(kwargs.get("reduce_fx", "mean"))
        entry = self.calls.setdefault(name, {"kwargs": kwargs, "value": None, "weight": 0, "metric": None,
                                             "kind": kind})
        if isinstance(value, nn.Module):  # a torchmetrics Metric: replayed as the same-named metric of every rank
            entry["metric"] = self._names[id(value)]
            return
        weight = batch_size if batch_size is not None else self._inferred_batch_size()
        number = float(value.detach().float() if isinstance(value, Tensor) else value)
        previous = entry["value"]
        if kind == "mean":
            number *= weight
        if previous is not None:
            number = {"mean": previous + number, "sum": previous + number, "max": max(previous, number),
                      "min": min(previous, number)}[kind]
        entry.update(value=number, weight=entry["weight"] + weight, kwargs=kwargs)

    def _inferred_batch_size(self) -> int:
        from lightning.pytorch.utilities.data import extract_batch_size

        try:
            return int(extract_batch_size(self.batch))
        except Exception:  # noqa: BLE001 -- no tensor to read a size from: Lightning's fallback, 1
            return 1

    @contextlib.contextmanager
    def recording(self, batch: Any = None) -> Iterator[None]:
        self.batch = batch
        self.module.log = self  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.module.log

    def summary(self) -> list[tuple[str, Any, dict[str, Any], int]]:
        out = []
        for name, entry in self.calls.items():
            if entry["metric"] is not None:
                out.append((name, ("metric", entry["metric"]), entry["kwargs"], 0))
            else:
                value = entry["value"] / max(entry["weight"], 1) if entry["kind"] == "mean" else entry["value"]
                out.append((name, value, entry["kwargs"], entry["weight"]))
        return out


def _replay(module: pl.LightningModule, calls: list[tuple[str, Any, dict[str, Any], int]]) -> None:
    """Logs the recorded values on every rank. They are the same on every rank (broadcast from the last stage), and
    the ranks of a pipeline are one data-parallel replica: ``sync_dist`` is dropped (it would sum a ``reduce_fx="sum"``
    value over the stages)."""
    modules = dict(module.named_modules())
    for name, value, kwargs, weight in calls:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("sync_dist", "sync_dist_group")}
        if isinstance(value, tuple):
            module.log(name, modules[value[1]], **kwargs)
        else:
            module.log(name, torch.tensor(value), batch_size=max(weight, 1), **kwargs)


def _batch_size(batch: Any) -> int:
    if isinstance(batch, Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return next(v.shape[0] for v in batch.values() if isinstance(v, Tensor) and v.dim() > 0)
    return _batch_size(batch[0])


def _take(batch: Any, start: int, stop: int, size: int) -> Any:
    """Rows ``start:stop`` of every tensor of ``batch`` whose first dimension is the batch size."""
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == size else batch
    if isinstance(batch, dict):
        return type(batch)((k, _take(v, start, stop, size)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(v, start, stop, size) for v in batch)
    return batch


class PipelineStrategy(DDPStrategy):
    """Pipeline parallelism on ``torch.distributed.pipelining``: GPipe, 1F1B and interleaved 1F1B schedules.

    See the module docstring for the contract with the LightningModule, checkpoints and exports. Every rank reads the
    same batches (the ranks of a pipeline form one data-parallel replica).

    Args:
        num_stages: Total number of stages. ``"gpipe"`` and ``"1f1b"``: one per rank, so equal to the number of
            processes; ``"interleaved_1f1b"``: a multiple (at least 2) of it, stage ``s`` on rank ``s % ranks``.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        num_microbatches: Micro-batches per batch; must divide the batch size.
        split_points: Names of the pieces where stages 2, 3, ... start (``["layers.2"]``: the boundary before
            ``layers.2``); ``None`` balances the stages by parameter count.
        model_attribute: The LightningModule's attribute holding the sequential model (``"decoder"``); ``None``
            finds it.
        process_group_backend: ``"gloo"`` or ``"nccl"``; ``None`` picks the accelerator's.
        max_schedules: How many schedules (one per batch shape: training or evaluation, micro-batches, input
            shapes) are kept; the least recently used is dropped beyond that, so dynamic padding does not grow
            memory without bound (pad to a few lengths to avoid rebuilding them).

    Raises:
        ValueError: If an argument is out of range or the schedule unknown.

    Example:
        >>> strategy = PipelineStrategy(num_stages=2, schedule="gpipe", num_microbatches=4, split_points=["layers.2"])
        >>> strategy.bubble_fraction()
        0.2
    """

    splits_layers = True  # each rank holds only its stages (lightning_peft._seams.splits_layers)

    strategy_name = "pipeline"

    def __init__(
        self,
        num_stages: int = 2,
        schedule: str = "1f1b",
        num_microbatches: int = 4,
        split_points: list[str] | None = None,
        model_attribute: str | None = None,
        process_group_backend: str | None = None,
        max_schedules: int = 8,
        **kwargs: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, **kwargs)
        for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                            ("max_schedules", max_schedules)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineStrategy({name}={value!r}): must be a positive integer.")
        if num_stages < 2:
            raise ValueError(
                f"PipelineStrategy(num_stages={num_stages}): a pipeline needs at least 2 stages; for one process use "
                "the default strategy."
            )
        if schedule not in SCHEDULES:
            raise ValueError(
                f"PipelineStrategy(schedule={schedule!r}): unknown schedule; choose one of "
                f"{', '.join(repr(s) for s in SCHEDULES)}."
            )
        if split_points is not None and (
            isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points)
        ):
            raise ValueError(
                f"PipelineStrategy(split_points={split_points!r}): give a list of module names, e.g. ['layers.2']."
            )
        self.num_stages = num_stages
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.split_points = None if split_points is None else list(split_points)
        self.model_attribute = model_attribute
        self.max_schedules = max_schedules
        self._sequential: nn.Module | None = None
        self._attribute = model_attribute
        self._split_names: list[list[str]] = []
        self._owned: set[int] = set()
        self._foreign_buffers: set[str] = set()  # state-dict keys of buffers other ranks' stages update
        self._foreign_buffer_ids: set[int] = set()
        self._shared_groups: list[tuple[list[int], list[nn.Parameter], Any]] = []
        self._schedules: OrderedDict[Any, Any] = OrderedDict()  # most recently used last
        self._stashed: dict[nn.Parameter, Tensor] | None = None
        self._inference_calls = 0
        self._current_microbatches = num_microbatches
        self._optimizer_positions: list[list[list[int]]] = []
        self.last_step_seconds: float | None = None  # wall time of the last training schedule.step

    def bubble_fraction(self, ranks: int | None = None) -> float:
        """The idle share the schedule predicts: ``(p - 1) / (v * m + p - 1)`` (``v = 1`` unless interleaved).

        Args:
            ranks: The number of pipeline processes ``p``; default: the number of stages (interleaved: half of it).
        """
        interleaved = self.schedule == "interleaved_1f1b"
        p = ranks if ranks is not None else (self.num_stages // 2 if interleaved else self.num_stages)
        v = self.num_stages // p if interleaved else 1
        return (p - 1) / (v * self.num_microbatches + p - 1)

    # ------------------------------------------------------------------ setup
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # every stage reads the same batch

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.precision_plugin.convert_module(module)
        self._check_world()
        self._split(module)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._keep_own_parameters_in_optimizers()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            from lightning.fabric.utilities.optimizer import _optimizers_to_device

            _optimizers_to_device(self.optimizers, self.root_device)
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        self._agree_on_overflow()

    def _agree_on_overflow(self) -> None:
        """Under a ``GradScaler`` (``16-mixed``), every rank skips the step (and lowers the scale) when any stage's
        gradients overflowed, as DDP's all-reduced gradients make it; else the stages would drift apart."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or getattr(scaler, "_lightning_peft_pipeline", False) or not dist.is_initialized():
            return
        unscale = scaler.unscale_
        device = self.root_device

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

    def _check_world(self) -> None:
        world = self.world_size
        if self.schedule == "interleaved_1f1b":
            if self.num_stages % world or self.num_stages // world < 2:
                raise ValueError(
                    f"PipelineStrategy(num_stages={self.num_stages}, schedule='interleaved_1f1b'): the interleaved "
                    f"schedule puts several stages on each of the {world} processes; use num_stages = {2 * world}, "
                    f"{3 * world}, ..."
                )
            rounds = max(1, self.num_microbatches // world)
            if self.num_microbatches % rounds:
                raise ValueError(
                    f"PipelineStrategy(num_microbatches={self.num_microbatches}, schedule='interleaved_1f1b'): "
                    f"with {world} processes the micro-batches must be a multiple of {rounds}."
                )
        elif self.schedule == "1f1b" and self.num_microbatches < self.num_stages:
            raise ValueError(
                f"PipelineStrategy(num_microbatches={self.num_microbatches}, schedule='1f1b'): 1F1B needs at least as "
                f"many micro-batches as stages ({self.num_stages}); raise num_microbatches or use schedule='gpipe'."
            )
        if self.schedule != "interleaved_1f1b" and self.num_stages != world:
            raise ValueError(
                f"PipelineStrategy(num_stages={self.num_stages}, schedule={self.schedule!r}): this schedule runs one "
                f"stage per process and there are {world} processes; set num_stages={world}, or "
                f"Trainer(devices={self.num_stages}), or schedule='interleaved_1f1b' for several stages per process."
            )

    def _find_sequential(self, module: pl.LightningModule) -> tuple[str, nn.Module]:
        from lightning_peft.nn.transformer import TransformerDecoder, TransformerEncoder

        kinds = (TransformerDecoder, TransformerEncoder, nn.Sequential)
        if self.model_attribute is not None:
            found = module.get_submodule(self.model_attribute) if self.model_attribute else module
            return self.model_attribute, found
        children = [(n, c) for n, c in module.named_children() if isinstance(c, kinds)]
        if len(children) != 1:
            raise ValueError(
                f"PipelineStrategy(model_attribute=None): {type(module).__name__} has "
                f"{'no' if not children else len(children)} TransformerDecoder / TransformerEncoder / nn.Sequential "
                f"children{' (' + ', '.join(n for n, _ in children) + ')' if children else ''}; name the one to "
                "split with model_attribute='...'."
            )
        return children[0]

    def _stage_ranks(self) -> list[int]:
        return [s % self.world_size for s in range(self.num_stages)]

    def _local_stages(self) -> list[int]:
        return [s for s, r in enumerate(self._stage_ranks()) if r == self.global_rank]

    def _split(self, module: pl.LightningModule) -> None:
        """Cuts the sequential model into stages and frees the parameters of the stages other ranks hold."""
        self._attribute, self._sequential = self._find_sequential(module)
        sequential = self._sequential
        pieces = pipeline_pieces(sequential)
        stages = split_pieces(pieces, self.num_stages, self._relative(self.split_points))
        self._split_names = [[p.name for p in stage] for stage in stages]
        ranks = self._stage_ranks()
        owners: dict[int, set[int]] = {}
        for index, stage in enumerate(stages):
            for piece in stage:
                for p in piece.module.parameters():
                    owners.setdefault(id(p), set()).add(ranks[index])
        last = ranks[-1]
        for p in module.parameters():  # heads outside the sequence (a classifier, a pooler) run on the last stage
            owners.setdefault(id(p), {last})
        self._owned = {i for i, rs in owners.items() if self.global_rank in rs}
        # Buffers (BatchNorm statistics) stay on every rank, but only the stages that run a module update its
        # buffers: only they save them (and a consolidated checkpoint takes each from its owner).
        buffer_owners: dict[int, set[int]] = {}
        for index, stage in enumerate(stages):
            for piece in stage:
                for b in piece.module.buffers():
                    buffer_owners.setdefault(id(b), set()).add(ranks[index])
        foreign = [(name, b) for name, b in module.named_buffers(remove_duplicate=False)
                   if self.global_rank not in buffer_owners.get(id(b), {last})]
        self._foreign_buffers = {name for name, _ in foreign}
        self._foreign_buffer_ids = {id(b) for _, b in foreign}
        _free_parameters(module, self._owned)
        params = {id(p): p for p in module.parameters()}
        groups: dict[tuple[int, ...], list[int]] = {}
        for pid, rs in owners.items():
            if len(rs) > 1:
                groups.setdefault(tuple(sorted(rs)), []).append(pid)
        self._shared_groups = []
        for rs, pids in sorted(groups.items()):
            group = dist.new_group(list(rs)) if dist.is_initialized() else None  # every rank creates every group
            if self.global_rank in rs:
                self._shared_groups.append((list(rs), [params[i] for i in pids], group))
        self._schedules = OrderedDict()

    def _relative(self, points: list[str] | None) -> list[str] | None:
        if points is None or not self._attribute:
            return points
        prefix = self._attribute + "."
        return [p[len(prefix):] if p.startswith(prefix) else p for p in points]

    def _forward_names(self, batch: Any = None) -> list[str]:
        """The batch entries the first stage takes: those named like the sequential model's forward arguments."""
        if isinstance(self._sequential, nn.Sequential) or batch is None:
            return ["input"]
        if not isinstance(batch, dict):
            return ["input_ids"]
        accepted = inspect.signature(self._sequential.forward).parameters
        return [k for k in accepted if k in batch and isinstance(batch[k], Tensor) and k != "position_ids"]

    @override
    def model_to_device(self) -> None:
        _move_real_tensors(self.lightning_module, self.root_device)

    def _keep_own_parameters_in_optimizers(self) -> None:
        """Drops the other ranks' (meta) parameters from every optimizer; remembers the kept ones' positions."""
        self._optimizer_positions = []
        for optimizer in self.optimizers:
            positions, index = [], 0
            for group in optimizer.param_groups:
                kept = []
                for p in group["params"]:
                    if id(p) in self._owned:
                        kept.append(index)
                    index += 1
                positions.append(kept)
                group["params"] = [p for p in group["params"] if id(p) in self._owned]
            self._optimizer_positions.append(positions)

    # ------------------------------------------------------------------ running the schedule
    def _pipeline(self, batch: Any, training: bool, microbatches: int) -> tuple[Any, list[Any]]:
        """The schedule and this rank's `PipelineStage` objects for batches like ``batch`` (built once per shape).

        Evaluation runs forward only, with GPipe (the interleaved schedule where a rank holds several stages); a
        batch with fewer micro-batches than 1F1B needs (the short last batch of an epoch) runs under GPipe too.
        """
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        names = self._forward_names(batch)
        inputs = self._inputs(batch, names)
        key = (training, microbatches, tuple(names), tuple((tuple(t.shape), t.dtype) for t in inputs))
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        while len(self._schedules) >= self.max_schedules:  # every rank sees the same shapes: the same evictions
            self._schedules.popitem(last=False)
        pieces = pipeline_pieces(self._sequential, names)
        by_name = {p.name: p for p in pieces}
        stages = []
        for index in self._local_stages():
            module = _StageModule([by_name[n] for n in self._split_names[index]], index == self.num_stages - 1,
                                  self.root_device)
            stages.append(PipelineStage(module, index, self.num_stages, self.root_device))
        loss_fn = self._loss_fn if training else None
        if len(stages) > 1:
            schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            one_f_one_b = training and self.schedule == "1f1b" and microbatches >= self.num_stages
            kind = Schedule1F1B if one_f_one_b else ScheduleGPipe
            schedule = kind(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
        self._schedules[key] = (schedule, stages)
        # A new schedule first infers the shapes of gradients by calling the loss once on the last stage, on an
        # uninitialised output; that call is not a micro-batch of the step and does not reach training_step.
        self._inference_calls = int(training and self._is_last_rank())
        return schedule, stages

    def _inputs(self, batch: Any, names: list[str]) -> list[Tensor]:
        """A tensor batch is the input; a tuple's first element; a dict's entries named like the forward's arguments
        (an ``nn.Sequential`` takes ``input_ids`` or ``input``)."""
        if isinstance(batch, Tensor):
            return [batch]
        if not isinstance(batch, dict):
            return [batch[0]]
        if names == ["input"]:
            key = next((k for k in ("input_ids", "input") if k in batch), None)
            if key is None:
                raise ValueError(
                    f"PipelineStrategy: the batch has no 'input_ids' or 'input' entry for the nn.Sequential model "
                    f"(keys: {', '.join(batch)})."
                )
            return [batch[key]]
        return [batch[n] for n in names]

    def _first_stage_inputs(self, batch: Any) -> list[Tensor]:
        """The first stage's inputs on the rank that holds it; nothing elsewhere (the others receive activations)."""
        return self._inputs(batch, self._forward_names(batch)) if 0 in self._local_stages() else []

    def _microbatches(self, batch: Any, training: bool, batch_idx: int = 0) -> tuple[int, int]:
        """``(batch size, micro-batches)``: ``num_microbatches``, or for a batch it does not divide, the largest
        divisor of both when the batch is an evaluation batch or the epoch's last (short) training batch.

        Raises:
            ValueError: If ``num_microbatches`` does not divide a full training batch.
        """
        size = _batch_size(batch)
        m = self.num_microbatches
        if size % m == 0:
            return size, m
        last = training and batch_idx > 0 and batch_idx == self.lightning_module.trainer.num_training_batches - 1
        if not training or last:
            return size, math.gcd(size, m)
        raise ValueError(
            f"PipelineStrategy(num_microbatches={m}): the micro-batches do not divide the batch of {size} samples; "
            f"use a batch size that is a multiple of {m}, or change num_microbatches."
        )

    def _is_last_rank(self) -> bool:
        return self.global_rank == self._stage_ranks()[-1]

    def _loss_fn(self, output: Tensor, rows: Tensor) -> Tensor:
        """The LightningModule's ``training_step`` on one micro-batch (``rows`` index the batch), with the sequential
        model answering the pipeline's ``output``; returns the loss scaled for the mean over micro-batches."""
        if self._inference_calls > 0:  # shape inference: any loss that depends on the output will do
            self._inference_calls -= 1
            return sum(t.float().sum() * 0.0 for t in torch.utils._pytree.tree_leaves(output)
                       if isinstance(t, Tensor) and t.is_floating_point())
        start, stop = int(rows[0]), int(rows[-1]) + 1
        micro = _take(self._batch, start, stop, self._size)
        with _answering(self._sequential, output), self._recorder.recording(micro):
            out = self.lightning_module.training_step(micro, self._batch_idx)
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, Tensor):
            raise RuntimeError(
                "PipelineStrategy: training_step must return the loss tensor (or a dict with 'loss') on every "
                f"micro-batch; it returned {type(out).__name__}."
            )
        self._losses.append(loss.detach().float())
        loss = loss / (self._current_microbatches * self.lightning_module.trainer.accumulate_grad_batches)
        scaler = getattr(self.precision_plugin, "scaler", None)  # a GradScaler unscales what the schedule computes
        return scaler.scale(loss) if scaler is not None else loss

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a checkpoint is read after the split: each rank reads its own stage's file

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Runs the schedule (forward and backward of every micro-batch); returns the mean micro-batch loss."""
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self._size, self._current_microbatches = self._microbatches(batch, True, batch_idx)
        self._batch, self._batch_idx, self._losses = batch, batch_idx, []
        self._recorder = _LogRecorder(self.lightning_module)
        schedule, _ = self._pipeline(batch, True, self._current_microbatches)
        before = {p: p.grad for p in self.lightning_module.parameters() if id(p) in self._owned}
        for p in before:
            p.grad = None
        started = time.perf_counter()
        with self.precision_plugin.train_step_context():
            schedule.step(*self._first_stage_inputs(batch), target=torch.arange(self._size, device=self.root_device))
        self.last_step_seconds = time.perf_counter() - started
        self._sum_shared_gradients()
        self._stashed = {}
        for p, old in before.items():  # the earlier gradients stay; Lightning zeroes them or accumulates onto them
            if p.grad is not None:
                self._stashed[p] = p.grad
            p.grad = old
        loss, calls = self._from_last_stage()
        _replay(self.lightning_module, calls)
        self._batch = None
        return loss

    def _from_last_stage(self) -> tuple[Tensor, list[Any]]:
        """The mean micro-batch loss and the recorded logs, broadcast from the last stage's rank."""
        payload: list[Any] = [None]
        if self._is_last_rank():
            payload = [(float(torch.stack(self._losses).mean()) if self._losses else None, self._recorder.summary())]
        if dist.is_initialized():
            dist.broadcast_object_list(payload, src=self._stage_ranks()[-1])
        loss, calls = payload[0]
        return (torch.tensor(loss, device=self.root_device) if loss is not None else None), calls

    def _sum_shared_gradients(self) -> None:
        for _, params, group in self._shared_groups:
            for p in params:
                if not p.requires_grad:  # frozen (a LoRA base): no gradient anywhere
                    continue
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad, group=group)
                p.grad = grad

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already differentiated: puts the gradients it computed back (see the module docstring)."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in (self._stashed or {}).items():
            p.grad = grad if p.grad is None else p.grad + grad
        self._stashed = None
        return self.precision_plugin.post_backward(closure_loss, module)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clips by the global gradient norm over all stages (a shared parameter counted once)."""
        counted = {id(p) for _, params, _ in self._shared_groups for p in params}
        lead = {id(p) for rs, params, _ in self._shared_groups if rs[0] == self.global_rank for p in params}
        grads, squares = [], torch.zeros((), dtype=torch.float64, device=self.root_device)
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

    def _evaluate(self, step: str, *args: Any, **kwargs: Any) -> Any:
        batch = args[0]
        schedule, _ = self._pipeline(batch, False, self._microbatches(batch, False)[1])
        output = schedule.eval(*self._first_stage_inputs(batch))
        recorder = _LogRecorder(self.lightning_module)
        result = None
        if self._is_last_rank():
            with _answering(self._sequential, output), recorder.recording(batch):
                result = getattr(self.lightning_module, step)(*args, **kwargs)
        payload = [recorder.summary()]
        if dist.is_initialized():
            dist.broadcast_object_list(payload, src=self._stage_ranks()[-1])
        _replay(self.lightning_module, payload[0])
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluate("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluate("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        raise RuntimeError(
            "PipelineStrategy does not run predict: consolidate the checkpoint (consolidate_checkpoint) and predict "
            "with the unsplit model on one process."
        )

    # ------------------------------------------------------------------ exports
    @contextlib.contextmanager
    def gathered_parameters(
        self, module: nn.Module, params: Sequence[nn.Parameter] | None = None
    ) -> Iterator[nn.Module]:
        """Inside, the chosen parameters of ``module`` (default: all, and then its buffers too) hold their full
        values on global rank 0.

        Every rank must enter (it runs collectives). The other ranks' parameters are sent to rank 0 and swapped in
        for its ``meta`` placeholders, and the buffers of the stages rank 0 does not run for its stale copies; on
        exit the placeholders and copies are put back.
        """
        chosen = None if params is None else {id(p) for p in params}
        ordered = [p for _, p in module.named_parameters() if chosen is None or id(p) in chosen]
        buffers = [b for _, b in module.named_buffers()] if chosen is None else []
        mine = ({i: p.detach().cpu() for i, p in enumerate(ordered) if p.device.type != "meta"},
                {i: b.detach().cpu() for i, b in enumerate(buffers) if id(b) not in self._foreign_buffer_ids})
        gathered: list[Any] = [None] * self.world_size if self.global_rank == 0 else None
        if dist.is_initialized():
            dist.gather_object(mine, gathered, dst=0)
        else:
            gathered = [mine]
        swapped: list[tuple[dict[str, Any], str, Tensor]] = []
        try:
            if self.global_rank == 0:
                full: dict[int, Tensor] = {}
                for part, buffer_part in gathered:
                    for i, tensor in part.items():
                        p = ordered[i]
                        if p.device.type == "meta" and id(p) not in full:
                            full[id(p)] = nn.Parameter(tensor.to(self.root_device), p.requires_grad)
                    for i, tensor in buffer_part.items():
                        b = buffers[i]
                        if id(b) in self._foreign_buffer_ids and id(b) not in full:
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

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and the buffers of the stages it runs (the other stages' are stale copies)."""
        state = self.lightning_module.state_dict()
        return {k: v for k, v in state.items()
                if not (isinstance(v, Tensor) and v.device.type == "meta") and k not in self._foreign_buffers}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Writes ``filepath/stage-<rank>.ckpt`` on every rank (see the module docstring)."""
        directory = Path(filepath)
        if self.is_global_zero and directory.is_file():
            directory.unlink()
        self.barrier("pipeline_checkpoint_dir")
        directory.mkdir(parents=True, exist_ok=True)
        checkpoint = {**checkpoint, "pipeline": {
            "rank": self.global_rank, "world_size": self.world_size, "num_stages": self.num_stages,
            "schedule": self.schedule, "model_attribute": self._attribute, "stages": self._split_names,
            "optimizer_positions": self._optimizer_positions,
        }}
        self.checkpoint_io.save_checkpoint(checkpoint, directory / _STAGE_FILE.format(self.global_rank),
                                           storage_options=storage_options)
        self.barrier("pipeline_checkpoint_saved")

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """This rank's stage file of a pipeline checkpoint directory, or a whole (unsplit) checkpoint file."""
        path = Path(checkpoint_path)
        if path.is_dir():
            own = path / _STAGE_FILE.format(self.global_rank)
            if not own.exists():
                raise ValueError(
                    f"PipelineStrategy: {str(path)!r} has no {own.name}; it was written by a pipeline of another size. "
                    "Merge it with consolidate_checkpoint() and load the merged file."
                )
            checkpoint = self.checkpoint_io.load_checkpoint(own, weights_only=weights_only)
            saved = checkpoint.get("pipeline", {})
            if saved.get("stages") != self._split_names:
                raise ValueError(
                    f"PipelineStrategy: {str(path)!r} was saved with stages {saved.get('stages')} but this run "
                    f"splits the model as {self._split_names}; use the same num_stages and split_points, or merge "
                    "the checkpoint with consolidate_checkpoint()."
                )
            return checkpoint
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        checkpoint["optimizer_states"] = [  # a whole checkpoint: keep this rank's parameters' states
            _select_optimizer_state(state, positions)
            for state, positions in zip(checkpoint.get("optimizer_states", []), self._optimizer_positions, strict=False)
        ]
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        meta = {k for k, v in module.state_dict().items() if isinstance(v, Tensor) and v.device.type == "meta"}
        state = {k: v for k, v in checkpoint["state_dict"].items() if k not in meta}
        missing, unexpected = module.load_state_dict(state, strict=False)
        missing = [k for k in missing if k not in meta and k not in self._foreign_buffers]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"PipelineStrategy: the checkpoint does not fit this stage: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}."
            )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        """Lightning's teardown, except that only this rank's parameters move to the CPU (the others are meta)."""
        from lightning.fabric.utilities.optimizer import _optimizers_to_device

        self._schedules = OrderedDict()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.lightning_module is not None:
            _move_real_tensors(self.lightning_module, torch.device("cpu"))
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


def _move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """Moves every parameter and buffer that is not a ``meta`` placeholder to ``device`` (in place, as ``.to``)."""
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for tensor in store.values():
                if tensor is not None and tensor.device.type != "meta" and tensor.device != device:
                    tensor.data = tensor.data.to(device)


def _free_parameters(module: nn.Module, owned: set[int]) -> None:
    """Replaces every parameter whose id is not in ``owned`` by a ``meta`` parameter of the same shape."""
    placeholders: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or id(p) in owned or p.device.type == "meta":
                continue
            if id(p) not in placeholders:
                placeholders[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            sub._parameters[name] = placeholders[id(p)]


def _select_optimizer_state(state: dict[str, Any], positions: list[list[int]]) -> dict[str, Any]:
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


StrategyRegistry.register(
    "pipeline", PipelineStrategy, description="Pipeline parallelism, 1F1B schedule (torch.distributed.pipelining)",
    override=True,
)
StrategyRegistry.register(
    "pipeline_gpipe", PipelineStrategy, description="Pipeline parallelism, GPipe schedule", override=True,
    schedule="gpipe",
)
StrategyRegistry.register(
    "pipeline_interleaved", PipelineStrategy, description="Pipeline parallelism, interleaved 1F1B (2 stages per rank)",
    override=True, schedule="interleaved_1f1b", num_stages=4,
)
