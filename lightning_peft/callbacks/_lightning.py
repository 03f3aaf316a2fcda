"""Lightning glue every callback shares: refusing a resume with other settings, and work done on rank 0 alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import lightning.pytorch as pl

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
