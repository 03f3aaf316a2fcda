"""The OFT layer: a frozen base layer whose input is rotated by a learned block-diagonal orthogonal matrix, and the
merge of that rotation into the base weight (see `lightning_peft.peft.oft.model` for the technique).

``M = diag(R_1, ..., R_r)`` (n, n), each block ``R_i = cayley(Q_i)`` (b, b) of a skew-symmetric ``Q_i`` whose upper
triangle is row ``i`` of ``oft_R.weight`` (r, b (b - 1) / 2) (one row, shared by every block, with ``block_share``).
Rows act as PEFT's do, ``x -> x M``:

| base layer | rotated (n) | forward | merged |
| --- | --- | --- | --- |
| ``nn.Linear`` | ``in_features`` | ``W (x M) + b`` | ``W' = W M^T`` |
| ``nn.Conv2d`` | ``in_channels * k * k`` | ``conv(x, W M^T) + b`` | ``W' = W M^T`` (``W`` as (out, n)) |
| ``nn.Embedding`` (PEFT: ``oft_embedding_R``) | ``embedding_dim`` | ``E[ids] M`` | ``E' = E M`` |

A linear layer rotates its input (the input-centric form of arXiv:2506.19847: no (n, n) matrix is built); a
convolution rotates its weight (the rotation of every input patch, which is what its merge computes: PEFT 0.21.2
rotates unfolded patches and folds them back, which sums overlapping patches and so differs from its own merge
whenever patches overlap).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .._common import adapter_dtype, compute_dtype, dense_weight
from .._wrapping import InPlaceLayer, Switch
from .config import OFTConfig


def rotated_size(module: nn.Module) -> int:
    """The size OFT rotates for ``module``: a Linear's input features, a Conv2d's ``in_channels * k * k``, an
    Embedding's ``embedding_dim``."""
    if isinstance(module, nn.Conv2d):
        return module.in_channels * module.kernel_size[0] * module.kernel_size[1]
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    return module.in_features


def skew(vectors: Tensor, size: int) -> Tensor:
    """(n, b (b - 1) / 2) upper triangles -> (n, b, b) skew-symmetric matrices."""
    rows, cols = torch.triu_indices(size, size, 1, device=vectors.device)
    upper = vectors.new_zeros(vectors.shape[0], size, size)
    upper[:, rows, cols] = vectors
    return upper - upper.transpose(-2, -1)


def cayley(q: Tensor, neumann_terms: int | None) -> Tensor:
    """(n, b, b) skew-symmetric -> (n, b, b) rotations.

    Exact (``neumann_terms`` None): ``R = (I - Q)(I + Q)^-1``. Neumann (PEFT >= 0.18's series, kept as it is so that
    its files mean the same here): ``R = I + 2 Q + 2 Q^2 + ... + 2 Q^(t-2) + Q^(t-1)`` for ``t`` terms, where
    ``t = 3`` sums the same as ``t = 4`` (its loop always adds ``2 Q^2`` when ``t > 2``). It approximates
    ``(I + Q)(I - Q)^-1``, the transpose of the exact one; both start at the identity.
    """
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    if neumann_terms is None:
        return torch.linalg.solve(eye + q, eye - q, left=False)
    rotation = eye.expand_as(q).clone()
    if neumann_terms > 1:
        rotation = rotation + 2 * q
    if neumann_terms > 2:
        power = q @ q
        rotation = rotation + 2 * power
        for _ in range(3, neumann_terms - 1):
            power = power @ q
            rotation = rotation + 2 * power
        rotation = rotation + power @ q
    return rotation


def rotate_rows(t: Tensor, blocks: Tensor) -> Tensor:
    """``t M`` for ``t`` (..., r * b) and ``M = diag(blocks)`` (blocks (r, b, b)), without building ``M``."""
    r, b, _ = blocks.shape
    return torch.einsum("...rk,rkc->...rc", t.reshape(*t.shape[:-1], r, b), blocks).reshape(t.shape)


