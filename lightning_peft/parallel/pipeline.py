"""Pipeline stages without Lightning: cutting a sequential model into stages, running them with
``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B), owning and exchanging their parameters, and merging
their checkpoint files. [`PipelineStrategy`][lightning_peft.strategies.PipelineStrategy] is the Lightning glue over it.

Papers: Huang et al. 2019, "GPipe" (arXiv:1811.06965): all forwards, then all backwards; Narayanan et al. 2019,
"PipeDream" (arXiv:1806.03377) and 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (arXiv:2104.04473): 1F1B (one forward, one backward in the steady state; at most ``p`` micro-batches
in flight) and interleaved 1F1B (``v`` stages per rank, a ``v`` times smaller bubble).

Bubble. With ``p`` pipeline ranks and ``m`` micro-batches of equal cost, the share of a step a rank is idle is
``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, and ``(p - 1) / (v * m + p - 1)`` with ``v`` stages per rank
(`bubble_fraction`).

Pieces and stages. A `TransformerDecoder` is cut into ``embed_tokens``, ``layers.<i>``, ``norm``, ``lm_head``; a
`TransformerEncoder` into ``embeddings``, ``layers.<i>``, ``final_norm``; an ``nn.Sequential`` into its children
(`pipeline_pieces`). `split_pieces` cuts the pieces into consecutive stages, at named split points or
balanced by parameter count (`lightning_peft.parallel.partition.balanced_cuts`). Stage ``s`` runs on rank
``s % ranks``.

What each rank holds and exchanges (parameters, shared gradients, checkpoint files):
`lightning_peft.parallel.pipeline_state`.

Shapes: ``input_ids`` (B, L) with B divisible by ``num_microbatches``; a micro-batch is (B / m, L); between stages
travel the hidden states (B / m, L, H) and, if given, the attention mask (B / m, L).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_peft.parallel.partition import balanced_starts, unique_numel

__all__ = [
    "SCHEDULES", "Piece", "StageModule", "answering", "batch_size", "bubble_fraction", "build_schedule",
    "check_schedule", "find_sequential", "forward_names", "pipeline_pieces", "split_pieces", "stage_inputs",
    "take_rows",
]


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


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
        ValueError: If the model is a reversible or token-pruning stack (its layers do not compose one by one), or
            the inputs are a packed batch (``cu_seqlens``).
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
    if "cu_seqlens" in names:  # the stages carry hidden states and a padding mask only: attention would cross rows
        raise ValueError(
            f"PipelineStrategy: the batch is packed (cu_seqlens) but the pipeline stages of a {who} carry no "
            "sequence boundaries between ranks, so attention would cross the packed rows. Use padded batches "
            "(SFTDataModule(packing=False)) with PipelineStrategy."
        )
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
        # the head's piece ends with the decoder's logit soft-cap, if any (Gemma 2), as the decoder's forward does
        head = model.lm_head
        pieces += [Piece("norm", model.norm, _last_run(model.norm)),
                   Piece("lm_head", head, lambda carry: (model.cap_logits(head(carry[0])),))]
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

    Examples:
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


def bubble_fraction(schedule: str, num_stages: int, num_microbatches: int, ranks: int | None = None) -> float:
    """The idle share ``schedule`` predicts: ``(p - 1) / (v * m + p - 1)`` (``v = 1`` unless interleaved).

    Args:
        ranks: The number of pipeline processes ``p``; default: the number of stages (interleaved: half of it).

    Examples:
        >>> bubble_fraction("gpipe", num_stages=2, num_microbatches=4)
        0.2
    """
    interleaved = schedule == "interleaved_1f1b"
    p = ranks if ranks is not None else (num_stages // 2 if interleaved else num_stages)
    v = num_stages // p if interleaved else 1
    return (p - 1) / (v * num_microbatches + p - 1)


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


def check_schedule(schedule: str, num_stages: int, num_microbatches: int, world: int) -> None:
    """Refuse a schedule that cannot run ``num_stages`` stages and ``num_microbatches`` on ``world`` processes."""
    if schedule == "interleaved_1f1b":
        if num_stages % world or num_stages // world < 2:
            raise ValueError(
                f"PipelineStrategy(num_stages={num_stages}, schedule='interleaved_1f1b'): the interleaved "
                f"schedule puts several stages on each of the {world} processes; use num_stages = {2 * world}, "
                f"{3 * world}, ..."
            )
        rounds = max(1, num_microbatches // world)
        if num_microbatches % rounds:
            raise ValueError(
                f"PipelineStrategy(num_microbatches={num_microbatches}, schedule='interleaved_1f1b'): "
                f"with {world} processes the micro-batches must be a multiple of {rounds}."
            )
    elif schedule == "1f1b" and num_microbatches < num_stages:
        raise ValueError(
            f"PipelineStrategy(num_microbatches={num_microbatches}, schedule='1f1b'): 1F1B needs at least as "
            f"many micro-batches as stages ({num_stages}); raise num_microbatches or use schedule='gpipe'."
        )
    if schedule != "interleaved_1f1b" and num_stages != world:
        raise ValueError(
            f"PipelineStrategy(num_stages={num_stages}, schedule={schedule!r}): this schedule runs one "
            f"stage per process and there are {world} processes; set num_stages={world}, or "
            f"Trainer(devices={num_stages}), or schedule='interleaved_1f1b' for several stages per process."
        )


def find_sequential(module: nn.Module, attribute: str | None) -> tuple[str, nn.Module]:
    """``(name, model)``: the sequential model to cut, ``attribute`` of ``module`` or, for None, its only child that
    is a `TransformerDecoder`, `TransformerEncoder` or ``nn.Sequential``."""
    from lightning_peft.nn.transformer import TransformerDecoder, TransformerEncoder

    kinds = (TransformerDecoder, TransformerEncoder, nn.Sequential)
    if attribute is not None:
        found = module.get_submodule(attribute) if attribute else module
        return attribute, found
    children = [(n, c) for n, c in module.named_children() if isinstance(c, kinds)]
    if len(children) != 1:
        raise ValueError(
            f"PipelineStrategy(model_attribute=None): {type(module).__name__} has "
            f"{'no' if not children else len(children)} TransformerDecoder / TransformerEncoder / nn.Sequential "
            f"children{' (' + ', '.join(n for n, _ in children) + ')' if children else ''}; name the one to "
            "split with model_attribute='...'."
        )
    return children[0]


def forward_names(sequential: nn.Module, batch: Any = None) -> list[str]:
    """The batch entries the first stage takes: those named like the sequential model's forward arguments."""
    if isinstance(sequential, nn.Sequential) or batch is None:
        return ["input"]
    if not isinstance(batch, dict):
        return ["input_ids"]
    accepted = inspect.signature(sequential.forward).parameters
    return [k for k in accepted if k in batch and isinstance(batch[k], Tensor) and k != "position_ids"]


def stage_inputs(batch: Any, names: list[str]) -> list[Tensor]:
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


