"""``TensorParallelStrategy``: Megatron-style tensor parallelism on DTensor with an automatic, LoRA-aware plan, and
optional data parallelism (a 2-D mesh ``(data_parallel, tensor_parallel)``).

The Lightning glue over `lightning_peft.parallel.tensor_parallel` (the rule, LoRA's placements, the plan, the
shapes: see that module). The plan is applied in ``setup``, after the PEFT callbacks injected their adapters; the
ranks of one tensor-parallel group see the same batch; the gradients of the trainable parameters are averaged over
the data-parallel group after each backward (as DDP does, unbucketed: a parameter one replica's batch did not reach
counts as a zero gradient there, one that no replica's batch reached keeps no gradient), and the model is broadcast
from the first data-parallel replica at setup.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_peft._checkpoint_io import AtomicCheckpoints, save_sharded
from lightning_peft._checks import integer
from lightning_peft._seams import refuse
from lightning_peft.parallel.checkpoint import load_optimizer_states
from lightning_peft.parallel.dtensor import average_gradients, broadcast_module, clip_grad_norm, local_parameter_bytes
from lightning_peft.parallel.tensor_parallel import check_plan_styles, parallelize

__all__ = ["TensorParallelStrategy"]

WHO = "TensorParallelStrategy"


class TensorParallelStrategy(AtomicCheckpoints, ModelParallelStrategy):
    """Tensor parallelism over DTensor with an automatic, LoRA-aware plan; optional data parallelism (2-D mesh).

    Unlike Lightning's `ModelParallelStrategy`, the LightningModule needs no ``configure_model``: the plan is applied
    in ``setup``, after the PEFT callbacks injected their adapters. Checkpoints are Lightning's distributed
    checkpoints (a folder, one file per rank) or, with ``save_distributed_checkpoint=False``, one full file.

    Args:
        tensor_parallel_size: Ranks a layer is split over; must divide the heads, hidden and feed-forward sizes.
        plan: ``"auto"`` (the project's blocks, Llama- and BERT-style names, embeddings and ``lm_head``) or
            ``{module name pattern: "colwise" | "rowwise"}``.
        data_parallel_size: Replicas (each a tensor-parallel group); ``"auto"``: world size / tensor_parallel_size.
        save_distributed_checkpoint: One file per rank (True) or one full checkpoint file on rank 0.
        process_group_backend: ``"gloo"`` (CPU) or ``"nccl"``; None picks by device.
        timeout: Collective timeout.

    YAML:

    ```yaml
    trainer:
      strategy:
        class_path: lightning_peft.strategies.TensorParallelStrategy
        init_args: {tensor_parallel_size: 2, plan: auto}
    ```

    Raises:
        ValueError: If ``tensor_parallel_size`` is not a positive integer, the plan is malformed, the device count
            is not a multiple of it, or (at setup) the plan does not fit the model (see
            `lightning_peft.parallel.tensor_parallel.resolve_plan`).
    """

    # Its data-parallel average takes every trainable gradient in one order, zeros for a replica that left one
    # unused (per-sample adapter routing), which the routing callback asks before refusing sharded data parallelism.
    averages_missing_gradients = True

    strategy_name = "tensor_parallel"

    def __init__(
        self,
        tensor_parallel_size: int = 2,
        plan: str | dict[str, str] = "auto",
        data_parallel_size: int | Literal["auto"] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        integer(WHO, "tensor_parallel_size", tensor_parallel_size, minimum=1)
        if data_parallel_size != "auto":
            integer(WHO, "data_parallel_size", data_parallel_size, minimum=1, example="'auto'")
        check_plan_styles(plan)
        super().__init__(
            data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint, process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.plan = plan
        self.applied_plan: dict[str, str] = {}

    @property
    def tensor_parallel_size(self) -> int:
        return int(self._tensor_parallel_size)

    @property
    def data_parallel_size(self) -> int:
        return int(self._data_parallel_size)

    @override
    def _configure_launcher(self) -> None:
        self._check_sizes()  # here the device count is known and no process is launched yet
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._check_sizes()
        super().setup_environment()

    def _check_sizes(self) -> None:
        world = self.num_nodes * self.num_processes
        tp = self._tensor_parallel_size
        if world % tp:
            raise ValueError(
                f"{WHO}(tensor_parallel_size={tp}): the run has {world} devices, not a multiple of {tp}; set "
                f"Trainer(devices=...) to a multiple of {tp} or lower tensor_parallel_size."
            )
        if self._data_parallel_size == "auto":
            self._data_parallel_size = world // tp
        elif self._data_parallel_size * tp != world:
            raise ValueError(
                f"{WHO}(tensor_parallel_size={tp}, data_parallel_size={self._data_parallel_size}): their product "
                f"must equal the {world} devices of the run; use data_parallel_size='auto'."
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.model is None or self.accelerator is None:
            raise RuntimeError(f"{WHO}.setup: the strategy has no model or accelerator; it runs inside Trainer.fit.")
        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not getattr(self.model, "_lightning_peft_tensor_parallel", False):
            self._parallelize()
            self.model._lightning_peft_tensor_parallel = True
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            _refuse_fused_over_mixed_groups(self)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # torch.nn.utils.clip_grad_norm_ cannot stack the norms of DTensor and plain gradients: clip by the global
        # norm computed here instead (Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")).
        self.precision_plugin.clip_grad_by_norm = _clip_grad_by_norm.__get__(self.precision_plugin)

    def _parallelize(self) -> None:
        if self.data_parallel_size > 1:
            broadcast_module(self.model, self.device_mesh["data_parallel"])
        if self.tensor_parallel_size > 1:
            self.applied_plan = parallelize(self.model, self.device_mesh["tensor_parallel"], self.plan)
            rank_zero_info(
                f"{WHO}: {len(self.applied_plan)} modules split over {self.tensor_parallel_size} ranks "
                f"({sum(s == 'colwise' for s in self.applied_plan.values())} column-wise, "
                f"{sum(s == 'rowwise' for s in self.applied_plan.values())} row-wise); "
                f"{local_parameter_bytes(self.model) / 2**20:.2f} MiB of parameters on this rank."
            )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's save; a distributed checkpoint is written into a temporary folder that then replaces
        ``filepath`` (a kill mid-save leaves the previous checkpoint whole)."""
        save_sharded(self, super().save_checkpoint, checkpoint, filepath, storage_options,
                     sharded=self._save_distributed_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads a distributed checkpoint into the split model and its optimizers.

        Unlike Lightning's loader, it also takes an adapter-only checkpoint (``LoRA(adapter_only_checkpoint=True)``:
        the frozen base is absent and stays as built) and a model without DTensor parameters (data parallel only).
        A full-file checkpoint (``save_distributed_checkpoint=False``) goes to Lightning's loader.
        """
        from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint

        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)
        return _load_sharded(self.model, self.optimizers, path, self.lightning_module.strict_loading, weights_only)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.data_parallel_size > 1:
            average_gradients(self.model.parameters(), self.device_mesh["data_parallel"])


def _clip_grad_by_norm(precision: Any, optimizer: Any, clip_val: float) -> None:
    """``Precision.clip_grad_by_norm`` for DTensor gradients (bound to the strategy's precision plugin)."""
    clip_grad_norm(precision.main_params(optimizer), clip_val)


def _load_sharded(model: nn.Module, optimizers: list, path: Path, strict: bool, weights_only: bool | None) -> dict:
    """The model's and the optimizers' states from a ``torch.distributed.checkpoint`` folder; returns the rest."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    saved = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    model_state = get_model_state_dict(model)  # the values as built: what the checkpoint lacks keeps them
    missing = [key for key in model_state if f"state_dict.{key}" not in saved]
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    if strict and any(key in trainable for key in missing):
        raise RuntimeError(
            f"{WHO}: the checkpoint {str(path)!r} lacks trained parameters of the model, e.g. "
            f"{next(k for k in missing if k in trainable)!r} ({len(missing)} keys missing in all); it was written "
            "for another model or adapter. Only frozen parameters may be absent (an adapter-only checkpoint)."
        )
    state = {"state_dict": model_state}
    load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=bool(missing)))
    model.load_state_dict(state["state_dict"], strict=strict)
    load_optimizer_states(path, model, optimizers)
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


StrategyRegistry.register(
    "tensor_parallel", TensorParallelStrategy, description="DTensor tensor parallelism, LoRA-aware (2 ranks)",
    override=True, tensor_parallel_size=2,
)
StrategyRegistry.register(
    "tp", TensorParallelStrategy, description="DTensor tensor parallelism, LoRA-aware (2 ranks)",
    override=True, tensor_parallel_size=2,
)


def _refuse_fused_over_mixed_groups(strategy: TensorParallelStrategy) -> None:
    """A fused optimizer steps each group in one kernel, which cannot take DTensor shards (the split layers) and
    plain tensors (LoRA's replicated factors, a head) together; regrouping behind the user's back would desynchronise
    the schedulers built over their groups."""
    from torch.distributed.tensor import DTensor

    for optimizer in strategy.optimizers:
        for index, group in enumerate(optimizer.param_groups):
            kinds = {isinstance(p, DTensor) for p in group["params"] if p.requires_grad}
            if group.get("fused") and len(kinds) == 2:
                raise refuse(
                    f"{type(optimizer).__name__}(fused=True)", strategy,
                    f"parameter group {index} holds both tensor-parallel shards (DTensor) and plain tensors, which "
                    "a fused optimizer step cannot take in one kernel",
                    "build the optimizer with fused=False (foreach is fine), or put the DTensor parameters "
                    "(isinstance(p, torch.distributed.tensor.DTensor) inside configure_optimizers) in groups of their own",
                )
