"""``ZeROStrategy(backend="deepspeed")``: DeepSpeed ZeRO stages 1, 2 and 3, also on the CPU (gloo).

Stock ``DeepSpeedStrategy`` refuses the CPU; the overrides here fix that (the environment is DDP's, the device rank
a CPU has, no shared-memory op to compile), take a torch optimizer without its frozen parameters, follow Lightning's
gradient clipping and accumulation windows, size the communication buckets to the model, and load a ZeRO-3
checkpoint for validate/test/predict by assembling its full weights. The front and the arguments:
`lightning_peft.strategies.zero`.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_peft._checkpoint_io import save_sharded
from lightning_peft.parallel.checkpoint import deepspeed_checkpoint
from lightning_peft.parallel.zero import (
    drop_empty_groups,
    drop_frozen,
    restore_torch_linear,
    skip_shared_memory_op,
    zero_config_fields,
)
from lightning_peft.peft.checkpoint import KEY as CHECKPOINT_KEY
from lightning_peft.peft.checkpoint import check_same_adapters
from lightning_peft.strategies.zero import ZeROStrategy, split_options

__all__ = ["DeepSpeedZeRO"]


class DeepSpeedZeRO(ZeROStrategy, DeepSpeedStrategy):
    """DeepSpeed ZeRO that also runs on the CPU (gloo), with a torch optimizer and Lightning's clipping."""

    _zero_kind = "deepspeed"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stage, backend, offload_optimizer, offload_parameters, engine_options = self._arguments(*args, **kwargs)
        zero_keys = zero_config_fields()
        zero_options = {k: v for k, v in engine_options.items()
                        if k in zero_keys and k not in inspect.signature(DeepSpeedStrategy).parameters}
        (strategy_options,) = split_options(
            self._name(), {k: v for k, v in engine_options.items() if k not in zero_options},
            ("DeepSpeedStrategy or the zero_optimization config", DeepSpeedStrategy.__init__),
        )
        DeepSpeedStrategy.__init__(
            self, stage=stage, offload_optimizer=offload_optimizer, offload_parameters=offload_parameters,
            **strategy_options,
        )
        given = strategy_options.get("config")
        self._explicit = set(engine_options) | set((self.config.get("zero_optimization") or {}) if given else ())
        told = (self.config.get("zero_optimization") or {}).get("stage") if given else None
        if told is not None and told != stage:
            raise ValueError(f"{self._name()}: the DeepSpeed config says zero_optimization.stage={told}; say the stage "
                             f"once, as ZeROStrategy(stage={told}, config=...).")
        if zero_options:
            self.config.setdefault("zero_optimization", {}).update(zero_options)
        self.config.setdefault("zero_optimization", {})["stage"] = stage

    @override
    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise ValueError(f"{self._name()} runs on CPUs and CUDA GPUs; this Trainer uses "
                             f"{type(self.accelerator).__name__}.")
        self._check_trainer()
        self._check_precision()
        # DeepSpeedStrategy.setup_environment refuses anything but CUDA; DDP's sets up the same environment.
        DDPStrategy.setup_environment(self)

    def _check_precision(self) -> None:
        precision = str(self.precision_plugin.precision)
        if isinstance(self.accelerator, CPUAccelerator) and precision.startswith("16"):
            raise ValueError(f"{self._name()} with Trainer(precision={precision!r}) on the CPU: DeepSpeed's CPU "
                             "accelerator has no float16 training. Use precision='32-true' or 'bf16-mixed'.")

    @override
    def setup_distributed(self) -> None:
        # DeepSpeedStrategy's version checks CUDA device indices first; the rest is the same.
        reset_seed()
        self.set_world_ranks()
        if isinstance(self.accelerator, CPUAccelerator):
            skip_shared_memory_op()
        self._init_deepspeed_distributed()

    @override
    def teardown(self) -> None:
        super().teardown()
        restore_torch_linear()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.gradient_clip_algorithm == "value" and trainer.gradient_clip_val:
            raise ValueError(f"{self._name()} with Trainer(gradient_clip_algorithm='value'): DeepSpeed clips "
                             "gradients by norm only. Use gradient_clip_algorithm='norm'.")
        clip = trainer.gradient_clip_val or 0.0
        told = self.config.get("gradient_clipping")
        if told is not None and float(told) != float(clip):
            raise ValueError(
                f"{self._name()}: the DeepSpeed config says gradient_clipping={told} but "
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}); say it once, in the Trainer."
            )
        # Lightning fills gradient_clipping only when the key is missing; DeepSpeed's own default is 1.0.
        self.config["gradient_clipping"] = float(clip)
        if any(getattr(c, "adapter_only_checkpoint", False) for c in trainer.callbacks):  # a PEFT callback's setting
            self.exclude_frozen_parameters = True
        self._fit_buckets(self.lightning_module)
        super().setup(trainer)

    def _fit_buckets(self, module: nn.Module) -> None:
        """Communication buckets no larger than what they can ever hold.

        DeepSpeed allocates its buckets whole (Lightning's default reduce and all-gather buckets are 2e8 elements,
        800 MB each in float32), whatever the model: a LoRA adapter of 10k parameters would carry GBs of buffers.
        A bucket larger than all the gradients (or parameters) it collects is never filled, so capping it there
        changes nothing else. Sizes given explicitly are kept.
        """
        # A model built under deepspeed.zero.Init is partitioned already: count its parameters' full sizes.
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)
        total = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
        zero = self.config.setdefault("zero_optimization", {})
        caps = {"reduce_bucket_size": (trainable, 500_000_000), "allgather_bucket_size": (total, 500_000_000)}
        if self.stage == 3:
            caps["stage3_prefetch_bucket_size"] = (total, 50_000_000)
        for key, (cap, deepspeed_default) in caps.items():
            if key not in self._explicit:
                # Rounded up: DeepSpeed wants bucket sizes aligned for its collectives.
                zero[key] = int(min(zero.get(key, deepspeed_default), -(-max(cap, 1) // 256) * 256))

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning decides the windows, as under DDP, and the engine follows (see `backward`).

        With True (``DeepSpeedStrategy``'s answer) Lightning calls ``engine.step()`` after every micro-batch and the
        engine steps after every ``gradient_accumulation_steps``-th of the whole run: its windows run across epoch
        ends, where Lightning (and DDP) step a short last window, so steps, learning rates and the count of
        optimizer steps drift from DDP's, and the count cannot change during a run.
        """
        return False

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        """``engine.backward`` of a loss that Lightning has already divided by the window's size.

        The engine would divide it by ``gradient_accumulation_steps`` again (``scale_wrt_gas``): the gradient of a
        window of ``k`` would be ``sum g_i / k**2``. And the engine is told whether this micro-batch ends a window
        (Lightning's decision, the one DDP follows): that is when ZeRO reduces the gradients and when
        ``engine.step()`` applies them, whatever the engine's own micro-step counter says.
        """
        module = self.lightning_module
        if module is not None and module.automatic_optimization and module.trainer.training:
            self._follow_window(module.trainer)
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _follow_window(self, trainer: pl.Trainer) -> None:
        """Tell the engine the size of the current window (its bookkeeping) and whether this micro-batch ends it."""
        engine = self.deepspeed_engine
        size = int(trainer.accumulate_grad_batches)
        if engine.gradient_accumulation_steps() != size:
            engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * engine.dp_world_size * size)
        engine.set_gradient_accumulation_boundary(not trainer.fit_loop._should_accumulate())

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # Lightning would enter engine.no_sync() for the micro-batches inside a window (the engine looks like a
        # DistributedDataParallel to it); ZeRO 2 and 3 refuse that. The engine skips the reduction itself there:
        # it is told that the micro-batch does not end a window (backward).
        yield None

    @override
    def _auto_select_batch_size(self) -> int:
        # Lightning reads the train loader's batch_sampler, which a loader of whole batches (batch_size=None, as
        # SFTDataModule's packed (1, T) rows come) does not have: each of its items is one micro-batch of one row.
        source = self.lightning_module.trainer.fit_loop._data_source
        loader = source.dataloader() if source.is_defined() else None
        return getattr(getattr(loader, "batch_sampler", None), "batch_size", None) or 1

    @override
    def _format_batch_size_and_grad_accum_config(self) -> None:
        # The micro-batch size first: reading it asks for the train loader, which is when a GradientAccumulation
        # (global_batch_size=...) derives its count; the engine's gradient_accumulation_steps is read after it.
        if self.lightning_module is not None and "train_micro_batch_size_per_gpu" not in self.config:
            self.config["train_micro_batch_size_per_gpu"] = self._auto_select_batch_size()
        super()._format_batch_size_and_grad_accum_config()

    @override
    def _setup_model_and_optimizer(self, model: nn.Module, optimizer: Optimizer | None, lr_scheduler: Any = None):
        import deepspeed

        if optimizer is not None:
            drop_frozen([optimizer])
            if not any(group["params"] for group in optimizer.param_groups):
                raise ValueError(f"{self._name()}: no parameter of the optimizer trains (every one has "
                                 "requires_grad=False); there is nothing for DeepSpeed to optimize.")
            # DeepSpeed cannot partition an empty group (a no-decay group of frozen biases under LoRA): drop it.
            drop_empty_groups(optimizer, [lr_scheduler] if lr_scheduler is not None else [])
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # DeepSpeed writes the folder from every rank: filled under a temporary name and swapped in whole
        save_sharded(self, super().save_checkpoint, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        self._assembled = False
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting or not self.zero_stage_3 or not path.is_dir() or self.load_full_weights:
            return super().load_checkpoint(path, weights_only)
        # validate/test/predict from a ZeRO-3 checkpoint: DeepSpeed's engine without an optimizer cannot load one
        # (it asks the optimizer it lacks to restore), so assemble the full weights as zero_to_fp32 does and load
        # them module by module into the partitions (load_model_state_dict below).
        checkpoint = deepspeed_checkpoint(path)
        self._check_assembled(checkpoint, path)  # on every rank: the load below runs on rank 0 only
        self._assembled = True
        return checkpoint

    def _check_assembled(self, checkpoint: Mapping[str, Any], path: Path) -> None:
        """Refuse, on every rank alike, a checkpoint whose adapters, keys or shapes do not fit the model."""
        module = self.lightning_module
        entry = checkpoint.get(CHECKPOINT_KEY) or {}
        if entry:
            check_same_adapters(entry, module, self._name())
        shapes = {k: tuple(getattr(p, "ds_shape", p.shape)) for k, p in module.named_parameters()}
        saved = checkpoint["state_dict"]
        lacking = sorted(set(shapes) - set(saved) - set(entry.get("dropped", [])))
        unexpected = sorted(k for k in saved if k not in shapes and k not in dict(module.named_buffers()))
        misfit = [k for k in saved if k in shapes and tuple(saved[k].shape) != shapes[k]]
        if lacking or unexpected or misfit:
            key = (lacking or unexpected or misfit)[0]
            what = "lacks" if lacking else "has an unknown key" if unexpected else "has another shape for"
            raise RuntimeError(f"{self._name()}: the checkpoint {str(path)!r} {what} {key!r}; it was written for "
                               "another model.")

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assembled, self._assembled = getattr(self, "_assembled", False), False
        if assembled:
            self._restore_zero_state(checkpoint, strict=strict)
            return
        super().load_model_state_dict(checkpoint, strict)

    def _deepspeed_args(self) -> argparse.Namespace:
        # Lightning passes root_device.index, which a CPU device does not have.
        return argparse.Namespace(
            device_rank=self.root_device.index if self.root_device.type == "cuda" else self.local_rank)

    @override
    def _initialize_deepspeed_inference(self, model: nn.Module) -> None:
        # DeepSpeedStrategy's, with the device rank a CPU has (validate/test/predict after or without fit).
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        config.update({k: self.config[k] for k in ("fp16", "bf16") if k in self.config})
        if self.zero_stage_3:
            config.update({k: self.config[k] for k in ("zero_allow_untested_optimizer", "zero_optimization")})
        # Lightning drops every hook of every module here (the training engine's ZeRO-3 hooks must go); the
        # state-dict hooks stay: LoRA's layout hooks and the adapter-only checkpoint hook are not DeepSpeed's.
        kept = {id(m): (m._state_dict_hooks.copy(), m._load_state_dict_pre_hooks.copy()) for m in model.modules()}
        remove_module_hooks(model)
        for module in model.modules():
            module._state_dict_hooks, module._load_state_dict_pre_hooks = kept[id(module)]
        self.model, _, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(), config=config, model=model, optimizer=None, lr_scheduler=None,
            model_parameters=[], dist_init_required=False,
        )