class Rotation(nn.Module):
    """The learned rotation of one layer: ``weight`` (blocks, b (b - 1) / 2) holds the skew-symmetric upper triangles
    (one row if shared). Held as ``oft_R`` (``oft_embedding_R`` for an embedding), PEFT's names.

    Args:
        size: The rotated size n.
        block_size: b, dividing n.
        config: The settings (sharing, COFT, the Cayley variant, dropout, initialisation).
        dtype, device: Of the parameter.
    """

    def __init__(self, size: int, block_size: int, config: OFTConfig, dtype: torch.dtype | None,
                 device: torch.device) -> None:
        super().__init__()
        self.size, self.block_size, self.blocks = size, block_size, size // block_size
        self.coft, self.eps, self.dropout = config.coft, config.eps, config.module_dropout
        self.neumann_terms = config.num_cayley_neumann_terms if config.use_cayley_neumann else None
        rows = 1 if config.block_share else self.blocks
        weight = torch.zeros(rows, block_size * (block_size - 1) // 2, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight if config.init_weights else weight.normal_(0.0, 0.1))

    def project_(self) -> None:
        """COFT (arXiv:2306.07280, Sec. 3.3): each block's ``Q`` onto ``||Q||_F <= eps'``, in place (PEFT's, at each
        use). ``eps' = eps / sqrt(rows)`` in float32, as PEFT computes it (so files and steps agree bit for bit)."""
        rows = self.weight.shape[0]
        radius = torch.tensor(self.eps, dtype=torch.float32) / torch.tensor(float(rows)).sqrt()
        with torch.no_grad():
            q = skew(self.weight, self.block_size)
            norm = torch.linalg.matrix_norm(q, keepdim=True)  # (rows, 1, 1), Frobenius
            q = torch.where(norm <= radius, q, radius.to(q.dtype) * (q / norm))
            rows_, cols = torch.triu_indices(self.block_size, self.block_size, 1, device=q.device)
            self.weight.copy_(q[:, rows_, cols])

    def rotations(self, train: bool = False) -> Tensor:
        """The blocks (r, b, b), shared ones repeated; ``train``: with multiplicative dropout."""
        if self.coft:
            self.project_()
        blocks = cayley(skew(self.weight, self.block_size), self.neumann_terms)
        if blocks.shape[0] == 1 and self.blocks > 1:
            return blocks.expand(self.blocks, -1, -1)  # shared: no dropout (PEFT's layer skips it too)
        dropped = int(self.dropout * self.blocks) if train else 0
        if dropped:  # `dropped` random blocks are the identity for this step
            mask = torch.zeros(self.blocks, 1, 1, dtype=blocks.dtype, device=blocks.device)
            mask[torch.randperm(self.blocks, device=blocks.device)[:dropped]] = 1
            eye = torch.eye(self.block_size, dtype=blocks.dtype, device=blocks.device)
            blocks = (1 - mask) * blocks + mask * eye
        return blocks

    def extra_repr(self) -> str:
        shared = ", shared" if self.weight.shape[0] == 1 and self.blocks > 1 else ""
        return f"size={self.size}, blocks={self.blocks}x{self.block_size}{shared}, coft={self.coft}"


class OFTLayer(InPlaceLayer):
    """``base_layer`` (frozen) with its input rotated (an embedding: its output).

    Args:
        base_layer: An ``nn.Linear``, ``nn.Conv2d`` (square kernel, no groups or dilation) or ``nn.Embedding``.
        block_size: b, dividing the rotated size (`rotated_size`).
        config: The settings.
        switch: The model's on/off switch (`disable_oft`); None: the layer's own.
    """

    # Tensor parallelism plans a wrapper that declares this as one unit; empty: it cannot be split (a row-wise base
    # gets its input sharded across the rotation's blocks), so a plan naming an OFT layer is refused at setup.
    tensor_parallel_split: ClassVar[dict[str, str]] = {}

    def __init__(self, base_layer: nn.Module, block_size: int, config: OFTConfig, switch: Switch | None = None) -> None:
        super().__init__(base_layer)
        self.merged = False
        self.switch = switch or Switch()
        self.kind = "conv" if isinstance(base_layer, nn.Conv2d) else \
            "embedding" if isinstance(base_layer, nn.Embedding) else "linear"
        self.key = "oft_embedding_R" if self.kind == "embedding" else "oft_R"
        weight = base_layer.weight
        setattr(self, self.key, Rotation(rotated_size(base_layer), block_size, config, adapter_dtype(weight),
                                         weight.device))

    @property
    def rotation(self) -> Rotation:
        return getattr(self, self.key)

    @property
    def reads_base_weight(self) -> bool:  # a convolution rotates its weight in the forward
        return self.kind == "conv"

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.merged or self.switch.disabled:
            return self.base_layer(x, *args, **kwargs)
        rotation = self.rotation
        blocks = rotation.rotations(self.training)
        if self.kind == "linear":
            rotated = rotate_rows(x.to(blocks.dtype), blocks)  # (..., in): x M
            return self.base_layer(rotated.to(x.dtype), *args, **kwargs)
        if self.kind == "embedding":
            out = self.base_layer(x, *args, **kwargs)
            return rotate_rows(out.to(blocks.dtype), blocks).to(out.dtype)  # (..., dim): E[ids] M
        base = self.base_layer
        weight = dense_weight(base.weight, base)
        rotated = self._rotate_weight(weight, blocks.transpose(-2, -1))  # W M^T
        return base._conv_forward(x, rotated.to(x.dtype), base.bias)

    def _rotate_weight(self, weight: Tensor, blocks: Tensor) -> Tensor:
        """``weight`` times ``diag(blocks)`` on the rotated side, in float32 or wider: a Linear / Conv2d weight (as
        (out, n)) from the right, an Embedding's (vocab, dim) too. Same shape as ``weight``."""
        wide = torch.promote_types(compute_dtype(weight.dtype), blocks.dtype)
        flat = weight.to(wide).reshape(weight.shape[0], -1)  # (out, n): Conv2d (out, C, k, k) -> (out, C k k)
        return rotate_rows(flat, blocks.to(wide)).reshape(weight.shape)

    def merge_blocks(self) -> Tensor:
        """The blocks that right-multiply the base weight when merged: ``R_i^T`` (``W M^T``); an embedding's ``R_i``."""
        with torch.no_grad():
            blocks = self.rotation.rotations()
        return blocks if self.kind == "embedding" else blocks.transpose(-2, -1)

    def merged_weights(self) -> dict[str, Tensor]:
        """The base layer's weight with the rotation folded in: a new tensor in the weight's dtype (the bias is not
        rotated). A layer merged in place returns its weight as it is."""
        base = self.base_layer
        weight = dense_weight(base.weight, base).detach()
        if self.merged:
            return {"weight": weight}
        return {"weight": self._rotate_weight(weight, self.merge_blocks()).to(weight.dtype)}

    def unmerge(self) -> None:
        """Undo `merge`: the weight times the inverse blocks (a (b, b) solve per block; exact up to rounding, also
        for the Neumann series, which is only nearly orthogonal)."""
        if not self.merged:
            return
        weight = self.base_layer.weight.detach()
        inverse = torch.linalg.inv(self.merge_blocks().to(torch.promote_types(compute_dtype(weight.dtype),
                                                                              self.rotation.weight.dtype)))
        self._write({"weight": self._rotate_weight(weight, inverse).to(weight.dtype)})
        self.merged = False
