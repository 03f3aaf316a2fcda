"""Pipeline parallelism as a Lightning strategy, on ``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B).

Lightning has no pipeline strategy (pytorch-lightning issue 17180). `PipelineStrategy` splits the LightningModule's
sequential model into ``num_stages`` consecutive stages, one rank holding each (two or more with the interleaved
schedule), and runs every training batch as ``num_microbatches`` micro-batches through a pipeline schedule.

This is the Lightning glue. The pieces, stages and schedules are pure torch in `lightning_peft.parallel.pipeline`
(papers, the bubble formula and shapes are there); what each rank holds and exchanges, and merging the stage files,
in `lightning_peft.parallel.pipeline_state`.

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

"""

from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
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

from lightning_peft._checkpoint_io import AtomicCheckpoints, save_folder
from lightning_peft._checks import integer, names
from lightning_peft.parallel.pipeline import (
    SCHEDULES,
    answering,
    batch_size,
    bubble_fraction,
    build_schedule,
    check_schedule,
    find_sequential,
    forward_names,
    pipeline_pieces,
    split_pieces,
    stage_inputs,
    take_rows,
)
from lightning_peft.parallel.pipeline_state import (
    STAGE_FILE,
    agree_on_overflow,
    clip_by_global_norm,
    consolidate_checkpoint,
    free_parameters,
    gather_on_rank,
    keep_owned_parameters,
    move_real_tensors,
    ownership,
    select_optimizer_state,
    sum_shared_gradients,
)
from lightning_peft.strategies._pipeline_logs import LogRecorder, replay

__all__ = ["PipelineStrategy", "consolidate_checkpoint"]  # consolidate_checkpoint: its documented path


