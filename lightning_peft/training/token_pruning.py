"""Token pruning during training: the annealing ramp that phases it in, and the measure of the work it leaves.

The rule itself (which tokens a layer keeps) is [`lightning_peft.nn.TokenPruner`][lightning_peft.nn.TokenPruner],
applied inside [`lightning_peft.nn.TransformerEncoder`][lightning_peft.nn.TransformerEncoder]; this module is what a
training loop (or the ``TokenPruning`` callback) adds around it.

Annealing: the pruner's scale at optimizer step ``t`` grows linearly from 0 (no pruning) to 1 (the configured keep
ratios) over ``A = anneal_fraction * total_steps`` steps:

```text
scale(t) = min(1, t / A)        (1 throughout when A = 0)
effective keep ratio of layer i = 1 - scale(t) * (1 - r_i)
```

Kept share (`KeptTokenShare`): the share of the token-layer work left, the real tokens leaving each layer
summed over layers and samples, over ``num_layers`` times the real tokens entering the encoder (1.0 without pruning).
Shapes: ``input_ids`` ``(B, T)``, ``attention_mask`` ``(B, T)``; each layer's kept counts ``(B,)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["KeptTokenShare", "anneal_scale", "anneal_steps"]


def anneal_scale(step: int, anneal_steps: float) -> float:
    """``min(1, step / anneal_steps)``: the pruner's scale at optimizer step ``step``; 1.0 when ``anneal_steps`` is 0.

    Examples:
        >>> [round(anneal_scale(t, 3.0), 4) for t in range(5)]
        [0.0, 0.3333, 0.6667, 1.0, 1.0]
    """
    return 1.0 if anneal_steps <= 0 else min(1.0, step / anneal_steps)


def anneal_steps(anneal_fraction: float, total_steps: float, who: str = "anneal_steps") -> float:
    """``A = anneal_fraction * total_steps``, the length of the ramp in optimizer steps.

    Raises:
        ValueError: If ``total_steps`` is infinite (a run without an end in steps) and ``anneal_fraction > 0``.

    Examples:
        >>> anneal_steps(0.3, 20)
        6.0
    """
    if anneal_fraction == 0.0:
        return 0.0
    if not math.isfinite(total_steps):
        raise ValueError(
            f"{who}(anneal_fraction={anneal_fraction}): the trainer's estimated_stepping_batches is {total_steps}, so "
            "the annealing has no length; set Trainer(max_epochs=...) or Trainer(max_steps=...), or anneal_fraction=0."
        )
    return anneal_fraction * total_steps


class KeptTokenShare:
    """Records the real tokens entering each encoder (`hook`, a forward pre-hook with kwargs) and gives the kept
    share of their last forward (`share`)."""

    def __init__(self) -> None:
        self._entering: dict[int, tuple[Tensor, int]] = {}  # id(encoder) -> (real tokens, samples) of its last forward

    def clear(self) -> None:
        self._entering = {}

    def hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook on an encoder: records the real tokens entering it and the batch size."""
        input_ids = args[0] if args else kwargs.get("input_ids")
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        if not isinstance(input_ids, Tensor):
            return
        tokens = mask.detach().bool().sum() if isinstance(mask, Tensor) else torch.tensor(input_ids.numel())
        self._entering[id(module)] = (tokens, input_ids.shape[0])

    def share(self, encoders: Iterable[Any]) -> tuple[Tensor, int] | None:
        """``(share, samples)`` of the last forward of ``encoders`` (each with ``layers`` and ``last_kept_tokens``, as
        ``TransformerEncoder``); None before any forward."""
        kept: Tensor | float = 0.0
        entering: Tensor | float = 0.0
        samples = 0
        for encoder in encoders:
            if id(encoder) not in self._entering:
                continue
            tokens, batch = self._entering[id(encoder)]
            layers = len(encoder.layers)
            counts = encoder.last_kept_tokens  # empty when no layer pruned
            kept = kept + (torch.stack([c.sum() for c in counts]).sum() if counts else tokens * layers)
            entering = entering + tokens * layers
            samples = max(samples, batch)
        if not samples:
            return None
        return torch.as_tensor(kept, dtype=torch.float32) / entering, samples
