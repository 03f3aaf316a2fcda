"""LoRA layers: a frozen base module plus a trainable low-rank update.

Paper: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685.
rsLoRA scaling: Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA", arXiv:2312.03732.

Update rule. A frozen weight ``W`` (out, in) is adapted as::

    W' = W + s * B @ A        A: (r, in), B: (out, r), s = alpha / r   (alpha / sqrt(r) with rsLoRA)
    y  = W x + s * B (A dropout(x))

Only ``A`` and ``B`` train. ``B`` starts at zero, so the adapted model starts equal to the base model.

Shapes (parameters are named and laid out as Hugging Face PEFT names them, so an adapter state dict is a
PEFT adapter up to the ``base_model.model.`` prefix):

=======================  ======================  ====================================================
base layer               base weight             adapter parameters
=======================  ======================  ====================================================
``nn.Linear(in, out)``   (out, in)               ``lora_A.weight`` (r, in), ``lora_B.weight`` (out, r)
``Conv1D`` (transformers) (in, out), transposed  same as Linear; the delta is transposed to merge
``nn.Embedding(V, d)``   (V, d)                  ``lora_embedding_A`` (r, V), ``lora_embedding_B`` (d, r)
``nn.Conv2d(in, out, k)`` (out, in, kh, kw)      ``lora_A``: Conv2d(in, r, k), ``lora_B``: Conv2d(r, out, 1)
=======================  ======================  ====================================================

Each layer wraps its base module (``self.base_layer``); nothing is copied. Merging is explicit
(:meth:`LoRALayer.merge` / :meth:`LoRALayer.unmerge`), never a side effect of ``train()``/``eval()``.
"""

from __future__ import annotations

import math
import sys
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Init = Literal["kaiming", "gaussian"]


def conv1d_type() -> type | None:
    """The ``transformers`` ``Conv1D`` class if ``transformers`` is already imported, else None.

    A model can only contain a ``Conv1D`` once ``transformers`` is imported, so this never imports it.
    """
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def _adapter_dtype(weight: Tensor) -> torch.dtype:
    # Half-precision bases get float32 adapters (as PEFT does): tiny, and they keep small updates.
    return torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Merges are computed in at least float32 and cast back.
    return torch.promote_types(dtype, torch.float32)


