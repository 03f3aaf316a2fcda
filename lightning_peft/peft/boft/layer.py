"""The BOFT layer: a frozen ``nn.Linear`` / ``nn.Conv2d`` whose input is rotated by a product of butterfly-permuted
block-diagonal rotations, and whose output is rescaled (see `lightning_peft.peft.boft.model` for the technique).

For ``m`` butterfly factors over ``n`` rotated features in ``D`` blocks of ``b``:

```text
M = F_(m-1) ... F_1 F_0,   F_i = P_i diag(R_i1, ..., R_iD) P_i^T,   R_ij = (I - S)(I + S)^-1,  S = (A_ij - A_ij^T) / 2
y = s ⊙ (W (x M)) + b                 merged: W' = s ⊙ (W M^T)   (a Conv2d: W as (out, in * k * k))
```

``A = boft_R`` (m, D, b, b), ``s = boft_s`` ((out, 1); a Conv2d's (1, out)), PEFT's names and shapes. ``P_i`` is
PEFT's butterfly permutation of level ``i`` (`butterfly_order`): within each run of ``b * 2**i`` features, the
half-blocks of size ``b / 2`` at even positions first, then the odd ones; ``P_0`` is the identity when ``m = 1``.
No ``n x n`` matrix is built: a permutation is an index, a block-diagonal factor a batched product.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .._common import adapter_dtype, compute_dtype, dense_weight
from .._wrapping import InPlaceLayer, Switch
from ..oft.layer import rotate_rows, rotated_size
from .config import BOFTConfig


def butterfly_order(size: int, blocks: int, half: int, factors: int) -> Tensor:
    """PEFT's ``block_butterfly_perm``: the index ``idx`` of ``P`` (``P[k, idx[k]] = 1``) for ``blocks`` runs over
    ``size`` features, moving half-blocks of ``half``; the identity for a single factor."""
    if factors == 1:
        return torch.arange(size)
    run = size // blocks
    parts = run // half
    order = torch.cat([torch.arange(p * half, (p + 1) * half) for p in [*range(0, parts, 2), *range(1, parts, 2)]])
    return torch.cat([start + order for start in range(0, size, run)])


def cayley(a: Tensor) -> Tensor:
    """(..., b, b) any matrices -> rotations ``(I - S)(I + S)^-1`` of their skew-symmetric parts ``S``."""
    q = 0.5 * (a - a.transpose(-2, -1))
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve(eye + q, eye - q, left=False)


class BOFTLayer(InPlaceLayer):
    """``base_layer`` (frozen) with its input rotated by the butterfly product and its output scaled.

    Args:
        base_layer: An ``nn.Linear`` or ``nn.Conv2d`` (square kernel, no groups or dilation).
        block_size: b, with ``blocks * b`` the rotated size (`rotated_size`).
        config: The settings (factors, dropout, initialisation).
        switch: The model's on/off switch (`disable_boft`); None: the layer's own.
    """

    tensor_parallel_split: ClassVar[dict[str, str]] = {}  # a plan naming it is refused (see OFTLayer)

    def __init__(self, base_layer: nn.Module, block_size: int, config: BOFTConfig,
                 switch: Switch | None = None) -> None:
        super().__init__(base_layer)
        self.merged = False
        self.switch = switch or Switch()
        self.conv = isinstance(base_layer, nn.Conv2d)
        self.dropout = config.boft_dropout
        size, factors = rotated_size(base_layer), config.boft_n_butterfly_factor
        blocks = size // block_size
        orders = torch.stack([butterfly_order(size, blocks // 2**i, block_size // 2, factors) for i in range(factors)])
        self.register_buffer("order", orders, persistent=False)  # (m, n): idx of P_i
        self.register_buffer("inverse", torch.argsort(orders, dim=-1), persistent=False)
        weight, dtype = base_layer.weight, adapter_dtype(base_layer.weight)
        out = base_layer.out_channels if self.conv else base_layer.out_features
        rotation = torch.zeros(factors, blocks, block_size, block_size, dtype=dtype, device=weight.device)
        scale = torch.ones((1, out) if self.conv else (out, 1), dtype=dtype, device=weight.device)
        if not config.init_weights:
            rotation.normal_(0.0, 0.1)
            scale.normal_(1.0, 0.1)
        self.boft_R = nn.Parameter(rotation)
        self.boft_s = nn.Parameter(scale)

    def rotations(self, train: bool = False) -> Tensor:
        """The blocks (m, D, b, b); ``train``: with PEFT's multiplicative dropout (its draws, in its order)."""
        blocks = cayley(self.boft_R)
        if not (train and self.dropout > 0):
            return blocks
        factors, count, size, _ = blocks.shape
        level = int(torch.randint(0, factors, (1,)).item())
        dropped = (torch.randperm(count) < int(self.dropout * count)).to(blocks.device)  # (D,)
        eye = torch.eye(size, dtype=blocks.dtype, device=blocks.device)
        kept = torch.where(dropped[:, None, None], eye, blocks[level])
        return torch.cat([blocks[:level], kept[None], blocks[level + 1:]])

    def rotate(self, t: Tensor, blocks: Tensor, transposed: bool) -> Tensor:
        """``t M`` (``transposed``: ``t M^T``) for rows ``t`` (..., n)."""
        levels = range(blocks.shape[0]) if transposed else reversed(range(blocks.shape[0]))
        for i in levels:
            rotated = rotate_rows(t[..., self.inverse[i]], blocks[i].transpose(-2, -1) if transposed else blocks[i])
            t = rotated[..., self.order[i]]
        return t

    @property
    def reads_base_weight(self) -> bool:  # a convolution rotates its weight, a linear layer unscales its bias
        return True

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.merged or self.switch.disabled:
            return self.base_layer(x, *args, **kwargs)
        blocks = self.rotations(self.training)
        base = self.base_layer
        if self.conv:
            weight = self._rotated_weight(dense_weight(base.weight, base), blocks, self.boft_s)
            return base._conv_forward(x, weight.to(x.dtype), base.bias)
        out = base(self.rotate(x.to(blocks.dtype), blocks, transposed=False).to(x.dtype), *args, **kwargs)
        scale = self.boft_s.flatten()
        if base.bias is None:
            return (out * scale).to(out.dtype)
        return ((out - base.bias) * scale + base.bias).to(out.dtype)  # the bias is not scaled (PEFT's)

    def _rotated_weight(self, weight: Tensor, blocks: Tensor, scale: Tensor) -> Tensor:
        """``s ⊙ (W M^T)`` in float32 or wider, in ``weight``'s shape."""
        wide = torch.promote_types(compute_dtype(weight.dtype), blocks.dtype)
        flat = weight.to(wide).reshape(weight.shape[0], -1)  # (out, n)
        rotated = self.rotate(flat, blocks.to(wide), transposed=True) * scale.reshape(-1, 1).to(wide)
        return rotated.reshape(weight.shape)

    def merged_weights(self) -> dict[str, Tensor]:
        """The base weight with the rotation and scale folded in (a new tensor in its dtype; the bias is unchanged).
        A layer merged in place returns its weight as it is."""
        base = self.base_layer
        weight = dense_weight(base.weight, base).detach()
        if self.merged:
            return {"weight": weight}
        with torch.no_grad():
            merged = self._rotated_weight(weight, self.rotations(), self.boft_s)
        return {"weight": merged.to(weight.dtype)}

    def merge(self) -> None:
        """Fold the rotation and scale into the base weight in place (`unmerge` takes them out).

        Raises:
            RuntimeError: If the weight is quantized, a scale is zero, or the merged weight is not finite.
        """
        if self.merged:
            return
        if (self.boft_s == 0).any():
            raise RuntimeError("boft_s has a zero entry, so the merged weight could not be divided back (unmerge). "
                               "Use merged_state_dict(model) or unload_boft(model, merge=True).")
        super().merge()

    def unmerge(self) -> None:
        """Undo `merge`: divide the scale out and rotate back (``M`` is orthogonal: ``(M^T)^-1 = M``)."""
        if not self.merged:
            return
        weight = self.base_layer.weight.detach()
        with torch.no_grad():
            blocks = self.rotations()
            wide = torch.promote_types(compute_dtype(weight.dtype), blocks.dtype)
            flat = weight.to(wide).reshape(weight.shape[0], -1) / self.boft_s.reshape(-1, 1).to(wide)
            restored = self.rotate(flat, blocks.to(wide), transposed=False).reshape(weight.shape)
        self._write({"weight": restored.to(weight.dtype)})
        self.merged = False

    def extra_repr(self) -> str:
        factors, blocks, size, _ = self.boft_R.shape
        return f"factors={factors}, blocks={blocks}x{size}"
