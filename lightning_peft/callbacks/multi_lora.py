"""``MultiLoRA`` callback: several named LoRA adapters on one model, each batch routed per sample.

The math lives in :mod:`lightning_peft.peft.multi_lora`; this callback decides when to call it:

- ``setup``: :func:`~lightning_peft.peft.inject_lora` for the first adapter, :func:`~lightning_peft.peft.add_adapter`
  for the others (before ``configure_optimizers``, so the optimizer holds every adapter), then ``active`` (default:
  the first) becomes the active adapter. A model that already has exactly these adapters (a later ``validate`` /
  ``test``, a restored checkpoint) is used as it is;
- every batch (training, validation, test, predict): ``batch[routing_key]`` gives each sample its adapter, by name or
  by integer id (the position in ``adapters``; ``-1`` or None: the base model). A batch without the key uses the
  active adapter. The key stays in the batch; :class:`~lightning_peft.modules.HFSequenceClassifier` passes only model
  inputs to its model. Per-adapter sample counts are logged as ``<stage>_adapter_samples/<name>`` (epoch sums);
- checkpoints record the adapters as the ``LoRA`` callback's do (``adapter_only_checkpoint`` likewise), so
  ``Trainer.fit(ckpt_path=...)`` and ``load_from_checkpoint`` rebuild all of them; resuming with other adapters is
  refused, naming the difference.

``MergeOnSave`` exports every adapter's folder (PEFT's multi-adapter layout) and the merged model of one
(``MergeOnSave(adapter_name=...)``, default: the active one).

YAML::

    trainer:
      callbacks:
        - class_path: lightning_peft.callbacks.MultiLoRA
          init_args:
            adapters:
              news: {rank: 8, alpha: 16, target_modules: [query, value]}
              sport: {rank: 4, alpha: 8, target_modules: [query, key, value]}
            modules_to_save: [classifier]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_peft._seams import data_parallel, refuse, splits_layers, strategy_family, tensor_parallel_size
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._checkpoint import (
    AdapterCallback,
    refuse_changed_settings,
    watch_checkpoint_loads,
)
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.peft.lora import LoRAConfig, as_config, inject_lora, lora_spec, trainable_parameters
from lightning_peft.peft.multi_lora import add_adapter, set_adapter


class MultiLoRA(AdapterCallback):
    """Inject several named LoRA adapters at ``setup`` and route every batch per sample.

    Args:
        adapters: ``{name: LoRA settings}``; the settings are those of the ``LoRA`` callback (``rank``, ``alpha``,
            ``dropout``, ``target_modules``, ``rank_pattern``, ``use_rslora``, ...), without ``modules_to_save``
            and ``bias`` (shared by every adapter: see below).
        routing_key: The batch entry that names each sample's adapter (a list of names, or integer ids).
        active: The adapter of batches without ``routing_key`` (default: the first).
        modules_to_save: Modules trained and saved in full, shared by every adapter (e.g. ``["classifier"]``).
            None: the task head of a Hugging Face task model; ``[]``: none.
        adapter_only_checkpoint: Checkpoints hold only what trains (and buffers), as with ``LoRA``.
        model_attribute: Dotted path of the model inside the LightningModule (as for ``LoRA``).
    """

    who = "MultiLoRA"

    def __init__(
        self,
        adapters: dict[str, dict[str, Any]],
        routing_key: str = "adapter",
        active: str | None = None,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        if not isinstance(adapters, Mapping) or not adapters:
            raise ValueError(
                f"MultiLoRA(adapters={adapters!r}): give a non-empty dict {{name: settings}}, e.g. "
                "{'news': {'rank': 8, 'target_modules': ['query', 'value']}}."
            )
        self.configs: dict[str, LoRAConfig] = {}
        for name, settings in adapters.items():
            who = f"MultiLoRA(adapters[{name!r}])"
            if not isinstance(settings, Mapping):
                raise TypeError(f"{who}: give the adapter's settings as a dict, e.g. {{'rank': 8}}; got {settings!r}.")
            shared = sorted({"modules_to_save", "bias"} & set(settings))
            if shared:
                raise ValueError(f"{who}: {shared[0]} is shared by every adapter; set MultiLoRA({shared[0]}=...) "
                                 "instead of per adapter.")
            self.configs[name] = as_config(None, {**settings, "modules_to_save": modules_to_save}, who)
        if active is not None and active not in self.configs:
            raise ValueError(f"MultiLoRA(active={active!r}): not one of the adapters {list(self.configs)}.")
        self.names = list(self.configs)
        self.routing_key = routing_key
        self.active = active or self.names[0]
        self.adapter_only_checkpoint = adapter_only_checkpoint
        self.model_attribute = model_attribute

    def own_dropout(self) -> float:
        return max((config.dropout for config in self.configs.values()), default=0.0)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        _, model = resolve_target(pl_module, self.model_attribute, "MultiLoRA")
        spec = lora_spec(model)
        if spec is None:
            first, *others = self.names
            inject_lora(model, self.configs[first], adapter_name=first)
            for name in others:
                add_adapter(model, name, self.configs[name])
            set_adapter(model, self.active)
            rank_zero_info(f"MultiLoRA: adapters {self.names} on {type(model).__name__}; {trainable_parameters(pl_module)}")
        else:
            now = {name: config for name, (config, _) in spec.adapters.items()}
            if now != self.configs:
                raise RuntimeError(
                    f"MultiLoRA: {type(model).__name__} already has LoRA adapters {list(now)} with other settings "
                    f"than this callback's {self.names}; use one LoRA or MultiLoRA callback per model, with the "
                    "adapters the model was built with."
                )
        self._routing = lora_spec(model).routing
        watch_checkpoint_loads(pl_module, "MultiLoRA")
        _check_strategy(trainer.strategy)

    def names_of(self, batch: Any) -> list[str | None] | None:
        """Each sample's adapter from ``batch[routing_key]`` (None when the batch has no such entry).

        Raises:
            ValueError: If an entry is neither a known adapter name, nor an id in ``[-1, len(adapters))``, nor None.
        """
        if not isinstance(batch, Mapping) or self.routing_key not in batch:
            return None
        entries = batch[self.routing_key]
        if isinstance(entries, torch.Tensor):
            entries = entries.tolist()
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
            raise ValueError(f"MultiLoRA: batch[{self.routing_key!r}] is {entries!r}; give one adapter name or id "
                             "per sample, as a list or a 1-D tensor.")
        return [self._name(entry) for entry in entries]

    def _name(self, entry: object) -> str | None:
        if entry is None or entry == -1:
            return None
        if isinstance(entry, str) and entry in self.configs:
            return entry
        if isinstance(entry, int) and not isinstance(entry, bool) and 0 <= entry < len(self.names):
            return self.names[entry]
        raise ValueError(
            f"MultiLoRA: batch[{self.routing_key!r}] holds {entry!r}, which names no adapter; give one of "
            f"{self.names}, an id in 0..{len(self.names) - 1} (their order), or -1 / None for the base model."
        )

    def _route(self, pl_module: pl.LightningModule, batch: Any, stage: str) -> None:
        names = self.names_of(batch)
        self._routing.route_to(names)
        if names is None or stage == "predict":
            return
        for name in self.names:
            pl_module.log(f"{stage}_adapter_samples/{name}", float(names.count(name)), on_step=False, on_epoch=True,
                          reduce_fx="sum", batch_size=len(names))

    def _end_routing(self) -> None:
        routing = getattr(self, "_routing", None)
        if routing is not None:
            routing.route_to(None)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._route(pl_module, batch, "train")

    @override
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._route(pl_module, batch, "val")

    @override
    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._route(pl_module, batch, "test")

    @override
    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._route(pl_module, batch, "predict")

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._end_routing()

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._end_routing()

    @override
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._end_routing()

    @override
    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._end_routing()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end_routing()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"adapters": {name: config.to_dict() for name, config in self.configs.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("adapters", {})
        now = self.state_dict()["adapters"]
        if list(saved) != list(now):
            raise ValueError(f"MultiLoRA: the checkpoint was trained with adapters {list(saved)}; this run has "
                             f"{list(now)}. Resume with the checkpoint's adapters, or start a new run without ckpt_path.")
        for name, config in saved.items():
            refuse_changed_settings(f"MultiLoRA (adapter {name!r})", config, now[name], ("dropout", "init"))


def _check_strategy(strategy: object) -> None:
    """Refuses sharded data parallelism, tensor and pipeline parallelism; lets DDP reduce the adapters a rank's
    batch did not use."""
    if tensor_parallel_size(strategy) > 1:
        raise refuse("MultiLoRA", strategy, "the routed path stacks every adapter's factors into one tensor per layer, "
                     "and the tensor-parallel plan shards some of them (DTensor) but not others",
                     "use LoRA (one adapter) under tensor parallelism, or MultiLoRA under DDP or one process")
    if splits_layers(strategy):
        raise refuse("MultiLoRA", strategy, "the adapter of each sample is set for the whole batch, while the pipeline "
                     "runs the layers on micro-batches of it", "use LoRA (one adapter) under the pipeline, or "
                     "MultiLoRA under DDP or one process")
    sharded = strategy_family(strategy) != "plain" and not getattr(strategy, "averages_missing_gradients", False)
    if sharded and data_parallel(strategy)[0] > 1:
        raise refuse(
            "MultiLoRA", strategy,
            "a rank whose batch routes no sample to an adapter has no gradient for that adapter's parameters, and "
            "this strategy reduces gradients as buffers of the same size on every rank (gloo aborts the process on "
            "the mismatch)", "use DDP, ZeROStrategy(stage=1, backend='native'), tensor or pipeline parallelism "
            "without data parallelism, or one process for several adapters; or train one adapter at a time with LoRA",
        )
    _let_unused_adapters_through(strategy)


def _let_unused_adapters_through(strategy: object) -> None:
    """Under DDP, a rank whose batch routes no sample to an adapter leaves that adapter's parameters without a
    gradient; DDP's reducer then waits for them forever (the other ranks hang in backward). With
    ``find_unused_parameters`` it reduces them as zeros: the average is the one-process gradient."""
    kwargs = getattr(strategy, "_ddp_kwargs", None)
    if isinstance(strategy, DDPStrategy) and isinstance(kwargs, dict) and not kwargs.get("find_unused_parameters"):
        kwargs["find_unused_parameters"] = True
        rank_zero_info("MultiLoRA: DDP set to find_unused_parameters=True (a rank's batch may leave an adapter unused).")
