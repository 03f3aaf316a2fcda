"""Lightning glue every callback shares: refusing a resume with other settings, work done on rank 0 alone, and
patches of objects the callbacks do not own (Lightning's train-loader request and accumulation decisions, a
LightningModule's ``configure_optimizers``) undone at teardown.

The train loader as a callback reads and replaces it is in `_train_loader`, the
trainer's accumulation as a callback sees and replaces it in `_accumulation`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_peft._hardware import cpu_bf16_is_native

T = TypeVar("T")


def refuse_changed_settings(
    who: str, saved: dict[str, Any], now: dict[str, Any], ignored: tuple[str, ...] = ()
) -> None:
    """Raise if a resumed callback's settings differ from the checkpoint's (``ignored``: settings that only steer
    training and may change on resume). Called from a callback's ``load_state_dict``."""
    differing = [k for k in saved if k not in ignored and saved[k] != now.get(k)]
    if differing:
        raise ValueError(
            f"{who}: the checkpoint was trained with " + ", ".join(f"{k}={saved[k]!r}" for k in differing)
            + "; this run has " + ", ".join(f"{k}={now.get(k)!r}" for k in differing)
            + ". Resume with the checkpoint's settings, or start a new run without ckpt_path."
        )


def on_rank_zero(trainer: pl.Trainer, work: Callable[[], T], who: str, what: str, share: bool = False) -> T | None:
    """Run ``work`` on global rank 0; if it fails there, every rank raises (none is left waiting in a collective).

    ``share``: every rank returns rank 0's result (broadcast); otherwise the other ranks return None.
    """
    error: Exception | None = None
    result = None
    if trainer.is_global_zero:
        try:
            result = work()
        except Exception as caught:  # re-raised below, after the other ranks heard of it
            error = caught
    message = None if error is None else f"{type(error).__name__}: {error}"
    shared, failure = trainer.strategy.broadcast((result if share else None, message), src=0)
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"{who}: {what} on rank 0 failed ({failure}); stopping this rank as well.")
    return shared if share else result


# ------------------------------------------------------------------------------------- patches of Lightning's loops

_MISSING = object()


class Patches:
    """Attributes a callback sets on objects it does not own, for one fit (or one ``with`` block), undone in reverse
    order.

    Lightning 2.6 has no public hook for some decisions (which train loader to use, when to step and zero under
    accumulation, how a LightningModule builds its optimizers); a callback replaces them on the trainer's loop objects
    or the module (instance attributes) and gives them back at ``teardown`` (and ``on_exception``: Lightning skips
    teardown hooks after an exception). On a class (``Optimizer.add_param_group``), use it as a context manager.
    """

    def __init__(self) -> None:
        self._done: list[tuple[object, str, object]] = []

    def __bool__(self) -> bool:
        return bool(self._done)

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def set(self, owner: object, name: str, value: object) -> None:
        """``owner.name = value``, remembering what ``vars(owner)`` held (nothing: the class's attribute showed)."""
        self._done.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, before in reversed(self._done):
            if before is not _MISSING:
                setattr(owner, name, before)
            elif name in vars(owner):
                delattr(owner, name)
        self._done.clear()


class PatchingCallback(Callback):
    """A callback that patches objects it does not own for one fit, in ``self._patches`` (a `Patches` its
    ``__init__`` makes): given back at ``teardown``, and on an exception (Lightning skips teardown hooks after one)."""

    _patches: Patches

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._patches.undo()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._patches.undo()


def warn_emulated_bf16(who: str, trainer: pl.Trainer) -> None:
    """Warn when a Trainer asks for bf16 on a CPU that only emulates it (no AVX512-BF16 or AMX)."""
    precision, cpu = str(trainer.precision), isinstance(trainer.accelerator, CPUAccelerator)
    if precision.startswith("bf16") and cpu and not cpu_bf16_is_native():
        rank_zero_warn(
            f"{who}: Trainer(precision={precision!r}) on a CPU without native bf16 (no AVX512-BF16 or AMX): "
            "PyTorch emulates it, and a LoRA training step runs many times slower than in float32 (17x measured "
            "on such a CPU). Use precision='32-true' on this machine; bf16 pays on GPUs and on CPUs with "
            "AVX512-BF16/AMX."
        )


def refuse_earlier_model_copies(trainer: pl.Trainer, callback: Callback, who: str, what: str) -> None:
    """Raise if a weight-averaging callback (``StochasticWeightAveraging``, ``WeightAveraging`` / EMA) comes before
    ``callback`` in ``Trainer(callbacks=...)``: it copied the model in its ``setup``, before ``callback`` changes
    the model there, so its average would be of another model (SWA fails later on mismatched shapes)."""
    callbacks = list(trainer.callbacks)
    mine = next((i for i, c in enumerate(callbacks) if c is callback), len(callbacks))
    earlier = [c for c in callbacks[:mine] if isinstance(c, (StochasticWeightAveraging, WeightAveraging))]
    if earlier:
        name = type(earlier[0]).__name__
        raise RuntimeError(
            f"{who}: {name} comes before {who} in Trainer(callbacks=[...]), so it copied the model in its setup "
            f"before {who} added {what}; its average would be of the model without them. Put {who} before {name} in "
            "the callbacks list."
        )