class PipelineStrategy(AtomicCheckpoints, DDPStrategy):
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

    Examples:
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
            integer("PipelineStrategy", name, value, minimum=1)
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
        if split_points is not None:
            split_points = names("PipelineStrategy", "split_points", split_points, example="['layers.2']")
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
        """The idle share the schedule predicts (`lightning_peft.parallel.pipeline.bubble_fraction`).

        Args:
            ranks: The number of pipeline processes ``p``; default: the number of stages (interleaved: half of it).
        """
        return bubble_fraction(self.schedule, self.num_stages, self.num_microbatches, ranks)

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
        agree_on_overflow(getattr(self.precision_plugin, "scaler", None), self.root_device)

    def _check_world(self) -> None:
        check_schedule(self.schedule, self.num_stages, self.num_microbatches, self.world_size)

    def _stage_ranks(self) -> list[int]:
        return [s % self.world_size for s in range(self.num_stages)]

    def _local_stages(self) -> list[int]:
        return [s for s, r in enumerate(self._stage_ranks()) if r == self.global_rank]

    def _split(self, module: pl.LightningModule) -> None:
        """Cuts the sequential model into stages and frees the parameters of the stages other ranks hold."""
        self._attribute, self._sequential = find_sequential(module, self.model_attribute)
        sequential = self._sequential
        pieces = pipeline_pieces(sequential)
        stages = split_pieces(pieces, self.num_stages, self._relative(self.split_points))
        self._split_names = [[p.name for p in stage] for stage in stages]
        held = ownership(module, stages, self._stage_ranks(), self.global_rank)
        self._owned, self._shared_groups = held.owned, held.shared
        self._foreign_buffers, self._foreign_buffer_ids = held.foreign_buffers, held.foreign_buffer_ids
        free_parameters(module, self._owned)
        self._schedules = OrderedDict()

    def _relative(self, points: list[str] | None) -> list[str] | None:
        if points is None or not self._attribute:
            return points
        prefix = self._attribute + "."
        return [p[len(prefix):] if p.startswith(prefix) else p for p in points]

    @override
    def model_to_device(self) -> None:
        move_real_tensors(self.lightning_module, self.root_device)

    def _keep_own_parameters_in_optimizers(self) -> None:
        """Drops the other ranks' (meta) parameters from every optimizer; remembers the kept ones' positions."""
        self._optimizer_positions = keep_owned_parameters(self.optimizers, self._owned)

    # ------------------------------------------------------------------ running the schedule
    def _pipeline(self, batch: Any, training: bool, microbatches: int) -> tuple[Any, list[Any]]:
        """The schedule and this rank's `PipelineStage` objects for batches like ``batch`` (built once per shape).

        Evaluation runs forward only, with GPipe (the interleaved schedule where a rank holds several stages); a
        batch with fewer micro-batches than 1F1B needs (the short last batch of an epoch) runs under GPipe too.
        """
        names = forward_names(self._sequential, batch)
        inputs = stage_inputs(batch, names)
        key = (training, microbatches, tuple(names), tuple((tuple(t.shape), t.dtype) for t in inputs))
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        while len(self._schedules) >= self.max_schedules:  # every rank sees the same shapes: the same evictions
            self._schedules.popitem(last=False)
        loss_fn = self._loss_fn if training else None
        one_f_one_b = training and self.schedule == "1f1b" and microbatches >= self.num_stages
        schedule, stages = build_schedule(pipeline_pieces(self._sequential, names), self._split_names,
                                          self._local_stages(), self.root_device, microbatches, loss_fn, one_f_one_b)
        self._schedules[key] = (schedule, stages)
        # A new schedule first infers the shapes of gradients by calling the loss once on the last stage, on an
        # uninitialised output; that call is not a micro-batch of the step and does not reach training_step.
        self._inference_calls = int(training and self._is_last_rank())
        return schedule, stages

    def _first_stage_inputs(self, batch: Any) -> list[Tensor]:
        """The first stage's inputs on the rank that holds it; nothing elsewhere (the others receive activations)."""
        return stage_inputs(batch, forward_names(self._sequential, batch)) if 0 in self._local_stages() else []

    def _microbatches(self, batch: Any, training: bool, batch_idx: int = 0) -> tuple[int, int]:
        """``(batch size, micro-batches)``: ``num_microbatches``, or for a batch it does not divide, the largest
        divisor of both when the batch is an evaluation batch or the epoch's last (short) training batch.

        Raises:
            ValueError: If ``num_microbatches`` does not divide a full training batch.
        """
        size = batch_size(batch)
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
        micro = take_rows(self._batch, start, stop, self._size)
        with answering(self._sequential, output), self._recorder.recording(micro):
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
        self._recorder = LogRecorder(self.lightning_module)
        schedule, _ = self._pipeline(batch, True, self._current_microbatches)
        before = {p: p.grad for p in self.lightning_module.parameters() if id(p) in self._owned}
        for p in before:
            p.grad = None
        started = time.perf_counter()
        with self.precision_plugin.train_step_context():
            schedule.step(*self._first_stage_inputs(batch), target=torch.arange(self._size, device=self.root_device))
        self.last_step_seconds = time.perf_counter() - started
        sum_shared_gradients(self._shared_groups)
        self._stashed = {}
        for p, old in before.items():  # the earlier gradients stay; Lightning zeroes them or accumulates onto them
            if p.grad is not None:
                self._stashed[p] = p.grad
            p.grad = old
        loss, calls = self._from_last_stage()
        replay(self.lightning_module, calls)
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
        clip_by_global_norm(optimizer, clip_val, self._shared_groups, self.global_rank, self.root_device)

    def _evaluate(self, step: str, *args: Any, **kwargs: Any) -> Any:
        batch = args[0]
        schedule, _ = self._pipeline(batch, False, self._microbatches(batch, False)[1])
        output = schedule.eval(*self._first_stage_inputs(batch))
        recorder = LogRecorder(self.lightning_module)
        result = None
        if self._is_last_rank():
            with answering(self._sequential, output), recorder.recording(batch):
                result = getattr(self.lightning_module, step)(*args, **kwargs)
        payload = [recorder.summary()]
        if dist.is_initialized():
            dist.broadcast_object_list(payload, src=self._stage_ranks()[-1])
        replay(self.lightning_module, payload[0])
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
        values on global rank 0 (`gather_on_rank`); every rank must enter."""
        with gather_on_rank(module, params, self._foreign_buffer_ids, self.global_rank, self.world_size,
                            self.root_device):
            yield module

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and the buffers of the stages it runs (the other stages' are stale copies)."""
        state = self.lightning_module.state_dict()
        return {k: v for k, v in state.items()
                if not (isinstance(v, Tensor) and v.device.type == "meta") and k not in self._foreign_buffers}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Writes ``filepath/stage-<rank>.ckpt`` on every rank (see the module docstring), into a temporary folder
        that replaces ``filepath`` once every stage is written."""
        checkpoint = {**checkpoint, "pipeline": {
            "rank": self.global_rank, "world_size": self.world_size, "num_stages": self.num_stages,
            "schedule": self.schedule, "model_attribute": self._attribute, "stages": self._split_names,
            "optimizer_positions": self._optimizer_positions,
        }}
        stage_file = STAGE_FILE.format(self.global_rank)
        save_folder(self, self.broadcast(filepath), lambda directory: self.checkpoint_io.save_checkpoint(
            checkpoint, directory / stage_file, storage_options=storage_options))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """This rank's stage file of a pipeline checkpoint directory, or a whole (unsplit) checkpoint file."""
        path = Path(checkpoint_path)
        if path.is_dir():
            own = path / STAGE_FILE.format(self.global_rank)
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
            select_optimizer_state(state, positions)
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
            move_real_tensors(self.lightning_module, torch.device("cpu"))
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


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
