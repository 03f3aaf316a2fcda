"""``ZeROStrategy``: ZeRO stages 1, 2 and 3 on DeepSpeed or on native torch.distributed, PEFT-aware.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", arXiv:1910.02054)
removes the redundancy of data parallelism: each of the ``N`` ranks keeps ``1/N`` of

| stage | partitioned | DeepSpeed (``backend="deepspeed"``) | native (``backend="native"``) |
| --- | --- | --- | --- |
| 1 | optimizer state | ZeRO stage 1 | DDP + ``ZeroRedundancyOptimizer`` |
| 2 | + gradients | ZeRO stage 2 | FSDP2 ``fully_shard``, parameters kept gathered from forward to backward |
| 3 | + parameters | ZeRO stage 3 | FSDP2 ``fully_shard``, parameters resharded after forward |

Per rank, for ``P`` trained parameters with Adam in float32 (4 bytes each for weights, gradients and each of the two
moments): DDP holds ``4P + 4P + 8P``; stage 1 ``4P + 4P + 8P/N``; stage 2 ``4P + 4P/N + 8P/N``; stage 3
``(4P + 4P + 8P)/N``, plus the engines' own buffers (DeepSpeed keeps a float32 master copy of its partition).
The frozen base of a LoRA model holds no gradient and no optimizer state on any backend: frozen parameters are
removed from the optimizer before the engine sees it, so optimizer state and gradients are those of the adapter.

With FSDP2 each adapter wrapper's frozen ``base_layer`` is its own unit and the repeated blocks (the children of
every ``nn.ModuleList``) are units holding the adapter's parameters (`lightning_peft.strategies.zero_native`).

This class is a front: ``ZeROStrategy(stage=3, backend="native")`` returns the backend's strategy (a
``DeepSpeedStrategy``, ``DDPStrategy`` or ``ModelParallelStrategy`` subclass, defined in `zero_deepspeed` and
`zero_native`), which is also a ``ZeROStrategy``. The pure helpers are in `lightning_peft.parallel.zero`. Importing
[`lightning_peft.strategies`][lightning_peft.strategies] registers ``zero1``, ``zero2``, ``zero3`` (DeepSpeed),
``zero2_offload``, ``zero3_offload`` and ``zero1_native``, ``zero2_native``, ``zero3_native`` in Lightning's strategy
registry.

YAML:

```yaml
trainer:
  strategy:
    class_path: lightning_peft.strategies.ZeROStrategy
    init_args: {stage: 3, backend: native}
```
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any, ClassVar, Literal

from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_peft._checkpoint_io import AtomicCheckpoints
from lightning_peft._checks import choice, integer

__all__ = ["ZeROStrategy"]

Backend = Literal["deepspeed", "native"]
DEEPSPEED_INSTALL = ("pip install 'lightning-peft[deepspeed]' (DeepSpeed builds from source: install torch first, "
                     "then pip install --no-build-isolation deepspeed)")


class ZeROStrategy(AtomicCheckpoints, Strategy):
    """ZeRO stage 1, 2 or 3 on DeepSpeed or native torch.distributed; returns the backend's strategy.

    Its arguments are those of [`__new__`][lightning_peft.strategies.ZeROStrategy.__new__] (below), which picks the
    backend's class.
    """

    stage: int
    backend: str
    # The backend classes (zero_deepspeed, zero_native) register themselves under their ``_zero_kind`` when they
    # are defined; importing lightning_peft.strategies defines them.
    _zero_kind: ClassVar[str | None] = None
    _backends: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("_zero_kind"):
            ZeROStrategy._backends[cls._zero_kind] = cls

    def __new__(
        cls,
        stage: int = 2,
        backend: Backend = "deepspeed",
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        options: dict[str, Any] | None = None,
        **engine_options: Any,
    ) -> ZeROStrategy:
        """Checks the arguments that need no Trainer and returns an instance of the backend's strategy class.

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
                (``find_unused_parameters``) and ``ZeroRedundancyOptimizer`` ones (``parameters_as_bucket_view``).
                Native stages 2 and 3: ``ModelParallelStrategy`` arguments (``save_distributed_checkpoint``,
                ``timeout``) and ``fully_shard`` ones (``mp_policy``).
        """
        # The one signature of the front: LightningCLI (jsonargparse) and inspect.signature read a class's own
        # __new__, and a backend's __init__ binds its arguments to it (_arguments). Python then calls the returned
        # backend class's __init__ with the same arguments.
        if cls is ZeROStrategy:
            cls = _backend_class(stage, backend, offload_optimizer, offload_parameters)
        return super().__new__(cls)

    def _arguments(self, *args: Any, **kwargs: Any) -> tuple[int, str, bool, bool, dict[str, Any]]:
        """The front's arguments (a backend's ``__init__`` gets what ``ZeROStrategy(...)`` was called with)."""
        bound = inspect.signature(ZeROStrategy.__new__).bind(type(self), *args, **kwargs)
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
    integer("ZeROStrategy", "stage", stage, minimum=1, maximum=3,
            meaning="1: optimizer state partitioned, 2: + gradients, 3: + parameters")
    choice("ZeROStrategy", "backend", backend, ("deepspeed", "native"))
    if backend == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            raise ImportError(f"ZeROStrategy(stage={stage}, backend='deepspeed') needs DeepSpeed, which is not "
                              f"installed: {DEEPSPEED_INSTALL}. Or use backend='native' (torch.distributed only).")
        if offload_parameters and stage != 3:
            raise ValueError(f"ZeROStrategy(stage={stage}, offload_parameters=True): DeepSpeed offloads parameters "
                             "only at stage 3 (parameters are partitioned only there). Use stage=3, or "
                             "offload_optimizer=True.")
        return ZeROStrategy._backends["deepspeed"]
    if stage == 1:
        if offload_optimizer or offload_parameters:
            raise ValueError("ZeROStrategy(stage=1, backend='native', offload_...=True): ZeroRedundancyOptimizer "
                             "has no offload. Use backend='deepspeed' (offload_optimizer), or stage 2/3 native "
                             "with offload_parameters=True (FSDP2's CPU offload).")
        return ZeROStrategy._backends["zero1"]
    if offload_optimizer and not offload_parameters:
        raise ValueError(f"ZeROStrategy(stage={stage}, backend='native', offload_optimizer=True): FSDP2 offloads "
                         "parameters, gradients and the optimizer step together; set offload_parameters=True "
                         "(which implies the optimizer), or use backend='deepspeed'.")
    return ZeROStrategy._backends["fsdp"]


def split_options(who: str, options: dict[str, Any], *targets: tuple[str, Any]) -> list[dict[str, Any]]:
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
