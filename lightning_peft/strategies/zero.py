"""``ZeROStrategy``: ZeRO stages 1, 2 and 3 on DeepSpeed or on native torch.distributed, PEFT-aware.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", arXiv:1910.02054)
removes the redundancy of data parallelism: each of the ``N`` ranks keeps ``1/N`` of

=========  ===========================  ===========================================  ============================
stage      partitioned                  DeepSpeed (``backend="deepspeed"``)           native (``backend="native"``)
=========  ===========================  ===========================================  ============================
1          optimizer state              ZeRO stage 1                                  DDP + ``ZeroRedundancyOptimizer``
2          + gradients                  ZeRO stage 2                                  FSDP2 ``fully_shard``, parameters kept
                                                                                      gathered from forward to backward
3          + parameters                 ZeRO stage 3                                  FSDP2 ``fully_shard``, parameters
                                                                                      resharded after forward
=========  ===========================  ===========================================  ============================

Per rank, for ``P`` trained parameters with Adam in float32 (4 bytes each for weights, gradients and each of the two
moments): DDP holds ``4P + 4P + 8P``; stage 1 ``4P + 4P + 8P/N``; stage 2 ``4P + 4P/N + 8P/N``; stage 3
``(4P + 4P + 8P)/N``, plus the engines' own buffers (DeepSpeed keeps a float32 master copy of its partition).
The frozen base of a LoRA model holds no gradient and no optimizer state on any backend: frozen parameters are
removed from the optimizer before the engine sees it, so optimizer state and gradients are those of the adapter.

With FSDP2 each LoRA layer's frozen ``base_layer`` is its own unit and the repeated blocks (the children of every
``nn.ModuleList``) are units holding the adapter's parameters; the LightningModule is the root unit, and its
``training_step``/``validation_step``/... run through its ``__call__`` so that the root's parameters are
gathered for them (Lightning calls those hooks directly).

This class is a front: ``ZeROStrategy(stage=3, backend="native")`` returns the backend's strategy (a
``DeepSpeedStrategy``, ``DDPStrategy`` or ``ModelParallelStrategy`` subclass), which is also a ``ZeROStrategy``.
Importing :mod:`lightning_peft.strategies` registers ``zero1``, ``zero2``, ``zero3`` (DeepSpeed),
``zero2_offload``, ``zero3_offload`` and ``zero1_native``, ``zero2_native``, ``zero3_native`` in Lightning's
strategy registry.

YAML::

    trainer:
      strategy:
        class_path: lightning_peft.strategies.ZeROStrategy
        init_args: {stage: 3, backend: native}
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import sys
from pathlib import Path
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.fabric.strategies.fsdp import _METADATA_FILENAME
from lightning.fabric.utilities.seed import reset_seed
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_peft.callbacks._checkpoint import KEY as CHECKPOINT_KEY
from lightning_peft.callbacks._checkpoint import AdapterCallback, check_same_adapters
from lightning_peft.peft.layers import LoRALayer
from lightning_peft.strategies.checkpoint import deepspeed_checkpoint

__all__ = ["ZeROStrategy"]

Backend = Literal["deepspeed", "native"]
DEEPSPEED_INSTALL = ("pip install 'lightning-peft[deepspeed]' (DeepSpeed builds from source: install torch first, "
                     "then pip install --no-build-isolation deepspeed)")


class ZeROStrategy(Strategy):
    """ZeRO stage 1, 2 or 3 on DeepSpeed or native torch.distributed; returns the backend's strategy.

    Args:
        stage: 1 (optimizer state partitioned), 2 (+ gradients) or 3 (+ parameters).
        backend: ``"deepspeed"`` or ``"native"`` (``ZeroRedundancyOptimizer`` for stage 1, FSDP2 for 2 and 3).
        offload_optimizer: Keep the optimizer state (and its step) in CPU memory; DeepSpeed only, on a GPU.
        offload_parameters: Keep parameters in CPU memory (DeepSpeed stage 3; FSDP2 stages 2 and 3, where it
            offloads gradients and the optimizer step too). On a GPU only.
        options: The engine options as one dict: what YAML can give (LightningCLI takes only named arguments),
            e.g. ``init_args: {stage: 3, options: {stage3_param_persistence_threshold: 0}}``.
        **engine_options: Passed through. DeepSpeed: any ``DeepSpeedStrategy`` argument (``config``,
            ``allgather_bucket_size``, ...) or ``zero_optimization`` key (``stage3_param_persistence_threshold``,
            ...). Native stage 1: ``DDPStrategy`` arguments, ``DistributedDataParallel`` ones
            (``find_unused_parameters``) and ``ZeroRedundancyOptimizer`` ones (``parameters_as_bucket_view``). Native stages 2 and 3: ``ModelParallelStrategy`` arguments
            (``save_distributed_checkpoint``, ``timeout``) and ``fully_shard`` ones (``mp_policy``).
    """

    stage: int
    backend: str

    def __new__(
        cls,
        stage: int = 2,
        backend: Backend = "deepspeed",
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        options: dict[str, Any] | None = None,
        **engine_options: Any,
    ) -> ZeROStrategy:
        if cls is ZeROStrategy:
            cls = _backend_class(stage, backend, offload_optimizer, offload_parameters)
        return super().__new__(cls)

    def __init__(
        self,
        stage: int = 2,
        backend: Backend = "deepspeed",
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        options: dict[str, Any] | None = None,
        **engine_options: Any,
    ) -> None:
        # Never runs: __new__ returns a backend class, whose own __init__ Python calls. This signature is the one
        # LightningCLI reads to build the strategy from YAML.
        del stage, backend, offload_optimizer, offload_parameters, options, engine_options

    def _arguments(self, *args: Any, **kwargs: Any) -> tuple[int, str, bool, bool, dict[str, Any]]:
        """The front's arguments (a backend's ``__init__`` gets what ``ZeROStrategy(...)`` was called with)."""
        bound = inspect.signature(ZeROStrategy.__init__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        _, stage, backend, offload_optimizer, offload_parameters, options, engine_options = bound.arguments.values()
        both = sorted(set(options or {}) & set(engine_options))
        if both:
            raise TypeError(f"ZeROStrategy: {both[0]!r} is given twice, in options and as a keyword; give it once.")
        engine_options = {**(options or {}), **engine_options}
        self.stage, self.backend = stage, backend
        self.offload_optimizer, self.offload_parameters = offload_optimizer, offload_parameters
        return stage, backend, offload_optimizer, offload_parameters, engine_options

    def _check_trainer(self) -> None:
        """Refuse, before any work, what this backend cannot honour on this accelerator."""
        accelerator = self.accelerator
        if (self.offload_optimizer or self.offload_parameters) and isinstance(accelerator, CPUAccelerator):
            asked = "offload_optimizer" if self.offload_optimizer else "offload_parameters"
            raise ValueError(
                f"{self._name()}({asked}=True) with Trainer(accelerator='cpu'): offloading moves state from GPU "
                "memory to CPU memory, and on the CPU everything already is in CPU memory. Drop the offload option "
                "(or train on GPUs)."
            )

    def _name(self) -> str:
        return f"ZeROStrategy(stage={self.stage}, backend={self.backend!r})"


# The front is never instantiated itself (``__new__`` returns a backend class, which implements Strategy's abstract
# methods); LightningCLI refuses to build a class it sees as abstract.
ZeROStrategy.__abstractmethods__ = frozenset()


def _backend_class(stage: Any, backend: Any, offload_optimizer: bool, offload_parameters: bool) -> type:
    """The backend's strategy class, after checking the arguments that need no Trainer."""
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(f"ZeROStrategy(stage={stage!r}): the ZeRO stage is 1 (optimizer state), 2 (+ gradients) "
                         "or 3 (+ parameters).")
    if backend not in ("deepspeed", "native"):
        raise ValueError(f"ZeROStrategy(backend={backend!r}): the backend is 'deepspeed' or 'native' "
                         "(torch.distributed: ZeroRedundancyOptimizer for stage 1, FSDP2 for stages 2 and 3).")
    if backend == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            raise ImportError(f"ZeROStrategy(stage={stage}, backend='deepspeed') needs DeepSpeed, which is not "
                              f"installed: {DEEPSPEED_INSTALL}. Or use backend='native' (torch.distributed only).")
        if offload_parameters and stage != 3:
            raise ValueError(f"ZeROStrategy(stage={stage}, offload_parameters=True): DeepSpeed offloads parameters "
                             "only at stage 3 (parameters are partitioned only there). Use stage=3, or "
                             "offload_optimizer=True.")
        return _DeepSpeedZeRO
    if stage == 1:
        if offload_optimizer or offload_parameters:
            raise ValueError("ZeROStrategy(stage=1, backend='native', offload_...=True): ZeroRedundancyOptimizer "
                             "has no offload. Use backend='deepspeed' (offload_optimizer), or stage 2/3 native "
                             "with offload_parameters=True (FSDP2's CPU offload).")
        return _NativeZeRO1
    if offload_optimizer and not offload_parameters:
        raise ValueError(f"ZeROStrategy(stage={stage}, backend='native', offload_optimizer=True): FSDP2 offloads "
                         "parameters, gradients and the optimizer step together; set offload_parameters=True "
                         "(which implies the optimizer), or use backend='deepspeed'.")
    return _NativeFSDP