class LoRALayer(nn.Module):
    """Base class: a frozen ``base_layer`` plus a low-rank update of its weight.

    Subclasses define the adapter parameters, :meth:`delta_weight` and ``forward``.

    Args:
        base_layer: The module to adapt. It is kept, not copied.
        rank: ``r``, the rank of the update.
        alpha: Scale numerator: the update is multiplied by ``alpha / rank`` (or ``alpha / sqrt(rank)``).
        dropout: Dropout probability on the adapter's input.
        use_rslora: Use the rank-stabilised scale ``alpha / sqrt(rank)``.
    """

    def __init__(self, base_layer: nn.Module, rank: int, alpha: float, dropout: float, use_rslora: bool) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.rank = rank
        self.alpha = alpha
        self.use_rslora = use_rslora
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    @property
    def weight(self) -> Tensor:
        """The base layer's weight: code that reads ``module.weight`` (dtype checks, T5) keeps working."""
        return self.base_layer.weight

    @property
    def bias(self) -> Tensor | None:
        return getattr(self.base_layer, "bias", None)

    def adapter_parameters(self) -> dict[str, nn.Parameter]:
        """The trainable adapter parameters, by their name relative to this layer."""
        raise NotImplementedError(f"{type(self).__name__} must define adapter_parameters()")

    def delta_weight(self) -> Tensor:
        """``s * B @ A`` in the base weight's layout and at least float32 precision."""
        raise NotImplementedError(f"{type(self).__name__} must define delta_weight()")

    def reset_parameters(self, init: Init = "kaiming") -> None:
        """Initialise the adapter so that its update is zero."""
        raise NotImplementedError(f"{type(self).__name__} must define reset_parameters()")

    def merged_weight(self) -> Tensor:
        """``W + delta`` computed in float32 (or wider), cast to the base dtype; raises if non-finite."""
        weight = self.base_layer.weight
        if self.merged:
            return weight.detach().clone()
        with torch.no_grad():
            merged = weight.to(_compute_dtype(weight.dtype)) + self.delta_weight()
        if not torch.isfinite(merged).all():
            raise RuntimeError(
                f"{type(self).__name__}: merging would write inf or NaN into the base weight "
                f"(shape {tuple(weight.shape)}); the adapter or base weight holds non-finite or overflowing "
                "values. Nothing was merged into this layer."
            )
        return merged.to(weight.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Add the update into the base weight. Merging a merged layer changes nothing."""
        if self.merged:
            return
        self.base_layer.weight.copy_(self.merged_weight())
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the update from the base weight (exact up to one rounding in the compute dtype).

        Raises:
            RuntimeError: If the layer is not merged.
        """
        if not self.merged:
            raise RuntimeError(f"{type(self).__name__}.unmerge(): the layer is not merged; call merge() first.")
        weight = self.base_layer.weight
        restored = weight.to(_compute_dtype(weight.dtype)) - self.delta_weight()
        weight.copy_(restored.to(weight.dtype))
        self.merged = False

    def _add_update(self, result: Tensor, hidden: Tensor, lora_b: Tensor) -> Tensor:
        """``result + s * hidden @ lora_b.T`` as one fused GEMM when dtypes agree.

        ``hidden`` is (..., r), ``lora_b`` is (out, r), ``result`` is (..., out).
        """
        if hidden.dtype == result.dtype == lora_b.dtype:
            out = torch.addmm(
                result.reshape(-1, result.shape[-1]), hidden.reshape(-1, hidden.shape[-1]), lora_b.t(),
                alpha=self.scaling,
            )  # (N, out)
            return out.view(result.shape)
        update = F.linear(hidden.to(lora_b.dtype), lora_b) * self.scaling
        return result + update.to(result.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:.4g}, merged={self.merged}"


class _ABLayer(LoRALayer):
    """A layer whose adapter is two modules, ``lora_A`` (input side) and ``lora_B`` (output side)."""

    lora_A: nn.Module
    lora_B: nn.Module

    def adapter_parameters(self) -> dict[str, nn.Parameter]:
        return {"lora_A.weight": self.lora_A.weight, "lora_B.weight": self.lora_B.weight}

    @torch.no_grad()
    def reset_parameters(self, init: Init = "kaiming") -> None:
        if init == "gaussian":
            nn.init.normal_(self.lora_A.weight, std=1 / self.rank)
        else:
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)


class LoRALinear(_ABLayer):
    """LoRA for ``nn.Linear`` and for ``transformers``' ``Conv1D`` (``fan_in_fan_out=True``: weight is (in, out))."""

    def __init__(
        self,
        base_layer: nn.Module,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        init: Init = "kaiming",
    ) -> None:
        super().__init__(base_layer, rank, alpha, dropout, use_rslora)
        weight = base_layer.weight
        self.fan_in_fan_out = not isinstance(base_layer, nn.Linear)
        in_features, out_features = weight.shape if self.fan_in_fan_out else weight.shape[::-1]
        kwargs = {"device": weight.device, "dtype": _adapter_dtype(weight)}
        self.lora_A = nn.Linear(in_features, rank, bias=False, **kwargs)
        self.lora_B = nn.Linear(rank, out_features, bias=False, **kwargs)
        self.reset_parameters(init)

    def delta_weight(self) -> Tensor:
        dtype = _compute_dtype(self.lora_A.weight.dtype)
        delta = (self.lora_B.weight.to(dtype) @ self.lora_A.weight.to(dtype)) * self.scaling  # (out, in)
        return delta.t() if self.fan_in_fan_out else delta

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)  # (..., out)
        if self.merged:
            return result
        lora_a = self.lora_A.weight  # (r, in)
        hidden = F.linear(self.dropout(x).to(lora_a.dtype), lora_a)  # (..., r)
        return self._add_update(result, hidden, self.lora_B.weight)


