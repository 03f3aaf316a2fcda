"""AdaLoRA's rank allocation (Zhang et al., arXiv:2303.10512, section 3.2-3.3), as Hugging Face PEFT 0.21.2's
``RankAllocator`` and ``AdaLoraModel.update_and_allocate`` run it, and the orthogonal regularisation.

After every optimizer step ``t`` (0-based), with the step's gradients still in ``p.grad``:

```text
I(p)   = |p * grad p|                                  every entry of every A, E, B (sensitivity)
Ī(p)  <- beta1 Ī(p) + (1 - beta1) I(p)                 smoothed sensitivity
U(p)  <- beta2 U(p) + (1 - beta2) |I(p) - Ī(p)|         uncertainty
S(p)   = Ī(p) U(p)
score of triplet i = S(E_i) + mean_j S(A_ij) + mean_j S(B_ji)
budget(t) = init_budget                                            t <= tinit
          = int((init - target) (1 - (t - tinit) / (T - tfinal - tinit))^3 + target)   (cubic; mask if t % deltaT == 0)
mask: E_i = 0 for every triplet whose score is <= the (init_budget - budget)-th smallest
t == T - tfinal: the final mask (budget = target), kept as the rank pattern; the scores are reset
t >  T - tfinal: E is masked with that pattern after every step
```

``init_budget`` is the sum of the layers' ranks, ``target = target_r * layers``, ``T = total_step``. Scores are
updated only while ``t < T - tfinal``. The orthogonal regularisation adds
``orth_reg_weight * mean over A and B of ||P P^T - I||_F`` (``A A^T``, ``B^T B``) to the loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .config import AdaLoraConfig, check_schedule
from .layer import SVDLayer

WHO = "AdaLoRA"
FACTORS = ("lora_A", "lora_B", "lora_E")


class RankAllocator:
    """The budget schedule and the sensitivity scores of one AdaLoRA adapter (see the module docstring).

    Args:
        layers: The adapter's layers by module name (all at rank ``init_r``).
        config: Its config (``target_r``, ``tinit``, ``tfinal``, ``deltaT``, ``beta1``, ``beta2``).
        total_step: The number of optimizer steps of the run (``T``).

    Raises:
        ValueError: If the schedule leaves no budgeting phase, or ``target_r`` is not below ``init_r``.
        RuntimeError: If a layer was resized already (a loaded allocation).
    """

    def __init__(self, layers: dict[str, SVDLayer], config: AdaLoraConfig, total_step: int) -> None:
        check_schedule(config, total_step)
        if config.target_r >= config.init_r:
            raise ValueError(f"{WHO}(init_r={config.init_r}, target_r={config.target_r}): target_r must be below "
                             "init_r (the budget shrinks from init_r to target_r per layer).")
        resized = [n for n, layer in layers.items() if layer.rank != config.init_r]
        if resized:
            raise RuntimeError(f"{WHO}: layer {resized[0]!r} has rank {layers[resized[0]].rank}, not init_r="
                               f"{config.init_r}: its budget was allocated already (a file with a rank_pattern). "
                               "Allocate on a fresh adapter.")
        self.layers, self.config, self.total_step = layers, config, total_step
        self.init_budget = sum(layer.rank for layer in layers.values())
        self.target_budget = config.target_r * len(layers)
        self.average: dict[str, Tensor] = {}  # "<module>.<factor>" -> Ī
        self.uncertainty: dict[str, Tensor] = {}  # -> U
        self.rank_pattern: dict[str, list[bool]] | None = None  # "<module>.lora_E" -> kept triplets
        self.last_step: int | None = None

    def budget(self, step: int) -> tuple[int, bool]:
        """(the budget at optimizer step ``step``, whether to mask at it)."""
        c, end = self.config, self.total_step - self.config.tfinal
        if step <= c.tinit:
            return self.init_budget, False
        if step > end:
            return self.target_budget, True
        remaining = 1 - (step - c.tinit) / (end - c.tinit)
        return int((self.init_budget - self.target_budget) * remaining**3 + self.target_budget), step % c.deltaT == 0

    def step(self, step: int) -> dict[str, list[bool]] | None:
        """Run optimizer step ``step``'s allocation (the gradients of that step must be in ``p.grad``); returns the
        rank pattern it set (None: it did not mask)."""
        end = self.total_step - self.config.tfinal
        self.last_step = step
        if step < end:
            self._update_scores()
            budget, mask = self.budget(step)
            if mask:
                self.rank_pattern = self._mask_to_budget(budget)
                return self.rank_pattern
        elif step == end:
            self.rank_pattern = self._mask_to_budget(self.target_budget)
            self.average, self.uncertainty = {}, {}
            return self.rank_pattern
        elif self.rank_pattern is not None:
            self._apply(self.rank_pattern)
        return None

    @torch.no_grad()
    def _update_scores(self) -> None:
        beta1, beta2 = self.config.beta1, self.config.beta2
        factors = list(self._factors())
        when = ("call it after backward and optimizer.step(), before zero_grad (with the AdaLoRA callback and manual "
                "optimization: zero the gradients before backward, not after the step)")
        missing = next((key for key, p in factors if p.grad is None), None)
        if missing is not None:
            raise RuntimeError(f"{WHO}: {missing} has no gradient at the allocation; {when}; every adapted layer "
                               "must be in the loss.")
        if not any(p.grad.any() for _, p in factors):  # zero_grad(set_to_none=False) ran: every score would be 0
            raise RuntimeError(f"{WHO}: every factor's gradient is zero at the allocation, so every triplet would "
                               f"score 0 and be masked (the gradients were zeroed before it ran); {when}.")
        for key, p in factors:
            sensitivity = (p * p.grad).abs()
            average = self.average.get(key, torch.zeros_like(p))
            average = beta1 * average + (1 - beta1) * sensitivity
            self.uncertainty[key] = (beta2 * self.uncertainty.get(key, torch.zeros_like(p))
                                     + (1 - beta2) * (sensitivity - average).abs())
            self.average[key] = average

    def _scores(self) -> dict[str, Tensor]:
        """Each layer's triplet scores (r,), by ``"<module>.lora_E"``."""
        score = {key: self.average[key] * self.uncertainty[key] for key, _ in self._factors()}
        return {f"{name}.lora_E": score[f"{name}.lora_E"].view(-1)
                + (score[f"{name}.lora_A"].mean(dim=1) + score[f"{name}.lora_B"].mean(dim=0))
                for name in self.layers}

    @torch.no_grad()
    def _mask_to_budget(self, budget: int) -> dict[str, list[bool]]:
        scores = self._scores()
        threshold = torch.kthvalue(torch.cat(list(scores.values())), k=self.init_budget - budget)[0].item()
        pattern = {key: (~(score <= threshold)).tolist() for key, score in scores.items()}  # PEFT's test (NaN kept)
        self._apply(pattern)
        return pattern

    @torch.no_grad()
    def _apply(self, pattern: dict[str, list[bool]]) -> None:
        for name, layer in self.layers.items():
            keep = torch.tensor(pattern[f"{name}.lora_E"], device=layer.lora_E.device).unsqueeze(-1)  # (r, 1)
            layer.lora_E.masked_fill_(~keep, 0.0)

    def _factors(self) -> Iterable[tuple[str, Tensor]]:
        for name, layer in self.layers.items():
            for factor in FACTORS:
                yield f"{name}.{factor}", getattr(layer, factor)

    def state_dict(self) -> dict[str, Any]:
        """The scores, the rank pattern and the last step, for a checkpoint (a resume continues bit for bit)."""
        return {"average": dict(self.average), "uncertainty": dict(self.uncertainty),
                "rank_pattern": self.rank_pattern, "last_step": self.last_step, "total_step": self.total_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("total_step") != self.total_step:
            raise ValueError(f"{WHO}: the checkpoint's schedule ran over total_step={state.get('total_step')}, this "
                             f"run over total_step={self.total_step} (the trainer's estimate when not given). Resume with "
                             f"AdaLoRA(total_step={state.get('total_step')}).")
        device = next(iter(self.layers.values())).lora_E.device
        self.average = {k: v.to(device) for k, v in state["average"].items()}
        self.uncertainty = {k: v.to(device) for k, v in state["uncertainty"].items()}
        self.rank_pattern, self.last_step = state["rank_pattern"], state["last_step"]


def orthogonal_regularization(layers: Iterable[SVDLayer]) -> Tensor:
    """PEFT's orthogonal regularisation: the mean of ``||A A^T - I||_F`` and ``||B^T B - I||_F`` over the layers'
    factors (differentiable; multiply by ``orth_reg_weight`` and add it to the loss)."""
    terms = [term for layer in layers for term in layer.orthogonality()]
    return sum(terms) / len(terms)  # summed in PEFT's order (the same roundings)
