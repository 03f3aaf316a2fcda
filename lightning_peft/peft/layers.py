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

Each layer wraps its base module (``self.base_layer``); nothing is copied, and attributes the layer does not
define (``in_features``, ``padding_idx``, ``kernel_size``, ...) are read from the base. Merging is explicit
(:meth:`LoRALayer.merge` / :meth:`LoRALayer.unmerge`), never a side effect of ``train()``/``eval()``; a state
dict is always taken unmerged (so a merged model's state dict loads anywhere), and loading into a merged
layer re-merges the loaded adapter.

Precision. Adapters of a float16/bfloat16 base are float32, and stay float32 when the module is cast to half
precision afterwards (``model.half()``, ``Trainer(precision="bf16-true")``): only the base changes dtype. Under
``torch.autocast`` the update is computed in the autocast dtype and added to the base output in the base
output's own dtype, so a zero update leaves the base output bit-for-bit unchanged. Merging is computed in
float32; ``unmerge(merge(W))`` restores ``W`` up to one rounding of the weight's dtype (exact only when the
sum is representable, i.e. not in general for bfloat16).
"""

from __future__ import annotations

import math
import sys
import warnings
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


_HALF = (torch.float16, torch.bfloat16)


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
        self._remerge_after_load = False
        self.register_state_dict_post_hook(_unmerged_state)
        self.register_load_state_dict_pre_hook(_unmerge_before_load)
        self.register_load_state_dict_post_hook(_remerge_after_load)

    def __getattr__(self, name: str):
        # nn.Module's lookup (parameters, buffers, submodules) first; then the base layer's attributes, so
        # code that reads ``in_features``, ``padding_idx`` or ``kernel_size`` keeps working.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_layer":
                raise
            return getattr(self.base_layer, name)

    def _apply(self, fn, recurse: bool = True):
        # A cast to half precision (model.half(), Trainer(precision="bf16-true")) reaches the base only: the
        # adapter follows device moves but keeps its dtype, so small updates are not lost.
        probe = fn(torch.zeros((), dtype=torch.float32))
        if not (isinstance(probe, Tensor) and probe.dtype in _HALF) or not recurse:
            return super()._apply(fn, recurse)
        device = probe.device

        def move(t: Tensor) -> Tensor:
            return t.to(device=device)

        for name, child in self.named_children():
            child._apply(fn if name == "base_layer" else move)
        return super()._apply(move, recurse=False)  # the layer's own parameters (LoRAEmbedding)

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

    def _check_trainable_forward(self) -> None:
        # A merged layer's output does not depend on the adapter, so training it ends in autograd's cryptic
        # "element 0 of tensors does not require grad"; say why first. A warning, not an error: a merged model
        # run for inference in train mode with autograd on is legitimate.
        if self.training and torch.is_grad_enabled() and any(
            p.requires_grad for p in self.adapter_parameters().values()
        ):
            warnings.warn(
                f"{type(self).__name__}: the layer is merged, so its adapter gets no gradient from this forward. "
                "To train, call unmerge_lora(model) first; for inference, use model.eval() or torch.no_grad().",
                UserWarning, stacklevel=3,
            )

    def _add_update(self, result: Tensor, hidden: Tensor, lora_b: Tensor) -> Tensor:
        """``result + s * hidden @ lora_b.T``; one fused GEMM when dtypes agree and autocast is off.

        ``hidden`` is (..., r), ``lora_b`` is (out, r), ``result`` is (..., out). Under autocast the fused
        GEMM would round the base output to the autocast dtype, so the update is added separately.
        """
        fuse = hidden.dtype == result.dtype == lora_b.dtype and not torch.is_autocast_enabled(result.device.type)
        if fuse:
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
            self._check_trainable_forward()
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
        # "kaiming" is PEFT's convention for embeddings: A = 0, B ~ N(0, 1). "gaussian" mirrors the linear
        # layers: A ~ N(0, 1/r), B = 0. The update starts at zero either way.
        if init == "gaussian":
            nn.init.normal_(self.lora_embedding_A, std=1 / self.rank)
            nn.init.zeros_(self.lora_embedding_B)
        else:
            nn.init.zeros_(self.lora_embedding_A)
            nn.init.normal_(self.lora_embedding_B)

    def delta_weight(self) -> Tensor:
        dtype = _compute_dtype(self.lora_embedding_A.dtype)
        delta = self.lora_embedding_B.to(dtype) @ self.lora_embedding_A.to(dtype)  # (d, V)
        return delta.t() * self.scaling  # (V, d)

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)  # (..., d)
        if self.merged:
            self._check_trainable_forward()
            return result
        base = self.base_layer
        # (..., r). The base's options apply to the adapter's lookup too, as in PEFT, except ``sparse``: a sparse
        # gradient cannot flow back through the transpose of A (PEFT fails there), and A is small, so it gets a
        # dense gradient, which every optimizer takes.
        hidden = F.embedding(
            x, self.lora_embedding_A.t(), padding_idx=base.padding_idx, max_norm=base.max_norm,
            norm_type=base.norm_type, scale_grad_by_freq=base.scale_grad_by_freq,
        )
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
            self._check_trainable_forward()
            return result
        lora_x = self.dropout(x).to(self.lora_A.weight.dtype)
        update = self.lora_B(self.lora_A(lora_x)) * self.scaling  # (B, out, H', W')
        return result + update.to(result.dtype)


def _unmerged_state(module: LoRALayer, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: a merged layer reports its unmerged base weight, so no state holds ``W + delta``."""
    key = f"{prefix}base_layer.weight"
    if module.merged and key in state_dict:
        weight = module.base_layer.weight
        with torch.no_grad():
            state_dict[key] = (weight.to(_compute_dtype(weight.dtype)) - module.delta_weight()).to(weight.dtype)


def _unmerge_before_load(module: LoRALayer, *args) -> None:
    # Load-state-dict pre-hook: load into the unmerged layout, then merge the loaded adapter again.
    if module.merged:
        module.unmerge()
        module._remerge_after_load = True


def _remerge_after_load(module: LoRALayer, incompatible_keys) -> None:
    if module._remerge_after_load:
        module._remerge_after_load = False
        module.merge()
