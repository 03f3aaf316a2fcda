"""The Lightning side of routing each batch per sample to named LoRA adapters (the ``MultiLoRA`` callback's helpers):
reading each sample's adapter from the batch, entering [`route_adapters`][lightning_peft.peft.route_adapters] for the
batch and leaving it after, and the strategies it cannot run under."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_peft._seams import data_parallel, refuse, splits_layers, strategy_family, tensor_parallel_size
from lightning_peft.callbacks._lightning import refuse_changed_settings
from lightning_peft.peft.lora import LoRAAdapter, LoRAConfig, as_config, route_adapters


def adapter_configs(adapters: object, modules_to_save: list[str] | None,
                    quantize: str | None = None) -> dict[str, LoRAConfig]:
    """``MultiLoRA(adapters=...)`` as ``{name: LoRAConfig}``; ``modules_to_save`` and ``quantize`` are shared by
    every adapter."""
    if not isinstance(adapters, Mapping) or not adapters:
        raise ValueError(
            f"MultiLoRA(adapters={adapters!r}): give a non-empty dict {{name: settings}}, e.g. "
            "{'news': {'rank': 8, 'target_modules': ['query', 'value']}}."
        )
    configs: dict[str, LoRAConfig] = {}
    for name, settings in adapters.items():
        who = f"MultiLoRA(adapters[{name!r}])"
        if not isinstance(settings, Mapping):
            raise TypeError(f"{who}: give the adapter's settings as a dict, e.g. {{'rank': 8}}; got {settings!r}.")
        shared = sorted({"modules_to_save", "bias", "quantize"} & set(settings))
        if shared:
            raise ValueError(f"{who}: {shared[0]} is shared by every adapter; set MultiLoRA({shared[0]}=...) "
                             "instead of per adapter.")
        configs[name] = as_config(None, {**settings, "modules_to_save": modules_to_save, "quantize": quantize}, who)
        if configs[name].use_dora:
            raise ValueError(f"{who}: use_dora=True; MultiLoRA routes every batch per sample, which DoRA adapters do "
                             "not support. Train a DoRA adapter with LoRA(use_dora=True) instead.")
    return configs


def refuse_changed_adapters(saved: dict[str, dict], now: dict[str, dict]) -> None:
    """Raise if a resumed ``MultiLoRA`` has other adapters, or other settings for one, than its checkpoint."""
    if list(saved) != list(now):
        raise ValueError(f"MultiLoRA: the checkpoint was trained with adapters {list(saved)}; this run has "
                         f"{list(now)}. Resume with the checkpoint's adapters, or start a new run without ckpt_path.")
    for name, config in saved.items():
        refuse_changed_settings(f"MultiLoRA (adapter {name!r})", config, now[name], LoRAAdapter.training_only)


class RoutesBatches(Callback):
    """Batch hooks: each batch (training, validation, test, predict) runs inside
    [`route_adapters`][lightning_peft.peft.route_adapters] with the adapters ``batch[routing_key]`` names; a batch
    without the key uses the active adapter. A packed batch (``batch["cu_seqlens"]``, as ``SFTDataModule(packing=True)``
    writes it) names one adapter per packed row and is routed per token. Per-adapter sample (row) counts are logged as
    ``<stage>_adapter_samples/<name>``.

    The subclass has ``routing_key``, ``names`` (the adapters in id order) and ``adapted_model``.
    """

    routing_key: str
    names: list[str]
    _routing: contextlib.ExitStack | None = None
    _warned_unrouted = False

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
        if isinstance(entry, str) and entry in self.names:
            return entry
        if isinstance(entry, int) and not isinstance(entry, bool) and 0 <= entry < len(self.names):
            return self.names[entry]
        raise ValueError(
            f"MultiLoRA: batch[{self.routing_key!r}] holds {entry!r}, which names no adapter; give one of "
            f"{self.names}, an id in 0..{len(self.names) - 1} (their order), or -1 / None for the base model."
        )

    def check_routes(self, datamodule: object) -> None:
        """Refuses, at setup, a routing value in the datamodule's rows that names no adapter (``routes()``, as
        `SFTDataModule` gives them with ``routing_field`` equal to ``routing_key``); routed batch by batch, it would
        stop the fit at the first batch holding it, after training on the others."""
        routes = getattr(datamodule, "routes", None)
        if getattr(datamodule, "routing_field", None) != self.routing_key or not callable(routes):
            return
        for value in routes():
            try:
                self._name(value)
            except ValueError:
                raise ValueError(
                    f"MultiLoRA: rows of {type(datamodule).__name__}({getattr(datamodule, 'data_path', '')!s}) name "
                    f"{value!r} in {self.routing_key!r}, which is none of the adapters {self.names} (nor an id in "
                    f"0..{len(self.names) - 1}, nor -1 / null for the base model); fix those rows or add the adapter."
                ) from None

    def _route(self, pl_module: pl.LightningModule, batch: Any, stage: str) -> None:
        self._end_routing()
        names = self.names_of(batch)
        if names is None:
            if stage == "train":
                self._warn_unrouted(batch)
            return
        stack = contextlib.ExitStack()
        # checks the names, the boundaries of a packed batch and that no adapter is merged
        stack.enter_context(route_adapters(self.adapted_model, names, cu_seqlens=self._packed_rows(batch, names)))
        self._routing = stack
        if stage == "predict":
            return
        for name in self.names:
            # Summed over the data-parallel ranks too (MultiLoRA runs only where every rank is one of them).
            pl_module.log(f"{stage}_adapter_samples/{name}", float(names.count(name)), on_step=False, on_epoch=True,
                          reduce_fx="sum", batch_size=len(names), sync_dist=True)

    def _packed_rows(self, batch: Mapping, names: list) -> torch.Tensor | None:
        """A packed batch's ``cu_seqlens`` (its routing entries are then one per packed row). A batch packed without
        them (``position_ids`` restarting at 0 inside a row and no ``attention_mask``: how transformers finds packed
        rows) is refused: routed per sample, all its rows would take the adapter of its first entry."""
        if batch.get("cu_seqlens") is not None:
            return batch["cu_seqlens"]
        positions = batch.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.dim() == 2 and batch.get("attention_mask") is None \
                and bool((positions[:, 1:] == 0).any()):
            raise ValueError(
                f"MultiLoRA: a batch with {self.routing_key!r} entries {names} is packed (its position_ids restart at "
                "0 inside a row, and it has no attention_mask) but has no 'cu_seqlens', so its packed rows cannot be "
                "told apart: routed per sample, every row of a sequence would take one adapter. Add the row "
                "boundaries as batch['cu_seqlens'] with one routing entry per packed row (SFTDataModule(packing=True, "
                "routing_field=...) writes both)."
            )
        return None

    def _warn_unrouted(self, batch: Any) -> None:
        """Once: a training batch without the key trains the active adapter alone (a ``routing_key`` typo would train
        one adapter of several, silently)."""
        if self._warned_unrouted or len(self.names) < 2:
            return
        self._warned_unrouted = True
        entries = f"its entries: {list(batch)}" if isinstance(batch, Mapping) else f"a {type(batch).__name__}"
        rank_zero_warn(
            f"MultiLoRA: a training batch has no {self.routing_key!r} entry ({entries}), so it trains the active "
            f"adapter {getattr(self, 'active', None)!r} alone, and the others get no gradient from it. Name each "
            f"sample's adapter in batch[{self.routing_key!r}], or set routing_key= to the entry that does.",
            category=UserWarning,
        )

    def _end_routing(self) -> None:
        stack, self._routing = self._routing, None
        if stack is not None:
            stack.close()

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


def check_strategy(strategy: object) -> None:
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
    let_unused_adapters_through(strategy)


def let_unused_adapters_through(strategy: object) -> None:
    """Under DDP, a rank whose batch routes no sample to an adapter leaves that adapter's parameters without a
    gradient; DDP's reducer then waits for them forever (the other ranks hang in backward). With
    ``find_unused_parameters`` it reduces them as zeros: the average is the one-process gradient."""
    kwargs = getattr(strategy, "_ddp_kwargs", None)
    if isinstance(strategy, DDPStrategy) and isinstance(kwargs, dict) and not kwargs.get("find_unused_parameters"):
        kwargs["find_unused_parameters"] = True
        rank_zero_info("MultiLoRA: DDP set to find_unused_parameters=True (a rank's batch may leave an adapter unused).")
