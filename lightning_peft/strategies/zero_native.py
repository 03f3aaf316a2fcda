"""``ZeROStrategy(backend="native")`` on torch.distributed: stage 1 as DDP + ``ZeroRedundancyOptimizer``, stages 2
and 3 as FSDP2 ``fully_shard`` (stage 3 reshards after forward, stage 2 keeps parameters gathered).

With FSDP2 each adapter wrapper's frozen ``base_layer`` is its own unit and the repeated blocks are units holding
the adapter's parameters (`lightning_peft.parallel.zero.fsdp_units`); the LightningModule is the root unit, and
its ``training_step``/``validation_step``/... run through its ``__call__`` so that the root's parameters are
gathered for them (Lightning calls those hooks directly). The front and the arguments: `lightning_peft.strategies.zero`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.fsdp import _METADATA_FILENAME
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_peft._checkpoint_io import save_sharded
from lightning_peft.parallel.zero import drop_frozen, fsdp_units, load_partial, rebind_schedulers
from lightning_peft.peft.checkpoint import KEY as CHECKPOINT_KEY
from lightning_peft.strategies.zero import ZeROStrategy, split_options

__all__ = ["NativeFSDP", "NativeZeRO1"]


class NativeZeRO1(ZeROStrategy, DDPStrategy):
    """DDP whose optimizers are wrapped in ``ZeroRedundancyOptimizer`` (each rank steps its share of them)."""

    _zero_kind = "zero1"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stage, backend, offload_optimizer, offload_parameters, engine_options = self._arguments(*args, **kwargs)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        for key in ("params", "optimizer_class", "process_group", "module", "device_ids", "output_device",
                    "overlap_with_ddp"):
            if key in engine_options:
                raise TypeError(f"{self._name()}: {key} is set by the strategy.")
        strategy_options, self._zero_options, ddp_options = split_options(
            self._name(), engine_options, ("DDPStrategy", DDPStrategy.__init__),
            ("ZeroRedundancyOptimizer", ZeroRedundancyOptimizer.__init__),
            ("DistributedDataParallel", DistributedDataParallel.__init__),
        )
        DDPStrategy.__init__(self, **strategy_options, **ddp_options)

    @override
    def setup_environment(self) -> None:
        self._check_trainer()
        super().setup_environment()

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        drop_frozen(self.optimizers)
        wrapped = {id(o): self._partitioned(o) for o in self.optimizers}
        for config in self.lr_scheduler_configs:
            rebind_schedulers(config.scheduler, wrapped)
        self.optimizers = [wrapped[id(o)] for o in self.optimizers]

    def _partitioned(self, optimizer: Optimizer) -> Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        # ``defaults`` may hold keys the constructor does not take (AdamW records decoupled_weight_decay). The
        # groups go in whole: per-group settings and a scheduler's initial_lr survive, and a group left empty by
        # drop_frozen (a no-decay group of frozen biases) is kept, so the schedulers' per-group lists still fit.
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return ZeroRedundancyOptimizer([dict(g) for g in optimizer.param_groups], optimizer_class=type(optimizer),
                                       **defaults, **self._zero_options)


def _through_root(method: str, context: str) -> Any:
    """A step hook that runs ``LightningModule.<method>`` inside the precision plugin's ``context`` and through the
    root module's ``__call__``: FSDP2 gathers the root unit's parameters in its forward hooks, which a direct
    ``lightning_module.training_step(...)`` call (what Lightning does) would skip."""

    def step(self: ModelParallelStrategy, *args: Any, **kwargs: Any) -> Any:
        with getattr(self.precision_plugin, context)():
            return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    step.__name__ = step.__qualname__ = method
    return step


class NativeFSDP(ZeROStrategy, ModelParallelStrategy):
    """FSDP2 ``fully_shard`` over all ranks (stage 3 reshards after forward, stage 2 keeps parameters gathered)."""

    _zero_kind = "fsdp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stage, backend, offload_optimizer, offload_parameters, engine_options = self._arguments(*args, **kwargs)
        from torch.distributed.fsdp import fully_shard

        strategy_options, self._shard_options = split_options(
            self._name(), engine_options, ("ModelParallelStrategy", ModelParallelStrategy.__init__),
            ("fully_shard", fully_shard),
        )
        for key in ("data_parallel_size", "tensor_parallel_size"):
            if key in strategy_options:
                raise TypeError(f"{self._name()}: {key} is set from the Trainer (every rank is data parallel); "
                                "for tensor parallelism use TensorParallelStrategy.")
        for key in ("module", "mesh", "reshard_after_forward", "offload_policy"):
            if key in self._shard_options:
                raise TypeError(f"{self._name()}: fully_shard's {key} is set by the strategy (stage, "
                                "offload_parameters).")
        ModelParallelStrategy.__init__(self, **strategy_options)

    @override
    def setup_environment(self) -> None:
        self._check_trainer()
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup, less its demand that configure_model applies the parallelism: here the
        # strategy shards the (already adapted) model itself.
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._shard(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            drop_frozen(self.optimizers)
        self.setup_precision_plugin()

    def _shard(self, module: nn.Module) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return  # configure_model sharded it already (or a previous stage did)
        options = {"mesh": self.device_mesh["data_parallel"], "reshard_after_forward": self.stage == 3,
                   **self._shard_options}
        if self.offload_parameters:
            options["offload_policy"] = CPUOffloadPolicy()
        for unit in fsdp_units(module):
            fully_shard(unit, **options)
        fully_shard(module, **options)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # a distributed checkpoint is filled under a temporary name and swapped in whole
        save_sharded(self, super().save_checkpoint, checkpoint, filepath, storage_options,
                     sharded=self._save_distributed_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not (path.is_dir() and (path / _METADATA_FILENAME).is_file()):
            return super().load_checkpoint(path, weights_only)
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        saved = {k.split(".", 1)[1] for k in FileSystemReader(path).read_metadata().state_dict_metadata
                 if k.startswith("state_dict.")}
        model_state = get_model_state_dict(self.model)
        if set(model_state) <= saved:
            return super().load_checkpoint(path, weights_only)
        # An adapter-only checkpoint: what it left out (the frozen base) stays as the model was built.
        metadata = torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
        entry = metadata.get(CHECKPOINT_KEY) or {}
        lacking = sorted(set(model_state) - saved - set(entry.get("dropped", [])))
        if lacking:
            raise RuntimeError(f"{self._name()}: the checkpoint {str(path)!r} has no {lacking[0]!r} (and "
                               f"{len(lacking) - 1} more keys the model has); it was written for another model.")
        return load_partial(path, self.model, self.optimizers, {k: v for k, v in model_state.items() if k in saved},
                             metadata)

    # The step hooks run through the root module's ``__call__`` (see _through_root).
    training_step = _through_root("training_step", "train_step_context")
    validation_step = _through_root("validation_step", "val_step_context")
    test_step = _through_root("test_step", "test_step_context")
    predict_step = _through_root("predict_step", "predict_step_context")
