"""DoRA: the weight of a LoRA layer split into a trained magnitude and a direction that LoRA updates.

Paper: Liu et al., "DoRA: Weight-Decomposed Low-Rank Adaptation", arXiv:2402.09353. Computed as Hugging Face PEFT
0.21 computes it (``peft/tuners/lora/dora.py``), so the two give the same outputs, gradients and files.

Update rule. For a frozen weight ``W`` (out, in), a LoRA update ``s B A`` and a trained magnitude ``m`` (out,):

```text
n  = ||W + s B A||_row      (out,): the L2 norm of each output row, detached (section 4.3 of the paper)
y  = (m / n) * (W x + s B A x) + b
W' = (m / n)[:, None] * (W + s B A)         the merged weight, computed in float32 (or wider)
```

``m`` starts at ``||W||_row`` (``B = 0``), so a new adapter starts equal to the base. ``n`` gets no gradient: ``m``
and the LoRA factors train, ``W`` stays frozen. With dropout in training, as in PEFT, the base output keeps the
undropped input and the correction uses the dropped one ``x'``: ``y = W x + b + (m/n - 1) W x' + (m/n) s B A x'``.

Shapes: ``lora_magnitude_vector.<adapter>`` (out,), beside ``lora_A.<adapter>.weight`` (r, in) and
``lora_B.<adapter>.weight`` (out, r); in an adapter file ``<path>.lora_magnitude_vector``, as PEFT writes it.
Supported on ``nn.Linear`` and ``transformers``' ``Conv1D`` (weight (in, out): the norm runs over its first
dimension). The base weight's values are read through `dense_weight` only, so a
quantized base is dequantized on the way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._common import dense_weight


def _as_out_in(weight: Tensor, fan_in_fan_out: bool) -> Tensor:
    return weight.t() if fan_in_fan_out else weight  # (out, in)


@torch.no_grad()
def row_norm(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float, fan_in_fan_out: bool) -> Tensor:
    """``||W + s B A||`` of every output row (out,), in the factors' dtype (float32 or wider, autocast or not),
    without gradient.

    ``weight``: the base weight in its layout ((out, in), or (in, out) for ``Conv1D``), dense; ``lora_a`` (r, in),
    ``lora_b`` (out, r).
    """
    dtype = torch.promote_types(lora_a.dtype, torch.float32)
    with torch.autocast(weight.device.type, enabled=False):  # a norm in float32 under autocast too
        combined = torch.addmm(_as_out_in(weight, fan_in_fan_out).to(dtype), lora_b.to(dtype), lora_a.to(dtype),
                               alpha=scaling)  # (out, in)
        return torch.linalg.vector_norm(combined, dim=1)  # (out,)


def dora_forward(layer, x: Tensor, result: Tensor, name: str) -> Tensor:
    """The DoRA layer's output for adapter ``name``: ``result`` (the base layer's output on ``x``) rescaled and
    updated as the module docstring says. ``x`` (..., in), ``result`` (..., out)."""
    spec = layer.specs[name]
    lora_a, lora_b = layer.factors(name)  # (r, in), (out, r)
    magnitude = layer.lora_magnitude_vector[name]  # (out,)
    weight = dense_weight(layer.base_layer.weight, layer.base_layer)
    scale = magnitude / row_norm(weight, lora_a, lora_b, spec.scaling, layer.fan_in_fan_out)  # (out,)
    dropout = layer.lora_dropout[name]
    bias = layer.bias
    if isinstance(dropout, nn.Identity) or not layer.training:
        base = result if bias is None else result - bias  # (..., out): W x
        kept = None if bias is None else bias.to(lora_b.dtype)  # (out,): outside the rescaling
    else:
        x = dropout(x)
        base = F.linear(x.to(weight.dtype), _as_out_in(weight, layer.fan_in_fan_out))  # (..., out): W x'
        kept = (result - base).reshape(-1, result.shape[-1]).to(lora_b.dtype)  # (N, out): W x + b - W x'
    hidden = F.linear(x.to(lora_a.dtype), lora_a).reshape(-1, lora_a.shape[0])  # (N, r)
    base = base.reshape(-1, result.shape[-1]).to(lora_b.dtype)  # (N, out)
    direction = torch.addmm(base, hidden, lora_b.t(), alpha=spec.scaling)  # (N, out): W x + s B A x
    out = direction * scale if kept is None else torch.addcmul(kept, direction, scale)  # (N, out)
    return out.view(result.shape).to(result.dtype)


def merged(weight: Tensor, delta: Tensor, magnitude: Tensor, fan_in_fan_out: bool) -> tuple[Tensor, Tensor]:
    """``(m / n) * (W + delta)`` and ``n``, in the layout and dtype of ``weight`` (dense, float32 or wider) and
    ``delta`` (``s B A`` in the same layout)."""
    dim = 0 if fan_in_fan_out else 1  # the input dimension
    combined = weight + delta
    norm = torch.linalg.vector_norm(combined, dim=dim)  # (out,)
    factor = (magnitude.to(combined.dtype) / norm).unsqueeze(dim)  # (out, 1), or (1, out) for Conv1D
    return factor * combined, norm


def unmerged(weight: Tensor, delta: Tensor, magnitude: Tensor, norm: Tensor, fan_in_fan_out: bool) -> Tensor:
    """``W`` back from a merged weight ``(m / n) * (W + delta)``, given the ``n`` recorded at the merge."""
    dim = 0 if fan_in_fan_out else 1
    factor = (magnitude.to(weight.dtype) / norm.to(weight)).unsqueeze(dim)
    return weight / factor - delta


def supports(module: nn.Module, linear_types: tuple[type, ...]) -> bool:
    """Whether DoRA can adapt ``module`` (a base layer): ``nn.Linear`` or ``Conv1D``."""
    return isinstance(module, linear_types)


def refuse_unsupported(who: str, chosen: list[str], modules: dict[str, nn.Module], linear_types: tuple[type, ...]):
    """Raise if ``use_dora=True`` would reach a layer type DoRA is not implemented for (before anything changes)."""
    bad = [n for n in chosen if not supports(modules[n], linear_types)]
    if not bad:
        return
    kind = type(modules[bad[0]]).__name__
    supported = ", ".join(t.__name__ for t in linear_types)
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