def _split_options(who: str, options: dict[str, Any], *targets: tuple[str, Any]) -> list[dict[str, Any]]:
    """Sort ``options`` by the callable whose signature names them; refuse the ones nobody takes."""
    parts: list[dict[str, Any]] = [{} for _ in targets]
    accepted: list[str] = []
    for index, (_, target) in enumerate(targets):
        names = [n for n, p in inspect.signature(target).parameters.items()
                 if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        accepted += names
        for key in names:
            if key in options and not any(key in p for p in parts):
                parts[index][key] = options[key]
    unknown = [k for k in options if not any(k in p for p in parts)]
    if unknown:
        where = " and ".join(label for label, _ in targets)
        raise TypeError(f"{who} got an unknown option {unknown[0]!r}; it passes options to {where}, which take: "
                        f"{', '.join(sorted(set(accepted)))}.")
    return parts


def drop_frozen(optimizers: list[Optimizer]) -> None:
    """Remove parameters that do not train from the optimizers' groups (before any step: no state moves).

    A ``configure_optimizers`` over ``self.parameters()`` hands the frozen base of a LoRA model to the optimizer;
    ZeroRedundancyOptimizer would partition (and balance) it, DeepSpeed would flatten it.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p.requires_grad]


# --- DeepSpeed ---------------------------------------------------------------------------------------------------


def _zero_config_fields() -> set[str]:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = set()
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        fields.add(name)
        if field.alias:
            fields.add(field.alias)
    return fields


class _DeepSpeedZeRO(ZeROStrategy, DeepSpeedStrategy):
    """DeepSpeed ZeRO that also runs on the CPU (gloo), with a torch optimizer and Lightning's clipping."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stage, backend, offload_optimizer, offload_parameters, engine_options = self._arguments(*args, **kwargs)
        zero_keys = _zero_config_fields()
        zero_options = {k: v for k, v in engine_options.items()
                        if k in zero_keys and k not in inspect.signature(DeepSpeedStrategy).parameters}
        (strategy_options,) = _split_options(
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
            _skip_shared_memory_op()
        self._init_deepspeed_distributed()

    @override
    def teardown(self) -> None:
        super().teardown()
        _restore_torch_linear()

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
        if any(getattr(c, "adapter_only_checkpoint", False) for c in trainer.callbacks if isinstance(c, AdapterCallback)):
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
        """False: Lightning decides the windows, as under DDP, and the engine follows (see :meth:`backward`).

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
            empty = [i for i, g in enumerate(optimizer.param_groups) if not g["params"]]
            if empty:
                raise ValueError(
                    f"{self._name()}: parameter group {empty[0]} of the optimizer holds no parameter that trains "
                    "(e.g. a no-decay group of frozen biases under LoRA); DeepSpeed cannot partition an empty group. "
                    "Build the groups from the parameters with requires_grad=True in configure_optimizers."
                )
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


def _restore_torch_linear() -> None:
    """DeepSpeed's ZeRO-3 replaces ``torch.nn.functional.linear`` for the whole process ("This will persist unless
    manually reset"): every later ``F.linear`` would run DeepSpeed's autograd function, which fails on the DTensors
    of a native strategy run later in the same process. Put torch's own back when the fit ends."""
    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(module, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None and torch.nn.functional.linear is not original:
        torch.nn.functional.linear = original


def _skip_shared_memory_op() -> None:
    """DeepSpeed compiles a shared-memory collective (about a minute) the first time it starts on the CPU; the
    gloo collectives it falls back to are the ones the rest of torch.distributed uses."""
    import deepspeed.comm.torch  # noqa: F401  (the module whose builder is replaced)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


# --- native stage 1: DDP + ZeroRedundancyOptimizer ----------------------------------------------------------------


class _NativeZeRO1(ZeROStrategy, DDPStrategy):
    """DDP whose optimizers are wrapped in ``ZeroRedundancyOptimizer`` (each rank steps its share of them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stage, backend, offload_optimizer, offload_parameters, engine_options = self._arguments(*args, **kwargs)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        for key in ("params", "optimizer_class", "process_group", "module", "device_ids", "output_device",
                    "overlap_with_ddp"):
            if key in engine_options:
                raise TypeError(f"{self._name()}: {key} is set by the strategy.")
        strategy_options, self._zero_options, ddp_options = _split_options(
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
            _rebind(config.scheduler, wrapped)
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


def _rebind(scheduler: Any, wrapped: dict[int, Optimizer]) -> None:
    """Point a scheduler, and the schedulers it chains (SequentialLR, ChainedScheduler), at the new optimizer."""
    if id(getattr(scheduler, "optimizer", None)) in wrapped:
        scheduler.optimizer = wrapped[id(scheduler.optimizer)]
    for child in getattr(scheduler, "_schedulers", []):
        _rebind(child, wrapped)


# --- native stages 2 and 3: FSDP2 ---------------------------------------------------------------------------------


class _NativeFSDP(ZeROStrategy, ModelParallelStrategy):
    """FSDP2 ``fully_shard`` over all ranks (stage 3 reshards after forward, stage 2 keeps parameters gathered)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stage, backend, offload_optimizer, offload_parameters, engine_options = self._arguments(*args, **kwargs)
        from torch.distributed.fsdp import fully_shard

        strategy_options, self._shard_options = _split_options(
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
        for unit in _units(module):
            fully_shard(unit, **options)
        fully_shard(module, **options)

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
        return _load_partial(path, self.model, self.optimizers, {k: v for k, v in model_state.items() if k in saved},
                             metadata)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirected("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirected("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirected("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirected("predict_step", *args, **kwargs)

    def _redirected(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a step hook through the root module's ``__call__``: FSDP2 gathers the root unit's parameters in
        its forward hooks, which a direct ``lightning_module.training_step(...)`` call would skip."""
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)


def _load_partial(path: Path, module: nn.Module, optimizers: list[Optimizer], state: dict[str, Any],
                  metadata: dict[str, Any]) -> dict[str, Any]:
    """Load a distributed checkpoint that holds only ``state``'s keys of the model, and the optimizer states."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    load({"state_dict": state}, checkpoint_id=path)
    module.load_state_dict(state, strict=False)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        load(optimizer_state, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key],
                                 options=StateDictOptions(cpu_offload=True))
    return metadata


def _units(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 units below the root, innermost first: each LoRA layer's frozen base, then each repeated block."""
    units: list[nn.Module] = []
    seen: set[int] = set()
    for layer in module.modules():
        if isinstance(layer, LoRALayer) and any(True for _ in layer.base_layer.parameters()):
            units.append(layer.base_layer)
            seen.add(id(layer.base_layer))
    blocks = [(name.count("."), block) for name, container in module.named_modules()
              if isinstance(container, nn.ModuleList) for block in container]
    # Deepest first: an inner block list (MoE experts in a layer, T5's layer in a block) is sharded before the
    # block around it, as fully_shard needs.
    for _, block in sorted(blocks, key=lambda item: -item[0]):
        if id(block) not in seen and any(p.numel() for p in block.parameters()):
            units.append(block)
            seen.add(id(block))
    return units


def _register() -> None:
    entries = {
        "zero1": ("ZeRO stage 1 on DeepSpeed", {"stage": 1}),
        "zero2": ("ZeRO stage 2 on DeepSpeed", {"stage": 2}),
        "zero3": ("ZeRO stage 3 on DeepSpeed", {"stage": 3}),
        "zero2_offload": ("ZeRO stage 2 on DeepSpeed, optimizer in CPU memory", {"stage": 2, "offload_optimizer": True}),
        "zero3_offload": ("ZeRO stage 3 on DeepSpeed, parameters and optimizer in CPU memory",
                          {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
        "zero1_native": ("ZeRO stage 1: DDP + ZeroRedundancyOptimizer", {"stage": 1, "backend": "native"}),
        "zero2_native": ("ZeRO stage 2: FSDP2, no reshard after forward", {"stage": 2, "backend": "native"}),
        "zero3_native": ("ZeRO stage 3: FSDP2", {"stage": 3, "backend": "native"}),
    }
    for name, (description, params) in entries.items():
        StrategyRegistry.register(name, ZeROStrategy, description=description, override=True, **params)


_register()
