"""What a callback must know about the running strategy: one answer, asked of the strategy, never guessed.

Callbacks meet strategies at three seams, and each has one function here:

- `data_parallel` -- the data-parallel size and rank. Not ``trainer.world_size`` / ``global_rank``: under
  [`PipelineStrategy`][lightning_peft.strategies.PipelineStrategy] every rank reads the same batch (size 1), under
  [`TensorParallelStrategy`][lightning_peft.strategies.TensorParallelStrategy] the ranks of one tensor-parallel group do
  (size ``world / tp``). Lightning's ``strategy.distributed_sampler_kwargs`` is the existing answer; a strategy without
  it (one device, the device map) is ``(1, 0)``.
- `strategy_family` -- where gradients live, as a short name: ``"plain"`` (``p.grad``, replicated: one
  device, DDP, native ZeRO-1, the pipeline's stages, the device map), ``"dtensor"`` (DTensor shards: FSDP2, tensor
  parallelism), ``"deepspeed"`` (the engine's own partitions; ``p.grad`` is None at stages 2 and 3). The pure half,
  reading and changing those gradients, is `lightning_peft._grads`.
- `refuse` -- what a strategy cannot run is refused at setup, naming the callback, the strategy and why,
  never run as a no-op that logs as if it had worked. A check whose answer can differ between ranks (it reads what
  one rank holds) decides with `refuse_together`, so that no rank goes on into a collective the others left.
"""

from __future__ import annotations

import atexit
from typing import Any, Literal

__all__ = ["Family", "data_parallel", "refuse", "refuse_together", "splits_layers", "strategy_family", "strategy_name",
           "tensor_parallel_size"]

Family = Literal["plain", "dtensor", "deepspeed"]


def data_parallel(strategy: Any) -> tuple[int, int]:
    """``(size, rank)`` of the data-parallel group this process belongs to: how many distinct batches one
    optimizer step sees, and which of them this process reads.

    Args:
        strategy: The trainer's strategy (``trainer.strategy``), after its environment is set up (from a
            callback's ``setup`` hook on).

    Examples:
        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> data_parallel(SingleDeviceStrategy("cpu"))
        (1, 0)
    """
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    if not kwargs:  # None for single-device strategies (the device map too)
        return 1, 0
    size, rank = int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))
    if size < 1 or not 0 <= rank < size:
        raise RuntimeError(
            f"{type(strategy).__name__}.distributed_sampler_kwargs = {kwargs}: expected 0 <= rank < num_replicas."
        )
    return size, rank


def strategy_name(strategy: Any) -> str:
    """The strategy as a user names it in an error: ``ZeROStrategy(stage=3, backend='deepspeed')``, ``DDPStrategy``."""
    describe = getattr(strategy, "_name", None)
    if callable(describe):
        return str(describe())
    return type(strategy).__name__


def strategy_family(strategy: Any) -> Family:
    """Where the trainable gradients live under ``strategy`` (see the module docstring)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

    if isinstance(strategy, DeepSpeedStrategy):
        return "deepspeed"
    if isinstance(strategy, ModelParallelStrategy):  # FSDP2 (native ZeRO 2/3) and tensor parallelism
        return "dtensor"
    return "plain"


def splits_layers(strategy: Any) -> bool:
    """Whether ``strategy`` keeps only some layers of the model on each rank (pipeline parallelism), so that no
    rank can run the whole model's forward by itself. Such a strategy sets ``splits_layers = True``."""
    return bool(getattr(strategy, "splits_layers", False))


def tensor_parallel_size(strategy: Any) -> int:
    """How many ranks split each layer's weights (attention heads, feed-forward columns); 1 when none do."""
    return int(getattr(strategy, "tensor_parallel_size", 1) or 1)


def refuse(who: str, strategy: Any, why: str, fix: str) -> RuntimeError:
    """The error a callback raises at setup for a strategy it cannot run under (raise what this returns).

    Examples:
        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> str(refuse("GradientNoise", SingleDeviceStrategy("cpu"), "it cannot", "remove one of them"))
        'GradientNoise under SingleDeviceStrategy: it cannot. Remove one of them.'
    """
    fix = fix[:1].upper() + fix[1:]
    return RuntimeError(f"{who} under {strategy_name(strategy)}: {why}. {fix}.")


def refuse_together(error: Exception | None) -> None:
    """Raises on every rank if any rank found ``error`` (the first such rank's, naming it); every rank must call.

    A refusal that only some ranks reach leaves the others waiting in their next collective for ever (a pipeline
    stage's send, a gradient all-reduce): one ``all_gather_object`` over the default process group decides for all.
    Without a process group, ``error`` is raised as it is.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if error is None else (type(error), str(error)))
    rank = next((r for r, e in enumerate(found) if e is not None), None)
    if rank is not None:
        kind, message = found[rank]
        raise kind(message if rank == dist.get_rank() else f"(found on rank {rank}) {message}")


def _destroy_process_group() -> None:
    """A gloo process group still alive when the interpreter finalises aborts the process after all the work is done
    ("terminate called without an active exception", exit 134: its threads are destroyed unjoined); Lightning never
    destroys the group it made. Destroyed at exit (registered when callbacks or strategies are imported), so a
    user's script that ends after a multi-process fit exits 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(_destroy_process_group)
