"""The pipeline's logging: what ``training_step`` logs on the last stage, per micro-batch, combined as one process would
log it for the whole batch and replayed on every rank
([`PipelineStrategy`][lightning_peft.strategies.PipelineStrategy])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

__all__ = ["LogRecorder", "replay"]


_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


def _reduction(reduce_fx: Any) -> str:
    """Lightning's ``reduce_fx`` (a name or ``torch.mean`` / ``sum`` / ``max`` / ``min``) as one of those names."""
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
    return _REDUCTIONS.get(name, "mean")


class LogRecorder:
    """Stands in for ``LightningModule.log`` while the last stage runs the module's steps; replays one value per
    name: what one process would log for the whole batch.

    Each call is weighted by its ``batch_size`` (or, as Lightning does, the size of the batch the step was given:
    ``self.batch``). Per ``reduce_fx``: ``mean`` gives the weighted mean of the calls, ``sum`` their sum, ``max`` /
    ``min`` their maximum / minimum; the replayed call carries the total batch size, so Lightning's epoch mean is
    weighted by samples, as on one process.
    """

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self.batch: Any = None  # the (micro-)batch the step being recorded was given
        self.calls: dict[str, dict[str, Any]] = {}
        self._names = {id(m): n for n, m in module.named_modules()}

    def __call__(self, name: str, value: Any, *args: Any, batch_size: int | None = None, **kwargs: Any) -> None:
        if args:
            raise TypeError(f"PipelineStrategy: log({name!r}, ...) got positional options {args!r}; pass them by name.")
        kind = _reduction(kwargs.get("reduce_fx", "mean"))
        entry = self.calls.setdefault(name, {"kwargs": kwargs, "value": None, "weight": 0, "metric": None,
                                             "kind": kind})
        if isinstance(value, nn.Module):  # a torchmetrics Metric: replayed as the same-named metric of every rank
            entry["metric"] = self._names[id(value)]
            return
        weight = batch_size if batch_size is not None else self._inferred_batch_size()
        number = float(value.detach().float() if isinstance(value, Tensor) else value)
        previous = entry["value"]
        if kind == "mean":
            number *= weight
        if previous is not None:
            number = {"mean": previous + number, "sum": previous + number, "max": max(previous, number),
                      "min": min(previous, number)}[kind]
        entry.update(value=number, weight=entry["weight"] + weight, kwargs=kwargs)

    def _inferred_batch_size(self) -> int:
        from lightning.pytorch.utilities.data import extract_batch_size

        try:
            return int(extract_batch_size(self.batch))
        except Exception:  # noqa: BLE001 -- no tensor to read a size from: Lightning's fallback, 1
            return 1

    @contextlib.contextmanager
    def recording(self, batch: Any = None) -> Iterator[None]:
        self.batch = batch
        self.module.log = self  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.module.log

    def summary(self) -> list[tuple[str, Any, dict[str, Any], int]]:
        out = []
        for name, entry in self.calls.items():
            if entry["metric"] is not None:
                out.append((name, ("metric", entry["metric"]), entry["kwargs"], 0))
            else:
                value = entry["value"] / max(entry["weight"], 1) if entry["kind"] == "mean" else entry["value"]
                out.append((name, value, entry["kwargs"], entry["weight"]))
        return out


def replay(module: pl.LightningModule, calls: list[tuple[str, Any, dict[str, Any], int]]) -> None:
    """Logs the recorded values on every rank. They are the same on every rank (broadcast from the last stage), and
    the ranks of a pipeline are one data-parallel replica: ``sync_dist`` is dropped (it would sum a ``reduce_fx="sum"``
    value over the stages)."""
    modules = dict(module.named_modules())
    for name, value, kwargs, weight in calls:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("sync_dist", "sync_dist_group")}
        if isinstance(value, tuple):
            module.log(name, modules[value[1]], **kwargs)
        else:
            module.log(name, torch.tensor(value), batch_size=max(weight, 1), **kwargs)