class LoRAEmbedding(LoRALayer):
    """LoRA for ``nn.Embedding``: the update looks up rows of ``A^T`` (V, r) and projects them with ``B``."""

    def __init__(
        self,
        base_layer: nn.Embedding,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        init: Init = "kaiming",
    ) -> None:
        # Dropout on token ids has no meaning; PEFT ignores it for embeddings too.
        super().__init__(base_layer, rank, alpha, 0.0, use_rslora)
        num_embeddings, dim = base_layer.weight.shape
        kwargs = {"device": base_layer.weight.device, "dtype": _adapter_dtype(base_layer.weight)}
        self.lora_embedding_A = nn.Parameter(torch.empty(rank, num_embeddings, **kwargs))  # (r, V)
        self.lora_embedding_B = nn.Parameter(torch.empty(dim, rank, **kwargs))  # (d, r)
        self.reset_parameters(init)

    def adapter_parameters(self) -> dict[str, nn.Parameter]:
        return {"lora_embedding_A": self.lora_embedding_A, "lora_embedding_B": self.lora_embedding_B}

    @torch.no_grad()
    def reset_parameters(self, init: Init = "kaiming") -> None:
        # PEFT's convention for embeddings: A = 0, B ~ N(0, 1); the update starts at zero either way.
        nn.init.zeros_(self.lora_embedding_A)
        nn.init.normal_(self.lora_embedding_B)

    def delta_weight(self) -> Tensor:
        dtype = _compute_dtype(self.lora_embedding_A.dtype)
        delta = self.lora_embedding_B.to(dtype) @ self.lora_embedding_A.to(dtype)  # (d, V)
        return delta.t() * self.scaling  # (V, d)

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)  # (..., d)
        if self.merged:
            return result
        hidden = F.embedding(x, self.lora_embedding_A.t(), padding_idx=self.base_layer.padding_idx)  # (..., r)
        return self._add_update(result, hidden, self.lora_embedding_B)


class LoRAConv2d(_ABLayer):
    """LoRA for ``nn.Conv2d`` (groups=1): ``A`` has the base kernel, stride and padding; ``B`` is 1x1."""

    def __init__(
        self,
        base_layer: nn.Conv2d,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        init: Init = "kaiming",
    ) -> None:
        super().__init__(base_layer, rank, alpha, dropout, use_rslora)
        kwargs = {"device": base_layer.weight.device, "dtype": _adapter_dtype(base_layer.weight)}
        self.lora_A = nn.Conv2d(
            base_layer.in_channels, rank, base_layer.kernel_size, base_layer.stride, base_layer.padding,
            base_layer.dilation, bias=False, padding_mode=base_layer.padding_mode, **kwargs,
        )
        self.lora_B = nn.Conv2d(rank, base_layer.out_channels, 1, bias=False, **kwargs)
        self.reset_parameters(init)

    def delta_weight(self) -> Tensor:
        dtype = _compute_dtype(self.lora_A.weight.dtype)
        a = self.lora_A.weight.to(dtype)  # (r, in, kh, kw)
        b = self.lora_B.weight.to(dtype).flatten(1)  # (out, r)
        return (b @ a.flatten(1)).view(b.shape[0], *a.shape[1:]) * self.scaling  # (out, in, kh, kw)

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)  # (B, out, H', W')
        if self.merged:
            return result
        lora_x = self.dropout(x).to(self.lora_A.weight.dtype)
        update = self.lora_B(self.lora_A(lora_x)) * self.scaling  # (B, out, H', W')
        return result + update.to(result.dtype)
