"""LoRA variants (PEFT's ``LoraVariant``): one object per adapter of a layer (``AdapterSpec.variant``, None for plain
LoRA) that the layer runs instead of plain LoRA; `LoRAVariant` is the protocol, DoRA one class per layer kind.

DoRA: Liu et al., "DoRA: Weight-Decomposed Low-Rank Adaptation", arXiv:2402.09353, computed as PEFT 0.21 computes
it (``peft/tuners/lora/dora.py``), so the two give the same outputs, gradients and files.

Update rule. For a frozen weight ``W``, a LoRA update ``s dW`` (``dW = B A`` in ``W``'s layout) and a trained
magnitude ``m`` of one entry per output feature:

```text
n  = ||W + s dW||           per output feature (the norm over every other dimension), detached (section 4.3)
y  = (m / n) * (W x + s dW x) + b
W' = (m / n) * (W + s dW)   the merged weight, computed in float32 (or wider)
```

``m`` starts at ``n`` (``B = 0``: ``||W||``), so a new adapter starts equal to the base. ``n`` gets no gradient:
``m`` and the LoRA factors train, ``W`` stays frozen. With dropout in training, as in PEFT, the base output keeps the
undropped input and the correction uses the dropped one ``x'``: ``y = W x + b + (m/n - 1) W x' + (m/n) s B A x'``.

| layer | ``W`` | ``n`` over | ``lora_magnitude_vector.<adapter>`` (as PEFT's, so files match) |
| --- | --- | --- | --- |
| ``nn.Linear`` | (out, in) | ``in`` | (out,) |
| ``Conv1D`` (transformers) | (in, out) | ``in`` | (out,) |
| ``nn.Embedding`` | (V, d) | ``V`` (a column) | (d,): the update scales each embedding dimension |
| ``nn.Conv1d/2d/3d`` | (out, in / groups, *kernel) | all but ``out`` | (1, out, 1, ...): it broadcasts over (B, out, ...) |

In a file: ``<path>.lora_magnitude_vector``, as PEFT writes it. The base weight is read through `dense_weight` only,
so a quantized base is dequantized on the way.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._common import compute_dtype, dense_weight

MAGNITUDE = "lora_magnitude_vector"


class LoRAVariant:
    """What a variant changes for one adapter of a LoRA ``layer`` (PEFT's ``LoraVariant``): the layer calls it in
    place of its plain-LoRA code. Its adapters are not routed per sample (`refuse_routing`)."""

    name: ClassVar[str]  # for the layer's repr
    #: Whether `forward` reads the base weight itself (a strategy must gather a sharded one around the layer).
    reads_base_weight: ClassVar[bool] = False

    def create(self, layer, name: str, device: torch.device, dtype: torch.dtype) -> None:
        """Add adapter ``name``'s own parameters to ``layer`` (after its ``A`` and ``B``)."""

    def parameters(self, layer, name: str) -> dict[str, nn.Parameter]:
        """Those parameters by their name relative to ``layer``."""
        return {}

    def delete(self, layer, name: str) -> None:
        """Remove them."""

    def reset(self, layer, name: str) -> None:
        """Initialise them (after ``A`` and ``B``) so that the adapter starts equal to the base."""

    def forward(self, layer, name: str, x: Tensor, result: Tensor) -> Tensor:
        """The layer's output on ``x``, given the base layer's output ``result``."""
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def merged(self, layer, name: str, weight: Tensor) -> Tensor:
        """The merged weight from the dense base ``weight`` (float32 or wider)."""
        raise NotImplementedError(f"{type(self).__name__} must define merged()")

    def unmerged(self, layer, name: str, weight: Tensor) -> Tensor:
        """The base weight back from ``weight``, which holds this adapter merged."""
        raise NotImplementedError(f"{type(self).__name__} must define unmerged()")


class DoRA(LoRAVariant):
    """DoRA for one adapter of a layer. A layer kind says which dimension of its weight is the output (`_out_dim`),
    the magnitude's shape (`_shape`) and ``dW`` as a product of two matrices (`_factors`)."""

    name = "dora"
    reads_base_weight = True

    def __init__(self) -> None:
        self.norm: Tensor | None = None  # n of the unmerged weight, recorded at the merge: unmerging needs it

    def _out_dim(self, layer) -> int:
        return 0

    def _shape(self, layer, name: str) -> tuple[int, ...]:
        raise NotImplementedError(f"{type(self).__name__} must define _shape()")

    def _factors(self, layer, name: str) -> tuple[Tensor, Tensor]:
        """``(P, Q)`` with ``P @ Q = dW`` reshaped to ``(len(P), -1)`` (``W``'s layout, rows first)."""
        raise NotImplementedError(f"{type(self).__name__} must define _factors()")

    def _norm(self, weight: Tensor, layer) -> Tensor:
        """The norm per output feature, over every other dimension of ``weight``, which keeps its dimensions."""
        dims = [d for d in range(weight.dim()) if d != self._out_dim(layer)]
        return torch.linalg.vector_norm(weight, dim=dims, keepdim=True)

    def create(self, layer, name: str, device: torch.device, dtype: torch.dtype) -> None:
        if MAGNITUDE not in layer._modules:
            layer.lora_magnitude_vector = nn.ParameterDict()
        layer.lora_magnitude_vector[name] = nn.Parameter(torch.empty(self._shape(layer, name), device=device,
                                                                     dtype=dtype))

    def parameters(self, layer, name: str) -> dict[str, nn.Parameter]:
        return {f"{MAGNITUDE}.{name}": layer.lora_magnitude_vector[name]}

    def delete(self, layer, name: str) -> None:
        del layer.lora_magnitude_vector[name]

    @torch.no_grad()
    def reset(self, layer, name: str) -> None:
        magnitude = layer.lora_magnitude_vector[name]
        magnitude.copy_(self.weight_norm(layer, name).view(magnitude.shape))

    @torch.no_grad()
    def weight_norm(self, layer, name: str) -> Tensor:
        """``n = ||W + s dW||`` (one fused ``addmm``, read every forward) in the factors' dtype (float32 or wider,
        autocast or not), without gradient; it keeps ``W``'s dimensions."""
        weight = dense_weight(layer.base_layer.weight, layer.base_layer)
        p, q = self._factors(layer, name)
        dtype = compute_dtype(p.dtype)
        with torch.autocast(weight.device.type, enabled=False):  # a norm in float32 under autocast too
            combined = torch.addmm(weight.reshape(p.shape[0], -1).to(dtype), p.to(dtype), q.to(dtype),
                                   alpha=layer.specs[name].scaling)
            return self._norm(combined.view(weight.shape), layer)

    def _factor(self, layer, name: str, norm: Tensor) -> Tensor:
        """``m / n`` shaped to scale the weight."""
        return layer.lora_magnitude_vector[name].to(norm.dtype).reshape(norm.shape) / norm

    def merged(self, layer, name: str, weight: Tensor) -> Tensor:
        combined = weight + layer.delta_weight(name)
        self.norm = self._norm(combined, layer)
        return self._factor(layer, name, self.norm) * combined

    def unmerged(self, layer, name: str, weight: Tensor) -> Tensor:
        return weight / self._factor(layer, name, self.norm.to(weight)) - layer.delta_weight(name)


class LinearDoRA(DoRA):
    """DoRA on ``nn.Linear`` and ``transformers``' ``Conv1D`` (weight (in, out): ``n`` runs over its first dimension).
    """

    def _out_dim(self, layer) -> int:
        return int(layer.fan_in_fan_out)

    def _shape(self, layer, name: str) -> tuple[int, ...]:
        return (layer.lora_B[name].weight.shape[0],)  # (out,): a packed 4-bit base weight's shape is not (out, in)

    def _factors(self, layer, name: str) -> tuple[Tensor, Tensor]:
        a, b = layer.factors(name)  # (r, in), (out, r)
        return (a.t(), b.t()) if layer.fan_in_fan_out else (b, a)

    def forward(self, layer, name: str, x: Tensor, result: Tensor) -> Tensor:
        """``x`` (..., in), ``result`` (..., out)."""
        spec = layer.specs[name]
        lora_a, lora_b = layer.factors(name)  # (r, in), (out, r)
        magnitude = layer.lora_magnitude_vector[name]
        scale = magnitude / self.weight_norm(layer, name).view(magnitude.shape)  # (out,)
        dropout = layer.lora_dropout[name]
        bias = layer.bias
        if isinstance(dropout, nn.Identity) or not layer.training:
            base = result if bias is None else result - bias  # (..., out): W x
            kept = None if bias is None else bias.to(lora_b.dtype)  # (out,): outside the rescaling
        else:
            x = dropout(x)
            weight = dense_weight(layer.base_layer.weight, layer.base_layer)
            base = F.linear(x.to(weight.dtype), weight.t() if layer.fan_in_fan_out else weight)  # (..., out): W x'
            kept = (result - base).reshape(-1, result.shape[-1]).to(lora_b.dtype)  # (N, out): W x + b - W x'
        hidden = F.linear(x.to(lora_a.dtype), lora_a).reshape(-1, lora_a.shape[0])  # (N, r)
        base = base.reshape(-1, result.shape[-1]).to(lora_b.dtype)  # (N, out)
        direction = torch.addmm(base, hidden, lora_b.t(), alpha=spec.scaling)  # (N, out): W x + s B A x
        out = direction * scale if kept is None else torch.addcmul(kept, direction, scale)  # (N, out)
        return out.view(result.shape).to(result.dtype)


class EmbeddingDoRA(DoRA):
    """DoRA on ``nn.Embedding`` (weight (V, d)): ``n`` is the norm of each column, over the vocabulary, and
    ``m / n`` scales the looked-up rows: ``y = (m / n) * (W[x] + s (A^T)[x] B^T)``. No dropout, as for its LoRA."""

    def _out_dim(self, layer) -> int:
        return 1

    def _shape(self, layer, name: str) -> tuple[int, ...]:
        return (layer.base_layer.weight.shape[1],)  # (d,)

    def _factors(self, layer, name: str) -> tuple[Tensor, Tensor]:
        a, b = layer.factors(name)  # (r, V), (d, r)
        return a.t(), b.t()

    def forward(self, layer, name: str, x: Tensor, result: Tensor) -> Tensor:
        """``x`` (...) ids, ``result`` (..., d)."""
        lora_a, lora_b = layer.factors(name)  # (r, V), (d, r)
        magnitude = layer.lora_magnitude_vector[name]  # (d,)
        scale = magnitude / self.weight_norm(layer, name).view(magnitude.shape)  # (d,)
        hidden = layer._lookup(x, lora_a.t()).reshape(-1, lora_a.shape[0])  # (N, r)
        rows = result.reshape(-1, result.shape[-1]).to(lora_b.dtype)  # (N, d): W[x]
        out = torch.addmm(rows, hidden, lora_b.t(), alpha=layer.specs[name].scaling) * scale  # (N, d)
        return out.view(result.shape).to(result.dtype)


class ConvDoRA(DoRA):
    """DoRA on a convolution of any number of spatial dimensions (``nn.Conv1d``, ``Conv2d``, ``Conv3d``, grouped
    too): ``n`` per output channel over (in / groups, *kernel).

    The norm in the forward reads ``dW`` as PEFT does, ``B.reshape(-1, r) @ A.reshape(r, -1)`` in ``W``'s shape: the
    true ``B A`` for groups=1 (and what PEFT computes for a grouped convolution).
    """

    def _shape(self, layer, name: str) -> tuple[int, ...]:
        weight = layer.base_layer.weight  # (out, in / groups, *kernel)
        return (1, weight.shape[0], *[1] * (weight.dim() - 2))

    def _factors(self, layer, name: str) -> tuple[Tensor, Tensor]:
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight  # (r, in, *kernel), (out, r / groups, 1, ...)
        return b.reshape(-1, a.shape[0]), a.reshape(a.shape[0], -1)

    def forward(self, layer, name: str, x: Tensor, result: Tensor) -> Tensor:
        """``x`` (B, in, *spatial), ``result`` (B, out, *spatial')."""
        lora_a, lora_b, base = layer.lora_A[name], layer.lora_B[name], layer.base_layer
        magnitude = layer.lora_magnitude_vector[name]  # (1, out, 1, ...)
        scale = magnitude / self.weight_norm(layer, name).view(magnitude.shape)  # (1, out, 1, ...)
        dropout = layer.lora_dropout[name]
        if isinstance(dropout, nn.Identity) or not layer.training:
            plain = result if base.bias is None else result - base.bias.view(magnitude.shape)  # W * x
        else:
            x = dropout(x)
            weight = dense_weight(base.weight, base)
            plain = base._conv_forward(x.to(weight.dtype), weight, None)  # W * x', in the base's padding mode
        update = lora_b(lora_a(x.to(lora_a.weight.dtype)))  # (B, out, *spatial'): B A x
        correction = (scale - 1) * plain.to(scale.dtype) + scale * update * layer.specs[name].scaling
        return result + correction.to(result.dtype)


def refuse_unsupported(who: str, chosen: list[str], modules: dict[str, nn.Module], types: tuple[type, ...]) -> None:
    """Raise if ``use_dora=True`` would reach a layer type DoRA is not implemented for (before anything changes)."""
    bad = [n for n in chosen if not isinstance(modules[n], types)]
    if not bad:
        return
    kind = type(modules[bad[0]]).__name__
    supported = ", ".join(t.__name__ for t in types)
    raise TypeError(f"{who}(use_dora=True): {bad[0]!r} is of type {kind}; DoRA supports {supported} layers only. "
                    f"Leave the {kind} layers out of target_modules (or exclude_modules=[{bad[0]!r}]), or set "
                    "use_dora=False.")


def refuse_routing(dora_names: list[str]) -> None:
    """Per-sample routing ([`route_adapters`][lightning_peft.peft.route_adapters], ``MultiLoRA``) is not implemented for
    DoRA adapters (nor is it in PEFT): raise, naming them, if any is routed."""
    if dora_names:
        raise ValueError(
            f"route_adapters: adapter {dora_names[0]!r} is a DoRA adapter (use_dora=True); per-sample routing of DoRA "
            "adapters is not supported (each would need its own weight norm per sample). Route LoRA adapters only, "
            "or run one DoRA adapter for the whole batch with set_adapter(model, name)."
        )
