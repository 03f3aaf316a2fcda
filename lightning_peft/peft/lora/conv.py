"""LoRA on convolutions: ``nn.Conv1d`` (audio), ``nn.Conv2d`` (images), ``nn.Conv3d`` (video), grouped and depthwise
ones included, as Hugging Face PEFT 0.21 adapts them (``peft/tuners/lora/layer.py``, ``_ConvNd``).

Paper: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685 (the update, written for
matrices, is applied to the flattened kernel ``W`` (out, in / g * prod(k))).

Update rule. The base convolution ``W * x`` (``*``: convolution, kernel ``k``, stride, padding, dilation, ``g``
groups) is adapted by adapter ``n`` as two convolutions:

```text
y = W * x + s_n * B_n * (A_n * dropout_n(x))     A_n: Conv(in, r, k) with the base's stride, padding and dilation
                                                   B_n: Conv(r, out, 1, groups=g), r a multiple of g
W' = W + s_n * reshape(B_n @ flatten(A_n))        (out, in, *k): merged only when g = 1
```

``A`` is never grouped and ``B`` has the base's groups (as PEFT builds them), so each group of outputs reads its
``r / g`` channels of ``A``'s output, which has read every input channel. The update therefore reaches inputs a grouped
base weight cannot hold: a grouped layer trains, saves and loads, but cannot be merged (PEFT refuses that merge too).

Shapes: ``lora_A.<n>.weight`` (r, in, *k), ``lora_B.<n>.weight`` (out, r / g, 1, ...), with ``lora_bias`` also
``lora_B.<n>.bias`` (out,); ``k`` has 1, 2 or 3 entries.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._common import compute_dtype
from . import variants
from .layer import LAYER_TYPES, ABLayer

__all__ = ["LoRAConv", "LoRAConv2d", "refuse_rank"]

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)  # by spatial dimensions - 1


def refuse_rank(who: str, name: str, base: nn.Module, rank: int) -> None:
    """Raise if ``rank`` does not split into ``base``'s groups (``B`` is a grouped convolution of ``r`` inputs)."""
    groups = base.groups
    if rank % groups:
        fit = rank + groups - rank % groups
        raise ValueError(
            f"{who}: {name!r} is a {type(base).__name__} with groups={groups}, so the rank must be a multiple of "
            f"{groups} (B is a grouped 1x1 convolution, as in PEFT); got rank={rank}. Use rank={fit}, or "
            f"rank_pattern={{{name.rsplit('.', 1)[-1]!r}: {fit}}}."
        )


class LoRAConv(ABLayer):
    """LoRA for ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d``, grouped ones included (module docstring).

    A mixed batch runs one segment per adapter it uses (convolutions have no batched-weight form in PyTorch).
    """

    dora_variant = variants.ConvDoRA  # DoRA (use_dora=True): any number of spatial dimensions, grouped too
    token_features = None  # a kernel mixes neighbouring positions: a packed batch takes one adapter here

    def add_adapter(self, name: str, rank: int, alpha: float, dropout: float = 0.0, **settings) -> None:
        refuse_rank(type(self).__name__, name, self.base_layer, rank)
        super().add_adapter(name, rank, alpha, dropout, **settings)

    def _create(self, name: str, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        base = self.base_layer
        conv = _CONV_TYPES[base.weight.dim() - 3]
        self.lora_A[name] = conv(
            base.in_channels, rank, base.kernel_size, base.stride, base.padding, base.dilation, bias=False,
            padding_mode=base.padding_mode, device=device, dtype=dtype,
        )
        self.lora_B[name] = conv(rank, base.out_channels, 1, groups=base.groups, bias=self.specs[name].lora_bias,
                                 device=device, dtype=dtype)

    def _delta(self, name: str) -> Tensor:
        base = self.base_layer
        if base.groups > 1:
            raise RuntimeError(
                f"{type(self).__name__}: the base {type(base).__name__} has groups={base.groups}; the update reads "
                "every input channel, which a grouped weight cannot hold, so it cannot be merged (PEFT refuses this "
                "merge too). Keep the adapter unmerged: save it with save_adapter and run it as a LoRA layer."
            )
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        dtype = compute_dtype(a.dtype)
        a, b = a.to(dtype), b.to(dtype).flatten(1)  # (r, in, *k), (out, r)
        return (b @ a.flatten(1)).view(b.shape[0], *a.shape[1:]) * self.specs[name].scaling  # (out, in, *k)

    def _lora_path(self, x: Tensor, name: str) -> Tensor:
        """``B (A dropout(x))`` of adapter ``name``, unscaled: (B, out, *spatial'), in the adapter's dtype."""
        lora_a = self.lora_A[name]
        return self.lora_B[name](lora_a(self.lora_dropout[name](x).to(lora_a.weight.dtype)))

    def _single(self, x: Tensor, result: Tensor, name: str) -> Tensor:
        update = self._lora_path(x, name)  # (B, out, *spatial')
        return result + (update * self.specs[name].scaling).to(result.dtype)


#: Another name of `LoRAConv`, public as ``lightning_peft.peft.LoRAConv2d``.
LoRAConv2d = LoRAConv

LAYER_TYPES.update(dict.fromkeys(_CONV_TYPES, LoRAConv))
