"""The LoKr layer: a frozen base layer plus ``ΔW``, the scaled Kronecker product of a small and a larger factor
(`lightning_peft.peft.lycoris.layer` applies it; the math is in `lightning_peft.peft.lokr.kron`).

Shapes, as Hugging Face PEFT keeps them (so its files load as they are); ``out = a * b`` and ``in = c * d`` (a group's
input channels) by `lightning_peft.peft.lokr.kron.factorization`, ``k`` the kernel:

| factor | full | low-rank |
| --- | --- | --- |
| ``W1`` (a, c) | ``lokr_w1`` (a, c) | ``lokr_w1_a`` (a, r), ``lokr_w1_b`` (r, c): ``decompose_both`` and ``r < max(a, c) / 2`` |
| ``W2`` (b, d, k) | ``lokr_w2`` (b, d, *k): ``r >= max(b, d) / 2`` | ``lokr_w2_a`` (b, r), ``lokr_w2_b`` (r, d * prod(k)) |
| ``W2``, Tucker | | ``lokr_t2`` (r, r, k1, k2) (Conv1d: (r, r, k, 1)), ``lokr_w2_a`` (r, b), ``lokr_w2_b`` (r, d) |

The Tucker form is taken for a convolution with ``use_effective_conv2d`` and a kernel that is not all ones.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from ..lycoris.config import LycorisConfig
from ..lycoris.layer import LycorisLayer, Switch
from .kron import NAMES, factor_shapes, init_factors, kron_weight


class LoKrLayer(LycorisLayer):
    """``base_layer`` (frozen) plus LoKr's update (the module docstring); the arguments are
    `lightning_peft.peft.lycoris.LycorisLayer`'s. ``rank_dropout_scale`` decides whether the rows
    kept by rank dropout are rescaled."""

    parameter_names: ClassVar[tuple[str, ...]] = NAMES

    def __init__(self, base_layer: nn.Module, r: int, alpha: float, config: LycorisConfig,
                 switch: Switch | None = None) -> None:
        super().__init__(base_layer, r, alpha, config, switch)
        self.rescale_rank_dropout = config.rank_dropout_scale

    @classmethod
    def parameter_shapes(cls, base: nn.Module, r: int, config: LycorisConfig) -> dict[str, tuple[int, ...]]:
        return factor_shapes(tuple(base.weight.shape), r, config.decompose_both, config.decompose_factor,
                             config.use_effective_conv2d)

    def factors(self) -> dict[str, Tensor]:
        """The layer's factors by PEFT's names."""
        return {name: self._parameters[name] for name in self.parameter_names if name in self._parameters}

    def reset_parameters(self, config: LycorisConfig) -> None:
        init_factors(self.factors(), config.init_weights)

    def delta(self) -> Tensor:
        return kron_weight(self.factors(), self.scaling, self.base_layer.weight.shape)
